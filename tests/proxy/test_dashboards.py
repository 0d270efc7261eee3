"""Issue 31 (dashboards): the SQL that BI tools and psql send around DP queries, each form
checked against Postgres's own answer to the same SQL.

- A WITH query that is a DP query, read by a plain outer query; aggregates, GROUP BY, HAVING,
  windows, ORDER BY and LIMIT over a DP subquery (a Superset chart over a virtual dataset):
  post-processing of the released rows. The proxy's answer must be what Postgres computes
  when it runs the same outer SQL over those released rows (captured as the proxy releases
  them, put in a table), and the DP query is charged once.
- `LOCK TABLE ... IN ACCESS SHARE MODE` (pg_dump --schema-only): taken by the analyst's own
  backend role; stronger modes stay refused.
- Table names through the session's search_path, as Postgres resolves them, in the pushdown
  too; a protected name that the path finds elsewhere first is refused.
- `now()`, `current_date` and interval arithmetic, fixed once when the query is planned, in the
  session's TimeZone.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from pglast import parse_sql

from config import Config
from config.models import PublicConfig, TableConfig
from dp_core.clock import clock_expressions, clock_sql
from server.dp_query import service
from server.dp_query.prepared import Prepared, answer_sql
from server.embedded import find_bindir
from tests.support.backend import TEST_DATABASE, Backend, init_backend
from tests.support.clients import psql
from tests.support.proxy import LoopThread, Proxy, reset_budget, running_proxy, spent

Released = list[tuple[Prepared, list[Any]]]


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> Released:
    """Each DP answer the proxy releases, as it releases it: the prepared query and its
    released rows (the proxy runs in this process)."""
    seen: Released = []
    real = service.answer_sql

    def spy(prepared: Prepared, rows: Any) -> str:
        seen.append((prepared, list(rows)))
        return real(prepared, rows)

    monkeypatch.setattr(service, "answer_sql", spy)
    return seen


def over_released(backend: Backend, answer: tuple[Prepared, list[Any]],
                  sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Postgres's answer to `sql`, which reads the table `released`: the DP query's released
    rows, as the DP query alone returns them (its own HAVING, ORDER BY, LIMIT applied)."""
    prepared, rows = answer
    alone = replace(prepared, query=replace(prepared.query, outer=None))
    with psycopg.connect(backend.admin_dsn) as admin:
        admin.execute(f"CREATE TEMP TABLE released AS {answer_sql(alone, rows)}")
        cur = admin.execute(sql)
        assert cur.description is not None
        return [d.name for d in cur.description], cur.fetchall()


# ---------------------------------------------------------------------------- post-processing

BY_BROWSER = "SELECT browser, COUNT(*) AS n FROM visits GROUP BY browser"
DATASET = "SELECT browser, country, COUNT(*) AS n FROM visits GROUP BY browser, country"
"""A Superset virtual dataset built from a DP query."""

