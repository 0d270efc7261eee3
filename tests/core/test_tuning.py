"""Row-level aggregates and max_rows_contributed: sensitivities, the plan's split, T's choice."""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest

from dp_core.accounting import AnswerCost
from dp_core.binned import clipped_aggregates
from dp_core.errors import InternalError, InvalidParameterValue
from dp_core.explain import explain_lines
from dp_core.mechanism_choices import SelectionKind
from dp_core.mechanisms import NoiseKind, NoiseSpec
from dp_core.plan import TUNING_SHARE, VALUE_STEPS, Component, make_plan, replan_with_bounds
from dp_core.query import Bounds
from dp_core.release import release
from dp_core.settings import Caps, DPSettings, query_settings
from dp_core.tuning import (
    ROW_EDGES,
    TunedRows,
    choose_clip,
    choose_max_rows,
    choose_sum_rows,
    replan_tuned,
    tune,
    tune_rows,
    typical_groups,
    unit_noise,
    value_thresholds,
)
from tests.support.engine import build

GROUPED = "SELECT browser, COUNT(*), SUM(duration), AVG(duration), VAR_POP(duration) " \
          "FROM visits GROUP BY browser"


def test_plain_aggregates_are_row_level_and_anon_ones_per_user() -> None:
    query, _, _ = build("SELECT WITH ANONYMIZATION COUNT(*), SUM(duration), ANON_COUNT(*), "
                        "ANON_SUM(duration, 0, 10), COUNT(DISTINCT uid), "
                        "SUM(duration, contribution_bounds_per_group => (0, 10)) FROM visits")
    assert [a.row_level for a in query.aggregates] == [True, True, False, False, False, False]


def test_row_level_sensitivities_are_t_rows_in_all_groups() -> None:
    """Hand-computed: T = 10 rows, duration within [0, 3600] per row (the demo's config):
    COUNT 10, SUM 36,000, AVG's count 10 and centred sum 10 · 1800, VAR's centred squares
    10 · 1800² (its count and centred sum are AVG's: one argument, one range, one T); each over
    all of a user's groups (Laplace scale Δ/ε, not C_u·Δ/ε)."""
    query, _, _ = build(GROUPED)
    plan = make_plan(query, 1.0, 1e-6, 5, NoiseKind.LAPLACE, max_rows=10)
    got = {(q.aggregate, q.component): q.sensitivity for q in plan.quantities}
    assert got == {(0, Component.COUNT): 10.0,
                   (1, Component.SUM): 36_000.0, (2, Component.N): 10.0,
                   (2, Component.CENTERED_SUM): 18_000.0,
                   (3, Component.CENTERED_SQUARES): 10 * 1800.0 ** 2}
    assert plan.name_of(3, Component.N) == "dp_a2_n"
    assert plan.name_of(3, Component.CENTERED_SUM) == "dp_a2_csum"
    assert plan.name_of(3, Component.CENTERED_SQUARES) == "dp_a3_csq"
    share = Fraction(1, len(plan.quantities) + 1)  # (the user count is the threshold's)
    for q in plan.quantities:
        assert q.epsilon == share and q.spec.scale == pytest.approx(q.sensitivity / share)
    assert not plan.tuning and plan.cost.epsilon == 1
    # the user count for partition selection keeps C_u: τ and its noise are C_u's
    assert plan.threshold is not None and plan.threshold.spec.scale == pytest.approx(5 / share)


