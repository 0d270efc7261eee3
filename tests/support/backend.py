"""The test Postgres: an embedded cluster or `DPPROXY_TEST_DSN`'s, with the suite's database.

The backend is an embedded cluster, or the server `DPPROXY_TEST_DSN` names (a superuser DSN;
the suite creates and drops its own database there). `prepared_backend` fills a database
with the demo schema and data and sets up the proxy's roles, as `dp-proxy init-backend` does.

With `DPPROXY_TEST_ON_CITUS` set, the backend is the Citus coordinator's database that
`DPPROXY_TEST_CITUS_DSN` names (a superuser's; Citus and its workers set up there): the
demo tables are made again in its public schema, distributed by uid and colocated, the
lookup table a reference table (`prepared_citus_backend`). tests/operations/test_citus.py
runs the DP test files so; tests of what Citus does not do are skipped there (`ON_CITUS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import asyncpg

from config import Config
from server.backend_setup import DEFAULT_ROLES, BackendDSNs
from server.bootstrap import apply_backend_setup
from server.demo_data import demo_data_sql, demo_schema_sql
from server.dsn import DSN, parse_dsn
from server.embedded import EmbeddedPostgres

ON_CITUS = bool(os.environ.get("DPPROXY_TEST_ON_CITUS"))
"""The suite's backend is a Citus coordinator (`prepared_citus_backend`)."""
TEST_DATABASE = parse_dsn(os.environ.get("DPPROXY_TEST_CITUS_DSN", "postgresql://x@localhost/x")).database \
    if ON_CITUS else "dpproxy_test"
"""The suite's database (on Citus: the coordinator's, which `DPPROXY_TEST_CITUS_DSN` names)."""
PASSWORDS = {"alice": "alice", "bob": "bob", "admin": "admin"}


@dataclass
class Backend:
    """The test Postgres: a superuser DSN, and DSNs of the two proxy roles."""

    admin_dsn: str
    """Superuser, connected to the test database."""
    dsns: BackendDSNs
    embedded: EmbeddedPostgres | None

    @property
    def restricted(self) -> DSN:
        return self.dsns.restricted

    @property
    def pushdown(self) -> DSN:
        return self.dsns.pushdown


SLOW_DP_QUERY = ("SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.2) v.browser, ANON_COUNT(*) "
                 "FROM visits v JOIN test_slow.lookup c ON c.code = v.country GROUP BY v.browser")
"""A DP query whose pushdown runs for seconds after its charge: it joins a public view whose
every row sleeps 50 ms (152 countries), which an operator may define; the analyst's own SQL
cannot make a pushdown slow (the work per row is bounded, protected tables multiply no rows).
The view is one of countries' rows on its key (the sleep in a function declared immutable:
Postgres inlines the view), so that the query is within the public rows a protected row may
meet (`dp_core.fanout`)."""
_SLOW_LOOKUP_SQL = [
    "CREATE SCHEMA test_slow",
    "CREATE FUNCTION test_slow.nap(text) RETURNS boolean LANGUAGE sql IMMUTABLE "
    "AS 'SELECT pg_sleep(0.05) IS NOT NULL'",
    "CREATE VIEW test_slow.lookup AS SELECT code FROM countries WHERE test_slow.nap(code)",
    "GRANT USAGE ON SCHEMA test_slow TO PUBLIC",
    "GRANT SELECT ON test_slow.lookup TO PUBLIC",
]


async def prepare_database(admin_server_dsn: str, database: str, config: Config,
                           role_password: str) -> None:
    """(Re)create `database` on the server of `admin_server_dsn` (a superuser's), with the demo
    schema and data, the slow lookup view, and the backend setup of `config` (hardened)."""
    conn = await asyncpg.connect(admin_server_dsn)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        await conn.execute(f"CREATE DATABASE {database}")
    finally:
        await conn.close()
    base = parse_dsn(admin_server_dsn)
    conn = await asyncpg.connect(base.uri(database=database))
    try:
        async with conn.transaction():
            for stmt in demo_schema_sql() + demo_data_sql():
                await conn.execute(stmt)
            for stmt in _SLOW_LOOKUP_SQL:
                await conn.execute(stmt)
        await apply_backend_setup(conn, suite_config(config), database,
                                  login_secret=role_password, harden=True)
        for role in (DEFAULT_ROLES.pushdown, DEFAULT_ROLES.restricted, DEFAULT_ROLES.ledger):
            await conn.execute(f"ALTER ROLE {role} PASSWORD '{role_password}'")
    finally:
        await conn.close()


