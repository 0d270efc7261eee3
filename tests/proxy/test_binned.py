"""Binned main statements (`dp_core.binned`): per-bin sums resolved for T and a clip give the
values the statement written for that T and clip computes, on the demo data in Postgres."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import asyncpg
import numpy as np
import pytest

from dp_core.binned import (
    Binned,
    TuningStats,
    binned_plan,
    binned_row,
    clipped_aggregates,
    resolve,
    value_bin_columns,
)
from dp_core.plan import replan_with_bounds
from dp_core.query import Bounds, TablePolicy
from dp_core.rewrite import binned, pushdown, ranged_pushdown
from dp_core.tuning import ROW_EDGES, groups_threshold, value_thresholds
from tests.support.backend import Backend
from tests.support.engine import POLICY, build


def test_a_bin_adds_its_rows_below_t_and_t_times_its_shares_above() -> None:
    """Hand-computed: two users of 1 row each (bin 1) and partials summing to 5 (A = 5, and
    B = 5 / 1); one user of 3 rows (bin 3: [3, 4)) with a partial of 6 (A = 6, B = 6 / 3)."""
    # column 0: first users; column 1: A, column 2: B of one quantity
    b = Binned(np.array([1, 3]), np.array([[2.0, 5.0, 5.0], [1.0, 6.0, 2.0]]))
    # T = 1 (edge index 0): every bin is above it: 1 · (5 + 2)
    assert b.value(0, 1) == 7.0
    # T = 2 (index 1): bin 1 below (5), bin 3 above: 2 · 2
    assert b.value(0, 2) == 9.0
    # T = 4 (index 3): both below: 5 + 6
    assert b.value(0, 4) == 11.0
    assert b.first_users()[[0, 2]].tolist() == [2.0, 1.0]
    # ranges of users add up bin by bin
    c = b + Binned(np.array([2, 3]), np.array([[1.0, 1.0, 0.5], [0.0, 3.0, 1.0]]))
    assert c.bins.tolist() == [1, 2, 3]
    assert c.sums.tolist() == [[2.0, 5.0, 5.0], [1.0, 1.0, 0.5], [1.0, 9.0, 3.0]]
    with pytest.raises(ValueError):
        b.value(0, 5)  # T is an edge


def test_weighting_by_bins_is_exact_for_every_edge() -> None:
    """Random users with random row counts: Σ min(1, T / n) · p from per-bin A and B equals
    the direct sum for every edge T."""
    rng = np.random.default_rng(5)
    n = rng.integers(1, 5000, size=400)
    p = rng.uniform(0, 10, size=400) * n  # a partial over the user's rows in the group
    bins = np.searchsorted(np.array(ROW_EDGES), n, side="right")  # width_bucket's numbers
    present = np.unique(bins)
    sums = np.array([[0.0, p[bins == b].sum(), (p[bins == b] / n[bins == b]).sum()]
                     for b in present])
    binned_sums = Binned(present, sums)
    for t in ROW_EDGES[:30]:
        direct = float(np.sum(np.minimum(1.0, t / n) * p))
        assert math.isclose(binned_sums.value(0, t), direct, rel_tol=1e-12), t


@pytest.mark.parametrize("sql", [
    "SELECT browser, count(*), sum(duration), avg(duration) FROM visits GROUP BY browser",
    "SELECT count(duration), var_pop(duration), stddev(duration) FROM visits",
    "SELECT country, sum(duration), count(*) FROM visits WHERE duration > 100 GROUP BY country",
])
def test_resolved_sums_are_the_statement_for_that_t_and_clip(backend: Backend, sql: str) -> None:
    """For several T and clips: the binned statement's rows resolved for them equal the rows
    of the statement written with that T and clip (which T's choice replaces), up to float
    rounding; so does the users' count and selection input, and the tuning statistics are
    the users' row counts (every user in one bin, first in one group)."""
    query, plan, _ = build(sql, max_groups=2)
    assert binned(plan)
    columns, terms = binned_plan(query, plan)
    pd = pushdown(query, plan, order_seed=11)
    assert list(pd.statements()) == ["main"]
    # (as `tuning.tune` gives them: every aggregate of a clipped argument and range)
    clipped = clipped_aggregates(query, plan)

    async def go() -> None:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            await conn.execute("SET hash_mem_multiplier = 8")
            assert pd.main is not None
            rows = [binned_row(r, len(columns)) for r in await conn.fetch(pd.main)]
            stats = TuningStats(groups_threshold(plan))
            for r in rows:
                stats.add(r, value_bin_columns(query, plan))
            users = await conn.fetchval("SELECT count(DISTINCT uid) FROM visits"
                                        + (" WHERE duration > 100" if "WHERE" in sql else ""))
            assert sum(stats.rows().values()) == users
            for t, clip_step in ((1, 0), (4, 2), (24, 1), (1048576, 6)):
                clips = {i: Bounds(0.0, ([3600.0, *value_thresholds(Bounds(0, 3600))])[clip_step])
                         for i in clipped}
                q2, p2 = replan_with_bounds(query, plan, clips, t, t)
                written = pushdown(q2, p2, order_seed=11)
                assert written.main is not None and "width_bucket" not in written.main
                expected = {tuple(r.get(f"dp_t{i}") for i in range(len(query.keys))): dict(r)
                            for r in await conn.fetch(written.main)}
                got = [dict(r) for r in rows]
                resolve(got, query, p2, terms, clips)
                assert len(got) == len(expected)
                for r in got:
                    e = expected[tuple(r.get(f"dp_t{i}") for i in range(len(query.keys)))]
                    for q in p2.quantities:
                        if q.name in terms:
                            assert _close(r[q.name], e[q.name]), (t, clip_step, q.name)
                    if "dp_users" in e:
                        assert r["dp_users"] == e["dp_users"]
        finally:
            await conn.close()

    asyncio.run(go())


def test_groups_no_users_count_in_are_left_in_the_pushdown(backend: Backend) -> None:
    """Red team, session 30: a key that gives each of one user's rows its own group
    (`CASE WHEN uid = target THEN duration ELSE 0 END`) made the row-level main statement
    return a row per group, every one but the user's first C_u no candidate, which the
    proxy read, parsed and dropped: 14-24 µs each, 0.4 s more for 20,000 rows. Over every
    user, binned (with value bins or without) or written for one T, the statement returns
    only the groups some user counts in: the others' group and the target's C_u. For one
    range of users (a group may be a candidate in another range) every group still comes."""
    async def go() -> None:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            await conn.execute("SET hash_mem_multiplier = 8")
            target, distinct = await conn.fetchrow(
                "SELECT uid, count(DISTINCT duration) FROM visits GROUP BY uid "
                "ORDER BY 2 DESC, 1 LIMIT 1")
            assert distinct > 100
            key = f"CASE WHEN uid = {target} THEN duration ELSE 0 END"
            for c_u in (1, 3):
                counted, counted_plan, _ = build(f"SELECT {key} AS k, count(*) FROM visits "
                                                 "GROUP BY 1", max_groups=c_u)
                summed, summed_plan, _ = build(f"SELECT {key} AS k, count(*), sum(duration) "
                                               "FROM visits GROUP BY 1", max_groups=c_u)
                assert binned(counted_plan) and binned(summed_plan)
                fixed_q, fixed_p = replan_with_bounds(summed, summed_plan, {}, 24, 24)
                for pd, groups in (
                        (pushdown(counted, counted_plan, order_seed=3), 1 + c_u),
                        (pushdown(fixed_q, fixed_p, order_seed=3), 1 + c_u),
                        (pushdown(summed, summed_plan, order_seed=3), 1 + c_u),
                        (ranged_pushdown(counted, counted_plan, None, 3).of((None, "999999999")),
                         distinct + 1)):
                    assert pd.main is not None
                    rows = await conn.fetch(pd.main)
                    assert len(rows) == groups, (len(rows), groups, pd.main[-200:])
        finally:
            await conn.close()

    asyncio.run(go())


def test_a_range_too_narrow_to_clip_is_summed_per_row(backend: Backend) -> None:
    """Review, session 30: bounds so narrow that no clip lies within them have one candidate
    and no count column; the value classes read one (`dp_n0`), and the statement failed to
    prepare. It is summed per row as before, and Postgres plans it."""
    narrow = {**POLICY, "visits": TablePolicy("public", "uid", {
        "duration": Bounds(1.0, math.nextafter(1.0, 2.0))})}
    query, plan, _ = build("SELECT browser, SUM(duration) FROM visits GROUP BY browser",
                           policy=narrow)
    assert binned(plan) and value_thresholds(Bounds(1.0, math.nextafter(1.0, 2.0))) == []
    main = pushdown(query, plan, order_seed=3).main
    assert main is not None and "dp_cls" not in main

    async def go() -> None:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            await conn.prepare(main)
        finally:
            await conn.close()

    asyncio.run(go())


def _close(a: Any, e: Any) -> bool:
    return math.isclose(float(a), float(e or 0), rel_tol=1e-9, abs_tol=1e-6)


def test_a_clip_bounds_each_users_mean_in_a_group(backend: Backend) -> None:
    """Computed apart on the demo data: with T = 8 and SUM(duration)'s clip 450 (its rows
    within [0, 3600]), the statement written for them sums, per browser, each user's sum
    there clamped to its values × 450 (its mean to 450: not each row to 450), times min(1,
    8 / its rows); AVG's count and centred sum likewise; VAR_POP's centred squares are each
    user's squared distances to 225 clamped to its values × 225². The binned statement's value bins
    (what the clip is chosen from) hold each (user, browser)'s values in the bin of their
    mean there, weighted by 1 / the user's rows, for the browsers the user's count goes to."""
    sql = "SELECT browser, SUM(duration), AVG(duration) FROM visits GROUP BY browser"
    query, plan, _ = build(sql, max_groups=2)
    clipped = clipped_aggregates(query, plan)
    assert clipped == {0, 1}
    q2, p2 = replan_with_bounds(query, plan, dict.fromkeys(clipped, Bounds(0, 450)), 8, 8, 8)
    assert q2.aggregates[0].row_bounds == Bounds(0, 3600)
    written = pushdown(q2, p2, order_seed=11).main
    binned_main = pushdown(query, plan, order_seed=11).main
    assert written is not None and binned_main is not None
    var_query, var_plan, _ = build("SELECT browser, VAR_POP(duration) FROM visits "
                                   "GROUP BY browser", max_groups=2)
    var_written = pushdown(*replan_with_bounds(var_query, var_plan, {0: Bounds(0, 450)}, 8, 8,
                                               8), order_seed=11).main
    assert var_written is not None
    per_user = ("WITH u AS (SELECT uid, browser, sum(duration) AS s, count(duration) AS n, "
                "count(*) AS r FROM visits WHERE uid IS NOT NULL GROUP BY 1, 2), "
                "t AS (SELECT uid, sum(r) AS total FROM u GROUP BY 1) ")
    thresholds = value_thresholds(Bounds(0, 3600))

    async def go() -> None:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            await conn.execute("SET hash_mem_multiplier = 8")
            expected = {r["browser"]: r for r in await conn.fetch(
                per_user + "SELECT browser, sum(least(coalesce(s, 0), n * 450.0) "
                "* least(1.0, 8.0 / total)) AS sum, sum(n * least(1.0, 8.0 / total)) AS n, "
                "sum((least(coalesce(s, 0), n * 450.0) - 225.0 * n) * least(1.0, 8.0 / total)) "
                "AS csum FROM u JOIN t USING (uid) GROUP BY browser")}
            got = {r["dp_t0"]: r for r in await conn.fetch(written)}
            assert set(got) == set(expected)
            for key, e in expected.items():
                assert _close(got[key]["dp_a0_sum"], e["sum"])
                assert _close(got[key]["dp_a1_n"], e["n"])
                assert _close(got[key]["dp_a1_csum"], e["csum"])
            # VAR_POP's centred squares: each user's squared distances to the clip's midpoint
            # 225 in the group, clamped to its values × 225²
            got_var = {r["dp_t0"]: r for r in await conn.fetch(var_written)}
            for r in await conn.fetch(
                    "WITH u AS (SELECT uid, browser, count(duration) AS n, count(*) AS r, "
                    "sum((duration - 225.0) * (duration - 225.0)) AS q FROM visits WHERE uid IS "
                    "NOT NULL GROUP BY 1, 2), t AS (SELECT uid, sum(r) AS total FROM u GROUP BY "
                    "1) SELECT browser, sum(least(coalesce(q, 0), n * 50625.0) * least(1.0, 8.0 "
                    "/ total)) AS csq FROM u JOIN t USING (uid) GROUP BY browser"):
                assert _close(got_var[r["browser"]]["dp_a0_csq"], r["csq"])
            # the row-clamped sum is less: the clip bounds means, not rows
            rows_clamped = await conn.fetchval(
                per_user + "SELECT sum(v.c * least(1.0, 8.0 / t.total)) FROM (SELECT uid, "
                "sum(least(duration, 450)) AS c FROM visits WHERE uid IS NOT NULL GROUP BY 1) "
                "AS v JOIN t USING (uid)")
            assert float(rows_clamped) < sum(float(e["sum"]) for e in expected.values())
            bins = np.zeros(len(thresholds) + 1)
            # (of each user's rows in the 2 groups its count goes to: its most rows, ties
            # broken by the keyed hash of the statement's order seed)
            for r in await conn.fetch(
                    per_user + "SELECT s, n, total FROM (SELECT *, row_number() OVER (PARTITION "
                    "BY uid ORDER BY r DESC, hashtextextended(coalesce(browser::text, ''), "
                    "hashtextextended(coalesce(uid::text, ''), 11) # (browser IS NULL)::int4::int8"
                    ")) AS rn FROM u) AS u JOIN t USING (uid) WHERE n > 0 AND rn <= 2"):
                mean = float(r["s"]) / float(r["n"])
                b = next((j for j, th in enumerate(thresholds) if mean >= th), len(thresholds))
                bins[b] += float(r["n"]) / float(r["total"])
            columns, _ = binned_plan(query, plan)
            stats = TuningStats(groups_threshold(plan))
            for r in await conn.fetch(binned_main):
                stats.add(binned_row(r, len(columns)), value_bin_columns(query, plan))
            (values,) = stats.values.values()
            assert np.allclose(values, bins, rtol=1e-9, atol=1e-6), (values, bins)
        finally:
            await conn.close()

    asyncio.run(go())


def _nodes(plan: dict[str, Any]) -> list[str]:
    return [plan["Node Type"], *(n for p in plan.get("Plans", []) for n in _nodes(p))]


def test_a_binned_statement_ranks_and_totals_users_in_one_window(backend: Backend) -> None:
    """The work of a row-level main statement beyond the per-user rows: one window over each
    user's groups gives both its rank and its total rows (two windows would be two passes),
    and no clip candidate is computed per (user, group) row: the rows are summed per value
    class, which the candidates' sums are made from (`binned.ValueClasses`). Postgres's plan
    has one WindowAgg, with no clamp in its output."""
    query, plan, _ = build("SELECT browser, count(*), sum(duration), avg(duration) "
                           "FROM visits GROUP BY browser", max_groups=2)
    main = pushdown(query, plan, order_seed=11).main
    assert main is not None

    async def go() -> None:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            await conn.execute("SET hash_mem_multiplier = 8")
            raw = await conn.fetchval(f"EXPLAIN (VERBOSE, FORMAT JSON) {main}")
            tree = json.loads(raw)[0]["Plan"]
            assert _nodes(tree).count("WindowAgg") == 1, _nodes(tree)
            window = _find(tree, "WindowAgg")
            clamps = [o for o in window["Output"] if "LEAST(GREATEST" in o]
            assert not clamps, window["Output"]
            assert len(value_thresholds(Bounds(0, 3600))) == 6  # (the candidates, by class)
            # (the rows are grouped by group, bin and value class: the vbin column)
            assert any("dp_a1_vbin" in k for k in _group_keys(tree)), _group_keys(tree)
        finally:
            await conn.close()

    asyncio.run(go())


def _group_keys(plan: dict[str, Any]) -> list[str]:
    return [*plan.get("Group Key", []), *(k for p in plan.get("Plans", []) for k in _group_keys(p))]


def _find(plan: dict[str, Any], node: str) -> dict[str, Any]:
    if plan["Node Type"] == node:
        return plan
    for p in plan.get("Plans", []):
        try:
            return _find(p, node)
        except LookupError:
            continue
    raise LookupError(node)
