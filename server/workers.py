"""Several worker processes behind one listener (`[listen] workers`), to use more than one core.

The supervisor (the `dp-proxy serve` or `demo` process) owns the listening socket:
it accepts each connection and hands the socket to the worker with the fewest
clients, over a Unix socket pair (SCM_RIGHTS), so it is never in the data path.
It enforces `max_connections` across workers, answers the ops endpoint by asking
every worker (metrics are summed, health is every worker's), forwards SIGHUP,
SIGTERM and SIGINT, and restarts a worker that dies.

Each worker is a `ProxyServer` without a listener of its own. A CancelRequest
may reach any worker (it comes on a new connection) and names the session by the
pid of its backend connection, which says nothing of its worker: the worker that
takes it looks among its own sessions and sends it to the supervisor, which passes
it on to every other worker.

Nothing else is shared: the ledger is in Postgres (DESIGN §4), and each worker has
its own pushdown pool, caches and backend connections.

Control messages are one datagram each (SOCK_SEQPACKET): a tag byte, then
  supervisor → worker: b"F" + a socket (ancillary), b"C" + process id and key,
                       b"M" (metrics?), b"H" (healthy?)
  worker → supervisor: b"R" (ready), b"X" (a client connection ended),
                       b"C" + process id and key (for the others), b"M" + exposition,
                       b"H" + b"1" or b"0"
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

from config import Config
from server.backend_setup import BackendDSNs

if TYPE_CHECKING:
    from server.metrics import Metrics


class WorkerHost(Protocol):
    """What a worker's link needs of the proxy it serves (server.app.ProxyServer is one)."""

    metrics: Metrics

    def cancel(self, process_id: int, secret_key: int, relay: bool = True) -> None: ...
    async def healthy(self) -> bool: ...
    def new_connection(self) -> asyncio.Protocol: ...

log = logging.getLogger("dp_proxy.workers")

_KEY = struct.Struct("!ii")
_MAX_MESSAGE = 1 << 22
"""Largest control message (a metrics exposition); the socket buffers are set to hold it."""
_RESTART_DELAY = 1.0
_MAX_RESTART_DELAY = 30.0


def _control_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _MAX_MESSAGE + 4096)
    return a, b


# ---------------------------------------------------------------------------- supervisor


class WorkerStartError(RuntimeError):
    """A worker exited before it was ready (it printed why)."""


