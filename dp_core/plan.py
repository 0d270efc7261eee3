"""The DP query plan: which noisy quantities a query releases, their share of ε/δ, noise and τ.

The plan is frozen and its `cost` is exactly what the ledger debits: the sum of
the quantities' shares (exact fractions) is asserted equal to it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from fractions import Fraction

from dp_core.errors import InternalError, InvalidParameterValue
from dp_core.mechanism_choices import SelectionKind
from dp_core.mechanisms import (
    MIN_SCALE,
    NoiseKind,
    NoiseSpec,
    selection_parameters,
    threshold_tau,
)
from dp_core.partials import MEANS
from dp_core.quantiles import DEPTH
from dp_core.query import CLIPPED_KINDS, AggKind, Aggregate, AnalyzedQuery, Bounds
from dp_core.settings import MAX_ROWS


class Component:
    """What a noisy quantity measures, per group."""

    USERS = "users"  # users in the group (τ-thresholding, COUNT(DISTINCT uid), COUNT(*))
    COUNT = "count"  # sum over users of min(rows, U)
    DISTINCT = "distinct"  # distinct values among the users' (at most k each)
    SUM = "sum"  # sum over users of the clamped per-user value
    N = "n"  # users with a value (AVG/VAR denominators)
    CENTERED_SUM = "csum"  # sum of (clamped value − midpoint)
    CENTERED_SQUARES = "csq"  # sum of (clamped value − midpoint)²
    TREE = "tree"  # user counts of every node of the quantile tree (dp_core.quantiles)
    BOUNDS = "bounds"  # APPROX_BOUNDS: user counts per log-scale bin, over all groups
    ROWS = "rows"  # max_rows_contributed's choice: users per log-scale bin of their rows
    GROUPS = "groups"  # max_rows_contributed's choice: groups first of ≥ τ users
    VALUES = "values"  # a row-level aggregate's clip: its rows per value bin, users weighted


APPROX_BOUNDS_SHARE = Fraction(1, 4)
"""The share of a query's ε that APPROX_BOUNDS spends, when some aggregate needs it."""
TUNING_SHARE = Fraction(1, 10)
"""The share of a query's ε that choosing max_rows_contributed spends (`dp_core.tuning`),
when a row-level aggregate needs it and neither the query nor the session fixes it."""


@dataclass(frozen=True)
class NoisyQuantity:
    name: str
    """The pushdown column that holds the true value."""
    component: str
    aggregate: int | None
    sensitivity: float | None
    """Largest change one user makes to this quantity in one group (L1; L2 for Gaussian
    trees); None until APPROX_BOUNDS has found the aggregate's bounds."""
    epsilon: Fraction
    delta: Fraction
    noise: NoiseSpec | None
    """None until APPROX_BOUNDS has found the bounds the noise depends on."""

    @property
    def spec(self) -> NoiseSpec:
        if self.noise is None:
            raise InternalError("noise used before its bounds were found (this is a bug)")
        return self.noise


@dataclass(frozen=True)
class PrivacyCost:
    epsilon: Fraction
    delta: Fraction