def test_t_chosen_per_query_spends_its_share_and_replans_at_the_same_cost() -> None:
    query, _, _ = build(GROUPED)
    plan = make_plan(query, 1.0, 1e-6, 5, NoiseKind.LAPLACE)
    assert plan.rows_pending and plan.pending and plan.max_rows is None
    # the histogram of rows and one value histogram for duration (SUM, AVG and VAR_POP share
    # it: one argument, one configured range); no count of groups: τ-thresholding runs first
    # and T's noise is weighed over the released groups (`tuning.typical_groups`)
    assert [(q.component, q.aggregate) for q in plan.tuning] == [
        (Component.ROWS, None), (Component.VALUES, 1)]
    assert all(q.epsilon == TUNING_SHARE / 2 and q.sensitivity == 1.0 for q in plan.tuning)
    assert plan.tuning[0].spec.scale == pytest.approx(20.0)
    # with truncated-geometric selection (no noisy user counts), or beside COUNT(DISTINCT x)
    # (the statistics run first, in a statement of their own), the groups are counted
    geometric = make_plan(query, 1.0, 1e-6, 5, NoiseKind.LAPLACE,
                          selection=SelectionKind.TRUNCATED_GEOMETRIC)
    distinct, _, _ = build("SELECT browser, COUNT(*), COUNT(DISTINCT country) FROM visits "
                           "GROUP BY browser")
    for other in (geometric, make_plan(distinct, 1.0, 1e-6, 5, NoiseKind.LAPLACE)):
        assert [q.component for q in other.tuning][:2] == [Component.ROWS, Component.GROUPS]
    # a one-pass τ plan's T is never chosen before the selection it is weighed over
    with pytest.raises(InternalError):
        tune(plan, {1: 10}, 3, {}, np.random.default_rng(1), query)
    _, again = replan_with_bounds(query, plan, {}, 48, 6)
    assert again.cost == plan.cost and again.max_rows == 48 and not again.pending
    assert again.quantity("dp_a0_count").sensitivity == 48.0
    assert again.quantity("dp_a1_sum").sensitivity == 48 * 3600.0
    # the means' T is their own: 6 rows
    assert again.quantity("dp_a2_n").sensitivity == 6.0
    assert again.quantity("dp_a3_csq").sensitivity == 6 * 1800.0 ** 2
    # a global query has no groups count: all the share on the histogram
    (one, _, _) = build("SELECT COUNT(*) FROM visits")
    assert [q.epsilon for q in make_plan(one, 1.0, 1e-6, 1, NoiseKind.LAPLACE).tuning] == \
        [TUNING_SHARE]


def _exact() -> NoiseSpec:
    return NoiseSpec(NoiseKind.LAPLACE, 1e-9)


def test_choice_of_t_by_hand() -> None:
    """1,000 users with 4 or 5 rows (bin [4, 6), typical 4.5) and 10 with 40 to 47 (bin
    [32, 48), typical 39.5), no noise to speak of. Where noise is cheap, T = 48 loses no row;
    where a row of noise costs as much as 0.2 rows per group, the 10 users' 35 rows beyond 4.5
    are not worth T's noise (T = 6: 10 · 33.5 rows lost < (48 − 6) · 0.2 · 100 groups); where
    noise costs 1,000 per unit of T, T = 4 (855 rows lost + 4,000 against, at T = 1, 2, 3 and 6:
    3,885 + 1,000, 2,875 + 2,000, 1,865 + 3,000 and 335 + 6,000)."""
    bin_of = {4: ROW_EDGES.index(4) + 1, 32: ROW_EDGES.index(32) + 1}
    hist = {bin_of[4]: 1000, bin_of[32]: 10}
    rng = np.random.default_rng(1)
    assert choose_max_rows(hist, None, _exact(), None, 1e-6, rng).max_rows == 48
    chosen = choose_max_rows(hist, 100, _exact(), _exact(), 0.2, rng)
    assert chosen.max_rows == 6
    # the median user is in [4, 6): the means' T is at most 6
    assert choose_max_rows(hist, None, _exact(), None, 1e-6, rng).mean_rows == 6
    assert chosen.rows_cut == pytest.approx(10 * 33.5 / (1000 * 4.5 + 10 * 39.5))
    assert chosen.users_cut == pytest.approx(10 / 1010)
    assert choose_max_rows(hist, None, _exact(), None, 1000.0, rng).max_rows == 4
    # public groups: their number is known, no noise needed (none given): 100 groups as above
    public = choose_max_rows(hist, 100, _exact(), None, 0.2, rng, groups_known=True)
    assert (public.max_rows, public.groups) == (6, 100)
    assert choose_max_rows(hist, 100, _exact(), None, 0.2, rng).groups == 1.0


