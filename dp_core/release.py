"""From the pushdown's true per-group quantities to the released, differentially private rows.

Noise is added to every quantity of every group (vectorised, in
`dp_core.mechanisms`); grouped results keep only groups whose noisy user
count reaches τ; a global aggregate always yields exactly one row. AVG is the
midpoint plus a noisy centred sum over a noisy count, clamped to [L, U] (Li et
al.); VAR uses the noisy centred sum of squares as well, clamped to
[0, ((U−L)/2)²]; STDDEV is √VAR. Quantiles come from walking each group's tree
with noisy counts (`dp_core.quantiles`).
"""

from __future__ import annotations

import dataclasses
import decimal
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from dp_core.errors import InternalError
from dp_core.mechanism_choices import SelectionKind
from dp_core.mechanisms import keep_probability, secure_rng
from dp_core.plan import Component, DPQueryPlan, NoisyQuantity, reads_user_count
from dp_core.quantiles import LEAVES, LEVEL_OFFSETS, walk, walk_interval
from dp_core.query import AggKind, Aggregate, AnalyzedQuery

INT8 = "int8"
FLOAT8 = "float8"


_COUNTS = (AggKind.COUNT, AggKind.COUNT_USERS, AggKind.COUNT_DISTINCT)


def output_type(agg: Aggregate) -> str:
    """Counts are bigint, every other DP aggregate double precision."""
    return INT8 if agg.kind in _COUNTS else FLOAT8


@dataclass(frozen=True)
class Released:
    """The released rows: key texts (None for NULL), aggregate values and interval ends, in
    the order of the query's outputs (`AnalyzedQuery.outputs`)."""

    rows: tuple[tuple[str | int | float | None, ...], ...]
    groups_in: int
    """Groups the pushdown returned (before thresholding); not to be shown to analysts."""
    spread: Mapping[int, tuple[float, float]] = dataclasses.field(default_factory=dict)
    """For each AVG, VAR and STDDEV (by aggregate index): the smallest and largest 95% noise
    half-width over the released groups (`noise_half_widths`)."""


GroupKey = tuple[str | int | None, ...]
"""What matches a group's row with its quantile trees: its key texts (the pushdown's dp_t
columns) or, for hashed keys, their hashes (dp_h); () for a global aggregate."""


def only_counted_groups(query: AnalyzedQuery) -> bool:
    """Whether the groups no user counts in (`dp_users` 0) are no candidates: with row-level
    aggregates, where users weight rows in groups their counts do not go to (such a group is
    never released, else a user could make any number of its groups candidates, each with a
    small chance); not with public groups (each listed one is released)."""
    return bool(query.keys) and any(a.row_level for a in query.aggregates) \
        and not query.public_groups


def group_key(row: Mapping[str, Any], query: AnalyzedQuery) -> GroupKey:
    return tuple(row[f"dp_h{i}" if k.hashed else f"dp_t{i}"] for i, k in enumerate(query.keys))


def row_order(row: Mapping[str, Any], keys: int) -> tuple[Any, ...]:
    """Where a row of a ranged main statement sorts (its ORDER BY: key texts by code point,
    NULL last), for merging the rows of several ranges of users as streams."""
    return tuple((1, "") if row[f"dp_t{i}"] is None else (0, row[f"dp_t{i}"])
                 for i in range(keys))


def tree_order(row: Mapping[str, Any], keys: int) -> tuple[Any, ...]:
    """Where a tree-statement row sorts (its ORDER BY: key texts by code point, NULL last; then
    the aggregate), for merging the trees of several ranges of users as streams."""
    return (*row_order(row, keys), int(row["dp_agg"]))