@dataclass(frozen=True)
class DPQueryPlan:
    epsilon: Fraction
    delta: Fraction
    max_groups_contributed: int
    noise_kind: NoiseKind
    grouped: bool
    tau: float | None
    """Release threshold on the noisy user count (grouped queries)."""
    threshold: NoisyQuantity | None
    quantities: tuple[NoisyQuantity, ...]
    shared_users: bool
    """COUNT(*) / COUNT(DISTINCT uid) read the (noisy) user count, at no extra cost."""
    cost: PrivacyCost
    approx_bounds: tuple[NoisyQuantity, ...] = ()
    """One APPROX_BOUNDS histogram per aggregate without written or configured bounds."""
    selection: SelectionKind = SelectionKind.LAPLACE
    """How `threshold`'s share picks the released groups: τ-thresholding of the noisy user
    count, or truncated-geometric selection on the true one (`keep_probability`)."""
    selection_asked: SelectionKind = SelectionKind.LAPLACE
    """What the session or OPTIONS asked for: truncated-geometric selection is used only
    where the noisy user count is not itself released (COUNT(*) reads it: thresholding the
    released count costs nothing more)."""
    max_rows: int | None = None
    """T, max_rows_contributed: the rows of one user that row-level aggregates count, in all
    its groups together (each user's rows weighted by min(1, T / its rows)); None where no
    aggregate is row-level, or until `dp_core.tuning` has chosen it."""
    tuning: tuple[NoisyQuantity, ...] = ()
    """The DP statistics max_rows_contributed is chosen from, when it is chosen."""
    mean_rows: int | None = None
    """T of row-level AVG, VAR and STDDEV: `max_rows` where the query or the session fixes
    it; chosen apart where T is (at most the users' median row count: `dp_core.tuning`)."""
    sum_rows: int | None = None
    """T of row-level SUMs: `max_rows` where the query or the session fixes it; chosen apart
    where T is (at most T: a sum's noise per row is its clip, its bias per row the mean
    value, `dp_core.tuning`)."""

    same: tuple[tuple[int, str, str], ...] = ()
    """(aggregate, component, the quantity it reads): where an earlier aggregate of the same
    argument and bounds already has that quantity (`shared_key`: AVG, VAR and STDDEV of one
    column share their count and centred sums), released once and read by both."""
    rows_stored: frozenset[int] | None = None
    """Where T waits for partition selection to be chosen from a table's stored statistics
    (`dp_core.table_tuning`: no share of ε), the aggregates whose clip is chosen with it
    (from the stored value bins); None otherwise."""

    def name_of(self, aggregate: int, component: str) -> str:
        """The noisy quantity aggregate `aggregate`'s `component` reads (its own, or the one
        it shares)."""
        return next((name for i, c, name in self.same if i == aggregate and c == component),
                    f"dp_a{aggregate}_{component}")

    def quantity_of(self, aggregate: int, component: str) -> NoisyQuantity:
        return self.quantity(self.name_of(aggregate, component))

    def rows_for(self, agg: Aggregate) -> int | None:
        """T of a row-level aggregate."""
        return rows_for(agg, self.max_rows, self.mean_rows, self.sum_rows)

    @property
    def groups_per_user(self) -> int:
        return groups_per_user(self.grouped, self.max_groups_contributed)

    @property
    def pending(self) -> bool:
        """Some noise waits for the bounds APPROX_BOUNDS finds (see `make_plan`'s `auto`)."""
        return any(q.noise is None for q in self.quantities)

    @property
    def rows_pending(self) -> bool:
        """Row-level aggregates wait for max_rows_contributed (`dp_core.tuning`), chosen from
        the answer's own statistics or a table's stored ones (`rows_stored`)."""
        return (bool(self.tuning) or self.rows_stored is not None) and self.max_rows is None

    @property
    def auto_bounds(self) -> frozenset[int]:
        return frozenset(q.aggregate for q in self.approx_bounds if q.aggregate is not None)

    @property
    def trees(self) -> tuple[NoisyQuantity, ...]:
        return tuple(q for q in self.quantities if q.component == Component.TREE)

    def quantity(self, name: str) -> NoisyQuantity:
        for q in self.all_quantities:
            if q.name == name:
                return q
        raise KeyError(name)

    @property
    def all_quantities(self) -> tuple[NoisyQuantity, ...]:
        return ((self.threshold,) if self.threshold else ()) + self.approx_bounds + \
            self.tuning + self.quantities

    def mechanisms(self) -> dict[str, dict[str, object]]:
        """What the ledger records of each quantity's mechanism: its kind, scale and share,
        and how groups are selected (τ; or truncated-geometric selection, whose user count
        gets no noise: it only decides through π(n), so it has no scale)."""
        out: dict[str, dict[str, object]] = {
            q.name: {"kind": q.noise.kind.value if q.noise else self.noise_kind.value,
                     "scale": q.noise.scale if q.noise else None,
                     "epsilon": str(q.epsilon), "delta": str(q.delta)}
            for q in self.all_quantities}
        if self.tau is not None:
            out["threshold"] = {"tau": self.tau}
        if self.max_rows is not None:
            out["max_rows_contributed"] = {"rows": self.max_rows, "means": self.mean_rows,
                                           "sums": self.sum_rows}
        if self.threshold is not None and self.selection is SelectionKind.TRUNCATED_GEOMETRIC:
            out[self.threshold.name].update(kind=self.selection.value, scale=None)
        if self.max_rows is None and self.rows_stored is not None:
            out["max_rows_contributed"] = {"chosen": "after partition selection, from a "
                                           "table's tuned statistics (dp_core.table_tuning)"}
        if self.max_rows is None and self.tuning:
            out["max_rows_contributed"] = {"chosen": "per query; the row-level counts', sums' "
                                           "and averages' shares split again with it "
                                           "(dp_core.tuning.share_weights)"}
        return out


