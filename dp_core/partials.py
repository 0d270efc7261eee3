"""Per-user partial aggregates in SQL, and the clamping of their values to finite bounds.

Clamping `LEAST(GREATEST(v, L), U)` maps NaN to U (Postgres orders NaN above
every number) and ±Infinity to U and L, so none survives to the output.
Per-user partials are computed in `numeric`, which fails on neither NaN nor
infinities, and overflows on no sum: its rows are clamped to ±NUMERIC_ROW_CLAMP first.
"""

from __future__ import annotations

from dataclasses import replace

from dp_core.errors import FeatureNotSupported, InternalError
from dp_core.query import AggKind, Aggregate, Bounds
from dp_core.splice import PH
from dp_core.sqlnodes import NUMERIC_ROW_CLAMP, within_magnitude_sql


def num(x: float) -> str:
    """A numeric literal for one of our own (finite) constants."""
    if x != x or x in (float("inf"), float("-inf")):
        raise InternalError()
    text = repr(float(x))  # our own constants only: never user text
    return f"({text})::numeric" if text.startswith("-") else f"{text}::numeric"


def clamp(col: str, lower: float, upper: float) -> str:
    """A per-user partial clamped to [lower, upper], in numeric: what is computed from it
    (centred sums, squares) cannot overflow, whatever the bounds (float8 squares could)."""
    return (f"CASE WHEN {col} IS NULL THEN NULL ELSE "
            f"LEAST(GREATEST(({col})::numeric, {num(lower)}), {num(upper)}) END")


def f8(x: float) -> str:
    """A float8 literal for one of our own (finite) constants."""
    if x != x or x in (float("inf"), float("-inf")):
        raise InternalError()
    return f"({float(x)!r})::float8"


_EXACT_INTEGERS = frozenset({"int2", "int4", "int8"})
"""sum/avg of these accumulate exactly in int8/numeric: no overflow, no NaN."""
_FLOATS = frozenset({"float4", "float8"})
NUMERIC_TYPES = _EXACT_INTEGERS | _FLOATS | {"numeric"}
FLOAT_ROW_CLAMP = 1e290
"""Float rows are clamped to ±1e290 first, so a sum of up to 10^18 of them cannot overflow."""
QUANTILE_ROW_CLAMP = 1e300
"""Numeric rows are clamped to ±1e300 before they become float8 for a quantile."""
TINY = 1e-100
"""Row values nearer 0 than this are 0 (`_flushed`), and so are contribution bounds
(`dp_core.aggregates.check_bound`): the float8 arithmetic on them (a mean's division, a
square, a weight, a leaf's division by the range) never underflows to 0, which Postgres
reports as an error (22003) that would depend on one row's value, after the charge; and a
numeric row becomes float8 without leaving its range."""


def _flushed(expr: str, cast: str) -> str:
    """`expr` (of type `cast`), or 0 where it is nearer 0 than TINY (NULL and NaN kept)."""
    return f"CASE WHEN abs({expr}) < ({TINY!r})::{cast} THEN (0)::{cast} ELSE {expr} END"


def _clamp_row(expr: str, limit: float, cast: str) -> str:
    """`expr` clamped to ±limit with NULL kept (LEAST/GREATEST alone ignore NULLs), NaN
    mapped to +limit (NaN sorts above every number) and values nearer 0 than TINY to 0."""
    x = _flushed(expr, cast)
    return (f"CASE WHEN {expr} IS NULL THEN NULL ELSE LEAST(GREATEST({x}, ({-limit!r})::{cast}), "
            f"({limit!r})::{cast}) END")


def _arg(i: int, arg_type: str | None) -> str:
    """The per-row argument of aggregate i, in a form whose sum cannot fail."""
    if arg_type in _EXACT_INTEGERS:
        return f"{PH}a{i}"
    if arg_type in _FLOATS:
        # NaN becomes +1e290, then the per-user clamp to U
        return _clamp_row(f"({PH}a{i})::float8", FLOAT_ROW_CLAMP, "float8")
    return within_magnitude_sql(f"({PH}a{i})::numeric", NUMERIC_ROW_CLAMP)


def _float_arg(i: int, arg_type: str | None) -> str:
    """The per-row argument of a quantile as a finite float8 (NaN becomes the upper clamp)."""
    if arg_type in _EXACT_INTEGERS:
        return f"({PH}a{i})::float8"
    if arg_type in _FLOATS:
        return _arg(i, arg_type)
    return f"({_clamp_row(f'({PH}a{i})::numeric', QUANTILE_ROW_CLAMP, 'numeric')})::float8"


