"""Live SQL fuzzing of the DP path: random queries built from the constructs analysts write.

Each query is answered or refused with a SQLSTATE that says why; never an internal
error, a dropped connection, or a charged failure (on the demo data nothing times
out, so a pushdown that fails after its charge is an expression the rewriter
should have made total or refused). Refusals and EXPLAIN spend nothing; answers
spend exactly their stated cost. Seeded (DPPROXY_TEST_FUZZ_SEED replays a failure;
DPPROXY_TEST_FUZZ_ROUNDS runs longer).
"""

from __future__ import annotations

import itertools
import os
import random
import re
from collections.abc import Iterator

import psycopg
import pytest

from config import Config
from tests.support.backend import ON_CITUS, Backend
from tests.support.proxy import LoopThread, Proxy, budgets_reset, running_proxy, spent

SEED = int(os.environ.get("DPPROXY_TEST_FUZZ_SEED", random.randrange(1 << 30)))
ROUNDS = int(os.environ.get("DPPROXY_TEST_FUZZ_ROUNDS", "120"))

# what a refusal may say: rules (0A000), protected reads (42501), syntax (42601), bad
# options or bounds (22023), and Postgres's own errors on the analyst's SQL while the
# pushdown is planned (42xxx: unknown column or function, type mismatch, grouping)
_REFUSALS = {"0A000", "42501", "53400", "42601", "22023", "42703", "42883", "42804", "42803", "42P01",
             "42725", "42P18", "22P02", "42846", "42P10", "42702"}

_SOURCES = {
    "visits": ("visits", ["browser", "country", "duration"], "uid"),
    "visits v": ("visits v", ["v.browser", "v.country", "v.duration"], "v.uid"),
    "purchases": ("purchases", ["category", "amount"], "uid"),
    "join": ("visits v JOIN purchases p USING (uid)", ["v.browser", "p.category", "v.duration",
                                                       "p.amount"], "uid"),
    "join on": ("visits v JOIN purchases p ON p.uid = v.uid", ["v.country", "p.category",
                                                               "p.amount", "v.duration"], "v.uid"),
    "lookup": ("visits v JOIN countries c ON c.code = v.country", ["c.region", "v.browser",
                                                                   "v.duration"], "v.uid"),
    "subquery": ("(SELECT uid, browser, duration FROM visits WHERE duration > 5) s",
                 ["s.browser", "s.duration"], "s.uid"),
    "per-user": ("(SELECT uid, browser, sum(duration) AS d FROM visits GROUP BY uid, browser) s",
                 ["s.browser", "s.d"], "s.uid"),
    "cte": ("t", ["t.category", "t.amount"], "t.uid"),
    "window": ("(SELECT uid, browser, duration, row_number() OVER (PARTITION BY uid ORDER BY "
               "duration) AS r FROM visits) w", ["w.browser", "w.duration", "w.r"], "w.uid"),
    "distinct": ("(SELECT DISTINCT uid, browser FROM visits) d", ["d.browser"], "d.uid"),
    "union": ("(SELECT uid, amount AS x FROM purchases UNION ALL SELECT uid, duration FROM visits) u",
              ["u.x"], "u.uid"),
    "limited": ("(SELECT uid, duration FROM visits LIMIT 100) l", ["l.duration"], "l.uid"),
    "unprotected": ("countries", ["region", "name"], "code"),
    "left join": ("visits v LEFT JOIN purchases p ON p.uid = v.uid", ["v.browser", "p.amount"],
                  "v.uid"),
    "cross": ("visits v, purchases p", ["v.browser", "p.amount"], "v.uid"),
    "quoted": ('public."visits" AS "V"', ['"V".browser', '"V".duration'], '"V".uid'),
    "nested": ("(SELECT uid, b, sum(x) AS x FROM (SELECT uid, browser AS b, duration AS x FROM "
               "visits) i GROUP BY uid, b) o", ["o.b", "o.x"], "o.uid"),
    # (a self join squares each user's rows: kept to a few hundred users)
    "self join": ("(SELECT * FROM visits WHERE uid < 300) a JOIN (SELECT * FROM visits WHERE "
                  "uid < 300) b ON a.uid = b.uid", ["a.browser", "b.country", "a.duration"],
                  "a.uid"),
    "bad join": ("visits a JOIN visits b ON a.uid < b.uid", ["a.browser", "a.duration"], "a.uid"),
}
_CTE = "WITH t AS (SELECT uid, category, amount FROM purchases WHERE amount > 1) "