def rows_for(agg: Aggregate, max_rows: int | None, mean_rows: int | None,
             sum_rows: int | None) -> int | None:
    """T of a row-level aggregate, from the T of counts, of means and of sums."""
    if agg.kind in MEANS:
        return mean_rows
    return sum_rows if agg.kind is AggKind.SUM else max_rows


def _components(agg: Aggregate, noise: NoiseKind,
                max_rows: int | None = None) -> list[tuple[str, float | None]]:
    """The noisy quantities of one aggregate and their sensitivities (None: bounds or
    max_rows_contributed not yet known). A row-level aggregate's are a user's whole
    contribution over all its groups (L1): T rows, each within the bounds."""
    if agg.row_level:
        per_row = _components(replace(agg, row_level=False), noise)
        return [(c, None if s is None or max_rows is None else s * max_rows)
                for c, s in per_row]
    if agg.kind is AggKind.QUANTILE:
        # one user changes one node per level of the tree
        depth = float(DEPTH)
        return [(Component.TREE, depth if noise is NoiseKind.LAPLACE else math.sqrt(depth))]
    if agg.bounds is None:
        return [(c, 1.0 if c == Component.N else None) for c, _ in _components(
            replace(agg, bounds=Bounds(0.0, 1.0)), noise)]
    lo, hi = agg.bounds.lower, agg.bounds.upper
    half = (hi - lo) / 2
    if agg.kind is AggKind.COUNT:
        return [(Component.COUNT, hi)]
    if agg.kind is AggKind.COUNT_DISTINCT:
        # a user's k values in a group are all it can add to (or take from) its count
        return [(Component.DISTINCT, hi)]
    if agg.kind is AggKind.SUM:
        return [(Component.SUM, max(abs(lo), abs(hi)))]
    if agg.kind is AggKind.AVG:
        return [(Component.N, 1.0), (Component.CENTERED_SUM, half)]
    if agg.kind in (AggKind.VAR, AggKind.STDDEV):
        return [(Component.N, 1.0), (Component.CENTERED_SUM, half),
                (Component.CENTERED_SQUARES, half * half)]
    raise InternalError()


def shared_key(agg: Aggregate, component: str) -> tuple[object, ...] | None:
    """What makes two aggregates' `component` one noisy quantity: the same statistic of the
    same values (argument, bounds, row-level or per-user; T follows from the component:
    counts, centred sums and squares of means all take the means' T). Quantiles' trees are
    their own. Not for bounds APPROX_BOUNDS finds (each aggregate's own)."""
    if component == Component.TREE or agg.bounds is None:
        return None
    return (component, agg.arg, agg.bounds, agg.row_level)


VALUE_STEPS = 7
"""A configured range [L, U] is clipped, for one query, at one of L + (U − L)·2^−j, j < this."""


def shares_clip(a: Aggregate, b: Aggregate) -> bool:
    """Whether row-level aggregate b gets the clip chosen for a: a sum or mean (a COUNT(x)'s
    bounds [0, 1] are what a row counts, not a range to clip, whatever x's own) of the same
    argument and bounds."""
    return b.row_level and b.kind in CLIPPED_KINDS and b.arg == a.arg and b.bounds == a.bounds


def sharing_clip(query: AnalyzedQuery, i: int) -> list[int]:
    """The aggregates of `query` that get the clip chosen for aggregate i (`shares_clip`)."""
    a = query.aggregates[i]
    return [j for j, b in enumerate(query.aggregates) if shares_clip(a, b)]


def clip_tuned(query: AnalyzedQuery, auto: frozenset[int] = frozenset()) -> tuple[int, ...]:
    """The row-level sums and means whose clip within their configured bounds [L, U] (L ≥ 0)
    is chosen with T (`dp_core.tuning`): the first of each argument and bounds, others
    sharing its choice; not those whose bounds APPROX_BOUNDS finds (`auto`)."""
    out: list[int] = []
    for i, a in enumerate(query.aggregates):
        if not a.row_level or a.kind not in CLIPPED_KINDS or a.bounds is None or i in auto \
                or a.bounds.lower < 0 or a.arg is None:
            continue
        if not any(shares_clip(query.aggregates[j], a) for j in out):
            out.append(i)
    return tuple(out)


