"""The pushdown: per-user aggregation, contribution bounding, clamping and cross-user sums in SQL.

The pushdown's structure is our own SQL template, parsed by pglast; the user's
(validated, totalised) expressions are spliced in as AST nodes where the
template has placeholders, and the result is printed by pglast. No user text
is ever concatenated into SQL. Postgres returns one row per group:

    WITH dp_per_user AS (SELECT keys, uid, per-user partials FROM ... WHERE ...
                         GROUP BY uid, keys),
         dp_bounded AS (SELECT *, row_number() OVER (PARTITION BY dp_uid
                        ORDER BY keyed hash of (uid, keys)) AS dp_rn FROM dp_per_user)
    SELECT keys, count(*) AS dp_users, sums of clamped partials
    FROM dp_bounded WHERE dp_rn <= C_u GROUP BY keys

Clamping `LEAST(GREATEST(v, L), U)` maps NaN to U (Postgres orders NaN above
every number) and ±Infinity to U and L, so none survives to the output.
Per-user partials are computed in `numeric`, which neither overflows nor
fails on NaN or infinities.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pglast import ast, parse_sql
from pglast.enums import (
    A_Expr_Kind,
    BoolExprType,
    JoinType,
    LimitOption,
    NullTestType,
    SetOperation,
)
from pglast.stream import RawStream

from dp_core.errors import FeatureNotSupported, InternalError
from dp_core.plan import Component, DPQueryPlan, reads_user_count
from dp_core.quantiles import EDGES, LEAVES, LEVEL_DIVISORS, LEVEL_OFFSETS
from dp_core.query import AggKind, Aggregate, AnalyzedQuery, Bounds
from dp_core.result import quoted

_PH = "dp_ph_"


def _num(x: float) -> str:
    """A numeric literal for one of our own (finite) constants."""
    if x != x or x in (float("inf"), float("-inf")):
        raise InternalError()
    text = repr(float(x))  # our own constants only: never user text
    return f"({text})::numeric" if text.startswith("-") else f"{text}::numeric"


def _clamp(col: str, lower: float, upper: float) -> str:
    """A per-user partial clamped to [lower, upper], in numeric: what is computed from it
    (centred sums, squares) cannot overflow, whatever the bounds (float8 squares could)."""
    return (f"CASE WHEN {col} IS NULL THEN NULL ELSE "
            f"LEAST(GREATEST(({col})::numeric, {_num(lower)}), {_num(upper)}) END")


def _f8(x: float) -> str:
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


def _clamp_row(expr: str, limit: float, cast: str) -> str:
    """`expr` clamped to ±limit with NULL kept (LEAST/GREATEST alone ignore NULLs) and NaN
    mapped to +limit (NaN sorts above every number)."""
    return (f"CASE WHEN {expr} IS NULL THEN NULL ELSE LEAST(GREATEST({expr}, ({-limit!r})::{cast}), "
            f"({limit!r})::{cast}) END")


def _arg(i: int, arg_type: str | None) -> str:
    """The per-row argument of aggregate i, in a form whose sum cannot fail."""
    if arg_type in _EXACT_INTEGERS or arg_type == "numeric":
        return f"{_PH}a{i}"
    if arg_type in _FLOATS:
        # NaN becomes +1e290, then the per-user clamp to U
        return _clamp_row(f"({_PH}a{i})::float8", FLOAT_ROW_CLAMP, "float8")
    return f"({_PH}a{i})::numeric"


def _float_arg(i: int, arg_type: str | None) -> str:
    """The per-row argument of a quantile as a finite float8 (NaN becomes the upper clamp)."""
    if arg_type in _EXACT_INTEGERS:
        return f"({_PH}a{i})::float8"
    if arg_type in _FLOATS:
        return _arg(i, arg_type)
    return f"({_clamp_row(f'({_PH}a{i})::numeric', QUANTILE_ROW_CLAMP, 'numeric')})::float8"


def _partial(i: int, agg: Aggregate, arg_type: str | None) -> str:
    """Aggregate i's per-user partial columns (one row per user and group); `_value(i, ...)`
    is its value over them."""
    if agg.kind is AggKind.COUNT:
        return f"count({_PH}a{i}) AS dp_p{i}" if agg.arg is not None else f"count(*) AS dp_p{i}"
    if agg.kind is AggKind.COUNT_DISTINCT:
        if arg_type is not None and arg_type.endswith("[]"):
            # an array (as the probe names it): arrays of arrays must have one shape, so the
            # pushdown would fail on the data, after the charge
            raise FeatureNotSupported(
                f"{agg.output_name}: COUNT(DISTINCT x) of an array (type {arg_type})",
                hint="count a scalar, e.g. the array's text: x::text")
        # the user's distinct values, at most k of them: a fixed choice among its own values
        # (by a hash of their text, so that users with many values do not all keep the same
        # smallest ones, which would make the count smaller than it need be)
        return (f"(SELECT array_agg(dp_v) FROM (SELECT dp_v FROM unnest(array_agg(DISTINCT "
                f"{_PH}a{i})) AS dp_v WHERE dp_v IS NOT NULL ORDER BY hashtext(dp_v::text) "
                f"LIMIT {int(agg.known_bounds.upper)}) AS dp_d) AS dp_p{i}")
    if agg.arg is not None and arg_type is not None and arg_type not in NUMERIC_TYPES:
        raise FeatureNotSupported(
            f"{agg.output_name}: the argument of {agg.kind.value} must be a number, not {arg_type}",
            hint="cast it in the query, e.g. x::numeric, where every value converts")
    if agg.kind is AggKind.SUM:
        return f"sum({_arg(i, arg_type)}) AS dp_p{i}"
    if agg.kind is AggKind.QUANTILE:
        assert agg.quantile is not None
        return (f"percentile_cont({float(agg.quantile)!r}::float8) WITHIN GROUP "
                f"(ORDER BY {_float_arg(i, arg_type)}) AS dp_p{i}")
    # AVG, VAR, STDDEV: the user's mean, divided only for the rows a user keeps (avg() would
    # divide in numeric for every user and group). For floats, avg() would also accumulate
    # the sum of squares, which overflows (an error) above ~1e154; the row clamp keeps the
    # sum finite.
    arg = _arg(i, arg_type)
    return f"sum({arg}) AS dp_s{i}, count({arg}) AS dp_n{i}"


_MEANS = frozenset({AggKind.AVG, AggKind.VAR, AggKind.STDDEV})
"""Aggregates whose per-user value is a mean: `_partial` makes a sum and a count."""


def _value(i: int, agg: Aggregate, arg_type: str | None) -> str:
    """Aggregate i's per-user value, over the columns `_partial` made."""
    if agg.kind not in _MEANS:
        return f"dp_p{i}"
    total = f"dp_s{i}" if arg_type in _FLOATS else f"(dp_s{i})::numeric"
    return f"({total} / NULLIF(dp_n{i}, 0))"