def row_value(i: int, agg: Aggregate, arg_type: str | None) -> str:
    """A row-level aggregate's argument on one row, clamped to its bounds, as float8 (NULL
    kept): integers and floats are clamped in float8 (NaN to the upper bound), anything else
    in numeric first (whose values may be beyond float8's range)."""
    b = agg.known_bounds
    if arg_type in _EXACT_INTEGERS or arg_type in _FLOATS:
        x = f"({PH}a{i})::float8"
        flushed = x if arg_type in _EXACT_INTEGERS else _flushed(x, "float8")
        return (f"CASE WHEN {x} IS NULL THEN NULL ELSE LEAST(GREATEST({flushed}, "
                f"{f8(b.lower)}), {f8(b.upper)}) END")
    return f"({clamp(_flushed(f'({PH}a{i})::numeric', 'numeric'), b.lower, b.upper)})::float8"


def partial(i: int, agg: Aggregate, arg_type: str | None) -> str:
    """Aggregate i's per-user partial columns (one row per user and group); `value(i, ...)`
    is its value over them. A row-level aggregate's are sums over the user's rows in the
    group of its clamped row values (`row_value`), weighted later (`weighted`)."""
    if agg.row_level and agg.kind is not AggKind.COUNT:
        check_number(agg, arg_type)
        # (with a clip, `row_bounds`: sums of the rows within their own bounds, which
        # `weighted` clamps to the count times the clip; squares of rows within the clip)
        r = row_value(i, replace(agg, bounds=agg.row_bounds or agg.bounds), arg_type)
        count = f"count({PH}a{i}) AS dp_n{i}"
        if agg.kind is AggKind.SUM:
            return f"sum({r}) AS dp_p{i}" + (f", {count}" if agg.row_bounds else "")
        mid = f8((agg.known_bounds.lower + agg.known_bounds.upper) / 2)
        cols = [f"sum({r}) AS dp_s{i}", count]
        if agg.kind is not AggKind.AVG and agg.row_bounds is not None:
            # the rows' squared distances to the clip's midpoint, from their variance and
            # mean (one numerically stable state; `weighted` clamps them to count × half²)
            n = f"count({PH}a{i})"
            cols.append(f"var_pop({r}) * {n} + {n} * (avg({r}) - {mid}) * (avg({r}) - {mid}) "
                        f"AS dp_q{i}")
        elif agg.kind is not AggKind.AVG:
            cols.append(f"sum(({r} - {mid}) * ({r} - {mid})) AS dp_q{i}")
        return ", ".join(cols)
    if agg.kind is AggKind.COUNT:
        return f"count({PH}a{i}) AS dp_p{i}" if agg.arg is not None else f"count(*) AS dp_p{i}"
    if agg.kind is AggKind.COUNT_DISTINCT:
        if arg_type is not None and arg_type.endswith("[]"):
            # an array (as the probe names it): arrays of arrays must have one shape, so the
            # pushdown would fail on the data, after the charge
            raise FeatureNotSupported(
                f"{agg.output_name}: COUNT(DISTINCT x) of an array (type {arg_type})",
                hint="count a scalar made from it, e.g. cardinality(x)")
        # the user's distinct values, at most k of them: a fixed choice among its own values
        # (by a hash of their text, so that users with many values do not all keep the same
        # smallest ones, which would make the count smaller than it need be)
        return (f"(SELECT array_agg(dp_v) FROM (SELECT dp_v FROM unnest(array_agg(DISTINCT "
                f"{_distinct_value(i, arg_type)})) AS dp_v WHERE dp_v IS NOT NULL ORDER BY "
                f"hashtext(dp_v::text) LIMIT {int(agg.known_bounds.upper)}) AS dp_d) AS dp_p{i}")
    check_number(agg, arg_type)
    if agg.kind is AggKind.SUM:
        return f"sum({_arg(i, arg_type)}) AS dp_p{i}"
    if agg.kind is AggKind.QUANTILE:
        assert agg.quantile is not None
        return (f"percentile_cont({float(agg.quantile)!r}::float8) WITHIN GROUP "
                f"(ORDER BY {_float_arg(i, arg_type)}) AS dp_p{i}")
    # AVG, VAR, STDDEV: the user's mean, divided once per user and group where it is
    # aggregated: a column of the per-user rows, so the later stages (which Citus runs on the
    # workers only with no fence between them) read it as a column and never divide again.
    # Not avg(): for floats it would also accumulate the sum of squares, which overflows (an
    # error) above ~1e154; the row clamp keeps the sum finite.
    arg = _arg(i, arg_type)
    total = f"sum({arg})" if arg_type in _FLOATS else f"(sum({arg}))::numeric"
    return f"{total} / NULLIF(count({arg}), 0) AS dp_v{i}"


