"""Analysis of a DP query: ownership rules (paper Table 2), total expressions, keys and aggregates.

Input: the statement text with its DP clause blanked out, the policy, and the
session's DP settings. Output: an `AnalyzedQuery` holding pglast AST pieces
that the rewriter assembles into the pushdown. Everything outside the rules is
refused with 0A000 naming the rule. Every expression that runs over user rows
is made total, so that whether the query fails never depends on one user's
data (paper §5.2): arithmetic runs in `numeric`, division goes through
`NULLIF(divisor, 0)`, and only functions known to be immutable and total for
all inputs are allowed.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from pglast import ast, parse_sql
from pglast.enums import A_Expr_Kind, BoolExprType, JoinType, MinMaxOp, NullTestType, SubLinkType
from pglast.parser import ParseError
from pglast.visitors import Visitor

from dp_core.cost import Cost, Linear, RowWorkBudget, row_cost
from dp_core.errors import (
    FeatureNotSupported,
    InternalError,
    InvalidParameterValue,
    StatementTooComplex,
    SyntaxError_,
)


class AggKind(Enum):
    COUNT = "count"
    """Rows per user and group, clamped to [0, U] (U = 1 unless given): a bounded sum."""
    COUNT_USERS = "count_users"
    """COUNT(DISTINCT uid): the number of users in the group."""
    COUNT_DISTINCT = "count_distinct"
    """COUNT(DISTINCT x) of anything but the uid: the distinct values in the group, each user
    adding at most k of its own (k = U, 1 unless given)."""
    SUM = "sum"
    AVG = "avg"
    VAR = "var"
    STDDEV = "stddev"
    QUANTILE = "quantile"
    """ANON_NTILE and its forms: a DP quantile of the users' own quantiles (dp_core.quantiles)."""


@dataclass(frozen=True)
class Bounds:
    lower: float
    upper: float


@dataclass(frozen=True)
class TableRef:
    """A protected table in the query's FROM: its alias and uid column."""

    name: str
    alias: str
    uid_column: str
    derived: bool = False
    """A subquery or WITH query over protected tables (no configured column bounds)."""
    bases: frozenset[str] = frozenset()
    """The protected tables whose rows it carries."""
    per_user: bool = False
    """At most one row per user (a subquery grouped by the uid alone)."""


@dataclass(frozen=True)
class Aggregate:
    kind: AggKind
    arg: ast.Node | None
    """The (totalised) argument; None for COUNT(*) and COUNT(DISTINCT uid)."""
    bounds: Bounds | None
    """Per-user contribution bounds: [0, U] for counts; None when APPROX_BOUNDS finds them."""
    output_name: str
    quantile: float | None = None
    """The quantile (0…1) of a QUANTILE aggregate."""

    @property
    def known_bounds(self) -> Bounds:
        if self.bounds is None:
            raise InternalError("bounds used before APPROX_BOUNDS found them (this is a bug)")
        return self.bounds


@dataclass(frozen=True)
class CastCheck:
    """A cast of column values that is total only for some source types, which the analysis
    cannot see: the server learns the source type from Postgres (`argument_probe_sql`) and
    `check_casts` refuses the query unless the cast is in TOTAL_CASTS."""

    arg: ast.Node
    """The (totalised) expression being cast."""
    target: str
    text: str
    """The cast as the analyst wrote it, for the refusal message."""
    scope: ast.SelectStmt | None = None
    """The inner query (subquery in FROM, or WITH query) whose FROM `arg` reads; None: the
    DP query's own FROM. Its FROM is final once the analysis is done."""
    rule: str | None = None
    """The refusal's rule when it is not a cast (an operand of `||` that is not text)."""
    sources: frozenset[str] | None = None
    """The source types accepted, where the check is not of a cast to `target` (a date/time
    function's unit, which fails on every value of the other types)."""


@dataclass(frozen=True)
class ArithmeticCheck:
    """An arithmetic operator as the analyst wrote it, whose type Postgres reports when the
    proxy prepares `argument_probe_sql` (t{i}): where it is an integer type, the analysis runs
    again with it (`analyze(..., integer_types=...)`) so that the total form keeps Postgres's
    integer semantics (`duration / 60` truncates) and type."""

    arg: ast.Node
    """The operator's expression, untouched (prepared, never run)."""
    location: int
    """Its offset in the statement: the key of `integer_types`."""
    scope: ast.SelectStmt | None = None


INTEGER_TYPES = frozenset({"int2", "int4", "int8"})


TOTAL_CASTS: dict[str, frozenset[str]] = {
    "int2": frozenset({"int2", "int4", "int8", "numeric", "float4", "float8"}),
    "int4": frozenset({"int4", "int8", "numeric", "float4", "float8"}),
    "int8": frozenset({"int8", "numeric", "float4", "float8"}),
    "float4": frozenset({"float4", "float8", "numeric"}),  # numeric holds NaN and ±Infinity
    "float8": frozenset({"float8", "numeric"}),
    "numeric": frozenset({"numeric"}),
    "bool": frozenset({"bool", "int4"}),
    "date": frozenset({"date"}),
    "timestamp": frozenset({"timestamp", "date"}),
    "timestamptz": frozenset({"timestamptz", "date"}),
    "text": frozenset({"text"}),
    "varchar": frozenset({"text"}),
    "bpchar": frozenset({"text"}),
}
"""Casts that succeed on every value of the source type (Postgres ≥ 14). Narrowing casts
(int8 → int4, float8 → float4, numeric → float8) overflow on some values; date → timestamp
fails out of range; text → anything fails on malformed input."""

_CHECKED_CAST_TARGETS = frozenset(t for targets in TOTAL_CASTS.values() for t in targets)
_LITERAL_CAST_TARGETS = _CHECKED_CAST_TARGETS | {
    "varchar", "bpchar", "char", "name", "time", "timetz", "interval", "uuid", "bool",
}
"""Built-in types a string literal may be cast to in a DP query: their input functions run
when the statement is planned (never on a row)."""
NUMBER_TYPES = frozenset({"int2", "int4", "int8", "numeric", "float4", "float8"})

def _is_number_valued(node: Any) -> bool:
    """Arithmetic or a numeric function's call: a number (never a boolean or text), so a cast
    of it to an integer type can be guarded by comparisons (`_guarded_integer_cast`)."""
    if isinstance(node, ast.A_Expr):
        return node.kind == A_Expr_Kind.AEXPR_OP and bool(node.name) \
            and str(node.name[-1].sval) in _ARITHMETIC
    return isinstance(node, ast.FuncCall) and _funcname(node) in _NUMERIC_ARG_FUNCTIONS


def check_casts(casts: Sequence[CastCheck], source_types: Sequence[str]) -> None:
    """Refuse the query unless every deferred cast is total for its source type."""
    for cast, source in zip(casts, source_types, strict=True):
        if cast.sources is not None:
            if source not in cast.sources:
                raise _refuse(f"{cast.rule}, not {source}", cast.text)
        elif cast.target not in TOTAL_CASTS.get(source, frozenset()):
            if cast.rule is not None:
                raise _refuse(f"{cast.rule}, not {source}", cast.text)
            raise _refuse(f"casts of column values from {source} to {cast.target} (they can "
                          "fail on some values)", cast.text)


@dataclass(frozen=True)
class Key:
    expr: ast.Node
    output_name: str
    hashed: bool = False
    """Matched between the pushdown's statements (a group's row and its quantile trees) by a
    hash of its value (`dp_h{i}`) instead of its text (`dp_t{i}`): for types whose equal
    values can print differently (numeric 1.0 = 1.00, float -0 = 0, ...)."""


@dataclass(frozen=True)
class OutputColumn:
    """One released column: a key or an aggregate (hidden when only an expression uses it)."""

    name: str
    key: int | None = None
    aggregate: int | None = None
    source: Any = field(default=None, compare=False)
    """The select-list expression it answers (to map HAVING / ORDER BY / expressions onto)."""


@dataclass(frozen=True)
class SelectItem:
    """One column the client sees: a released column, or an expression over released columns."""

    name: str
    column: int | None = None
    expr: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class TablePolicy:
    schema: str
    uid_column: str
    columns: Mapping[str, Bounds] = field(default_factory=dict)
    """Configured contribution bounds of numeric columns."""


@dataclass(frozen=True)
class AnalyzedQuery:
    """A validated DP query, in pieces for the rewriter."""

    from_clause: tuple[ast.Node, ...]
    where: ast.Node | None
    uid: ast.Node
    tables: tuple[TableRef, ...]
    keys: tuple[Key, ...]
    aggregates: tuple[Aggregate, ...]
    outputs: tuple[OutputColumn, ...]
    having: ast.Node | None
    order_by: tuple[ast.Node, ...]
    limit: ast.Node | None
    offset: ast.Node | None
    plain_form: bool
    """True for `SELECT k, COUNT(*) ...` without WITH ANONYMIZATION."""
    ctes: tuple[Any, ...] = ()
    """The query's (validated) WITH list, kept ahead of the pushdown's own."""
    select: tuple[SelectItem, ...] = ()
    """What the client sees, in select-list order."""
    casts: tuple[CastCheck, ...] = ()
    """Casts whose totality depends on their source type (see `check_casts`)."""
    arithmetic: tuple[ArithmeticCheck, ...] = ()
    """Arithmetic operators whose type decides their integer semantics (`ArithmeticCheck`)."""
    sublinks: tuple[ast.SelectStmt, ...] = ()
    """Its IN and EXISTS subqueries (total), which must plan alone (`Findings.sublinks`)."""
    relations: tuple[Relation, ...] = ()
    """The unprotected tables it reads by name (schema as written, or None; name): the
    server refuses the query unless each is one the analysts may read."""
    joins_capped: bool = False
    """Two protected FROM items are joined row by row somewhere: each reads at most
    JOIN_ROWS_PER_USER rows of a user."""
    outer: ast.SelectStmt | None = None
    """A query over this one's answer (`SELECT ... FROM (DP query) AS t WHERE ...`, as Power BI
    writes): post-processing, run over the released rows; its FROM item's subquery is
    replaced by the result query."""

    def with_bounds(self, found: Mapping[int, Bounds]) -> AnalyzedQuery:
        """The query with bounds (from APPROX_BOUNDS) filled in for the given aggregates."""
        aggregates = tuple(replace(a, bounds=found[i]) if i in found else a
                           for i, a in enumerate(self.aggregates))
        return replace(self, aggregates=aggregates)

    def with_hashed_keys(self, hashed: Iterable[int]) -> AnalyzedQuery:
        """The query with the given keys matched by hash (`Key.hashed`)."""
        which = set(hashed)
        return replace(self, keys=tuple(replace(k, hashed=i in which)
                                        for i, k in enumerate(self.keys)))

    @property
    def has_quantiles(self) -> bool:
        return any(a.kind is AggKind.QUANTILE for a in self.aggregates)

    @property
    def keys_read_uid(self) -> bool:
        """Whether a group key reads a protected table's uid column (by name)."""
        names = {t.uid_column for t in self.tables}
        return any(isinstance(n, ast.ColumnRef) and getattr(n.fields[-1], "sval", "") in names
                   for k in self.keys for n in _walk(k.expr))


# ---------------------------------------------------------------------------- functions