FORMS: dict[str, tuple[str, str]] = {
    "a WITH query read by a plain outer query (issue 31)": (
        f"WITH t AS ({BY_BROWSER}) SELECT * FROM t ORDER BY n DESC, browser",
        "WITH t AS (SELECT * FROM released) SELECT * FROM t ORDER BY n DESC, browser"),
    "WITH queries it reads and one nothing reads, column names on it": (
        "WITH long_visits AS (SELECT uid, browser FROM visits WHERE duration > 60), "
        "t (b, n) AS (SELECT browser, count(*) FROM long_visits GROUP BY browser), "
        "unused AS (SELECT 1) SELECT b, n * 2 AS twice FROM t WHERE n > 0 ORDER BY b",
        "WITH t (b, n) AS (SELECT * FROM released) "
        "SELECT b, n * 2 AS twice FROM t WHERE n > 0 ORDER BY b"),
    "a chart over a virtual dataset (issue 31)": (
        f'SELECT browser AS browser, sum(n) AS "SUM(n)", count(*) AS "COUNT(*)" FROM ({DATASET}) '
        'AS virtual_table GROUP BY browser ORDER BY "SUM(n)" DESC, browser LIMIT 10000',
        'SELECT browser AS browser, sum(n) AS "SUM(n)", count(*) AS "COUNT(*)" FROM released '
        'AS virtual_table GROUP BY browser ORDER BY "SUM(n)" DESC, browser LIMIT 10000'),
    "HAVING, avg and a window over the groups of a DP subquery": (
        "SELECT country, avg(n) AS mean, max(n) - min(n) AS spread, rank() OVER (ORDER BY "
        f"sum(n) DESC, country) AS r FROM ({DATASET}) AS v GROUP BY country "
        "HAVING count(*) >= 2 ORDER BY r LIMIT 5",
        "SELECT country, avg(n) AS mean, max(n) - min(n) AS spread, rank() OVER (ORDER BY "
        "sum(n) DESC, country) AS r FROM released AS v GROUP BY country "
        "HAVING count(*) >= 2 ORDER BY r LIMIT 5"),
    "a global aggregate (a big number)": (
        f'SELECT sum(n) AS "SUM(n)", count(*) AS groups FROM ({DATASET}) AS virtual_table '
        "LIMIT 50000",
        'SELECT sum(n) AS "SUM(n)", count(*) AS groups FROM released AS virtual_table '
        "LIMIT 50000"),
    "the row count of a chart (a query around a query around the DP query)": (
        'SELECT COUNT(*) AS rowcount FROM (SELECT browser AS browser, sum(n) AS "SUM(n)" FROM '
        f"({DATASET}) AS virtual_table GROUP BY browser LIMIT 10000) AS rowcount_qry",
        'SELECT COUNT(*) AS rowcount FROM (SELECT browser AS browser, sum(n) AS "SUM(n)" FROM '
        "released AS virtual_table GROUP BY browser LIMIT 10000) AS rowcount_qry"),
    "a WITH query in the subquery a chart reads": (
        f"SELECT b, sum(n) AS n FROM (WITH t AS ({DATASET}) SELECT browser AS b, n FROM t) "
        "AS virtual_table GROUP BY b ORDER BY b",
        "SELECT b, sum(n) AS n FROM (WITH t AS (SELECT * FROM released) SELECT browser AS b, n "
        "FROM t) AS virtual_table GROUP BY b ORDER BY b"),
    "DISTINCT over a DP subquery (a filter's values)": (
        f"SELECT DISTINCT browser FROM ({DATASET}) AS virtual_table ORDER BY browser",
        "SELECT DISTINCT browser FROM released AS virtual_table ORDER BY browser"),
    "error bars as SQL values, read by a query around": (
        "SELECT browser, n, lo, hi FROM (SELECT browser, COUNT(*) AS n, DP_INTERVAL_LOW(n) AS lo, "
        "DP_INTERVAL_HIGH(COUNT(*)) AS hi FROM visits GROUP BY browser) AS t "
        "ORDER BY hi - lo, browser",
        "SELECT browser, n, lo, hi FROM released AS t ORDER BY hi - lo, browser"),
    "the paper's form inside, a plain aggregate around": (
        "SELECT sum(users) AS users, count(*) AS countries FROM (SELECT WITH ANONYMIZATION "
        "country, ANON_COUNT(*) AS users FROM visits GROUP BY country) AS t",
        "SELECT sum(users) AS users, count(*) AS countries FROM released AS t"),
}


@pytest.mark.parametrize("protocol", ["extended", "simple"])
@pytest.mark.parametrize("form", list(FORMS))
def test_post_processing_is_postgres_over_the_released_rows(
        px: Proxy, backend: Backend, released: Released, form: str, protocol: str) -> None:
    sql, reference = FORMS[form]
    cursor = psycopg.ClientCursor if protocol == "simple" else psycopg.Cursor
    with psycopg.connect(px.dsn(), autocommit=True, cursor_factory=cursor) as conn:
        conn.execute("SET dp.epsilon = 0.5")
        cur = conn.execute(sql)
        assert cur.description is not None
        names, rows = [d.name for d in cur.description], cur.fetchall()
        assert spent(conn).epsilon == pytest.approx(0.5), "one DP query, charged once"
    (answer,) = released
    assert (names, rows) == over_released(backend, answer, reference)
    assert rows, "a case that tests little"