def _present(i: int, agg: Aggregate) -> str:
    """A column `_partial` made that is NULL exactly when aggregate i's per-user value is (a
    mean's sum is NULL iff its count is 0): cheaper to test than the value, a division."""
    return f"dp_s{i}" if agg.kind in _MEANS else f"dp_p{i}"


Prefilter = tuple[str, ...]
"""Type names of the uid and of each key (in order), for `_kept_rows` to pick a user's groups
from its rows before aggregating them (`prefilter_types`)."""

_TYPED_HASHES: dict[str, tuple[str, str]] = {
    # type: (its own extended hash function, which equal values share; the value a NULL
    # hashes as, with another key: `_typed_hash`). Only types whose hash is cheap:
    # `hash_array_extended` works for any hashable type but costs more per row than the
    # prefilter saves.
    "text": ("hashtextextended", "''"),
    "varchar": ("hashtextextended", "''"),
    "bpchar": ("hashbpcharextended", "''"),
    "int2": ("hashint2extended", "0"),
    "int4": ("hashint4extended", "0"),
    "int8": ("hashint8extended", "0"),
    "numeric": ("hash_numeric_extended", "0"),
    "float4": ("hashfloat4extended", "0"),
    "float8": ("hashfloat8extended", "0"),
    "uuid": ("uuid_hash_extended", "'00000000-0000-0000-0000-000000000000'"),
}


def prefilter_types(uid_type: str, key_types: Sequence[str]) -> Prefilter | None:
    """The prefilter for a query whose uid and keys have these types (pg_type names), or None
    when one has no cheap hash that equal values share (`_TYPED_HASHES`; keys also need a
    `min` aggregate, which uuid lacks)."""
    types = (uid_type, *key_types)
    if not key_types or uid_type not in _TYPED_HASHES or any(
            t not in _TYPED_HASHES or t == "uuid" for t in key_types):
        return None
    return types


def _typed_hash(expr: str, type_name: str, seed: str) -> str:
    """`expr`'s hash keyed by `seed`; a NULL hashes as its type's `null` value keyed by `seed`
    with its lowest bit flipped, so that it is a group apart from '' (or 0), as in the plain
    pushdown, and ranks independently of it."""
    fn, null = _TYPED_HASHES[type_name]
    return (f"{fn}(COALESCE({expr}, ({null})::{type_name}), "
            f"({seed})::int8 # ({expr} IS NULL)::int4::int8)")


