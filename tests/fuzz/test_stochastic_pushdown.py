"""The stochastic DP tester end to end: the real pushdown SQL on neighbouring databases in Postgres.

`test_stochastic.py` feeds the release path per-user values aggregated the way the pushdown
would; here each database of the paper's tester (§5.3: Halton databases, neighbours by
removing one user) is written into Postgres, with each user's rows in several groups, an
optional purchase and a public lookup table, and the query's own pushdown statement runs on
it. The release (`dp_core.release`) then draws many answers from that statement's row; an
error of the pushdown, or a group that is not released, is one more outcome. Covers joins
(inner, left, right, full, a public table left joined), windows and per-user subqueries,
bounded row counts, distinct counts, Gaussian noise, C_u > 1 and both partition selections,
APPROX_BOUNDS (its bins' statement, then the main statement with the bounds each draw finds),
and the split paths: the statements of two uid ranges, plain and prefiltered, added up.
`DPPROXY_TEST_STOCHASTIC_LONG=1` (or `pytest --long`) runs more databases and samples.
"""

from __future__ import annotations

import math
import os
import secrets
from collections import Counter
from collections.abc import Iterator, Mapping
from fractions import Fraction
from typing import Any

import numpy as np
import psycopg
import pytest
from numpy.typing import NDArray
from psycopg.rows import dict_row

from dp_core.analysis import analyze, parse_select
from dp_core.binned import TuningStats, binned_plan, binned_row, resolve, value_bin_columns
from dp_core.classify import Classifier, ProtectionPolicy
from dp_core.mechanism_choices import SelectionKind
from dp_core.mechanisms import NoiseKind, secure_rng
from dp_core.plan import DPQueryPlan, make_plan, reads_user_count, replan_with_bounds
from dp_core.quantiles import NoBoundsFound, choose_bounds, walk
from dp_core.query import AnalyzedQuery, Bounds, KeyDomain, TablePolicy
from dp_core.release import (
    Selection,
    absent_groups,
    add_rows,
    noise_deferred,
    release,
    released_users,
    select,
    tree_arrays,
)
from dp_core.rewrite import binned, main_sql, pushdown, ranged_pushdown, tuning_statement
from dp_core.table_tuning import (
    Applied,
    applied,
    table_tuning,
    tuning_sql,
    with_tuning_epsilon,
)
from dp_core.tuning import groups_threshold, tune, tune_rows
from dp_core.uid_ranges import UidRange
from tests.support.backend import Backend
from tests.support.dp_tester import Mechanism, test_mechanism

LONG = bool(os.environ.get("DPPROXY_TEST_STOCHASTIC_LONG"))
DATABASES = 8 if LONG else 3
SAMPLES = 200_000 if LONG else 40_000
TOLERANCE = 0.01
EPSILON = 1.0
LOWER, UPPER = 0.0, 10.0
SCHEMA = "dp_tester"
ERROR = -1e12
"""The outcome of a pushdown that failed."""
NOT_RELEASED = -1e11
"""The outcome of a group that partition selection did not release."""

POLICY = {"visits": TablePolicy(SCHEMA, "uid", {}), "purchases": TablePolicy(SCHEMA, "uid", {})}
PUBLIC_POLICY = {**POLICY, "visits": TablePolicy(SCHEMA, "uid", {},
                                                  {"browser": KeyDomain(("a", "b", "q"))})}
"""With the browsers' public keys 'a', 'b' (which users have) and 'q' (which none has)."""
CLASSIFIER = Classifier(ProtectionPolicy({"visits": SCHEMA, "purchases": SCHEMA}))

