"""A throwaway Postgres cluster for the demo and the tests, started from pgserver's binaries."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PG_OS_USER = "dpproxy-pg"
"""The unprivileged OS account that runs Postgres when dp-proxy itself runs as root."""

_PR_SET_PDEATHSIG = 1
_BASE_PREFIX = "dp-proxy-pg-"
_OWNER_FILE = "owner.pid"


def remove_stale_clusters() -> list[Path]:
    """Remove temporary clusters whose owning process is gone (it was killed with -9).

    Their postmaster has already stopped: it gets a signal when its parent dies.
    """
    removed = []
    for base in Path(tempfile.gettempdir()).glob(_BASE_PREFIX + "*"):
        try:
            owner = int((base / _OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        postmaster = _postmaster_pid(base / "data")
        if not _pid_alive(owner) and (postmaster is None or not _pid_alive(postmaster)):
            shutil.rmtree(base, ignore_errors=True)
            removed.append(base)
    return removed


def _postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EmbeddedPostgresError(RuntimeError):
    """The embedded cluster could not be created, started or stopped."""


def find_bindir() -> Path:
    """Return a directory holding `initdb` and `postgres`.

    pgserver's wheel is preferred (it works anywhere pip does); otherwise the
    binaries on PATH, or those `pg_config --bindir` names.
    """
    with contextlib.suppress(ImportError):
        import importlib.util

        spec = importlib.util.find_spec("pgserver")
        if spec is not None and spec.origin is not None:
            candidate = Path(spec.origin).parent / "pginstall" / "bin"
            if (candidate / "postgres").exists():
                return candidate
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        candidate = Path(out.stdout.strip())
        if (candidate / "initdb").exists():
            return candidate
    raise EmbeddedPostgresError(
        "no Postgres binaries found: install the 'pgserver' package or put initdb on PATH"
    )


def _world_traversable(path: Path) -> bool:
    """True when every directory from / down to `path` can be entered by any user."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents])


def _ensure_os_user(name: str) -> tuple[int, int]:
    import pwd

    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
        )
        entry = pwd.getpwnam(name)
    return entry.pw_uid, entry.pw_gid


_CACHE_LAYOUT = "3"
"""Bumped when what the cache holds changes, so that a copy made by an older layout is not reused."""


def _bindir_for_uid(bindir: Path, run_as: tuple[int, int] | None = None) -> Path:
    """A copy of the installation that an unprivileged user can execute.

    Running as root, a virtualenv under a 0700 home is out of the Postgres user's reach; the
    install tree (bin, lib, share) is then copied once into a world-readable cache keyed by its
    location. pgserver's binaries find their shared libraries through
    `RPATH $ORIGIN/../../../pgserver.libs` (a sibling of the package, as auditwheel lays it
    out), so the copy keeps that layout: `<cache>/<package>/<install>` beside
    `<cache>/<package>.libs`. A cached copy is used only after its `initdb --version` runs as
    `run_as`; a broken one (an older layout, a partial copy) is replaced.
    """
    if _world_traversable(bindir):
        return bindir
    prefix = bindir.parent
    package = prefix.parent
    libs = package.parent / f"{package.name}.libs"
    key = hashlib.sha256(
        f"{_CACHE_LAYOUT}:{prefix}:{prefix.stat().st_mtime_ns}".encode()
    ).hexdigest()[:12]
    cache = Path(tempfile.gettempdir()) / f"dp-proxy-pginstall-{key}"
    cached_bindir = cache / package.name / prefix.name / bindir.name
    if cache.exists() and not _runs(cached_bindir, run_as):
        shutil.rmtree(cache, ignore_errors=True)
    if not cache.exists():
        _remove_orphan_copies(cache.parent)
        staging = Path(tempfile.mkdtemp(prefix="dp-proxy-pginstall-"))
        tree = staging / "tree"
        shutil.copytree(prefix, tree / package.name / prefix.name, symlinks=True)
        (tree / _SOURCE).write_text(str(prefix))
        if libs.is_dir():
            shutil.copytree(libs, tree / libs.name, symlinks=True)
        for root, dirs, files in os.walk(staging):
            for name in dirs + files:
                p = Path(root) / name
                if not p.is_symlink():
                    p.chmod(p.stat().st_mode | stat.S_IROTH | stat.S_IXOTH | stat.S_IRGRP)
        staging.chmod(0o755)
        with contextlib.suppress(OSError):  # another process won the race; its copy is as good
            tree.rename(cache)
        shutil.rmtree(staging, ignore_errors=True)
    if not _runs(cached_bindir, run_as):
        raise EmbeddedPostgresError(
            f"the copy of Postgres's binaries in {cache} does not run as the OS user "
            f"{PG_OS_USER!r}: remove it and try again, or run dp-proxy as an ordinary user"
        )
    return cached_bindir


