"""What a probed type is under its domains: its base type, an array's element, a composite."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg
from pglast import ast
from pglast.enums import LimitOption, SetOperation

from dp_core.errors import FeatureNotSupported
from dp_core.probes import order_probe_sql
from dp_core.query import AnalyzedQuery, TypeMix
from server.dp_query.key_types import FIRST_USER_OID

_BASES = """
WITH RECURSIVE d(root, cur) AS (
    SELECT o, o FROM unnest($1::oid[]) AS o
  UNION ALL
    SELECT d.root, t.typbasetype FROM d JOIN pg_catalog.pg_type t ON t.oid = d.cur
    WHERE t.typtype = 'd')
SELECT d.root, b.typname, b.typtype::text AS typtype, b.typcategory = 'A' AND b.typelem <> 0 AS is_array,
       b.typelem
FROM d JOIN pg_catalog.pg_type b ON b.oid = d.cur WHERE b.typtype <> 'd'"""
"""Each type (oid) under its domains (a domain over a domain too): its base's name, typtype,
whether it is an array, and its element type."""

TEXT_OUTPUT_BASES = frozenset({
    "text", "varchar", "bpchar", "name", "char", "json", "int2", "int4", "int8", "float4",
    "float8", "numeric", "bool", "date", "time", "timetz", "timestamp", "timestamptz",
    "interval", "uuid", "inet", "cidr", "macaddr", "macaddr8", "money", "oid", "xml",
    "int4range", "int8range", "numrange", "daterange", "tsrange", "tstzrange",
})
"""Base types whose text is at most about their size (a text's own, json's and xml's as
stored) or small (numbers, dates, addresses, the built-in ranges of them): a value's text
stays within Postgres's 1 GB limit. Not bytea (twice its size), bit and varbit (8 times: a
user's varbit of 135 MB made 1.08 GB of text, an error after the charge; red team, session
32), jsonb (escapes, up to 6 times), nor arrays, composites and the rest, whose text can be
several times their size."""


@dataclass(frozen=True)
class TypeShape:
    """A type under its domains."""

    name: str
    """Its base type's name; of an array, its element's (under its domains): Postgres converts
    an array by converting each element."""
    kind: str
    """That type's typtype: b (base), c (composite), e (enum), r (range), m (multirange), p
    (pseudo: `record`)."""
    array: bool

    @property
    def container(self) -> bool:
        """Whether Postgres looks up its parts' equality and order only when a row reaches a
        comparison of it (an array's, a composite's, a record's)."""
        return self.array or self.kind in ("c", "p")

    @property
    def text_is_bounded(self) -> bool:
        """Whether its text stays near its size (TEXT_OUTPUT_BASES, the built-in ranges,
        enums; not a range over texts, whose bounds' quotes double in it)."""
        return not self.array and (self.kind == "e" or (self.kind in ("b", "r") and
                                                        self.name in TEXT_OUTPUT_BASES))


async def type_shapes(conn: Any, oids: Iterable[int]) -> dict[int, TypeShape]:
    """Each type of `oids` as `TypeShape`: one catalog read, two where arrays are among them."""
    wanted = sorted(set(oids))
    if not wanted:
        return {}
    rows = {int(r["root"]): r for r in await conn.fetch(_BASES, wanted)}
    elements = {int(r["typelem"]) for r in rows.values() if r["is_array"]}
    under = {int(r["root"]): r for r in await conn.fetch(_BASES, sorted(elements))} \
        if elements else {}
    out = {}
    for oid, r in rows.items():
        if r["is_array"]:
            e = under[int(r["typelem"])]
            out[oid] = TypeShape(str(e["typname"]), str(e["typtype"]), True)
        else:
            out[oid] = TypeShape(str(r["typname"]), str(r["typtype"]), False)
    return out


def check_text_outputs(texts: Iterable[tuple[str, TypeShape]]) -> None:
    """Refuse (0A000, before any charge) a value whose text the query makes (a cast to text,
    concat(), COUNT(DISTINCT)'s digest) where its type's text can be several times its size:
    `texts` pairs what the query wrote (each argument of one concat() the same) with the
    value's type."""
    for text, shape in texts:
        if not shape.text_is_bounded:
            what = f"{shape.name}[]" if shape.array else shape.name
            raise FeatureNotSupported(
                f"not allowed in a DP query (the text of a {what} value: it can be several "
                f"times the value's size, past Postgres's 1 GB limit on one value): {text}",
                hint="cast to text only texts, numbers, dates and times, addresses, enums")


async def probed_shapes(attrs: Iterable[Any], conn: Any) -> dict[str, TypeShape]:
    """The shape of each probed column's type (asyncpg's attributes), by column name: built-in
    base types as they are, the others (arrays, domains, composites, ranges, extensions')
    from the catalog."""
    attrs = list(attrs)
    ask = {a.type.oid for a in attrs if (a.type.kind != "scalar" or a.type.oid >= FIRST_USER_OID)}
    found = await type_shapes(conn, ask)
    out = {}
    for a in attrs:
        if a.type.oid in found:
            out[a.name] = found[a.type.oid]
        else:
            out[a.name] = TypeShape(a.type.name, "p" if a.type.name == "record" else "b", False)
    return out


async def check_comparisons(query: AnalyzedQuery, shapes: Mapping[str, TypeShape],
                            conn: Any) -> None:
    """Refuse (before any charge) comparisons of arrays and composites whose parts Postgres
    cannot order: it looks their equality and order up when a row first reaches them (`ja =
    ja` of a json[], `cp = cp` of a composite with a json field: 42883 only where a row had
    one; red team, session 32). Which it can, Postgres says for each such value when it
    plans `ORDER BY` of it (`order_probe_sql`); a `record` (a subquery's ROW()) is refused."""
    operands = []
    for i, mix in enumerate(query.mixes):
        if mix.kind != "compare" and mix.text != "GREATEST or LEAST" \
                and not mix.text.startswith("USING ("):
            continue  # (CASE and COALESCE choose a value, comparing none)
        for j, op in enumerate(mix.operands):
            shape = shapes[f"m{i}_{j}"]
            if not shape.container:
                continue
            if shape.kind == "p":
                raise FeatureNotSupported(
                    f"not allowed in a DP query (a comparison of {shape.name} values, whose "
                    f"parts Postgres compares only as rows reach it): {mix.text}")
            operands.append((op, mix.scope if mix.scopes is None else mix.scopes[j]))
    if operands:
        try:
            await conn.prepare(order_probe_sql(query, operands))
        except asyncpg.PostgresError as e:
            raise FeatureNotSupported(
                "not allowed in a DP query (a comparison of arrays or composites whose parts "
                f"Postgres cannot order: {e})") from None


COLLATABLE_BASES = frozenset({"text", "varchar", "bpchar", "name", "citext"})
"""Base types with a collation (an array's elements' too)."""


async def check_collations(query: AnalyzedQuery, shapes: Mapping[str, TypeShape],
                           conn: Any) -> None:
    """Refuse (before any charge) texts of two collations brought together where Postgres
    would have to choose one: a comparison, GREATEST, CASE or COALESCE, `||` or concat()
    of a "C" column and a "POSIX" (or ICU) one, or of a subquery's text that a literal's
    COLLATE "C" made "C". Postgres plans them, and fails only when a row reaches the
    comparison or a function that needs the collation ("could not determine which collation
    to use", red team, session 33: XX000 after the charge only where one user's row did).
    It refuses `ORDER BY` of a value whose collation it cannot determine when it parses it,
    so each such mix is prepared as `ORDER BY CASE WHEN false THEN a ... ELSE b END`."""
    probes = [_collation_probe(i, mix, shapes) for i, mix in enumerate(query.mixes)]
    found = [p for p in probes if p is not None]
    if not found:
        return
    try:
        await conn.prepare(order_probe_sql(query, [probe for probe, _ in found]))
    except asyncpg.PostgresError as e:  # (any error: what Postgres cannot plan is refused)
        raise _mixed_collations(e, found) from None


def _collation_probe(i: int, mix: TypeMix, shapes: Mapping[str, TypeShape]
                     ) -> tuple[tuple[Any, Any], TypeMix] | None:
    """((the CASE of the mix's texts that are not literals, where to read it), the mix), or
    None where fewer than two are texts."""
    texts = [j for j in range(len(mix.operands)) if mix.constant[j] is not True
             and shapes[f"m{i}_{j}"].name in COLLATABLE_BASES]
    if len(texts) < 2:
        return None
    if mix.scopes is not None:  # (a USING column: each side's, read in a subquery of its own)
        sides = [ast.RangeSubselect(lateral=False, subquery=ast.SelectStmt(
                     targetList=(ast.ResTarget(val=copy.deepcopy(mix.operands[j])),),
                     fromClause=copy.deepcopy(mix.scopes[j].fromClause or ()),
                     op=SetOperation.SETOP_NONE, limitOption=LimitOption.LIMIT_OPTION_DEFAULT),
                     alias=ast.Alias(aliasname=f"dp_side{j}")) for j in texts]
        ref: Any = mix.operands[texts[0]]
        column = str(ref.fields[-1].sval)
        values: list[Any] = [ast.ColumnRef(fields=(ast.String(sval=f"dp_side{j}"),
                                                   ast.String(sval=column))) for j in texts]
        scope: Any = ast.SelectStmt(fromClause=tuple(sides), op=SetOperation.SETOP_NONE,
                                    limitOption=LimitOption.LIMIT_OPTION_DEFAULT)
    else:
        values, scope = [copy.deepcopy(mix.operands[j]) for j in texts], mix.scope
    case = ast.CaseExpr(args=tuple(ast.CaseWhen(expr=ast.A_Const(val=ast.Boolean(boolval=False)),
                                                result=v) for v in values[:-1]),
                        defresult=values[-1])
    return (case, scope), mix


def _mixed_collations(e: asyncpg.PostgresError, found: list[Any]) -> FeatureNotSupported:
    what = ", ".join(sorted({mix.text for _, mix in found}))
    return FeatureNotSupported(
        f"not allowed in a DP query (texts brought together whose one collation Postgres "
        f"could not settle when it planned them, only when a row reaches them: {e}; in one "
        f"of: {what})",
        hint="compare and combine texts of one collation (a column's with literals, or with "
             "columns of the same collation)")
