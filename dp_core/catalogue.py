"""The SQL a DP query may use: total casts, functions and operators, with their literal rules."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from pglast import ast
from pglast.enums import A_Expr_Kind, BoolExprType

from dp_core.query import AggKind, CastCheck, TypeMix
from dp_core.sqlnodes import const_number, const_string, func_name, node_sql, refuse

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

CHECKED_CAST_TARGETS = frozenset(t for targets in TOTAL_CASTS.values() for t in targets)
LITERAL_CAST_TARGETS = CHECKED_CAST_TARGETS | {
    "varchar", "bpchar", "char", "name", "time", "timetz", "interval", "uuid", "bool",
}
"""Built-in types a string literal may be cast to in a DP query: their input functions run
when the statement is planned (never on a row)."""
NUMBER_TYPES = frozenset({"int2", "int4", "int8", "numeric", "float4", "float8"})

def is_number_valued(node: Any) -> bool:
    """Arithmetic or a numeric function's call: a number (never a boolean or text), so a cast
    of it to an integer type can be guarded by comparisons (`_guarded_integer_cast`)."""
    if isinstance(node, ast.A_Expr):
        return node.kind == A_Expr_Kind.AEXPR_OP and bool(node.name) \
            and str(node.name[-1].sval) in ARITHMETIC
    return isinstance(node, ast.FuncCall) and func_name(node) in NUMERIC_ARG_FUNCTIONS


def check_casts(casts: Sequence[CastCheck], source_types: Sequence[str]) -> None:
    """Refuse the query unless every deferred cast is total for its source type."""
    for cast, source in zip(casts, source_types, strict=True):
        if cast.output:
            continue  # (its type's shape is the server's to check: `check_text_outputs`)
        if cast.sources is not None:
            if source not in cast.sources:
                raise refuse(f"{cast.rule}, not {source}", cast.text)
        elif cast.target not in TOTAL_CASTS.get(source, frozenset()):
            if cast.rule is not None:
                raise refuse(f"{cast.rule}, not {source}", cast.text)
            raise refuse(f"casts of column values from {source} to {cast.target} (they can "
                          "fail on some values)", cast.text)


_OID_TYPES = frozenset({"oid", "regclass", "regcollation", "regconfig", "regdictionary",
                        "regnamespace", "regoper", "regoperator", "regproc", "regprocedure",
                        "regrole", "regtype"})
_COMPARED = {"numeric": frozenset({"float4", "float8"}), "int8": _OID_TYPES,
             "text": frozenset({"regclass"}), "varchar": frozenset({"regclass"}),
             "macaddr8": frozenset({"macaddr"})}
FAILING_CONVERSIONS: dict[str, dict[str, frozenset[str]]] = {
    "compare": _COMPARED,
    "choose": {**_COMPARED, "date": frozenset({"timestamp", "timestamptz"}),
               "timestamp": frozenset({"timestamptz"})},
    "concatenate": {},  # (text of each: only their collations merge, `check_collations`)
}
"""The implicit conversions (pg_cast's, between built-in types) Postgres may apply to a value
that it compares with, or chooses among, values of another type, and that fail on some
values: numeric to real or double precision beyond their range (1e39, 1e309) or below their
smallest magnitude (1e-45, 1e-324); bigint to oid past 2^32; a text to regclass where it
names no table; a macaddr8 to macaddr unless its middle bytes are FF:FE; a date to a
timestamp past 294276 AD, a timestamp to timestamptz at its range's ends. Every other
implicit conversion between built-in types succeeds on every value (both checked against
Postgres by tests/proxy/test_attacks.py). Dates and timestamps compare across their types
without converting: only CASE, COALESCE, GREATEST, LEAST and a list of IN values choose one
type for all."""


STABLE_CONVERSIONS = frozenset({("date", "timestamptz"), ("timestamp", "timestamptz"),
                                ("text", "regclass"), ("varchar", "regclass")})
"""Those of FAILING_CONVERSIONS that are not immutable (they read the session's time zone or
the catalog): Postgres does not fold them into a constant when it plans the pushdown but
converts the constant on each row that reaches it (checked against pg_cast by
tests/proxy/test_attacks.py)."""


def check_mixes(mixes: Sequence[TypeMix], types: Sequence[Sequence[str]]) -> None:
    """Refuse the query where a value of the rows may be converted implicitly by a conversion
    that fails on some values (`FAILING_CONVERSIONS`); a constant only where that conversion
    is not immutable (an immutable one Postgres makes once, when it plans the pushdown,
    whatever the rows: `STABLE_CONVERSIONS`)."""
    for mix, found in zip(mixes, types, strict=True):
        failing = FAILING_CONVERSIONS[mix.kind]
        for j, (source, constant) in enumerate(zip(found, mix.constant, strict=True)):
            targets = failing.get(source, frozenset()) & set(found)
            if constant is None:
                continue
            if constant:
                targets = frozenset(t for t in targets if (source, t) in STABLE_CONVERSIONS)
            if not targets:
                continue
            target = min(targets)
            back = TOTAL_CASTS.get(target, frozenset())
            to, of = _SQL_NAMES.get(target, target), _SQL_NAMES.get(source, source)
            hint = f"; cast the {to} values to {of}" if source in back else ""
            raise refuse(f"{of} values brought to one type with {to} ones by {mix.text} "
                         f"(Postgres converts them to {to}, which fails on some values{hint})",
                         node_sql(mix.operands[j]))


_SQL_NAMES = {"float4": "real", "float8": "double precision", "timestamptz":
              "timestamp with time zone"}


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
QUANTILE_OF = {"anon_median": 0.5, "anon_min": 0.0, "anon_max": 1.0, "min": 0.0, "max": 1.0}
LATER_FUNCTIONS = frozenset({"approx_bounds", "percentile_disc", "median", "mode"})
OTHER_AGGREGATES = frozenset({
    "any_value", "array_agg", "bit_and", "bit_or", "bit_xor", "bool_and", "bool_or", "corr",
    "covar_pop", "covar_samp", "cume_dist", "dense_rank", "every", "json_agg", "json_agg_strict",
    "json_arrayagg", "json_object_agg", "json_object_agg_strict", "json_object_agg_unique",
    "json_object_agg_unique_strict", "json_objectagg", "jsonb_agg", "jsonb_agg_strict",
    "jsonb_object_agg", "jsonb_object_agg_strict", "jsonb_object_agg_unique",
    "jsonb_object_agg_unique_strict", "percent_rank", "range_agg", "range_intersect_agg", "rank",
    "regr_avgx", "regr_avgy", "regr_count", "regr_intercept", "regr_r2", "regr_slope", "regr_sxx",
    "regr_sxy", "regr_syy", "string_agg", "xmlagg",
})
"""Postgres's built-in aggregates with no DP form (rank() and its kin as hypothetical-set
aggregates, without OVER): an expression over released values cannot hold one."""

# Immutable functions that cannot raise for any argument values of the types they accept.
TOTAL_FUNCTIONS = frozenset({
    "lower", "upper", "length", "char_length", "character_length", "octet_length", "bit_length",
    "btrim", "ltrim", "rtrim", "md5", "concat", "initcap", "reverse", "ascii",
    "abs", "sign", "round", "floor", "ceil", "ceiling", "trunc", "greatest", "least",
    "isfinite", "date_trunc", "date_part", "extract", "coalesce", "nullif", "num_nulls",
    "num_nonnulls",
})
def integer_literal(node: Any, low: float = -2**31, high: float = 2**31 - 1) -> bool:
    value = const_number(node)
    return value is not None and value.is_integer() and low <= value <= high


def _start_and_length(a: list[Any]) -> bool:
    return len(a) in (1, 2) and integer_literal(a[0]) and (len(a) == 1 or integer_literal(a[1], 0))


def _pad(a: list[Any]) -> bool:
    return len(a) in (1, 2) and integer_literal(a[0], 0, 10_000) \
        and all(const_string(x) is not None for x in a[1:])


def _one_string(a: list[Any]) -> bool:
    return len(a) == 1 and const_string(a[0]) is not None


LITERAL_ARGUMENT_FUNCTIONS: dict[str, tuple[Callable[[list[Any]], bool], str]] = {
    "substring": (_start_and_length, "(x, integer start [, length >= 0]); the "
                                     "regular-expression forms are refused"),
    "substr": (_start_and_length, "(x, integer start [, length >= 0])"),
    "left": (lambda a: len(a) == 1 and integer_literal(a[0]), "(x, integer)"),
    "right": (lambda a: len(a) == 1 and integer_literal(a[0]), "(x, integer)"),
    "split_part": (lambda a: len(a) == 2 and const_string(a[0]) is not None
                   and integer_literal(a[1], 1),  # (a negative field fails before Postgres 14)
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
NUMERIC_ARG_FUNCTIONS = frozenset({"abs", "sign", "round", "floor", "ceil", "ceiling", "trunc"})
ROUNDING_UP = frozenset({"round", "ceil", "ceiling", "floor"})
"""Of NUMERIC_ARG_FUNCTIONS, those whose result can be larger than their argument: it is
taken within ±NUMERIC_ROW_CLAMP (±Infinity and NaN to its ends, as a sum's rows)."""
DATE_UNITS = frozenset({
    "microseconds", "milliseconds", "second", "minute", "hour", "day", "week", "month", "quarter",
    "year", "decade", "century", "millennium", "dow", "doy", "isodow", "isoyear", "epoch",
})
_TIME_OF_DAY = frozenset({"microseconds", "milliseconds", "second", "minute", "hour"})
_SPANS = _TIME_OF_DAY | {"day", "month", "quarter", "year", "decade", "century", "millennium"}
DATETIME_UNITS: dict[tuple[str, str], frozenset[str]] = {
    ("date_trunc", "timestamp"): _TIME_OF_DAY | {"day", "week", "month", "quarter", "year"},
    ("date_trunc", "timestamptz"): _TIME_OF_DAY | {"day", "week", "month", "quarter", "year"},
    ("date_part", "timestamp"): DATE_UNITS,
    ("date_part", "timestamptz"): DATE_UNITS,
    ("date_part", "interval"): _SPANS | {"epoch"},
    ("date_part", "time"): _TIME_OF_DAY | {"epoch"},
    ("date_part", "timetz"): _TIME_OF_DAY | {"epoch"},
    ("extract", "timestamp"): DATE_UNITS,
    ("extract", "timestamptz"): DATE_UNITS,
    ("extract", "date"): DATE_UNITS - _TIME_OF_DAY,
    ("extract", "interval"): _SPANS | {"epoch"},
    ("extract", "time"): _TIME_OF_DAY | {"epoch"},
    ("extract", "timetz"): _TIME_OF_DAY | {"epoch"},
}
"""The units each date/time function takes without failing on any value of the argument's
type (from the first to the last representable one, infinities included, in any time zone;
checked against Postgres by tests/proxy/test_attacks.py), date_trunc as `datetime_call` writes it.
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
    if func_name(fc) != "date_trunc":
        return fc
    low, high = (ast.A_Const(val=ast.String(sval=v)) for v in _TRUNCATED_RANGE)
    inside = ast.A_Expr(kind=A_Expr_Kind.AEXPR_BETWEEN, name=(ast.String(sval="BETWEEN"),),
                        lexpr=copy.deepcopy(value), rexpr=(low, high))
    infinite = ast.BoolExpr(boolop=BoolExprType.NOT_EXPR, args=(ast.FuncCall(
        funcname=(ast.String(sval="isfinite"),), args=(copy.deepcopy(value),)),))
    test = ast.BoolExpr(boolop=BoolExprType.OR_EXPR, args=(inside, infinite))
    return ast.CaseExpr(args=(ast.CaseWhen(expr=test, result=fc),))


MAX_DIGITS = 100
"""The most digits round(x, d) and trunc(x, d) may keep (numeric keeps up to 16383: a value
that long per row would be a lever on the time a query takes)."""
MAX_BOUND = 1e100
"""Largest magnitude of a contribution bound: the sum of a bounded value over every user
(and its noise) stays far inside float8's range."""
MIN_BOUND = 1e-100
"""Smallest magnitude of a contribution bound but 0 (`dp_core.partials.TINY`: rows nearer 0
are 0, and no float8 arithmetic over the bounds underflows)."""
TOTAL_OPERATORS = frozenset({"=", "<>", "!=", "<", ">", "<=", ">="})
ARITHMETIC = frozenset({"+", "-", "*", "/", "%"})
SYSTEM_SCHEMAS = frozenset({"pg_catalog", "information_schema", "pg_toast"})


def is_dp_aggregate(name: str) -> bool:
    return name in ANON_FUNCTIONS or name in PLAIN_FUNCTIONS or name in QUANTILE_FUNCTIONS