ANON_FUNCTIONS = {
    "anon_count": AggKind.COUNT, "anon_sum": AggKind.SUM, "anon_avg": AggKind.AVG,
    "anon_var": AggKind.VAR, "anon_stddev": AggKind.STDDEV,
}
PLAIN_FUNCTIONS = {
    "count": AggKind.COUNT, "sum": AggKind.SUM, "avg": AggKind.AVG,
    "variance": AggKind.VAR, "var_samp": AggKind.VAR, "var_pop": AggKind.VAR,
    "stddev": AggKind.STDDEV, "stddev_samp": AggKind.STDDEV, "stddev_pop": AggKind.STDDEV,
}
QUANTILE_FUNCTIONS = frozenset({"anon_ntile", "anon_median", "anon_min", "anon_max",
                                "percentile_cont", "min", "max"})
"""DP quantiles: ANON_NTILE(x, p[, L, U]), ANON_MEDIAN/MIN/MAX(x[, L, U]), PERCENTILE_CONT in
the plain form (p) WITHIN GROUP (ORDER BY x) and the BigQuery form (x, p[, L, U]), MIN/MAX."""
_QUANTILE_OF = {"anon_median": 0.5, "anon_min": 0.0, "anon_max": 1.0, "min": 0.0, "max": 1.0}
LATER_FUNCTIONS = frozenset({"approx_bounds", "percentile_disc", "median", "mode"})

# Immutable functions that cannot raise for any argument values of the types they accept.
TOTAL_FUNCTIONS = frozenset({
    "lower", "upper", "length", "char_length", "character_length", "octet_length", "bit_length",
    "btrim", "ltrim", "rtrim", "md5", "concat", "initcap", "reverse", "ascii",
    "abs", "sign", "round", "floor", "ceil", "ceiling", "trunc", "greatest", "least",
    "isfinite", "date_trunc", "date_part", "extract", "coalesce", "nullif", "num_nulls",
    "num_nonnulls",
})
def _integer_literal(node: Any, low: float = -2**31, high: float = 2**31 - 1) -> bool:
    value = const_number(node)
    return value is not None and value.is_integer() and low <= value <= high


def _start_and_length(a: list[Any]) -> bool:
    return len(a) in (1, 2) and _integer_literal(a[0]) and (len(a) == 1 or _integer_literal(a[1], 0))


def _pad(a: list[Any]) -> bool:
    return len(a) in (1, 2) and _integer_literal(a[0], 0, 10_000) \
        and all(const_string(x) is not None for x in a[1:])


def _one_string(a: list[Any]) -> bool:
    return len(a) == 1 and const_string(a[0]) is not None


_LITERAL_ARGUMENT_FUNCTIONS: dict[str, tuple[Callable[[list[Any]], bool], str]] = {
    "substring": (_start_and_length, "(x, integer start [, length >= 0]); the "
                                     "regular-expression forms are refused"),
    "substr": (_start_and_length, "(x, integer start [, length >= 0])"),
    "left": (lambda a: len(a) == 1 and _integer_literal(a[0]), "(x, integer)"),
    "right": (lambda a: len(a) == 1 and _integer_literal(a[0]), "(x, integer)"),
    "split_part": (lambda a: len(a) == 2 and const_string(a[0]) is not None
                   and _integer_literal(a[1], 1),  # (a negative field fails before Postgres 14)
                   "(x, 'delimiter', field >= 1)"),
    "replace": (lambda a: len(a) == 2 and all(const_string(x) is not None for x in a),
                "(x, 'from', 'to')"),
    "strpos": (_one_string, "(x, 'text')"),
    "position": (_one_string, "('text' IN x)"),
    "lpad": (_pad, "(x, length 0 to 10000 [, 'fill'])"),
    "rpad": (_pad, "(x, length 0 to 10000 [, 'fill'])"),
}
"""Text functions that fail only on some arguments, allowed when every argument after the
value is a literal that cannot make them fail (the value is made total as any other): the
check of those arguments, and the shape the refusal names."""
_NUMERIC_ARG_FUNCTIONS = frozenset({"abs", "sign", "round", "floor", "ceil", "ceiling", "trunc"})
_DATE_UNITS = frozenset({
    "microseconds", "milliseconds", "second", "minute", "hour", "day", "week", "month", "quarter",
    "year", "decade", "century", "millennium", "dow", "doy", "isodow", "isoyear", "epoch",
})
_TIME_OF_DAY = frozenset({"microseconds", "milliseconds", "second", "minute", "hour"})
_SPANS = _TIME_OF_DAY | {"day", "month", "quarter", "year", "decade", "century", "millennium"}
DATETIME_UNITS: dict[tuple[str, str], frozenset[str]] = {
    ("date_trunc", "timestamp"): _TIME_OF_DAY | {"day", "week", "month", "quarter", "year"},
    ("date_trunc", "timestamptz"): _TIME_OF_DAY | {"day", "week", "month", "quarter", "year"},
    ("date_part", "timestamp"): _DATE_UNITS,
    ("date_part", "timestamptz"): _DATE_UNITS,
    ("date_part", "interval"): _SPANS | {"epoch"},
    ("date_part", "time"): _TIME_OF_DAY | {"epoch"},
    ("date_part", "timetz"): _TIME_OF_DAY | {"epoch"},
    ("extract", "timestamp"): _DATE_UNITS,
    ("extract", "timestamptz"): _DATE_UNITS,
    ("extract", "date"): _DATE_UNITS - _TIME_OF_DAY,
    ("extract", "interval"): _SPANS | {"epoch"},
    ("extract", "time"): _TIME_OF_DAY | {"epoch"},
    ("extract", "timetz"): _TIME_OF_DAY | {"epoch"},
}
"""The units each date/time function takes without failing on any value of the argument's
type (from the first to the last representable one, infinities included, in any time zone;
checked against Postgres by tests/test_attacks.py), date_trunc as `datetime_call` writes it.
Elsewhere it fails on some values only (date_trunc to the decade overflows near the end of
timestamps' range) or on every one (extract(hour FROM date)), and a date reaches date_trunc
and date_part only through a cast to timestamp that fails past 294276 AD: refused when the
query is planned, from the argument's type."""
_TRUNCATED_RANGE = ("4713-01-01 BC", "294276-01-01")
"""date_trunc's argument is truncated only inside this range (or infinite), NULL outside: at
the first representable months (4714-11-24 BC) truncating to the month or year fails, and
in a time zone west or east of UTC so does truncating a timestamptz near either end."""


def datetime_call(fc: ast.FuncCall, value: ast.Node) -> ast.Node:
    """The total form of a date/time function call whose unit is checked: date_trunc's value
    kept inside `_TRUNCATED_RANGE` (or infinite), else NULL; extract and date_part as they are."""
    if _funcname(fc) != "date_trunc":
        return fc
    low, high = (ast.A_Const(val=ast.String(sval=v)) for v in _TRUNCATED_RANGE)
    inside = ast.A_Expr(kind=A_Expr_Kind.AEXPR_BETWEEN, name=(ast.String(sval="BETWEEN"),),
                        lexpr=copy.deepcopy(value), rexpr=(low, high))
    infinite = ast.BoolExpr(boolop=BoolExprType.NOT_EXPR, args=(ast.FuncCall(
        funcname=(ast.String(sval="isfinite"),), args=(copy.deepcopy(value),)),))
    test = ast.BoolExpr(boolop=BoolExprType.OR_EXPR, args=(inside, infinite))
    return ast.CaseExpr(args=(ast.CaseWhen(expr=test, result=fc),))
MAX_MAGNITUDE = 1e300
"""Arithmetic in a DP query runs in numeric with every operand and result clamped to
±MAX_MAGNITUDE (`_clamped`): a product of two is within numeric's range (10^131072), so no
value of any row can overflow it; number literals in arithmetic must lie within it."""
MAX_DIGITS = 100
"""The most digits round(x, d) and trunc(x, d) may keep (numeric keeps up to 16383: a value
that long per row would be a lever on the time a query takes)."""
MAX_BOUND = 1e100
"""Largest magnitude of a contribution bound: the sum of a bounded value over every user
(and its noise) stays far inside float8's range."""
_TOTAL_OPERATORS = frozenset({"=", "<>", "!=", "<", ">", "<=", ">="})
_ARITHMETIC = frozenset({"+", "-", "*", "/", "%"})
_SYSTEM_SCHEMAS = frozenset({"pg_catalog", "information_schema", "pg_toast"})


def _refuse(rule: str, fragment: str = "") -> FeatureNotSupported:
    where = f": {fragment}" if fragment else ""
    return FeatureNotSupported(f"not allowed in a DP query ({rule}){where}")


def _funcname(fc: ast.FuncCall) -> str:
    return str(fc.funcname[-1].sval).lower()


def _sql(node: Any) -> str:
    from pglast.stream import RawStream

    try:
        text = str(RawStream()(node))
    except Exception:  # pragma: no cover - printing only feeds error messages
        return type(node).__name__
    finally:
        # pglast's printer leaves on each node it printed an `ancestors` chain that links the
        # whole tree: a later deepcopy of the node would walk it (and exhaust the stack)
        for n in _walk(node):
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


def _numeric(node: ast.Node) -> ast.Node:
    return ast.TypeCast(arg=node, typeName=ast.TypeName(names=(ast.String(sval="numeric"),)))


def _as_integer(value: ast.Node, type_name: str) -> ast.Node:
    """Exact, integer-valued arithmetic `value` as Postgres's integer type `type_name`: cast
    where it is in the type's range, else NULL (where Postgres would fail: overflow)."""
    low, high = _INTEGER_LIMITS[type_name]
    inside = ast.A_Expr(kind=A_Expr_Kind.AEXPR_BETWEEN, name=(ast.String(sval="BETWEEN"),),
                        lexpr=copy.deepcopy(value),
                        rexpr=(ast.A_Const(val=ast.Float(fval=low)),
                               ast.A_Const(val=ast.Float(fval=high))))
    cast = ast.TypeCast(arg=value, typeName=ast.TypeName(names=(ast.String(sval=type_name),)))
    return ast.CaseExpr(args=(ast.CaseWhen(expr=inside, result=cast),))


_INTEGER_LIMITS = {"int2": ("-32768", "32767"), "int4": ("-2147483648", "2147483647"),
                   "int8": ("-9223372036854775808", "9223372036854775807")}


def _nullif_zero(node: ast.Node) -> ast.Node:
    zero = ast.A_Const(val=ast.Integer(ival=0))
    return ast.A_Expr(kind=A_Expr_Kind.AEXPR_NULLIF, name=(ast.String(sval="="),),
                      lexpr=_numeric(node), rexpr=zero)


def _clamped(node: ast.Node) -> ast.Node:
    """`node` as numeric within ±MAX_MAGNITUDE (NaN and +Infinity to the top, -Infinity to the
    bottom: NaN sorts above every number); a number literal is checked instead."""
    value = const_number(node)
    if value is not None:
        if not abs(value) <= MAX_MAGNITUDE:
            raise _refuse(f"number literals in arithmetic beyond ±{MAX_MAGNITUDE:g}", _sql(node))
        return _numeric(node)

    def limit(kind: MinMaxOp, value: str, arg: ast.Node) -> ast.Node:
        return ast.MinMaxExpr(op=kind, args=(arg, _numeric(ast.A_Const(val=ast.Float(
            fval=value)))))

    low = limit(MinMaxOp.IS_GREATEST, f"-{MAX_MAGNITUDE:g}", _numeric(node))
    return limit(MinMaxOp.IS_LEAST, f"{MAX_MAGNITUDE:g}", low)


# ---------------------------------------------------------------------------- clauses

Relation = tuple[str | None, str]
"""An unprotected table a DP query reads: (schema as written, or None; name)."""

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


