"""Statements only prepared, never run: the types of the query's expressions, its subqueries, its names."""

from __future__ import annotations

import copy
from typing import Any

from pglast import ast
from pglast.enums import GroupingSetKind, LimitOption, SetOperation
from pglast.stream import RawStream

from dp_core.query import AggKind, AnalyzedQuery
from dp_core.splice import PH, Splice
from dp_core.sql_parse import parse_sql


def _probe_sql(query: AnalyzedQuery, exprs: dict[str, Any],
               inner: dict[str, tuple[Any, Any]] | None = None) -> str | None:
    """`SELECT expr AS name, ... FROM <the query's FROM> WHERE FALSE`: prepared, never run,
    so that Postgres reports the expressions' types. `inner` maps more names to an expression
    and the inner query whose FROM it reads, probed as `(SELECT expr FROM <its FROM> WHERE
    FALSE)`: a scalar subquery has its column's type."""
    inner = inner or {}
    if not exprs and not inner:
        return None
    cols = [f"{PH}{name} AS {name}" for name in exprs]
    cols += [f"(SELECT {PH}{name} FROM {PH}from_{name} WHERE FALSE) AS {name}" for name in inner]
    stmt = parse_sql(f"SELECT {', '.join(cols)} FROM {PH}from WHERE FALSE")[0].stmt
    nodes = {f"{PH}{name}": node for name, node in exprs.items()}
    nodes.update((f"{PH}{name}", arg) for name, (arg, _) in inner.items())
    froms = {f"{PH}from_{name}": tuple(scope.fromClause or ())  # (a subquery may have none)
             for name, (_, scope) in inner.items()}
    Splice(nodes, query.from_clause, froms)(stmt)
    if query.ctes:
        stmt.withClause = ast.WithClause(ctes=tuple(copy.deepcopy(query.ctes)))
    return str(RawStream()(stmt))


def argument_probe_sql(query: AnalyzedQuery) -> str | None:
    """A query whose result columns have the types of the aggregates' arguments (a{i}), of
    the deferred casts' arguments (c{i}, for `check_casts`), of the arithmetic operators as
    written (t{i}, for their integer semantics), of the values brought to one type (m{i}_{j},
    for `check_mixes`) and of the keys (k{i}): one statement to prepare."""
    exprs = {f"a{i}": a.arg for i, a in enumerate(query.aggregates)
             if a.arg is not None and a.kind is not AggKind.COUNT}
    exprs.update((f"c{i}", c.arg) for i, c in enumerate(query.casts) if c.scope is None)
    exprs.update((f"t{i}", c.arg) for i, c in enumerate(query.arithmetic) if c.scope is None)
    exprs.update((f"m{i}_{j}", op) for i, m in enumerate(query.mixes)
                 if m.scope is None and m.scopes is None for j, op in enumerate(m.operands))
    # (k{i}): how a key's equal values print (`canonical_key`), and whether trees and rows
    # can be matched by key text
    exprs.update((f"k{i}", k.expr) for i, k in enumerate(query.keys))
    inner: dict[str, tuple[Any, Any]] = {
        f"c{i}": (c.arg, c.scope) for i, c in enumerate(query.casts) if c.scope is not None}
    inner.update((f"t{i}", (c.arg, c.scope)) for i, c in enumerate(query.arithmetic)
                 if c.scope is not None)
    inner.update((f"m{i}_{j}", (op, m.scope if m.scopes is None else m.scopes[j]))
                 for i, m in enumerate(query.mixes) if m.scope is not None or m.scopes
                 for j, op in enumerate(m.operands))
    return _probe_sql(query, exprs, inner)


def order_probe_sql(query: AnalyzedQuery, operands: list[tuple[Any, Any]]) -> str:
    """`SELECT (SELECT 1 FROM <its FROM> WHERE FALSE ORDER BY value LIMIT 1), ...` for each
    (value, the inner query whose FROM it reads or None): prepared, never run, so that
    Postgres says whether it can order (and so compare) the values' type, an array's or a
    composite's by its parts', which it otherwise looks up when a row first reaches the
    comparison (`ja = ja` of a json[] failed only where a row had one)."""
    cols = [f"(SELECT 1 FROM {PH}from_o{i} WHERE FALSE ORDER BY {PH}o{i} LIMIT 1) AS o{i}"
            for i in range(len(operands))]
    stmt = parse_sql(f"SELECT {', '.join(cols)}")[0].stmt
    nodes = {f"{PH}o{i}": value for i, (value, _) in enumerate(operands)}
    froms = {f"{PH}from_o{i}": tuple((query.from_clause if scope is None else
                                      scope.fromClause) or ())
             for i, (_, scope) in enumerate(operands)}
    Splice(nodes, query.from_clause, froms)(stmt)
    if query.ctes:
        stmt.withClause = ast.WithClause(ctes=tuple(copy.deepcopy(query.ctes)))
    return str(RawStream()(stmt))