def _kept_rows(query: AnalyzedQuery, plan: DPQueryPlan, partials: list[str],
               order_seed: int, prefilter: Prefilter | None = None) -> tuple[str, str, str]:
    """(WITH-list entries, relation, condition): the per-user rows each user keeps (≤ C_u groups).

    With `prefilter`, a user's rows outside its kept groups are dropped before they are
    aggregated (`_prefiltered_rows`): the same mechanism, much cheaper where users have many
    more groups than C_u, dearer where they have few (a window over every row)."""
    keys = [f"{_PH}k{i} AS dp_k{i}" for i in range(len(query.keys))]
    if prefilter is not None and query.keys:
        return _prefiltered_rows(query, plan, partials, order_seed, prefilter)
    # the user first: rows read in user order (an index on the uid column, or a table
    # clustered by user) then group with small per-user sorts, and the groups come out in
    # the order the window below partitions by, so it sorts nothing but each user's groups
    group_by = ", ".join(str(n) for n in [len(keys) + 1, *range(1, len(keys) + 1)])
    per_user = (f"SELECT {', '.join([*keys, f'{_PH}uid AS dp_uid', *partials])} "
                f"FROM {_PH}from WHERE {_PH}where GROUP BY {group_by}")
    if not query.keys:
        return f"dp_per_user AS ({per_user})", "dp_per_user", "TRUE"
    # which groups a user keeps: a keyed hash of (user, group) with a fresh secret key per
    # query: independent across users as random() is, but parallel-safe and cheap to sort.
    # (A hash of the group alone would make every user prefer the same groups.) The same key
    # in every statement of one answer makes them all see the same kept rows.
    # The hash chains: the user's hash keys the first key's, which keys the next one's;
    # cheaper than hashing one concatenated text. A NULL key hashes as '' with its key's
    # lowest bit flipped: no tie with '' (a tie would let the statements of one answer keep
    # different groups), as in the prefiltered form (`_typed_hash`).
    rank = f"hashtextextended(coalesce(dp_uid::text, ''), {int(order_seed)})"
    for i in range(len(keys)):
        rank = (f"hashtextextended(coalesce(dp_k{i}::text, ''), "
                f"({rank}) # (dp_k{i} IS NULL)::int4::int8)")
    bounded = ("SELECT *, row_number() OVER (PARTITION BY dp_uid ORDER BY "
               f"{rank}) AS dp_rn FROM dp_per_user")
    return (f"dp_per_user AS ({per_user}), dp_bounded AS ({bounded})", "dp_bounded",
            f"dp_rn <= {int(plan.max_groups_contributed)}")


_ARG_PLACEHOLDER = re.compile(rf"\b{_PH}a(\d+)\b")


def _prefiltered_rows(query: AnalyzedQuery, plan: DPQueryPlan, partials: list[str],
                      order_seed: int, types: Prefilter) -> tuple[str, str, str]:
    """`_kept_rows` picking each user's groups from its rows:

        dp_rows AS (SELECT keys, uid, arguments, h AS dp_o,
                    dense_rank() OVER (PARTITION BY uid ORDER BY h) AS dp_r FROM ...)
        dp_per_user AS (SELECT min(key) AS key, uid, partials FROM dp_rows
                        WHERE dp_r <= C_u GROUP BY uid, dp_o)

    where h is a keyed hash of (uid, keys) by each type's own hash function, so that all rows
    of one group (equal keys, whatever their texts: numeric 1.0 = 1.00) have one h. A user's
    rows with its C_u smallest h make at most C_u per-user rows, one per h, and never two in
    one group (equal keys have equal h); the rows come out of the window in (uid, h) order,
    so grouping them sorts nothing, and Postgres stops ranking a user's rows at the first
    beyond C_u. A hash tie between two groups of one user (about 2^-64 a pair) makes one
    per-user row of both, labelled with the smaller key: still one row, clamped as any.
    With several keys a tie could label a row with a third group the user also has: there
    the rows are ranked by (h, keys) and grouped by (uid, h, keys), which is exact at the
    cost of sorting by the keys too.
    """
    n = len(query.keys)
    if len(types) != n + 1:
        raise InternalError("a prefilter needs the types of the uid and of every key")
    seed = str(int(order_seed))
    h = _typed_hash(f"{_PH}uid", types[0], seed)
    for i in range(n):
        h = _typed_hash(f"{_PH}k{i}", types[i + 1], h)
    # each argument once (ANON_SUM(x) and ANON_AVG(x) read one column, whose sums Postgres
    # then computes once)
    same: dict[int, int] = {}
    for i in sorted({int(m) for p in partials for m in _ARG_PLACEHOLDER.findall(p)}):
        arg = query.aggregates[i].arg
        same[i] = next((j for j in same.values() if query.aggregates[j].arg == arg), i)
    order = [h] if n == 1 else [h, *(f"{_PH}k{i}" for i in range(n))]
    cols = [*(f"{_PH}k{i} AS dp_k{i}" for i in range(n)), f"{_PH}uid AS dp_uid",
            *(f"{_PH}a{i} AS dp_a{i}" for i in sorted(set(same.values()))), f"{h} AS dp_o",
            f"dense_rank() OVER (PARTITION BY {_PH}uid ORDER BY {', '.join(order)}) AS dp_r"]
    rows = f"SELECT {', '.join(cols)} FROM {_PH}from WHERE {_PH}where"
    keys = [f"dp_k{i}" for i in range(n)]
    labels = ["min(dp_k0) AS dp_k0"] if n == 1 else keys
    own = [_ARG_PLACEHOLDER.sub(lambda m: f"dp_a{same[int(m[1])]}", p) for p in partials]
    per_user = (f"SELECT {', '.join([*labels, 'dp_uid', *own])} FROM dp_rows "
                f"WHERE dp_r <= {int(plan.max_groups_contributed)} "
                f"GROUP BY {', '.join(['dp_uid', 'dp_o', *([] if n == 1 else keys)])}")
    return f"dp_rows AS ({rows}), dp_per_user AS ({per_user})", "dp_per_user", "TRUE"


