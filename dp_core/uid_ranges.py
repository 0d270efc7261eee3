"""Splitting a pushdown over ranges of the uid: the ranges, their test in the query, their bounds."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from pglast import ast
from pglast.enums import A_Expr_Kind, BoolExprType, JoinType, NullTestType

from dp_core.errors import InternalError
from dp_core.query import AnalyzedQuery
from dp_core.result import quoted

UidRange = tuple[str | None, str | None]
"""[lower, upper) of the uid as text literals in the uid's type; None is unbounded (and the
lowest range also holds a NULL uid)."""


def uid_ranges(histogram: Sequence[str], n: int) -> list[UidRange]:
    """About `n` ranges of equally many rows, cut at `histogram`: percentiles of the uid column
    (ascending in the column's order). Every uid is in exactly one range: `>=` and `<` against
    one value are complements for any btree-ordered type."""
    cuts: list[str] = []
    for k in range(1, n):
        cut = histogram[round(k * (len(histogram) - 1) / n)] if histogram else None
        if cut is not None and (not cuts or cut != cuts[-1]):
            cuts.append(cut)
    bounds: list[str | None] = [None, *cuts, None]
    return [(bounds[i], bounds[i + 1]) for i in range(len(cuts) + 1)]


def has_outer_join(query: AnalyzedQuery) -> bool:
    """Whether the query's FROM has an outer join (as written)."""
    def outer(node: Any) -> bool:
        if isinstance(node, ast.JoinExpr):
            return node.jointype is not JoinType.JOIN_INNER or outer(node.larg) or outer(node.rarg)
        return False

    return any(outer(item) for item in query.from_clause)


def _range_uids(query: AnalyzedQuery) -> list[Any]:
    """The uid columns a range of users is tested on: the query's uid, and where the FROM
    clause has no outer join, every protected FROM item's (all equal in each row, as the
    analysis requires; Postgres infers equalities from `a.uid = b.uid` but not ranges, so each
    table is read for its range alone instead of whole in every range)."""
    uids = [query.uid]
    if has_outer_join(query):
        return uids
    for t in query.tables:
        ref = ast.ColumnRef(fields=(ast.String(sval=t.alias), ast.String(sval=t.uid_column)))
        if all(ref != u for u in uids):
            uids.append(ref)
    return uids


def uid_in(query: AnalyzedQuery, token: str) -> Any:
    """The query's users in the range that `fill_range` later writes in for the marks named by
    `token`, in one shape for every range, which Postgres's constant folding reduces to the
    range's own test (`uids` from `_range_uids`, uid the first):

        (AND over uids of ((u >= lower OR no_lower) AND (u < upper OR no_upper)))
        OR (uid IS NULL AND nulls)

    where `nulls` is true for the lowest range only, and only where the uid can be NULL: the
    OR makes Postgres read the whole uid index for that range (an index condition cannot say
    `< upper OR IS NULL`), so it is folded away where no NULL can be there.
    """
    def mark(name: str) -> Any:
        return ast.A_Const(val=ast.String(sval=f"dp_range_{name}_{token}"))

    def both(args: Sequence[Any]) -> Any:
        return args[0] if len(args) == 1 else ast.BoolExpr(boolop=BoolExprType.AND_EXPR,
                                                           args=tuple(args))

    def either(a: Any, b: Any) -> Any:
        return ast.BoolExpr(boolop=BoolExprType.OR_EXPR, args=(a, b))

    def compare(uid: Any, op: str, value: str) -> Any:
        return ast.A_Expr(kind=A_Expr_Kind.AEXPR_OP, name=(ast.String(sval=op),),
                          lexpr=copy.deepcopy(uid), rexpr=mark(value))

    in_range = both([both([either(compare(u, ">=", "lower"), mark("no_lower")),
                           either(compare(u, "<", "upper"), mark("no_upper"))])
                     for u in _range_uids(query)])
    is_null = ast.NullTest(arg=copy.deepcopy(query.uid), nulltesttype=NullTestType.IS_NULL)
    return either(in_range, both([is_null, mark("nulls")]))


def fill_range(sql: str, token: str, uid_range: UidRange, null_uids: bool = True) -> str:
    """`sql` with the marks of `uid_in` replaced by `uid_range`'s bounds (an open end's
    comparison gets the other bound, a valid value that its `OR TRUE` ignores); the lowest
    range holds the NULL uid unless `null_uids` is false (none can be there)."""
    lower, upper = uid_range
    some_lower = lower if lower is not None else upper
    some_upper = upper if upper is not None else lower
    if some_lower is None or some_upper is None:
        raise InternalError("a uid range needs a bound")

    marks = {"lower": quoted(some_lower), "upper": quoted(some_upper),
             "no_lower": "TRUE" if lower is None else "FALSE",
             "no_upper": "TRUE" if upper is None else "FALSE",
             "nulls": "TRUE" if lower is None and null_uids else "FALSE"}
    for name, value in marks.items():
        sql = sql.replace(f"'dp_range_{name}_{token}'", value)
    return sql


def null_uids(query: AnalyzedQuery, uid_not_null: bool) -> bool:
    """Whether the query's uid can be NULL: its column allows it, or an outer join makes it."""
    return not uid_not_null or has_outer_join(query)
