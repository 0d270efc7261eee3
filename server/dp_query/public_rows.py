"""The public tables' unique columns and sizes a DP query's joins are bounded by (dp_core.fanout)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pglast import ast

from dp_core.errors import ProgramLimitExceeded, UndefinedTable
from dp_core.fanout import (
    IN_COMPARISONS_PER_ROW,
    PUBLIC_ROWS_PER_ROW,
    SUBLINK_READ_ROWS,
    check_row_bound,
    counted,
    row_bound,
    selected_source,
)
from dp_core.probes import standalone_subqueries, sublink_read_counts
from dp_core.query import AnalyzedQuery, Relation, TieKey
from dp_core.sql_parse import parse_sql
from dp_core.sqlnodes import func_name, walk_nodes
from server.backend_setup import quote_ident

_UNIQUE_COLUMNS = (
    "SELECT a.attname FROM pg_catalog.pg_index i JOIN pg_catalog.pg_attribute a "
    "ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] "
    "JOIN pg_catalog.pg_class c ON c.oid = i.indrelid "
    "JOIN pg_catalog.pg_opclass o ON o.oid = i.indclass[0] "
    "WHERE i.indrelid = pg_catalog.to_regclass($1) AND i.indisunique AND i.indisvalid "
    "AND i.indnkeyatts = 1 AND i.indpred IS NULL AND i.indexprs IS NULL "
    "AND i.indcollation[0] = a.attcollation AND o.opcdefault "
    "AND (c.relkind = 'p' OR NOT c.relhassubclass)")
"""The columns of a table that a valid unique index (a PRIMARY KEY, UNIQUE) covers alone,
with no predicate and no expression, under the column's own collation and its type's
default operator class (the equality `=` means): one row per value (not of a table with
inheritance children, whose rows its index does not cover; a partitioned table's unique
index covers its partitions)."""
_UNIQUE_SETS = (
    "SELECT array_agg(a.attname::text ORDER BY k.n) FROM pg_catalog.pg_index i "
    "CROSS JOIN LATERAL unnest(i.indkey::int2[], i.indclass::oid[], i.indcollation::oid[]) "
    "WITH ORDINALITY AS k(attnum, opclass, coll, n) "
    "JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
    "JOIN pg_catalog.pg_opclass o ON o.oid = k.opclass "
    "JOIN pg_catalog.pg_class c ON c.oid = i.indrelid "
    "WHERE i.indrelid = pg_catalog.to_regclass($1) AND i.indisunique AND i.indisvalid "
    "AND i.indnkeyatts > 1 AND k.n <= i.indnkeyatts AND i.indpred IS NULL "
    "AND i.indexprs IS NULL AND (c.relkind = 'p' OR NOT c.relhassubclass) "
    "GROUP BY i.indexrelid HAVING bool_and(o.opcdefault AND k.coll = a.attcollation)")
"""The column sets of a table's unique indexes of several columns, as `_UNIQUE_COLUMNS`
takes single ones (a composite PRIMARY KEY): one row per combination of values."""
_COLUMN_TYPE = ("SELECT a.atttypid::int8, a.attcollation::int8 FROM pg_catalog.pg_attribute a "
                "WHERE a.attrelid = pg_catalog.to_regclass($1) AND a.attname = $2 "
                "AND a.attnum > 0 AND NOT a.attisdropped")
_CAST_TYPE = ("SELECT t.oid::int8 FROM pg_catalog.pg_type t "
              "WHERE t.oid = pg_catalog.to_regtype($1) AND t.typcollation = 0")
_EXACT = {20: 0, 21: 0, 23: 0, 1700: 0, 25: 1, 1043: 1, 700: 2, 701: 2}
"""Types whose equality across one another compares exactly what each holds (a cast of one to
the other that keeps distinct values distinct): int2, int4, int8 and numeric; text and
varchar (under one collation); float4 and float8. Not char(n) against text (padding), nor a
float against an integer or numeric (rounding)."""
_VIEW = ("SELECT pg_catalog.pg_get_viewdef(c.oid) FROM pg_catalog.pg_class c "
         "WHERE c.oid = pg_catalog.to_regclass($1) AND c.relkind = 'v'")
_RETURNS_SETS = ("SELECT coalesce(bool_or(p.proretset OR p.provolatile = 'v'), false) "
                 "FROM pg_catalog.pg_proc p WHERE p.proname = ANY($1::text[])")
"""Whether a function of one of the names returns sets (repeating a row) or is volatile
(Postgres then keeps the view a subquery of its own, whose rows a nested loop may scan
for each protected row, rather than inline it over its table's index)."""
_VIEW_DEPTH = 3
"""Views over views are followed this deep to a table's unique columns."""


def _qualified(relation: Relation) -> str:
    schema, name = relation
    return quote_ident(name) if schema is None else f"{quote_ident(schema)}.{quote_ident(name)}"


async def unique_columns(relation: Relation, conn: Any, depth: int = 0) -> set[str]:
    """The columns of `relation` with one row per value: a table's that a unique index covers
    alone; a view's that are such columns of the one table (or view) it selects from as they
    are (no join, grouping, set operation or set-returning function: each of its rows is one
    of that table's; no volatile function: Postgres inlines it, and joins it on that table's
    index or a hash)."""
    qualified = _qualified(relation)
    found = {str(r[0]) for r in await conn.fetch(_UNIQUE_COLUMNS, qualified)}
    definition = await conn.fetchval(_VIEW, qualified)
    if definition is None or depth >= _VIEW_DEPTH:
        return found
    try:
        (raw,) = parse_sql(definition)
    except Exception:  # (a definition pglast cannot read: no column is taken for unique)
        return found
    stmt = raw.stmt
    items = tuple(stmt.fromClause or ()) if isinstance(stmt, ast.SelectStmt) else ()
    if not isinstance(stmt, ast.SelectStmt) or stmt.op or stmt.groupClause \
            or stmt.distinctClause or stmt.withClause or stmt.valuesLists \
            or len(items) != 1 or not isinstance(items[0], ast.RangeVar):
        return found
    calls = [func_name(n) for n in walk_nodes(stmt) if isinstance(n, ast.FuncCall)]
    if calls and await conn.fetchval(_RETURNS_SETS, calls):
        return found
    source = selected_source(stmt, {})
    if source.relation is None:
        return found
    below = await unique_columns(source.relation, conn, depth + 1)
    return found | {out for out in source.order if source.column(out) in below}


async def check_public_rows(query: AnalyzedQuery, conn: Any) -> float:
    """54000 (before any charge) where the query's joins may give one protected row more than
    PUBLIC_ROWS_PER_ROW public rows (`dp_core.fanout`): each public table's unique columns
    from the catalog, and the rows of those it is not tied to on one, and of each IN
    subquery (uncorrelated: checked before), counted up to the limit (public data the
    analysts may read; nothing of a protected table is read). Returns the joined rows' bound:
    the most public rows one protected row is joined with (1 where every public item is tied
    on a unique column)."""
    tables = {item.source.relation for item in query.public_items
              if item.source.relation is not None}
    unique: dict[Relation, set[str]] = {}
    sets: dict[Relation, list[frozenset[str]]] = {}
    rows: dict[Relation, int] = {}
    for relation in tables:
        if await conn.fetchval("SELECT pg_catalog.to_regclass($1) IS NULL", _qualified(relation)):
            raise UndefinedTable(f'relation "{relation[1]}" does not exist')
        unique[relation] = await unique_columns(relation, conn)
        sets[relation] = [frozenset(r[0]) for r in
                          await conn.fetch(_UNIQUE_SETS, _qualified(relation))]

    types: dict[tuple[Relation, str], tuple[int, int] | None] = {}
    for item in query.public_items:
        source = item.source
        for key in item.keys:
            column = source.column(key.column)
            keyed = set().union(unique.get(source.relation, set()),
                                *sets.get(source.relation, ())) if source.relation else set()
            if source.relation is None or column is None or \
                    (key.partner is None and key.cast is None) or column not in keyed:
                continue
            for place in ((source.relation, column), key.partner):
                if place is None:
                    continue
                if place not in types:
                    row = await conn.fetchrow(_COLUMN_TYPE, _qualified(place[0]), place[1])
                    types[place] = None if row is None else (int(row[0]), int(row[1]))

    casts: dict[str, tuple[int, int] | None] = {}
    for cast in {k.cast for item in query.public_items for k in item.keys if k.cast}:
        row = await conn.fetchrow(_CAST_TYPE, cast)
        casts[cast] = None if row is None else (int(row[0]), 0)

    def is_unique(relation: Relation, column: str, key: TieKey) -> bool:
        """One row per value of the column under the equality the tie compares it with: a
        literal takes the column's type; a column must have its type and collation, or an
        exactly comparable one (`_EXACT`), not one that casts it to a type where distinct
        values compare equal (varchar against char, bigint against float8); so must an
        expression cast to a type that has no collation (`CAST(v.ts AS date)`)."""
        return column in unique[relation] and exact(relation, column, key)

    def on_composite(relation: Relation, tied: Sequence[tuple[str, TieKey]]) -> bool:
        """All the columns of a unique index of several tied, each as `is_unique` asks."""
        cols = {column for column, key in tied if exact(relation, column, key)}
        return any(s <= cols for s in sets[relation])

    def exact(relation: Relation, column: str, key: TieKey) -> bool:
        if key.literal:
            return True
        mine = types.get((relation, column))
        theirs = casts.get(key.cast) if key.cast is not None else \
            None if key.partner is None else types.get(key.partner)
        return mine is not None and theirs is not None and (mine == theirs or (
            mine[1] == theirs[1] and _EXACT.get(mine[0], -1) == _EXACT.get(theirs[0], -2)))

    for relation in counted(query.public_items, is_unique, on_composite) - rows.keys():
        rows[relation] = int(await conn.fetchval(
            f"SELECT count(*) FROM (SELECT FROM {_qualified(relation)} "
            f"LIMIT {PUBLIC_ROWS_PER_ROW + 1}) s"))
    for sql in sublink_read_counts(query, SUBLINK_READ_ROWS + 1):
        if int(await conn.fetchval(sql)) > SUBLINK_READ_ROWS:
            raise ProgramLimitExceeded(
                f"an IN or EXISTS subquery of this DP query reads a table of more than "
                f"{SUBLINK_READ_ROWS} rows (it runs only where a row reaches it: its time "
                f"could tell one user's rows)", hint="join the table on its key instead, or "
                "list the values")
    in_lists = [int(await conn.fetchval(sql)) for sql in
                standalone_subqueries(query, in_lists=True,
                                      limit=PUBLIC_ROWS_PER_ROW * IN_COMPARISONS_PER_ROW + 1)]
    check_row_bound(query.public_items, is_unique, rows.__getitem__, in_lists, on_composite)
    return row_bound(query.public_items, is_unique, rows.__getitem__, (), on_composite)
