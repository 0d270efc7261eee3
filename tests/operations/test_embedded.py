"""The embedded Postgres: start, stop, crash, kept data, stale clean-up; and the demo CLI's lifecycle."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import pytest

from server.demo_data import COUNTRIES
from server.embedded import EmbeddedPostgres, _parent_of, _pids, remove_stale_clusters
from tests.support.processes import free_port


def _children(pid: int) -> list[int]:
    return [q for q in _pids() if _parent_of(q) == pid]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill 0; it is gone for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _select_one(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval("SELECT 1"))
    finally:
        await conn.close()


@pytest.mark.live  # starts a Postgres of its own
def test_start_query_stop_leaves_nothing() -> None:
    pg = EmbeddedPostgres(tcp=True).start()
    pid = pg.pid
    base = pg.socket_dir.parent
    assert pid is not None and pg.is_running()
    assert asyncio.run(_select_one(pg.dsn())) == 1
    assert asyncio.run(_select_one(pg.tcp_dsn())) == 1
    pg.stop()
    assert not _alive(pid)
    assert not base.exists()
    pg.stop()  # a second stop is harmless


@pytest.mark.live  # starts a Postgres of its own
def test_crash_of_the_server_process_is_detected_and_cleaned() -> None:
    pg = EmbeddedPostgres().start()
    pid = pg.pid
    assert pid is not None
    base = pg.socket_dir.parent
    asyncio.run(_select_one(pg.dsn()))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pg.is_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pg.is_running()
    pg.stop()
    assert not base.exists()
    assert not _children(pid)


@pytest.mark.live  # starts a Postgres of its own
def test_data_dir_is_kept_when_asked() -> None:
    import shutil
    import tempfile

    parent = Path(tempfile.mkdtemp(prefix="dp-proxy-test-"))
    parent.chmod(0o755)  # reachable by the Postgres OS user when the tests run as root
    data = parent / "pgdata"
    try:
        with EmbeddedPostgres(data_dir=data) as pg:
            asyncio.run(_exec(pg.dsn(), "CREATE TABLE kept (x int); INSERT INTO kept VALUES (7)"))
        assert (data / "PG_VERSION").exists()
        with EmbeddedPostgres(data_dir=data) as pg:
            assert asyncio.run(_fetchval(pg.dsn(), "SELECT x FROM kept")) == 7
    finally:
        shutil.rmtree(parent, ignore_errors=True)


async def _exec(dsn: str, sql: str) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


async def _fetchval(dsn: str, sql: str) -> object:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


def test_stale_cluster_of_a_dead_owner_is_removed(tmp_path: Path) -> None:
    import tempfile

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = Path(tempfile.mkdtemp(prefix="dp-proxy-pg-"))
    (stale / "owner.pid").write_text(str(dead.pid))
    live = Path(tempfile.mkdtemp(prefix="dp-proxy-pg-"))
    (live / "owner.pid").write_text(str(os.getpid()))
    try:
        removed = remove_stale_clusters()
        assert stale in removed and not stale.exists()
        assert live.exists()
    finally:
        import shutil

        shutil.rmtree(live, ignore_errors=True)


def _start_demo(port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "demo", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("dp-proxy demo did not listen within 60 s")


@pytest.mark.live  # starts a Postgres of its own
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_demo_stops_postgres_on_signal(sig: signal.Signals) -> None:
    import psycopg

    port = free_port()
    proc = _start_demo(port)
    try:
        postmasters = [q for q in _children(proc.pid)]
        assert postmasters, "the demo runs no postgres child"
        with psycopg.connect(f"host=127.0.0.1 port={port} user=alice password=alice dbname=demo "
                             "sslmode=disable") as conn:
            assert conn.execute("SELECT count(*) FROM countries").fetchone() == (len(COUNTRIES),)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:  # a failed assertion above must not leave the demo running
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
    assert proc.returncode == 0, out
    assert "psql \"postgresql://alice:alice@127.0.0.1:" in out
    assert "stopped" in out
    for pid in postmasters:
        assert not _alive(pid), f"postgres {pid} still running after {sig.name}"


def _private_copy_of_pgserver(home: Path) -> Path:
    """pgserver's install tree and its `.libs` sibling, laid out as in site-packages, under a
    0700 directory (a virtualenv in /root): returns the copy's bin directory."""
    import shutil

    from server.embedded import find_bindir

    bindir = find_bindir()
    prefix, package = bindir.parent, bindir.parent.parent
    site = home / "venv" / "site-packages"
    shutil.copytree(prefix, site / package.name / prefix.name, symlinks=True)
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, site / libs.name, symlinks=True)
    home.chmod(0o700)
    return site / package.name / prefix.name / bindir.name


@pytest.mark.live  # starts a Postgres of its own
@pytest.mark.skipif(os.geteuid() != 0, reason="the private-home case arises only as root")
def test_root_in_a_private_home_starts_postgres_and_replaces_a_broken_copy(tmp_path: Path) -> None:
    """As root from a 0700 home, Postgres runs as the OS user from a world-readable copy that
    keeps pgserver's RPATH layout; a broken copy left by an older version is replaced."""
    import shutil

    from server.embedded import _bindir_for_uid, _ensure_os_user, find_bindir

    if not (find_bindir().parent.parent.parent / f"{find_bindir().parent.parent.name}.libs").is_dir():
        pytest.skip("Postgres binaries are not pgserver's (no .libs directory beside them)")
    home = tmp_path / "root-home"
    home.mkdir()
    bindir = _private_copy_of_pgserver(home)
    with EmbeddedPostgres(bindir=bindir) as pg:
        assert asyncio.run(_select_one(pg.dsn())) == 1
    cached = _bindir_for_uid(bindir, _ensure_os_user("dpproxy-pg"))
    assert cached != bindir
    libs = cached.parent.parent.parent / f"{cached.parent.parent.name}.libs"
    shutil.rmtree(libs)  # what the broken copy of the earlier layout looked like
    with EmbeddedPostgres(bindir=bindir) as pg:
        assert asyncio.run(_select_one(pg.dsn())) == 1
    assert libs.is_dir()
    shutil.rmtree(cached.parent.parent.parent, ignore_errors=True)


def test_cached_copies_of_a_removed_installation_are_removed(tmp_path: Path) -> None:
    """A copy whose installation is gone (a deleted checkout's virtualenv) is removed when a
    new copy is made; one whose installation is there, or that names none, is kept."""
    from server.embedded import _SOURCE, _remove_orphan_copies

    installed = tmp_path / "venv" / "pginstall"
    installed.mkdir(parents=True)
    copies = {name: tmp_path / f"dp-proxy-pginstall-{name}" for name in ("gone", "here", "old")}
    for copy in copies.values():
        copy.mkdir()
    (copies["gone"] / _SOURCE).write_text(str(tmp_path / "deleted" / "pginstall"))
    (copies["here"] / _SOURCE).write_text(str(installed))
    _remove_orphan_copies(tmp_path)
    assert not copies["gone"].exists()
    assert copies["here"].exists() and copies["old"].exists()