def test_error_bars_as_sql_values(px: Proxy) -> None:
    """DP_INTERVAL_LOW / DP_INTERVAL_HIGH beside the aggregates: double precision columns,
    each value within its interval, a count's and a sum's width the notice's, an AVG's
    within the notice's range (by group count), a quantile's around it (from its tree); at
    no cost beyond the aggregates'; anywhere else refused before any charge."""
    sql = ("SELECT browser, COUNT(*) AS n, DP_INTERVAL_LOW(n) AS nl, DP_INTERVAL_HIGH(n) AS nh, "
           "SUM(duration) AS s, DP_INTERVAL_LOW(SUM(duration)) AS sl, DP_INTERVAL_HIGH(s) AS sh, "
           "AVG(duration) AS a, DP_INTERVAL_LOW(a) AS al, DP_INTERVAL_HIGH(a) AS ah, "
           "percentile_cont(0.5) WITHIN GROUP (ORDER BY duration) AS m, DP_INTERVAL_LOW(m) AS ml "
           "FROM visits GROUP BY browser ORDER BY browser")
    details: list[str] = []
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        conn.add_notice_handler(lambda d: details.append(d.message_detail or ""))
        cur = conn.execute(sql)
        assert cur.description is not None
        types = {d.name: d.type_code for d in cur.description}
        rows = [dict(zip(types, r, strict=True)) for r in cur.fetchall()]
        assert spent(conn).epsilon == pytest.approx(1.0)  # the defaults' ε: one query's
        plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql))
        assert "Cost charged when run: epsilon 1," in plan
        for bad in ("SELECT COUNT(*) AS n, DP_INTERVAL_HIGH(n) - n FROM visits",
                    "SELECT browser, COUNT(*) AS n FROM visits GROUP BY browser "
                    "HAVING DP_INTERVAL_LOW(n) > 10"):
            with pytest.raises(psycopg.errors.FeatureNotSupported, match="of their own"):
                conn.execute(bad)
        assert spent(conn).epsilon == pytest.approx(1.0)
    float8 = psycopg.adapters.types["float8"].oid
    assert all(types[c] == float8 for c in ("nl", "nh", "sl", "sh", "al", "ah", "ml"))
    assert len(rows) > 3
    widths = dict(part.split(" ±", 1) for part in
                  details[-1].split("; ")[0].removeprefix("95% noise half-width: ").split(", "))
    n_width, s_width = float(widths["n"]), float(widths["s"])
    low, _, high = widths["a"].partition(" to ±")
    a_low, a_high = float(low), float(high.split(" ")[0] or low)
    for r in rows:
        assert r["nl"] <= r["n"] <= r["nh"] and r["sl"] <= r["s"] <= r["sh"]
        assert r["al"] <= r["a"] <= r["ah"] and r["ml"] <= r["m"]
        assert r["nh"] - r["n"] == pytest.approx(n_width, rel=1e-3)
        assert r["sh"] - r["s"] == pytest.approx(s_width, rel=1e-3)
        assert r["s"] - r["sl"] == pytest.approx(s_width, rel=1e-3)
        # (the notice's ends are simulated too: 4,000 draws at two groups, 1,000 here)
        if r["al"] > 0 and r["ah"] < 3600:
            assert 0.8 * a_low <= (r["ah"] - r["al"]) / 2 <= 1.2 * a_high


def test_explain_says_what_is_post_processing(px: Proxy) -> None:
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        lines = [r[0] for r in conn.execute(f"EXPLAIN WITH t AS ({BY_BROWSER}) SELECT * FROM t")]
        assert any(line.startswith("Post-processing") for line in lines)
        # a subquery grouped by the uid has per-user rows: the query around is the DP query
        lines = [r[0] for r in conn.execute(
            "EXPLAIN SELECT count(*) FROM (SELECT uid, count(*) AS n FROM visits GROUP BY uid) s "
            "WHERE n > 2")]
        assert not any(line.startswith("Post-processing") for line in lines)
        assert spent(conn).epsilon == 0