def _only_clauses(sel: ast.SelectStmt, allowed: Iterable[str], scope: str) -> None:
    """Refuse every clause of `sel` that is present and not in `allowed`: the rules accept a
    SELECT clause by clause, so a clause no rule handles (or one a later pglast adds) never
    runs unchecked as the pushdown role."""
    accepted = frozenset(allowed)
    for name in sel:
        value = getattr(sel, name)
        present = value == _WITH_TIES if name == "limitOption" else bool(value)
        if present and name not in accepted:
            raise _refuse(f"{_CLAUSES.get(name, name)} in {scope}", _sql(sel))


_OWNED_CLAUSES = ("targetList", "fromClause", "whereClause", "groupClause")
_PUBLIC_CLAUSES = ("targetList", "fromClause", "whereClause")


# ---------------------------------------------------------------------------- totality


@dataclass
class Findings:
    """What the analysis of one query collects in all its scopes, for checks that need
    Postgres (types, privileges) or the whole query (the work per row)."""

    casts: list[CastCheck] = field(default_factory=list)
    """Casts whose totality depends on their argument's type, which Postgres reports when
    the proxy prepares `argument_probe_sql`."""
    arithmetic: list[ArithmeticCheck] = field(default_factory=list)
    """Arithmetic operators of the analyst's text, whose types the proxy asks Postgres."""
    relations: list[Relation] = field(default_factory=list)
    """The unprotected tables the query reads by name, which the server checks the analysts
    may read (`AnalyzedQuery.relations`)."""
    shapes: dict[Any, tuple[frozenset[str], bool]] = field(default_factory=dict)
    """Each inner query over protected tables (by id of its node, and each WITH query also by
    name): the protected tables whose rows it carries, and whether it has one row per user."""
    row_names: set[str] = field(default_factory=set)
    """The names of FROM items in every scope: a bare column reference of one of them is a
    whole row (whose comparisons fail on some values), refused."""
    sublinks: list[ast.SelectStmt] = field(default_factory=list)
    """Subqueries in IN and EXISTS, which the server prepares alone: they must not read the
    DP query's row (a correlated subquery runs once per row, over a whole public table)."""
    costs: list[tuple[Cost, str, Any]] = field(default_factory=list)
    """Each expression a row meets (its bound from `dp_core.cost`, where it is, the node)."""
    work: Linear = field(default_factory=Linear)
    """The sum of their work."""
    budget: RowWorkBudget = field(default_factory=RowWorkBudget)
    joins_capped: bool = False
    """Some scope joins two protected items row by row (`_FromAnalysis.capped_joins`)."""
    """The most work per row the query's expressions may do together."""


class Totalizer:
    """Checks an expression over user rows and returns a total version of it."""

    def __init__(self, protected_names: frozenset[str], findings: Findings | None = None,
                 scope: ast.SelectStmt | None = None,
                 integer_types: Mapping[int, str] | None = None) -> None:
        self.protected_names = protected_names
        self.findings = Findings() if findings is None else findings
        """Shared by the query's scopes."""
        self.casts = self.findings.casts
        self.arithmetic = self.findings.arithmetic
        self.relations = self.findings.relations
        self.integer_types: Mapping[int, str] = integer_types or {}
        """The integer type of the arithmetic operators that have one, by location."""
        self._in_arithmetic = 0
        """How many arithmetic operators the expression being totalised is inside."""
        self.scope = scope
        """The inner query whose FROM the expressions read (None: the DP query's own)."""
        self.semi_joins: Callable[[ast.SubLink], ast.SubLink] | None = None
        """Checks an IN or EXISTS subquery of the DP query's WHERE (`_semi_join`); None: every
        subquery is refused."""

    def inner(self, scope: ast.SelectStmt) -> Totalizer:
        """The totaliser of an inner query's expressions (its casts are checked in its FROM)."""
        return Totalizer(self.protected_names, self.findings, scope, self.integer_types)

    def with_semi_joins(self, check: Callable[[ast.SubLink], ast.SubLink]) -> Totalizer:
        """This totaliser, with IN and EXISTS subqueries accepted where `check` accepts them."""
        other = Totalizer(self.protected_names, self.findings, self.scope, self.integer_types)
        other.semi_joins = check
        return other

    def __call__(self, node: Any, context: str) -> Any:
        """A total copy of `node` (the original is left as the client wrote it); its work per
        row is noted (`Findings.costs`)."""
        # (the expression's text is printed only for a refusal: pglast's printer leaves the
        # nodes it printed too deep for deepcopy)
        cost = row_cost(node)
        found = self.findings
        found.costs.append((cost, context, node))
        found.work = found.work + cost.work
        # far over the budget, refused before the total form is written (which copies some
        # arguments: nested, their copies multiply); else after its own rules had their say
        budget = found.budget
        _check_work(found, RowWorkBudget(budget.per_byte * 1000, budget.fixed * 1000), budget)
        total = self._total(copy.deepcopy(node), context)
        _check_work(found, budget)
        return total

    def _total(self, node: Any, ctx: str) -> Any:
        if node is None or isinstance(node, (ast.A_Const, ast.ColumnRef, ast.ParamRef)):
            if isinstance(node, ast.ColumnRef) and isinstance(node.fields[-1], ast.A_Star):
                raise _refuse("* outside COUNT(*)", ctx)
            if isinstance(node, ast.ColumnRef) and len(node.fields) == 1 \
                    and str(node.fields[0].sval) in self.findings.row_names:
                raise _refuse("whole-row references (name the columns)", _sql(node))
            return node
        if isinstance(node, ast.BoolExpr):
            node.args = tuple(self._total(a, ctx) for a in node.args)
            return node
        if isinstance(node, (ast.NullTest, ast.BooleanTest)):
            node.arg = self._total(node.arg, ctx)
            return node
        if isinstance(node, ast.A_Expr):
            return self._a_expr(node, ctx)
        if isinstance(node, ast.CaseExpr):
            node.arg = self._total(node.arg, ctx)
            node.args = tuple(self._total(w, ctx) for w in node.args)
            node.defresult = self._total(node.defresult, ctx)
            return node
        if isinstance(node, ast.CaseWhen):
            node.expr = self._total(node.expr, ctx)
            node.result = self._total(node.result, ctx)
            return node
        if isinstance(node, (ast.CoalesceExpr, ast.MinMaxExpr)):
            node.args = tuple(self._total(a, ctx) for a in node.args)
            return node
        if isinstance(node, ast.TypeCast):
            return self._cast(node, ctx)
        if isinstance(node, ast.FuncCall):
            return self._function(node, ctx)
        if isinstance(node, ast.SubLink):
            if self.semi_joins is None:
                raise _refuse("subqueries inside a DP query (but IN or EXISTS over "
                              "unprotected tables in WHERE)", ctx)
            link = self.semi_joins(node)
            link.testexpr = self._total(link.testexpr, ctx)
            return link
        if isinstance(node, ast.SQLValueFunction):
            raise _refuse("only immutable functions", _sql(node))
        raise _refuse(f"expression of type {type(node).__name__}", _sql(node))

    def _a_expr(self, node: ast.A_Expr, ctx: str) -> Any:
        kind = node.kind
        op = str(node.name[-1].sval) if node.name else ""
        if node.name and len(node.name) > 1 and str(node.name[0].sval) != "pg_catalog":
            raise _refuse("only built-in operators", _sql(node))
        if kind == A_Expr_Kind.AEXPR_OP:
            if op in _TOTAL_OPERATORS:
                node.lexpr, node.rexpr = self._total(node.lexpr, ctx), self._total(node.rexpr, ctx)
                return node
            if op in _ARITHMETIC:
                # exact numeric arithmetic cannot overflow on column values; x/0 is NULL
                location = node.location if isinstance(node.location, int) else -1
                if location >= 0:
                    self.arithmetic.append(ArithmeticCheck(copy.deepcopy(node), location,
                                                           self.scope))
                outermost = not self._in_arithmetic
                self._in_arithmetic += 1
                try:
                    left = None if node.lexpr is None else self._total(node.lexpr, ctx)
                    right = self._total(node.rexpr, ctx)
                finally:
                    self._in_arithmetic -= 1
                node.lexpr = None if left is None else _clamped(left)
                node.rexpr = _nullif_zero(_clamped(right)) if op in ("/", "%") \
                    else _clamped(right)
                integer = self.integer_types.get(location)
                if integer is None:
                    return _clamped(node) if outermost else node
                # Postgres's integer semantics: a quotient truncated toward zero; the type
                # (and its range) only where the arithmetic ends, inner values being exact
                value = ast.FuncCall(funcname=(ast.String(sval="trunc"),), args=(node,)) \
                    if op == "/" else node
                return _as_integer(value, integer) if outermost else value
            if op == "||":
                return self._concatenation(node, ctx)
            raise _refuse(f"operator {op} (it can fail on some values)", _sql(node))
        if kind in (A_Expr_Kind.AEXPR_IN, A_Expr_Kind.AEXPR_DISTINCT, A_Expr_Kind.AEXPR_NOT_DISTINCT,
                    A_Expr_Kind.AEXPR_BETWEEN, A_Expr_Kind.AEXPR_NOT_BETWEEN,
                    A_Expr_Kind.AEXPR_NULLIF):
            node.lexpr = self._total(node.lexpr, ctx)
            if isinstance(node.rexpr, (tuple, list)):
                node.rexpr = tuple(self._total(r, ctx) for r in node.rexpr)
            else:
                node.rexpr = self._total(node.rexpr, ctx)
            return node
        if kind in (A_Expr_Kind.AEXPR_LIKE, A_Expr_Kind.AEXPR_ILIKE):
            pattern = const_string(node.rexpr)
            if pattern is None:
                raise _refuse("LIKE patterns must be constant strings", _sql(node))
            trailing = len(pattern) - len(pattern.rstrip("\\"))
            if trailing % 2:
                raise SyntaxError_("LIKE pattern must not end with escape character")
            node.lexpr = self._total(node.lexpr, ctx)
            return node
        raise _refuse("this operator kind (regular expressions, SIMILAR TO, ...)", _sql(node))

    def _cast(self, node: ast.TypeCast, ctx: str) -> Any:
        target = str(node.typeName.names[-1].sval).lower()
        names = node.typeName.names
        builtin = (len(names) == 1 or str(names[0].sval) == "pg_catalog") \
            and not node.typeName.arrayBounds and not node.typeName.setof
        if isinstance(node.arg, ast.A_Const):
            # a literal converted when the pushdown is planned (a string by the type's input,
            # a number by an immutable cast): fails, if at all, before any row. Not a domain,
            # whose check runs on each row, nor a type whose conversion is not immutable
            literal_targets = _LITERAL_CAST_TARGETS if isinstance(node.arg.val, ast.String) \
                else _CHECKED_CAST_TARGETS | {"text", "varchar"}
            if not builtin or target not in literal_targets:
                raise _refuse(f"casts of literals to {target}", _sql(node))
            return node
        if builtin and target in ("text", "varchar"):
            node.arg = self._total(node.arg, ctx)
            return node
        if builtin and target in _INTEGER_LIMITS and _is_number_valued(node.arg) \
                and not node.typeName.typmods and not node.typeName.arrayBounds:
            return self._guarded_integer_cast(node, target, ctx)
        if builtin and target in _CHECKED_CAST_TARGETS \
                and not node.typeName.typmods and not node.typeName.arrayBounds:
            text = _sql(node)
            node.arg = self._total(node.arg, ctx)
            self.casts.append(CastCheck(copy.deepcopy(node.arg), target, text, self.scope))
            return node
        raise _refuse(f"casts of column values to {target} (they can fail on some values)",
                      _sql(node))

    def number(self, value: ast.Node, rule: str, text: str) -> ast.Node:
        """`value` (totalised) as numeric, checked when the query is planned to be a number:
        a cast of text to numeric would parse each row's value, and fail on some."""
        checked = isinstance(value, ast.TypeCast) and \
            str(value.typeName.names[-1].sval).lower() in NUMBER_TYPES  # (checked as a cast)
        if const_number(value) is None and not checked:
            self.casts.append(CastCheck(copy.deepcopy(value), "numeric", text, self.scope,
                                        rule=rule, sources=NUMBER_TYPES))
        return _numeric(value)

    def _concatenation(self, node: ast.A_Expr, ctx: str) -> ast.A_Expr:
        """`a || b` of text cannot fail (as concat() cannot), but `||` of arrays can: each
        operand that is not a literal or another `||` must be text, which Postgres reports
        when the query is planned (a CastCheck to text, accepted from text, varchar, bpchar)."""
        text = _sql(node)
        for side in ("lexpr", "rexpr"):
            operand = getattr(node, side)
            total = self._total(operand, ctx)
            setattr(node, side, total)
            if operand is None or isinstance(operand, ast.A_Const) or (
                    isinstance(operand, ast.A_Expr) and operand.kind == A_Expr_Kind.AEXPR_OP
                    and operand.name and str(operand.name[-1].sval) == "||"):
                continue
            self.casts.append(CastCheck(copy.deepcopy(total), "text", text, self.scope,
                                        rule="operands of || must be text"))
        return node

    def _width_bucket(self, fc: ast.FuncCall, args: list[Any], ctx: str) -> ast.Node:
        """`width_bucket(x, low, high, n)` (a histogram's bins): it fails on NaN bounds or
        operand, infinite or equal bounds and n <= 0, so the bounds and n must be literals
        that cannot make it fail, and a NaN x gives NULL (`x::numeric = 'NaN'`: every number
        type casts to numeric, ±Infinity included, and Postgres's NaN equals NaN)."""
        low, high = (const_number(a) for a in args[1:3]) if len(args) == 4 else (None, None)
        if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)) \
                or low == high or not _integer_literal(args[3], 1, 2**31 - 2):
            raise _refuse("width_bucket() but as width_bucket(x, low, high, n) with finite, "
                          "different literal bounds and a literal n >= 1", _sql(fc))
        value = self._total(args[0], ctx)
        fc.args = (value, *args[1:])
        nan = ast.A_Expr(kind=A_Expr_Kind.AEXPR_OP, name=(ast.String(sval="="),),
                         lexpr=_numeric(copy.deepcopy(value)),
                         rexpr=_numeric(ast.A_Const(val=ast.String(sval="NaN"))))
        return ast.CaseExpr(args=(ast.CaseWhen(expr=nan, result=ast.A_Const(isnull=True)),),
                            defresult=fc)

    def _guarded_integer_cast(self, node: ast.TypeCast, target: str, ctx: str) -> ast.Node:
        """`(duration / 60)::int`: a number cast to an integer type, made total. The argument
        is arithmetic or a numeric function (`_is_number_valued`), numeric once totalised, and
        its cast rounds as round(numeric) does and fails out of range, on NaN and ±Infinity:
        so the rounded value is cast where it is in range, else NULL (`_as_integer`; NaN
        sorts above every number)."""
        rounded = ast.FuncCall(funcname=(ast.String(sval="round"),),
                               args=(self._total(node.arg, ctx),))
        return _as_integer(rounded, target)

    def _function(self, fc: ast.FuncCall, ctx: str) -> Any:
        name = _funcname(fc)
        if fc.over is not None:
            raise _refuse("window functions", _sql(fc))
        if _is_dp_aggregate(name) or name in LATER_FUNCTIONS:
            raise _refuse("aggregates inside expressions or in WHERE", _sql(fc))
        if len(fc.funcname) > 1 and str(fc.funcname[0].sval) != "pg_catalog":
            raise _refuse("only built-in functions", _sql(fc))
        if name not in TOTAL_FUNCTIONS and name not in _LITERAL_ARGUMENT_FUNCTIONS \
                and name != "width_bucket":
            raise _refuse(f"function {name}() (only immutable built-ins that cannot fail are "
                          f"allowed: {', '.join(sorted(TOTAL_FUNCTIONS))}, and "
                          f"{', '.join(sorted(_LITERAL_ARGUMENT_FUNCTIONS))} with literal "
                          "arguments after the first)", _sql(fc))
        if fc.agg_star or fc.agg_distinct or fc.agg_order or fc.agg_filter or fc.func_variadic:
            raise _refuse("aggregate syntax on a plain function", _sql(fc))
        args = list(fc.args or ())
        if name == "width_bucket":
            return self._width_bucket(fc, args, ctx)
        if name in _LITERAL_ARGUMENT_FUNCTIONS:
            check, shape = _LITERAL_ARGUMENT_FUNCTIONS[name]
            if not check(args[1:]):
                raise _refuse(f"{name}() but as {name}{shape}: literal arguments after the "
                              "value, which cannot make it fail", _sql(fc))
            args[:1] = [self._total(a, ctx) for a in args[:1]]
        elif name in ("date_trunc", "date_part", "extract"):
            unit = const_string(args[0]) if args else None
            if unit is None or unit.lower() not in _DATE_UNITS:
                raise _refuse(f"{name}() needs a constant, valid unit", _sql(fc))
            if len(args) != 2:
                raise _refuse(f"{name}() but as {name}('unit', x)", _sql(fc))
            args[1:] = [self._total(a, ctx) for a in args[1:]]
            unit = unit.lower()
            types = frozenset(t for (f, t), units in DATETIME_UNITS.items()
                              if f == name and unit in units)
            shown = ", ".join(sorted(types)) or "no type"
            self.casts.append(CastCheck(
                copy.deepcopy(args[1]), "", _sql(fc), self.scope, sources=types,
                rule=f"{name}() with the unit {unit} takes {shown} (it fails on some values "
                     "of other types)"))
            fc.args = tuple(args)
            return datetime_call(fc, args[1])
        elif name in _NUMERIC_ARG_FUNCTIONS:
            if name in ("round", "trunc") and len(args) == 2 and not _integer_literal(
                    args[1], -MAX_DIGITS, MAX_DIGITS):
                raise _refuse(f"{name}() needs a constant number of digits from {-MAX_DIGITS} "
                              f"to {MAX_DIGITS}", _sql(fc))
            args[0] = self.number(self._total(args[0], ctx), f"{name}() of a number", _sql(fc))
        else:
            args = [self._total(a, ctx) for a in args]
        fc.args = tuple(args)
        return fc


