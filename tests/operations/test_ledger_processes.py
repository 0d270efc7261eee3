"""The ledger across proxy processes: races between two proxies, and a proxy killed mid-query."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import asyncpg
import psycopg
import pytest

from server.bootstrap import demo_config_text
from tests.support.backend import SLOW_DP_QUERY, TEST_DATABASE, Backend
from tests.support.paths import ROOT
from tests.support.processes import free_port

Q = "SELECT WITH ANONYMIZATION OPTIONS(epsilon={e}) browser, ANON_COUNT(*) FROM visits GROUP BY browser"


def _config(backend: Backend, tmp: Path, port: int, extra: str = "") -> Path:
    path = tmp / f"proxy-{port}.toml"
    path.write_text(demo_config_text(backend.dsns, port) + extra)
    return path


class ProxyProcess:
    def __init__(self, backend: Backend, tmp: Path, extra_config: str = "") -> None:
        """A `dp-proxy serve` process with the demo config (and `extra_config` appended)."""
        self.port = free_port()
        cfg = _config(backend, tmp, self.port, extra_config)
        self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", "--log-level", "WARNING",
                                      "serve", "--config", str(cfg)], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
                time.sleep(0.1)
        raise AssertionError("dp-proxy did not start")

    def dsn(self, user: str) -> str:
        return (f"host=127.0.0.1 port={self.port} user={user} password={user} "
                f"dbname={TEST_DATABASE} sslmode=disable")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(30)
        if self.proc.stderr:
            self.proc.stderr.close()


@pytest.fixture
def two_proxies(backend: Backend, tmp_path: Path) -> Iterator[tuple[ProxyProcess, ProxyProcess]]:
    a, b = ProxyProcess(backend, tmp_path), ProxyProcess(backend, tmp_path)
    with psycopg.connect(a.dsn("admin"), autocommit=True) as admin:
        admin.execute("SELECT dp_reset_budget('alice')")
    yield a, b
    a.stop()
    b.stop()


async def _ledger_totals(backend: Backend, analyst: str) -> tuple[Decimal, Decimal]:
    """(spent in the analysts table, sum of charges since the last reset in the ledger)."""
    conn = await asyncpg.connect(backend.admin_dsn)
    try:
        spent = await conn.fetchval("SELECT epsilon_spent FROM dpproxy.analysts WHERE analyst = $1",
                                    analyst)
        charged = await conn.fetchval(
            "SELECT coalesce(sum(epsilon), 0) FROM dpproxy.ledger WHERE analyst = $1 AND kind = 'charge' "
            "AND id > coalesce((SELECT max(id) FROM dpproxy.ledger WHERE analyst = $1 AND kind = 'reset'), 0)",
            analyst)
        return spent, charged
    finally:
        await conn.close()


async def _orphans_gone(backend: Backend, seconds: float) -> bool:
    """Postgres aborts a pushdown whose proxy died (client_connection_check_interval)."""
    conn = await asyncpg.connect(backend.admin_dsn)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            n = await conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                                    "'dp-proxy pushdown' AND state = 'active' AND query LIKE '%dp_per_user%'")
            if n == 0:
                return True
            await asyncio.sleep(0.2)
        return False
    finally:
        await conn.close()


def test_two_proxies_never_overspend(two_proxies: tuple[ProxyProcess, ProxyProcess], backend: Backend) -> None:
    """Alice has ε = 10; 50 queries of ε = 0.4 (twice the limit) race through two proxies.

    (Her δ budget, 1e-4, would allow 100 of these grouped queries: ε is the binding limit.)
    """
    answered: list[int] = []
    errors: list[str | None] = []

    def run(proxy: ProxyProcess) -> None:
        while True:  # (past alice's limits on sessions and DP queries at once: again)
            try:
                with psycopg.connect(proxy.dsn("alice"), autocommit=True) as c:
                    c.execute(Q.format(e=0.4)).fetchall()
                    answered.append(1)
                    return
            except psycopg.Error as e:
                # (psycopg does not keep the SQLSTATE of a refused login)
                if e.sqlstate != "53300" and "too many" not in str(e):
                    errors.append(e.sqlstate)
                    return
            time.sleep(0.05)

    threads = [threading.Thread(target=run, args=(two_proxies[i % 2],)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(answered) == 25, (len(answered), errors)
    assert errors == ["53400"] * 25
    spent, charged = asyncio.run(_ledger_totals(backend, "alice"))
    assert spent == charged == Decimal(10)


def test_proxy_killed_during_a_pushdown_keeps_the_charge(backend: Backend, tmp_path: Path) -> None:
    proxy = ProxyProcess(backend, tmp_path)
    try:
        _crash_during_pushdown(proxy, backend, tmp_path)
    finally:
        if proxy.proc.poll() is None:
            proxy.stop(signal.SIGKILL)


def _crash_during_pushdown(proxy: ProxyProcess, backend: Backend, tmp_path: Path) -> None:
    with psycopg.connect(proxy.dsn("admin"), autocommit=True) as admin:
        admin.execute("SELECT dp_reset_budget('bob')")
    outcome: list[str] = []

    def slow_query() -> None:
        try:
            with psycopg.connect(proxy.dsn("bob"), autocommit=True) as c:
                c.execute(SLOW_DP_QUERY.replace("epsilon=0.2", "epsilon=0.3")).fetchall()
                outcome.append("answered")
        except psycopg.Error:
            outcome.append("lost")

    t = threading.Thread(target=slow_query)
    t.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # wait until the charge is committed
        spent, _ = asyncio.run(_ledger_totals(backend, "bob"))
        if spent > 0:
            break
        time.sleep(0.05)
    os.kill(proxy.proc.pid, signal.SIGKILL)
    proxy.stop()
    t.join(30)
    assert outcome == ["lost"], "the client saw the connection die"
    spent, charged = asyncio.run(_ledger_totals(backend, "bob"))
    assert spent == charged == Decimal("0.3"), "the charge stands and the totals agree with the ledger"
    assert asyncio.run(_orphans_gone(backend, 15)), "the dead proxy's pushdown still runs"
    restarted = ProxyProcess(backend, tmp_path)
    try:
        with psycopg.connect(restarted.dsn("bob"), autocommit=True) as c:
            (left,), = c.execute("SELECT epsilon_remaining FROM dp_budget()").fetchall()
            assert left == Decimal("0.7")
    finally:
        restarted.stop()