@pytest.mark.parametrize("sql", [
    f"SELECT browser, sum(n) + (SELECT count(*) FROM visits) FROM ({DATASET}) AS v GROUP BY 1",
    f"SELECT sum(v.n) FROM ({DATASET}) AS v, countries c WHERE c.code = v.country",
    f"WITH t AS ({BY_BROWSER}) SELECT * FROM t WHERE browser IN (SELECT browser FROM visits)",
    f"WITH t AS ({BY_BROWSER}), u AS (SELECT uid, browser FROM visits) "
    "SELECT count(*) FROM t JOIN u USING (browser)",
    f"WITH t AS ({BY_BROWSER}) SELECT sum(n) FROM t, LATERAL (SELECT 1) x",
    f"SELECT count(*) FROM ({DATASET}) AS v, generate_series(1, 3) g",
    f"WITH t AS ({BY_BROWSER}) SELECT * FROM t FOR UPDATE",
])
def test_a_query_around_a_dp_answer_reads_nothing_else(px: Proxy, sql: str) -> None:
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as err:
            conn.execute(sql).fetchall()
        assert err.value.sqlstate in ("0A000", "42501")
        assert spent(conn).epsilon == 0


SUPERSET_SETUP = ("SELECT pg_catalog.version()", "SELECT current_schema()",
                  "SHOW standard_conforming_strings")


def test_a_superset_like_sequence(px: Proxy, backend: Backend, released: Released) -> None:
    """What Superset sends for the charts of a virtual dataset built from a DP query: the
    dataset's SQL with a LIMIT (its columns), then each chart's query, compiled by SQLAlchemy
    as Superset compiles it (the dataset's text as a subquery `AS virtual_table`, literal
    binds) and sent by psycopg2: a bar chart, its row count, a big number, a filter's values,
    the samples. Each answers what Postgres answers over its DP query's released rows."""
    import sqlalchemy as sa
    from sqlalchemy.pool import NullPool

    engine = sa.create_engine(f"postgresql+psycopg2://alice:alice@{px.host}:{px.port}/"
                              f"{TEST_DATABASE}", poolclass=NullPool)
    col = sa.literal_column
    virtual = sa.text(DATASET).columns().subquery("virtual_table")
    bar = sa.select(col("browser").label("browser"), sa.func.sum(col("n")).label("SUM(n)")) \
        .select_from(virtual).group_by(col("browser")) \
        .order_by(sa.desc(col('"SUM(n)"')), col("browser")).limit(10000)
    charts = {
        "bar chart": bar,
        "row count": sa.select(col("COUNT(*)").label("rowcount")).select_from(
            bar.subquery("rowcount_qry")),
        "big number": sa.select(sa.func.sum(col("n")).label("SUM(n)")).select_from(virtual)
        .limit(50000),
        "filter values": sa.select(col("browser").label("browser")).select_from(virtual)
        .group_by(col("browser")).order_by(col("browser")).limit(1000),
        "samples": sa.select(col("browser").label("browser"), col("country").label("country"),
                             col("n").label("n")).select_from(virtual)
        .order_by(col("browser"), col("country")).limit(10000).offset(0),
    }
    try:
        with engine.connect() as conn:
            for sql in SUPERSET_SETUP:
                conn.exec_driver_sql(sql).fetchall()
            # the dataset's columns: its SQL with Superset's forced LIMIT
            rows = conn.exec_driver_sql(f"{DATASET} LIMIT 1")
            assert list(rows.keys()) == ["browser", "country", "n"] and len(rows.fetchall()) <= 1
            for name, chart in charts.items():
                sql = str(chart.compile(engine, compile_kwargs={"literal_binds": True}))
                assert f"({DATASET}) AS virtual_table" in sql, name
                result = conn.exec_driver_sql(sql)
                names, got = list(result.keys()), [tuple(r) for r in result.fetchall()]
                reference = sql.replace(f"({DATASET})", "released")
                assert (names, got) == over_released(backend, released[-1], reference), name
                assert got, name
            conn.rollback()
    finally:
        engine.dispose()
    assert len(released) == 1 + len(charts)
    assert spent(px).epsilon == pytest.approx(1.0 * len(released)), "each statement charged once"