def groups_sql(query: AnalyzedQuery, uid_range: UidRange | None = None,
               uid_not_null: bool = False) -> str:
    """How many (user, group) pairs and users there are (of the users in `uid_range`; see
    `ranged_pushdown` for `uid_not_null`): what a `Prefilter` is chosen by."""
    if uid_range is None:
        return _build(_groups_template(query), query)
    import secrets

    token = secrets.token_hex(8)
    return _fill(_build(_groups_template(query), query, token), token, uid_range,
                 _null_uids(query, uid_not_null))


def _groups_template(query: AnalyzedQuery) -> str:
    keys = [f"{_PH}k{i} AS dp_k{i}" for i in range(len(query.keys))]
    group_by = ", ".join(str(n) for n in range(1, len(keys) + 2))
    return (f"WITH dp_per_user AS (SELECT {', '.join([f'{_PH}uid AS dp_uid', *keys])} "
            f"FROM {_PH}from WHERE {_PH}where GROUP BY {group_by}) "
            "SELECT count(*) AS dp_groups, count(DISTINCT dp_uid) AS dp_users FROM dp_per_user")


def _template(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str],
              order_seed: int, prefilter: Prefilter | None = None) -> str | None:
    partials = [_partial(i, agg, arg_types.get(i)) for i, agg in enumerate(query.aggregates)
                if not reads_user_count(agg) and agg.kind is not AggKind.QUANTILE]
    finals = []
    means: dict[str, str] = {}
    if plan.threshold is not None or plan.shared_users:
        finals.append("count(*) AS dp_users")
    for q in plan.quantities:
        if q.component in (Component.USERS, Component.TREE):
            continue  # dp_users, above; trees have their own statement
        assert q.aggregate is not None
        agg = query.aggregates[q.aggregate]
        lo, hi = agg.known_bounds.lower, agg.known_bounds.upper
        mid = (lo + hi) / 2
        p = _value(q.aggregate, agg, arg_types.get(q.aggregate))
        if agg.kind in _MEANS:  # divided once per kept row, in dp_kept below
            means[f"dp_v{q.aggregate}"] = p
            p = f"dp_v{q.aggregate}"
        if q.component == Component.COUNT:
            finals.append(f"sum(LEAST({p}, {_num(hi)})) AS {q.name}")
        elif q.component == Component.DISTINCT:
            # each user's values padded with NULLs to k (array_agg of arrays needs one length)
            # and counted once over all the group's users
            v = f"coalesce({p}, '{{}}')"
            padded = f"array_cat({v}, array_fill(({v})[0], ARRAY[{int(hi)} - cardinality({v})]))"
            finals.append(f"(SELECT count(DISTINCT dp_v) FROM unnest(array_agg({padded})) "
                          f"AS dp_v) AS {q.name}")
        elif q.component == Component.SUM:
            finals.append(f"sum({_clamp(p, lo, hi)}) AS {q.name}")
        elif q.component == Component.N:
            finals.append(f"count({p}) AS {q.name}")
        elif q.component == Component.CENTERED_SUM:
            finals.append(f"sum({_clamp(p, lo, hi)} - {_num(mid)}) AS {q.name}")
        elif q.component == Component.CENTERED_SQUARES:
            c = f"({_clamp(p, lo, hi)} - {_num(mid)})"
            finals.append(f"sum({c} * {c}) AS {q.name}")
        else:
            raise InternalError()
    if not finals:
        return None  # a global query of quantiles only: the tree statement answers it
    with_list, relation, kept = _kept_rows(query, plan, partials, order_seed, prefilter)
    if means:
        # OFFSET 0 keeps the subquery from being flattened, which would copy each mean into
        # every expression that uses it and divide several times per row
        cols = ", ".join(f"{expr} AS {name}" for name, expr in means.items())
        relation = f"(SELECT *, {cols} FROM {relation} WHERE {kept} OFFSET 0) AS dp_kept"
        kept = "TRUE"
    if not query.keys:
        return f"WITH {with_list} SELECT {', '.join(finals)} FROM {relation}"
    key_cols = [f"dp_k{i}" for i in range(len(query.keys))]
    key_text = [f"dp_k{i}::text AS dp_t{i}" for i in range(len(query.keys))]
    columns = [*key_cols, *key_text, *_key_hashes(query), *finals]
    return (f"WITH {with_list} SELECT {', '.join(columns)} "
            f"FROM {relation} WHERE {kept} GROUP BY {', '.join(key_cols)}")


def _key_hashes(query: AnalyzedQuery) -> list[str]:
    """The match columns of hashed keys (`Key.hashed`): the hash of the value by its type's
    own hash function, which equal values share whatever their texts."""
    return [f"hash_array_extended(ARRAY[dp_k{i}], 0) AS dp_h{i}"
            for i, k in enumerate(query.keys) if k.hashed]