def test_typical_groups_by_hand() -> None:
    """The noise of T is weighed over the released groups' users over the median group's:
    10 + 20 + 30 + 1,000 users, median 25: 42.4 groups (T chosen for the median group's
    relative error); equal groups count as their number; counts below 1 (noise) as 1; none
    or one group as 1. Given (`weighed`), it replaces the groups' noisy count."""
    assert typical_groups([10, 20, 30, 1000]) == pytest.approx(1060 / 25)
    assert typical_groups([50.0] * 7) == pytest.approx(7)
    assert typical_groups([-3.0, 0.5, 1.0]) == pytest.approx(3)
    assert typical_groups([]) == 1.0
    assert typical_groups([400.0]) == 1.0
    bin_of = {4: ROW_EDGES.index(4) + 1, 32: ROW_EDGES.index(32) + 1}
    hist = {bin_of[4]: 1000, bin_of[32]: 10}
    rng = np.random.default_rng(1)
    # as test_choice_of_t_by_hand: 100 groups at 0.2 a unit of T choose 6, one group 48
    weighed = choose_max_rows(hist, 1, _exact(), _exact(), 0.2, rng, weighed=100.0)
    assert (weighed.max_rows, weighed.groups) == (6, 100.0)
    assert choose_max_rows(hist, 100, _exact(), _exact(), 0.2, rng, weighed=1.0).max_rows == 48


_SHAPES = {
    "exp18": lambda rng: 1 + np.floor(rng.exponential(18, 20_000)).astype(int),
    "lognormal": lambda rng: np.maximum(1, np.round(rng.lognormal(2, 1.2, 20_000))).astype(int),
    "pareto": lambda rng: np.minimum(5000, np.floor(2 * (1 - rng.random(20_000)) ** (-1 / 1.15)))
    .astype(int),
}
"""Rows per user: issue 30's bench body, a log-normal, and the demo's heavy Pareto tail."""


@pytest.mark.parametrize("shape", sorted(_SHAPES))
@pytest.mark.parametrize("groups", [1, 30])
def test_the_chosen_t_is_near_the_least_error_under_its_noise(shape: str, groups: int) -> None:
    """Statistical: 20,000 users, the histogram's noise at ε 0.1 (scale 10), the count's at ε
    0.9, `groups` groups: over 300 draws, the error T brings (rows beyond it + groups × the
    count's mean noise for T, relative to the rows) is, in the median draw, within 1.5× the
    least over every candidate T plus 1% of the rows, and within 3× plus 2% in 95% of them.
    For the heavy tail with one group, where the users beyond the seen bins hold the error,
    the median within 1.8× the least and the 95th percentile within 4.5×: the fitted tail
    finds them (the histogram alone left 4× and 6× the least there: 11% and 17% of the rows
    against 2.7%)."""
    rng = np.random.default_rng(11)
    rows = _SHAPES[shape](rng)
    bins = np.searchsorted(ROW_EDGES, rows, side="right")
    hist = {int(b): int(n) for b, n in zip(*np.unique(bins, return_counts=True), strict=True)}
    unit = unit_noise(NoiseKind.LAPLACE, 0.9, 0.0)

    def error(t: int) -> float:
        return float(np.maximum(rows - t, 0).sum() + groups * unit * t) / float(rows.sum())

    least = min(error(t) for t in ROW_EDGES)
    noisy = NoiseSpec(NoiseKind.LAPLACE, 10.0)
    drawn = np.array([error(choose_max_rows(hist, groups, noisy, noisy, unit, rng,
                                            groups_known=True).max_rows) for _ in range(300)])
    heavy_global = shape == "pareto" and groups == 1
    assert np.median(drawn) <= (1.8 * least if heavy_global else 1.5 * least + 0.01), \
        (least, np.median(drawn))
    assert np.quantile(drawn, 0.95) <= (4.5 * least if heavy_global else 3 * least + 0.02), \
        (least, np.quantile(drawn, 0.95))