def reads_user_count(agg: Aggregate) -> bool:
    """Aggregates equal to the user count of the group: one row per user, counted once."""
    return agg.kind is AggKind.COUNT_USERS or (
        agg.kind is AggKind.COUNT and agg.arg is None and agg.known_bounds.upper == 1
        and not agg.row_level
    )


def groups_per_user(grouped: bool, max_groups: int) -> int:
    """How many released groups one user can change (the L0 bound the noise is calibrated
    with): C_u, or 1 for a query without GROUP BY, whose users are all in its one group."""
    return max_groups if grouped else 1


def _scale_error(query: AnalyzedQuery, agg_index: int | None, epsilon: Fraction,
                 how: str) -> InvalidParameterValue:
    """22023 for noise whose scale overflows, or is too small for its grid (`MIN_SCALE`):
    bounds too wide or too narrow, or an ε too small or too large for the query."""
    if agg_index is None:
        return InvalidParameterValue(
            f"epsilon {float(epsilon):g} makes this query's noise scale {how}",
            hint="ask for a larger epsilon" if how == "overflow" else "ask for a smaller epsilon")
    agg = query.aggregates[agg_index]
    return InvalidParameterValue(
        f"{agg.output_name}: its bounds [{agg.known_bounds.lower:g}, "
        f"{agg.known_bounds.upper:g}] make the noise scale {how}",
        hint="give narrower bounds (they bound one user's contribution)" if how == "overflow"
        else "give wider bounds (they bound one user's contribution)")


def check_noise_scales(query: AnalyzedQuery, plan: DPQueryPlan) -> None:
    """22023 for noise of a scale too small for its grid (`MIN_SCALE`): before any charge,
    after the budget and the per-query caps (so that an ε above the cap is refused as such)."""
    for q in plan.all_quantities:
        if q.noise is not None and not q.noise.scale >= MIN_SCALE:
            raise _scale_error(query, q.aggregate, plan.epsilon, "underflow")