def _tree_template(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str],
                   order_seed: int, prefilter: Prefilter | None = None) -> str | None:
    """One row per group and quantile: the codes and user counts of the tree's non-empty nodes."""
    indexes = [i for i, a in enumerate(query.aggregates) if a.kind is AggKind.QUANTILE]
    if not indexes:
        return None
    partials = [_partial(i, query.aggregates[i], arg_types.get(i)) for i in indexes]
    with_list, relation, kept = _kept_rows(query, plan, partials, order_seed, prefilter)
    key_cols = [f"dp_k{i}" for i in range(len(query.keys))]
    leaves = []
    for i in indexes:
        b = query.aggregates[i].known_bounds
        lo, hi = _f8(b.lower), _f8(b.upper)
        leaf = (f"LEAST(GREATEST(floor((LEAST(GREATEST(dp_p{i}, {lo}), {hi}) - {lo}) / ({hi} - {lo}) "
                f"* {_f8(LEAVES)}), 0), {LEAVES - 1})::int4")
        leaves.append(f"SELECT {', '.join([*key_cols, f'{i} AS dp_agg', f'{leaf} AS dp_leaf'])} "
                      f"FROM {relation} WHERE {kept} AND dp_p{i} IS NOT NULL")
    levels = ", ".join(f"({off}, {div})" for off, div in zip(LEVEL_OFFSETS, LEVEL_DIVISORS,
                                                             strict=True))
    nodes = (f"SELECT {', '.join([*key_cols, 'dp_agg'])}, lv.off + dp_leaf / lv.div AS dp_code, "
             f"count(*) AS dp_n FROM ({' UNION ALL '.join(leaves)}) AS dp_leaves "
             f"CROSS JOIN (VALUES {levels}) AS lv(off, div) "
             f"GROUP BY {', '.join(str(n) for n in range(1, len(key_cols) + 3))}")
    key_text = [f"dp_k{i}::text AS dp_t{i}" for i in range(len(query.keys))]
    order = [f'dp_k{i}::text COLLATE "C"' for i in range(len(query.keys))]
    columns = [*key_text, *_key_hashes(query), "dp_agg"]
    return (f"WITH {with_list}, dp_nodes AS ({nodes}) "
            # codes and counts as big-endian int4 / int8 bytes (`release.tree_arrays`): a tree
            # of 70k nodes is 840 kB instead of Python lists of ten times that
            f"SELECT {', '.join(columns)}, string_agg(int4send(dp_code), ''::bytea "
            "ORDER BY dp_code) AS dp_codes, string_agg(int8send(dp_n), ''::bytea ORDER BY dp_code) "
            "AS dp_counts FROM dp_nodes "
            f"GROUP BY {', '.join([*key_cols, 'dp_agg'])} "
            # in one order (code points; NULL last) for any collation and range of users, so
            # that the trees of several ranges merge as streams (one group at a time)
            f"ORDER BY {', '.join([*order, 'dp_agg'])}")


def _bounds_template(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str],
                     order_seed: int, prefilter: Prefilter | None = None) -> str | None:
    """APPROX_BOUNDS: per aggregate without bounds, the users per log-scale bin (all groups)."""
    indexes = sorted(plan.auto_bounds)
    if not indexes:
        return None
    partials = [_partial(i, query.aggregates[i], arg_types.get(i)) for i in indexes]
    with_list, relation, kept = _kept_rows(query, plan, partials, order_seed, prefilter)
    edges = ", ".join(str(e) for e in EDGES)
    aggs = query.aggregates
    bins = [f"SELECT {i} AS dp_agg, width_bucket(({_value(i, aggs[i], arg_types.get(i))})::numeric, "
            f"(ARRAY[{edges}])::numeric[]) AS dp_bin FROM {relation} "
            f"WHERE {kept} AND {_present(i, aggs[i])} IS NOT NULL" for i in indexes]
    return (f"WITH {with_list} SELECT dp_agg, dp_bin, count(*) AS dp_n "
            f"FROM ({' UNION ALL '.join(bins)}) AS dp_bins GROUP BY 1, 2")