def _number(rng: random.Random, cols: list[str]) -> str:
    """A numeric expression over the source's columns (some of them partial or invalid)."""
    nums = [c for c in cols if c.split(".")[-1] in ("duration", "amount", "d")] or ["1"]
    x = rng.choice(nums)
    forms = [x, f"{x} * 2", f"{x} + 1", f"{x} / 60", f"{x} / NULLIF({x}, 0)", f"abs({x} - 300)",
             f"coalesce({x}, 0)", f"CAST({x} AS numeric)", f"CAST({x} AS bigint)", f"sqrt({x})",
             f"ln({x})", f"{x} % 7", f"CASE WHEN {x} > 100 THEN 1 ELSE 0 END", f"greatest({x}, 1)",
             f"power({x}, 2)", f"{x}::float8", f"1 / ({x} - 42)", f"round({x})", f"{x} - {x}",
             f"exp({x})", f"{x} * {x} * {x} * {x}", "1", f"CAST({x} AS int)"]
    return rng.choice(forms)


def _aggregate(rng: random.Random, cols: list[str], plain: bool, uid: str) -> str:
    x = _number(rng, cols)
    lo, hi = rng.choice([(0, 10), (0, 3600), (-5, 5), (1, 1000), (10, 0)])
    bounds = rng.choice([f", {lo}, {hi}", f", {lo}, {hi}", ""])
    if plain:
        return rng.choice(["COUNT(*)", f"SUM({x})", f"AVG({x})", "count(*)",
                           f"COUNT(DISTINCT {uid})", f"MIN({x})", f"stddev({x})",
                           f"COUNT({rng.choice(cols)})", f"sum({x}) FILTER (WHERE {x} > 1)",
                           f"COUNT(DISTINCT {rng.choice(cols)})"])
    return rng.choice([
        "ANON_COUNT(*)", f"ANON_COUNT(*, {rng.choice([1, 3, 0])})", f"ANON_COUNT(DISTINCT {uid})",
        f"ANON_SUM({x}{bounds})", f"ANON_AVG({x}{bounds})", f"ANON_VAR({x}{bounds})",
        f"ANON_STDDEV({x}{bounds})", f"ANON_MEDIAN({x}{bounds})",
        f"ANON_NTILE({x}, {rng.choice([0.1, 0.9, 1.5])}{bounds})", f"ANON_MIN({x}{bounds})",
        f"ANON_MAX({x}{bounds})", f"ANON_COUNT({rng.choice(cols)})",
        f"ANON_SUM({x}{bounds}) FILTER (WHERE {x} > 1)", f"ANON_SUM(DISTINCT {x}{bounds})",
        f"ANON_COUNT(DISTINCT {x}, {rng.choice([1, 2, 0, 101])})"])


def _condition(rng: random.Random, cols: list[str], uid: str) -> str:
    c = rng.choice(cols)
    x = _number(rng, cols)
    return rng.choice([
        f"{x} > 10", f"{c} IS NOT NULL", f"{x} BETWEEN 1 AND 100", f"1 / ({uid} - 42) > 0",
        f"{uid} < 500", f"{c}::text LIKE 'C%'", f"{x} IN (1, 2, 3)", "random() < 0.5",
        f"{uid} IN (SELECT uid FROM purchases)", f"length({c}::text) > 2", f"{x} / 0 > 1",
        f"CAST({c} AS text) = 'x'", f"{c}::text ~ '^[A-Z]'", "now() > '2020-01-01'",
        f"NOT ({x} < 5) OR {c} IS NULL", f"{c} = ANY (ARRAY['US', 'DE'])",
        "EXISTS (SELECT 1 FROM countries WHERE code = 'US')"])


def _query(rng: random.Random) -> tuple[str, bool]:
    """A query, and whether it reads protected tables (else it is passed through, unspent)."""
    name = rng.choice(list(_SOURCES))
    source, cols, uid = _SOURCES[name]
    plain = rng.random() < 0.2
    keys = rng.sample(cols, min(len(cols), rng.choice([0, 1, 1, 2])))
    keys = [rng.choice([k, f"upper({k}::text)", f"{k}::text", f"{k} IS NULL",
                        f"CASE WHEN {k} IS NULL THEN 'none' ELSE 'some' END"])
            if rng.random() < 0.3 else k for k in keys]
    aggs = [_aggregate(rng, cols, plain, uid) for _ in range(rng.choice([1, 1, 2, 3]))]
    head = "SELECT "
    if not plain:
        head = rng.choice(["SELECT WITH ANONYMIZATION ", "SELECT WITH DIFFERENTIAL_PRIVACY "])
        if rng.random() < 0.5:
            opts = rng.sample([f"epsilon={rng.choice([0.01, 0.1, 0.5, 0, -1])}",
                               f"delta={rng.choice([1e-6, 1e-9, 0.5])}",
                               f"max_groups_contributed={rng.choice([1, 3, 0])}",
                               f"noise={rng.choice(['gaussian', 'laplace', 'bogus'])}"],
                              rng.choice([1, 2]))
            head += f"OPTIONS({', '.join(opts)}) "
    # an aggregate alone, or post-processed (arithmetic over released values)
    outs = [rng.choice([a, a, f"{a} / 2", f"{a} + {aggs[0]}", f"round({a})"]) for a in aggs]
    sql = head + ", ".join([*keys, *(f"{a} AS a{i}" for i, a in enumerate(outs))])
    sql += f" FROM {source}"
    if rng.random() < 0.5:
        sql += " WHERE " + _condition(rng, cols, uid)
    if keys:
        sql += " GROUP BY " + ", ".join(keys)
        if rng.random() < 0.2:
            sql += " HAVING a0 > 0"
        if rng.random() < 0.3:
            sql += (" ORDER BY " + rng.choice(["1", "a0", f"{len(keys) + 1}"])
                    + rng.choice(["", " DESC", " NULLS FIRST"])
                    + rng.choice(["", " LIMIT 3", " OFFSET 1", " LIMIT ALL"]))
    if rng.random() < 0.1:  # DP words inside a comment and a string change nothing
        sql = sql.replace(" FROM ", " /* WITH ANONYMIZATION */ FROM ", 1) + " -- ANON_SUM('x')"
    if name == "cte":
        sql = _CTE + sql
    return ("EXPLAIN " if rng.random() < 0.25 else "") + sql, name != "unprotected"