# ---------------------------------------------------------------------------- FROM clause


JOIN_ROWS_PER_USER = 100
"""Where two protected FROM items are joined row by row, the rows of each user each of them
reads (`_FromAnalysis.capped_joins`): the join then makes at most 100² rows per user."""


def _capped(node: Any, table: TableRef) -> ast.RangeSubselect:
    """`node`, a protected FROM item, as a subquery of the same name that reads at most
    JOIN_ROWS_PER_USER rows of each user, chosen from the user's own rows alone: those of a
    table with the lowest hash of their place in it (ctid: cheap, and the same in each
    statement of one snapshot), those of an inner query with the lowest hash of the whole
    row. Its columns are the item's and dp_rn (the row's rank within its user's): a condition
    on the uid still reaches the table's index."""
    alias, uid = _quote(table.alias), _quote(table.uid_column)
    row = f"{alias}::text" if table.derived else f"{alias}.ctid::text"
    sub = parse_sql(
        f"SELECT * FROM (SELECT {alias}.*, row_number() OVER (PARTITION BY {alias}.{uid} "
        f"ORDER BY hashtextextended({row}, 0)) AS dp_rn FROM dp_capped) AS dp_c "
        f"WHERE dp_c.dp_rn <= {JOIN_ROWS_PER_USER}")[0].stmt
    sub.fromClause[0].subquery.fromClause = (node,)
    return ast.RangeSubselect(subquery=sub, alias=ast.Alias(aliasname=table.alias))


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _no_column_aliases(rv: ast.RangeVar) -> None:
    """`FROM visits AS v (browser, uid)` renames columns by position: v.uid would be the
    browser, and the privacy unit with it. Refused for every relation with user rows."""
    if rv.alias is not None and rv.alias.colnames:
        raise _refuse("column aliases on a table with user rows (they would rename its uid)",
                      _sql(rv))


def _public_relation(rv: ast.RangeVar, ctes: Mapping[str, str | None],
                     totalize: Totalizer) -> None:
    """An unprotected table (or a WITH query) read by name in a DP query: never a system
    catalog; recorded for the server, which refuses it unless the analysts may read it."""
    name = str(rv.relname)
    schema = str(rv.schemaname) if rv.schemaname else None
    if schema in _SYSTEM_SCHEMAS or name.startswith("pg_") or rv.catalogname:
        raise _refuse("system catalogs", name)
    if schema is None and name in ctes:
        return
    totalize.relations.append((schema, name))


