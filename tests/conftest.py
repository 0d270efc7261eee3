"""Shared fixtures: one real Postgres for the whole run, and a fresh proxy per test.

The backend is an embedded cluster, or the server `DPPROXY_TEST_DSN` names (a
superuser DSN; the suite creates and drops its own database there). The proxy
runs on port 0 in a thread with its own event loop, so tests can use blocking
clients (psql, psycopg, psycopg2) as well as asyncpg.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest

from config import DEMO_CONFIG, Config, load_config
from server.app import ProxyServer
from server.backend_setup import DEFAULT_ROLES, BackendDSNs
from server.bootstrap import apply_backend_setup
from server.demo_data import demo_data_sql, demo_schema_sql
from server.dsn import DSN, parse_dsn
from server.embedded import EmbeddedPostgres


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true",
                     help="the stochastic DP tester's deeper mode (more databases, samples, depth)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--long"):
        os.environ["DPPROXY_TEST_STOCHASTIC_LONG"] = "1"  # read by test_stochastic at import


TEST_DATABASE = "dpproxy_test"
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
cannot make a pushdown slow (the work per row is bounded, protected tables multiply no rows)."""
_SLOW_LOOKUP_SQL = [
    "CREATE SCHEMA test_slow",
    "CREATE VIEW test_slow.lookup AS SELECT code, pg_sleep(0.05)::text AS slept FROM countries",
    "GRANT USAGE ON SCHEMA test_slow TO PUBLIC",
    "GRANT SELECT ON test_slow.lookup TO PUBLIC",
]


async def _prepare(admin_server_dsn: str, database: str, config: Config, role_password: str) -> None:
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


SUITE_ANALYSTS = ("carol",)
"""Analysts some tests add to the demo config: the suite's database has their backend roles."""


def suite_config(config: Config) -> Config:
    """`config` with the analysts of SUITE_ANALYSTS too (as alice, whatever their password)."""
    extra = {name: config.analysts["alice"] for name in SUITE_ANALYSTS
             if name not in config.analysts}
    return config.model_copy(update={"analysts": {**config.analysts, **extra}})


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


@pytest.fixture(scope="session")
def demo_config() -> Config:
    return load_config(DEMO_CONFIG, environ={})


@pytest.fixture(scope="session")
def backend(demo_config: Config) -> Iterator[Backend]:
    external = os.environ.get("DPPROXY_TEST_DSN")
    pg: EmbeddedPostgres | None = None
    if external:
        server_dsn = external
    else:
        pg = EmbeddedPostgres().start()
        server_dsn = pg.dsn()
    password = secrets.token_hex(12)
    asyncio.run(_prepare(server_dsn, TEST_DATABASE, demo_config, password))
    base = parse_dsn(server_dsn)
    try:
        yield Backend(
            admin_dsn=base.uri(database=TEST_DATABASE),
            dsns=BackendDSNs(
                *(DSN(base.host, base.port, role, TEST_DATABASE, password) for role in
                  (DEFAULT_ROLES.restricted, DEFAULT_ROLES.pushdown, DEFAULT_ROLES.ledger)),
                login_secret=password),
            embedded=pg,
        )
    finally:
        if pg is not None:
            pg.stop()


def process_rss_mib() -> float:
    """This test process's resident set size (in-process proxies included), in MiB."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmRSS:"))


class LoopThread:
    """An event loop in a daemon thread, for servers that blocking clients talk to."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 60) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


@dataclass
class Proxy:
    server: ProxyServer
    host: str
    port: int

    def dsn(self, user: str = "alice", password: str | None = None, dbname: str = TEST_DATABASE,
            **extra: str) -> str:
        pw = PASSWORDS.get(user, "x") if password is None else password
        parts = [f"host={self.host}", f"port={self.port}", f"user={user}", f"password={pw}",
                 f"dbname={dbname}"]
        parts += [f"{k}={v}" for k, v in extra.items()]
        if "sslmode" not in extra:
            parts.append("sslmode=disable")
        return " ".join(parts)

    def uri(self, user: str = "alice", dbname: str = TEST_DATABASE) -> str:
        return f"postgresql://{user}:{PASSWORDS.get(user, 'x')}@{self.host}:{self.port}/{dbname}"


def start_proxy(loop_thread: LoopThread, config: Config, backend: Backend) -> Proxy:
    listen = config.listen.model_copy(update={"port": 0, "host": "127.0.0.1"})
    config = config.model_copy(update={"listen": listen})

    async def make() -> ProxyServer:
        server = ProxyServer(config, backend.dsns)
        await server.start()
        return server

    server = loop_thread.run(make())
    return Proxy(server, "127.0.0.1", server.port)


@contextlib.contextmanager
def running_proxy(loop_thread: LoopThread, config: Config, backend: Backend) -> Iterator[Proxy]:
    """A proxy with `config` for the duration of a `with` block."""
    px = start_proxy(loop_thread, config, backend)
    try:
        yield px
    finally:
        loop_thread.run(px.server.stop())


@pytest.fixture
def proxy(loop_thread: LoopThread, demo_config: Config, backend: Backend) -> Iterator[Proxy]:
    with running_proxy(loop_thread, demo_config, backend) as px:
        yield px


def reset_budget(proxy: Proxy, analyst: str = "alice") -> None:
    """Give `analyst` a full budget again (the ledger outlives each test's proxy)."""
    import psycopg

    with psycopg.connect(proxy.dsn("admin"), autocommit=True) as adm:
        adm.execute("SELECT dp_reset_budget(%s)", (analyst,))


def show(conn: Any, name: str = "dp.epsilon") -> str:
    """A setting as SHOW gives it, on a psycopg connection."""
    (value,) = conn.execute(f"SHOW {name}").fetchone()
    return str(value)


@pytest.fixture
def px(proxy: Proxy) -> Proxy:
    """A fresh proxy, with alice's budget full."""
    reset_budget(proxy)
    return proxy