def test_the_tail_is_fitted_to_the_highest_seen_bins() -> None:
    """Hand-computed: counts falling as one power law over the six highest seen bins continue
    above them with that law, for TAIL_REACH bins; counts whose law steepens (an
    exponential's), that do not fall as a tail (flat per row count), or too few bins, give
    none."""
    from dp_core.tuning import _REPS, _WIDTHS, TAIL_REACH, fitted_tail

    top = 12
    law = 1e7 * _REPS ** -2.5 * _WIDTHS
    noisy = np.zeros(len(ROW_EDGES))
    noisy[top - 5: top + 1] = law[top - 5: top + 1]
    tail = fitted_tail(noisy, top)
    assert not tail[:top + 1].any()
    reach = slice(top + 1, top + 1 + TAIL_REACH)
    assert np.allclose(tail[reach], law[reach], rtol=1e-9)
    assert not tail[top + 1 + TAIL_REACH:].any()
    steepening = np.zeros(len(ROW_EDGES))
    steepening[top - 5: top + 1] = 1e7 * np.exp(-_REPS[top - 5: top + 1] / 30) \
        * _WIDTHS[top - 5: top + 1]
    assert not fitted_tail(steepening, top).any()
    flat = np.zeros(len(ROW_EDGES))
    flat[top - 5: top + 1] = 5.0 * _WIDTHS[top - 5: top + 1]  # the same users per row count
    assert not fitted_tail(flat, top).any()
    few = noisy.copy()
    few[top - 5] = 0.0
    assert not fitted_tail(few, top).any()


def test_max_rows_contributed_setting_and_option() -> None:
    caps = Caps(10.0, 1e-3, 100)
    settings = DPSettings(1.0, 1e-6, 1, "laplace")
    assert settings.show("max_rows_contributed") == "auto"
    assert query_settings(settings, caps).max_rows is None
    assert query_settings(settings, caps, [("max_rows_contributed", 7)]).max_rows == 7
    fixed = settings.with_value("dp.max_rows_contributed", "12", caps)
    assert query_settings(fixed, caps).max_rows == 12
    assert query_settings(fixed, caps, [("max_rows_contributed", "auto")]).max_rows is None
    for bad in (0, 2.5, "many", 1 << 21):
        with pytest.raises(InvalidParameterValue):
            settings.with_value("dp.max_rows_contributed", bad, caps)


def test_choice_of_the_sums_t_by_hand() -> None:
    """A SUM's T: its rows' mean value × the rows beyond T + groups × T × its largest |value|
    × a count's mean noise, least over the edges up to the count's T. 1,000 users of 1 row and
    10 of 111 (bin [96, 128)): rows beyond T = 10 × (111.5 − T) below 111.5."""
    tuned = TunedRows(128, 128, 0.0, 0.0, 1111.0, 1.0,
                      lost=tuple(10 * max(0.0, 111.5 - t) for t in ROW_EDGES))
    # a low mean value against a wide clip: every row beyond 1 costs more noise than it
    # brings (5 × 10 < 1 × 100 per unit of T)
    assert choose_sum_rows(tuned, [(5.0, 100.0)], 1.0) == 1
    # a middling one: worth it up to the heavy users' bin (at 96: 12 × 155 + 9,600 = 11,460;
    # at 128: 0 + 12,800)
    assert choose_sum_rows(tuned, [(12.0, 100.0)], 1.0) == 96
    # a high one: every row (50 × 10 > 100 per unit of T)
    assert choose_sum_rows(tuned, [(50.0, 100.0)], 1.0) == 128
    # never above the count's T, and summed over the sums (12 × lost + 101 × T)
    assert choose_sum_rows(tuned, [(1e6, 1.0)], 1.0) == 128
    assert choose_sum_rows(tuned, [(5.0, 100.0), (7.0, 1.0)], 1.0) == 96
    assert choose_sum_rows(tuned, [], 1.0) == 128


