"""The static per-row work of a DP query's expressions: a bound from their text alone (DESIGN §3.11).

How long a DP query takes must not be a lever on one user's data. Reading a row costs
about its size; an expression can cost far more per row (`lpad(x, 10000)`, nested
`replace` that multiply a value's length, a `concat` of a hundred copies), and then the
time of the whole query moves with the rows of one user that reach it. Each expression
the analysis accepts gets a bound here, as an affine function of the bytes of the row's
own values (`Linear`): its output's size and the work of computing it, function by
function from its arguments' bounds (lpad to its literal length, replace by the ratio of
its literals, concat the sum, nesting composes). The analysis adds the bounds of every
expression a row meets and refuses a query above `RowWorkBudget`, before anything runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from pglast import ast
from pglast.enums import A_Expr_Kind


@dataclass(frozen=True)
class Linear:
    """At most `per_byte` × (bytes of the row's values) + `fixed` bytes."""

    per_byte: float = 0.0
    fixed: float = 0.0

    def __add__(self, other: Linear) -> Linear:
        return Linear(self.per_byte + other.per_byte, self.fixed + other.fixed)

    def times(self, factor: float) -> Linear:
        return Linear(self.per_byte * factor, self.fixed * factor)

    def widest(self, other: Linear) -> Linear:
        return Linear(max(self.per_byte, other.per_byte), max(self.fixed, other.fixed))

    def fits(self, budget: Linear) -> bool:
        return self.per_byte <= budget.per_byte and self.fixed <= budget.fixed


@dataclass(frozen=True)
class Cost:
    size: Linear
    """The largest value the expression can produce, in bytes."""
    work: Linear
    """What computing it costs, in bytes handled."""


@dataclass(frozen=True)
class RowWorkBudget:
    """The most work a DP query's expressions may do on one row: `per_byte` passes over the
    row's values plus `fixed` bytes (a small multiple of reading the row)."""

    per_byte: float = 32.0
    fixed: float = 1024.0

    @property
    def linear(self) -> Linear:
        return Linear(self.per_byte, self.fixed)


_WORD = Linear(0.0, 16.0)
"""A number, a boolean, a date: small and of bounded size."""
_ROW = Linear(1.0, 0.0)
_SMALL_RESULT = frozenset({
    "length", "char_length", "character_length", "octet_length", "bit_length", "ascii",
    "strpos", "position", "sign", "isfinite", "num_nulls", "num_nonnulls", "width_bucket",
    "date_trunc", "date_part", "extract",
})
_SAME_SIZE = frozenset({"lower", "upper", "initcap", "reverse", "btrim", "ltrim", "rtrim",
                        "abs", "round", "floor", "ceil", "ceiling", "trunc", "substring",
                        "substr", "left", "right", "split_part"})
_WIDEST = frozenset({"coalesce", "nullif", "greatest", "least"})


_COLUMN: ContextVar[Linear] = ContextVar("dp_cost_column", default=_ROW)
"""The size of a column of the row being costed (`row_cost`'s `column`)."""


def row_cost(node: Any, column: Linear | None = None) -> Cost:
    """The bound of one expression (as the analyst wrote it) on one row. `column`: the size
    of one of the row's columns, as a bound in the protected row's bytes (its own: one pass
    over them; a subquery's or WITH query's output column: the largest value its select list
    can make, `Totalizer.column_size`), so that what each level of nested subqueries makes
    of its input counts in the level above (seven levels of `concat(b, b)` make a value 128
    times as large as the first level's, each level priced as if it read the row)."""
    if column is not None:
        token = _COLUMN.set(column)
        try:
            return row_cost(node)
        finally:
            _COLUMN.reset(token)
    if node is None:
        return Cost(Linear(), Linear())
    if isinstance(node, ast.A_Const):
        return Cost(Linear(0.0, float(len(_literal_text(node)))), Linear())
    if isinstance(node, ast.ColumnRef):
        return Cost(_COLUMN.get(), Linear())
    if isinstance(node, (ast.ParamRef, ast.SQLValueFunction)):
        return Cost(_WORD, Linear())
    if isinstance(node, ast.FuncCall):
        return _function(node)
    if isinstance(node, ast.A_Expr):
        return _operator(node)
    if isinstance(node, (ast.CaseExpr, ast.CoalesceExpr, ast.MinMaxExpr)):
        return _widest(_children(node))
    if isinstance(node, ast.CaseWhen):
        test, result = row_cost(node.expr), row_cost(node.result)
        return Cost(result.size, test.work + test.size + result.work)
    if isinstance(node, ast.TypeCast):
        inner = row_cost(node.arg)  # (a number's text is about as long as its digits)
        type_names = node.typeName.names if node.typeName is not None else None
        target = str(type_names[-1].sval).lower() if type_names else ""
        # a cast to an integer type is made total by testing the value, then casting it: the
        # argument is written (and computed) twice
        copies = 2.0 if target in ("int2", "int4", "int8", "smallint", "integer", "bigint") \
            else 1.0
        return Cost(inner.size + _WORD, inner.work.times(copies) + inner.size.times(copies))
    if isinstance(node, ast.SubLink):
        # IN / EXISTS over public tables: Postgres runs them as a (hashed) semi-join, a probe
        # per row of the test expression
        test = row_cost(node.testexpr)
        return Cost(_WORD, test.work + test.size + _WORD)
    return _reading(_children(node), _WORD)


def _literal_text(node: ast.A_Const) -> str:
    if node.isnull:
        return ""
    val = node.val
    for attr in ("sval", "fval", "ival", "boolval", "bsval"):
        if hasattr(val, attr):
            return str(getattr(val, attr))
    return ""


def _children(node: ast.Node) -> list[Cost]:
    out: list[Cost] = []
    for name in node:
        value = getattr(node, name)
        items: Iterable[Any] = value if isinstance(value, (tuple, list)) else (value,)
        out.extend(row_cost(v) for v in items if isinstance(v, ast.Node))
    return out


def _reading(args: list[Cost], size: Linear) -> Cost:
    """A result of `size` computed by reading each argument once."""
    work = Linear()
    for a in args:
        work = work + a.work + a.size
    return Cost(size, work + size)


def _widest(args: list[Cost]) -> Cost:
    """CASE, COALESCE, GREATEST ...: the largest argument (every one may be evaluated)."""
    size = Linear()
    work = Linear()
    for a in args:
        size = size.widest(a.size)
        work = work + a.work + a.size
    return Cost(size, work)


def _sum_of(args: list[Cost]) -> Linear:
    total = Linear()
    for a in args:
        total = total + a.size
    return total


def _operator(node: ast.A_Expr) -> Cost:
    args = [row_cost(node.lexpr)]
    right = node.rexpr
    args.extend(row_cost(r) for r in (right if isinstance(right, (tuple, list)) else (right,)))
    op = str(node.name[-1].sval) if node.name else ""
    if node.kind == A_Expr_Kind.AEXPR_OP and op == "||":
        return _reading(args, _sum_of(args))
    if node.kind == A_Expr_Kind.AEXPR_OP and op in ("*", "/", "%", "+", "-"):
        # numeric digits add up under products and quotients, never more
        return _reading(args, _sum_of(args) + _WORD)
    if node.kind in (A_Expr_Kind.AEXPR_LIKE, A_Expr_Kind.AEXPR_ILIKE):
        # matching backs up over the value at most once per pattern character
        pattern = max(args[1].size.fixed, 1.0)
        return Cost(_WORD, args[0].work + args[0].size.times(pattern) + args[1].size)
    if node.kind == A_Expr_Kind.AEXPR_NULLIF:
        return _widest(args)
    return _reading(args, _WORD)


_Rule = Callable[[list[Cost], list[Any]], Linear]


def _padded(args: list[Cost], raw: list[Any]) -> Linear:
    length = _number(raw[1]) if len(raw) > 1 else None
    return Linear(0.0, length * 4.0) if length is not None else Linear(math.inf, math.inf)


def _replaced(args: list[Cost], raw: list[Any]) -> Linear:
    """Each occurrence of 'from' becomes 'to': the value grows by their ratio, at most."""
    source = _string(raw[1]) if len(raw) > 1 else None
    target = _string(raw[2]) if len(raw) > 2 else None
    if source is None or target is None:
        return Linear(math.inf, math.inf)
    ratio = max(1.0, len(target) / len(source)) if source else 1.0
    return args[0].size.times(ratio)


_SIZES: dict[str, _Rule] = {
    "lpad": _padded, "rpad": _padded, "replace": _replaced,
    "concat": lambda args, raw: _sum_of(args), "md5": lambda args, raw: Linear(0.0, 32.0),
}


_SEARCHES = frozenset({"strpos", "position", "replace", "split_part", "btrim", "ltrim", "rtrim"})
"""Functions that look for their literal arguments in the value: the work is the value's
size times the length of what is looked for."""


def _function(fc: ast.FuncCall) -> Cost:
    names = fc.funcname or ()
    name = str(names[-1].sval).lower() if names else ""
    raw = list(fc.args or ())
    args = [row_cost(a) for a in raw]
    if name in _SEARCHES and len(args) > 1:
        looked_for = max((a.size.fixed for a in args[1:]), default=1.0)
        if any(a.size.per_byte for a in args[1:]):  # (a column: quadratic in its length)
            return Cost(Linear(math.inf, math.inf), Linear(math.inf, math.inf))
        searched = Cost(args[0].size, args[0].work + args[0].size.times(max(looked_for, 1.0)))
        size = _SIZES[name](args, raw) if name in _SIZES else args[0].size + _WORD
        return _reading([searched, *args[1:]], size)
    if name == "date_trunc" and len(args) == 2:
        # made total by testing its value's range and finiteness, then calling it: the value
        # three times (`dp_core.catalogue.datetime_call`)
        thrice = Cost(args[1].size.times(3.0), args[1].work.times(3.0))
        return _reading([args[0], thrice], _WORD)
    if name == "width_bucket" and args:
        # made total by testing its value for NaN, then calling it: the value twice
        twice = Cost(args[0].size.times(2.0), args[0].work.times(2.0))
        return _reading([twice, *args[1:]], _WORD)
    if name in ("round", "trunc") and len(raw) == 2:
        digits = _number(raw[1])
        extra = Linear(0.0, abs(digits)) if digits is not None else Linear(math.inf, math.inf)
        return _reading(args, args[0].size + extra + _WORD)
    if name in _SIZES:
        return _reading(args, _SIZES[name](args, raw))
    if name in _SMALL_RESULT:
        return _reading(args, _WORD)
    if name in _SAME_SIZE and args:
        return _reading(args, args[0].size + _WORD)
    if name in _WIDEST:
        return _widest(args)
    return _reading(args, _sum_of(args) + _WORD)  # (aggregates' arguments, casts, ...)


def _number(node: Any) -> float | None:
    if isinstance(node, ast.A_Const) and isinstance(node.val, ast.Integer) \
            and node.val.ival is not None:
        return float(node.val.ival)
    return None


def _string(node: Any) -> str | None:
    if isinstance(node, ast.A_Const) and isinstance(node.val, ast.String):
        return str(node.val.sval)
    return None