class _Worker:
    """The supervisor's view of one worker process."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen[bytes] | None = None
        self.control: socket.socket | None = None
        self.clients = 0
        self.logged_in = 0
        """Of `clients`, those past their login (the rest are in start-up or login)."""
        self.ready = False
        self.replies: asyncio.Queue[bytes] = asyncio.Queue()
        self.failures = 0
        """Exits in a row without becoming ready: the restart waits 1, 2, 4 ... 30 s."""


class Supervisor:
    """Accepts clients and spreads them over `config.listen.workers` worker processes."""

    def __init__(self, config: Config, dsns: BackendDSNs,
                 config_path: str | None, log_level: str) -> None:
        self.config = config
        self.dsns = dsns
        self.config_path = config_path
        self.log_level = log_level
        self.workers = [_Worker(i) for i in range(config.listen.workers)]
        self.port = 0
        self._listeners: list[socket.socket] = []
        self._accepting: list[asyncio.Task[None]] = []
        self._stopping = False
        self._started = False
        """Every worker was ready once: from then on one that dies is restarted."""
        self._ask = asyncio.Lock()
        self._watch: set[asyncio.Task[None]] = set()
        self.ops: Any = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        listen = self.config.listen
        infos = await loop.getaddrinfo(listen.host or None, listen.port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        # every address the host names, as asyncio's create_server binds them (localhost:
        # 127.0.0.1 and ::1), on one port
        for family, _, _, _, address in dict.fromkeys((i[0], i[1], i[2], i[3], i[4])
                                                      for i in infos):
            sock = socket.socket(family, socket.SOCK_STREAM)
            self._listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if self.port:
                address = (address[0], self.port, *address[2:])
            sock.bind(address)
            sock.listen(1024)
            sock.setblocking(False)
            self.port = int(sock.getsockname()[1])
        for worker in self.workers:
            self._spawn(worker)
        await asyncio.wait_for(self._all_ready(), 60)
        self._started = True
        self._accepting = [loop.create_task(self._accept(s)) for s in self._listeners]
        log.info("listening on %s:%s with %d workers", listen.host, self.port, len(self.workers))
        m = self.config.metrics
        if m.port is not None:
            from server.metrics import OpsServer

            self.ops = OpsServer(self._exposition, self._healthy)
            await self.ops.start(m.host, m.port)

    async def _all_ready(self) -> None:
        while not all(w.ready for w in self.workers):
            for w in self.workers:
                if w.proc is not None and w.proc.poll() is not None and not w.ready:
                    raise WorkerStartError(f"worker {w.index} exited at start (status "
                                           f"{w.proc.returncode})")
            await asyncio.sleep(0.05)

    def _spawn(self, worker: _Worker) -> None:
        mine, theirs = _control_pair()
        spec = {
            "config": self.config.model_dump(mode="json", by_alias=True),
            "dsns": asdict(self.dsns),
            "index": worker.index, "workers": len(self.workers), "control_fd": theirs.fileno(),
            "config_path": self.config_path, "log_level": self.log_level,
        }
        proc = subprocess.Popen([sys.executable, "-m", "server.worker_process"], stdin=subprocess.PIPE,
                                pass_fds=[theirs.fileno()])
        theirs.close()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
        worker.proc, worker.control, worker.clients, worker.ready = proc, mine, 0, False
        worker.logged_in = 0
        worker.replies = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.add_reader(mine.fileno(), self._on_control, worker)
        task = loop.create_task(self._wait_exit(worker, proc))
        self._watch.add(task)
        task.add_done_callback(self._watch.discard)

    async def _wait_exit(self, worker: _Worker, proc: subprocess.Popen[bytes]) -> None:
        code = await asyncio.to_thread(proc.wait)
        if worker.proc is not proc:
            return
        self._drop_control(worker)
        worker.ready = False
        if self._stopping or code == 0 or not self._started:
            # (0: it was stopped by a signal, as the terminal's Ctrl-C stops every process)
            return
        delay = min(_RESTART_DELAY * 2 ** worker.failures, _MAX_RESTART_DELAY)
        worker.failures += 1
        log.error("worker %d exited (status %s); its sessions are lost; restarting it in %g s",
                  worker.index, code, delay)
        await asyncio.sleep(delay)
        if not self._stopping:
            self._spawn(worker)

    def _drop_control(self, worker: _Worker) -> None:
        if worker.control is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(worker.control.fileno())
            worker.control.close()
            worker.control = None

    def _on_control(self, worker: _Worker) -> None:
        assert worker.control is not None
        try:
            data = worker.control.recv(_MAX_MESSAGE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop_control(worker)
            return
        tag, body = data[:1], data[1:]
        if tag == b"R":
            worker.ready = True
            worker.failures = 0
        elif tag in (b"X", b"Y"):  # a client closed before (X) or after (Y) its login
            worker.clients = max(0, worker.clients - 1)
            if tag == b"Y":
                worker.logged_in = max(0, worker.logged_in - 1)
        elif tag == b"A":
            worker.logged_in += 1
        elif tag == b"C":
            for other in self.workers:
                if other is not worker:
                    self._send(other, data)
        elif tag in (b"M", b"H"):
            worker.replies.put_nowait(body)

    def _send(self, worker: _Worker, data: bytes, fds: list[int] | None = None) -> bool:
        if worker.control is None:
            return False
        try:
            if fds:
                socket.send_fds(worker.control, [data], fds)
            else:
                worker.control.send(data)
        except OSError:
            return False
        return True

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(listener)
            except OSError as e:
                log.warning("accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            with conn:
                live = [w for w in self.workers if w.ready and w.control is not None]
                if not live or self._full():
                    self._refuse(conn, bool(live))
                    continue
                worker = min(live, key=lambda w: w.clients)
                if self._send(worker, b"F", [conn.fileno()]):
                    worker.clients += 1
                else:
                    self._refuse(conn, False)

    def _full(self) -> bool:
        """No room for one more connection: max_connections clients are logged in, or
        max_unauthenticated are in their start-up. (A worker admits a login without asking:
        logins in progress can take the logged-in past max_connections by at most
        max_unauthenticated.)"""
        listen = self.config.listen
        logged_in = sum(w.logged_in for w in self.workers)
        starting = sum(w.clients for w in self.workers) - logged_in
        return logged_in >= listen.max_connections or starting >= listen.max_unauthenticated

    def _refuse(self, conn: socket.socket, full: bool) -> None:
        """Answer a connection the workers cannot take with one FATAL error (in the
        supervisor's loop, as a lone ProxyServer answers one over its limit)."""
        from server.errors import CannotConnectNow, TooManyConnections
        from server.replies import Refuse

        err = TooManyConnections("sorry, too many clients already") if full else \
            CannotConnectNow("the proxy is starting up or restarting a worker")
        sock = conn.dup()
        asyncio.get_running_loop().create_task(
            asyncio.get_running_loop().connect_accepted_socket(lambda: Refuse(err), sock))

    async def ask(self, tag: bytes, timeout: float = 5.0) -> list[bytes]:
        """Send `tag` to every worker and collect their replies (a worker that does not answer
        within `timeout` seconds is left out)."""
        async with self._ask:
            asked = [w for w in self.workers if self._send(w, tag)]
            out = []
            for w in asked:
                with contextlib.suppress(TimeoutError):
                    out.append(await asyncio.wait_for(w.replies.get(), timeout))
            return out

    async def _exposition(self) -> bytes:
        return sum_expositions(await self.ask(b"M"))

    async def _healthy(self) -> bool:
        replies = await self.ask(b"H", timeout=2.5)
        return len(replies) == len(self.workers) and all(r == b"1" for r in replies)

    def signal_workers(self, signum: int) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signum)

    async def shutdown(self, graceful: bool) -> None:
        """Stop accepting, pass the stop on to the workers (SIGTERM: they let running queries
        finish within shutdown_grace; SIGINT: at once) and wait for them."""
        self._stopping = True
        for task in self._accepting:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in self._listeners:
            sock.close()
        self.signal_workers(signal.SIGTERM if graceful else signal.SIGINT)
        deadline = self.config.listen.shutdown_grace + 15
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                await asyncio.wait_for(asyncio.to_thread(w.proc.wait), deadline)
            except TimeoutError:
                w.proc.kill()
                await asyncio.to_thread(w.proc.wait)
            self._drop_control(w)
        if self.ops is not None:
            await self.ops.stop()