DP = f"SELECT WITH ANONYMIZATION OPTIONS(epsilon={EPSILON}"
SHAPES = {
    "inner join": f"{DP}) ANON_SUM(v.duration, 0, 10) FROM visits v JOIN purchases p ON p.uid = v.uid",
    "left join": f"{DP}) ANON_SUM(p.amount, 0, 10) FROM visits v LEFT JOIN purchases p ON p.uid = v.uid",
    "right join": f"{DP}) ANON_AVG(v.duration, 0, 10) FROM purchases p RIGHT JOIN visits v ON p.uid = v.uid",
    "full join": f"{DP}) ANON_COUNT(DISTINCT uid) FROM visits v FULL JOIN purchases p USING (uid)",
    "public left join": f"{DP}) ANON_COUNT(*) FROM countries c LEFT JOIN visits v ON v.browser = c.code",
    "window by uid": f"{DP}) ANON_AVG(t, 0, 10) FROM (SELECT uid, sum(duration) OVER "
                     "(PARTITION BY uid) AS t FROM visits) s",
    "per-user subquery": f"{DP}) ANON_SUM(d, 0, 10) FROM (SELECT uid, max(duration) AS d FROM visits "
                         "GROUP BY uid) s",
    # joins as dp_core.join_fence rewrites them: outward from a protected table (LEFT), FULL
    # between subqueries or where a subquery is kept, the filters after the joins
    "three-item join, filters after it": f"{DP}) ANON_SUM(v.duration, 0, 10) FROM visits v "
                                         "JOIN purchases p ON p.uid = v.uid JOIN countries c "
                                         "ON c.code = v.browser WHERE v.duration > 2",
    "per-user subqueries joined (full join)": f"{DP}) ANON_SUM(s.d, 0, 10) FROM (SELECT uid, "
                                              "max(duration) AS d FROM visits GROUP BY uid) s "
                                              "JOIN (SELECT uid, sum(amount) AS a FROM purchases "
                                              "GROUP BY uid) q USING (uid) WHERE q.a > 1",
    "subquery kept by a left join": f"{DP}) ANON_COUNT(*) FROM (SELECT uid, max(duration) AS d "
                                    "FROM visits WHERE duration > 2 GROUP BY uid) s "
                                    "LEFT JOIN purchases p ON p.uid = s.uid",
    # a subquery of many rows per user joined row by row: each side reads at most 100 rows
    # of a user, a subquery's drawn at random (`ownership._capped`)
    "subquery joined row by row": f"{DP}) ANON_SUM(v.duration, 0, 10) FROM visits v JOIN "
                                  "(SELECT uid, amount FROM purchases WHERE amount >= 0) p "
                                  "ON p.uid = v.uid",
    "rows counted, U = 3": f"{DP}) ANON_COUNT(*, 3) FROM visits",
    "distinct values, k = 2": f"{DP}) ANON_COUNT(DISTINCT browser, 2) FROM visits",
    "gaussian": f"{DP}, delta=1e-5, noise='gaussian') ANON_SUM(duration, 0, 10) FROM visits",
    "variance, C_u 2": f"{DP}, max_groups_contributed=2) ANON_VAR(duration, 0, 10) FROM visits",
    "median, left join": f"{DP}) ANON_MEDIAN(p.amount, 0, 10) FROM visits v LEFT JOIN purchases p "
                         "ON p.uid = v.uid",
    "p90 of a per-user maximum": f"{DP}) ANON_NTILE(d, 0.9, 0, 10) FROM (SELECT uid, max(duration) "
                                 "AS d FROM visits GROUP BY uid) s",
    "grouped, tau, C_u 2": f"{DP}, delta=0.2, max_groups_contributed=2) browser, "
                           "ANON_SUM(duration, 0, 10) FROM visits GROUP BY browser",
    "grouped, truncated geometric": f"{DP}, delta=0.2, partition_selection='truncated_geometric') "
                                    "browser, ANON_SUM(duration, 0, 10) FROM visits GROUP BY browser",
    # row-level aggregates (Postgres's meaning): each user's rows weighted by min(1, T / rows),
    # T fixed, or chosen from the tuning statement's DP statistics for each draw
    "row-level count, T chosen": f"{DP}) COUNT(*) FROM visits",
    "row-level sum, T = 2": f"{DP}, max_rows_contributed=2) "
                            "SUM(CASE WHEN duration > 3 THEN 1 ELSE 0.5 END) FROM visits",
    "row-level sum, T and clip chosen": f"{DP}) "
                                        "SUM(CASE WHEN duration > 3 THEN 1 ELSE 0.5 END) FROM visits",
    "row-level avg, T chosen, bounds found": f"{DP}) AVG(duration) FROM visits",
    # with T and the clip, a count, sum and average split their ε by their predicted
    # relative noise (`tuning.share_weights`): the last column's share depends on the draw
    "row-level count and sum, T and clip chosen, shares rebalanced": f"{DP}) COUNT(*), "
        "SUM(CASE WHEN duration > 3 THEN 1 ELSE 0.5 END) FROM visits",
    "row-level count and avg, T and clip chosen, shares rebalanced": f"{DP}) COUNT(*), "
        "AVG(CASE WHEN duration > 3 THEN 1 ELSE 0.25 END) FROM visits",
    "grouped row-level count, T chosen": f"{DP}, delta=0.2, max_groups_contributed=2) browser, "
                                         "COUNT(*) FROM visits GROUP BY browser",
    # (the clip's value bins of each user's rows in the groups its count goes to; groups no
    # user counts in left in Postgres: `rewrite._candidates_only`)
    "grouped row-level sum, T and clip chosen": f"{DP}, delta=0.2, max_groups_contributed=2) "
                                                "browser, SUM(CASE WHEN duration > 3 THEN 1 "
                                                "ELSE 0.5 END) FROM visits GROUP BY browser",
    "row-level variance, T and clip chosen": f"{DP}) VAR_POP(CASE WHEN duration > 3 THEN 1 "
                                             "ELSE 0.25 END) FROM visits",
    # VAR's count, centred sum and squares are STDDEV's too (one noisy quantity each, a
    # larger share of ε): STDDEV released
    "row-level variance and stddev, T = 2, shared": f"{DP}, max_rows_contributed=2) "
                                                    "VAR_POP(CASE WHEN duration > 3 THEN 1 ELSE "
                                                    "0.25 END), STDDEV_POP(CASE WHEN duration > 3 "
                                                    "THEN 1 ELSE 0.25 END) FROM visits",
}
"""Global queries, and grouped ones with a large δ (so that groups of a few users are
sometimes released): the first group's value, or NOT_RELEASED."""
SHAPES["approx bounds"] = f"{DP}) ANON_SUM(duration) FROM visits"
SPLIT_SHAPES = {
    "grouped, split in two uid ranges": (SHAPES["grouped, tau, C_u 2"], False),
    "grouped, split and prefiltered": (f"{DP}, delta=0.2) browser, ANON_SUM(duration, 0, 10) "
                                       "FROM visits GROUP BY browser", True),
}
"""Run as the statements of two uid ranges (cut at a fixed uid, not at the data's), added up
(`release.add_rows`) as the proxy adds up a split run's; prefiltered: each user's groups
picked from its rows before they are aggregated."""
SPLIT_AT = "5000000"
"""The cut between the two ranges: the uids run from 1 to about 10,000,031 (a value times
1,000,003, plus 1), so that both ranges hold users."""