def test_choice_of_clip_by_hand() -> None:
    """[0, 1024] clipped at 512, 256, ... 16; all rows in [64, 128) (typical 96), no noise
    to speak of, 1,000 rows. Where the range's noise is cheap, 128 clips nothing and is the
    narrowest such range; at 600 per unit of range, 64 (32 lost per row: 32,000 + 38,400
    against 76,800 at 128 and 64,000 + 19,200 at 32), a third of the value beyond it."""
    bounds = Bounds(0.0, 1024.0)
    assert value_thresholds(bounds)[:3] == [512.0, 256.0, 128.0]
    bins = [0.0] * VALUE_STEPS
    bins[3] = 100.0  # [64, 128): bin 0 is [512, 1024]
    rng = np.random.default_rng(3)
    assert choose_clip(bins, bounds, 1000.0, 1e-6, _exact(), rng) == \
        (128.0, pytest.approx(0.0, abs=1e-9), pytest.approx(96.0))
    upper, share, mean = choose_clip(bins, bounds, 1000.0, 600.0, _exact(), rng)
    assert upper == 64.0 and share == pytest.approx(1 / 3) and mean == pytest.approx(96.0)
    with pytest.raises(InternalError):
        choose_clip(bins[:-1], bounds, 1000.0, 1.0, _exact(), rng)


def test_tuning_rows_of_an_empty_table() -> None:
    """Over no rows the value bins' sums are NULL (the statement's one row of an aggregate
    over nothing): read as 0, T and the clip are chosen from noise alone, no error."""
    query, _, _ = build("SELECT SUM(duration) FROM visits")
    plan = make_plan(query, 1.0, 1e-6, 1, NoiseKind.LAPLACE)
    rows = [{"dp_kind": 2, "dp_agg": 0, "dp_bin": b, "dp_n": None} for b in range(VALUE_STEPS)]
    tuned = tune_rows(plan, rows, np.random.default_rng(5), query)
    assert tuned.max_rows in ROW_EDGES and 0 in tuned.clips


def test_rdp_accountant_reads_row_level_gaussian_noise_exactly() -> None:
    """A row-level aggregate's Gaussian noise is calibrated for L2 sensitivity T·Δ over all
    groups (not √C_u·T·Δ): the RDP accountant's noise multiplier is σ / (T·Δ), whatever C_u,
    as for the per-user quantities σ / (√C_u·Δ)."""
    query, _, _ = build("SELECT browser, SUM(duration), ANON_SUM(duration, 0, 10) FROM visits "
                        "GROUP BY browser")
    plan = make_plan(query, 1.0, 1e-5, 4, NoiseKind.GAUSSIAN, max_rows=10)
    row, per_user = plan.quantity("dp_a0_sum"), plan.quantity("dp_a1_sum")
    got = dict(zip(("row", "user"), AnswerCost.of(plan).gaussian_multipliers[-2:], strict=True))
    assert got["row"] == pytest.approx(row.spec.scale / (10 * 3600))
    assert got["user"] == pytest.approx(per_user.spec.scale / (2 * 10))


def test_explain_says_what_t_is_chosen_from() -> None:
    """EXPLAIN names each statistic T and the clips are chosen from, once each: with
    τ-thresholding in one pass, the users' row counts and the value bins, and how the
    released groups weigh T's noise; with truncated-geometric selection, the groups' count
    instead (and a value histogram is never described as one)."""
    query, _, _ = build(GROUPED)
    for selection, groups_line in ((SelectionKind.LAPLACE, False),
                                   (SelectionKind.TRUNCATED_GEOMETRIC, True)):
        plan = make_plan(query, 1.0, 1e-6, 5, NoiseKind.LAPLACE, selection=selection)
        text = "\n".join(explain_lines(query, plan, []))
        assert text.count("users per log-scale bin of their row count") == 1
        assert text.count("Clip of sum from DP statistics") == 1
        assert text.count("users have as their first group") == int(groups_line), text
        assert ("released groups' noisy user counts over the median" in text) != groups_line
        assert "rows per bin of their user's mean in the group" in text
        assert text.count("; each user's mean in a group clamped to a clip") == 3
    means, _, _ = build("SELECT browser, SUM(duration), AVG(duration) FROM visits "
                        "GROUP BY browser")
    text = "\n".join(explain_lines(means, make_plan(means, 1.0, 1e-6, 5, NoiseKind.LAPLACE), []))
    assert "rows per bin of their user's mean in the group" in text
    assert text.count("; each user's mean in a group clamped to a clip") == 2