class _FromAnalysis:
    """Walks FROM: finds protected tables, checks joins between them equate their uids."""

    def __init__(self, policy: Mapping[str, TablePolicy], totalize: Totalizer,
                 ctes: Mapping[str, str | None] | None = None) -> None:
        self.policy = policy
        self.totalize = totalize
        self.ctes = dict(ctes or {})
        """Common table expressions in scope: name → uid column (None: no protected rows)."""
        self.tables: list[TableRef] = []
        self.uid_equalities: list[tuple[str, str]] = []
        self.using: list[tuple[set[str], str]] = []
        self.names: set[str] = set()
        """The names of the scope's FROM items (aliases, or table names)."""
        self.nullable: set[str] = set()
        """Aliases of protected FROM items that an outer join can null (their uid is then
        NULL in rows they have no part in)."""
        self.nodes: dict[str, Any] = {}
        """Each protected FROM item's node, by alias (for `capped_joins`)."""

    def item(self, node: Any) -> Any:
        if isinstance(node, ast.RangeVar):
            return self._range_var(node)
        if isinstance(node, ast.JoinExpr):
            if node.isNatural:
                raise _refuse("NATURAL JOIN (name the join columns)", _sql(node))
            if node.alias is not None:  # (it hides the names inside: a.uid could be another a's)
                raise _refuse("an alias on a join (name its tables instead)", _sql(node))
            if node.jointype not in (JoinType.JOIN_INNER, JoinType.JOIN_LEFT, JoinType.JOIN_RIGHT,
                                     JoinType.JOIN_FULL):
                raise _refuse("this kind of join", _sql(node))
            before = len(self.tables)
            node.larg = self.item(node.larg)
            mid = len(self.tables)
            node.rarg = self.item(node.rarg)
            left = {t.alias for t in self.tables[before:mid]}
            right = {t.alias for t in self.tables[mid:]}
            if node.jointype in (JoinType.JOIN_LEFT, JoinType.JOIN_FULL):
                self.nullable |= right
            if node.jointype in (JoinType.JOIN_RIGHT, JoinType.JOIN_FULL):
                self.nullable |= left
            if node.usingClause:
                cols = {str(c.sval) for c in node.usingClause}
                for alias in left | right:
                    uid = self._by_alias(alias).uid_column
                    if left and right and uid in cols:
                        self.using.append((left | right, uid))
            if node.quals is not None:
                self._collect_uid_equalities(node.quals)
                node.quals = self.totalize(node.quals, "JOIN condition")
            return node
        if isinstance(node, ast.RangeSubselect):
            if node.lateral:
                raise _refuse("LATERAL subqueries", _sql(node))
            if node.alias is None:
                raise _refuse("a subquery in FROM needs an alias", _sql(node))
            sub_uid = _owned_subquery(node.subquery, self.policy,
                                      self.totalize.inner(node.subquery), self.ctes)
            alias = str(node.alias.aliasname)
            self._named(alias)
            if sub_uid is not None:
                if node.alias.colnames:
                    raise _refuse("column aliases on a subquery that reads protected tables", alias)
                bases, per_user = self.totalize.findings.shapes[id(node.subquery)]
                self.tables.append(TableRef(alias, alias, sub_uid, derived=True, bases=bases,
                                            per_user=per_user))
                self.nodes[alias] = node
            return node
        if isinstance(node, (ast.RangeFunction, ast.RangeTableFunc)):
            raise _refuse("functions in FROM", _sql(node))
        if isinstance(node, ast.RangeTableSample):
            raise _refuse("TABLESAMPLE (a DP query reads every row it selects)", _sql(node))
        raise _refuse(f"FROM item {type(node).__name__}", _sql(node))

    def _named(self, alias: str) -> None:
        """Every FROM item of a scope has its own name (Postgres checks it too, but not
        across a join's alias): the analysis reads `alias.uid` as that item's."""
        if alias in self.names:
            raise _refuse("the same alias twice", alias)
        self.names.add(alias)
        self.totalize.findings.row_names.add(alias)

    def _range_var(self, rv: ast.RangeVar) -> ast.RangeVar:
        name = str(rv.relname)
        schema = str(rv.schemaname) if rv.schemaname else None
        alias = str(rv.alias.aliasname) if rv.alias else name
        self._named(alias)
        if (schema in _SYSTEM_SCHEMAS) or name.startswith("pg_"):
            raise _refuse("system catalogs", name)
        if schema is None and name in self.ctes:
            cte_uid = self.ctes[name]
            if cte_uid is not None:
                _no_column_aliases(rv)
                bases, per_user = self.totalize.findings.shapes[name]
                self.tables.append(TableRef(name, alias, cte_uid, derived=True, bases=bases,
                                            per_user=per_user))
                self.nodes[alias] = rv
            return rv
        pol = self.policy.get(name)
        if pol is not None and schema in (None, pol.schema):
            _no_column_aliases(rv)
            self.tables.append(TableRef(name, alias, pol.uid_column,
                                        bases=frozenset({f"{pol.schema}.{name}"})))
            self.nodes[alias] = rv
            rv.schemaname = pol.schema  # (the pushdown names the configured table, whatever
            # the pushdown role's search_path finds first)
        else:
            _public_relation(rv, self.ctes, self.totalize)
        return rv

    def owned(self) -> list[TableRef]:
        """The protected FROM items whose uid no outer join can null, in FROM order."""
        return [t for t in self.tables if t.alias not in self.nullable]

    def owner(self) -> ast.Node:
        """Each row's owner (DESIGN §3.4): the uid of the first protected FROM item that no
        outer join nulls; where every one can be (a FULL JOIN between protected tables, a
        public table LEFT JOINed to one), the first of their uids that is not NULL. A row
        whose owner is NULL belongs to no user (the pushdown drops it)."""
        refs = [ast.ColumnRef(fields=(ast.String(sval=t.alias), ast.String(sval=t.uid_column)))
                for t in (self.owned() or self.tables)]
        return refs[0] if len(refs) == 1 or self.owned() else ast.CoalesceExpr(args=tuple(refs))

    def _by_alias(self, alias: str) -> TableRef:
        for t in self.tables:
            if t.alias == alias:
                return t
        raise KeyError(alias)

    def _collect_uid_equalities(self, cond: Any) -> None:
        for conj in _conjuncts(cond):
            if (isinstance(conj, ast.A_Expr) and conj.kind == A_Expr_Kind.AEXPR_OP
                    and conj.name[-1].sval == "="):
                a, b = self._uid_alias(conj.lexpr), self._uid_alias(conj.rexpr)
                if a and b and a != b:
                    self.uid_equalities.append((a, b))

    def _uid_alias(self, node: Any) -> str | None:
        """The alias whose uid column `node` names (alias.uid), if any."""
        if not isinstance(node, ast.ColumnRef) or len(node.fields) != 2:
            return None
        alias, col = str(node.fields[0].sval), str(node.fields[1].sval)
        for t in self.tables:
            if t.alias == alias and t.uid_column == col:
                return alias
        return None

    def check_multiplying(self) -> None:
        """Joined row by row, protected tables multiply each user's rows: two tables give the
        product of the user's rows in each (the work a query does then grows with one user's
        rows squared), a table with itself the square. Allowed: two different tables, and any
        number of inner queries with one row per user (grouped by the uid alone)."""
        rows = [t for t in self.tables if not t.per_user]
        seen: set[str] = set()
        for t in rows:
            if seen & t.bases:
                raise _refuse("a protected table joined row by row with itself (aggregate one "
                              "side per user first: (SELECT uid, ... GROUP BY uid))", t.alias)
            seen |= t.bases
        if len(rows) > 2:
            raise _refuse("joins of more than two protected tables row by row (aggregate the "
                          "others per user first: (SELECT uid, ... GROUP BY uid))",
                          ", ".join(t.alias for t in rows))

    def capped_joins(self, items: tuple[Any, ...]) -> tuple[Any, ...]:
        """`items` (this scope's FROM) where two protected items are joined row by row: each
        then reads at most JOIN_ROWS_PER_USER rows of each user (picked by a hash of the row),
        so that the join makes at most JOIN_ROWS_PER_USER² rows of one user, whatever that
        user's rows (DESIGN §3.11: no construct lets one user's rows multiply the work)."""
        rows = [t for t in self.tables if not t.per_user]
        if len(rows) < 2:
            return items
        capped = {id(self.nodes[t.alias]): _capped(self.nodes[t.alias], t) for t in rows}
        self.totalize.findings.joins_capped = True

        def swap(node: Any) -> Any:
            if id(node) in capped:
                return capped[id(node)]
            if isinstance(node, ast.JoinExpr):
                node.larg, node.rarg = swap(node.larg), swap(node.rarg)
            return node

        return tuple(swap(item) for item in items)

    def check_connected(self, where: Any) -> None:
        """All protected tables must be joined on uid equality into one privacy unit."""
        if len(self.tables) <= 1:
            return
        if where is not None:
            self._collect_uid_equalities(where)
        parent = {t.alias: t.alias for t in self.tables}

        def find(a: str) -> str:
            while parent[a] != a:
                a = parent[a]
            return a

        for a, b in self.uid_equalities:
            parent[find(a)] = find(b)
        for aliases, _ in self.using:
            first, *rest = sorted(aliases)
            for other in rest:
                parent[find(other)] = find(first)
        roots = {find(t.alias) for t in self.tables}
        if len(roots) > 1:
            names = ", ".join(t.alias for t in self.tables)
            raise _refuse("joins between protected tables must equate their uid columns, "
                          "e.g. USING (uid) or ON a.uid = b.uid", names)


def _conjuncts(node: Any) -> Iterator[Any]:
    if isinstance(node, ast.BoolExpr) and node.boolop == BoolExprType.AND_EXPR:
        for a in node.args:
            yield from _conjuncts(a)
    else:
        yield node


# ---------------------------------------------------------------------------- the query


class _ParamBinder(Visitor):
    def __init__(self, values: Mapping[int, ast.Node]) -> None:
        super().__init__()
        self.values = values

    def visit_ParamRef(self, ancestors: Any, node: ast.ParamRef) -> Any:
        value = self.values.get(node.number)
        if value is None:
            raise SyntaxError_(f"there is no parameter ${node.number}")
        return value


class _SchemaQualifiedColumns(Visitor):
    """`schema.table.column` → `table.column` where FROM has `schema.table` without an alias
    (the form Metabase writes): the same column, since a FROM list cannot hold two items of
    one name; the rules then see the table's uid and configured bounds."""

    def __init__(self, tables: frozenset[tuple[str, str]]) -> None:
        super().__init__()
        self.tables = tables

    def visit_ColumnRef(self, ancestors: Any, node: ast.ColumnRef) -> Any:
        fields = node.fields
        if len(fields) == 3 and isinstance(fields[0], ast.String) \
                and isinstance(fields[1], ast.String) \
                and (str(fields[0].sval), str(fields[1].sval)) in self.tables:
            return ast.ColumnRef(fields=fields[1:], location=node.location)
        return None


def _unaliased_tables(stmt: ast.Node) -> frozenset[tuple[str, str]]:
    return frozenset((str(n.schemaname), str(n.relname)) for n in _walk(stmt)
                     if isinstance(n, ast.RangeVar) and n.schemaname and n.alias is None
                     and not n.catalogname)


MAX_NESTING = 64
"""How deep a DP query's syntax tree may be: the analysis walks and copies it recursively."""


