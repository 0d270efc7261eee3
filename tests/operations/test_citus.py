"""Scale-out on Citus (issue 32): with `DPPROXY_TEST_CITUS_DSN` naming a coordinator's database
(a superuser's, Citus installed, workers added), the setup, the distribution checks and DP
answers through the proxy; skipped without one."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import asyncpg
import psycopg
import pytest

from config import Config, TableConfig
from dp_core.rewrite import pushdown
from server.backend_setup import DSN, BackendDSNs, BackendRoles, parse_dsn
from server.bootstrap import apply_backend_setup, citus_problems, find_wall_problems
from tests.support.backend import Backend, distributed_demo_tables
from tests.support.engine import EXTRA_CASES, GOLDEN_CASES, build, golden_sql
from tests.support.proxy import LoopThread, running_proxy, spent
from tests.support.shapes import plan_problems

CITUS_DSN = os.environ.get("DPPROXY_TEST_CITUS_DSN")
pytestmark = [pytest.mark.live,
              pytest.mark.skipif(not CITUS_DSN, reason="DPPROXY_TEST_CITUS_DSN names no Citus "
                                                       "coordinator")]
SCHEMA = "dp_citus_test"
ROLES = BackendRoles("dpct_pushdown", "dpct_restricted", "dpct_ledger", "dpct_analyst_")


@dataclass
class Cluster:
    admin_dsn: str
    backend: Backend
    config: Config


def _run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def _prepare(admin_dsn: str, config: Config, password: str) -> None:
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        await conn.execute(f"CREATE SCHEMA {SCHEMA}")
        await conn.execute(f"SET search_path TO {SCHEMA}")
        await distributed_demo_tables(conn)
        await conn.execute("RESET search_path")
        for _ in range(2):  # (idempotent, also on Citus)
            await apply_backend_setup(conn, config, parse_dsn(admin_dsn).database, ROLES,
                                      login_secret=password, harden=True)
        for role in (ROLES.pushdown, ROLES.restricted, ROLES.ledger):
            await conn.execute(f"ALTER ROLE {role} PASSWORD '{password}'")
    finally:
        await conn.close()


@pytest.fixture(scope="module")
def cluster(demo_config: Config) -> Iterator[Cluster]:
    assert CITUS_DSN is not None
    base = parse_dsn(CITUS_DSN)
    password = secrets.token_hex(12)
    dsns = BackendDSNs(*(DSN(base.host, base.port, role, base.database, password)
                         for role in (ROLES.restricted, ROLES.pushdown, ROLES.ledger)),
                       analyst_prefix=ROLES.analyst_prefix, login_secret=password)
    tables = {name: t.model_copy(update={"schema_": SCHEMA})
              for name, t in demo_config.tables.items()}
    backend = demo_config.backend.model_copy(update={
        "ledger_schema": "dpct_ledger", "analyst_role_prefix": ROLES.analyst_prefix})
    public = demo_config.public.model_copy(update={"tables": [f"{SCHEMA}.countries"]})
    config = demo_config.model_copy(update={"tables": tables, "backend": backend,
                                            "public": public})
    _run(_prepare(CITUS_DSN, config, password))
    yield Cluster(CITUS_DSN, Backend(admin_dsn=CITUS_DSN, dsns=dsns, embedded=None), config)
    _run(_drop(CITUS_DSN))


async def _drop(admin_dsn: str) -> None:
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        await conn.execute("DROP SCHEMA IF EXISTS dpct_ledger CASCADE")
    finally:
        await conn.close()


def test_the_distribution_is_checked_before_any_query(cluster: Cluster) -> None:
    """Every protected table distributed by its uid column, all colocated, public tables
    reference tables: no problem; a table distributed by another column, one in another
    colocation group, a local one and a public table that is not a reference table are each
    named, with the statement that fixes it."""
    async def check() -> list[str]:
        conn = await asyncpg.connect(cluster.admin_dsn)
        try:
            assert await citus_problems(conn, cluster.config) == []
            await conn.execute(f"CREATE TABLE {SCHEMA}.by_browser (uid bigint, browser text)")
            await conn.execute(f"SELECT create_distributed_table('{SCHEMA}.by_browser', 'browser')")
            await conn.execute(f"CREATE TABLE {SCHEMA}.apart (uid bigint, x int)")
            await conn.execute(f"SELECT create_distributed_table('{SCHEMA}.apart', 'uid', "
                               "colocate_with => 'none')")
            await conn.execute(f"CREATE TABLE {SCHEMA}.local_one (uid bigint)")
            await conn.execute(f"CREATE TABLE {SCHEMA}.lookup (code text)")
            extra = {n: TableConfig.model_validate({"schema": SCHEMA, "uid_column": "uid"})
                     for n in ("by_browser", "apart", "local_one")}
            config = cluster.config.model_copy(update={
                "tables": {**cluster.config.tables, **extra},
                "public": cluster.config.public.model_copy(update={
                    "tables": [*cluster.config.public.tables, f"{SCHEMA}.lookup"]})})
            return await citus_problems(conn, config)
        finally:
            await conn.close()

    problems = _run(check())
    assert isinstance(problems, list)
    text = "\n".join(problems)
    assert f"tables.by_browser: Citus distributes {SCHEMA}.by_browser by browser, not by its " \
           "uid column uid" in text
    assert f"tables.local_one: {SCHEMA}.local_one is not distributed" in text
    assert "Citus colocation groups" in text and f"{SCHEMA}.apart" in text
    assert f"public.tables: {SCHEMA}.lookup is not a Citus reference table" in text
    assert len(problems) == 4, problems


def test_dp_answers_on_citus(cluster: Cluster, loop_thread: LoopThread) -> None:
    """The BI forms, the ANON forms, quantiles, COUNT(DISTINCT), joins on the uid and with a
    reference table answer through the proxy on Citus, each charged once."""
    queries = [
        "SELECT browser, COUNT(*), SUM(duration), AVG(duration) FROM visits GROUP BY browser",
        "SELECT COUNT(*) FROM visits",
        "SELECT WITH ANONYMIZATION browser, ANON_COUNT(*), ANON_AVG(duration, 0, 100) "
        "FROM visits GROUP BY browser",
        "SELECT WITH ANONYMIZATION ANON_MEDIAN(duration, 0, 3600) FROM visits",
        "SELECT COUNT(DISTINCT browser) FROM visits",
        "SELECT v.browser, COUNT(*) FROM visits v JOIN purchases p ON p.uid = v.uid "
        "GROUP BY v.browser",
        "SELECT c.region, COUNT(*) FROM visits v JOIN countries c ON c.code = v.country "
        "GROUP BY c.region",
        "SELECT browser, VAR_POP(duration) FROM visits GROUP BY browser",
    ]
    database = cluster.backend.dsns.database
    with running_proxy(loop_thread, cluster.config, cluster.backend) as px:
        with psycopg.connect(px.dsn("admin", dbname=database), autocommit=True) as admin:
            admin.execute("SELECT dp_reset_budget('alice')")
        with psycopg.connect(px.dsn(dbname=database), autocommit=True) as conn:
            conn.execute("SET dp.epsilon = 0.5")
            conn.execute(f"SET search_path TO {SCHEMA}")
            for q in queries:
                assert conn.execute(q).fetchall(), q
            assert spent(conn).epsilon == pytest.approx(0.5 * len(queries))
            # Citus's shard sizes are closed to the analysts (their activity too)
            for sql in ("SELECT citus_table_size('visits')", "SELECT * FROM citus_shards"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(sql)


def test_every_golden_pushdown_runs_its_per_user_stages_on_the_workers(cluster: Cluster) -> None:
    """Each statement of every golden pushdown (and of the forms beside them that the shape
    rule checks) reads its per-user rows, picks each user's groups with the window, and
    aggregates them by the groups inside the workers' tasks: Citus's plan shows no task
    returning per-user rows and no window on the coordinator (tests/support/shapes.py)."""
    cases = [golden_sql(c).strip() for c in GOLDEN_CASES] + EXTRA_CASES

    async def explain() -> list[str]:
        conn = await asyncpg.connect(cluster.admin_dsn)
        out = []
        try:
            for sql in cases:
                query, plan, _ = build(sql, schema=SCHEMA)
                for name, statement in pushdown(query, plan, order_seed=1234).statements().items():
                    rows = await conn.fetch(f"EXPLAIN (COSTS off) {statement}")
                    text = "\n".join(r[0] for r in rows)
                    assert "Task" in text, f"{sql} {name}: not distributed\n{text}"
                    out += [f"{sql} ({name}): {p}" for p in plan_problems(text)]
        finally:
            await conn.close()
        return out

    assert _run(explain()) == []


def test_the_wall_check_reads_the_shards_on_the_workers(cluster: Cluster) -> None:
    """A shard of a protected table without row-level security, or with a policy for the
    restricted role, on a worker, is named by the wall's check (as init-backend and
    check-config --connect run it); with the shard mended, nothing is."""
    table = f"{SCHEMA}.visits"
    one_shard = (f"SELECT shardid FROM pg_dist_shard WHERE logicalrelid = '{table}'::regclass "
                 "ORDER BY shardid LIMIT 1")
    # (changed on the worker that holds it, behind Citus's back, as a worker's own admin could)

    async def check() -> tuple[list[str], list[str], list[str]]:
        conn = await asyncpg.connect(cluster.admin_dsn)
        try:
            shard = await conn.fetchval(one_shard)
            name = str(await conn.fetchval("SELECT shard_name($1::regclass, $2)", table,
                                           shard)).split(".")[-1]
            clean = await find_wall_problems(conn, cluster.config, ROLES)
            await conn.execute(
                "SELECT * FROM run_command_on_workers($1)",
                f"DO $$ BEGIN IF to_regclass('{SCHEMA}.{name}') IS NOT NULL THEN EXECUTE "
                f"'ALTER TABLE {SCHEMA}.{name} DISABLE ROW LEVEL SECURITY; CREATE POLICY "
                f"leak ON {SCHEMA}.{name} FOR SELECT TO {ROLES.restricted} USING (true)'; "
                "END IF; END $$")
            broken = await find_wall_problems(conn, cluster.config, ROLES)
            await conn.execute(
                "SELECT * FROM run_command_on_workers($1)",
                f"DO $$ BEGIN IF to_regclass('{SCHEMA}.{name}') IS NOT NULL THEN EXECUTE "
                f"'ALTER TABLE {SCHEMA}.{name} ENABLE ROW LEVEL SECURITY; DROP POLICY leak ON "
                f"{SCHEMA}.{name}'; END IF; END $$")
            mended = await find_wall_problems(conn, cluster.config, ROLES)
            return clean, broken, mended
        finally:
            await conn.close()

    result = _run(check())
    assert isinstance(result, tuple)
    clean, broken, mended = result
    assert clean == [] and mended == []
    assert len(broken) == 1 and "shard " in broken[0] and "has no row-level security" in broken[0]


def test_pushdown_work_mem_reaches_the_workers(cluster: Cluster) -> None:
    """With backend.pushdown_work_mem, init-backend sets it as the pushdown role's own
    setting, which Citus propagates: the per-user stages on the workers run with it (a
    coordinator session's start-up parameter does not reach them)."""
    config = cluster.config.model_copy(update={"backend": cluster.config.backend.model_copy(
        update={"pushdown_work_mem": "24MB"})})
    database = cluster.backend.dsns.database

    async def check() -> set[str]:
        conn = await asyncpg.connect(cluster.admin_dsn)
        try:
            await apply_backend_setup(conn, config, database, ROLES, harden=True)
        finally:
            await conn.close()
        pushdown = await asyncpg.connect(cluster.backend.pushdown.uri())
        try:
            rows = await pushdown.fetch(
                f"SELECT DISTINCT current_setting('work_mem') FROM {SCHEMA}.visits")
            return {str(r[0]) for r in rows}
        finally:
            await pushdown.close()
            conn = await asyncpg.connect(cluster.admin_dsn)
            try:
                await conn.execute(f"ALTER ROLE {ROLES.pushdown} RESET work_mem")
            finally:
                await conn.close()

    assert _run(check()) == {"24MB"}


DP_TEST_FILES = [
    "tests/proxy/test_dp_queries.py", "tests/proxy/test_semantics.py",
    "tests/proxy/test_quantile_queries.py", "tests/proxy/test_binned.py",
    "tests/proxy/test_public_groups.py", "tests/proxy/test_dashboards.py",
    "tests/proxy/test_attacks.py", "tests/proxy/test_split.py", "tests/proxy/test_reuse.py",
    "tests/fuzz/test_fuzz_sql.py", "tests/fuzz/test_fuzz_neighbours.py",
    "tests/fuzz/test_stochastic_pushdown.py",
]
"""The DP test files: run against the coordinator with the demo tables distributed
(`tests.support.backend.prepared_citus_backend`); what Citus does not do by design (the split,
answer reuse) is skipped there."""


@pytest.mark.timeout(3600)
def test_the_dp_test_files_pass_on_citus() -> None:
    """The DP test files, in a pytest of their own whose backend is the coordinator's database
    (its public schema's demo tables made again, distributed)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "DPPROXY_TEST_ON_CITUS": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          *DP_TEST_FILES], cwd=root, env=env,
                         capture_output=True, text=True, timeout=3600)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in summary and " failed" not in summary, summary