def prepared_backend(server_dsn: str, config: Config,
                     embedded: EmbeddedPostgres | None = None) -> Backend:
    """The suite's database prepared on the server of `server_dsn` (a superuser's), with a
    fresh random password for the proxy's roles, as a `Backend`."""
    password = secrets.token_hex(12)
    asyncio.run(prepare_database(server_dsn, TEST_DATABASE, config, password))
    base = parse_dsn(server_dsn)
    return Backend(
        admin_dsn=base.uri(database=TEST_DATABASE),
        dsns=BackendDSNs(
            *(DSN(base.host, base.port, role, TEST_DATABASE, password) for role in
              (DEFAULT_ROLES.restricted, DEFAULT_ROLES.pushdown, DEFAULT_ROLES.ledger)),
            login_secret=password),
        embedded=embedded,
    )


async def distributed_demo_tables(conn: asyncpg.Connection) -> None:
    """The demo tables made again (in the first schema of `conn`'s search_path) and filled,
    distributed as dp-proxy needs them on Citus: visits and purchases by uid, colocated;
    countries a reference table."""
    for stmt in demo_schema_sql():
        await conn.execute(stmt)
    await conn.execute("SELECT create_distributed_table('visits', 'uid')")
    await conn.execute("SELECT create_distributed_table('purchases', 'uid', "
                       "colocate_with => 'visits')")
    await conn.execute("SELECT create_reference_table('countries')")
    for stmt in demo_data_sql():
        await conn.execute(stmt)


async def prepare_citus_database(admin_dsn: str, config: Config, role_password: str) -> None:
    """The demo tables made again in the public schema of `admin_dsn`'s database (a Citus
    coordinator's, as a superuser), distributed as dp-proxy needs them (visits and purchases
    by uid, colocated; countries a reference table), with the slow lookup view, a fresh
    ledger, and the backend setup of `config` (hardened)."""
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute("DROP SCHEMA IF EXISTS test_slow CASCADE")
        await conn.execute(f"DROP SCHEMA IF EXISTS {config.backend.ledger_schema} CASCADE")
        await distributed_demo_tables(conn)
        for stmt in _SLOW_LOOKUP_SQL:
            await conn.execute(stmt)
        await conn.execute("ANALYZE visits, purchases, countries")
        await apply_backend_setup(conn, suite_config(config), parse_dsn(admin_dsn).database,
                                  login_secret=role_password, harden=True)
        for role in (DEFAULT_ROLES.pushdown, DEFAULT_ROLES.restricted, DEFAULT_ROLES.ledger):
            await conn.execute(f"ALTER ROLE {role} PASSWORD '{role_password}'")
    finally:
        await conn.close()


def prepared_citus_backend(admin_dsn: str, config: Config) -> Backend:
    """The suite's backend on a Citus coordinator (`prepare_citus_database`)."""
    password = secrets.token_hex(12)
    asyncio.run(prepare_citus_database(admin_dsn, config, password))
    base = parse_dsn(admin_dsn)
    return Backend(
        admin_dsn=admin_dsn,
        dsns=BackendDSNs(
            *(DSN(base.host, base.port, role, base.database, password) for role in
              (DEFAULT_ROLES.restricted, DEFAULT_ROLES.pushdown, DEFAULT_ROLES.ledger)),
            login_secret=password),
        embedded=None,
    )


SUITE_ANALYSTS = ("carol",)
"""Analysts some tests add to the demo config: the suite's database has their backend roles."""


def suite_config(config: Config) -> Config:
    """`config` with the analysts of SUITE_ANALYSTS too (as alice, whatever their password),
    as the suite's database is set up: with answer reuse's triggers (the suite's proxies run
    with reuse off, tests/proxy/test_reuse.py turns it on)."""
    extra = {name: config.analysts["alice"] for name in SUITE_ANALYSTS
             if name not in config.analysts}
    defaults = config.defaults.model_copy(update={"answer_reuse": "analyst"})
    return config.model_copy(update={"analysts": {**config.analysts, **extra},
                                     "defaults": defaults})


def init_backend(backend: Backend, config: Config) -> None:
    """What `dp-proxy init-backend` does for `config` (with SUITE_ANALYSTS) on the suite's
    database: its analysts' roles, with the suite's login secret; analysts it does not name
    lose their login."""
    config = suite_config(config)

    async def run() -> None:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            await apply_backend_setup(conn, config, TEST_DATABASE,
                                      login_secret=backend.dsns.login_secret, harden=True)
        finally:
            await conn.close()

    asyncio.run(run())


@contextlib.contextmanager
def scratch_schema(admin_dsn: str, schema: str, objects: list[str]) -> Iterator[str]:
    """A schema made of `objects` (statements, run in order) for a test module, dropped after:
    yields the superuser DSN."""
    import psycopg

    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        for stmt in objects:
            conn.execute(stmt)
        try:
            yield admin_dsn
        finally:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")

