"""Bounds an admin tunes once per table (dp_core.table_tuning): the statement's plan and cost, what
is stored, and which later queries use it and how (hand-computed)."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

from dp_core.analysis import analyze, parse_select
from dp_core.binned import clipped_aggregates, value_bin_columns
from dp_core.mechanisms import NoiseKind
from dp_core.plan import Component, make_plan
from dp_core.query import Bounds
from dp_core.rewrite import binned
from dp_core.table_tuning import (
    TableTuning,
    applied,
    table_tuning,
    tuning_sql,
    with_tuning_epsilon,
)
from dp_core.tuning import ROW_EDGES, TunedRows, replan_tuned, typical_groups, value_thresholds
from tests.support.engine import CLASSIFIER, POLICY

LOST = tuple(100.0 * max(0, 1000 - c) for c in ROW_EDGES)
"""Rows beyond each candidate T of 100 users of 1,000 rows each (and no other)."""
TUNED = TableTuning("public.visits", "tuned:public.visits:ab", Fraction(1, 10), 64, 8, 32,
                    {"duration": Bounds(0, 900)}, {"duration": 0.02}, 0.01, 0.001, 1,
                    "2026-11-27 00:00:00 UTC", 7, {"duration": 420.0}, LOST,
                    tuple(1.0 if c < 1000 else 0.0 for c in ROW_EDGES), 100_000.0, 12)


def _query(sql: str):  # type: ignore[no-untyped-def]
    (st,) = CLASSIFIER.classify(sql)
    return analyze(parse_select(st.stripped_sql), POLICY, plain_form=st.dp_clause is None)


def test_the_tuning_query_and_its_noise_for_the_admins_epsilon() -> None:
    sql = tuning_sql("public", "visits", ["duration"])
    assert sql == 'SELECT count(*), sum("duration"), avg("duration") FROM "public"."visits"'
    query = _query(sql)
    plan = make_plan(query, 1.0, 1e-6, 1, NoiseKind.LAPLACE)
    # users per bin of their rows, and duration's value bins (avg shares sum's clip)
    assert [q.component for q in plan.tuning] == [Component.ROWS, Component.VALUES]
    tuned = with_tuning_epsilon(plan, Fraction(1, 5))
    # ε 0.2 over two histograms of sensitivity 1: Laplace scale 1 / 0.1 = 10 each
    assert [(q.epsilon, q.spec.scale) for q in tuned.tuning] == [(Fraction(1, 10), 10.0)] * 2
    assert tuned.cost.epsilon == Fraction(1, 5) and tuned.cost.delta == 0
    assert tuned.quantities == plan.quantities  # (what T's choice weighs: the answer's noise)


def test_what_is_stored_round_trips_and_keeps_the_clips_by_column() -> None:
    assert TableTuning.from_json(TUNED.to_json(), TUNED.tuned_at, TUNED.ledger_id) == TUNED
    binned = replace(TUNED, bins={"duration": (1.0, 2.5, 0.0)},
                     ranges={"duration": Bounds(0, 3600)})
    assert TableTuning.from_json(binned.to_json(), binned.tuned_at, binned.ledger_id) == binned
    query = _query(tuning_sql("public", "visits", ["duration"]))
    tuned = TunedRows(128, 8, 0.05, 0.01, clips={1: Bounds(0, 450), 2: Bounds(0, 450)},
                      clipped={1: 0.1, 2: 0.1}, sum_rows=64, means={1: 300.0, 2: 300.0},
                      lost=LOST, mean_cap=12)
    stored = table_tuning("public.visits", "tok", Fraction(1, 10), query, POLICY["visits"],
                          tuned, 3)
    assert (stored.max_rows, stored.mean_rows, stored.sum_rows, stored.groups) == (128, 8, 64, 3)
    assert stored.clips == {"duration": Bounds(0, 450)} and stored.clipped == {"duration": 0.1}
    assert stored.means == {"duration": 300.0} and stored.lost == LOST and stored.mean_cap == 12
    assert stored.bins == {} and stored.ranges == {}  # (no value bins in `tuned`)


def test_a_query_of_the_table_alone_takes_t_and_its_columns_clips() -> None:
    query = _query("SELECT browser, COUNT(*), SUM(duration), AVG(v.duration), "
                   "VAR_POP(duration), SUM(duration * 2) FROM visits v GROUP BY browser")
    used = applied(query, POLICY, {"public.visits": TUNED})
    assert used is not None and used.tuning is TUNED
    aggs = used.query.aggregates
    assert aggs[0].bounds == Bounds(0, 1) and aggs[0].row_bounds is None  # a count: no clip
    for i in (1, 2, 3):  # the column as it is: its mean per user and group within the clip
        assert aggs[i].bounds == Bounds(0, 900) and aggs[i].row_bounds == Bounds(0, 3600)
    assert aggs[4].row_bounds is None  # an expression of it: not the column's clip
    assert used.tuned.clips == {1: Bounds(0, 900), 2: Bounds(0, 900), 3: Bounds(0, 900)}
    plan = make_plan(used.query, 1.0, 1e-6, 1, NoiseKind.LAPLACE, max_rows=64, mean_rows=8,
                     sum_rows=32)
    assert plan.tuning == () and plan.cost.epsilon == 1  # nothing of the query's goes to it
    count = plan.quantity_of(0, Component.COUNT)
    # a row-level count of T = 64 rows per user: sensitivity 64, scale 64 / its ε share
    assert count.sensitivity == 64 and count.spec.scale == pytest.approx(64 / count.epsilon)
    total = plan.quantity_of(1, Component.SUM)
    assert total.sensitivity == 32 * 900  # T of sums × the clip


@pytest.mark.parametrize(("epsilon", "expected"), [(1.0, 1024), (0.005, 1)])
def test_each_query_chooses_its_t_from_the_stored_statistics(epsilon: float,
                                                             expected: int) -> None:
    """100 users of 1,000 rows (LOST), `SELECT COUNT(*)`: its count has all of ε (no tuning
    share), Laplace noise of mean |noise| 1 / ε per unit of T. At ε 1: rows beyond T + T is
    least at T = 1024 (0 + 1024; at 768, 23,200 + 768); at ε 0.005 (200 per unit): at T = 1
    (99,900 + 200; at 768, 23,200 + 153,600; at 1024, 204,800)."""
    query = _query("SELECT COUNT(*) FROM visits")
    used = applied(query, POLICY, {"public.visits": TUNED})
    assert used is not None
    probe = make_plan(used.query, epsilon, 1e-6, 1, NoiseKind.LAPLACE, max_rows=1)
    tuned = used.chosen(probe).tuned
    assert tuned.max_rows == expected and tuned.mean_rows == min(expected, 12)
    assert tuned.rows_cut == pytest.approx(LOST[ROW_EDGES.index(expected)] / 100_000)
    assert tuned.users_cut == (1.0 if expected < 1000 else 0.0)


@pytest.mark.parametrize(("public", "expected"), [(None, 1024), (3, 1)])
def test_public_groups_weigh_t_over_their_number(public: int | None, expected: int) -> None:
    """A query of public groups releases all of them: T chosen when it is planned, its noise
    weighed over their number (`public`), not the admin's `groups` (TUNED: 1). Grouped by
    browser at ε 1/30, the count has half of it: mean |noise| 60 per unit of T. Rows beyond
    T + groups × 60·T: over 1 group least at T = 1024 (61,440; at 768, 23,200 + 46,080; at 1,
    99,960); over 3, at T = 1 (100,080; at 1024, 184,320)."""
    used = applied(_query("SELECT browser, COUNT(*) FROM visits GROUP BY browser"), POLICY,
                   {"public.visits": TUNED})
    assert used is not None
    plan = make_plan(used.query, 1 / 30, 1e-6, 1, NoiseKind.LAPLACE, max_rows=1)
    tuned = used.chosen(plan, public=public).tuned
    assert tuned.max_rows == expected and tuned.groups == (public or 1)


@pytest.mark.parametrize("sql", [
    "SELECT COUNT(*) FROM purchases",  # another table
    "SELECT COUNT(*) FROM visits JOIN purchases USING (uid)",  # two protected tables
    "SELECT COUNT(*) FROM (SELECT uid, duration FROM visits) s",  # through a subquery
    "SELECT WITH ANONYMIZATION ANON_SUM(duration, 0, 10) FROM visits",  # per-user: no T
])
def test_other_queries_do_not_use_it(sql: str) -> None:
    assert applied(_query(sql), POLICY, {"public.visits": TUNED}) is None


def test_a_clip_that_no_longer_fits_the_columns_bounds_is_not_used() -> None:
    query = _query("SELECT SUM(duration) FROM visits")
    stale = TableTuning("public.visits", "t", Fraction(1, 10), 64, 8, 32,
                        {"duration": Bounds(0, 5000)}, {"duration": 0.0}, lost=LOST)
    used = applied(query, POLICY, {"public.visits": stale})
    assert used is not None and used.query.aggregates[0].bounds == Bounds(0, 3600)
    assert used.tuned.clips == {}


@pytest.mark.parametrize(("epsilon", "clip"), [(1.0, 450), (0.005, 900)])
def test_each_query_chooses_its_clip_from_the_stored_value_bins(epsilon: float,
                                                                clip: float) -> None:
    """Every user's mean in the bin [450, 900) (representative 675), 1,500 rows in all, the
    column's range [0, 3600]: a clip c costs 1,500 × (675 − c)⁺ + w × c, w = the noise per
    unit of range, T × the sum's mean |noise| per unit (1 / ε). At ε 1 (T 1024: w 1024),
    450 (225 × 1500 + 460,800 = 798,300) beats 900 (921,600) and 225 (675,000 + 230,400);
    at ε 0.005 (T 1: w 200), 900 (180,000) beats 450 (337,500 + 90,000)."""
    stored = replace(TUNED, rows_total=1500.0, bins={"duration": (0, 0, 100.0, 0, 0, 0, 0)},
                     ranges={"duration": Bounds(0, 3600)})
    used = applied(_query("SELECT SUM(duration) FROM visits"), POLICY, {stored.table: stored})
    assert used is not None
    chosen = used.chosen(make_plan(used.query, epsilon, 1e-6, 1, NoiseKind.LAPLACE,
                                   max_rows=1))
    assert chosen.tuned.clips == {0: Bounds(0, clip)}
    assert chosen.query.aggregates[0].bounds == Bounds(0, clip)
    assert chosen.query.aggregates[0].row_bounds == Bounds(0, 3600)
    assert chosen.tuned.means == {0: 675.0}
    # bins stored under other bounds are not read: the stored clip, where it fits
    moved = replace(stored, ranges={"duration": Bounds(0, 7200)})
    used = applied(_query("SELECT SUM(duration) FROM visits"), POLICY, {moved.table: moved})
    assert used is not None
    assert used.chosen(make_plan(used.query, epsilon, 1e-6, 1, NoiseKind.LAPLACE,
                                 max_rows=1)).tuned.clips == {0: Bounds(0, 900)}


@pytest.mark.parametrize("sql", [
    "SELECT SUM(duration) FROM visits WHERE duration > 3000",
    "SELECT SUM(duration) FROM visits JOIN countries c ON c.code = visits.country",
])
def test_a_filtered_or_joined_query_keeps_its_bounds_and_takes_t(sql: str) -> None:
    """Its rows' values may lie anywhere in [L, U] whatever the table's do (the table's clip
    would clamp every mean of `duration > 3000` to 900): no clip; T from the statistics."""
    used = applied(_query(sql), POLICY, {"public.visits": TUNED})
    assert used is not None and used.tuned.clips == {}
    assert used.query.aggregates[0].bounds == Bounds(0, 3600)
    assert used.query.aggregates[0].row_bounds is None
    chosen = used.chosen(make_plan(used.query, 1.0, 1e-6, 1, NoiseKind.LAPLACE, max_rows=1))
    assert chosen.tuned.max_rows == 1024 and chosen.tuned.clips == {}



@pytest.mark.parametrize(("released", "expected"), [([100.0] * 4, 1024), ([10.0] * 200, 1)])
def test_a_grouped_query_chooses_t_once_its_groups_are_selected(released: list[float],
                                                                expected: int) -> None:
    """`SELECT browser, COUNT(*) ... GROUP BY browser` of the tuned table (LOST: 100 users of
    1,000 rows): its plan leaves T to the run (`rows_stored`; no tuning share, its main
    statement binned), which chooses it from the stored statistics once partition selection
    has released groups, weighed over their noisy user counts over the median's
    (`typical_groups`). The count has half of ε 1 (the threshold the other half): mean
    |noise| 2 per unit of T. Four groups of 100 users: 4 groups, rows beyond T + 8·T, least
    at T = 1024 (8,192; at 768, 23,200 + 6,144); 200 groups of 10: 200 groups, 100,000 +
    300·T below 1,000 rows, least at T = 1 (100,300; at 1024, 409,600)."""
    query = _query("SELECT browser, COUNT(*) FROM visits GROUP BY browser")
    used = applied(query, POLICY, {"public.visits": TUNED})
    assert used is not None and used.clips_rechosen
    plan = make_plan(used.base, 1.0, 1e-6, 1, NoiseKind.LAPLACE,
                     stored=frozenset(used.columns))
    assert plan.rows_pending and plan.tuning == () and plan.cost.epsilon == 1 and binned(plan)
    assert plan.mechanisms()["max_rows_contributed"]["chosen"].startswith(
        "after partition selection")
    tuned = used.chosen(plan, released).tuned
    assert tuned.max_rows == expected
    assert tuned.groups == pytest.approx(typical_groups(released))
    # before the groups are known, the admin's `groups` (1) weighs it: T = 1024 either way
    assert used.chosen(plan).tuned.max_rows == 1024
    # what the run does next: the plan for that T, at the cost charged
    _, again = replan_tuned(used.base, plan, tuned)
    assert again.max_rows == expected and again.cost == plan.cost and not again.rows_pending


def test_a_grouped_querys_clip_is_chosen_with_t_from_the_value_bins() -> None:
    """Grouped and of all the table's rows: its SUM's clip candidates are in the binned main
    statement (`rows_stored` names it), and the run chooses the clip from the stored value
    bins with T (as `test_each_query_chooses_its_clip_from_the_stored_value_bins`)."""
    stored = replace(TUNED, rows_total=1500.0, bins={"duration": (0, 0, 100.0, 0, 0, 0, 0)},
                     ranges={"duration": Bounds(0, 3600)})
    used = applied(_query("SELECT browser, SUM(duration), AVG(duration) FROM visits "
                          "GROUP BY browser"), POLICY, {stored.table: stored})
    assert used is not None and used.clips_rechosen and set(used.columns) == {0}
    plan = make_plan(used.base, 1.0, 1e-6, 1, NoiseKind.LAPLACE, stored=frozenset(used.columns))
    assert clipped_aggregates(used.base, plan) == {0, 1}  # (AVG shares SUM's clip)
    assert value_bin_columns(used.base, plan) == {}  # (the stored bins, not the answer's)
    tuned = used.chosen(plan, [100.0] * 4).tuned
    assert set(tuned.clips) == {0, 1} and tuned.clips[0] == tuned.clips[1]
    assert tuned.clips[0].upper in (3600.0, *value_thresholds(Bounds(0, 3600)))
    # bins stored under other bounds: T is chosen when the query is prepared, as before
    moved = applied(used.base, POLICY, {stored.table: replace(stored, ranges={
        "duration": Bounds(0, 7200)})})
    assert moved is not None and not moved.clips_rechosen
