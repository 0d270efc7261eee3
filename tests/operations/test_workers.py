"""`[listen] workers`: a supervisor spreads clients over worker processes (server.workers)."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.workers import sum_expositions
from tests.support.backend import Backend
from tests.support.paths import ROOT
from tests.support.processes import await_epsilon_total, config_for, free_port
from tests.support.proxy import spent


def _values(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_expositions_are_summed_sample_by_sample() -> None:
    a = (b'# HELP dpproxy_sessions Client sessions open\n# TYPE dpproxy_sessions gauge\n'
         b'dpproxy_sessions 2.0\n'
         b'# HELP dpproxy_errors Errors\n# TYPE dpproxy_errors counter\n'
         b'dpproxy_errors_total{sqlstate="42501"} 3.0\n'
         b'# HELP h Time\n# TYPE h histogram\nh_bucket{le="0.1"} 1.0\nh_bucket{le="+Inf"} 2.0\n'
         b'h_count 2.0\nh_sum 0.25\n')
    b = (b'# HELP dpproxy_sessions Client sessions open\n# TYPE dpproxy_sessions gauge\n'
         b'dpproxy_sessions 1.0\n'
         b'# HELP dpproxy_errors Errors\n# TYPE dpproxy_errors counter\n'
         b'dpproxy_errors_total{sqlstate="42501"} 1.0\ndpproxy_errors_total{sqlstate="0A000"} 4.0\n'
         b'# HELP h Time\n# TYPE h histogram\nh_bucket{le="0.1"} 0.0\nh_bucket{le="+Inf"} 1.0\n'
         b'h_count 1.0\nh_sum 0.5\n')
    summed = _values(sum_expositions([a, b]))
    assert summed[("dpproxy_sessions", ())] == 3
    assert summed[("dpproxy_errors_total", (("sqlstate", "42501"),))] == 4
    assert summed[("dpproxy_errors_total", (("sqlstate", "0A000"),))] == 4
    assert summed[("h_bucket", (("le", "0.1"),))] == 1
    assert summed[("h_bucket", (("le", "+Inf"),))] == 3
    assert summed[("h_count", ())] == 3 and summed[("h_sum", ())] == 0.75
    assert _values(sum_expositions([a])) == _values(a)


def _workers(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "server.worker_process"], capture_output=True,
                         text=True, check=False)
    return sorted(int(x) for x in out.stdout.split())


def _worker_of(conn: psycopg.Connection, workers: list[int]) -> int:
    """The index in `workers` of the worker process that serves `conn` (the one holding the
    other end of its socket): the pid the client is told is its backend's, not a worker's."""
    with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
        here, there = sock.getsockname()[1], sock.getpeername()[1]
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, remote = (int(a.rsplit(":", 1)[1], 16) for a in fields[1:3])
            if (local, remote) == (there, here):
                inodes.add(f"socket:[{fields[9]}]")
    found = [i for i, pid in enumerate(workers) for fd in Path(f"/proc/{pid}/fd").iterdir()
             if _link(fd) in inodes]
    assert len(found) == 1, (inodes, found)
    return found[0]


def _link(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _cancel_with_a_wrong_key(conn: psycopg.Connection) -> None:
    with socket.create_connection(("127.0.0.1", conn.info.port)) as sock:
        # (the right key is one of 2**31: psycopg does not show it)
        sock.sendall(struct.pack("!iiii", 16, 80877102, conn.info.backend_pid, 12345))
        assert sock.recv(1) == b""


@contextmanager
def _serve(backend: Backend, tmp_path: Path, **env: str) -> Iterator[tuple[subprocess.Popen[bytes],
                                                                           Path, str]]:
    cfg = config_for(backend, tmp_path, "dp_pushdown", "dp_restricted")
    port = free_port()
    environ = dict(os.environ, DPPROXY_LISTEN__PORT=str(port), **env)
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--config", str(cfg)],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=environ)
    dsn = (f"host=127.0.0.1 port={port} dbname={backend.pushdown.database} sslmode=disable "
           "connect_timeout=5")
    try:
        for _ in range(300):  # (the supervisor logs it once every worker is ready)
            if "listening on" in log_path.read_text() or proc.poll() is not None:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("dp-proxy did not start: " + log_path.read_text())
        assert proc.poll() is None, log_path.read_text()
        yield proc, cfg, dsn
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in _workers(proc.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(sys.platform != "linux", reason="processes and signals")
def test_workers_share_clients_cancels_limits_metrics_reload_and_stop(
        backend: Backend, tmp_path: Path) -> None:
    metrics_port = free_port()
    with _serve(backend, tmp_path, DPPROXY_LISTEN__WORKERS="2", DPPROXY_LISTEN__MAX_CONNECTIONS="4",
                DPPROXY_METRICS__PORT=str(metrics_port)) as (proc, cfg, dsn):
        workers = _workers(proc.pid)
        assert len(workers) == 2
        admin = psycopg.connect(dsn + " user=admin password=admin", autocommit=True)
        admin.execute("SELECT dp_reset_budget('bob')")
        a = psycopg.connect(dsn + " user=bob password=bob", autocommit=True)
        # clients go to the worker with fewer; each is told its own backend's pid
        assert {_worker_of(admin, workers), _worker_of(a, workers)} == {0, 1}
        for conn in (admin, a):
            assert conn.execute("SELECT pg_backend_pid()").fetchone() == (conn.info.backend_pid,)

        # a cancel reaches the session whichever worker the CancelRequest lands on (both are
        # open with one client each: it lands on worker 0 and is passed on to the other);
        # a wrong key cancels nothing, in either worker
        for conn in (admin, a):
            threading.Timer(0.3, _cancel_with_a_wrong_key, (conn,)).start()
            assert conn.execute("SELECT 1 FROM pg_sleep(1)").fetchone() == (1,)
        for conn in (admin, a):
            threading.Timer(0.3, conn.cancel).start()
            t0 = time.monotonic()
            with pytest.raises(psycopg.errors.QueryCanceled):
                conn.execute("SELECT pg_sleep(10)")
            assert time.monotonic() - t0 < 5

        # DP answers and the ledger work in both (one ledger in Postgres)
        for conn in (admin, a):
            row = conn.execute("SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits").fetchone()
            assert row is not None and row[0] > 0
        assert spent(a).epsilon == 1.0

        # max_connections counts the clients of every worker
        b = psycopg.connect(dsn + " user=bob password=bob", autocommit=True)
        c = psycopg.connect(dsn + " user=bob password=bob", autocommit=True)
        with pytest.raises(psycopg.OperationalError, match="too many clients"):
            psycopg.connect(dsn + " user=bob password=bob")
        c.close()
        for _ in range(50):  # the supervisor hears of the close from the worker
            try:
                c = psycopg.connect(dsn + " user=bob password=bob", autocommit=True)
                break
            except psycopg.OperationalError:
                time.sleep(0.1)
        else:
            raise AssertionError("a closed client's slot was not freed")

        # one endpoint: the workers' metrics summed; healthy when every worker is
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            metrics = _values(r.read())
        assert metrics[("dpproxy_sessions", ())] == 4
        assert metrics[("dpproxy_statements_total", (("kind", "pass_through"),
                                                     ("outcome", "error")))] == 2  # (cancelled)
        assert metrics[("dpproxy_statements_total", (("kind", "dp_query"), ("outcome", "ok")))] == 2
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz", timeout=10) as r:
            assert r.status == 200

        # SIGHUP to the supervisor reloads every worker
        cfg.write_text(cfg.read_text().replace("epsilon_budget = 1\n", "epsilon_budget = 2.5\n"))
        os.kill(proc.pid, signal.SIGHUP)
        for conn in (a, b, c):
            await_epsilon_total(conn, 2.5, "SIGHUP did not reload bob's budget in every worker")

        # a worker that dies is restarted (its clients are lost, the others' are not)
        victim_index = _worker_of(a, workers)
        survivor = admin if _worker_of(admin, workers) != victim_index else None
        victim = workers[victim_index]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(psycopg.OperationalError):
            a.execute("SELECT 1")
        if survivor is not None:
            assert survivor.execute("SELECT 1").fetchone() == (1,)
        for conn in (a, b, c, admin):
            conn.close()
        for _ in range(100):
            now = _workers(proc.pid)
            if len(now) == 2 and victim not in now:
                try:
                    psycopg.connect(dsn + " user=bob password=bob").close()
                    psycopg.connect(dsn + " user=bob password=bob").close()
                    break
                except psycopg.OperationalError:
                    pass
            time.sleep(0.1)
        else:
            raise AssertionError("the dead worker was not restarted")

        # SIGTERM stops the supervisor and its workers
        workers = _workers(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(30) == 0
        for pid in workers:
            assert not Path(f"/proc/{pid}").exists() or \
                Path(f"/proc/{pid}/status").read_text().find("State:\tZ") >= 0


@pytest.mark.skipif(sys.platform != "linux", reason="processes and signals")
def test_workers_speak_tls_and_refuse_plaintext_when_required(
        backend: Backend, tmp_path: Path) -> None:
    """The supervisor hands over the socket before a byte is read: SSLRequest, the handshake
    and require_tls happen in the worker, as in a lone proxy. (It listens on every address
    of a host name, as asyncio's create_server does: here localhost.)"""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "server.crt"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    with _serve(backend, tmp_path, DPPROXY_LISTEN__WORKERS="2", DPPROXY_LISTEN__HOST="localhost",
                DPPROXY_TLS__CERT_FILE=str(tmp_path / "server.crt"),
                DPPROXY_TLS__KEY_FILE=str(tmp_path / "server.key"),
                DPPROXY_TLS__REQUIRE="true") as (proc, _, dsn):
        plain = dsn.replace("sslmode=disable", "sslmode=verify-full sslrootcert=" +
                            str(tmp_path / "ca.crt"))
        conns = [psycopg.connect(plain + " user=bob password=bob") for _ in range(2)]
        assert {_worker_of(c, _workers(proc.pid)) for c in conns} == {0, 1}
        for c in conns:
            assert c.pgconn.ssl_in_use
            assert c.execute("SELECT count(*) FROM countries").fetchone() == (152,)
            c.close()
        with pytest.raises(psycopg.OperationalError, match=r"TLS|SSL|ssl"):
            psycopg.connect(dsn + " user=bob password=bob")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_unreachable_backend_is_one_line_and_exit_1(tmp_path: Path, workers: str) -> None:
    from server.backend_setup import BackendDSNs
    from server.bootstrap import demo_config_text
    from server.dsn import DSN

    cfg = tmp_path / "unreachable.toml"
    cfg.write_text(demo_config_text(BackendDSNs(*(DSN("127.0.0.1", 1, role, "x") for role in
                                                  ("dp_restricted", "dp_pushdown", "dp_ledger"))),
                                    free_port()))
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--config", str(cfg)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, DPPROXY_LISTEN__WORKERS=workers))
    assert out.returncode == 1
    assert "dp-proxy: cannot start:" in out.stderr and "(backend 127.0.0.1:1)" in out.stderr
    assert "Traceback" not in out.stderr and "restarting" not in out.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="processes and signals")