def _nesting(root: Any) -> int:
    """The depth of the syntax tree under `root`, in nodes (without recursion)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(root, 0)]
    while stack:
        cur, depth = stack.pop()
        if isinstance(cur, ast.Node):
            depth += 1
            deepest = max(deepest, depth)
            stack.extend((getattr(cur, name), depth) for name in cur)
        elif isinstance(cur, (tuple, list)):
            stack.extend((item, depth) for item in cur)
    return deepest


def parse_select(stripped_sql: str, params: Mapping[int, ast.Node] | None = None) -> ast.SelectStmt:
    """Parse one SELECT (the DP clause already blanked), bind `$n` parameters as constants and
    write `schema.table.column` references as `table.column`."""
    try:
        stmts = parse_sql(stripped_sql)
    except ParseError as e:
        raise SyntaxError_(str(e)) from None
    if len(stmts) != 1:
        raise SyntaxError_("a DP query is exactly one statement")
    stmt = stmts[0].stmt
    if isinstance(stmt, (ast.ExplainStmt, ast.DeclareCursorStmt, ast.CopyStmt)) \
            and stmt.query is not None:
        stmt = stmt.query  # (a cursor is declared over the released answer, or it is copied)
    if not isinstance(stmt, ast.SelectStmt):
        raise _refuse("only SELECT", type(stmt).__name__)
    if _nesting(stmt) > MAX_NESTING:
        raise StatementTooComplex(
            f"a DP query nests expressions more than {MAX_NESTING} levels deep",
            hint="write long sums or concatenations with fewer levels, e.g. concat(a, b, c)")
    if params:
        _ParamBinder(params)(stmt)
    tables = _unaliased_tables(stmt)
    if tables:
        _SchemaQualifiedColumns(tables)(stmt)
    return stmt


def analyze(stmt: ast.SelectStmt, policy: Mapping[str, TablePolicy], plain_form: bool,
            privacy_unit: str | None = None,
            integer_types: Mapping[int, str] | None = None,
            row_work: RowWorkBudget | None = None) -> AnalyzedQuery:
    """Check `stmt` against the DP rules and split it into keys, aggregates and the rest.

    `privacy_unit`: BigQuery's OPTIONS(privacy_unit_column=...), which must name the uid
    column (the privacy unit is the configuration's, not the query's). `integer_types`: the
    integer type of arithmetic operators (by location), as Postgres reported them for a first
    analysis's `ArithmeticCheck`s."""
    answered = _post_processed(stmt)
    if answered is not None:
        return replace(analyze(answered, policy, plain_form, privacy_unit, integer_types,
                               row_work), outer=stmt)
    if stmt.op is not None and stmt.op != 0 and stmt.larg is not None:
        raise _refuse("set operations (UNION, INTERSECT, EXCEPT)")
    ctes: dict[str, str | None] = {}
    findings = Findings(budget=row_work or RowWorkBudget())
    cte_nodes: tuple[Any, ...] = ()
    if stmt.withClause is not None:
        if stmt.withClause.recursive:
            raise _refuse("recursive WITH")
        for cte in stmt.withClause.ctes:
            name = str(cte.ctename)
            if name.startswith("dp_"):
                raise _refuse("names starting with dp_ are reserved", name)
            if cte.aliascolnames:
                raise _refuse("column aliases on a WITH query", name)
            if not isinstance(cte.ctequery, ast.SelectStmt):
                raise _refuse("data-modifying WITH", name)
            ctes[name] = _owned_subquery(cte.ctequery, policy,
                                         Totalizer(frozenset(policy), findings, cte.ctequery,
                                                   integer_types), ctes)
            if ctes[name] is not None:
                findings.shapes[name] = findings.shapes[id(cte.ctequery)]
        cte_nodes = tuple(stmt.withClause.ctes)
    if stmt.distinctClause == (None,) and not stmt.groupClause and not any(
            _dp_aggregates_in(t) for t in stmt.targetList or ()):
        # SELECT DISTINCT k (a BI tool's filter values): GROUP BY k, its keys released by
        # partition selection alone
        stmt = copy.copy(stmt)
        stmt.distinctClause = None
        stmt.groupClause = tuple(ast.A_Const(val=ast.Integer(ival=i + 1))
                                 for i in range(len(stmt.targetList or ())))
    if stmt.distinctClause:
        raise _refuse("SELECT DISTINCT (distinct over users' rows)")
    if stmt.windowClause:
        raise _refuse("window functions")
    if stmt.intoClause is not None or stmt.lockingClause:
        raise _refuse("SELECT INTO or FOR UPDATE")
    if not stmt.fromClause:
        raise _refuse("a DP query must read a protected table")
    _only_clauses(stmt, (*_OWNED_CLAUSES, "havingClause", "sortClause", "limitCount",
                         "limitOffset", "withClause"), "a DP query")
    totalize = Totalizer(frozenset(policy), findings, None, integer_types)
    fa = _FromAnalysis(policy, totalize, ctes)
    from_clause = tuple(fa.item(item) for item in stmt.fromClause)
    if not fa.tables:
        raise _refuse("a DP query must read a protected table")
    if privacy_unit is not None and all(privacy_unit.lower() != t.uid_column.lower()
                                        for t in fa.tables):
        units = ", ".join(sorted({t.uid_column for t in fa.tables}))
        raise _refuse(f"privacy_unit_column {privacy_unit} (the privacy unit is the configured uid "
                      f"column: {units})")
    fa.check_connected(stmt.whereClause)
    fa.check_multiplying()
    from_clause = fa.capped_joins(from_clause)
    uid = fa.owner()
    # rows whose owner is NULL (a NULL uid in the data, or the side an outer join adds) belong
    # to no user: dropped before anything is counted
    owned: ast.Node = ast.NullTest(arg=copy.deepcopy(uid), nulltesttype=NullTestType.IS_NOT_NULL)
    where = owned
    if stmt.whereClause is not None:
        semi = totalize.with_semi_joins(lambda link: _semi_join(link, policy, ctes, totalize))
        where = ast.BoolExpr(boolop=BoolExprType.AND_EXPR,
                             args=(semi(stmt.whereClause, "WHERE"), owned))

    group_exprs = _group_expressions(stmt)
    keys: list[Key] = []
    aggregates: list[Aggregate] = []
    outputs: list[OutputColumn] = []
    select: list[SelectItem] = []
    def release_hidden(calls: list[Any]) -> None:
        """Post-processing: each DP aggregate of an expression over them (in the select list,
        HAVING or ORDER BY) that no output answers yet is released hidden; the result query
        evaluates the expression over the released values."""
        for fc in calls:
            if not any(_same(fc, o.source) for o in outputs):
                hidden = f"dp_hidden{len(outputs)}"
                aggregates.append(_make_aggregate(fc, hidden, fa, policy, totalize))
                outputs.append(OutputColumn(hidden, aggregate=len(aggregates) - 1, source=fc))

    for target in stmt.targetList or ():
        if not isinstance(target, ast.ResTarget) or target.val is None:
            raise _refuse("this select-list item")
        val = target.val
        if isinstance(val, ast.ColumnRef) and isinstance(val.fields[-1], ast.A_Star):
            raise _refuse("SELECT * (list the group keys and DP aggregates)")
        name = str(target.name) if target.name else _default_name(val)
        agg = _aggregate_call(val, plain_form)
        if agg is not None:
            aggregates.append(_make_aggregate(agg, name, fa, policy, totalize))
            outputs.append(OutputColumn(name, aggregate=len(aggregates) - 1, source=val))
            select.append(SelectItem(name, column=len(outputs) - 1))
            continue
        inner = _dp_aggregates_in(val)
        if inner:
            release_hidden(inner)
            select.append(SelectItem(name, expr=val))
            continue
        if any(isinstance(n, ast.FuncCall) and n.over is not None for n in _walk(val)):
            raise _refuse("window functions but over DP aggregates (sum(count(*)) OVER ())",
                          _sql(val))
        if not any(_same(val, g) or _is_ref_to(g, name) for g in group_exprs):
            raise _refuse("every selected column must be a GROUP BY key or a DP aggregate",
                          _sql(val))
        keys.append(Key(totalize(val, "GROUP BY key"), name))
        outputs.append(OutputColumn(name, key=len(keys) - 1, source=val))
        select.append(SelectItem(name, column=len(outputs) - 1))
    for expr in (stmt.havingClause, *(s.node for s in stmt.sortClause or ())):
        if expr is not None:  # (they filter and sort on noisy values too)
            release_hidden(_dp_aggregates_in(expr))
    selected = [(o.source, o.name) for o in outputs if o.key is not None]
    for g in group_exprs:
        # (against the selected expressions as written: the keys are totalised, `x % 2`
        # became `x % NULLIF(2, 0)`, and would not match `GROUP BY x % 2` or `GROUP BY 1`)
        if not any(_same(g, source) or _is_ref_to(g, name) for source, name in selected):
            # a GROUP BY key that is not selected still partitions the result
            keys.append(Key(totalize(g, "GROUP BY key"), f"__key{len(keys)}"))
    if not aggregates and not keys:  # (keys alone: the groups partition selection releases)
        raise _refuse("a DP query needs at least one DP aggregate, e.g. ANON_COUNT(*)")
    for k in keys:
        if _is_uid(k.expr, fa):
            raise _refuse("grouping by the uid: every group would hold one user, and partition "
                          "selection releases none (group by something coarser)", _sql(k.expr))
    return AnalyzedQuery(
        from_clause=from_clause, where=where, uid=uid, tables=tuple(fa.tables), keys=tuple(keys),
        aggregates=tuple(aggregates), outputs=tuple(outputs), having=stmt.havingClause,
        order_by=tuple(stmt.sortClause or ()), limit=stmt.limitCount, offset=stmt.limitOffset,
        plain_form=plain_form, ctes=cte_nodes, select=tuple(select),
        casts=tuple(findings.casts), arithmetic=tuple(findings.arithmetic),
        relations=tuple(dict.fromkeys(findings.relations)),
        sublinks=tuple(findings.sublinks), joins_capped=findings.joins_capped,
    )


def _check_work(found: Findings, budget: RowWorkBudget,
                named: RowWorkBudget | None = None) -> None:
    """Refuse a query whose expressions may do more work on one row than `budget` (DESIGN
    §3.11: the time a query takes must not be a lever on one user's rows), naming the
    costliest expression."""
    total = found.work
    unbounded = not (math.isfinite(total.fixed) and math.isfinite(total.per_byte))
    if total.fits(budget.linear) or (named is not None and unbounded):
        return  # (an unbounded cost is a non-literal argument: the rules refuse it by name)
    _, where, node = max(found.costs, key=lambda c: (c[0].work.per_byte, c[0].work.fixed))
    budget = named or budget  # (the budget the message names)
    raise _refuse(
        f"expressions whose work on one row may exceed {budget.per_byte:g} passes over its "
        f"values plus {budget.fixed:g} bytes (here {total.per_byte:g} passes plus "
        f"{total.fixed:g} bytes; the costliest is {where}: {_sql(node)})")


_PER_USER_AGGREGATES = frozenset({"count", "sum", "avg", "min", "max"})


def _semi_join(link: ast.SubLink, policy: Mapping[str, TablePolicy],
               ctes: Mapping[str, str | None], totalize: Totalizer) -> ast.SubLink:
    """`x IN (SELECT ...)` or `EXISTS (SELECT ...)` in a DP query's WHERE, checked and made
    total in place: over unprotected tables only, a plain SELECT [WHERE] of their rows
    (public data), total.

    Subqueries in WHERE that read protected tables, correlated or not, are refused (DESIGN
    §3.1, the paper's Table 2), even the semi-join on the uid (`uid IN (SELECT uid FROM
    purchases ...)`), which would be safe: a join on the uid in FROM says the same."""
    sub = link.subselect
    exists = link.subLinkType == SubLinkType.EXISTS_SUBLINK
    if not exists and (link.subLinkType != SubLinkType.ANY_SUBLINK or
                       (link.operName and str(link.operName[-1].sval) != "=")):
        raise _refuse("subqueries inside a DP query (but IN or EXISTS over unprotected tables "
                      "in WHERE)", _sql(link))
    if not isinstance(sub, ast.SelectStmt):
        raise _refuse("this kind of subquery", _sql(link))
    if _reads_protected(sub, policy, ctes):
        raise _refuse("correlated or WHERE subqueries that read protected tables (join the "
                      "table on the uid in FROM instead)", _sql(link))
    _public_subquery(sub, totalize.inner(sub), ctes,
                     "a subquery in IN or EXISTS over unprotected tables")
    totalize.findings.sublinks.append(sub)
    return link


def _public_subquery(sub: ast.SelectStmt, totalize: Totalizer,
                     ctes: Mapping[str, str | None], scope: str) -> None:
    """A subquery of unprotected tables inside a DP query (in FROM, WITH, IN or EXISTS): a
    plain SELECT of their rows, filtered, made total (it may read the DP query's row too), or
    a VALUES list; its tables are recorded for the server's check (`_public_relation`)."""
    if sub.valuesLists:
        _only_clauses(sub, ("valuesLists",), scope)
        sub.valuesLists = tuple(tuple(totalize(v, "VALUES list") for v in row)
                                for row in sub.valuesLists)
        return
    try:
        _only_clauses(sub, _PUBLIC_CLAUSES, scope)
    except FeatureNotSupported:
        raise _refuse(f"{scope} but as SELECT ... FROM ... [WHERE]", _sql(sub)) from None
    if len(sub.fromClause or ()) > 1:
        raise _refuse(f"{scope} reads one table (no joins: work per row of the DP query)",
                      _sql(sub))
    for item in sub.fromClause or ():
        if not isinstance(item, ast.RangeVar):
            raise _refuse(f"{scope} reads tables by name only (no joins, functions or "
                          "subqueries)", _sql(item))
        _public_relation(item, ctes, totalize)
        totalize.findings.row_names.add(str(item.alias.aliasname) if item.alias
                                        else str(item.relname))
    for target in sub.targetList or ():
        if isinstance(target.val, ast.ColumnRef) and isinstance(target.val.fields[-1], ast.A_Star):
            continue
        _no_aggregates_inside(target.val)
        target.val = totalize(target.val, "subquery select list")
    if sub.whereClause is not None:
        sub.whereClause = totalize(sub.whereClause, "WHERE")