def test_aggregates_of_one_column_share_their_noisy_quantities() -> None:
    """AVG, VAR and STDDEV of one argument and bounds (row-level, or per-user) read one noisy
    count and centred sum, VAR and STDDEV one sum of squares: fewer quantities, each a larger
    share of ε, the cost still ε. Not shared: another argument, other bounds, row-level with
    per-user, bounds APPROX_BOUNDS finds (each aggregate's own); and the sharing is the same
    once T and the clip are chosen (the replan's cost is the plan's). Released, STDDEV is the
    square root of VAR exactly (one noisy variance)."""
    query, _, _ = build("SELECT browser, VAR_POP(duration), STDDEV_POP(duration), "
                        "AVG(duration) FROM visits GROUP BY browser")
    plan = make_plan(query, 1.0, 1e-6, 5, NoiseKind.LAPLACE)
    assert [q.name for q in plan.quantities] == ["dp_a0_n", "dp_a0_csum", "dp_a0_csq"]
    text = "\n".join(explain_lines(query, plan, []))
    assert "  var_pop, stddev_pop, avg: n, " in text and "  var_pop, stddev_pop: csq, " in text
    assert all(q.epsilon == (1 - TUNING_SHARE) / 4 for q in plan.quantities)
    assert plan.cost.epsilon == 1
    # (the clip is chosen for the argument and range: every aggregate of them gets it)
    _, again = replan_with_bounds(query, plan, dict.fromkeys(range(3), Bounds(0, 900)), 48, 6)
    assert again.same == plan.same and again.cost == plan.cost
    with pytest.raises(InternalError):
        replan_with_bounds(query, plan, {0: Bounds(0, 900)}, 48, 6)
    assert again.quantity_of(2, Component.N).sensitivity == 6.0
    unshared = [
        "SELECT browser, AVG(duration), AVG(duration + 1) FROM visits GROUP BY browser",
        "SELECT browser, SUM(duration), SUM(duration, contribution_bounds_per_group => (0, 3600))"
        " FROM visits GROUP BY browser",
        "SELECT WITH ANONYMIZATION browser, ANON_AVG(duration, 0, 10), ANON_AVG(duration, 0, 20)"
        " FROM visits GROUP BY browser",
        "SELECT WITH ANONYMIZATION category, ANON_AVG(amount * 2), ANON_VAR(amount * 2) "
        "FROM purchases GROUP BY category",
    ]
    for sql in unshared:
        q, p, _ = build(sql)
        assert not p.same, sql
    q, p, _ = build("SELECT WITH ANONYMIZATION browser, ANON_AVG(duration, 0, 10), "
                    "ANON_STDDEV(duration, 0, 10), ANON_VAR(duration, 0, 10) FROM visits "
                    "GROUP BY browser")
    assert {(i, c) for i, c, _ in p.same} == {
        (1, Component.N), (1, Component.CENTERED_SUM), (2, Component.N),
        (2, Component.CENTERED_SUM), (2, Component.CENTERED_SQUARES)}
    assert len(p.quantities) == 3
    rows = [{"dp_t0": "x", "dp_k0": "x", "dp_h0": None, "dp_users": 500, "dp_a0_n": 500.0,
             "dp_a0_csum": -1000.0, "dp_a1_csq": 5000.0}]
    out = release(q, p, rows, np.random.default_rng(3)).rows
    assert len(out) == 1
    _, avg, stddev, var = out[0]
    assert 0 <= avg <= 10 and stddev == pytest.approx(math.sqrt(var), rel=1e-12)


