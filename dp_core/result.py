"""The result query: released rows as SQL that the session's own backend answers with (so
that the client sees Postgres's types and formats), with the post-processing written around a
DP subquery; and the COPY and SET TRANSACTION forms of it."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from pglast import ast
from pglast.enums import (
    VariableSetKind,
)
from pglast.stream import RawStream
from pglast.visitors import Visitor

from dp_core.errors import FeatureNotSupported, InternalError
from dp_core.sql_parse import parse_sql

TypeRef = tuple[str, str]
"""(schema, type name) of a result column, e.g. ("pg_catalog", "int8")."""


_COPY_PLACEHOLDER = "COPY (SELECT 1)"


def copy_result(copy_sql: str, query: str) -> str:
    """`COPY (query) TO STDOUT` with the options of the client's `copy_sql` (a COPY of a DP
    query or local function to the client, its DP clause blanked)."""
    stmt = parse_sql(copy_sql)[0].stmt
    assert isinstance(stmt, ast.CopyStmt) and stmt.filename is None and not stmt.is_program
    stmt.query = parse_sql("SELECT 1")[0].stmt
    text = RawStream()(stmt)
    assert text.startswith(_COPY_PLACEHOLDER), text
    return f"COPY ({query}){text[len(_COPY_PLACEHOLDER):]}"


def set_transaction_sql(begin_sql: str) -> str:
    """`SET TRANSACTION` with the modes of `begin_sql` (BEGIN or START TRANSACTION with
    ISOLATION LEVEL, READ ONLY...): what such a BEGIN does inside a block already open."""
    stmt = parse_sql(begin_sql)[0].stmt
    assert isinstance(stmt, ast.TransactionStmt) and stmt.options
    return RawStream()(ast.VariableSetStmt(kind=VariableSetKind.VAR_SET_MULTI,
                                           name="TRANSACTION", args=stmt.options))


def quoted(text: str) -> str:
    """A string constant as pglast prints one (the proxy keeps standard_conforming_strings on
    in every session it relays)."""
    return "'" + text.replace("'", "''") + "'"


def _value_sql(value: str | int | float | None, t: TypeRef) -> str:
    """A released value as a constant of its column's type, for the result's VALUES list
    (printed directly: building and printing an AST for each value took most of an answer's
    Python time for a few hundred groups)."""
    schema, name = t
    array = "[]" if name.endswith("[]") else ""  # (asyncpg names a user type's array so)
    typ = ".".join('"' + part.replace('"', '""') + '"'
                   for part in (schema, name[:len(name) - len(array)])) + array
    if value is None:
        return f"CAST(NULL AS {typ})"
    if isinstance(value, float) and not isinstance(value, bool):
        if value != value or value in (float("inf"), float("-inf")):
            raise InternalError()
        return f"CAST({quoted(repr(value))} AS {typ})"
    return f"CAST({quoted(str(value))} AS {typ})"


def _result_ref(i: int) -> Any:
    return ast.ColumnRef(fields=(ast.String(sval=f"dp_c{i}"),))


class _ToResultColumns(Visitor):
    """Rewrites expressions over released values (select-list expressions, HAVING, ORDER BY)
    into references to result columns: each DP aggregate or GROUP BY expression that a column
    answers (`sources`). Names are read before (dp_core.names): one left here is refused, never
    taken for an output column's."""

    def __init__(self, sources: list[Any]) -> None:
        super().__init__()
        self.sources = sources

    def visit(self, ancestors: Any, node: Any) -> Any:
        for i, src in enumerate(self.sources):
            if node == src:
                return _result_ref(i)
        if isinstance(node, (ast.ColumnRef, ast.SubLink)):
            name = ".".join(str(getattr(f, "sval", "*")) for f in node.fields) \
                if isinstance(node, ast.ColumnRef) else "a subquery"
            raise FeatureNotSupported(
                "not allowed in a DP query (expressions over its answer read only GROUP BY keys "
                f"and DP aggregates): {name}")
        return None


def result_sql(names: list[str], types: list[TypeRef],
               rows: Sequence[Sequence[str | int | float | None]], *,
               sources: list[Any] | None = None, having: Any = None,
               order_by: Sequence[Any] = (), limit: Any = None, offset: Any = None,
               visible: Sequence[tuple[str, int | Any]] | None = None,
               outer: ast.SelectStmt | None = None) -> str:
    """A query that returns `rows` with the given column names and types.

    HAVING and ORDER BY, written over what the columns answer (`sources`: DP aggregates and
    GROUP BY expressions; dp_core.names has replaced their names) and output positions, are
    applied to the (already noisy) values by Postgres, which also encodes the result in
    whatever format the client asked for. With `outer` (a query whose one FROM item is a
    subquery left empty, maybe under more such queries: `dp_core.analysis.post_processed`),
    that query is run over these rows, in the empty subquery's place.
    """
    import secrets

    cols = tuple(ast.String(sval=f"dp_c{i}") for i in range(len(names)))
    empty = not rows
    # the VALUES list is printed directly and put in place of a one-value list that nothing
    # else in the statement can print as (a fresh mark)
    mark = f"dp_values_{secrets.token_hex(8)}"
    inner = ast.SelectStmt(valuesLists=((ast.A_Const(val=ast.String(sval=mark)),),))
    values = ", ".join(
        "(" + ", ".join(_value_sql(v, t) for v, t in zip(row, types, strict=True)) + ")"
        for row in rows) or "(" + ", ".join(_value_sql(None, t) for t in types) + ")"
    mapper = _ToResultColumns(list(sources or []))
    targets = []
    for name, what in visible or [(n, i) for i, n in enumerate(names)]:
        if isinstance(what, int):
            targets.append(ast.ResTarget(name=name, val=_result_ref(what)))
        else:  # an expression over released values (post-processing)
            holder = ast.ResTarget(name=name, val=copy.deepcopy(what))
            mapper(holder)
            targets.append(holder)
    stmt = ast.SelectStmt(
        targetList=tuple(targets),
        fromClause=(ast.RangeSubselect(subquery=inner,
                                       alias=ast.Alias(aliasname="dp_result", colnames=cols)),),
    )
    where = None
    if having is not None:
        holder = ast.ResTarget(val=copy.deepcopy(having))
        mapper(holder)
        where = holder.val
    if empty:
        false = ast.A_Const(val=ast.Boolean(boolval=False))
        where = false if where is None else ast.BoolExpr(boolop=0, args=(false, where))
    stmt.whereClause = where
    if order_by:
        sorts = copy.deepcopy(tuple(order_by))
        mapper(ast.SelectStmt(sortClause=sorts))
        stmt.sortClause = sorts
    stmt.limitCount = copy.deepcopy(limit)
    stmt.limitOffset = copy.deepcopy(offset)
    if limit is not None or offset is not None:
        stmt.limitOption = 1  # LIMIT_OPTION_COUNT
    if outer is not None:
        # the DP query's place: the FROM subquery left empty, under the queries around it
        outer = copy.deepcopy(outer)
        place: Any = outer
        while place.fromClause[0].subquery is not None:
            place = place.fromClause[0].subquery
        place.fromClause = (ast.RangeSubselect(subquery=stmt, alias=place.fromClause[0].alias),)
        stmt = outer
    printed = str(RawStream()(stmt))
    placeholder = f"(VALUES ('{mark}'))"
    if printed.count(placeholder) != 1:
        raise InternalError("the result's VALUES list has no single place")
    return printed.replace(placeholder, f"(VALUES {values})")