def test_by_default_one_worker_per_core_each_with_its_share_of_the_pool(
        backend: Backend, tmp_path: Path) -> None:
    """`workers = "auto"` (the default) starts one worker per usable core; the pushdown pool
    (`pushdown_pool_size`, the proxy's total) is divided among them: with 2 connections and
    2 workers, two DP queries on one worker run their pushdowns one after the other."""
    from config.models import usable_cores

    with _serve(backend, tmp_path) as (proc, _, _):
        assert len(_workers(proc.pid)) == (usable_cores() if usable_cores() > 1 else 0)
    with _serve(backend, tmp_path, DPPROXY_LISTEN__WORKERS="2",
                DPPROXY_BACKEND__PUSHDOWN_POOL_SIZE="2") as (proc, _, dsn), \
            psycopg.connect(backend.admin_dsn, autocommit=True) as watch:
        conns = [psycopg.connect(dsn + " user=alice password=alice", autocommit=True)
                 for _ in range(3)]
        where = [_worker_of(c, _workers(proc.pid)) for c in conns]
        pair = [c for c, w in zip(conns, where, strict=True) if w == where[0]]
        assert len(pair) == 2  # (clients go to the worker with fewer: 0, 1, 0)
        answers: list[tuple[int, ...] | None] = []

        def ask(c: psycopg.Connection) -> None:
            answers.append(c.execute("SELECT COUNT(*) FROM visits").fetchone())

        with psycopg.connect(backend.admin_dsn) as locker:
            locker.execute("LOCK TABLE visits IN ACCESS EXCLUSIVE MODE")
            threads = [threading.Thread(target=ask, args=(c,)) for c in pair]
            for t in threads:
                t.start()
            seen: list[int] = []
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                row = watch.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE usename = %s "
                    "AND datname = current_database() AND wait_event_type = 'Lock'",
                    (backend.pushdown.user,)).fetchone()
                assert row is not None
                seen.append(row[0])
                time.sleep(0.05)
            assert max(seen) == 1 and seen[-1] == 1  # the second query waits for the pool
            locker.rollback()
        for t in threads:
            t.join(30)
        assert len(answers) == 2 and all(a is not None for a in answers)
        # one pool connection per worker: the log says DP queries cannot split, and the fix
        assert "fewer than pushdown_split (4), so DP queries split less; raise " \
            "pushdown_pool_size to 8 for full splits" in (tmp_path / "serve.log").read_text()
        for c in conns:
            c.close()