_FIXED_SIZE_TYPES = frozenset({"int2", "int4", "int8", "float4", "float8", "bool", "date",
                               "time", "timetz", "timestamp", "timestamptz", "interval", "uuid",
                               "money", "oid", "char", "inet", "cidr", "macaddr", "macaddr8"})


_DIGESTED_TYPES = frozenset({"text", "varchar", "bpchar", "bytea"})


def digested_whole(arg_type: str | None) -> bool:
    """Whether COUNT(DISTINCT x) of this type gathers x without making its text (`_distinct_value`):
    of the others, the server checks that their text stays near their size."""
    return arg_type is None or arg_type in _FIXED_SIZE_TYPES or arg_type in _DIGESTED_TYPES \
        or arg_type in ("numeric", "jsonb")


def _distinct_value(i: int, arg_type: str | None) -> str:
    """What COUNT(DISTINCT x) collects of each row: x itself where its type's values are of a
    few bytes, else an md5 of one text of its equal values (texts' own, a numeric's without
    trailing zeros): each user's distinct values are gathered in one array before k of them
    are kept, and ten distinct 110 MB texts of one user passed Postgres's 1 GB limit on an
    array, an error after the charge (red team, session 31). Texts count each spelling, as
    their keys are grouped under "C"."""
    a = f"{PH}a{i}"
    if arg_type is None or arg_type in _FIXED_SIZE_TYPES:
        return a
    if arg_type in _DIGESTED_TYPES:
        return f"md5({a})"
    if arg_type == "numeric":
        return f"md5(trim_scale({a})::text)"
    if arg_type == "jsonb":
        # (its text can be several times its size; its hash is of its equal values' one form)
        return f"pg_catalog.jsonb_hash_extended({a}, 0)"
    return f"md5(({a})::text)"


def check_number(agg: Aggregate, arg_type: str | None) -> None:
    """Refuse a sum or mean of something that is not a number (before any charge)."""
    if agg.arg is not None and arg_type is not None and arg_type not in NUMERIC_TYPES:
        raise FeatureNotSupported(
            f"{agg.output_name}: the argument of {agg.kind.value} must be a number, not {arg_type}",
            hint="cast it in the query, e.g. x::numeric, where every value converts")


def mean_clamped(total: str, count: str, bounds: Bounds) -> str:
    """A user's sum of values in a group (`total`, of `count` values) with their mean clamped
    to `bounds`: between count × lower and count × upper (0 for no values)."""
    n = f"({count})::float8"
    return f"LEAST(GREATEST({total}, {n} * {f8(bounds.lower)}), {n} * {f8(bounds.upper)})"


def weighted(i: int, agg: Aggregate, component: str, weight: str) -> str:
    """The sum over (user, group) rows of a row-level aggregate's `component` (a
    `dp_core.plan.Component` value), each user's partials times its `weight`; with a clip
    (`Aggregate.row_bounds`), each user's sum clamped to its count times the clip."""
    b = agg.known_bounds
    mid = f8((b.lower + b.upper) / 2)
    total = f"dp_p{i}" if agg.kind is AggKind.SUM else f"dp_s{i}"
    squares = f"dp_q{i}"
    if agg.row_bounds is not None:
        total = mean_clamped(total, f"dp_n{i}", b)
        squares = squares_clamped(squares, f"dp_n{i}", b)
    term = {"count": f"dp_p{i}", "sum": total, "n": f"dp_n{i}",
            "csum": f"({total} - {mid} * dp_n{i})", "csq": squares}[component]
    return f"sum({term} * {weight})"


def squares_clamped(squares: str, count: str, bounds: Bounds) -> str:
    """A user's sum of squared distances to the midpoint of `bounds` in a group (`squares`, of
    `count` values) clamped to count × half the range squared (0 for no values)."""
    half = (bounds.upper - bounds.lower) / 2
    return f"LEAST({squares}, ({count})::float8 * {f8(half * half)})"


MEANS = frozenset({AggKind.AVG, AggKind.VAR, AggKind.STDDEV})
"""Aggregates whose per-user value is a mean (`partial`'s dp_v column)."""


def value(i: int, agg: Aggregate, arg_type: str | None) -> str:
    """Aggregate i's per-user value: the column `partial` made (NULL for a user without one)."""
    return f"dp_v{i}" if agg.kind in MEANS else f"dp_p{i}"