@pytest.fixture(scope="module")
def tester_db(backend: Backend) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    with psycopg.connect(backend.admin_dsn, autocommit=True, row_factory=dict_row) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        conn.execute(f"CREATE SCHEMA {SCHEMA}")
        conn.execute(f"CREATE TABLE {SCHEMA}.visits (uid bigint, browser text, duration float8)")
        conn.execute(f"CREATE TABLE {SCHEMA}.purchases (uid bigint, amount float8)")
        conn.execute(f"CREATE TABLE {SCHEMA}.countries (code text)")
        conn.execute(f"INSERT INTO {SCHEMA}.countries VALUES ('a'), ('b'), ('z')")
        conn.execute(f"SET search_path = {SCHEMA}")
        try:
            yield conn
        finally:
            conn.execute("RESET search_path")
            conn.execute(f"DROP SCHEMA {SCHEMA} CASCADE")


def _write(conn: psycopg.Connection[dict[str, Any]], values: list[float]) -> None:
    """One user per value: 1 to 3 visits in groups 'a', 'b', 'c' (the value, then its half and
    its complement), for some users a purchase of the value or a NULL browser. Everything of a
    user, its uid included, follows from its value alone, so that the neighbour (one value
    fewer) differs by that user's rows and nothing else."""
    conn.execute("TRUNCATE visits, purchases")
    visits, purchases = [], []
    for v in values:
        uid = int(v * 1_000_003) + 1  # (Halton values of one database are distinct)
        null_browser = int(v * 13) % 4 == 3
        for j, value in enumerate((v, v / 2, UPPER - v)[: 1 + int(v) % 3]):
            visits.append((uid, None if null_browser else "abc"[j], value))
        if int(v * 7) % 2 == 0:
            purchases.append((uid, v))
    with conn.cursor() as cur:
        if visits:
            cur.executemany("INSERT INTO visits VALUES (%s, %s, %s)", visits)
        if purchases:
            cur.executemany("INSERT INTO purchases VALUES (%s, %s)", purchases)