def test_the_supervisor_does_not_load_the_dp_engine() -> None:
    """The supervisor reads the configuration and hands sockets on: numpy and pglast (tens of
    MiB each process) stay in the workers."""
    out = subprocess.run([sys.executable, "-c",
                          "import sys, server.cli, server.workers, server.replies, config; "
                          "print(sorted(m for m in ('numpy', 'pglast', 'server.app', "
                          "'server.session', 'dp_core.mechanisms') if m in sys.modules))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(sys.platform != "linux", reason="processes and signals")
def test_a_worker_that_cannot_start_is_retried_with_backoff(backend: Backend,
                                                           tmp_path: Path) -> None:
    """A worker that dies and then cannot start again (here: the pushdown role refused) is
    retried after 1, 2, 4 ... s (at most 30), not every second forever."""
    role = backend.pushdown.user
    with _serve(backend, tmp_path, DPPROXY_LISTEN__WORKERS="2") as (proc, _, _), \
            psycopg.connect(backend.admin_dsn, autocommit=True) as admin:
        log = tmp_path / "serve.log"
        admin.execute(f'ALTER ROLE "{role}" CONNECTION LIMIT 0')
        try:
            os.kill(_workers(proc.pid)[0], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and "restarting it in 4 s" not in log.read_text():
                time.sleep(0.2)
        finally:
            admin.execute(f'ALTER ROLE "{role}" CONNECTION LIMIT -1')
        text = log.read_text()
        assert ["in 1 s" in text, "in 2 s" in text, "in 4 s" in text] == [True] * 3, text
