"""Choosing max_rows_contributed (T) from DP statistics of the data: the least expected error.

Row-level aggregates (`Aggregate.row_level`) weight each user's rows by
min(1, T / its rows in all groups): a user with more than T rows is counted as T
rows spread over its groups in proportion, so its whole contribution is bounded by T
rows (the noise's L1 sensitivity) and the rows beyond T are the bias. Where neither
the query nor the session fixes T, it is chosen per query, with DP, to minimise the
expected total absolute error of a count over the groups released:

    lost(T) + G · E|noise of sensitivity T|

where lost(T) = Σ_users max(0, rows − T) is estimated from a noisy histogram of the
users' row counts (each user in one bin: sensitivity 1; a power-law tail extended above
the bins the noise lets through, `fitted_tail`) and G, the groups released,
from a noisy count of the groups that at least τ users have as their first group (the
group of their most rows: each user has one, so sensitivity 1). Both spend
`plan.TUNING_SHARE` of the query's ε, and the choice, a function of them alone, is
post-processing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import numpy as np

from dp_core.errors import InternalError
from dp_core.mechanism_choices import NoiseKind, SelectionKind
from dp_core.mechanisms import NoiseSpec, users_kept_with
from dp_core.partials import MEANS
from dp_core.plan import VALUE_STEPS, Component, DPQueryPlan, replan_with_bounds, sharing_clip
from dp_core.quantiles import bounds_threshold
from dp_core.query import AggKind, AnalyzedQuery, Bounds


def _edges() -> tuple[int, ...]:
    out, e = [1, 2, 3], 4
    while e <= 1 << 20:
        out += [e, e * 3 // 2]
        e *= 2
    return tuple(x for x in out if x <= 1 << 20)


ROW_EDGES = _edges()
"""Bin edges of the users' row counts: 1, 2, 3, 4, 6, 8, 12, ... 2^20 (each bin [e_i, e_i+1);
the last is every count from 2^20). T is chosen among them."""
EMPTY_BINS_CLEAR = 0.95
"""The probability that no empty bin's noisy count passes the threshold bins must pass."""
BINS_ABOVE_SEEN = 6
"""The bins above the highest seen whose noisy counts are kept (a factor of about 8 in rows)."""
TAIL_FIT_BINS = 3
"""The highest seen bins a power law is fitted to, for the tail above them (and as many
below them, to check that it is one)."""
TAIL_CURVE = 0.5
"""How much the law's slope may differ between the highest seen bins and those below them
for the counts to be taken as a power law's."""
TAIL_REACH = 8
"""The bins above the highest seen that the fitted tail reaches (a factor of about 16 in
rows): heavy tails hold many rows in users too few per bin for the noisy counts to show;
further, the T it would bring costs filtered and grouped counts more noise than it saves."""
ROWS_KIND, GROUPS_KIND, VALUES_KIND = 0, 1, 2
"""dp_kind of the tuning statement's rows: a histogram bin, or the groups count."""