def test_a_clip_bounds_users_means() -> None:
    """A clip chosen for row-level SUM, AVG, VAR and STDDEV bounds each user's mean in a group
    (and its mean squared distance to the clip's midpoint; its rows keep the configured
    bounds, `row_bounds`); not a COUNT's; bounds APPROX_BOUNDS finds are not clips."""
    q, _, _ = build("SELECT browser, SUM(duration), AVG(duration), COUNT(duration) FROM visits "
                    "GROUP BY browser")
    assert [q.clips_means(i) for i in range(3)] == [True, True, False]
    clipped = q.with_bounds({0: Bounds(0, 900), 1: Bounds(0, 900)})
    assert [a.row_bounds for a in clipped.aggregates] == [Bounds(0, 3600), Bounds(0, 3600), None]
    assert clipped.aggregates[0].bounds == Bounds(0, 900)
    # clipped again (another draw): the rows keep the configured bounds
    again = clipped.with_bounds({0: Bounds(0, 450)}).aggregates[0]
    assert (again.bounds, again.row_bounds) == (Bounds(0, 450), Bounds(0, 3600))
    v, _, _ = build("SELECT browser, SUM(duration), STDDEV(duration) FROM visits "
                    "GROUP BY browser")
    assert v.clips_means(0) and v.clips_means(1)
    assert [a.row_bounds for a in v.with_bounds(
        {0: Bounds(0, 900), 1: Bounds(0, 900)}).aggregates] == [Bounds(0, 3600)] * 2
    found, _, _ = build("SELECT WITH ANONYMIZATION category, ANON_SUM(amount * 2) FROM purchases "
                        "GROUP BY category")
    assert found.with_bounds({0: Bounds(0, 64)}).aggregates[0].row_bounds is None


def test_a_count_of_a_column_never_takes_its_sums_clip() -> None:
    """A row-level COUNT(x) has bounds [0, 1] (a row counts 1): where x's own bounds are [0, 1]
    too, SUM(x)'s clip must not become the count's, whose rows still count 1 each (its noise
    would be calibrated for T × the clip: down to 1/64 of the sensitivity). Found
    by review; on 72d2593 the count's sensitivity after the replan is the clip × T."""
    x = "CASE WHEN duration > 3 THEN 1 ELSE 0 END"
    query, _, _ = build(f"SELECT browser, COUNT({x}) AS c, SUM({x}) AS s, AVG({x}) AS a "
                        "FROM visits GROUP BY browser", max_groups=2)
    plan = make_plan(query, 1.0, 1e-6, 2, NoiseKind.LAPLACE)
    hist = {ROW_EDGES.index(8) + 1: 5000}
    # every user's mean in the lowest value bin: the lowest clip
    values = {1: {VALUE_STEPS - 1: 5000.0}}
    tuned = tune(plan, hist, 0, values, np.random.default_rng(2), query, released_users=[2500.0])
    assert set(tuned.clips) == {1, 2} and tuned.clips[1].upper < 1
    q2, p2 = replan_tuned(query, plan, tuned)
    assert q2.aggregates[0].bounds == Bounds(0, 1.0)
    assert p2.quantity_of(0, Component.COUNT).sensitivity == tuned.max_rows
    assert clipped_aggregates(query, plan) == {1, 2}
    # the replan refuses a count given other bounds
    with pytest.raises(InternalError):
        replan_with_bounds(query, plan, {0: Bounds(0, 0.5)}, 8, 8, 8)


def test_a_range_too_narrow_to_halve_has_fewer_clips() -> None:
    """[1, 1 + 1e-15]: its halvings round to 1 or repeat, so no candidate is at L (a mean's
    range, and its noise, would be 0: the replan failed after the charge, found by review)
    and none twice; a range of one float has none, its value bins one. The clip chosen is
    always one the plan can take."""
    narrow = Bounds(1.0, 1.0 + 1e-15)
    t = value_thresholds(narrow)
    assert all(narrow.lower < x < narrow.upper for x in t) and len(set(t)) == len(t) < 6
    assert value_thresholds(Bounds(0, 3600)) == [1800, 900, 450, 225, 112.5, 56.25]
    assert value_thresholds(Bounds(1.0, 1.0 + 2.0 ** -52)) == []
    rng = np.random.default_rng(4)
    for bounds in (narrow, Bounds(1.0, 1.0 + 2.0 ** -52)):
        bins = [100.0] * (len(value_thresholds(bounds)) + 1)
        for _ in range(20):
            upper, _, _ = choose_clip(bins, bounds, 1000.0, 1e6, _exact(), rng)
            assert bounds.lower < upper <= bounds.upper