# ---------------------------------------------------------------------------- LOCK TABLE

def test_lock_in_access_share_mode_is_the_analysts_own(px: Proxy, backend: Backend) -> None:
    """pg_dump --schema-only locks each table it dumps IN ACCESS SHARE MODE: it reads no row,
    and the analyst's own backend role takes it (Postgres grants it to a role with SELECT,
    which the analyst's has, under row-level security). A DP query in the same block is
    answered (the pushdown's read takes the same mode, which does not conflict)."""
    with psycopg.connect(px.dsn()) as conn, psycopg.connect(backend.admin_dsn) as admin:
        conn.execute("LOCK TABLE visits, public.purchases IN ACCESS SHARE MODE NOWAIT")
        held = admin.execute(
            "SELECT a.usename, l.mode, l.granted FROM pg_locks l JOIN pg_stat_activity a "
            "USING (pid) WHERE l.relation = 'public.visits'::regclass AND l.pid = %s",
            (conn.info.backend_pid,)).fetchall()
        assert held == [("dp_analyst_alice", "AccessShareLock", True)]
        assert conn.execute("SELECT count(*) FROM visits").fetchone() is not None
        conn.rollback()
        for mode in ("ROW SHARE", "ROW EXCLUSIVE", "SHARE UPDATE EXCLUSIVE", "SHARE",
                     "SHARE ROW EXCLUSIVE", "EXCLUSIVE", "ACCESS EXCLUSIVE"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="ACCESS SHARE"):
                conn.execute(f"LOCK TABLE visits IN {mode} MODE")
            conn.rollback()
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("LOCK visits")  # (ACCESS EXCLUSIVE)
        conn.rollback()


def test_pg_dump_schema_only(px: Proxy) -> None:
    """pg_dump --schema-only through the proxy. It locks every table it sees, the ledger's
    too, which no analyst's role may use: Postgres refuses that one, so the ledger's schema
    is left out (-N)."""
    def dump(*extra: str) -> subprocess.CompletedProcess[str]:
        argv = [str(find_bindir() / "pg_dump"), "--schema-only", *extra, "-h", px.host,
                "-p", str(px.port), "-U", "alice", "-d", TEST_DATABASE]
        env = dict(os.environ, PGPASSWORD="alice", PGSSLMODE="disable")
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)

    done = dump("-N", "dpproxy")
    assert done.returncode == 0, done.stderr
    assert "CREATE TABLE public.visits" in done.stdout
    whole = dump()
    assert whole.returncode != 0 and "permission denied for schema dpproxy" in whole.stderr


# ---------------------------------------------------------------------------- search_path

RIDES_SQL = [
    "DROP SCHEMA IF EXISTS ops CASCADE", "DROP SCHEMA IF EXISTS shadow CASCADE",
    "DROP TABLE IF EXISTS public.zones",
    "CREATE SCHEMA ops",
    "CREATE TABLE ops.rides (uid int, city text, started_at timestamptz)",
    # one ride per user, three an hour for 40 days, each 10 minutes off a third of an hour:
    # no ride is within minutes of a boundary the tests draw (30 days ago, a local midnight)
    "INSERT INTO ops.rides SELECT k, (ARRAY['a', 'b', 'c'])[1 + k % 3], "
    "now() - k * interval '20 minutes' - interval '10 minutes' FROM generate_series(0, 2879) k",
    "CREATE TABLE ops.zones (city text, zone text)",
    "INSERT INTO ops.zones VALUES ('a', 'north'), ('b', 'south'), ('c', 'north')",
    # a public table of the same name elsewhere, which the pushdown role's search_path finds
    "CREATE TABLE public.zones (city text, zone text)",
    "INSERT INTO public.zones VALUES ('a', 'east'), ('b', 'east'), ('c', 'west')",
    # a table of the protected table's name that is not protected
    "CREATE SCHEMA shadow",
    "CREATE TABLE shadow.rides (uid int, city text, started_at timestamptz)",
    "GRANT USAGE ON SCHEMA shadow TO PUBLIC", "GRANT SELECT ON shadow.rides TO PUBLIC",
]