class _Splice:
    """Replaces placeholders in the template with the user's AST nodes.

    A direct walk over the nodes' slots (pglast's generic Visitor, which tracks every node's
    ancestors, took half of a pushdown's build time); what it puts in is not walked again, so
    the user's own names are never taken for placeholders."""

    def __init__(self, nodes: dict[str, Any], from_clause: tuple[Any, ...],
                 inner_froms: dict[str, tuple[Any, ...]] | None = None) -> None:
        self.nodes = nodes
        self.froms = {f"{_PH}from": from_clause, **(inner_froms or {})}
        """FROM placeholders (`FROM dp_ph_from`, ...) and the FROM clause each stands for."""

    def __call__(self, node: Any) -> Any:
        return self._walk(node)

    def _walk(self, node: Any) -> Any:
        """`node` with its placeholders replaced: the replacement when it is one itself."""
        if isinstance(node, ast.ColumnRef):
            fields = node.fields
            name = getattr(fields[-1], "sval", "") if fields else ""
            if len(fields) == 1 and name.startswith(_PH):
                if name not in self.nodes:
                    raise InternalError()
                return copy.deepcopy(self.nodes[name])
            return node
        done = None
        if isinstance(node, ast.SelectStmt):
            fc = node.fromClause
            if fc and len(fc) == 1 and isinstance(fc[0], ast.RangeVar) and \
                    fc[0].relname in self.froms:
                node.fromClause = copy.deepcopy(self.froms[fc[0].relname])
                done = "fromClause"
        for slot in node.__slots__:
            if slot == done:
                continue
            value = getattr(node, slot)
            if isinstance(value, ast.Node):
                new = self._walk(value)
                if new is not value:
                    setattr(node, slot, new)
            elif isinstance(value, tuple) and value:
                new = self._walk_items(value)
                if new is not value:
                    setattr(node, slot, new)
        return node

    def _walk_items(self, items: tuple[Any, ...]) -> tuple[Any, ...]:
        """`items` with their placeholders replaced (the same tuple when none is there)."""
        out = [self._walk(v) if isinstance(v, ast.Node) else
               self._walk_items(v) if isinstance(v, tuple) else v for v in items]
        return tuple(out) if any(a is not b for a, b in zip(out, items, strict=True)) else items


def _probe_sql(query: AnalyzedQuery, exprs: dict[str, Any],
               inner: dict[str, tuple[Any, Any]] | None = None) -> str | None:
    """`SELECT expr AS name, ... FROM <the query's FROM> WHERE FALSE`: prepared, never run,
    so that Postgres reports the expressions' types. `inner` maps more names to an expression
    and the inner query whose FROM it reads, probed as `(SELECT expr FROM <its FROM> WHERE
    FALSE)`: a scalar subquery has its column's type."""
    inner = inner or {}
    if not exprs and not inner:
        return None
    cols = [f"{_PH}{name} AS {name}" for name in exprs]
    cols += [f"(SELECT {_PH}{name} FROM {_PH}from_{name} WHERE FALSE) AS {name}" for name in inner]
    stmt = parse_sql(f"SELECT {', '.join(cols)} FROM {_PH}from WHERE FALSE")[0].stmt
    nodes = {f"{_PH}{name}": node for name, node in exprs.items()}
    nodes.update((f"{_PH}{name}", arg) for name, (arg, _) in inner.items())
    froms = {f"{_PH}from_{name}": tuple(scope.fromClause) for name, (_, scope) in inner.items()}
    _Splice(nodes, query.from_clause, froms)(stmt)
    if query.ctes:
        stmt.withClause = ast.WithClause(ctes=tuple(copy.deepcopy(query.ctes)))
    return str(RawStream()(stmt))


def argument_probe_sql(query: AnalyzedQuery) -> str | None:
    """A query whose result columns have the types of the aggregates' arguments (a{i}), of
    the deferred casts' arguments (c{i}, for `check_casts`), of the arithmetic operators as
    written (t{i}, for their integer semantics) and, for queries with quantiles,
    of the keys (k{i}): one statement to prepare."""
    exprs = {f"a{i}": a.arg for i, a in enumerate(query.aggregates)
             if a.arg is not None and a.kind is not AggKind.COUNT}
    exprs.update((f"c{i}", c.arg) for i, c in enumerate(query.casts) if c.scope is None)
    exprs.update((f"t{i}", c.arg) for i, c in enumerate(query.arithmetic) if c.scope is None)
    if query.has_quantiles:  # (k{i}): whether trees and rows can be matched by key text
        exprs.update((f"k{i}", k.expr) for i, k in enumerate(query.keys))
    inner = {f"c{i}": (c.arg, c.scope) for i, c in enumerate(query.casts) if c.scope is not None}
    inner.update((f"t{i}", (c.arg, c.scope)) for i, c in enumerate(query.arithmetic)
                 if c.scope is not None)
    return _probe_sql(query, exprs, inner)


def standalone_subqueries(query: AnalyzedQuery) -> list[str]:
    """Each IN or EXISTS subquery of `query` as a statement of its own (with the query's WITH
    list): it plans only if it reads nothing of the DP query's row, i.e. is not correlated."""
    out = []
    for sub in query.sublinks:
        outer = ast.SelectStmt(
            targetList=(ast.ResTarget(val=ast.A_Const(val=ast.Integer(ival=1))),),
            fromClause=(ast.RangeSubselect(lateral=False, subquery=copy.deepcopy(sub),
                                           alias=ast.Alias(aliasname="dp_s")),),
            limitOption=LimitOption.LIMIT_OPTION_DEFAULT, op=SetOperation.SETOP_NONE)
        if query.ctes:
            outer.withClause = ast.WithClause(ctes=tuple(copy.deepcopy(query.ctes)),
                                              recursive=False)
        out.append(str(RawStream()(outer)))
    return out


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