@pytest.fixture(params=["plain", "prefiltered"])
def split_proxy(request: pytest.FixtureRequest,
                loop_thread: LoopThread, demo_config: Config, backend: Backend) -> Iterator[Proxy]:
    """The demo proxy, splitting every pushdown it can by uid ranges (also over small tables),
    so that the fuzzer runs that path too; "prefiltered": every split pushdown whose types
    allow it picks users' groups from their rows (whatever the groups per user). alice's and
    bob's budgets are full at the start, and again at the end."""
    b = demo_config.backend.model_copy(update={"pushdown_split": 3, "pushdown_split_min_rows": 0,
                                               "pushdown_prefilter": request.param == "prefiltered"})
    with running_proxy(loop_thread, demo_config.model_copy(update={"backend": b}), backend) as px, \
            budgets_reset(px):
        yield px


def test_random_dp_queries_are_answered_or_refused_cleanly(split_proxy: Proxy) -> None:
    rng = random.Random(SEED)
    answered = refused = 0
    with psycopg.connect(split_proxy.dsn("admin"), autocommit=True) as admin, \
            psycopg.connect(split_proxy.dsn(), autocommit=True) as conn:
        for i in itertools.count():
            # ROUNDS queries, and more (up to three times as many) until the split and
            # prefiltered paths have both been taken: a seed whose first ROUNDS queries never
            # reach them still tests them
            if i >= ROUNDS and (_paths_taken(split_proxy) or i >= 3 * ROUNDS):
                break
            sql, protected = _query(rng)
            params: tuple[object, ...] | None = None
            if re.search(r" > 10\b", sql) and rng.random() < 0.3:  # an extended-protocol parameter
                sql = re.sub(r" > 10\b", " > %s", sql.replace("%", "%%"), count=1)
                params = (rng.choice([10, 10.5, "10", None, "abc", 2**40]),)
            where = f"seed {SEED}, round {i}: {sql} {params or ''}"
            before = spent(conn)
            try:
                conn.execute(sql, params).fetchall()
            except psycopg.Error as e:
                if not protected:  # passed through: Postgres's own answer, whatever it is
                    assert e.sqlstate and e.sqlstate[:2] not in ("XX", "08"), f"{where}\n{e}"
                    continue
                assert e.sqlstate in _REFUSALS, f"{where}\n{e.sqlstate}: {e}"
                if "cost is charged" in str(e):  # APPROX_BOUNDS found too few users: says so
                    assert e.sqlstate == "22023" and spent(conn).epsilon > before.epsilon, where
                else:
                    assert spent(conn) == before, f"{where}: a refusal spent budget"
                refused += 1
            else:
                after = spent(conn)
                if sql.startswith("EXPLAIN") or not protected:
                    assert after == before, f"{where}: spent budget"
                else:
                    assert after.epsilon > before.epsilon, f"{where}: an answer spent nothing"
                answered += 1
            if spent(conn).epsilon > 8:  # keep the analyst's budget (10) from running out
                admin.execute("SELECT dp_reset_budget('alice')")
    # the generator must reach both sides, or it tests little
    assert answered >= ROUNDS // 10 and refused >= ROUNDS // 10, (answered, refused)
    # (on Citus the split is off by design)
    assert ON_CITUS or _paths_taken(split_proxy), \
        "no pushdown was split (or, in that mode, prefiltered)"


def _paths_taken(proxy: Proxy) -> bool:
    """Some pushdown was split by uid ranges, and (where the fixture makes every split
    pushdown prefilter) some was prefiltered."""
    split = [x for x in proxy.server.metrics.pushdown_split.collect()[0].samples
             if x.name.endswith("_total")]
    if proxy.server.config.backend.pushdown_prefilter:
        return sum(x.value for x in split if x.labels["prefiltered"] == "yes") > 0
    return sum(x.value for x in split) > 0

