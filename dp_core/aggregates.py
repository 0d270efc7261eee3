"""DP aggregates: recognising ANON_* and plain aggregate calls, their contribution bounds and quantiles."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from pglast import ast

from dp_core.catalogue import (
    ANON_FUNCTIONS,
    LATER_FUNCTIONS,
    MAX_BOUND,
    MIN_BOUND,
    PLAIN_FUNCTIONS,
    QUANTILE_FUNCTIONS,
    QUANTILE_OF,
    is_dp_aggregate,
)
from dp_core.errors import (
    FeatureNotSupported,
    InvalidParameterValue,
)
from dp_core.ownership import FromAnalysis
from dp_core.query import AggKind, Aggregate, Bounds, KeyDomain, TablePolicy
from dp_core.sqlnodes import const_number, func_name, node_sql, refuse, walk_nodes
from dp_core.totality import Totalizer


def aggregate_call(val: Any, plain_form: bool) -> ast.FuncCall | None:
    if not isinstance(val, ast.FuncCall):
        return None
    name = func_name(val)
    if name == "approx_bounds":
        raise FeatureNotSupported(
            "APPROX_BOUNDS is not called directly: it runs by itself for every aggregate whose "
            "bounds are neither written nor configured")
    if name in LATER_FUNCTIONS:
        raise FeatureNotSupported(f"{name.upper()} has no DP form here",
                                  hint="use PERCENTILE_CONT, ANON_MEDIAN or ANON_NTILE")
    if is_dp_aggregate(name) and val.over is None:  # both forms: BigQuery spells them plainly
        return val
    return None


INTERVAL_FUNCTIONS = {"dp_interval_low": "low", "dp_interval_high": "high"}
"""The ends of a DP aggregate's 95% noise interval, as SQL values (Snowflake's names)."""
_INTERVAL_USE = ("a DP aggregate of this query, or its output name: "
                 "SELECT COUNT(*) AS n, DP_INTERVAL_LOW(n), DP_INTERVAL_HIGH(n) ...")


def _is_interval(node: Any) -> bool:
    return isinstance(node, ast.FuncCall) and len(node.funcname) == 1 \
        and func_name(node) in INTERVAL_FUNCTIONS


def interval_call(val: Any, aliases: Mapping[str, Any],
                  plain_form: bool) -> tuple[str, ast.FuncCall] | None:
    """Of a select-list item `DP_INTERVAL_LOW(x)` or `DP_INTERVAL_HIGH(x)`: "low" or "high",
    and the DP aggregate x is or names (`aliases`: the select list's DP aggregates by output
    name); None for any other item."""
    if not _is_interval(val):
        return None
    fname = func_name(val).upper()
    args: Any = val.args or ()
    if len(args) != 1 or val.agg_star or val.agg_distinct or val.over or val.agg_filter \
            or val.agg_order or val.func_variadic or val.agg_within_group:
        raise FeatureNotSupported(f"{fname} takes one argument: {_INTERVAL_USE}",
                                  hint="one call per interval end and aggregate")
    arg = args[0]
    agg = aggregate_call(arg, plain_form)
    if agg is None and isinstance(arg, ast.ColumnRef) and len(arg.fields) == 1 \
            and isinstance(arg.fields[0], ast.String) and str(arg.fields[0].sval) in aliases:
        agg = aggregate_call(aliases[str(arg.fields[0].sval)], plain_form)
    if agg is None:
        raise FeatureNotSupported(
            f"{fname}({node_sql(arg)}): its argument must be {_INTERVAL_USE}",
            hint="name a DP aggregate's output column (AS n), or write the aggregate itself")
    return INTERVAL_FUNCTIONS[func_name(val)], agg


def no_nested_intervals(stmt: ast.SelectStmt) -> None:
    """Refuse DP_INTERVAL_LOW / HIGH anywhere but as a select-list item of its own."""
    found = sum(1 for n in walk_nodes(stmt) if _is_interval(n))
    top = sum(1 for t in stmt.targetList or () if isinstance(t, ast.ResTarget) and _is_interval(t.val))
    if found > top:
        raise FeatureNotSupported(
            "DP_INTERVAL_LOW and DP_INTERVAL_HIGH are select-list items of their own (not inside "
            "an expression, WHERE, HAVING or ORDER BY)",
            hint="select them, and order or filter by their output names in an outer query")


def dp_aggregates_in(val: Any) -> list[Any]:
    """DP aggregate calls inside an expression (not inside subqueries), in order."""
    found = []
    stack = deque([val])  # (breadth first, in order: popleft, not list.pop(0))
    while stack:
        cur = stack.popleft()
        if isinstance(cur, ast.SubLink):
            continue
        if isinstance(cur, ast.FuncCall) and is_dp_aggregate(func_name(cur)) \
                and cur.over is None:  # (a window function runs over the released rows)
            found.append(cur)
            continue
        if isinstance(cur, ast.Node):
            stack.extend(getattr(cur, n) for n in cur)
        elif isinstance(cur, (tuple, list)):
            stack.extend(cur)
    return found


_PER_ROW_BOUNDS = "contribution_bounds_per_row"
_PER_GROUP_BOUNDS = "contribution_bounds_per_group"


def _positional_args(fc: ast.FuncCall, fname: str) -> list[Any]:
    """`fc`'s arguments, with BigQuery's named bounds `contribution_bounds_per_group => (L, U)`
    (SUM, AVG, COUNT, ...: each user's value in a group is clamped) or
    `contribution_bounds_per_row => (L, U)` (PERCENTILE_CONT: each row's) as the two
    positional bounds the ANON_ spelling takes."""
    args = list(fc.args or ())
    if not args or not isinstance(args[-1], ast.NamedArgExpr):
        return args
    named = args[-1]
    wanted = _PER_ROW_BOUNDS if fname in QUANTILE_FUNCTIONS else _PER_GROUP_BOUNDS
    if str(named.name).lower() != wanted or \
            any(isinstance(a, ast.NamedArgExpr) for a in args[:-1]):
        raise refuse(f"{fname.upper()} takes its bounds as {wanted} => (lower, upper)", node_sql(fc))
    pair = named.arg
    if not isinstance(pair, ast.RowExpr) or len(pair.args or ()) != 2:
        raise refuse(f"{wanted} => (lower, upper), two number literals", node_sql(fc))
    return args[:-1] + list(pair.args)


def make_aggregate(fc: ast.FuncCall, name: str, fa: FromAnalysis,
                    policy: Mapping[str, TablePolicy], totalize: Totalizer) -> Aggregate:
    fname = func_name(fc)
    if fc.over is not None:
        raise refuse("window functions", node_sql(fc))
    if fname in QUANTILE_FUNCTIONS:
        return _make_quantile(fc, name, fa, policy, totalize)
    kind = ANON_FUNCTIONS.get(fname) or PLAIN_FUNCTIONS[fname]
    if fc.agg_order or fc.agg_within_group:
        raise refuse("ORDER BY or WITHIN GROUP in a DP aggregate", node_sql(fc))
    args = _positional_args(fc, fname)
    agg = _make_bounded(fc, fname, kind, args, name, fa, policy, totalize)
    if fname in PLAIN_FUNCTIONS and len(args) == len(fc.args or ()) == 1 - bool(fc.agg_star) \
            and agg.kind not in (AggKind.COUNT_USERS, AggKind.COUNT_DISTINCT) \
            and not (agg.kind is AggKind.COUNT and fc.agg_distinct):
        # Postgres's meaning: rows (`Aggregate.row_level`); written bounds keep the paper's
        agg = replace(agg, row_level=True)
    return agg


def _make_bounded(fc: ast.FuncCall, fname: str, kind: AggKind, args: list[Any], name: str,
                  fa: FromAnalysis, policy: Mapping[str, TablePolicy],
                  totalize: Totalizer) -> Aggregate:
    if fc.agg_filter is not None and fc.agg_distinct and kind is not AggKind.COUNT:
        raise refuse("FILTER with DISTINCT in a DP aggregate", node_sql(fc))
    if kind is AggKind.COUNT:
        if fc.agg_distinct:
            arg, k = _distinct_count_args(fc, args)
            if is_uid(arg, fa):  # (k changes nothing for the uid: each user has one)
                if fc.agg_filter is not None:  # the users with a row that passes: each counts 1
                    return Aggregate(AggKind.COUNT, _filtered(fc, None, totalize), Bounds(0, 1),
                                     name)
                return Aggregate(AggKind.COUNT_USERS, None, Bounds(0, 1), name)
            return Aggregate(AggKind.COUNT_DISTINCT, _filtered(fc, arg, totalize), Bounds(0, k),
                             name)
        if fc.agg_star:
            bound = 1.0
            if args:  # ANON_COUNT(*, U)
                bound = _bound_literal(args[-1], fc)
                args = []
            return Aggregate(AggKind.COUNT, _filtered(fc, None, totalize), Bounds(0, bound), name)
        if len(args) == 3:  # COUNT(x, contribution_bounds_per_group => (0, U))
            if _bound_literal(args[1], fc) != 0:
                raise refuse("a count's lower bound other than 0 (each user adds 0 to U rows)",
                              node_sql(fc))
            args = [args[0], args[2]]
        if len(args) not in (1, 2):
            raise refuse("COUNT takes one column (and an optional per-user bound)", node_sql(fc))
        bound = _bound_literal(args[1], fc) if len(args) == 2 else 1.0
        if bound <= 0:
            raise refuse("the per-user bound of a count must be positive", node_sql(fc))
        if isinstance(args[0], ast.A_Const) and not args[0].isnull:  # COUNT(1) is COUNT(*)
            return Aggregate(AggKind.COUNT, _filtered(fc, None, totalize), Bounds(0, bound), name)
        return Aggregate(AggKind.COUNT, _filtered(fc, args[0], totalize), Bounds(0, bound), name)
    if fc.agg_distinct:
        raise refuse(f"{fname.upper()}(DISTINCT ...)", node_sql(fc))
    if fname == "sum" and len(args) == 1 and isinstance(args[0], ast.A_Const) \
            and isinstance(args[0].val, ast.Integer) and args[0].val.ival == 1:
        # Tableau counts rows as SUM(1): a count, bigint as Postgres's SUM of integers
        return Aggregate(AggKind.COUNT, _filtered(fc, None, totalize), Bounds(0, 1.0), name)
    if len(args) not in (1, 3):
        raise refuse(f"{fname.upper()} takes (x) or (x, lower, upper)", node_sql(fc))
    bounds = _bounds(args[0], args[1:], fc, fa, policy)
    return Aggregate(kind, _filtered(fc, args[0], totalize), bounds, name)


def _distinct_count_args(fc: ast.FuncCall, args: list[Any]) -> tuple[Any, float]:
    """COUNT(DISTINCT x [, k]), or with BigQuery's `contribution_bounds_per_group => (0, k)`:
    x, and k, the distinct values of its own each user may add to a group (1 unless given)."""
    if fc.agg_star or len(args) not in (1, 2, 3):
        raise refuse("COUNT(DISTINCT x) takes one expression (and an optional per-user "
                      "number of values)", node_sql(fc))
    if len(args) == 3:
        if _bound_literal(args[1], fc) != 0:
            raise refuse("a count's lower bound other than 0 (each user adds 0 to k values)",
                          node_sql(fc))
        args = [args[0], args[2]]
    k = _bound_literal(args[1], fc) if len(args) == 2 else 1.0
    if k < 1 or k != int(k) or k > MAX_DISTINCT_PER_USER:
        raise refuse(f"the number of distinct values a user adds to a group is a whole "
                      f"number from 1 to {MAX_DISTINCT_PER_USER}", node_sql(fc))
    return args[0], k


MAX_DISTINCT_PER_USER = 100
"""Largest k of COUNT(DISTINCT x, k): the pushdown holds k values per user and group
(padded to k: memory in Postgres grows with users × k)."""


def _filtered(fc: ast.FuncCall, value: Any, totalize: Totalizer) -> Any:
    """An aggregate's (totalised) argument `value` (None: a row count), with its FILTER
    (WHERE c) folded in as `CASE WHEN c THEN value END`: every DP aggregate skips NULLs, so
    it aggregates the same rows. None for a plain row count (COUNT(*))."""
    if fc.agg_filter is None:
        return None if value is None else totalize(value, "aggregate argument")
    when = ast.CaseWhen(expr=fc.agg_filter,
                        result=value if value is not None else ast.A_Const(val=ast.Integer(ival=1)))
    return totalize(ast.CaseExpr(args=(when,)), "aggregate argument")


def _bounds(arg: Any, written: Sequence[Any], fc: ast.FuncCall, fa: FromAnalysis,
            policy: Mapping[str, TablePolicy]) -> Bounds | None:
    """Written bounds, else the column's configured ones, else None (APPROX_BOUNDS finds them)."""
    if written:
        lower, upper = _bound_literal(written[0], fc), _bound_literal(written[1], fc)
    else:
        configured = _configured_bounds(arg, fa, policy)
        if configured is None:
            return None
        lower, upper = configured
        check_bound(lower, fc)
        check_bound(upper, fc)
    if not lower < upper:
        raise FeatureNotSupported(f"lower bound {lower:g} is not below upper bound {upper:g}",
                                  hint=node_sql(fc))
    return Bounds(lower, upper)


def _make_quantile(fc: ast.FuncCall, name: str, fa: FromAnalysis,
                   policy: Mapping[str, TablePolicy], totalize: Totalizer) -> Aggregate:
    fname = func_name(fc)
    args = _positional_args(fc, fname)
    if fc.agg_distinct or fc.agg_star:
        raise refuse(f"DISTINCT or * in {fname.upper()}", node_sql(fc))
    if fname == "percentile_cont" and fc.agg_within_group:
        # PERCENTILE_CONT(p) WITHIN GROUP (ORDER BY x [DESC])
        if len(args) != 1 or not fc.agg_order or len(fc.agg_order) != 1:
            raise refuse("PERCENTILE_CONT(p) WITHIN GROUP (ORDER BY x) with one p and one x",
                          node_sql(fc))
        p = _quantile_literal(args[0], fc)
        sort = fc.agg_order[0]
        if sort.sortby_dir == 2:  # SORTBY_DESC
            p = 1.0 - p
        x, written = sort.node, []
    else:
        if fc.agg_order or fc.agg_within_group:
            raise refuse(f"ORDER BY or WITHIN GROUP in {fname.upper()}", node_sql(fc))
        takes_p = fname in ("anon_ntile", "percentile_cont")
        if not args or len(args) not in ((2, 4) if takes_p else (1, 3)):
            shape = "(x, p) or (x, p, lower, upper)" if takes_p else "(x) or (x, lower, upper)"
            raise refuse(f"{fname.upper()} takes {shape}", node_sql(fc))
        p = _quantile_literal(args[1], fc) if takes_p else QUANTILE_OF[fname]
        x, written = args[0], args[2:] if takes_p else args[1:]
    bounds = _bounds(x, written, fc, fa, policy)
    return Aggregate(AggKind.QUANTILE, _filtered(fc, x, totalize), bounds, name, p)


def _quantile_literal(node: Any, fc: ast.FuncCall) -> float:
    value = const_number(node)
    if value is None or not 0.0 <= value <= 1.0:
        raise refuse("the quantile must be a number literal between 0 and 1", node_sql(fc))
    return value


def _bound_literal(node: Any, fc: ast.FuncCall) -> float:
    value = const_number(node)
    if value is None:
        raise refuse("contribution bounds must be finite number literals", node_sql(fc))
    check_bound(value, fc)
    return value


def check_bound(value: float, where: Any) -> None:
    """Refuse (22023) a contribution bound that is not finite, is nearer 0 than MIN_BOUND
    but not 0 (float8 arithmetic over it could underflow, an error that would depend on the
    data) or exceeds ±MAX_BOUND (sums over users could leave float8); `where` is the call it
    bounds (printed in the hint only then: pglast's printer leaves the nodes it printed too
    deep for deepcopy)."""
    if not math.isfinite(value) or (value != 0 and abs(value) < MIN_BOUND) \
            or abs(value) > MAX_BOUND:
        raise InvalidParameterValue(
            f"contribution bounds must be 0 or of a magnitude within {MIN_BOUND:g} and "
            f"{MAX_BOUND:g}, not {value!r}", hint=node_sql(where))


def is_uid(node: Any, fa: FromAnalysis) -> bool:
    if not isinstance(node, ast.ColumnRef):
        return False
    parts = [str(f.sval) for f in node.fields if isinstance(f, ast.String)]
    return any(parts == [t.uid_column] or parts == [t.alias, t.uid_column] for t in fa.tables)


def configured_domain(node: Any, fa: FromAnalysis,
                      policy: Mapping[str, TablePolicy]) -> KeyDomain | None:
    """The public key domain the config gives a column a key reads as it is (a plain column
    reference to a protected table, not a derived one), or None."""
    if not isinstance(node, ast.ColumnRef):
        return None
    parts = [str(f.sval) for f in node.fields if isinstance(f, ast.String)]
    if len(parts) != len(node.fields) or len(parts) > 2:
        return None
    found = [policy[t.name].domains.get(parts[-1]) for t in fa.tables
             if not t.derived and (len(parts) == 1 or parts[0] == t.alias)]
    return found[0] if len(found) == 1 else None


_WIDENING_CASTS = frozenset({"float8", "float4", "numeric", "int8"})
"""Types a bounded column keeps its value in when cast to them (Tableau writes
AVG(CAST(x AS DOUBLE PRECISION))): the column's configured bounds still apply."""


def _configured_bounds(node: Any, fa: FromAnalysis,
                       policy: Mapping[str, TablePolicy]) -> tuple[float, float] | None:
    """The bounds the config gives a column (through widening casts), or that a CASE of
    such columns and number literals has (Metabase's `sum(CASE WHEN c THEN 1 ELSE 0.0 END)`:
    their hull, with 0, which no per-user sum of them can leave)."""
    while isinstance(node, ast.TypeCast) and node.typeName is not None \
            and not node.typeName.arrayBounds \
            and str(node.typeName.names[-1].sval) in _WIDENING_CASTS:
        node = node.arg
    if isinstance(node, ast.CaseExpr):
        lo, hi = 0.0, 0.0
        for result in (*(w.result for w in node.args), node.defresult):
            if result is None or (isinstance(result, ast.A_Const) and result.isnull):
                continue  # (NULL: skipped by the aggregate)
            value = const_number(result)
            found = (value, value) if value is not None else _configured_bounds(result, fa,
                                                                                 policy)
            if found is None:
                return None
            lo, hi = min(lo, found[0]), max(hi, found[1])
        return (lo, hi) if lo < hi else None
    if not isinstance(node, ast.ColumnRef):
        return None
    parts = [str(f.sval) for f in node.fields if isinstance(f, ast.String)]
    candidates = []
    for t in fa.tables:
        if t.derived:
            continue  # its columns are the inner query's outputs, not the table's
        col = policy[t.name].columns.get(parts[-1])
        if col is not None and (len(parts) == 1 or parts[0] == t.alias):
            candidates.append((col.lower, col.upper))
    return candidates[0] if len(candidates) == 1 else None