@dataclass(frozen=True)
class TunedRows:
    """max_rows_contributed as chosen, with DP estimates of what it cuts (for the notice)."""

    max_rows: int
    mean_rows: int
    """T of the means (AVG, VAR, STDDEV): at most the users' median row count, by the noisy
    histogram: their noise is over a weighted count, which grows more slowly than T."""
    rows_cut: float
    """The share of the rows beyond T (weighted away), estimated from the noisy histogram."""
    users_cut: float
    """The share of the users with more than T rows."""
    rows_total: float = 0.0
    """The rows, estimated from the noisy histogram."""
    groups: float = 1.0
    """The groups the noise is weighed over: those to be released, estimated (1 without GROUP
    BY), or after partition selection `typical_groups` of those released."""
    clips: Mapping[int, Bounds] = field(default_factory=dict)
    """The bounds each clipped row-level aggregate gets (`plan.clip_tuned`, and those that
    share their argument and bounds), within its configured ones."""
    clipped: Mapping[int, float] = field(default_factory=dict)
    """For each of them, the share of its rows' value beyond the clip (an estimate)."""
    sum_rows: int = 0
    """T of the row-level SUMs (0: `max_rows`), at most T: their noise per unit of T is the
    clip, their bias per row beyond T the rows' mean value (`choose_sum_rows`)."""
    lost: tuple[float, ...] = ()
    """The rows beyond each candidate T (ROW_EDGES), as estimated from the noisy histogram."""
    means: Mapping[int, float] = field(default_factory=dict)
    """For each clipped aggregate, a row's mean value (an estimate, from its value bins)."""
    value_bins: Mapping[int, tuple[float, ...]] = field(default_factory=dict)
    """For each aggregate whose clip was chosen, its value bins with their noise."""
    mean_cap: int = 0
    """The upper edge of the median user's bin: T of the means is at most this."""
    users_over: tuple[float, ...] = ()
    """The share of the users beyond each candidate T, as estimated from the noisy histogram."""
    weights: Mapping[str, Fraction] = field(default_factory=dict)
    """How the answer's row-level counts, sums and means split their ε among them
    (`share_weights`; empty: equally)."""


def groups_threshold(plan: DPQueryPlan) -> float:
    """The user count from which a group is counted as released in the tuning statement:
    τ, or for truncated-geometric selection the count kept with probability 1/2."""
    if plan.tau is not None:
        return plan.tau
    t = plan.threshold
    if t is None or plan.selection is not SelectionKind.TRUNCATED_GEOMETRIC:
        return 1.0
    return float(users_kept_with(0.5, plan.max_groups_contributed, float(t.epsilon),
                                 float(t.delta)))


def _representative(b: int) -> float:
    """A typical row count of bin b (width_bucket's numbering: bin b holds [e_b-1, e_b))."""
    if b <= 0:
        raise InternalError()
    if b >= len(ROW_EDGES):
        return ROW_EDGES[-1] * 1.5
    lo, hi = ROW_EDGES[b - 1], ROW_EDGES[b]
    return (lo + hi - 1) / 2


_REPS = np.array([_representative(b) for b in range(1, len(ROW_EDGES) + 1)])
_CANDIDATES = np.array(ROW_EDGES, dtype=np.float64)
_BEYOND = np.maximum(_REPS[None, :] - _CANDIDATES[:, None], 0.0)
"""_BEYOND[j, b]: the rows beyond candidate T = ROW_EDGES[j] of a user in bin b + 1."""
_WIDTHS = np.array([ROW_EDGES[b] - ROW_EDGES[b - 1] for b in range(1, len(ROW_EDGES))]
                   + [ROW_EDGES[-1]], dtype=np.float64)
"""The row counts each bin holds (the last, open one: as many as its lower edge)."""


def _slope(noisy: np.ndarray, fit: np.ndarray) -> float:
    """The log-log slope of users per row count over bins `fit` (weighted least squares)."""
    x, y = np.log(_REPS[fit]), np.log(noisy[fit] / _WIDTHS[fit])
    return float(np.polyfit(x, y, 1, w=np.sqrt(noisy[fit]))[0])


def fitted_tail(noisy: np.ndarray, top: int) -> np.ndarray:
    """Users per bin above bin index `top` (the highest seen): where the seen counts fall as
    a power law does (users per row count ∝ rows^s, s < −1, the same s over the
    `TAIL_FIT_BINS` highest seen bins and the as many below them, within TAIL_CURVE), that
    law through the highest seen bin, up to `TAIL_REACH` bins above; zeros otherwise (a tail
    that steepens as it goes, as an exponential's or a log-normal's, ends soon).
    Post-processing of the noisy counts."""
    out = np.zeros_like(noisy)
    k = TAIL_FIT_BINS
    if top + 1 < 2 * k or not (noisy[top + 1 - 2 * k: top + 1] > 0).all():
        return out
    upper = _slope(noisy, np.arange(top + 1 - k, top + 1))
    lower = _slope(noisy, np.arange(top + 1 - 2 * k, top + 1 - k))
    if not (upper < -1 and abs(upper - lower) <= TAIL_CURVE):
        return out
    tail = slice(top + 1, min(top + 1 + TAIL_REACH, len(noisy)))
    out[tail] = noisy[top] / _WIDTHS[top] * (_REPS[tail] / _REPS[top]) ** upper * _WIDTHS[tail]
    return out