def standalone_subqueries(query: AnalyzedQuery, in_lists: bool = False,
                          limit: int | None = None) -> list[str]:
    """Each IN or EXISTS subquery of `query` as a statement of its own (with the query's WITH
    list): it plans only if it reads nothing of the DP query's row, i.e. is not correlated.
    `in_lists`: the IN subqueries only; `limit`: each statement then counts the subquery's
    rows up to `limit` (public data, once it is known to be uncorrelated)."""
    out = []
    for sub in query.in_lists if in_lists else query.sublinks:
        outer = ast.SelectStmt(
            targetList=(ast.ResTarget(val=ast.A_Const(val=ast.Integer(ival=1))),),
            fromClause=(ast.RangeSubselect(lateral=False, subquery=copy.deepcopy(sub),
                                           alias=ast.Alias(aliasname="dp_s")),),
            limitOption=LimitOption.LIMIT_OPTION_DEFAULT, op=SetOperation.SETOP_NONE)
        if limit is not None:
            outer.limitCount = ast.A_Const(val=ast.Integer(ival=limit))
            outer.limitOption = LimitOption.LIMIT_OPTION_COUNT
            outer = ast.SelectStmt(
                targetList=(ast.ResTarget(val=ast.FuncCall(funcname=(ast.String(sval="count"),),
                                                           agg_star=True)),),
                fromClause=(ast.RangeSubselect(lateral=False, subquery=outer,
                                               alias=ast.Alias(aliasname="dp_n")),),
                limitOption=LimitOption.LIMIT_OPTION_DEFAULT, op=SetOperation.SETOP_NONE)
        if query.ctes:
            outer.withClause = ast.WithClause(ctes=tuple(copy.deepcopy(query.ctes)),
                                              recursive=False)
        out.append(str(RawStream()(outer)))
    return out


def sublink_read_counts(query: AnalyzedQuery, limit: int) -> list[str]:
    """For each IN or EXISTS subquery of `query`, a statement counting (up to `limit`) the rows
    of what it reads, its WHERE aside: the rows it may scan when it runs (public data)."""
    out = []
    for sub in query.sublinks:
        if not sub.fromClause:
            continue  # (VALUES, or a SELECT of constants: nothing to scan)
        inner: Any = parse_sql(f"SELECT 1 FROM dp_x LIMIT {int(limit)}")[0].stmt
        inner.fromClause = _read_from(tuple(sub.fromClause), query.ctes)
        outer: Any = parse_sql("SELECT count(*) FROM dp_x AS dp_n")[0].stmt
        outer.fromClause = (ast.RangeSubselect(lateral=False, subquery=inner,
                                               alias=ast.Alias(aliasname="dp_n")),)
        if query.ctes:
            outer.withClause = ast.WithClause(ctes=tuple(copy.deepcopy(query.ctes)),
                                              recursive=False)
        out.append(str(RawStream()(outer)))
    return out


def _read_from(items: tuple[Any, ...], ctes: tuple[Any, ...], depth: int = 0) -> tuple[Any, ...]:
    """`items` with each WITH query named there replaced by what it reads (its own FROM, its
    WHERE aside): a WITH query's rows are not what scanning it costs."""
    named = {str(c.ctename): c.ctequery for c in ctes}
    out: list[Any] = []
    for item in items:
        query = named.get(str(item.relname)) if isinstance(item, ast.RangeVar) and \
            item.schemaname is None else None
        if query is not None and depth < 8 and isinstance(query, ast.SelectStmt) and \
                query.fromClause:
            out += _read_from(tuple(query.fromClause), ctes, depth + 1)
        else:
            out.append(copy.deepcopy(item))
    return tuple(out)


def column_probe_sql(query: AnalyzedQuery, name: tuple[str, ...]) -> str:
    """`SELECT name FROM <the query's FROM> WHERE FALSE GROUP BY <its GROUP BY>`: prepared, never
    run, so that Postgres says what a name of HAVING or ORDER BY is (`names.InputColumns`): it
    plans where the name is a GROUP BY key (42803 where it is an input column that is not, 42703
    where no input column has the name). The GROUP BY is the query's as the proxy groups it;
    without one, `GROUP BY ()`: one group, as a query of aggregates alone."""
    groups: tuple[Any, ...] | None = tuple(copy.deepcopy(query.grouped_by)) or (
        ast.GroupingSet(kind=GroupingSetKind.GROUPING_SET_EMPTY),)
    if name and name[0] == "":
        # a GROUP BY name (analysis.GROUP_NAME): whether an input column has it, ungrouped
        name, groups = name[1:], None
    stmt = ast.SelectStmt(
        targetList=(ast.ResTarget(val=ast.ColumnRef(fields=tuple(ast.String(sval=part)
                                                                 for part in name))),),
        fromClause=tuple(copy.deepcopy(query.from_clause)),
        whereClause=ast.A_Const(val=ast.Boolean(boolval=False)), groupClause=groups,
        limitOption=LimitOption.LIMIT_OPTION_DEFAULT, op=SetOperation.SETOP_NONE)
    if query.ctes:
        stmt.withClause = ast.WithClause(ctes=tuple(copy.deepcopy(query.ctes)), recursive=False)
    return str(RawStream()(stmt))