def make_plan(query: AnalyzedQuery, epsilon: float, delta: float, max_groups: int,
              noise: NoiseKind, auto: frozenset[int] = frozenset(),
              selection: SelectionKind = SelectionKind.LAPLACE, max_rows: int | None = None,
              tuned: bool = False, mean_rows: int | None = None,
              sum_rows: int | None = None,
              weights: Mapping[str, Fraction] | None = None,
              stored: frozenset[int] | None = None) -> DPQueryPlan:
    """Split (ε, δ) over the query's noisy quantities and calibrate each one's noise.

    Aggregates without bounds get an APPROX_BOUNDS histogram (together APPROX_BOUNDS_SHARE
    of ε) and noise that is calibrated only once the bounds are known: plan again with
    the found bounds filled in and `auto` naming those aggregates, for the same split.
    Likewise row-level aggregates without `max_rows` (T) get the statistics T is chosen
    from (TUNING_SHARE of ε): plan again with the chosen T and `tuned` (and `mean_rows` and
    `sum_rows`, T of the means and of the sums, when they differ). `weights`: for some of
    the answer's quantities (by name), their part of what they have together, which
    otherwise is equal (`rebalanced`; the others' shares, the threshold's, and the cost are
    unchanged). `stored`: T (and the clips of these aggregates) to be chosen from a table's
    stored statistics once the groups are selected (`rows_stored`), not from the answer's own.
    """
    grouped = bool(query.keys)
    # public groups (`AnalyzedQuery.public_groups`): every key is released, none selected
    selecting = grouped and not query.public_groups
    l0 = groups_per_user(grouped, max_groups)
    # the decimal the analyst wrote (1e-6), not the binary expansion of the float
    eps, dlt = Fraction(repr(float(epsilon))), Fraction(repr(float(delta)))
    auto = auto | {i for i, a in enumerate(query.aggregates) if a.bounds is None}
    if any(query.aggregates[i].kind in (AggKind.COUNT, AggKind.COUNT_USERS) for i in auto):
        raise InternalError()
    shared = any(reads_user_count(a) for a in query.aggregates)
    row_level = any(a.row_level for a in query.aggregates)
    max_rows = max_rows if row_level else None  # (T of row-level aggregates only)
    mean_rows = max_rows if mean_rows is None or max_rows is None else mean_rows
    sum_rows = max_rows if sum_rows is None or max_rows is None else sum_rows
    tune = row_level and (max_rows is None or tuned) and stored is None
    if max_rows is not None and not (1 <= max_rows <= MAX_ROWS and mean_rows is not None
                                     and 1 <= mean_rows <= max_rows and sum_rows is not None
                                     and 1 <= sum_rows <= max_rows):
        raise InternalError()
    specs: list[tuple[str, str, int | None, float | None]] = []
    if selecting or shared:
        specs.append(("dp_users", Component.USERS, None, 1.0))
    same: list[tuple[int, str, str]] = []
    keys: list[tuple[tuple[object, ...], str]] = []
    for i, agg in enumerate(query.aggregates):
        if reads_user_count(agg):
            continue
        for component, sensitivity in _components(
                agg, noise, rows_for(agg, max_rows, mean_rows, sum_rows)):
            name = f"dp_a{i}_{component}"
            key = shared_key(agg, component) if i not in auto else None
            first = next((n for k, n in keys if key is not None and k == key), None)
            if first is not None:
                same.append((i, component, first))
                continue
            if key is not None:
                keys.append((key, name))
            specs.append((name, component, i, sensitivity))
    if any(s is not None and s <= 0 for *_, s in specs):
        raise InternalError()
    bounds_eps = eps * APPROX_BOUNDS_SHARE if auto else Fraction(0)
    tuning_eps = eps * TUNING_SHARE if tune else Fraction(0)
    share = (eps - bounds_eps - tuning_eps) / len(specs)
    shares = rebalanced({name: share for name, *_ in specs}, weights or {})
    gaussian = noise is NoiseKind.GAUSSIAN
    n_gauss = sum(1 for name, *_ in specs if name != "dp_users" or not selecting) \
        if gaussian else 0
    delta_threshold = (dlt / 2 if gaussian else dlt) if selecting else Fraction(0)
    delta_each = (dlt - delta_threshold) / n_gauss if n_gauss else Fraction(0)
    threshold: NoisyQuantity | None = None
    tau = None
    used = SelectionKind.LAPLACE if shared else selection
    quantities = []
    for name, component, agg_index, sensitivity in specs:
        if name == "dp_users" and selecting:
            spec = NoiseSpec.calibrate(NoiseKind.LAPLACE, float(share), 0, max_groups, 1.0)
            if not math.isfinite(spec.scale):
                raise _scale_error(query, None, eps, "overflow")
            threshold = NoisyQuantity(name, component, None, 1.0, share, delta_threshold, spec)
            if used is SelectionKind.LAPLACE:
                tau = threshold_tau(max_groups, float(share), float(delta_threshold))
                continue
            try:
                selection_parameters(max_groups, float(share), float(delta_threshold))
            except ValueError:
                raise InvalidParameterValue(
                    f"truncated_geometric partition selection needs a delta of at least "
                    f"{max_groups * 2.0 ** -46:.3g} for the selection (here "
                    f"{float(delta_threshold):g})",
                    hint="raise delta, or use dp.partition_selection = 'laplace'") from None
            continue
        kind = NoiseKind.GAUSSIAN if gaussian else NoiseKind.LAPLACE
        # (a row-level aggregate's sensitivity bounds a user's sum over all its groups)
        groups = 1 if agg_index is not None and query.aggregates[agg_index].row_level else l0
        noise_spec = None if sensitivity is None else NoiseSpec.calibrate(
            kind, float(shares[name]), float(delta_each), groups, sensitivity)
        if noise_spec is not None and not math.isfinite(noise_spec.scale):
            raise _scale_error(query, agg_index, eps, "overflow")
        quantities.append(NoisyQuantity(name, component, agg_index, sensitivity, shares[name],
                                        delta_each if gaussian else Fraction(0), noise_spec))
    if auto and not math.isfinite(l0 / float(bounds_eps / len(auto))):
        raise _scale_error(query, None, eps, "overflow")
    histograms = tuple(
        NoisyQuantity(f"dp_a{i}_{Component.BOUNDS}", Component.BOUNDS, i, 1.0,
                      bounds_eps / len(auto), Fraction(0),
                      NoiseSpec.calibrate(NoiseKind.LAPLACE, float(bounds_eps / len(auto)), 0,
                                          l0, 1.0))
        for i in sorted(auto))
    tuning: tuple[NoisyQuantity, ...] = ()
    if tune:
        # users per bin of their row count and, with GROUP BY, the groups that at least τ
        # users have as their first group: each user is in one bin, and first in one group
        # and, per clipped argument (`clip_tuned`), its rows per value bin, each user's
        # weighted by 1 / its rows (together at most 1)
        parts: list[tuple[str, int | None]] = [(Component.ROWS, None)]
        # (public groups: their number is known; τ-thresholding in one pass runs first, and
        # the released groups' noisy user counts weigh T's noise: `tuning.typical_groups`)
        one_pass = all(c != Component.DISTINCT for _, c, _, _ in specs)  # (`rewrite.binned`)
        if selecting and not (one_pass and used is SelectionKind.LAPLACE):
            parts.append((Component.GROUPS, None))
        parts += [(Component.VALUES, i) for i in clip_tuned(query, auto)]
        each = tuning_eps / len(parts)
        tuning = tuple(NoisyQuantity(f"dp_{c}" if i is None else f"dp_a{i}_{c}", c, i, 1.0,
                                     each, Fraction(0),
                                     NoiseSpec.calibrate(NoiseKind.LAPLACE, float(each), 0, 1,
                                                         1.0))
                       for c, i in parts)
        if not all(math.isfinite(q.spec.scale) for q in tuning):
            raise _scale_error(query, None, eps, "overflow")
    cost = PrivacyCost(eps, delta_threshold + delta_each * n_gauss)
    plan = DPQueryPlan(eps, dlt, max_groups, noise, grouped, tau, threshold, tuple(quantities),
                       shared, cost, histograms, used if grouped else SelectionKind.LAPLACE,
                       selection, max_rows, tuning, mean_rows, sum_rows, tuple(same),
                       stored if row_level and max_rows is None else None)
    spent_eps = sum((q.epsilon for q in plan.all_quantities), Fraction(0))
    spent_delta = sum((q.delta for q in plan.all_quantities), Fraction(0))
    if spent_eps != cost.epsilon or spent_delta != cost.delta or cost.delta > dlt:
        raise InternalError("the plan's privacy loss differs from its cost (this is a bug)")
    if tau is not None and not math.isfinite(tau):
        raise InternalError()
    return plan