def unit_noise(kind: NoiseKind, epsilon: float, delta: float) -> float:
    """The mean absolute noise of a quantity of sensitivity 1 with this share of ε/δ (its
    noise grows in proportion to the sensitivity, so T times this for T)."""
    spec = NoiseSpec.calibrate(kind, epsilon, delta, 1, 1.0)
    return spec.scale if kind is NoiseKind.LAPLACE else spec.scale * math.sqrt(2 / math.pi)


def choose_max_rows(histogram: Mapping[int, int], groups: int | None, rows_noise: NoiseSpec,
                    groups_noise: NoiseSpec | None, unit: float,
                    rng: np.random.Generator, groups_known: bool = False,
                    weighed: float | None = None) -> TunedRows:
    """T from the true statistics (of the main statement's rows, or the tuning statement's):
    users per bin (`histogram`, bins 1..len(ROW_EDGES)) and, with GROUP BY, the groups at
    least τ users count in (or, with `groups_known`, the public groups released: used as they
    are). Every bin gets noise (empty ones too), then T is the edge of least estimated error,
    `unit` being the mean absolute noise per unit of T of the answer's counts
    (`unit_noise`). `weighed`: the groups to weigh the noise over, given (`typical_groups`:
    `groups` is then not used)."""
    bins = len(ROW_EDGES)
    true = np.zeros(bins + 1)
    for b, n in histogram.items():
        if not 1 <= b <= bins:
            raise InternalError()
        true[b] = n
    raw = rows_noise.add(true[1:], rng)
    # The seen bins: from the lowest whose noisy count passes a threshold an empty bin's
    # would hardly reach, up, each with a passing one at most two bins below it (one far
    # above the rest is an empty bin's noise). Their noisy counts are taken clipped at 0;
    # those of the BINS_ABOVE_SEEN bins above less the noise's scale, clipped at 0 (a heavy
    # tail's users are few per bin but many together, and the rows of these bins are many:
    # an empty bin's noise alone would move T far up); higher bins count as empty (the few
    # users there DP cannot count in full anyway). Where the highest seen bins fall as a
    # power law does, the tail above has at least the users that law gives (`fitted_tail`):
    # its users are too few per bin to show through the noise, but their rows are many.
    top = -1
    for b in map(int, np.flatnonzero(raw > bounds_threshold(rows_noise.scale, bins + 1,
                                                            EMPTY_BINS_CLEAR))):
        if top >= 0 and b - top > 3:
            break
        top = b
    noisy = np.zeros(bins)
    noisy[:top + 1] = np.maximum(raw[:top + 1], 0.0)
    above = slice(top + 1, top + 1 + BINS_ABOVE_SEEN)
    noisy[above] = np.maximum(raw[above] - rows_noise.scale, 0.0)
    if top >= 0:
        noisy = np.maximum(noisy, fitted_tail(noisy, top))
    g = 1.0
    if weighed is not None:
        g = max(1.0, weighed)
    elif groups_known:
        g = max(1.0, float(groups or 0))
    elif groups_noise is not None:
        g = max(1.0, float(groups_noise.add(np.array([float(groups or 0)]), rng)[0]))
    lost = np.maximum(_BEYOND @ noisy, 0.0)  # rows beyond each candidate T
    best = int(np.argmin(lost + g * unit * _CANDIDATES))
    t = ROW_EDGES[best]
    total_rows = max(float(noisy @ _REPS), 1.0)
    total_users = max(float(np.sum(np.maximum(noisy, 0.0))), 1.0)
    over = max(float(np.sum(noisy[t < _REPS])), 0.0)
    # the median user's bin (noisy counts: post-processing), its upper edge
    median = int(np.searchsorted(np.cumsum(np.maximum(noisy, 0.0)), total_users / 2))
    mean_cap = ROW_EDGES[min(median + 1, len(ROW_EDGES) - 1)]
    mean_t = min(t, mean_cap)
    users_over = [float(np.sum(noisy[c < _REPS])) / total_users for c in ROW_EDGES]
    return TunedRows(t, mean_t, min(float(lost[best]) / total_rows, 1.0),
                     min(over / total_users, 1.0), total_rows, g, lost=tuple(map(float, lost)),
                     mean_cap=mean_cap, users_over=tuple(min(max(u, 0.0), 1.0)
                                                         for u in users_over))