def mechanism(conn: psycopg.Connection[dict[str, Any]], sql: str, split: bool = False,
              prefiltered: bool = False,
              ranges: tuple[UidRange, ...] = ((None, SPLIT_AT), (SPLIT_AT, None)),
              policy: Mapping[str, TablePolicy] = POLICY,
              table_tuning_epsilon: float | None = None,
              released: Counter[bool] | None = None) -> Mechanism:
    (st,) = CLASSIFIER.classify(sql)
    assert st.dp_clause is not None
    options = dict(st.dp_clause.options)
    query = analyze(parse_select(st.stripped_sql), policy, plain_form=False)
    epsilon, delta = float(options["epsilon"]), float(options.get("delta", 1e-6))
    groups = int(options.get("max_groups_contributed", 1))
    noise = NoiseKind(options.get("noise", "laplace"))
    fixed_rows = options.get("max_rows_contributed")
    plan = make_plan(query, epsilon, delta, groups, noise,
                     selection=SelectionKind(options.get("partition_selection", "laplace")),
                     max_rows=None if fixed_rows is None else int(fixed_rows))
    statements = pushdown(query, plan).statements()
    assert list(statements) in (["main"], ["trees"], ["bounds", "main"], ["tuning", "main"],
                                ["tuning", "bounds", "main"]), statements

    def main_rows(q: AnalyzedQuery, pl: DPQueryPlan) -> list[dict[str, Any]]:
        """The main statement's rows: one statement, or the two ranges' added up (per-bin
        sums as the run reads them: `binned_row`)."""
        width = len(binned_plan(q, pl)[0]) if binned(pl) else None

        def read(sql: str) -> list[dict[str, Any]]:
            rows = conn.execute(sql).fetchall()
            return rows if width is None else [binned_row(r, width) for r in rows]

        if not split:
            main = main_sql(q, pl, secrets.randbits(62))
            assert main is not None
            return read(main)
        ranged = ranged_pushdown(q, pl, None, None, ("int8", "text") if prefiltered else None)
        parts = [read(ranged.of(r).statements()["main"]) for r in ranges]
        keys = range(len(q.keys))
        return add_rows(parts, [f"dp_t{i}" for i in keys], [f"dp_k{i}" for i in keys])

    def outcomes(q: AnalyzedQuery, pl: DPQueryPlan, rows: list[dict[str, Any]],
                 samples: int) -> NDArray[np.float64]:
        if not q.keys:
            (row,) = rows
            out = release(q, pl, [row] * samples, secure_rng())
            return np.array([float(r[-1]) if r[-1] is not None else ERROR for r in out.rows])
        # grouped: the group 'a', released or not, `samples` times (each copy its own group)
        first = [r for r in rows if r["dp_t0"] == "a"]
        if not first and q.public_groups:  # released all the same, from zeros
            first = absent_groups(q, pl, [("a",)], set(), None)
        if not first:
            return np.full(samples, NOT_RELEASED)
        copies = [{**first[0], "dp_k0": f"a{i}", "dp_t0": f"a{i}"} for i in range(samples)]
        out = release(q, pl, copies, secure_rng())
        outcome = np.full(samples, NOT_RELEASED)
        for r in out.rows:
            outcome[int(str(r[0])[1:])] = float(r[-1])
        return outcome

    def with_found_bounds(samples: int) -> NDArray[np.float64]:
        """APPROX_BOUNDS and max_rows_contributed: each draw's bounds from the bins (no bin
        passing is an error) and T from the tuning statement's statistics, then the main
        statement with those, run once per distinct choice drawn."""
        bins: dict[int, dict[int, int]] = {i: {} for i in plan.auto_bounds}
        if "bounds" in statements:
            for r in conn.execute(statements["bounds"]).fetchall():
                bins[int(r["dp_agg"])][int(r["dp_bin"])] = int(r["dp_n"])
        tuned_here = "tuning" in statements
        tuning = conn.execute(statements["tuning"]).fetchall() if tuned_here else []
        rng = secure_rng()
        drawn = Counter[tuple[tuple[int, int, int] | None, tuple[tuple[int, float, float], ...],
                              tuple[tuple[int, float, float], ...],
                              tuple[tuple[str, Fraction], ...]]]()
        failed = 0
        for _ in range(samples):
            try:
                # (over no users the statement has no rows: T is then chosen from noise)
                tuned = tune_rows(plan, tuning, rng, query) if tuned_here else None
                rows = None if tuned is None else (tuned.max_rows, tuned.mean_rows,
                                                   tuned.sum_rows)
                clips = () if tuned is None else tuple(
                    (i, b.lower, b.upper) for i, b in sorted(tuned.clips.items()))
                weights = () if tuned is None else tuple(sorted(tuned.weights.items()))
                drawn[rows, tuple((q.aggregate, f.lower, f.upper) for q in plan.approx_bounds
                                  if q.aggregate is not None
                                  for f in [choose_bounds(bins[q.aggregate], q.spec, rng,
                                                          "x")]), clips, weights] += 1
            except NoBoundsFound:
                failed += 1
        parts = [np.full(failed, ERROR)]
        for (rows, found, clips, weights), n in drawn.items():
            q, pl = replan_with_bounds(query, plan, {i: Bounds(lo, hi)
                                                     for i, lo, hi in (*found, *clips)},
                                       *(rows or (None, None, None)), dict(weights))
            parts.append(outcomes(q, pl, main_rows(q, pl), n))
        return np.concatenate(parts)

    def with_binned(samples: int) -> NDArray[np.float64]:
        """T chosen from the main statement's own rows (`dp_core.binned`): per APPROX_BOUNDS
        draw, the main statement once; per sample, T and the clips drawn from its statistics
        and its rows resolved for them, as `PushdownRunner.run` does."""
        rng = secure_rng()
        bins: dict[int, dict[int, int]] = {i: {} for i in plan.auto_bounds}
        if "bounds" in statements:
            for r in conn.execute(statements["bounds"]).fetchall():
                bins[int(r["dp_agg"])][int(r["dp_bin"])] = int(r["dp_n"])
        found_drawn = Counter[tuple[tuple[int, float, float], ...]]()
        failed = 0
        for _ in range(samples):
            try:
                found_drawn[tuple((q.aggregate, f.lower, f.upper) for q in plan.approx_bounds
                                  if q.aggregate is not None
                                  for f in [choose_bounds(bins[q.aggregate], q.spec, rng,
                                                          "x")])] += 1
            except NoBoundsFound:
                failed += 1
        parts = [np.full(failed, ERROR)]
        for found, n in found_drawn.items():
            q1, pl1 = replan_with_bounds(query, plan, {i: Bounds(lo, hi) for i, lo, hi in found})
            rows = main_rows(q1, pl1)
            _, terms = binned_plan(q1, pl1)
            stats = TuningStats(groups_threshold(pl1))
            value_bins = value_bin_columns(q1, pl1)
            for r in rows:
                stats.add(r, value_bins)
            values = {i: dict(enumerate(v)) for i, v in stats.values.items()}
            drawn = Counter[tuple[int, int, int, tuple[tuple[int, float, float], ...],
                                  bool | None, tuple[tuple[str, Fraction], ...]]]()
            selected = bool(q1.keys) and pl1.tau is not None and not q1.public_groups
            for _ in range(n):
                # τ-thresholding first, over every group, as the run's stream does: T is then
                # weighed over the released groups' noisy user counts; the group's own
                # selection is kept with the choice it led to
                kept: bool | None = None
                released = None
                if selected:
                    chosen_groups = select(q1, pl1, rows, rng, deferred=True)
                    released = released_users(pl1, chosen_groups)
                    kept = any(chosen_groups.rows[k]["dp_t0"] == "a" for k in chosen_groups.kept)
                tuned = tune(pl1, stats.rows(), stats.groups, values, rng, q1,
                             released_users=released)
                drawn[tuned.max_rows, tuned.mean_rows, tuned.sum_rows, tuple(
                    (i, b.lower, b.upper) for i, b in sorted(tuned.clips.items())), kept,
                    tuple(sorted(tuned.weights.items()))] += 1
            for (t, mean_t, sum_t, clips, kept, weights), m in drawn.items():
                chosen = {i: Bounds(lo, hi) for i, lo, hi in clips}
                q2, pl2 = replan_with_bounds(q1, pl1, chosen, t, mean_t, sum_t, dict(weights))
                resolved = [dict(r) for r in rows]
                resolve(resolved, q1, pl2, terms, chosen)
                if kept is None:
                    parts.append(outcomes(q2, pl2, resolved, m))
                elif not kept:
                    parts.append(np.full(m, NOT_RELEASED))
                else:
                    parts.append(kept_outcomes(q2, pl2, resolved, m))
        return np.concatenate(parts)

    def kept_outcomes(q: AnalyzedQuery, pl: DPQueryPlan, rows: list[dict[str, Any]],
                      samples: int) -> NDArray[np.float64]:
        """The group 'a', selected already, `samples` times: its row-level quantities' noise
        for the plan its selection led to (`noise_deferred`)."""
        if any(reads_user_count(a) for a in q.aggregates):
            raise AssertionError("a released user count is drawn with the selection")
        (first,) = [r for r in rows if r["dp_t0"] == "a"]
        copies = [{**first, "dp_k0": f"a{i}", "dp_t0": f"a{i}"} for i in range(samples)]
        rng = secure_rng()
        chosen = noise_deferred(Selection(copies, {}, list(range(samples))), pl, rng)
        return np.array([float(r[-1]) for r in release(q, pl, copies, rng,
                                                      selection=chosen).rows])

    def tunings_drawn(samples: int, rng: np.random.Generator) -> Iterator[Applied]:
        """An admin's tuning of visits (`dp_core.table_tuning`: its statement on this
        database once, its choice drawn per sample), as the query at hand applies it."""
        assert table_tuning_epsilon is not None
        tq = analyze(parse_select(tuning_sql(SCHEMA, "visits", ["duration"])), policy,
                     plain_form=True)
        tplan = with_tuning_epsilon(make_plan(tq, epsilon, delta, groups, noise),
                                    Fraction(repr(table_tuning_epsilon)))
        stats = conn.execute(tuning_statement(tq, tplan, {1: "float8", 2: "float8"},
                                              secrets.randbits(62))).fetchall()
        for _ in range(samples):
            tuned = tune_rows(tplan, stats, rng, tq, known_groups=1)
            stored = table_tuning(f"{SCHEMA}.visits", "t", Fraction(1), tq, policy["visits"],
                                  tuned, 1)
            used = applied(query, policy, {stored.table: stored})
            assert used is not None
            yield used

    def with_table_tuning(samples: int) -> NDArray[np.float64]:
        """An admin's tuning of visits (`tunings_drawn`), then the query with the bounds each
        draw stored, planned with them fixed, as the proxy plans it (T weighed over the
        public groups, where it has them), run once per choice."""
        rng = secure_rng()
        drawn = Counter[tuple[int, int, int, tuple[tuple[int, float, float], ...],
                              tuple[tuple[str, Fraction], ...]]]()
        public = (math.prod(len(k.domain.keys or ()) for k in query.keys if k.domain)
                  if query.public_groups else None)
        for used in tunings_drawn(samples, rng):
            t = used.chosen(make_plan(used.query, epsilon, delta, groups, noise,
                                      max_rows=1), public=public).tuned
            drawn[t.max_rows, t.mean_rows, t.sum_rows or t.max_rows,
                  tuple((i, b.lower, b.upper) for i, b in sorted(t.clips.items())),
                  tuple(sorted(t.weights.items()))] += 1
        parts = []
        read: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for (t_rows, t_means, t_sums, clips, weights), n in drawn.items():
            q = query.with_bounds({i: Bounds(lo, hi) for i, lo, hi in clips})
            pl = make_plan(q, epsilon, delta, groups, noise, max_rows=t_rows,
                           mean_rows=t_means, sum_rows=t_sums, weights=dict(weights))
            # (the statement does not depend on the shares' weights, and a T of 3 rows or more
            # weighs none of `_write`'s users down: run once per T up to 3 and clip)
            key = (min(t_rows, 3), min(t_means, 3), min(t_sums, 3), clips)
            if key not in read:
                read[key] = main_rows(q, pl)
            parts.append(outcomes(q, pl, read[key], n))
        return np.concatenate(parts)

    def with_table_tuning_grouped(samples: int) -> NDArray[np.float64]:
        """An admin's tuning of visits, then a grouped query of it, whose T and clips the run
        chooses from the stored statistics once τ-thresholding has selected the groups
        (`DPQueryPlan.rows_stored`, as `Preparer._after_selection` plans it): per sample, the
        tuning drawn, the groups selected over the binned main statement's rows, T and the
        clips chosen for the released groups' noisy user counts, the rows resolved for them
        and the group 'a' noised for the plan that led to (or not released)."""
        rng = secure_rng()
        read: dict[frozenset[int], tuple[DPQueryPlan, list[dict[str, Any]], Any]] = {}
        drawn = Counter[tuple[frozenset[int], int, int, int,
                              tuple[tuple[int, float, float], ...], bool,
                              tuple[tuple[str, Fraction], ...]]]()
        for used in tunings_drawn(samples, rng):
            assert used.clips_rechosen
            columns = frozenset(used.columns)
            if columns not in read:
                pl = make_plan(used.base, epsilon, delta, groups, noise, stored=columns)
                assert binned(pl) and pl.tau is not None
                read[columns] = (pl, main_rows(used.base, pl), binned_plan(used.base, pl)[1])
            pl, rows, _ = read[columns]
            chosen_groups = select(used.base, pl, rows, rng, deferred=True)
            kept = any(chosen_groups.rows[k]["dp_t0"] == "a" for k in chosen_groups.kept)
            if released is not None:
                released[kept] += 1
            t = used.chosen(pl, released_users(pl, chosen_groups)).tuned
            drawn[columns, t.max_rows, t.mean_rows, t.sum_rows or t.max_rows,
                  tuple((i, b.lower, b.upper) for i, b in sorted(t.clips.items())), kept,
                  tuple(sorted(t.weights.items()))] += 1
        parts = []
        for (columns, t_rows, t_means, t_sums, clips, kept, weights), n in drawn.items():
            if not kept:
                parts.append(np.full(n, NOT_RELEASED))
                continue
            pl, rows, terms = read[columns]
            chosen = {i: Bounds(lo, hi) for i, lo, hi in clips}
            q2, pl2 = replan_with_bounds(query, pl, chosen, t_rows, t_means, t_sums,
                                         dict(weights))
            resolved = [dict(r) for r in rows]
            resolve(resolved, query, pl2, terms, chosen)
            parts.append(kept_outcomes(q2, pl2, resolved, n))
        return np.concatenate(parts)

    def run(values: list[float], samples: int) -> NDArray[np.float64]:  # type: ignore[override]
        _write(conn, values)
        try:
            if table_tuning_epsilon is not None and query.keys and not query.public_groups:
                return with_table_tuning_grouped(samples)
            if table_tuning_epsilon is not None:
                return with_table_tuning(samples)
            if binned(plan):
                return with_binned(samples)
            if "bounds" in statements or "tuning" in statements:
                return with_found_bounds(samples)
            if "trees" in statements:  # a global quantile: its tree (none without users), walked
                rows = conn.execute(statements["trees"]).fetchall()
                (tree,) = plan.trees
                codes, counts = tree_arrays(rows[0]) if rows else (np.zeros(0, np.int64),
                                                                    np.zeros(0, np.int64))
                agg = query.aggregates[tree.aggregate]
                bounds = agg.known_bounds
                return walk(codes, counts, float(agg.quantile or 0.0), bounds.lower,
                            bounds.upper, tree.spec, secure_rng(), runs=samples)
            return outcomes(query, plan, main_rows(query, plan), samples)
        except psycopg.Error:
            return np.full(samples, ERROR)

    return run  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(SPLIT_SHAPES))