def rebalanced(shares: Mapping[str, Fraction],
               weights: Mapping[str, Fraction]) -> dict[str, Fraction]:
    """`shares` with those of the quantities `weights` names split again: their total in
    proportion to the weights (the last gets what is left, so the total is exact)."""
    out = dict(shares)
    names = [n for n in shares if n in weights]
    if any(weights[n] <= 0 for n in names) or set(weights) - set(shares):
        raise InternalError("weights of quantities a plan does not have (this is a bug)")
    if len(names) < 2:
        return out
    pool = sum((shares[n] for n in names), Fraction(0))
    total = sum((weights[n] for n in names), Fraction(0))
    for n in names[:-1]:
        out[n] = pool * weights[n] / total
    out[names[-1]] = pool - sum((out[n] for n in names[:-1]), Fraction(0))
    return out


def replan_with_bounds(query: AnalyzedQuery, plan: DPQueryPlan, found: Mapping[int, Bounds],
                       max_rows: int | None = None, mean_rows: int | None = None,
                       sum_rows: int | None = None,
                       weights: Mapping[str, Fraction] | None = None
                       ) -> tuple[AnalyzedQuery, DPQueryPlan]:
    """The second planning stage, after APPROX_BOUNDS and the choice of max_rows_contributed:
    the query with the bounds found filled in and its plan for them and for `max_rows` (the
    plan's own when None), the same split of ε/δ (the noise of the aggregates that had none
    is now calibrated). Its cost must be the charged plan's."""
    query = query.with_bounds(found)
    again = make_plan(query, float(plan.epsilon), float(plan.delta), plan.max_groups_contributed,
                      plan.noise_kind, plan.auto_bounds, plan.selection_asked,
                      max_rows if max_rows is not None else plan.max_rows, bool(plan.tuning),
                      mean_rows if max_rows is not None else plan.mean_rows,
                      sum_rows if max_rows is not None else plan.sum_rows, weights,
                      plan.rows_stored if max_rows is None else None)
    if any(a.row_level and a.kind is AggKind.COUNT and a.bounds != Bounds(0, 1)
           for a in query.aggregates):
        raise InternalError("a row-level count given bounds (this is a bug)")
    if again.cost != plan.cost or again.same != plan.same:
        # (the clips chosen are each argument and range's: its aggregates' stay alike)
        raise InternalError("the plan's cost or shared quantities changed with its bounds "
                            "(this is a bug)")
    return query, again