def rechosen(tuned: TunedRows, groups: float, unit: float) -> TunedRows:
    """T (and T of the means) chosen again from the statistics `tuned` was (post-processing):
    for noise weighed over `groups` groups, `unit` the mean absolute noise per unit of T of
    the answer's counts; as `choose_max_rows` chooses."""
    if not tuned.lost:
        raise InternalError("T chosen again without the statistics it was chosen from")
    lost = np.array(tuned.lost)
    best = int(np.argmin(lost + max(1.0, groups) * unit * _CANDIDATES))
    t = ROW_EDGES[best]
    return replace(tuned, max_rows=t, mean_rows=min(t, tuned.mean_cap or t),
                   rows_cut=min(float(lost[best]) / max(tuned.rows_total, 1.0), 1.0),
                   users_cut=tuned.users_over[best] if tuned.users_over else tuned.users_cut,
                   groups=max(1.0, groups))


def value_thresholds(bounds: Bounds) -> list[float]:
    """Where a configured range [L, U] may be clipped for one query, high to low:
    L + (U − L)·2^−j for j = 1 … VALUE_STEPS − 1 (U itself is the first choice), each
    above L and below the one before (a range so narrow that a step rounds to its
    neighbour has fewer: a clip at L would leave a mean's range, and its noise, at 0)."""
    out: list[float] = []
    for j in range(1, VALUE_STEPS):
        t = bounds.lower + (bounds.upper - bounds.lower) * 2.0 ** -j
        if bounds.lower < t < (out[-1] if out else bounds.upper):
            out.append(t)
    return out


def choose_clip(bins: Sequence[float], bounds: Bounds, rows: float, weight: float,
                noise: NoiseSpec, rng: np.random.Generator) -> tuple[float, float, float]:
    """(upper clip, share of the value beyond it, mean value of a row) of a row-level
    aggregate whose rows fall in value bins `bins` by their user's mean in the group (the
    clip bounds that mean: `Aggregate.row_bounds`; true, each user's rows weighted by 1 /
    its rows: bin 0 holds [t1, U], bin j [t(j+1), t(j)), the last [L, t(last)), t from
    `value_thresholds`): the candidate of least estimated error, `rows` times the mean value
    beyond it plus `weight` times its range (the noise a range brings, per unit: groups × T
    × a count's mean noise, halved for a mean's centred sums). The bins get their noise once,
    here; the rest is post-processing."""
    return clip_from(noisy_bins(bins, noise, rng), bounds, rows, weight)


def noisy_bins(bins: Sequence[float], noise: NoiseSpec, rng: np.random.Generator) -> np.ndarray:
    """Value bins with their noise, clipped at 0 (what `clip_from` chooses from)."""
    return np.maximum(noise.add(np.asarray(bins, dtype=np.float64), rng), 0.0)