def tree_arrays(row: Mapping[str, Any]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """A tree row's node codes and user counts: bytes from the tree statement (big-endian int4
    and int8), or sequences."""
    codes, counts = row["dp_codes"], row["dp_counts"]
    if isinstance(codes, bytes):
        return (np.frombuffer(codes, dtype=">i4").astype(np.int64),
                np.frombuffer(counts, dtype=">i8").astype(np.int64))
    return np.asarray(codes, dtype=np.int64), np.asarray(counts, dtype=np.int64)


def tree_nodes(row: Mapping[str, Any]) -> int:
    codes = row["dp_codes"]
    return len(codes) // 4 if isinstance(codes, bytes) else len(codes)


def add_trees(parts: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """One group's quantile tree from its trees in several ranges of users (rows of the tree
    statement with equal keys and aggregate): each node's user count is the sum of its counts."""
    if len(parts) == 1:
        return parts[0]
    # one dense count per possible node (560 kB), each part added in turn: a smaller peak
    # than sorting all parts' codes together
    dense = np.zeros(LEVEL_OFFSETS[-1] + LEAVES, dtype=np.int64)
    for p in parts:
        codes, counts = tree_arrays(p)
        dense[codes] += counts  # a part's codes are distinct
    nodes = np.flatnonzero(dense)
    merged = dict(parts[0].items())
    merged["dp_codes"], merged["dp_counts"] = nodes.astype(np.int64), dense[nodes]
    return merged


_EXACT = decimal.Context(prec=decimal.MAX_PREC, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)


def add_rows(parts: Iterable[Iterable[Mapping[str, Any]]], by: Sequence[str],
             keep: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The rows of statements that each read one range of the users, added up.

    Rows with equal `by` columns are one row; `keep` columns are taken from the first of them
    and every other column is a sum over users, so it adds up (NULL only where all are NULL,
    as SQL's sum). With `by` empty (a global aggregate) the result is one row.
    """
    merged: dict[tuple[Any, ...], dict[str, Any]] = {}
    with decimal.localcontext(_EXACT):  # numeric sums add exactly, as in Postgres
        for rows in parts:
            for row in rows:
                key = tuple(row[c] for c in by)
                into = merged.get(key)
                if into is None:
                    merged[key] = dict(row.items())
                    continue
                for name, value in row.items():
                    if name in by or name in keep or value is None:
                        continue
                    into[name] = value if into[name] is None else into[name] + value
    return list(merged.values())


QuantileAnswer = float | tuple[float, float, float]
"""A group's DP quantile, or (with an interval column of it) the quantile and its interval's
ends (`quantiles.walk_interval`)."""


def quantile_value(query: AnalyzedQuery, plan: DPQueryPlan, aggregate: int,
                   codes: Sequence[int] | NDArray[np.int64], counts: Sequence[int] | NDArray[np.int64],
                   rng: np.random.Generator) -> QuantileAnswer:
    """The DP quantile of one group from its tree's non-empty nodes (a row of the tree
    statement), with its interval where the query selects one (DP_INTERVAL_LOW / HIGH)."""
    agg = query.aggregates[aggregate]
    tree = plan.quantity(f"dp_a{aggregate}_{Component.TREE}")
    assert agg.quantile is not None
    b = agg.known_bounds
    codes, counts = np.asarray(codes, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    if any(o.aggregate == aggregate and o.bound is not None for o in query.outputs):
        return walk_interval(codes, counts, agg.quantile, b.lower, b.upper, tree.spec, rng)
    return float(walk(codes, counts, agg.quantile, b.lower, b.upper, tree.spec, rng)[0])


def tree_answer(query: AnalyzedQuery, plan: DPQueryPlan, row: Mapping[str, Any],
                rng: np.random.Generator) -> tuple[tuple[GroupKey, int], QuantileAnswer]:
    """((group, aggregate), DP quantile) from one row of the tree statement (one whole tree):
    rows can be streamed, keeping only the answers."""
    aggregate = int(row["dp_agg"])
    return ((group_key(row, query), aggregate),
            quantile_value(query, plan, aggregate, *tree_arrays(row), rng))


def tree_values(query: AnalyzedQuery, plan: DPQueryPlan, tree_rows: Iterable[Mapping[str, Any]],
                rng: np.random.Generator | None = None
                ) -> dict[tuple[GroupKey, int], QuantileAnswer]:
    """DP quantiles of every (group, quantile aggregate) the tree statement returned rows for."""
    rng = rng or secure_rng()
    return dict(tree_answer(query, plan, r, rng) for r in tree_rows)


def _column(rows: Sequence[Mapping[str, Any]], name: str) -> NDArray[np.float64]:
    return np.array([float(r[name]) if r[name] is not None else 0.0 for r in rows], dtype=np.float64)


@dataclass(frozen=True)
class Selection:
    """Every group's noisy quantities, and the groups partition selection keeps."""

    rows: Sequence[Mapping[str, Any]]
    """The pushdown's rows (one made-up row of zeros for a global aggregate over no rows)."""
    noisy: dict[str, NDArray[np.float64]]
    kept: list[int]
    """Indexes into `rows` of the released groups, in order."""
    matched: frozenset[GroupKey] = frozenset()
    """For a query with quantiles, the kept groups' match keys (`group_key`) but for any two
    groups share (two hashed keys' hashes that collide): those groups get an empty tree's
    answer, never another group's."""


def _matched(rows: Sequence[Mapping[str, Any]], kept: list[int],
             query: AnalyzedQuery) -> frozenset[GroupKey]:
    seen: set[GroupKey] = set()
    shared: set[GroupKey] = set()
    for r in kept:
        key = group_key(rows[r], query)
        (shared if key in seen else seen).add(key)
    return frozenset(seen - shared)


def _per_group(plan: DPQueryPlan) -> list[NoisyQuantity]:
    return [q for q in plan.all_quantities if q.component not in (
        Component.TREE, Component.BOUNDS, Component.ROWS, Component.GROUPS, Component.VALUES)]


def select(query: AnalyzedQuery, plan: DPQueryPlan, rows: Sequence[Mapping[str, Any]],
           rng: np.random.Generator | None = None, deferred: bool = False) -> Selection:
    """Add noise to every group's quantities and keep the groups whose noisy user count
    reaches τ, or, with truncated-geometric selection, each group of n users with
    probability π(n) (every group when there is no threshold). The selection's indexes are
    into its `rows`, which leaves out groups that are no candidates. Run before the quantile
    trees are walked, so that only kept groups' trees are. `deferred`: the row-level
    quantities still wait for T (`plan.rows_pending`): they get their noise from
    `noise_deferred` once it is chosen (each group's noise is its own: the same outcome)."""
    rng = rng or secure_rng()
    if plan.pending and not (deferred and plan.rows_pending):
        raise InternalError("release before APPROX_BOUNDS found the bounds (this is a bug)")
    per_group = [q for q in _per_group(plan) if q.noise is not None or not deferred]
    if not query.keys and not rows:
        rows = [{q.name: 0 for q in _per_group(plan)}]  # an aggregate over no rows
    elif only_counted_groups(query):
        rows = [r for r in rows if r["dp_users"]]
    geometric = plan.threshold if plan.selection is SelectionKind.TRUNCATED_GEOMETRIC else None
    """The user count that decides through π(n): never noised nor released."""
    noisy: dict[str, NDArray[np.float64]] = {
        q.name: q.spec.add(_column(rows, q.name), rng) if rows else np.zeros(0)
        for q in per_group if q is not geometric
    }
    keep = np.ones(len(rows), dtype=bool)
    if geometric is not None:
        keep = rng.random(len(rows)) < keep_probability(
            _column(rows, geometric.name), plan.max_groups_contributed,
            float(geometric.epsilon), float(geometric.delta))
    elif plan.threshold is not None and plan.tau is not None:
        keep = noisy[plan.threshold.name] >= plan.tau
    kept = [int(x) for x in np.flatnonzero(keep)]
    matched = _matched(rows, kept, query) if query.has_quantiles else frozenset()
    return Selection(rows, noisy, kept, matched)


def released_users(plan: DPQueryPlan, selection: Selection) -> NDArray[np.float64] | None:
    """The released groups' noisy user counts, where τ-thresholding kept them (they are
    released by it: post-processing may read them); None otherwise (no selection, public
    groups, or truncated-geometric selection, whose counts are never noised)."""
    t = plan.threshold
    if t is None or plan.tau is None or t.name not in selection.noisy:
        return None
    return selection.noisy[t.name][np.asarray(selection.kept, dtype=np.intp)]


def noise_deferred(selection: Selection, plan: DPQueryPlan,
                   rng: np.random.Generator) -> Selection:
    """`selection` (made with `deferred`) with noise on the quantities it left out, now that
    `plan` has them calibrated (its rows hold their true values)."""
    noisy = dict(selection.noisy)
    for q in _per_group(plan):
        if q.name not in noisy:
            if q.spec is None:
                raise InternalError("a quantity without noise after T was chosen")
            noisy[q.name] = q.spec.add(_column(selection.rows, q.name), rng) \
                if selection.rows else np.zeros(0)
    return Selection(selection.rows, noisy, selection.kept, selection.matched)


def absent_groups(query: AnalyzedQuery, plan: DPQueryPlan, keys: Iterable[tuple[str, ...]],
                  seen: set[tuple[str | None, ...]], binned: Any = None) -> list[dict[str, Any]]:
    """Public groups (`AnalyzedQuery.public_groups`) the pushdown returned no row for: rows
    of zeros, released with noise as any other (`binned`: their empty per-bin sums)."""
    out = []
    for key in keys:
        if key in seen:
            continue
        row: dict[str, Any] = {q.name: 0 for q in _per_group(plan)}
        for i, text in enumerate(key):
            row[f"dp_t{i}"], row[f"dp_k{i}"], row[f"dp_h{i}"] = text, None, None
        if binned is not None:
            row["dp_binned"] = binned
        out.append(row)
    return out


class SelectionStream:
    """Partition selection over the pushdown's rows a batch at a time (`select` on each): only
    the kept groups' rows and noisy quantities stay, so memory grows with the answer, not with
    the groups the pushdown returns. Each group's noise and selection are its own, so the
    outcome has the distribution of one `select` over all the rows."""

    def __init__(self, query: AnalyzedQuery, plan: DPQueryPlan,
                 rng: np.random.Generator | None = None, deferred: bool = False) -> None:
        self.query, self.plan, self.rng = query, plan, rng or secure_rng()
        self.deferred = deferred
        self._rows: list[Mapping[str, Any]] = []
        self._noisy: dict[str, list[NDArray[np.float64]]] = {}
        self._seen = 0

    def add(self, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        self._seen += len(rows)
        chosen = select(self.query, self.plan, rows, self.rng, self.deferred)
        self._rows.extend(chosen.rows[r] for r in chosen.kept)
        for name, values in chosen.noisy.items():
            self._noisy.setdefault(name, []).append(values[chosen.kept])

    def done(self) -> Selection:
        """The selection over every row added (as `select` over them all would make it)."""
        if not self._seen:
            return select(self.query, self.plan, [], self.rng, self.deferred)
        rows = self._rows
        kept = list(range(len(rows)))
        noisy = {name: np.concatenate(parts) for name, parts in self._noisy.items()}
        matched = _matched(rows, kept, self.query) if self.query.has_quantiles else frozenset()
        return Selection(rows, noisy, kept, matched)


def release(query: AnalyzedQuery, plan: DPQueryPlan, rows: Sequence[Mapping[str, Any]],
            rng: np.random.Generator | None = None,
            quantiles: Mapping[tuple[GroupKey, int], QuantileAnswer] | None = None,
            selection: Selection | None = None) -> Released:
    """Add noise to the pushdown's rows and keep what may be released.

    `quantiles` are the groups' DP quantiles from `tree_values`; a group without a
    tree row (no user with a value) gets the answer of an empty tree. `selection`, from
    `select` over the same rows, when the groups were chosen first (to walk only their trees).
    """
    rng = rng or secure_rng()
    chosen = selection if selection is not None else select(query, plan, rows, rng)
    rows, noisy, kept = chosen.rows, chosen.noisy, chosen.kept
    values: list[list[Any]] = []
    found, wanted = quantiles or {}, chosen.matched
    ends: dict[int, dict[int, tuple[float, float]]] = {}
    """Of each quantile with an interval column, by released row: its interval's ends."""
    for i, agg in enumerate(query.aggregates):
        if agg.kind is AggKind.QUANTILE:
            column: list[Any] = [None] * len(rows)
            for r in kept:
                key = group_key(rows[r], query)
                value = found.get((key, i)) if key in wanted else None
                if value is None:
                    value = quantile_value(query, plan, i, [], [], rng)
                if isinstance(value, tuple):
                    column[r] = value[0]
                    ends.setdefault(i, {})[r] = (value[1], value[2])
                else:
                    column[r] = value
            values.append(column)
            continue
        values.append(list(_aggregate_values(i, agg, plan, noisy, len(rows))))
    spread = {i: noise_half_widths(i, agg, plan, noisy, kept)
              for i, agg in enumerate(query.aggregates)
              if agg.kind in _DERIVED and not reads_user_count(agg) and kept}
    intervals = _intervals(query, plan, noisy, values, kept, ends)
    out = []
    for pos, r in enumerate(kept):
        row: list[str | int | float | None] = []
        for col in query.outputs:
            if col.key is not None:
                row.append(rows[r][f"dp_t{col.key}"])
            elif col.bound is not None:
                assert col.aggregate is not None
                row.append(intervals[(col.aggregate, col.bound)][pos])
            else:
                assert col.aggregate is not None
                row.append(values[col.aggregate][r])
        out.append(tuple(row))
    # The pushdown's row order is its hash table's, which follows the order rows reached it
    # (one user's rows can swap two keys of one bucket): the rows are released in their
    # keys' order (texts by code point, NULL last), shuffled first so that even keys of one
    # text would leave no trace of it. What LIMIT without ORDER BY keeps follows from this.
    # (Public groups come in their configured keys' order already, whatever the data.)
    keys = len(query.keys)
    order = list(range(len(kept))) if query.public_groups else sorted(
        rng.permutation(len(kept)).tolist(), key=lambda pos: row_order(rows[kept[pos]], keys))
    return Released(tuple(out[pos] for pos in order), len(rows), spread)


def _aggregate_values(i: int, agg: Aggregate, plan: DPQueryPlan,
                      noisy: Mapping[str, NDArray[np.float64]], n: int) -> list[int | float]:
    if reads_user_count(agg):
        return [max(0, round(v)) for v in noisy["dp_users"]]
    if agg.kind in _COUNT_COMPONENTS:
        return [max(0, round(v)) for v in noisy[plan.name_of(i, _COUNT_COMPONENTS[agg.kind])]]
    if agg.kind is AggKind.SUM:
        return [float(v) for v in noisy[plan.name_of(i, Component.SUM)]]
    return [float(v) for v in _derived(agg, *_components(i, agg, plan, noisy))]


_COUNT_COMPONENTS = {AggKind.COUNT: Component.COUNT, AggKind.COUNT_DISTINCT: Component.DISTINCT}
"""The one noisy quantity of each bounded count, released rounded and never below 0."""
_DERIVED = (AggKind.AVG, AggKind.VAR, AggKind.STDDEV)
_SIMULATED = 4000


def _component_names(agg: Aggregate) -> list[str]:
    """The components an AVG, VAR or STDDEV is derived from."""
    names = [Component.N, Component.CENTERED_SUM]
    if agg.kind is not AggKind.AVG:
        names.append(Component.CENTERED_SQUARES)
    return names


def _components(i: int, agg: Aggregate, plan: DPQueryPlan,
                noisy: Mapping[str, NDArray[np.float64]]) -> list[NDArray[np.float64]]:
    return [noisy[plan.name_of(i, name)] for name in _component_names(agg)]


def _derived(agg: Aggregate, n: NDArray[np.float64], csum: NDArray[np.float64],
             csquares: NDArray[np.float64] | None = None) -> NDArray[np.float64]:
    """AVG, VAR or STDDEV from the noisy count and centred sums (elementwise)."""
    lo, hi = agg.known_bounds.lower, agg.known_bounds.upper
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    count = np.maximum(n, 1.0)
    mean_c = csum / count
    if agg.kind is AggKind.AVG:
        return np.asarray(np.clip(mid + mean_c, lo, hi), dtype=np.float64)
    assert csquares is not None
    var = np.clip(csquares / count - mean_c**2, 0.0, half * half)
    return np.asarray(var if agg.kind is AggKind.VAR else np.sqrt(var), dtype=np.float64)


def noise_half_widths(i: int, agg: Aggregate, plan: DPQueryPlan,
                      noisy: Mapping[str, NDArray[np.float64]], kept: Sequence[int],
                      rng: np.random.Generator | None = None) -> tuple[float, float]:
    """The 95% noise half-width of an AVG, VAR or STDDEV at the released groups with the
    smallest and the largest noisy count, as (smallest width, largest width)
    (`derived_half_widths`: there is no one width per column)."""
    n = noisy[plan.name_of(i, Component.N)][list(kept)]
    ends = sorted({list(kept)[int(np.argmin(n))], list(kept)[int(np.argmax(n))]})
    widths = derived_half_widths(i, agg, plan, noisy, ends, rng, _SIMULATED)
    return float(widths.min()), float(widths.max())


def derived_half_widths(i: int, agg: Aggregate, plan: DPQueryPlan,
                        noisy: Mapping[str, NDArray[np.float64]], rows: Sequence[int],
                        rng: np.random.Generator | None = None,
                        draws: int = 1000) -> NDArray[np.float64]:
    """The 95% noise half-width of an AVG, VAR or STDDEV at each of the released `rows`.

    Such a value is a ratio of noisy quantities, so how far its noise moves it depends on
    the group's count. Each width is simulated: the group's noisy components, moved into
    the values true ones can have (a count ≥ 1, a centred sum within ±half the range per
    value, a sum of squares between the sum's square over the count and half the range
    squared per value), are taken for the true ones, the plan's noise is drawn `draws` times
    for them again, and the 95th percentile of how far the value moves is the width. This
    uses only noisy quantities of released groups and the public noise distributions, so it
    is post-processing and costs nothing (the draws need not be secure)."""
    rng = rng or np.random.default_rng()
    half = (agg.known_bounds.upper - agg.known_bounds.lower) / 2
    comps = [c[list(rows)] for c in _components(i, agg, plan, noisy)]
    comps[0] = np.maximum(comps[0], 1.0)
    comps[1] = np.clip(comps[1], -half * comps[0], half * comps[0])
    if len(comps) > 2:
        comps[2] = np.clip(comps[2], comps[1] ** 2 / comps[0], half * half * comps[0])
    names = _component_names(agg)
    specs = {name: plan.quantity_of(i, name).spec for name in names}
    out = np.empty(len(rows), dtype=np.float64)
    step = max(1, 200_000 // draws)  # (rows at a time: a few MB of draws)
    for start in range(0, len(rows), step):
        part = slice(start, start + step)
        at = [c[part, None] for c in comps]
        drawn = [specs[name].add(np.repeat(c[part, None], draws, axis=1), rng)
                 for name, c in zip(names, comps, strict=True)]
        moved = np.abs(_derived(agg, *drawn) - _derived(agg, *at))
        out[part] = np.quantile(moved, 0.95, axis=1)
    return out


def half_width_95(query: AnalyzedQuery, plan: DPQueryPlan, i: int) -> float | None:
    """The 95% noise half-width of aggregate i where it is one per column (a count or sum:
    the noise of its one noisy quantity, or of the user count it reads); None for an AVG,
    VAR or STDDEV (per group: `derived_half_widths`) and a quantile (its noise is on ranks:
    `quantiles.walk_interval`)."""
    agg = query.aggregates[i]
    if agg.kind is AggKind.QUANTILE or (agg.kind in _DERIVED and not reads_user_count(agg)):
        return None
    qs = [] if reads_user_count(agg) else [plan.quantity_of(
        i, Component.SUM if agg.kind is AggKind.SUM else _COUNT_COMPONENTS[agg.kind])]
    if not qs and plan.threshold is not None:
        qs = [plan.threshold]
    elif not qs:
        qs = [q for q in plan.quantities if q.name == "dp_users"]
    return qs[-1].spec.half_width_95 if qs else None


def _intervals(query: AnalyzedQuery, plan: DPQueryPlan, noisy: Mapping[str, NDArray[np.float64]],
               values: list[list[Any]], kept: Sequence[int],
               ends: Mapping[int, Mapping[int, tuple[float, float]]]
               ) -> dict[tuple[int, str], list[Any]]:
    """For each interval column (`OutputColumn.bound`), by (aggregate, "low" or "high"): its
    value at each released row, the released value ∓ its 95% noise half-width, kept within
    what the value can be (a count ≥ 0; an AVG within its bounds, a VAR or STDDEV within 0
    and the bounds' half range, squared for VAR); None for a NULL value. A quantile's are its
    `ends` (the values its noisy tree gives at the ranks its rank error away)."""
    out: dict[tuple[int, str], list[Any]] = {}
    for i in sorted({c.aggregate for c in query.outputs
                     if c.bound is not None and c.aggregate is not None}):
        agg = query.aggregates[i]
        fixed = half_width_95(query, plan, i)
        if agg.kind is AggKind.QUANTILE:
            out[(i, "low")] = [ends[i][r][0] if r in ends.get(i, {}) else None for r in kept]
            out[(i, "high")] = [ends[i][r][1] if r in ends.get(i, {}) else None for r in kept]
            continue
        widths: list[float | None]
        if fixed is None:
            # (fewer draws for many groups: 2M at most, at least 200 a group)
            draws = min(1000, max(200, 2_000_000 // max(1, len(kept))))
            widths = [float(w) for w in derived_half_widths(i, agg, plan, noisy, kept,
                                                             draws=draws)]
        else:
            widths = [fixed] * len(kept)
        lo, hi = -math.inf, math.inf
        if agg.kind in _COUNT_COMPONENTS or reads_user_count(agg):
            lo = 0.0
        elif agg.kind in _DERIVED:
            b = agg.known_bounds
            half = (b.upper - b.lower) / 2
            lo, hi = {AggKind.AVG: (b.lower, b.upper), AggKind.VAR: (0.0, half * half),
                      AggKind.STDDEV: (0.0, half)}[agg.kind]
        for side, sign in (("low", -1.0), ("high", 1.0)):
            column = []
            for pos, r in enumerate(kept):
                v, w = values[i][r], widths[pos]
                column.append(None if v is None or w is None else
                              float(min(hi, max(lo, float(v) + sign * w))))
            out[(i, side)] = column
    return out