def test_rebalanced_shares_keep_the_total_and_the_others() -> None:
    from dp_core.plan import rebalanced

    fifth = Fraction(1, 5)
    out = rebalanced({"t": fifth, "a": fifth, "b": fifth, "c": fifth},
                     {"a": Fraction(1), "b": Fraction(3)})
    assert out == {"t": fifth, "a": Fraction(1, 10), "b": Fraction(3, 10), "c": fifth}
    assert rebalanced({"a": fifth}, {"a": Fraction(2)}) == {"a": fifth}  # (one: nothing to split)
    with pytest.raises(InternalError):
        rebalanced({"a": fifth, "b": fifth}, {"a": Fraction(1), "z": Fraction(1)})


def test_counts_sums_and_averages_split_their_epsilon_by_their_relative_noise() -> None:
    """COUNT(*), SUM and AVG of duration by country, T 48 (sums 32, means 8), clip 900, a
    row's mean value 420 (hand-computed): a = 48 for the count, 32 × 900 / 420 = 68.57 for
    the sum, 8 × 450 / 420 = 8.57 for the average's centred sum and 8 × |420 − 450| / 420 =
    0.571 for its count; √a = 6.928, 8.281, 2.928, 0.756 on the quarter-octave grid 2^(11/4)
    = 6.727, 2^3 = 8, 2^(6/4), 2^(-2/4); the last two raised to the floor f = ¾ of the mean
    weight, f = 0.75 × (6.727 + 8 + 2f) / 4, so f = 4.418. Their 4 × 0.18 of ε: the count
    0.2056, the sum 0.2444, each of the average's 0.135 (¾ of 0.18)."""
    from dp_core.tuning import share_weights

    query, plan, _ = build("SELECT country, COUNT(*), SUM(duration), AVG(duration) FROM visits "
                           "GROUP BY country", max_groups=5)
    tuned = TunedRows(48, 8, 0.0, 0.0, clips={1: Bounds(0, 900), 2: Bounds(0, 900)},
                      sum_rows=32)
    weights = share_weights(query, plan, tuned, {1: 420.0, 2: 420.0})
    assert {n: float(w) for n, w in weights.items()} == pytest.approx(
        {"dp_a0_count": 2 ** (11 / 4), "dp_a1_sum": 8.0,
         "dp_a2_csum": 4.41815, "dp_a2_n": 4.41815}, rel=1e-4)
    _, again = replan_tuned(query, plan, replace(tuned, weights=weights))
    eps = {q.name: float(q.epsilon) for q in again.all_quantities}
    assert eps["dp_users"] == pytest.approx(0.18)  # (the threshold's share: as charged)
    assert eps["dp_a0_count"] == pytest.approx(0.2056, abs=1e-4)
    assert eps["dp_a1_sum"] == pytest.approx(0.2444, abs=1e-4)
    assert eps["dp_a2_csum"] == pytest.approx(0.135, abs=1e-6)
    assert eps["dp_a2_n"] == pytest.approx(0.135, abs=1e-6)
    assert again.cost == plan.cost
    # the noise follows the shares: the count's Laplace scale is T / its ε
    assert again.quantity("dp_a0_count").spec.scale == pytest.approx(48 / eps["dp_a0_count"])
    # equal shares where a mean value is unknown, or with VAR
    assert share_weights(query, plan, tuned, {1: 420.0}) == {}
    var_query, var_plan, _ = build("SELECT COUNT(*), VAR_POP(duration) FROM visits")
    assert share_weights(var_query, var_plan, replace(tuned, clips={1: Bounds(0, 900)}),
                         {1: 420.0}) == {}
