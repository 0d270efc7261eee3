"""Lifecycle: graceful shutdown with a grace period, SIGHUP-style reload of analysts, signals."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest

from config import AnalystConfig, Config
from server.scram import make_verifier
from tests.support.backend import Backend, init_backend
from tests.support.paths import ROOT
from tests.support.processes import await_epsilon_total, config_for
from tests.support.proxy import LoopThread, running_proxy, start_proxy


def _later(loop_thread: LoopThread, coro: object) -> asyncio.Future[object]:
    return asyncio.run_coroutine_threadsafe(coro, loop_thread.loop)  # type: ignore[arg-type]


def test_shutdown_lets_a_running_query_finish_and_closes_idle_sessions(
        loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    px = start_proxy(loop_thread, demo_config, backend)
    busy = psycopg.connect(px.dsn(), autocommit=True)
    idle = psycopg.connect(px.dsn("bob"), autocommit=True)
    result: list[object] = []

    def run_slow() -> None:
        result.append(busy.execute("SELECT pg_sleep(1.0), 42").fetchone())

    worker = threading.Thread(target=run_slow)
    worker.start()
    time.sleep(0.3)  # the query is running
    t0 = time.monotonic()
    done = _later(loop_thread, px.server.shutdown(grace=10))
    time.sleep(0.3)
    # the idle session is closed at once with 57P01
    with pytest.raises(psycopg.OperationalError) as exc:
        idle.execute("SELECT 1")
    assert "administrator command" in str(exc.value)
    # no new sessions
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(px.dsn(), connect_timeout=2)
    worker.join(10)
    done.result(15)
    assert result and result[0] == ("", 42)
    assert time.monotonic() - t0 < 5  # it waited for the query, not for the whole grace period
    assert not px.server.sessions
    busy.close()
    idle.close()


def test_shutdown_grace_expires_for_a_query_that_runs_on(
        loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    px = start_proxy(loop_thread, demo_config, backend)
    conn = psycopg.connect(px.dsn(), autocommit=True)
    errors: list[BaseException] = []

    def run_long() -> None:
        try:
            conn.execute("SELECT pg_sleep(30)").fetchone()
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=run_long)
    worker.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    _later(loop_thread, px.server.shutdown(grace=0.5)).result(15)
    worker.join(10)
    assert time.monotonic() - t0 < 5
    assert errors and isinstance(errors[0], psycopg.OperationalError)
    conn.close()


def _with_analysts(config: Config, **analysts: AnalystConfig) -> Config:
    return config.model_copy(update={"analysts": analysts})


def test_reload_changes_budgets_adds_and_removes_analysts_without_dropping_sessions(
        loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    with running_proxy(loop_thread, demo_config, backend) as px:
        alice = psycopg.connect(px.dsn(), autocommit=True)
        bob = psycopg.connect(px.dsn("bob"), autocommit=True)
        a = demo_config.analysts
        carol = AnalystConfig(scram_verifier=str(make_verifier("carol-pw")), epsilon_budget=3,
                              delta_budget=1e-6)
        dave = carol.model_copy()
        new = _with_analysts(demo_config, alice=a["alice"].model_copy(update={"epsilon_budget": 7.5}),
                             admin=a["admin"], carol=carol, dave=dave)
        new = new.model_copy(update={"listen": new.listen.model_copy(update={"idle_timeout": 99.0})})
        ignored = loop_thread.run(px.server.reload(new))
        assert ignored == ["listen"]
        # alice's session survives and sees her new limit
        row = alice.execute("SELECT epsilon_total FROM dp_budget()").fetchone()
        assert row is not None and float(row[0]) == 7.5
        # bob was removed: his session is closed
        with pytest.raises(psycopg.OperationalError) as exc:
            bob.execute("SELECT 1")
        assert "removed from the configuration" in str(exc.value)
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(px.dsn("bob"))
        # dave has no backend role until an operator runs init-backend; then he can log in
        with pytest.raises(psycopg.OperationalError, match='analyst "dave" has no backend login'):
            psycopg.connect(px.dsn("dave", password="carol-pw"))
        init_backend(backend, _with_analysts(demo_config, **demo_config.analysts, dave=dave))
        psycopg.connect(px.dsn("dave", password="carol-pw")).close()
        # carol (whose role the suite's database has) can log in and has her budget
        with psycopg.connect(px.dsn("carol", password="carol-pw"), autocommit=True) as c:
            row = c.execute("SELECT epsilon_total FROM dp_budget()").fetchone()
            assert row is not None and float(row[0]) == 3
        # the limits change is in the ledger as an appended event
        with psycopg.connect(px.dsn("admin"), autocommit=True) as adm:
            kinds = [r[0] for r in adm.execute("SELECT kind FROM dp_ledger('alice')").fetchall()]
            assert "limits" in kinds
        alice.close()
        bob.close()
    # put the test database's analysts back as the other tests expect them
    with running_proxy(loop_thread, demo_config, backend) as px, \
            psycopg.connect(px.dsn("admin"), autocommit=True) as adm:
        adm.execute("SELECT dp_reset_budget('alice')")


@pytest.mark.skipif(sys.platform != "linux", reason="signals to a child process")
def test_serve_reloads_on_sighup_and_stops_on_sigterm(backend: Backend, tmp_path: Path) -> None:
    cfg = config_for(backend, tmp_path, "dp_pushdown", "dp_restricted")
    text = cfg.read_text()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    text = text.replace("port = 6432", f"port = {port}")
    assert f"port = {port}" in text
    cfg.write_text(text)
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--config", str(cfg)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        dsn = f"host=127.0.0.1 port={port} user=bob password=bob dbname={backend.pushdown.database} sslmode=disable"
        for _ in range(100):
            try:
                conn = psycopg.connect(dsn, autocommit=True)
                break
            except psycopg.OperationalError:
                time.sleep(0.1)
        else:
            raise AssertionError("dp-proxy did not start: " + (tmp_path / "serve.log").read_text())
        cfg.write_text(text.replace("epsilon_budget = 1\n", "epsilon_budget = 2.5\n"))
        assert "epsilon_budget = 2.5" in cfg.read_text()
        os.kill(proc.pid, signal.SIGHUP)
        await_epsilon_total(conn, 2.5, "SIGHUP did not reload bob's budget")
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(15) == 0
        conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    # (bob's limit goes back to the demo's when the next proxy starts: it loads the limits)
