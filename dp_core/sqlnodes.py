"""pglast node helpers the analysis shares: refusals, names, constants, clauses, total arithmetic."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator
from typing import Any

from pglast import ast
from pglast.enums import A_Expr_Kind, BoolExprType

from dp_core.errors import (
    FeatureNotSupported,
)

MAX_MAGNITUDE = 1e38
"""Arithmetic in a DP query runs in numeric with every operand and result clamped to
±MAX_MAGNITUDE (`clamp_magnitude`; 38 digits, as SQL's usual NUMERIC(38) holds): a product of
two is far within numeric's range (10^131072), so no value of any row can overflow it;
number literals in arithmetic must lie within it. (It was 1e300: a product or quotient of
two 331-digit values costs 10–40 times one of small values, and an accepted expression of a
few of them cost 5–10 µs per row, so a user's 5,000 rows showed through the time quantum:
red team, session 30. At 68 digits an operator costs 2–3 times a small one.)"""
NUMERIC_ROW_CLAMP = 1e300
"""numeric rows are clamped to ±1e300 (`within_magnitude`) before a user's sum (a DP
aggregate's, a per-user subquery's `sum()`/`avg()`, as an aggregate or over a window): two rows
near numeric's largest (10^131072) overflowed it, an error after the charge from one user's
values (red team, session 31); a sum of 10^18 rows of 1e300 is far within it."""
MAX_SCALE = 30
"""Arithmetic's operands and results are rounded to MAX_SCALE decimals (`clamp_magnitude`):
with the magnitude bound, every value has at most 68 digits. Numeric products are exact,
their digits the sum of their operands': squared over nested subqueries (`(1 + 1e-1000) / 7`
has 1000 digits, its square 2000), one user's rows took half a second more where a CASE
gave them such a value (a timing side channel); and a product's work grows with the square
of its digits."""


def refuse(rule: str, fragment: str = "") -> FeatureNotSupported:
    where = f": {fragment}" if fragment else ""
    return FeatureNotSupported(f"not allowed in a DP query ({rule}){where}")


def func_name(fc: ast.FuncCall) -> str:
    return str(fc.funcname[-1].sval).lower()


def node_sql(node: Any) -> str:
    from pglast.stream import RawStream

    try:
        text = str(RawStream()(node))
    except Exception:  # pragma: no cover - printing only feeds error messages
        return type(node).__name__
    finally:
        # pglast's printer leaves on each node it printed an `ancestors` chain that links the
        # whole tree: a later deepcopy of the node would walk it (and exhaust the stack)
        for n in walk_nodes(node):
            with contextlib.suppress(AttributeError):
                del n.ancestors
    return text if len(text) <= 120 else text[:117] + "..."


# ---------------------------------------------------------------------------- constants


def const_number(node: Any) -> float | None:
    """The value of a numeric literal, or of a negated one."""
    if isinstance(node, ast.A_Const) and not node.isnull:
        val = node.val
        if isinstance(val, ast.Integer):
            return float(val.ival)
        if isinstance(val, ast.Float):
            return float(val.fval)
        return None
    if (isinstance(node, ast.A_Expr) and node.kind == A_Expr_Kind.AEXPR_OP and node.lexpr is None
            and node.name[-1].sval == "-"):
        inner = const_number(node.rexpr)
        return -inner if inner is not None else None
    return None


def const_string(node: Any) -> str | None:
    if isinstance(node, ast.A_Const) and isinstance(node.val, ast.String):
        return str(node.val.sval)
    return None


def as_numeric(node: ast.Node) -> ast.Node:
    return ast.TypeCast(arg=node, typeName=ast.TypeName(names=(ast.String(sval="numeric"),)))


def as_integer(value: ast.Node, type_name: str) -> ast.Node:
    """Exact, integer-valued arithmetic `value` as Postgres's integer type `type_name`: cast
    where it is in the type's range, else NULL (where Postgres would fail: overflow)."""
    low, high = INTEGER_LIMITS[type_name]
    inside = ast.A_Expr(kind=A_Expr_Kind.AEXPR_BETWEEN, name=(ast.String(sval="BETWEEN"),),
                        lexpr=copy.deepcopy(value),
                        rexpr=(ast.A_Const(val=ast.Float(fval=low)),
                               ast.A_Const(val=ast.Float(fval=high))))
    cast = ast.TypeCast(arg=value, typeName=ast.TypeName(names=(ast.String(sval=type_name),)))
    return ast.CaseExpr(args=(ast.CaseWhen(expr=inside, result=cast),))


INTEGER_LIMITS = {"int2": ("-32768", "32767"), "int4": ("-2147483648", "2147483647"),
                   "int8": ("-9223372036854775808", "9223372036854775807")}


def nullif_zero(node: ast.Node) -> ast.Node:
    zero = ast.A_Const(val=ast.Integer(ival=0))
    return ast.A_Expr(kind=A_Expr_Kind.AEXPR_NULLIF, name=(ast.String(sval="="),),
                      lexpr=as_numeric(node), rexpr=zero)