def _post_processed(stmt: ast.SelectStmt) -> ast.SelectStmt | None:
    """The DP query that `stmt` only post-processes, or None.

    That is a SELECT without aggregates or GROUP BY of its own whose one FROM item is a
    subquery with them (a DP query): it reads nothing but the released rows, so it may
    filter, project, sort and limit them freely. It may read nothing else: no other FROM
    item, WITH or subquery (those stay refused as reads of protected rows)."""
    if (stmt.op not in (None, 0) or stmt.groupClause or stmt.havingClause or stmt.valuesLists
            or not stmt.fromClause or len(stmt.fromClause) != 1):
        return None
    item = stmt.fromClause[0]
    if not isinstance(item, ast.RangeSubselect) or not isinstance(item.subquery, ast.SelectStmt):
        return None
    inner = item.subquery
    if not (inner.groupClause or any(_dp_aggregates_in(t) for t in inner.targetList or ())):
        return None  # a projection of rows: the outer query is the DP query, if any
    outer_parts = (stmt.targetList, stmt.whereClause, stmt.sortClause, stmt.limitCount,
                   stmt.limitOffset, stmt.distinctClause, stmt.windowClause)
    if any(_dp_aggregates_in(part) for part in outer_parts if part is not None):
        return None  # aggregates over the subquery's rows: the outer query is the DP query
    if item.lateral or stmt.withClause is not None or stmt.intoClause is not None \
            or stmt.lockingClause:
        raise _refuse("LATERAL, WITH, INTO or FOR UPDATE around a DP query", _sql(stmt))
    for part in outer_parts:
        for node in _walk(part) if part is not None else ():
            if isinstance(node, (ast.SubLink, ast.RangeVar, ast.RangeFunction)):
                raise _refuse("a query over a DP answer reads only its rows (no subqueries)",
                              _sql(node))
    return inner


def _owned_subquery(sel: Any, policy: Mapping[str, TablePolicy], totalize: Totalizer,
                    ctes: Mapping[str, str | None]) -> str | None:
    """Check an inner query (subquery in FROM or WITH) against the ownership rules.

    Returns the name of its uid output column, or None when it reads no protected
    rows. Projection and selection are free; aggregation must group by the uid
    (per-user rows); DISTINCT, LIMIT/OFFSET, window functions and set operations
    are refused. The uid is appended to the select list when it is missing and
    that is unambiguous. Expressions are made total in place.
    """
    if not isinstance(sel, ast.SelectStmt):
        raise _refuse("this kind of subquery", _sql(sel))
    if sel.op and sel.larg is not None:
        if _reads_protected(sel, policy, ctes):
            raise _refuse("set operations (UNION, INTERSECT, EXCEPT) over protected tables", _sql(sel))
        raise _refuse("set operations (UNION, INTERSECT, EXCEPT) in a DP query", _sql(sel))
    if not _reads_protected(sel, policy, ctes):
        _public_subquery(sel, totalize, ctes, "a subquery over unprotected tables")
        return None
    if sel.withClause is not None:
        raise _refuse("WITH inside a subquery", _sql(sel))
    if sel.distinctClause:
        raise _refuse("DISTINCT in a subquery over protected tables", _sql(sel))
    if sel.limitCount is not None or sel.limitOffset is not None:
        raise _refuse("LIMIT or OFFSET in a subquery over protected tables", _sql(sel))
    if sel.windowClause:
        raise _refuse("named windows (WINDOW w AS ...) in a subquery", _sql(sel))
    if sel.havingClause is not None:
        raise _refuse("HAVING in a subquery over protected tables", _sql(sel))
    if sel.valuesLists or not sel.fromClause:
        raise _refuse("this kind of subquery", _sql(sel))
    if sel.sortClause:
        raise _refuse("ORDER BY in a subquery over protected tables (without LIMIT it means "
                      "nothing)", _sql(sel))
    _only_clauses(sel, _OWNED_CLAUSES, "a subquery over protected tables")
    fa = _FromAnalysis(policy, totalize, ctes)
    sel.fromClause = tuple(fa.item(item) for item in sel.fromClause)
    fa.check_connected(sel.whereClause)
    fa.check_multiplying()
    sel.fromClause = fa.capped_joins(sel.fromClause)
    if sel.whereClause is not None:
        sel.whereClause = totalize(sel.whereClause, "WHERE")
    # a uid that an outer join can null is not a user: only the owned tables' uids bound a
    # contribution (per-user groups and windows); an unqualified one only where no nullable
    # table has a uid of that name
    owned = fa.owned()
    if not fa.tables:
        raise _refuse("protected tables read elsewhere than in a subquery's FROM", _sql(sel))
    if not owned:
        raise _refuse("outer joins that can null every protected table of a subquery (its "
                      "rows would have no owner)", _sql(sel))
    uid_refs = {(t.alias, t.uid_column) for t in owned}
    uid_names = {t.uid_column for t in owned} - \
        {t.uid_column for t in fa.tables if t.alias in fa.nullable}

    def is_uid(node: Any) -> bool:
        if not isinstance(node, ast.ColumnRef):
            return False
        parts = tuple(str(f.sval) for f in node.fields if isinstance(f, ast.String))
        return (len(parts) == 2 and parts in uid_refs) or (len(parts) == 1 and parts[0] in uid_names)

    grouped = bool(sel.groupClause)
    if grouped:
        keys = _group_expressions(sel)
        if not any(is_uid(k) for k in keys):
            raise _refuse("aggregation in a subquery must group by the uid (per-user rows)",
                          _sql(sel))
        sel.groupClause = tuple(totalize(g, "GROUP BY") if not is_uid(g) else g
                                for g in sel.groupClause)
    targets = []
    uid_out: str | None = None
    for target in sel.targetList or ():
        val = target.val
        if isinstance(val, ast.ColumnRef) and isinstance(val.fields[-1], ast.A_Star):
            if fa.nullable:
                raise _refuse("* in a subquery with an outer join of protected tables (name "
                              "the columns)", _sql(sel))
            targets.append(target)
            if uid_out is None:
                uid_out = fa.tables[0].uid_column
            continue
        if is_uid(val) and uid_out is None:
            uid_out = str(target.name) if target.name else str(val.fields[-1].sval)
            targets.append(target)
            continue
        if isinstance(val, ast.FuncCall) and val.over is not None:
            target.val = _per_user_window(val, is_uid, totalize)
        else:
            for node in _walk(val):
                if isinstance(node, ast.FuncCall) and node.over is not None:
                    raise _refuse("window functions inside expressions", _sql(val))
            target.val = _per_user_expression(val, grouped, totalize)
        targets.append(target)
    if uid_out is None:  # propagate the uid: unambiguous, the first owned table's
        first = owned[0]
        uid_out = "dp_uid_auto" if any(t.name == first.uid_column for t in targets) else first.uid_column
        targets.append(ast.ResTarget(name=uid_out, val=ast.ColumnRef(fields=(
            ast.String(sval=first.alias), ast.String(sval=first.uid_column)))))
    sel.targetList = tuple(targets)
    bases = frozenset().union(*(t.bases for t in fa.tables))
    per_user = grouped and len(_group_expressions(sel)) == 1
    totalize.findings.shapes[id(sel)] = (bases, per_user)
    return uid_out


def _builtin(fc: ast.FuncCall) -> bool:
    return len(fc.funcname) == 1 or str(fc.funcname[0].sval) == "pg_catalog"


_DEFAULT_FRAME = 1058
"""pglast's WindowDef.frameOptions without a frame clause (RANGE UNBOUNDED PRECEDING to
CURRENT ROW, the frame Postgres computes incrementally)."""
_WINDOW_FUNCTIONS = frozenset({"row_number", "rank", "dense_rank", "count", "sum", "avg", "min", "max"})


def _per_user_window(fc: Any, is_uid: Any, totalize: Totalizer) -> Any:
    """A window function over one user's rows: partitioned by the uid, total."""
    over = fc.over
    if over.refname or not any(is_uid(p) for p in (over.partitionClause or ())):
        raise _refuse("window functions must be partitioned by the uid", _sql(fc))
    name = _funcname(fc)
    if name not in _WINDOW_FUNCTIONS or not _builtin(fc):
        raise _refuse(f"window function {name}() (allowed: {', '.join(sorted(_WINDOW_FUNCTIONS))})",
                      _sql(fc))
    if fc.agg_filter is not None or fc.agg_distinct:
        raise _refuse("FILTER or DISTINCT in a window function", _sql(fc))
    if over.frameOptions != _DEFAULT_FRAME:
        # (a frame whose start moves recomputes max() over it on every row: quadratic work
        # in one user's rows)
        raise _refuse("window frames (ROWS or RANGE BETWEEN ...)", _sql(fc))
    args = tuple(totalize(a, "window function argument") for a in (fc.args or ()))
    if name in ("sum", "avg"):
        args = tuple(totalize.number(a, f"{name}() of a number", _sql(fc)) for a in args)
    fc.args = args or None
    over.partitionClause = tuple(p if is_uid(p) else totalize(p, "PARTITION BY")
                                 for p in over.partitionClause)
    if over.orderClause:
        for sort in over.orderClause:
            if sort.useOp:
                raise _refuse("ORDER BY ... USING in a window", _sql(fc))
            sort.node = totalize(sort.node, "window ORDER BY")
    if over.startOffset is not None or over.endOffset is not None:
        raise _refuse("window frames with offsets", _sql(fc))
    return fc


def _per_user_expression(val: Any, grouped: bool, totalize: Totalizer) -> Any:
    """A select-list item of an inner query: total, with per-user aggregates made total too."""
    if isinstance(val, ast.FuncCall) and _funcname(val) in _PER_USER_AGGREGATES:
        if not grouped:
            raise _refuse("aggregates in a subquery need GROUP BY uid", _sql(val))
        if val.over is not None or val.agg_filter is not None or val.agg_order \
                or not _builtin(val):
            raise _refuse("FILTER, ORDER BY or OVER in a per-user aggregate, or one that is not "
                          "built in", _sql(val))
        name = _funcname(val)
        args = tuple(totalize(a, "aggregate argument") for a in (val.args or ()))
        if name in ("sum", "avg"):  # exact: no overflow for any user's rows
            args = tuple(totalize.number(a, f"{name}() of a number", _sql(val)) for a in args)
        val.args = args or None
        return val
    for node in _walk(val):
        if isinstance(node, ast.FuncCall) and _funcname(node) in _PER_USER_AGGREGATES:
            raise _refuse("expressions over per-user aggregates (select the aggregate itself)",
                          _sql(val))
    _no_aggregates_inside(val)
    return totalize(val, "subquery select list")


def _reads_protected(sel: Any, policy: Mapping[str, TablePolicy], ctes: Mapping[str, str | None]) -> bool:
    for node in _walk(sel):
        if isinstance(node, ast.RangeVar):
            name = str(node.relname)
            schema = str(node.schemaname) if node.schemaname else None
            pol = policy.get(name)
            if pol is not None and schema in (None, pol.schema):
                return True
            if schema is None and ctes.get(name) is not None:
                return True
    return False