def clip_from(noisy: Sequence[float] | np.ndarray, bounds: Bounds, rows: float,
              weight: float) -> tuple[float, float, float]:
    """`choose_clip`'s choice from value bins already noisy (post-processing)."""
    t = value_thresholds(bounds)
    if len(noisy) != len(t) + 1:
        raise InternalError()
    noisy = np.asarray(noisy, dtype=np.float64)
    edges = [bounds.upper, *t, bounds.lower]
    reps = np.array([(edges[k] + edges[k + 1]) / 2 for k in range(len(noisy))])
    mass = max(float(noisy.sum()), 1e-12)
    candidates = np.array([bounds.upper, *t])
    beyond = np.maximum(reps[None, :] - candidates[:, None], 0.0) @ noisy / mass
    best = int(np.argmin(rows * beyond + weight * (candidates - bounds.lower)))
    total = max(float(noisy @ reps) / mass, 1e-300)
    mean = float(noisy @ reps) / mass if float(noisy.sum()) > 0 else bounds.lower
    return float(candidates[best]), min(float(beyond[best]) / total, 1.0), mean


def choose_sum_rows(tuned: TunedRows, sums: Sequence[tuple[float, float]], unit: float) -> int:
    """T of the row-level SUMs, at most `tuned.max_rows`: the edge of least estimated error
    summed over them, each (mean value of a row, largest |value| within its clip) in `sums`:
    mean × rows beyond T + groups × T × |value| × `unit` (a sum's noise for T). Post-processing
    of the statistics `tuned` was chosen from."""
    if not sums or not tuned.lost:
        return tuned.max_rows
    lost = np.array(tuned.lost)
    error = sum(max(mean, 0.0) * lost + tuned.groups * unit * _CANDIDATES * size
                for mean, size in sums)
    allowed = tuned.max_rows >= _CANDIDATES
    return int(_CANDIDATES[int(np.argmin(np.where(allowed, error, np.inf)))])


def tune_rows(plan: DPQueryPlan, rows: Iterable[Mapping[str, Any]],
              rng: np.random.Generator, query: AnalyzedQuery | None = None,
              known_groups: int | None = None) -> TunedRows:
    """T for `plan` from the rows of its tuning statement (`rewrite._tuning_template`), and
    the clips of `query`'s row-level aggregates it has value bins for."""
    histogram: dict[int, int] = {}
    values: dict[int, dict[int, float]] = {}
    groups = 0
    for r in rows:
        if int(r["dp_kind"]) == GROUPS_KIND:
            groups = int(r["dp_n"])
        elif int(r["dp_kind"]) == VALUES_KIND:
            # (NULL: no rows at all, whose sums are NULL)
            values.setdefault(int(r["dp_agg"]), {})[int(r["dp_bin"])] = float(r["dp_n"] or 0)
        else:
            histogram[int(r["dp_bin"])] = int(r["dp_n"])
    if known_groups is not None:  # public groups: released whatever the statistics say
        return tune(plan, histogram, known_groups, values, rng, query, groups_known=True)
    return tune(plan, histogram, groups, values, rng, query)


def typical_groups(released_users: Sequence[float]) -> float:
    """The groups the noise of T is weighed over, from the released groups' noisy user counts
    (post-processing): their users over the median group's, the rows over the median
    group's rows (each group's rows taken in proportion to its users). T is then chosen for
    the median released group's relative error, bias plus noise, where the groups' number
    would choose it for their total absolute error: a count of the largest groups' rows (the
    bias is in them) at the cost of noise the smaller groups cannot bear."""
    users = np.maximum(np.asarray(released_users, dtype=np.float64), 1.0)
    if not len(users):
        return 1.0
    return max(1.0, float(users.sum() / np.median(users)))


