"""Error bars as SQL values (issue 31): DP_INTERVAL_LOW / DP_INTERVAL_HIGH, the ends of each DP
column's 95% noise interval, released with the answer at no cost."""

from __future__ import annotations

import numpy as np
import pytest

from dp_core.errors import FeatureNotSupported
from dp_core.mechanisms import NoiseKind, NoiseSpec
from dp_core.quantiles import tree_codes, walk, walk_interval
from dp_core.release import derived_half_widths, half_width_95, release, tree_values
from tests.support.engine import build

QUERY = ("SELECT WITH ANONYMIZATION browser, ANON_COUNT(*) AS n, DP_INTERVAL_LOW(n) AS nl, "
         "DP_INTERVAL_HIGH(n) AS nh, ANON_SUM(duration, 0, 10) AS s, DP_INTERVAL_LOW(s) AS sl, "
         "DP_INTERVAL_HIGH(ANON_SUM(duration, 0, 10)) AS sh, ANON_AVG(duration, 0, 10) AS a, "
         "DP_INTERVAL_LOW(a) AS al, DP_INTERVAL_HIGH(a) AS ah FROM visits GROUP BY browser")
GROUPS, USERS, MEAN = 50, 400, 3.0


def _rows() -> list[dict[str, object]]:
    """Each group's true per-user sums: USERS users, each with the mean MEAN (within [0, 10])."""
    return [{"dp_k0": f"k{g}", "dp_t0": f"k{g}", "dp_users": USERS, "dp_a1_sum": USERS * MEAN,
             "dp_a2_n": USERS, "dp_a2_csum": USERS * (MEAN - 5.0)} for g in range(GROUPS)]


def test_intervals_are_columns_of_their_own_and_cost_nothing() -> None:
    query, plan, _ = build(QUERY)
    _, plain_plan, _ = build("SELECT WITH ANONYMIZATION browser, ANON_COUNT(*) AS n, "
                             "ANON_SUM(duration, 0, 10) AS s, ANON_AVG(duration, 0, 10) AS a "
                             "FROM visits GROUP BY browser")
    assert len(query.aggregates) == 3  # an interval names an aggregate: no aggregate more
    assert plan.cost == plain_plan.cost and plan.quantities == plain_plan.quantities
    assert [s.name for s in query.select] == ["browser", "n", "nl", "nh", "s", "sl", "sh", "a",
                                              "al", "ah"]
    assert [(o.aggregate, o.bound) for o in query.outputs if o.bound] == [
        (0, "low"), (0, "high"), (1, "low"), (1, "high"), (2, "low"), (2, "high")]


def test_intervals_cover_the_true_values_95_percent_of_the_time() -> None:
    """Over 20 releases of 50 groups with known true values (no contribution bias: every
    user's value within the bounds, one group each), each interval covers its group's true
    value in 95% of the releases. Tolerance: 1,000 intervals per column, so ±3 standard
    errors of a proportion around 0.95 is ±0.021; counts are rounded and the AVG's width is
    simulated (1,000 draws), so [0.92, 0.985]."""
    query, plan, _ = build(QUERY)
    rng = np.random.default_rng(7)
    covered = {"n": 0, "s": 0, "a": 0}
    names = [o.name for o in query.outputs]  # (released rows are in output order)
    for _ in range(20):
        out = release(query, plan, _rows(), rng)
        assert len(out.rows) == GROUPS
        for row in out.rows:
            r = dict(zip(names, row, strict=True))
            for col, truth in (("n", USERS), ("s", USERS * MEAN), ("a", MEAN)):
                lo, hi = r[f"{col}l"], r[f"{col}h"]
                assert isinstance(lo, float) and isinstance(hi, float)
                assert lo <= r[col] <= hi  # type: ignore[operator]
                covered[col] += lo <= truth <= hi
    for col, k in covered.items():
        assert 0.92 <= k / (20 * GROUPS) <= 0.985, (col, k)


def test_widths_are_the_notices() -> None:
    """A count's and a sum's width is their noise's 95% half-width (hand-computed: Laplace of
    scale C_u·Δ/ε has P(|X| ≤ w) = 1 − exp(−w/b), so w = b·ln 20); an AVG's, per group, is
    larger where the group's count is smaller."""
    query, plan, _ = build(QUERY)
    b_users = plan.quantity("dp_users").spec.scale
    assert half_width_95(query, plan, 0) == pytest.approx(b_users * np.log(20), rel=0.02)
    b_sum = plan.quantity("dp_a1_sum").spec.scale
    assert half_width_95(query, plan, 1) == pytest.approx(b_sum * np.log(20), rel=0.02)
    assert half_width_95(query, plan, 2) is None  # per group
    noisy = {"dp_a2_n": np.array([20.0, 2000.0]), "dp_a2_csum": np.array([-40.0, -4000.0])}
    small, large = derived_half_widths(2, query.aggregates[2], plan, noisy, [0, 1],
                                       np.random.default_rng(1), 4000)
    assert small > 5 * large > 0


