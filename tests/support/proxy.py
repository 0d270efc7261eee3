"""In-process proxies for the tests, and what tests ask a proxy: the budget spent, a setting.

A proxy runs on port 0 in a thread with its own event loop (`LoopThread`), so tests can use
blocking clients (psql, psycopg, psycopg2) as well as asyncpg.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple

import psycopg
import pytest

from config import Config
from server import wire as p
from server.app import ProxyServer

from .backend import PASSWORDS, SLOW_DP_QUERY, TEST_DATABASE, Backend
from .rawclient import RawClient


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


def process_rss_mib() -> float:
    """This test process's resident set size (in-process proxies included), in MiB."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmRSS:"))


# ---------------------------------------------------------------------------- the budget


def reset_budget(proxy: Proxy, analyst: str = "alice") -> None:
    """Give `analyst` a full budget again (the ledger outlives each test's proxy)."""
    with psycopg.connect(proxy.dsn("admin"), autocommit=True) as adm:
        adm.execute("SELECT dp_reset_budget(%s)", (analyst,))


@contextlib.contextmanager
def budgets_reset(proxy: Proxy, analysts: tuple[str, ...] = ("alice", "bob")) -> Iterator[None]:
    """Full budgets for `analysts` at the start of a `with` block, and again at its end (so
    what the block spends does not reach later tests)."""
    def do() -> None:
        with psycopg.connect(proxy.dsn("admin"), autocommit=True) as c:
            for who in analysts:
                c.execute(f"SELECT dp_reset_budget('{who}')")
    do()
    yield
    do()


class Spent(NamedTuple):
    """What an analyst has spent, as dp_budget() reports it."""

    epsilon: float
    delta: float


_SPENT_SQL = "SELECT epsilon_spent, delta_spent FROM dp_budget()"


def spent(via: Proxy | psycopg.Connection[Any] | RawClient) -> Spent:
    """The ε and δ spent, asked through `via`: a `Proxy` is asked on a fresh autocommit
    connection as alice; a psycopg connection, or a `RawClient` logged in and ready (with a
    simple Query), is asked on itself, for the analyst it is logged in as."""
    if isinstance(via, Proxy):
        with psycopg.connect(via.dsn(), autocommit=True) as conn:
            return spent(conn)
    if isinstance(via, RawClient):
        via.send(p.Query(_SPENT_SQL))
        rows = [m for m in via.recv_until_ready() if isinstance(m, p.DataRow)]
        epsilon, delta = rows[0].values
        assert epsilon is not None and delta is not None
        return Spent(float(epsilon.decode()), float(delta.decode()))
    row = via.execute(_SPENT_SQL).fetchone()
    assert row is not None
    return Spent(float(row[0]), float(row[1]))


def show(conn: Any, name: str = "dp.epsilon") -> str:
    """A setting as SHOW gives it, on a psycopg connection."""
    (value,) = conn.execute(f"SHOW {name}").fetchone()
    return str(value)


def cancel_a_slow_dp_query(conn: psycopg.Connection[Any]) -> None:
    """Run a slow DP query (epsilon 0.2) on a proxy whose statement_timeout is about a second,
    cancel it after half a second: the cancel, which comes after the charge, changes nothing
    (DESIGN §3.11: when a cancel wins would be a clock on the work left); the query ends at
    its statement timeout with the generic error of a charged failure (XX000)."""
    timer = threading.Timer(0.5, conn.cancel_safe)
    timer.start()
    started = time.monotonic()
    with pytest.raises(psycopg.errors.InternalError_, match="failed after its privacy cost"):
        conn.execute(SLOW_DP_QUERY).fetchall()
    assert time.monotonic() - started < 5
