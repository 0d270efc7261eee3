"""Join keys and what a condition reads: the equalities Postgres hashes a join on, written not strict."""

from __future__ import annotations

import copy
from typing import Any

from pglast import ast
from pglast.enums import A_Expr_Kind


def _uncast(node: Any) -> Any:
    """`node` without its casts (and `COALESCE(x, x)`, as `lenient` writes a column)."""
    while True:
        if isinstance(node, ast.TypeCast):
            node = node.arg
            continue
        args: Any = node.args if isinstance(node, ast.CoalesceExpr) else None
        if args is None or len(args) != 2 or args[0] != args[1]:
            return node
        node = args[0]


def column(node: Any) -> Any:
    """`alias.column`, maybe cast (or as `lenient` writes it)."""
    node = _uncast(node)
    fields = tuple(node.fields or ()) if isinstance(node, ast.ColumnRef) else ()
    if len(fields) == 2 and all(isinstance(f, ast.String) for f in fields):
        return node
    return None


def _equality(cond: Any) -> bool:
    """`x = y` (the plain operator)."""
    name: Any = cond.name if isinstance(cond, ast.A_Expr) else None
    return isinstance(cond, ast.A_Expr) and cond.kind == A_Expr_Kind.AEXPR_OP \
        and bool(name) and len(name) == 1 and str(name[0].sval) == "="


def is_key(cond: Any, left: set[str], right: set[str]) -> bool:
    """`a.x = b.y` (maybe cast), one column of an item in `left`, the other in `right`."""
    if not _equality(cond):
        return False
    a, b = column(cond.lexpr), column(cond.rexpr)
    if a is None or b is None:
        return False
    x, y = str(a.fields[0].sval), str(b.fields[0].sval)
    return (x in left and y in right) or (x in right and y in left)


def unnamed_key(cond: Any) -> bool:
    """`x = y` of two columns, one named without its item (`ON code = country`): Postgres
    says whose they are; in a join of two items (whose output feeds no other join) it stays
    where it is written, a key to hash on where the columns are of both items. (Two columns
    of one item would filter it where it is read, by an equality no literal is in.)"""
    if not _equality(cond):
        return False
    fields = [tuple(s.fields or ()) if isinstance(s, ast.ColumnRef) else ()
              for s in (_uncast(cond.lexpr), _uncast(cond.rexpr))]
    return all(f and all(isinstance(x, ast.String) for x in f) and len(f) <= 2 for f in fields) \
        and any(len(f) == 1 for f in fields)


def outside(node: Any) -> list[Any]:
    """`node`'s nodes, not descending into subqueries (a SubLink itself is included)."""
    out, stack = [], [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, ast.Node):
            out.append(cur)
            if isinstance(cur, ast.SubLink):
                stack.append(cur.testexpr)
                continue
            stack.extend(getattr(cur, name) for name in cur)
        elif isinstance(cur, (tuple, list)):
            stack.extend(cur)
    return out


def reads(cond: Any) -> frozenset[str] | None:
    """The FROM item names `cond` reads (outside its subqueries, which read none: correlated
    ones are refused); None where it reads a column without naming its item."""
    out: set[str] = set()
    for n in outside(cond):
        if isinstance(n, ast.ColumnRef):
            fields = tuple(n.fields or ())
            if len(fields) != 2 or not isinstance(fields[0], ast.String):
                return None
            out.add(str(fields[0].sval))
    return frozenset(out)


def lenient(keys: list[Any], nullable: set[str]) -> list[Any]:
    """Keys of an outer join with their nullable side's columns as `COALESCE(x, x)`: the same
    equality (Postgres hashes on it), but not strict, so Postgres does not turn an outer
    join inside that side into an inner one (whose empty input would skip the rest)."""
    out = []
    for k in keys:
        k = copy.deepcopy(k)
        for side in ("lexpr", "rexpr"):
            ref = column(getattr(k, side))
            if ref is not None and str(ref.fields[0].sval) in nullable:
                expr = getattr(k, side)
                setattr(k, side, ast.CoalesceExpr(args=(expr, copy.deepcopy(expr))))
        out.append(k)
    return out