def _has_outer_join(query: AnalyzedQuery) -> bool:
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
    if _has_outer_join(query):
        return uids
    for t in query.tables:
        ref = ast.ColumnRef(fields=(ast.String(sval=t.alias), ast.String(sval=t.uid_column)))
        if all(ref != u for u in uids):
            uids.append(ref)
    return uids


def _uid_in(query: AnalyzedQuery, token: str) -> Any:
    """The query's users in the range that `_fill` later writes in for the marks named by
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


def _fill(sql: str, token: str, uid_range: UidRange, null_uids: bool = True) -> str:
    """`sql` with the marks of `_uid_in` replaced by `uid_range`'s bounds (an open end's
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


def _build(template: str, query: AnalyzedQuery, token: str | None = None) -> str:
    stmt = parse_sql(template)[0].stmt
    where = query.where or ast.A_Const(val=ast.Boolean(boolval=True))
    if token is not None:
        where = ast.BoolExpr(boolop=BoolExprType.AND_EXPR, args=(where, _uid_in(query, token)))
    nodes: dict[str, Any] = {f"{_PH}uid": query.uid, f"{_PH}where": where}
    for i, key in enumerate(query.keys):
        nodes[f"{_PH}k{i}"] = key.expr
    for i, agg in enumerate(query.aggregates):
        if agg.arg is not None:
            nodes[f"{_PH}a{i}"] = agg.arg
    _Splice(nodes, query.from_clause)(stmt)
    if query.ctes:
        stmt.withClause.ctes = tuple(copy.deepcopy(query.ctes)) + tuple(stmt.withClause.ctes)
    return str(RawStream()(stmt))


@dataclass(frozen=True)
class Pushdown:
    """The statements one DP answer runs as the pushdown role (in one snapshot)."""

    main: str | None
    """One row per group: true user counts and sums (None for a global query of quantiles only)."""
    trees: str | None
    """One row per group and quantile: the quantile tree's non-empty nodes."""
    bounds: str | None
    """APPROX_BOUNDS: users per log-scale bin and aggregate (run first, when present)."""
    order_seed: int

    def statements(self) -> dict[str, str]:
        """The statements there are, by name, in the order they run."""
        named = (("bounds", self.bounds), ("main", self.main), ("trees", self.trees))
        return {name: sql for name, sql in named if sql}


def pushdown(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str] | None = None,
             order_seed: int | None = None, uid_range: UidRange | None = None,
             prefilter: Prefilter | None = None) -> Pushdown:
    """The pushdown statements for `plan`.

    `arg_types` maps aggregate indexes to their argument's type name (from
    `argument_probe_sql`); unknown types are summed in numeric. `order_seed`
    keys the hash that picks which groups a user keeps; a fresh secret one is
    drawn when none is given. Before APPROX_BOUNDS has run, aggregates without
    bounds get placeholder bounds [0, 1] in `main` and `trees` (prepared only,
    for their types; run them from `pushdown` with the found bounds).
    With `uid_range`, the statements read only the users in that range (see
    `RangedPushdown`). With `prefilter`, users' rows outside their kept groups are dropped
    before aggregating (`_prefiltered_rows`).
    """
    if uid_range is not None:
        return ranged_pushdown(query, plan, arg_types, order_seed, prefilter).of(uid_range)
    return _pushdown(query, plan, arg_types, order_seed, None, prefilter)


@dataclass(frozen=True)
class RangedPushdown:
    """The pushdown for any range of the uid, printed once with marks for the range's bounds.

    The statements of the ranges of `uid_ranges(...)` together read every user once, and as
    all their columns but the keys are sums over users, their rows add up to the unsplit
    statements' rows (`release.add_rows`).
    """

    marked: Pushdown
    token: str
    null_uids: bool = True
    """Whether the query's uid can be NULL (the lowest range then holds it)."""

    def of(self, uid_range: UidRange) -> Pushdown:
        """The statements that read only the users in `uid_range`."""
        def fill(sql: str | None) -> str | None:
            return None if sql is None else _fill(sql, self.token, uid_range, self.null_uids)

        m = self.marked
        return Pushdown(fill(m.main), fill(m.trees), fill(m.bounds), m.order_seed)


def ranged_pushdown(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str] | None,
                    order_seed: int | None, prefilter: Prefilter | None = None,
                    uid_not_null: bool = False) -> RangedPushdown:
    """The pushdown for any uid range (`RangedPushdown.of`). `uid_not_null`: the uid column
    is declared NOT NULL (so the query's uid is never NULL unless an outer join makes it)."""
    import secrets

    token = secrets.token_hex(8)
    return RangedPushdown(_pushdown(query, plan, arg_types, order_seed, token, prefilter), token,
                          _null_uids(query, uid_not_null))


def _null_uids(query: AnalyzedQuery, uid_not_null: bool) -> bool:
    """Whether the query's uid can be NULL: its column allows it, or an outer join makes it."""
    return not uid_not_null or _has_outer_join(query)