@pytest.fixture(scope="module")
def rides_config(demo_config: Config, backend: Backend) -> Iterator[Config]:
    """The demo config with ops.rides protected and ops.zones and zones public."""
    public = PublicConfig(tables=[*demo_config.public.tables, "ops.zones", "zones"])
    config = demo_config.model_copy(update={
        "tables": {**demo_config.tables,
                   "rides": TableConfig.model_validate({"uid_column": "uid", "schema": "ops"})},
        "public": public})
    with psycopg.connect(backend.admin_dsn, autocommit=True) as su:
        for stmt in RIDES_SQL:
            su.execute(stmt)
    init_backend(backend, config)
    try:
        yield config
    finally:
        with psycopg.connect(backend.admin_dsn, autocommit=True) as su:
            su.execute("DROP SCHEMA ops CASCADE")
            su.execute("DROP SCHEMA shadow CASCADE")
            su.execute("DROP TABLE public.zones")
        init_backend(backend, demo_config)


@pytest.fixture
def rides_proxy(loop_thread: LoopThread, rides_config: Config, backend: Backend) -> Iterator[Proxy]:
    with running_proxy(loop_thread, rides_config, backend) as px:
        reset_budget(px)
        yield px


DP = "SELECT WITH ANONYMIZATION OPTIONS(epsilon=10) "


def _truth(backend: Backend, sql: str, *settings: str) -> dict[Any, int]:
    with psycopg.connect(backend.admin_dsn, autocommit=True) as conn:
        for s in settings:
            conn.execute(s)
        return {r[0]: int(r[1]) for r in conn.execute(sql)}


def _close(released: dict[Any, int], truth: dict[Any, int]) -> None:
    """At ε 10, C_u 1 and one group per user, a count of users is within 2 of the truth, and
    partition selection (τ 2.31) releases every group of 7 users or more, none of fewer than
    2 (tests/proxy/test_semantics.py)."""
    assert {k for k, n in truth.items() if n >= 7} <= released.keys()
    assert all(truth.get(k, 0) >= 2 and abs(n - truth[k]) <= 2 for k, n in released.items()), \
        (released, truth)


def test_names_mean_what_the_sessions_search_path_finds(rides_proxy: Proxy,
                                                         backend: Backend) -> None:
    """After SET search_path TO ops, `rides` and `zones` are ops.rides and ops.zones, in the
    pushdown too (it runs as another role, whose search_path finds public.zones)."""
    sql = ("city, ANON_COUNT(DISTINCT uid) FROM rides GROUP BY city",
           "z.zone, ANON_COUNT(DISTINCT uid) FROM rides r JOIN zones z USING (city) "
           "GROUP BY z.zone")
    truth = [_truth(backend, "SELECT city, count(DISTINCT uid) FROM ops.rides GROUP BY city"),
             _truth(backend, "SELECT z.zone, count(DISTINCT uid) FROM ops.rides r JOIN "
                             "ops.zones z USING (city) GROUP BY z.zone")]
    assert set(truth[1]) == {"north", "south"}
    with psycopg.connect(rides_proxy.dsn(), autocommit=True) as conn:
        conn.execute("SET search_path TO ops, public")
        for query, expected in zip(sql, truth, strict=True):
            reset_budget(rides_proxy)
            _close({r[0]: int(r[1]) for r in conn.execute(DP + query)}, expected)
        # in a transaction block, on the extended protocol with a parameter
        with conn.transaction():
            conn.execute("SET LOCAL search_path TO public, ops")
            reset_budget(rides_proxy)
            found = {r[0]: int(r[1]) for r in conn.execute(
                DP + "z.zone, ANON_COUNT(DISTINCT uid) FROM rides r JOIN zones z USING (city) "
                "WHERE r.uid >= %s GROUP BY z.zone", (0,))}
        assert found.keys() == {"east", "west"}  # public.zones, first in that path
    # psql: SET and the DP query in one Query (the proxy's implicit block)
    reset_budget(rides_proxy)
    done = psql(rides_proxy, "SET search_path TO ops; SELECT count(*) > 1000 AS many FROM rides")
    assert done.returncode == 0 and " t\n" in done.stdout, done.stderr