def _group_expressions(stmt: ast.SelectStmt) -> list[Any]:
    out = []
    for g in stmt.groupClause or ():
        if isinstance(g, (ast.GroupingSet,)):
            raise _refuse("GROUPING SETS, ROLLUP and CUBE")
        n = const_number(g)
        if n is not None:
            if not math.isfinite(n):
                raise SyntaxError_(f"GROUP BY position {n} is not in select list")
            idx = int(n) - 1
            if not 0 <= idx < len(stmt.targetList) or n != int(n):
                raise SyntaxError_(f"GROUP BY position {n} is not in select list")
            out.append(stmt.targetList[idx].val)
        else:
            out.append(g)
    return out


def _same(a: Any, b: Any) -> bool:
    return bool(a == b)  # pglast's equality ignores source locations


def _is_ref_to(node: Any, name: str) -> bool:
    return (isinstance(node, ast.ColumnRef) and len(node.fields) == 1
            and isinstance(node.fields[0], ast.String) and node.fields[0].sval == name)


def _default_name(val: Any) -> str:
    """The column name Postgres would give an unaliased select-list item."""
    if isinstance(val, ast.ColumnRef) and isinstance(val.fields[-1], ast.String):
        return str(val.fields[-1].sval)
    if isinstance(val, ast.FuncCall):
        return _funcname(val)
    if isinstance(val, ast.TypeCast):
        inner = _default_name(val.arg)
        return inner if inner != "?column?" else str(val.typeName.names[-1].sval)
    return "?column?"


def _is_dp_aggregate(name: str) -> bool:
    return name in ANON_FUNCTIONS or name in PLAIN_FUNCTIONS or name in QUANTILE_FUNCTIONS


def _aggregate_call(val: Any, plain_form: bool) -> ast.FuncCall | None:
    if not isinstance(val, ast.FuncCall):
        return None
    name = _funcname(val)
    if name == "approx_bounds":
        raise FeatureNotSupported(
            "APPROX_BOUNDS is not called directly: it runs by itself for every aggregate whose "
            "bounds are neither written nor configured")
    if name in LATER_FUNCTIONS:
        raise FeatureNotSupported(f"{name.upper()} has no DP form here",
                                  hint="use PERCENTILE_CONT, ANON_MEDIAN or ANON_NTILE")
    if _is_dp_aggregate(name) and val.over is None:  # both forms: BigQuery spells them plainly
        return val
    return None


def _dp_aggregates_in(val: Any) -> list[Any]:
    """DP aggregate calls inside an expression (not inside subqueries), in order."""
    found = []
    stack = [val]
    while stack:
        cur = stack.pop(0)
        if isinstance(cur, ast.SubLink):
            continue
        if isinstance(cur, ast.FuncCall) and _is_dp_aggregate(_funcname(cur)) \
                and cur.over is None:  # (a window function runs over the released rows)
            found.append(cur)
            continue
        if isinstance(cur, ast.Node):
            stack.extend(getattr(cur, n) for n in cur)
        elif isinstance(cur, (tuple, list)):
            stack.extend(cur)
    return found


def _no_aggregates_inside(val: Any) -> None:
    for node in _walk(val):
        if isinstance(node, ast.FuncCall) and _is_dp_aggregate(_funcname(node)):
            raise _refuse("expressions over DP aggregates are not supported yet "
                          "(select the aggregate itself)", _sql(val))


def _walk(node: Any) -> Iterator[Any]:
    stack = [node]
    while stack:
        cur = stack.pop()
        if isinstance(cur, ast.Node):
            yield cur
            stack.extend(getattr(cur, name) for name in cur)
        elif isinstance(cur, (tuple, list)):
            stack.extend(cur)


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
        raise _refuse(f"{fname.upper()} takes its bounds as {wanted} => (lower, upper)", _sql(fc))
    pair = named.arg
    if not isinstance(pair, ast.RowExpr) or len(pair.args or ()) != 2:
        raise _refuse(f"{wanted} => (lower, upper), two number literals", _sql(fc))
    return args[:-1] + list(pair.args)


def _make_aggregate(fc: ast.FuncCall, name: str, fa: _FromAnalysis,
                    policy: Mapping[str, TablePolicy], totalize: Totalizer) -> Aggregate:
    fname = _funcname(fc)
    if fc.over is not None:
        raise _refuse("window functions", _sql(fc))
    if fname in QUANTILE_FUNCTIONS:
        return _make_quantile(fc, name, fa, policy, totalize)
    kind = ANON_FUNCTIONS.get(fname) or PLAIN_FUNCTIONS[fname]
    if fc.agg_order or fc.agg_within_group:
        raise _refuse("ORDER BY or WITHIN GROUP in a DP aggregate", _sql(fc))
    args = _positional_args(fc, fname)
    if fc.agg_filter is not None and fc.agg_distinct and kind is not AggKind.COUNT:
        raise _refuse("FILTER with DISTINCT in a DP aggregate", _sql(fc))
    if kind is AggKind.COUNT:
        if fc.agg_distinct:
            arg, k = _distinct_count_args(fc, args)
            if _is_uid(arg, fa):  # (k changes nothing for the uid: each user has one)
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
                raise _refuse("a count's lower bound other than 0 (each user adds 0 to U rows)",
                              _sql(fc))
            args = [args[0], args[2]]
        if len(args) not in (1, 2):
            raise _refuse("COUNT takes one column (and an optional per-user bound)", _sql(fc))
        bound = _bound_literal(args[1], fc) if len(args) == 2 else 1.0
        if bound <= 0:
            raise _refuse("the per-user bound of a count must be positive", _sql(fc))
        if isinstance(args[0], ast.A_Const) and not args[0].isnull:  # COUNT(1) is COUNT(*)
            return Aggregate(AggKind.COUNT, _filtered(fc, None, totalize), Bounds(0, bound), name)
        return Aggregate(AggKind.COUNT, _filtered(fc, args[0], totalize), Bounds(0, bound), name)
    if fc.agg_distinct:
        raise _refuse(f"{fname.upper()}(DISTINCT ...)", _sql(fc))
    if fname == "sum" and len(args) == 1 and isinstance(args[0], ast.A_Const) \
            and isinstance(args[0].val, ast.Integer) and args[0].val.ival == 1:
        # Tableau counts rows as SUM(1): a count, bigint as Postgres's SUM of integers
        return Aggregate(AggKind.COUNT, _filtered(fc, None, totalize), Bounds(0, 1.0), name)
    if len(args) not in (1, 3):
        raise _refuse(f"{fname.upper()} takes (x) or (x, lower, upper)", _sql(fc))
    bounds = _bounds(args[0], args[1:], fc, fa, policy)
    return Aggregate(kind, _filtered(fc, args[0], totalize), bounds, name)


def _distinct_count_args(fc: ast.FuncCall, args: list[Any]) -> tuple[Any, float]:
    """COUNT(DISTINCT x [, k]), or with BigQuery's `contribution_bounds_per_group => (0, k)`:
    x, and k, the distinct values of its own each user may add to a group (1 unless given)."""
    if fc.agg_star or len(args) not in (1, 2, 3):
        raise _refuse("COUNT(DISTINCT x) takes one expression (and an optional per-user "
                      "number of values)", _sql(fc))
    if len(args) == 3:
        if _bound_literal(args[1], fc) != 0:
            raise _refuse("a count's lower bound other than 0 (each user adds 0 to k values)",
                          _sql(fc))
        args = [args[0], args[2]]
    k = _bound_literal(args[1], fc) if len(args) == 2 else 1.0
    if k < 1 or k != int(k) or k > MAX_DISTINCT_PER_USER:
        raise _refuse(f"the number of distinct values a user adds to a group is a whole "
                      f"number from 1 to {MAX_DISTINCT_PER_USER}", _sql(fc))
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


def _bounds(arg: Any, written: Sequence[Any], fc: ast.FuncCall, fa: _FromAnalysis,
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
                                  hint=_sql(fc))
    return Bounds(lower, upper)


def _make_quantile(fc: ast.FuncCall, name: str, fa: _FromAnalysis,
                   policy: Mapping[str, TablePolicy], totalize: Totalizer) -> Aggregate:
    fname = _funcname(fc)
    args = _positional_args(fc, fname)
    if fc.agg_distinct or fc.agg_star:
        raise _refuse(f"DISTINCT or * in {fname.upper()}", _sql(fc))
    if fname == "percentile_cont" and fc.agg_within_group:
        # PERCENTILE_CONT(p) WITHIN GROUP (ORDER BY x [DESC])
        if len(args) != 1 or not fc.agg_order or len(fc.agg_order) != 1:
            raise _refuse("PERCENTILE_CONT(p) WITHIN GROUP (ORDER BY x) with one p and one x",
                          _sql(fc))
        p = _quantile_literal(args[0], fc)
        sort = fc.agg_order[0]
        if sort.sortby_dir == 2:  # SORTBY_DESC
            p = 1.0 - p
        x, written = sort.node, []
    else:
        if fc.agg_order or fc.agg_within_group:
            raise _refuse(f"ORDER BY or WITHIN GROUP in {fname.upper()}", _sql(fc))
        takes_p = fname in ("anon_ntile", "percentile_cont")
        if not args or len(args) not in ((2, 4) if takes_p else (1, 3)):
            shape = "(x, p) or (x, p, lower, upper)" if takes_p else "(x) or (x, lower, upper)"
            raise _refuse(f"{fname.upper()} takes {shape}", _sql(fc))
        p = _quantile_literal(args[1], fc) if takes_p else _QUANTILE_OF[fname]
        x, written = args[0], args[2:] if takes_p else args[1:]
    bounds = _bounds(x, written, fc, fa, policy)
    return Aggregate(AggKind.QUANTILE, _filtered(fc, x, totalize), bounds, name, p)


def _quantile_literal(node: Any, fc: ast.FuncCall) -> float:
    value = const_number(node)
    if value is None or not 0.0 <= value <= 1.0:
        raise _refuse("the quantile must be a number literal between 0 and 1", _sql(fc))
    return value


def _bound_literal(node: Any, fc: ast.FuncCall) -> float:
    value = const_number(node)
    if value is None:
        raise _refuse("contribution bounds must be finite number literals", _sql(fc))
    check_bound(value, fc)
    return value


def check_bound(value: float, where: Any) -> None:
    """Refuse (22023) a contribution bound that is not finite, is subnormal (its noise and
    clamping lose all precision) or exceeds ±MAX_BOUND (sums over users could leave float8);
    `where` is the call it bounds (printed in the hint only then: pglast's printer leaves the
    nodes it printed too deep for deepcopy)."""
    if not math.isfinite(value) or (value != 0 and abs(value) < sys.float_info.min) \
            or abs(value) > MAX_BOUND:
        raise InvalidParameterValue(
            f"contribution bounds must be 0 or normal numbers within ±{MAX_BOUND:g}, not "
            f"{value!r}", hint=_sql(where))


def _is_uid(node: Any, fa: _FromAnalysis) -> bool:
    if not isinstance(node, ast.ColumnRef):
        return False
    parts = [str(f.sval) for f in node.fields if isinstance(f, ast.String)]
    return any(parts == [t.uid_column] or parts == [t.alias, t.uid_column] for t in fa.tables)


_WIDENING_CASTS = frozenset({"float8", "float4", "numeric", "int8"})
"""Types a bounded column keeps its value in when cast to them (Tableau writes
AVG(CAST(x AS DOUBLE PRECISION))): the column's configured bounds still apply."""


def _configured_bounds(node: Any, fa: _FromAnalysis,
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