def test_clamped_to_what_the_value_can_be() -> None:
    """A count's interval never goes below 0; an AVG's stays within its bounds."""
    query, plan, _ = build(QUERY)
    rows = [{"dp_k0": "k", "dp_t0": "k", "dp_users": 1000, "dp_a1_sum": 0.0, "dp_a2_n": 1000,
             "dp_a2_csum": -5000.0}]
    names = [o.name for o in query.outputs]  # (released rows are in output order)
    for seed in range(20):
        (row,) = release(query, plan, rows, np.random.default_rng(seed)).rows
        r = dict(zip(names, row, strict=True))
        assert r["al"] >= 0.0 and r["ah"] <= 10.0  # type: ignore[operator]
        assert r["nl"] >= 0.0  # type: ignore[operator]


@pytest.mark.parametrize("sql,message", [
    ("SELECT COUNT(*) AS n, DP_INTERVAL_LOW(n) + 1 FROM visits", "select-list items of their own"),
    ("SELECT COUNT(*) AS n FROM visits HAVING DP_INTERVAL_LOW(n) > 0",
     "select-list items of their own"),
    ("SELECT COUNT(*) AS n FROM visits ORDER BY DP_INTERVAL_HIGH(COUNT(*))",
     "select-list items of their own"),
    ("SELECT browser, COUNT(*), DP_INTERVAL_LOW(browser) FROM visits GROUP BY browser",
     "must be a DP aggregate"),
    ("SELECT COUNT(*) AS n, DP_INTERVAL_LOW(n, 2) FROM visits", "takes one argument"),
    ("SELECT COUNT(*) AS n, DP_INTERVAL_LOW(m) FROM visits", "must be a DP aggregate"),
    ("SELECT COUNT(*) AS n, SUM(duration) AS n, DP_INTERVAL_LOW(n) FROM visits",
     "must be a DP aggregate"),  # (two items of the name: ambiguous)
])
def test_other_uses_are_refused(sql: str, message: str) -> None:
    with pytest.raises(FeatureNotSupported, match=message):
        build(sql)


def test_a_quantiles_interval_brackets_it_and_covers_the_true_quantile() -> None:
    """A quantile's interval is read from its own noisy tree at the ranks its rank error away:
    the answer always lies within it (the walks share each node's noise, and a walk's value
    grows with its rank), and over 400 answers (ε 1, 2,000 users, values spread over the
    bounds) it covers the true median in at least 90% of them (two one-sided 95% ends;
    tolerance: 3 standard errors of a proportion of 400 below 0.95, 0.918, less the leaves'
    width)."""
    rng = np.random.default_rng(11)
    values = rng.gamma(2.0, 300.0, 2000).clip(0, 3600)
    codes, counts = tree_codes(values, 0.0, 3600.0)
    noise = NoiseSpec(NoiseKind.LAPLACE, 4.0)
    truth = float(np.quantile(values, 0.5))
    covered = 0
    for _ in range(400):
        v, lo, hi = walk_interval(codes, counts, 0.5, 0.0, 3600.0, noise, rng)
        assert lo <= v <= hi
        covered += lo <= truth <= hi
    assert covered / 400 >= 0.9, covered
    # the same answer's distribution as a walk of its own (the answer's walk is unchanged)
    alone = walk(codes, counts, 0.5, 0.0, 3600.0, noise, rng, runs=400)
    shared = [walk_interval(codes, counts, 0.5, 0.0, 3600.0, noise, rng)[0] for _ in range(400)]
    assert abs(np.median(alone) - np.median(shared)) < 20 and abs(np.median(alone) - truth) < 20


def test_quantile_intervals_through_release() -> None:
    query, plan, _ = build("SELECT WITH ANONYMIZATION browser, ANON_MEDIAN(duration, 0, 3600) AS m, "
                           "DP_INTERVAL_LOW(m) AS ml, DP_INTERVAL_HIGH(m) AS mh FROM visits "
                           "GROUP BY browser")
    values = np.random.default_rng(3).uniform(0, 3600, 3000)
    codes, counts = tree_codes(values, 0.0, 3600.0)
    rows = [{"dp_k0": "k", "dp_t0": "k", "dp_users": 3000}]
    trees = [{"dp_t0": "k", "dp_agg": 0, "dp_codes": b"".join(int(c).to_bytes(4, "big") for c in codes),
              "dp_counts": b"".join(int(n).to_bytes(8, "big") for n in counts)}]
    names = [o.name for o in query.outputs]
    (row,) = release(query, plan, rows, np.random.default_rng(5),
                     quantiles=tree_values(query, plan, trees)).rows
    r = dict(zip(names, row, strict=True))
    assert r["ml"] <= r["m"] <= r["mh"] and r["mh"] - r["ml"] < 600  # type: ignore[operator]
    assert abs(r["m"] - 1800) < 300  # type: ignore[operator]