def tune(plan: DPQueryPlan, histogram: Mapping[int, int], groups: int,
         values: Mapping[int, Mapping[int, float]], rng: np.random.Generator,
         query: AnalyzedQuery | None = None, groups_known: bool = False,
         released_users: Sequence[float] | None = None) -> TunedRows:
    """T and the clips from the true statistics: users per bin of their row count
    (`histogram`), the groups at least τ users have first (`groups`; `groups_known`: the
    groups released, public and exact, which get no noise) and, per clipped aggregate, its
    rows per value bin, each user's weighted by 1 / its rows (`values`). `released_users`:
    where partition selection has run (τ-thresholding), the kept groups' noisy user counts,
    which weigh the noise instead of `groups` (`typical_groups`)."""
    specs = {q.component: q.spec for q in plan.tuning}
    if Component.ROWS not in specs:
        raise InternalError("max_rows_contributed chosen for a plan without its statistics")
    unit = answer_unit(plan)
    if plan.tau is not None and not groups_known and released_users is None \
            and Component.GROUPS not in specs:
        raise InternalError("T of a one-pass plan chosen before partition selection")
    if released_users is not None and not groups_known:
        tuned = choose_max_rows(histogram, None, specs[Component.ROWS], None, unit, rng,
                                groups_known=True, weighed=typical_groups(released_users))
    else:
        tuned = choose_max_rows(histogram, groups, specs[Component.ROWS],
                                specs.get(Component.GROUPS), unit, rng, groups_known)
    clips: dict[int, Bounds] = {}
    clipped: dict[int, float] = {}
    means: dict[int, float] = {}
    value_bins: dict[int, tuple[float, ...]] = {}
    for q in plan.tuning:
        if q.aggregate is None:
            continue
        if query is None:
            raise InternalError("value bins without the query they clip")
        agg = query.aggregates[q.aggregate]
        b = agg.known_bounds
        steps = len(value_thresholds(b)) + 1
        bins = [values.get(q.aggregate, {}).get(k, 0.0) for k in range(steps)]
        noisy = noisy_bins(bins, q.spec, rng)
        value_bins[q.aggregate] = tuple(map(float, noisy))
        upper, share, mean = clip_from(noisy, b, tuned.rows_total,
                                       clip_weight(tuned, agg.kind, unit))
        for j in sharing_clip(query, q.aggregate):
            clips[j], clipped[j], means[j] = Bounds(b.lower, upper), share, mean
    tuned = replace(tuned, clips=clips, clipped=clipped, means=means, value_bins=value_bins)
    return tuned if query is None else finished(query, plan, tuned, unit)


def clip_weight(tuned: TunedRows, kind: AggKind, unit: float) -> float:
    """What a unit of a clip's range costs in noise (`clip_from`'s `weight`): groups × T ×
    a count's mean noise, halved for a mean's centred sums (T of the means for them)."""
    t = tuned.mean_rows if kind in MEANS else tuned.max_rows
    return tuned.groups * unit * t * (0.5 if kind in MEANS else 1.0)


def answer_unit(plan: DPQueryPlan) -> float:
    """The mean absolute noise per unit of T of the answer's row-level counts (`unit_noise`
    of the first count, sum or average's count among its quantities)."""
    counted = next((q for q in plan.quantities if q.aggregate is not None
                    and q.component in (Component.COUNT, Component.N, Component.SUM)), None)
    if counted is None:
        raise InternalError("max_rows_contributed chosen for a plan without row-level counts")
    return unit_noise(plan.noise_kind, float(counted.epsilon), float(counted.delta))


def finished(query: AnalyzedQuery, plan: DPQueryPlan, tuned: TunedRows,
             unit: float) -> TunedRows:
    """`tuned` (T and the clips chosen, the rows' mean values estimated) with T of the sums
    (`choose_sum_rows`, where every row-level SUM has a clip) and the weights of the answer's
    shares (`share_weights`): post-processing of the same statistics."""
    sums = [j for j, a in enumerate(query.aggregates) if a.row_level and a.kind is AggKind.SUM]
    sum_rows = tuned.max_rows
    if sums and all(j in tuned.clips and j in tuned.means for j in sums):
        sum_rows = choose_sum_rows(tuned, [(tuned.means[j], max(abs(tuned.clips[j].lower),
                                                                abs(tuned.clips[j].upper)))
                                           for j in sums], unit)
    tuned = replace(tuned, sum_rows=sum_rows)
    return replace(tuned, weights=share_weights(query, plan, tuned, tuned.means))