def clamp_magnitude(node: ast.Node) -> ast.Node:
    """`node` as numeric within ±MAX_MAGNITUDE (`within_magnitude`); a number literal is
    checked instead."""
    value = const_number(node)
    if value is not None:
        if not abs(value) <= MAX_MAGNITUDE:
            raise refuse(f"number literals in arithmetic beyond ±{MAX_MAGNITUDE:g}", node_sql(node))
        return _rounded(as_numeric(node))
    return _rounded(within_magnitude(as_numeric(node), MAX_MAGNITUDE))


def within_magnitude(node: ast.Node, limit: float) -> ast.Node:
    """`node` (numeric) within ±`limit`, NULL kept: NaN and +Infinity to the top, -Infinity to
    the bottom (NaN sorts above every number). numeric_larger and numeric_smaller (max's and
    min's) are strict, where GREATEST and LEAST skip a NULL and made it -limit (`x * 1.5`
    of a NULL x was -1.5e38, not NULL). `node` is read once."""
    def bound(fn: str, value: str, arg: ast.Node) -> ast.Node:
        return ast.FuncCall(funcname=(ast.String(sval="pg_catalog"), ast.String(sval=fn)),
                            args=(arg, as_numeric(ast.A_Const(val=ast.Float(fval=value)))))

    return bound("numeric_smaller", f"{limit:g}", bound("numeric_larger", f"-{limit:g}", node))


def within_magnitude_sql(expr: str, limit: float) -> str:
    """`within_magnitude` of the SQL text `expr` (numeric), for SQL written as text."""
    return (f"pg_catalog.numeric_smaller(pg_catalog.numeric_larger({expr}, "
            f"(-{limit:g})::numeric), ({limit:g})::numeric)")


def _rounded(node: ast.Node) -> ast.Node:
    """`node` (numeric) rounded to MAX_SCALE decimals (never fails: NaN stays NaN)."""
    return ast.FuncCall(funcname=(ast.String(sval="pg_catalog"), ast.String(sval="round")),
                        args=(node, ast.A_Const(val=ast.Integer(ival=MAX_SCALE))))


_CLAUSES = {
    "distinctClause": "DISTINCT", "intoClause": "INTO", "targetList": "a select list",
    "fromClause": "FROM", "whereClause": "WHERE", "groupClause": "GROUP BY",
    "groupDistinct": "GROUP BY DISTINCT", "havingClause": "HAVING", "windowClause": "WINDOW",
    "valuesLists": "VALUES", "sortClause": "ORDER BY", "limitOffset": "OFFSET",
    "limitCount": "LIMIT", "limitOption": "FETCH ... WITH TIES",
    "lockingClause": "FOR UPDATE or FOR SHARE", "withClause": "WITH",
    "op": "UNION, INTERSECT or EXCEPT", "all": "UNION, INTERSECT or EXCEPT",
    "larg": "UNION, INTERSECT or EXCEPT", "rarg": "UNION, INTERSECT or EXCEPT",
}
_WITH_TIES = 2
"""pglast's LimitOption.LIMIT_OPTION_WITH_TIES (COUNT, 1, goes with a LIMIT)."""


def only_clauses(sel: ast.SelectStmt, allowed: Iterable[str], scope: str) -> None:
    """Refuse every clause of `sel` that is present and not in `allowed`: the rules accept a
    SELECT clause by clause, so a clause no rule handles (or one a later pglast adds) never
    runs unchecked as the pushdown role."""
    accepted = frozenset(allowed)
    for name in sel:
        value = getattr(sel, name)
        present = value == _WITH_TIES if name == "limitOption" else bool(value)
        if present and name not in accepted:
            raise refuse(f"{_CLAUSES.get(name, name)} in {scope}", node_sql(sel))


OWNED_CLAUSES = ("targetList", "fromClause", "whereClause", "groupClause")
PUBLIC_CLAUSES = ("targetList", "fromClause", "whereClause")


def conjuncts(node: Any) -> Iterator[Any]:
    if isinstance(node, ast.BoolExpr) and node.boolop == BoolExprType.AND_EXPR:
        for a in node.args:
            yield from conjuncts(a)
    else:
        yield node


def same_node(a: Any, b: Any) -> bool:
    return bool(a == b)  # pglast's equality ignores source locations


def is_ref_to(node: Any, name: str) -> bool:
    return (isinstance(node, ast.ColumnRef) and len(node.fields) == 1
            and isinstance(node.fields[0], ast.String) and node.fields[0].sval == name)


def walk_nodes(node: Any) -> Iterator[Any]:
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, ast.Node):
            yield cur
            stack.extend(getattr(cur, name) for name in cur)
        elif isinstance(cur, (tuple, list)):
            stack.extend(cur)


def from_name(node: Any) -> str | None:
    """A FROM item's name (its alias, or a table's name); None for a join."""
    if isinstance(node, ast.RangeVar):
        return str(node.alias.aliasname) if node.alias else str(node.relname)
    if isinstance(node, ast.RangeSubselect) and node.alias is not None:
        return str(node.alias.aliasname)
    return None


def from_names(node: Any) -> set[str]:
    """The names of the FROM items in `node` (a join's, all of them)."""
    if isinstance(node, ast.JoinExpr):
        return from_names(node.larg) | from_names(node.rarg)
    name = from_name(node)
    return set() if name is None else {name}

