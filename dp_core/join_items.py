"""FROM items a join reads whole: sentinel rows for a subquery, a public item with its own conditions."""

from __future__ import annotations

import copy
from typing import Any

from pglast import ast
from pglast.enums import BoolExprType

from dp_core.sql_parse import parse_sql
from dp_core.sqlnodes import from_name


def filtered(node: Any, own: dict[str, list[Any]]) -> Any:
    """`node` with each item of `own` wrapped with its conditions."""
    if isinstance(node, ast.JoinExpr):
        node.larg, node.rarg = filtered(node.larg, own), filtered(node.rarg, own)
        return node
    name = from_name(node)
    if name not in own:
        return node
    sub: Any = parse_sql("SELECT * FROM dp_x OFFSET 0")[0].stmt
    sub.fromClause = (node,)
    conds = own[name]
    sub.whereClause = conds[0] if len(conds) == 1 else ast.BoolExpr(
        boolop=BoolExprType.AND_EXPR, args=tuple(conds))
    return ast.RangeSubselect(lateral=False, subquery=sub, alias=ast.Alias(aliasname=name))


_SENTINEL = ("SELECT dp_s.* FROM (VALUES (0)) AS dp_one (dp_x) LEFT JOIN dp_item AS dp_s "
             "ON true OFFSET 0")


def sentinel(node: Any) -> ast.RangeSubselect:
    """A subquery or WITH query over protected rows as a FROM item of the same name that has
    its rows, or one row of NULLs where it has none (OFFSET 0: Postgres keeps it whole,
    rather than reducing the LEFT JOIN away under a join key)."""
    sub: Any = parse_sql(_SENTINEL)[0].stmt
    join = sub.fromClause[0]
    if isinstance(node, ast.RangeSubselect):
        join.rarg = ast.RangeSubselect(lateral=False, subquery=node.subquery,
                                       alias=ast.Alias(aliasname="dp_s"))
        return ast.RangeSubselect(lateral=False, subquery=sub, alias=node.alias)
    rv = copy.copy(node)
    rv.alias = ast.Alias(aliasname="dp_s")
    join.rarg = rv
    name = from_name(node)
    return ast.RangeSubselect(lateral=False, subquery=sub, alias=ast.Alias(aliasname=name))