_SOURCE = "source"
"""A cached copy's file naming the installation it copies."""


def _remove_orphan_copies(directory: Path) -> None:
    """Remove cached copies whose installation is gone (a virtualenv deleted with its
    checkout, as each fresh CI clone leaves one): 34 MB each otherwise left in /tmp."""
    for cache in directory.glob("dp-proxy-pginstall-*"):
        with contextlib.suppress(OSError):
            source = (cache / _SOURCE).read_text().strip()
            if source and not Path(source).exists():
                shutil.rmtree(cache, ignore_errors=True)


def _runs(bindir: Path, run_as: tuple[int, int] | None) -> bool:
    """True when `initdb --version` from `bindir` runs (as `run_as`): its libraries load."""
    user, group = run_as if run_as is not None else (None, None)
    try:
        out = subprocess.run(
            [str(bindir / "initdb"), "--version"],
            capture_output=True, check=False, user=user, group=group, timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _set_parent_death_signal() -> None:
    """Runs in the forked child: the postmaster shuts down fast if dp-proxy dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGINT)


@dataclass
class EmbeddedPostgres:
    """A private Postgres cluster owned by this process.

    It listens on a Unix socket in a private directory (and on a free loopback
    TCP port when `tcp` is set), trusts local connections as superuser
    `postgres`, and is removed entirely by `stop()` unless `data_dir` was given.
    """

    data_dir: Path | None = None
    tcp: bool = False
    fast: bool = True
    """Trade durability for speed (fsync off): right for throwaway clusters."""
    host_auth: str = "trust"
    """pg_hba method for TCP connections (e.g. "md5", "scram-sha-256"); the socket always trusts."""

    bindir: Path | None = None
    """Where initdb and postgres are; found by `find_bindir()` when not given."""

    port: int = 5432
    socket_dir: Path = field(init=False)
    _base: Path | None = field(init=False, default=None)
    _proc: subprocess.Popen[bytes] | None = field(init=False, default=None)
    _uid: int | None = field(init=False, default=None)
    _gid: int | None = field(init=False, default=None)
    _bindir: Path | None = field(init=False, default=None)
    _data: Path | None = field(init=False, default=None)

    @property
    def keep_data(self) -> bool:
        return self.data_dir is not None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def dsn(self, user: str = "postgres", database: str = "postgres") -> str:
        """A libpq/asyncpg URI that reaches the cluster over its Unix socket."""
        return f"postgresql://{user}@/{database}?host={self.socket_dir}&port={self.port}"

    def tcp_dsn(self, user: str = "postgres", database: str = "postgres") -> str:
        if not self.tcp:
            raise EmbeddedPostgresError("the cluster was started without TCP")
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 60.0) -> EmbeddedPostgres:
        """Create the cluster if needed and start it; returns when it accepts connections."""
        if self.is_running():
            return self
        bindir = self.bindir if self.bindir is not None else find_bindir()
        if os.geteuid() == 0:
            self._uid, self._gid = _ensure_os_user(PG_OS_USER)
            bindir = _bindir_for_uid(bindir, (self._uid, self._gid))
        remove_stale_clusters()
        self._base = Path(tempfile.mkdtemp(prefix=_BASE_PREFIX))
        self._base.chmod(0o700)
        (self._base / _OWNER_FILE).write_text(str(os.getpid()))
        data = self.data_dir if self.data_dir is not None else self._base / "data"
        self.socket_dir = self._base / "sock"
        self.socket_dir.mkdir(mode=0o700)
        data.mkdir(parents=True, exist_ok=True)
        if self.keep_data and self._uid is not None and not _world_traversable(data.parent):
            raise EmbeddedPostgresError(
                f"{data}: running as root, Postgres runs as the OS user {PG_OS_USER!r}, "
                "which cannot reach this directory: choose one whose parents are world-searchable"
            )
        for p in (self._base, self.socket_dir, data):
            if self._uid is not None:
                os.chown(p, self._uid, self._gid or -1)
        try:
            if not (data / "PG_VERSION").exists():
                self._run(
                    [
                        str(bindir / "initdb"),
                        "-D", str(data),
                        "-U", "postgres",
                        "--auth-local=trust",
                        f"--auth-host={self.host_auth}",
                        "--encoding=UTF8",
                        "--locale=C",
                        "--no-sync",
                    ]
                )
            self._bindir, self._data = bindir, data
            self._launch(bindir, data, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, timeout: float = 60.0) -> None:
        """Fast-shutdown the postmaster and start it again on the same data, socket and port
        (what an operator's restart does to the proxy: every connection drops)."""
        proc, self._proc = self._proc, None
        if proc is None or self._bindir is None or self._data is None:
            raise EmbeddedPostgresError("the cluster is not running")
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            proc.wait(timeout)
        self._reap_orphans(proc.pid)
        self._launch(self._bindir, self._data, timeout, keep_port=True)

    def _run(self, argv: list[str]) -> None:
        out = subprocess.run(
            argv, capture_output=True, text=True, check=False, user=self._uid, group=self._gid
        )
        if out.returncode != 0:
            raise EmbeddedPostgresError(f"{Path(argv[0]).name} failed: {out.stderr.strip()}")

    def _launch(self, bindir: Path, data: Path, timeout: float, keep_port: bool = False) -> None:
        for attempt in range(5):
            if self.tcp and not keep_port:
                self.port = _free_loopback_port()
            argv = [
                str(bindir / "postgres"),
                "-D", str(data),
                "-k", str(self.socket_dir),
                "-h", "127.0.0.1" if self.tcp else "",
                "-p", str(self.port),
                "-c", "max_connections=300",  # the proxy's 200 clients, its pool, admins
                "-c", "shared_buffers=128MB",
                "-c", "log_min_messages=warning",
            ]
            if self.fast and not self.keep_data:
                argv += ["-c", "fsync=off", "-c", "synchronous_commit=off",
                         "-c", "full_page_writes=off"]
            log = open(data / "postgres.log", "ab")  # noqa: SIM115 - handed to the child
            self._proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                user=self._uid,
                group=self._gid,
                start_new_session=True,  # a Ctrl-C reaches dp-proxy, which stops us in order
                preexec_fn=_set_parent_death_signal,
            )
            log.close()
            if self._wait_ready(data, timeout):
                return
            if self.tcp and attempt < 4 and self._proc.poll() is not None:
                continue  # the free port was taken in between: try another
            tail = (data / "postgres.log").read_text(errors="replace")[-2000:]
            raise EmbeddedPostgresError(f"postgres did not start:\n{tail}")

    def _wait_ready(self, data: Path, timeout: float) -> bool:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        pidfile = data / "postmaster.pid"
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            with contextlib.suppress(OSError):
                lines = pidfile.read_text().splitlines()
                if len(lines) >= 8 and lines[7].strip() == "ready":
                    return True
            time.sleep(0.05)
        return False

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the postmaster (fast shutdown, then harder) and remove what `start` made.

        Safe to call twice, and after the server crashed.
        """
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGINT, timeout), (signal.SIGQUIT, 5.0), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if proc is not None:
            self._reap_orphans(proc.pid)
        if self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)
            self._base = None

    @staticmethod
    def _reap_orphans(postmaster_pid: int) -> None:
        """After a postmaster crash its backends exit on their own; wait briefly for them."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if not any(_parent_of(pid) == postmaster_pid for pid in _pids()):
                return
            time.sleep(0.05)

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _pids() -> Iterator[int]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
