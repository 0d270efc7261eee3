"""The stochastic DP tester end to end: the real pushdown SQL on neighbouring databases in Postgres.

`test_stochastic.py` feeds the release path per-user values aggregated the way the pushdown
would; here each database of the paper's tester (§5.3: Halton databases, neighbours by
removing one user) is written into Postgres, with each user's rows in several groups, an
optional purchase and a public lookup table, and the query's own pushdown statement runs on
it. The release (`dp_core.release`) then draws many answers from that statement's row; an
error of the pushdown, or a group that is not released, is one more outcome. Covers joins
(inner, left, right, full, a public table left joined), windows and per-user subqueries,
bounded row counts, distinct counts, Gaussian noise, C_u > 1 and both partition selections.
`DPPROXY_TEST_STOCHASTIC_LONG=1` (or `pytest --long`) runs more databases and samples.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import psycopg
import pytest
from numpy.typing import NDArray
from psycopg.rows import dict_row

from dp_core.analysis import analyze, parse_select
from dp_core.classify import Classifier, ProtectionPolicy
from dp_core.kinds import SelectionKind
from dp_core.mechanisms import NoiseKind, secure_rng
from dp_core.plan import make_plan
from dp_core.quantiles import walk
from dp_core.query import TablePolicy
from dp_core.release import release, tree_arrays
from dp_core.rewrite import pushdown

from .conftest import Backend
from .dp_tester import Mechanism, test_mechanism

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
}
"""Global queries, and grouped ones with a large δ (so that groups of a few users are
sometimes released): the first group's value, or NOT_RELEASED."""


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


def mechanism(conn: psycopg.Connection[dict[str, Any]], sql: str) -> Mechanism:
    (st,) = CLASSIFIER.classify(sql)
    assert st.dp_clause is not None
    options = dict(st.dp_clause.options)
    query = analyze(parse_select(st.stripped_sql), POLICY, plain_form=False)
    plan = make_plan(query, float(options["epsilon"]), float(options.get("delta", 1e-6)),
                     int(options.get("max_groups_contributed", 1)),
                     NoiseKind(options.get("noise", "laplace")),
                     selection=SelectionKind(options.get("partition_selection", "laplace")))
    statements = pushdown(query, plan).statements()
    assert list(statements) in (["main"], ["trees"]), statements

    def run(values: list[float], samples: int) -> NDArray[np.float64]:  # type: ignore[override]
        _write(conn, values)
        try:
            rows = conn.execute(next(iter(statements.values()))).fetchall()
        except psycopg.Error:
            return np.full(samples, ERROR)
        if "trees" in statements:  # a global quantile: its tree (none without users), walked
            (tree,) = plan.trees
            codes, counts = tree_arrays(rows[0]) if rows else (np.zeros(0, np.int64),
                                                                np.zeros(0, np.int64))
            agg = query.aggregates[tree.aggregate]
            bounds = agg.known_bounds
            return walk(codes, counts, float(agg.quantile or 0.0), bounds.lower, bounds.upper,
                        tree.spec, secure_rng(), runs=samples)
        if not query.keys:
            (row,) = rows
            out = release(query, plan, [row] * samples, secure_rng())
            return np.array([float(r[-1]) if r[-1] is not None else ERROR for r in out.rows])
        # grouped: the group 'a', released or not, `samples` times (each copy its own group)
        first = [r for r in rows if r["dp_t0"] == "a"]
        if not first:
            return np.full(samples, NOT_RELEASED)
        copies = [{**first[0], "dp_k0": f"a{i}", "dp_t0": f"a{i}"} for i in range(samples)]
        out = release(query, plan, copies, secure_rng())
        outcome = np.full(samples, NOT_RELEASED)
        for r in out.rows:
            outcome[int(str(r[0])[1:])] = float(r[-1])
        return outcome

    return run  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(SHAPES))
def test_real_pushdowns_are_differentially_private(
        tester_db: psycopg.Connection[dict[str, Any]], name: str) -> None:
    verdict = test_mechanism(mechanism(tester_db, SHAPES[name]), EPSILON,
                             0.2 if "grouped" in name else 1e-5, databases=DATABASES,
                             max_users=4, lower=LOWER, upper=UPPER, samples=SAMPLES, depth=1)
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