def _pushdown(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str] | None,
              order_seed: int | None, token: str | None,
              prefilter: Prefilter | None = None) -> Pushdown:
    import secrets

    seed = secrets.randbits(62) if order_seed is None else order_seed
    types = arg_types or {}
    bounds_sql = _bounds_template(query, plan, types, seed, prefilter)
    # the statements' shape needs only the plan's quantity names, which bounds do not change
    query = query.with_bounds({i: Bounds(0.0, 1.0) for i, a in enumerate(query.aggregates)
                               if a.bounds is None})
    main = _template(query, plan, types, seed, prefilter)
    if main and token is not None and query.keys:
        # in one order (code points; NULL last) for any collation and range of users, as the
        # trees: the ranges' rows merge as streams, a group at a time (`release.row_order`)
        order = ", ".join(f'dp_k{i}::text COLLATE "C"' for i in range(len(query.keys)))
        main = f"{main} ORDER BY {order}"
    trees = _tree_template(query, plan, types, seed, prefilter)
    built = Pushdown(_build(main, query, token) if main else None,
                     _build(trees, query, token) if trees else None,
                     _build(bounds_sql, query, token) if bounds_sql else None, seed)
    if order_seed is not None and order_seed >= _SENTINELS:
        # a sentinel (`PushdownCache`): it must be in the printed statements exactly where the
        # templates put it, or the seed written in later would change something else
        digits = str(order_seed)
        for template, sql in ((main, built.main), (trees, built.trees), (bounds_sql, built.bounds)):
            if (template or "").count(digits) != (sql or "").count(digits):
                raise _NotSeedable()
    return built


_SENTINELS = 1 << 62
"""Order seeds at or above this are sentinels of `PushdownCache` (real ones are 62 bits)."""


class _NotSeedable(Exception):
    """A sentinel seed's digits are also elsewhere in the printed statements."""


class PushdownCache:
    """Printed pushdowns by query, reused with a fresh order seed written in.

    Building a pushdown (splicing the query into the templates and printing it) was most of
    the proxy's Python per answer; a query asked again (dashboards, the same statement with
    the same parameters and settings) has the same statements but for the seed. They are
    built once with a random sentinel seed of 19 digits, checked to appear exactly where the
    templates put it, and each answer gets them with its own fresh secret seed in its place.
    `key` must determine everything the statements depend on but the seed: the query and its
    parameters, the settings, the argument types, the prefilter and the uid's nullability.
    """

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._entries: dict[Any, tuple[int, Pushdown | RangedPushdown]] = {}

    def pushdown(self, key: Any, query: AnalyzedQuery, plan: DPQueryPlan,
                 arg_types: dict[int, str] | None) -> Pushdown:
        """`pushdown(query, plan, arg_types)`, with a fresh seed."""
        import secrets

        got = self._get(("pushdown", key), lambda s: _pushdown(query, plan, arg_types, s, None))
        seed = secrets.randbits(62)
        if got is None:
            return _pushdown(query, plan, arg_types, seed, None)
        sentinel, built = got
        assert isinstance(built, Pushdown)
        return _seeded(built, sentinel, seed)

    def ranged(self, key: Any, query: AnalyzedQuery, plan: DPQueryPlan,
               arg_types: dict[int, str] | None, order_seed: int, prefilter: Prefilter | None,
               uid_not_null: bool) -> RangedPushdown:
        """`ranged_pushdown(...)` with `order_seed`."""
        got = self._get(("ranged", key, prefilter, uid_not_null), lambda s: ranged_pushdown(
            query, plan, arg_types, s, prefilter, uid_not_null))
        if got is None:
            return ranged_pushdown(query, plan, arg_types, order_seed, prefilter, uid_not_null)
        sentinel, built = got
        assert isinstance(built, RangedPushdown)
        return RangedPushdown(_seeded(built.marked, sentinel, order_seed), built.token,
                              built.null_uids)

    def _get(self, key: Any, build: Callable[[int], Pushdown | RangedPushdown]
             ) -> tuple[int, Pushdown | RangedPushdown] | None:
        import secrets

        hit = self._entries.pop(key, None)
        if hit is None:
            sentinel = _SENTINELS + secrets.randbits(60)
            try:
                hit = (sentinel, build(sentinel))
            except _NotSeedable:
                return None
            if len(self._entries) >= self.size:
                self._entries.pop(next(iter(self._entries)))
        self._entries[key] = hit  # (most recently used last)
        return hit


def _seeded(built: Pushdown, sentinel: int, seed: int) -> Pushdown:
    old, new = str(sentinel), str(seed)

    def put(sql: str | None) -> str | None:
        return None if sql is None else sql.replace(old, new)

    return Pushdown(put(built.main), put(built.trees), put(built.bounds), seed)


def pushdown_sql(query: AnalyzedQuery, plan: DPQueryPlan, arg_types: dict[int, str] | None = None,
                 order_seed: int | None = None) -> str:
    """The main pushdown statement alone (queries without quantiles and APPROX_BOUNDS)."""
    pd = pushdown(query, plan, arg_types, order_seed)
    if pd.main is None or pd.trees is not None or pd.bounds is not None:
        raise InternalError()
    return pd.main