def test_a_name_the_search_path_does_not_find_is_postgres_error(rides_proxy: Proxy,
                                                                backend: Backend) -> None:
    for path, sql in [("public", "SELECT city, count(*) FROM rides GROUP BY city"),
                      ("ops", "SELECT r.city, count(*) FROM ops.rides r JOIN countries c "
                              "ON c.code = r.city GROUP BY r.city")]:
        with psycopg.connect(backend.admin_dsn, autocommit=True) as su, \
                pytest.raises(psycopg.Error) as expected:
            su.execute(f"SET search_path TO {path}")
            su.execute(sql)
        with psycopg.connect(rides_proxy.dsn(), autocommit=True) as conn:
            conn.execute(f"SET search_path TO {path}")
            with pytest.raises(psycopg.Error) as err:
                conn.execute(sql)
            assert err.value.sqlstate == expected.value.sqlstate == "42P01"
            assert err.value.diag.message_primary == expected.value.diag.message_primary
            assert spent(conn).epsilon == 0


def test_a_protected_name_found_elsewhere_first_is_refused(rides_proxy: Proxy) -> None:
    """shadow.rides, not protected, comes first in the path: Postgres would read it. The
    proxy reads neither it nor ops.rides for `rides`: refused, nothing spent; the qualified
    name is answered."""
    with psycopg.connect(rides_proxy.dsn(), autocommit=True) as conn:
        conn.execute("SET search_path TO shadow, ops")
        with pytest.raises(psycopg.errors.FeatureNotSupported, match=r"shadow\.rides"):
            conn.execute("SELECT city, count(*) FROM rides GROUP BY city")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT * FROM rides")  # (a row-level read, as ever)
        assert spent(conn).epsilon == 0
        assert conn.execute("SELECT city, count(*) FROM ops.rides GROUP BY city").fetchall()


# ---------------------------------------------------------------------------- relative dates

def test_relative_dates_are_fixed_when_planned(rides_proxy: Proxy, backend: Backend) -> None:
    """`now() - interval '30 days'`, the filter every BI tool writes, as Postgres reads it (the
    input 'now' too)."""
    for where in ("started_at > now() - interval '30 days'",
                  "started_at > 'now'::timestamptz - interval '30 days'"):
        truth = _truth(backend, f"SELECT city, count(DISTINCT uid) FROM ops.rides WHERE {where} "
                                "GROUP BY city")
        assert sum(truth.values()) == 3 * 24 * 30
        reset_budget(rides_proxy)
        with psycopg.connect(rides_proxy.dsn(), autocommit=True) as conn:
            conn.execute("SET search_path TO ops")
            _close({r[0]: int(r[1]) for r in conn.execute(
                DP + f"city, ANON_COUNT(DISTINCT uid) FROM rides WHERE {where} GROUP BY city")},
                truth)
            plan = "\n".join(r[0] for r in conn.execute(
                f"EXPLAIN SELECT count(*) FROM rides WHERE {where}"))
            assert "now" not in plan.lower().replace("now() read", "") \
                and "timestamp with time zone" in plan  # a literal


@pytest.mark.parametrize("timezone", ["Pacific/Kiritimati", "America/Los_Angeles"])
def test_dates_are_read_in_the_sessions_timezone(rides_proxy: Proxy, backend: Backend,
                                                 timezone: str) -> None:
    """`current_date - 3` and `started_at::date` are the session's dates: Postgres's answer in
    that TimeZone, not in the pushdown role's (hours apart: dozens of rides a day). Counted by
    city and by day (a key of the session's dates, `date_trunc` of its midnights)."""
    for key in ("city", "date_trunc('day', started_at)"):
        sql = (f"SELECT {key}, count(DISTINCT uid) FROM ops.rides WHERE started_at::date >= "
               "current_date - 3 AND started_at < now() + interval '1 day' GROUP BY 1")
        truth = _truth(backend, sql, f"SET TimeZone = '{timezone}'")
        elsewhere = _truth(backend, sql, "SET TimeZone = 'UTC'")
        assert any(abs(n - elsewhere.get(k, 0)) > 6 for k, n in truth.items()), "it tests little"
        with psycopg.connect(rides_proxy.dsn(), autocommit=True) as conn:
            conn.execute(f"SET TimeZone = '{timezone}'")
            reset_budget(rides_proxy)
            _close({r[0]: int(r[1]) for r in conn.execute(sql.replace(
                "count(DISTINCT uid)", "ANON_COUNT(DISTINCT uid)").replace("SELECT ", DP, 1))},
                truth)
    reset_budget(rides_proxy)
    with psycopg.connect(rides_proxy.dsn(), autocommit=True) as conn:
        conn.execute(f"SET TimeZone = '{timezone}'")
        (row,) = conn.execute(DP + "current_date AS today, ANON_COUNT(*) FROM ops.rides")
        assert row[0] == conn.execute("SELECT current_date").fetchone()[0]  # type: ignore[index]