def sum_expositions(texts: list[bytes]) -> bytes:
    """Prometheus text expositions of processes with the same metrics, as one: each sample's
    value summed over them (counters, histogram buckets and sums, the sessions gauge)."""
    order: list[tuple[str, str, str]] = []
    samples: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode()):
            if family.name not in samples:
                order.append((family.name, family.type, family.documentation))
                samples[family.name] = {}
            acc = samples[family.name]
            for s in family.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                acc[key] = acc.get(key, 0.0) + s.value
    lines = []
    for name, kind, doc in order:
        lines.append(f"# HELP {name} {_escape_help(doc)}")
        lines.append(f"# TYPE {name} {kind}")
        for (sample, labels), value in samples[name].items():
            label_text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)
            lines.append(f"{sample}{{{label_text}}} {value!r}" if labels else f"{sample} {value!r}")
    return ("\n".join(lines) + "\n").encode()


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


# ---------------------------------------------------------------------------- worker


class WorkerLink:
    """A worker's end of its control socket: adopts client sockets, passes on cancels."""

    def __init__(self, server: WorkerHost, control: socket.socket, index: int,
                 workers: int) -> None:
        self.server = server
        self.control = control
        self.index = index
        self.workers = workers

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self.control.fileno(), self._on_control)
        self.control.send(b"R")

    def client_closed(self, logged_in: bool) -> None:
        with contextlib.suppress(OSError):
            self.control.send(b"Y" if logged_in else b"X")

    def client_logged_in(self) -> None:
        with contextlib.suppress(OSError):
            self.control.send(b"A")

    def cancel_elsewhere(self, process_id: int, secret_key: int) -> None:
        with contextlib.suppress(OSError, struct.error):
            self.control.send(b"C" + _KEY.pack(process_id, secret_key))

    def _on_control(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.control, _MAX_MESSAGE, 4)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, fds = b"", []
        if not data:
            # the supervisor is gone: stop as at SIGINT
            asyncio.get_running_loop().remove_reader(self.control.fileno())
            os.kill(os.getpid(), signal.SIGINT)
            return
        tag, body = data[:1], data[1:]
        if tag == b"F":
            for fd in fds:
                self._adopt(socket.socket(fileno=fd))
        elif tag == b"C":
            pid, key = _KEY.unpack(body)
            self.server.cancel(pid, key, relay=False)
        elif tag == b"M":
            self._reply(b"M" + self.server.metrics.exposition())
        elif tag == b"H":
            task = asyncio.get_running_loop().create_task(self._health())
            task.add_done_callback(lambda _: None)
        for fd in fds if tag != b"F" else ():
            os.close(fd)

    async def _health(self) -> None:
        try:
            ok = await asyncio.wait_for(self.server.healthy(), 4)
        except Exception:
            ok = False
        self._reply(b"H" + (b"1" if ok else b"0"))

    def _reply(self, data: bytes) -> None:
        with contextlib.suppress(OSError):
            self.control.send(data)

    def _adopt(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        task = loop.create_task(loop.connect_accepted_socket(self.server.new_connection, sock))
        task.add_done_callback(self._adopted(sock))

    def _adopted(self, sock: socket.socket) -> Callable[[asyncio.Task[Any]], None]:
        def done(task: asyncio.Task[Any]) -> None:
            if task.cancelled() or task.exception() is not None:
                log.warning("could not take a client connection: %s",
                            "cancelled" if task.cancelled() else task.exception())
                sock.close()
                self.client_closed(False)
        return done