SHARE_FLOOR = Fraction(3, 4)
"""The least part of its equal share of ε a rebalanced quantity keeps (`share_weights`)."""


def share_weights(query: AnalyzedQuery, plan: DPQueryPlan, tuned: TunedRows,
                  means: Mapping[int, float]) -> dict[str, Fraction]:
    """How the noisy quantities of the answer's row-level COUNTs, SUMs and AVGs split their
    ε between them, once T and the clips are chosen: in proportion to √a, a being the
    quantity's noise per unit of ε relative to its aggregate's value, which minimises the sum
    over them of a / ε (the groups' rows n, common to all, left out; √a rounded to a quarter
    octave): a count's T; a sum's T × its largest |value| / a row's mean value m (its noise
    per user over the value of its rows); an average's centred sum, T × half its range / m,
    and its count, T × |m − the range's midpoint| / m (how much its noise moves the mean). Each keeps at least
    SHARE_FLOOR of its equal share. Post-processing of the statistics T and the clips were
    chosen from (`means`: the row's mean value by aggregate, from its value bins); empty
    (equal shares) where an aggregate has no such estimate, or the query has VAR or STDDEV."""
    need: dict[str, float] = {}
    for i, agg in enumerate(query.aggregates):
        if not agg.row_level:
            continue
        if agg.kind in (AggKind.VAR, AggKind.STDDEV):
            return {}
        t = tuned.mean_rows if agg.kind in MEANS else \
            (tuned.sum_rows or tuned.max_rows) if agg.kind is AggKind.SUM else tuned.max_rows
        if agg.kind is AggKind.COUNT:
            parts = {Component.COUNT: float(t)}
        else:
            m = means.get(i)
            b = tuned.clips.get(i)
            if m is None or b is None or not m > 0:
                return {}
            if agg.kind is AggKind.SUM:
                parts = {Component.SUM: t * max(abs(b.lower), abs(b.upper)) / m}
            else:
                mid = (b.lower + b.upper) / 2
                parts = {Component.CENTERED_SUM: t * (b.upper - b.lower) / 2 / m,
                         Component.N: t * abs(m - mid) / m}
        for component, a in parts.items():
            name = plan.name_of(i, component)
            need[name] = max(need.get(name, 0.0), a)
    if len(need) < 2:
        return {}
    # √a on a grid of quarter octaves: the split moves by steps (a few splits, whichever the
    # noisy statistics; equal weights stay equal)
    raw = {n: Fraction(2.0 ** (round(4 * math.log2(math.sqrt(max(a, 1e-12)))) / 4))
           .limit_denominator(1 << 16) for n, a in need.items()}
    # the floor f = SHARE_FLOOR × the mean weight, those below it raised to it: with k
    # weights, `low` of them raised, f = c × (the others' sum + low × f) / k
    k, low = len(raw), frozenset[str]()
    while True:
        above = sum((w for n, w in raw.items() if n not in low), Fraction(0))
        floor = SHARE_FLOOR * above / (k - SHARE_FLOOR * len(low))
        now = frozenset(n for n, w in raw.items() if w < floor)
        if now <= low:
            return {n: max(w, floor) if n in low else w for n, w in raw.items()}
        low |= now


def replan_tuned(query: AnalyzedQuery, plan: DPQueryPlan, tuned: TunedRows,
                 found: Mapping[int, Bounds] | None = None) -> tuple[AnalyzedQuery, DPQueryPlan]:
    """The query and plan for what `tuned` chose (T of counts, means and sums, and the
    clips), with the bounds APPROX_BOUNDS `found`."""
    return replan_with_bounds(query, plan, {**(found or {}), **tuned.clips}, tuned.max_rows,
                              tuned.mean_rows, tuned.sum_rows or tuned.max_rows,
                              tuned.weights)