def test_split_pushdowns_are_differentially_private(
        tester_db: psycopg.Connection[dict[str, Any]], name: str) -> None:
    sql, prefiltered = SPLIT_SHAPES[name]
    verdict = test_mechanism(mechanism(tester_db, sql, split=True, prefiltered=prefiltered),
                             EPSILON, 0.2, databases=DATABASES, max_users=4, lower=LOWER,
                             upper=UPPER, samples=SAMPLES, depth=1)
    assert verdict.bins_checked > 0
    assert verdict.failure_rate <= TOLERANCE, verdict


LONG_ONLY = ("grouped row-level count, T chosen", "grouped row-level sum, T and clip chosen",
             "row-level avg, T chosen, bounds found",
             "row-level variance, T and clip chosen", "row-level sum, T and clip chosen",
             "row-level count and avg, T and clip chosen, shares rebalanced")
"""Shapes whose T is drawn for every sample (a choice each, and a pushdown per choice): in the
long mode only; the short mode runs the other such shapes (the count and sum with rebalanced
shares covers the sum's clip). All shapes whose T is chosen
run a quarter of the samples (one `tune_rows` per sample is most of their time)."""


@pytest.mark.parametrize("name", list(SHAPES))
def test_real_pushdowns_are_differentially_private(
        tester_db: psycopg.Connection[dict[str, Any]], name: str) -> None:
    if name in LONG_ONLY and not LONG:
        pytest.skip("DPPROXY_TEST_STOCHASTIC_LONG=1 runs it")
    tuned = "chosen" in name
    verdict = test_mechanism(mechanism(tester_db, SHAPES[name]), EPSILON,
                             0.2 if "grouped" in name else 1e-5, databases=DATABASES,
                             max_users=4, lower=LOWER, upper=UPPER,
                             samples=SAMPLES // 4 if tuned else SAMPLES, depth=1)
    assert verdict.bins_checked > 0
    assert verdict.failure_rate <= TOLERANCE, verdict


TUNED_POLICY = {**POLICY, "visits": TablePolicy(SCHEMA, "uid", {"duration": Bounds(LOWER, UPPER)})}
TUNED_PUBLIC_POLICY = {**POLICY, "visits": TablePolicy(
    SCHEMA, "uid", {"duration": Bounds(LOWER, UPPER)}, {"browser": KeyDomain(("a", "b", "q"))})}
TUNING_EPSILON = 0.5
TUNED_SHAPES = {
    "table tuned, row-level sum and avg": f"{DP}) SUM(duration), AVG(duration) FROM visits",
    "table tuned, row-level count": f"{DP}) COUNT(*) FROM visits WHERE duration > 1",
    "table tuned, grouped row-level sum and avg, T after selection":
        f"{DP}, delta=0.2) browser, SUM(duration), AVG(duration) FROM visits GROUP BY browser",
    "table tuned, public groups, row-level sum":
        f"{DP}) browser, SUM(duration) FROM visits GROUP BY browser",
}
"""Queries over visits after an admin tuned it (`dp_core.table_tuning`, ε TUNING_EPSILON):
together, the tuning and the answer are (ε + TUNING_EPSILON)-DP. (The public groups' T is
chosen when the query is planned, weighed over its 3 public groups.)"""


@pytest.mark.parametrize("name", list(TUNED_SHAPES))
def test_table_tuning_and_its_answers_are_differentially_private(
        tester_db: psycopg.Connection[dict[str, Any]], name: str) -> None:
    if "count" in name and not LONG:  # (minutes each: the tuning and T drawn every sample)
        pytest.skip("DPPROXY_TEST_STOCHASTIC_LONG=1 runs it")
    released = Counter[bool]()
    policy = TUNED_PUBLIC_POLICY if "public" in name else TUNED_POLICY
    verdict = test_mechanism(mechanism(tester_db, TUNED_SHAPES[name], policy=policy,
                                       table_tuning_epsilon=TUNING_EPSILON, released=released),
                             EPSILON + TUNING_EPSILON, 0.2 if "grouped" in name else 1e-5,
                             databases=DATABASES, max_users=4,
                             lower=LOWER, upper=UPPER,
                             samples=SAMPLES // 4 if LONG else SAMPLES // 16, depth=1)
    assert verdict.bins_checked > 0
    assert verdict.failure_rate <= TOLERANCE, verdict
    if "grouped" in name:  # (T, the clips and their noise tested, not only the selection)
        assert released[True] >= 0.05 * sum(released.values()), released


PUBLIC_SHAPES = {
    "public groups, C_u 2": f"{DP}, max_groups_contributed=2) browser, ANON_SUM(duration, 0, 10) "
                            "FROM visits GROUP BY browser",
    "public groups, row-level count, T = 2": f"{DP}, max_rows_contributed=2) browser, COUNT(*) "
                                             "FROM visits GROUP BY browser",
}
"""Grouped by a column with public keys: group 'a' is released whether users have it or not."""


@pytest.mark.parametrize("name", list(PUBLIC_SHAPES))
def test_public_groups_are_differentially_private(
        tester_db: psycopg.Connection[dict[str, Any]], name: str) -> None:
    verdict = test_mechanism(mechanism(tester_db, PUBLIC_SHAPES[name], policy=PUBLIC_POLICY),
                             EPSILON, 1e-5, databases=DATABASES, max_users=4, lower=LOWER,
                             upper=UPPER, samples=SAMPLES, depth=1)
    assert verdict.bins_checked > 0
    assert verdict.failure_rate <= TOLERANCE, verdict


def test_a_pushdown_without_its_contribution_bound_is_caught(
        tester_db: psycopg.Connection[dict[str, Any]]) -> None:
    """The tester's power on the real path: the bounded row count's pushdown with its per-user
    clamp (at most U = 3 rows) replaced by ten times the user's rows fails."""
    (st,) = CLASSIFIER.classify(SHAPES["rows counted, U = 3"])
    query = analyze(parse_select(st.stripped_sql), POLICY, plain_form=False)
    plan = make_plan(query, EPSILON, 1e-6, 1, NoiseKind.LAPLACE)
    sound = pushdown(query, plan).statements()["main"]
    broken = sound.replace("LEAST(dp_p0, CAST(3.0 AS numeric))", "dp_p0 * 10")
    assert broken != sound

    def run(values: list[float], samples: int) -> NDArray[np.float64]:
        _write(tester_db, values)
        row = tester_db.execute(broken).fetchone()
        assert row is not None
        return np.array([float(r[-1]) for r in release(query, plan, [row] * samples,
                                                        secure_rng()).rows])

    verdict = test_mechanism(run, EPSILON, 1e-5, databases=DATABASES, max_users=4,
                             lower=LOWER, upper=UPPER, samples=SAMPLES, depth=1)
    assert verdict.failure_rate > TOLERANCE, verdict


def test_a_split_whose_ranges_overlap_is_caught(
        tester_db: psycopg.Connection[dict[str, Any]]) -> None:
    """The tester's power on the split path: the bounded row count split into ranges of
    which four read the users below the cut (each of them added four times) fails."""
    below = (None, SPLIT_AT)
    broken = mechanism(tester_db, SHAPES["rows counted, U = 3"], split=True,
                       ranges=(below, below, below, below, (SPLIT_AT, None)))
    verdict = test_mechanism(broken, EPSILON, 1e-5, databases=DATABASES, max_users=4,
                             lower=LOWER, upper=UPPER, samples=SAMPLES, depth=1)
    assert verdict.failure_rate > TOLERANCE, verdict