@pytest.mark.parametrize("timezone", ["UTC", "Asia/Kolkata", "America/St_Johns"])
def test_the_clock_is_read_at_the_start_of_its_quantum(backend: Backend, timezone: str) -> None:
    """With a granularity, every clock value of a relative date is the start of the clock's
    quantum of the session's local time (zones half an hour off UTC too): now() and
    current_timestamp its instant, localtimestamp and localtime its local time, current_date
    its local date, as the input 'now' of a date or time type does ('today' is read as the
    day); 0 is the exact time."""
    exprs = clock_expressions(parse_sql(
        "SELECT 1 FROM t WHERE a = now() AND b = current_timestamp(2) AND c = localtimestamp "
        "AND d = current_date AND e = localtime AND f = current_time AND g = "
        "transaction_timestamp() AND h = date_trunc('day', now()) - interval '1 day' AND "
        "i = 'now'::timestamptz AND j = timestamp ' Now' AND k = date 'today'")[0].stmt)
    with psycopg.connect(backend.admin_dsn, autocommit=True) as conn:
        conn.execute(f"SET TimeZone = '{timezone}'")
        with conn.transaction():
            start = conn.execute(
                "SELECT date_bin('15 minutes', now()::timestamp, '2000-01-01')").fetchone()
            assert start is not None
            local = start[0]
            row = conn.execute(clock_sql(exprs, 15 * 60)).fetchone()
            exact = conn.execute(clock_sql(exprs)).fetchone()
            now = conn.execute("SELECT now()").fetchone()
        assert row is not None and exact is not None and now is not None
        zoned = conn.execute("SELECT %s::timestamp::timestamptz", (local,)).fetchone()
        assert zoned is not None
        values = [row[1 + 2 * i] for i in range(len(exprs))]  # (now, v0, t0, v1, t1, ...)
        text = conn.execute(
            "SELECT %s::timestamptz::text, %s::timestamp::text, %s::timestamp::date::text, "
            "%s::timestamp::time::text, %s::timestamptz::timetz::text, "
            "(date_trunc('day', %s::timestamptz) - interval '1 day')::text",
            (zoned[0], local, local, local, zoned[0], zoned[0])).fetchone()
        assert text is not None
        assert row[0] == text[0]  # the time they were read at
        assert values == [text[0], text[0], text[1], text[2], text[3], text[4], text[0], text[5],
                          text[0], text[1], text[2]]
        assert local.minute % 15 == 0 and local.second == 0 and local.microsecond == 0
        # (0: the exact time)
        assert exact[0] == conn.execute("SELECT %s::timestamptz::text", (now[0],)).fetchone()[0]  # type: ignore[index]


def test_a_relative_date_that_fails_fails_before_the_charge(rides_proxy: Proxy) -> None:
    with psycopg.connect(rides_proxy.dsn(), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InvalidDatetimeFormat):
            conn.execute("SELECT count(*) FROM ops.rides WHERE started_at > now() - "
                         "interval 'thirty days'")
        with pytest.raises(psycopg.errors.FeatureNotSupported, match="clock_timestamp"):
            conn.execute("SELECT count(*) FROM ops.rides WHERE started_at > clock_timestamp()")
        assert spent(conn).epsilon == 0
