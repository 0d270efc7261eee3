"""A client session's state and output: what every other part of a session works on.

The session is built in layers, one concern per module, each class extending
the one below: this state and output, the dp.* settings (`settings`), start-up
and authentication (`startup`), the statements the proxy answers itself
(`answers`), the extended protocol's local statements and portals
(`extended`), the implicit block of a Query of several statements
(`implicit_block`), and the input with its routing by message tag (`client`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from dp_core.classify import Statement
from dp_core.errors import DPError
from dp_core.settings import Caps, DPSettings
from server import backend
from server import wire as p
from server.block_settings import BlockSettings
from server.errors import IdleSessionTimeout
from server.replies import error_response

if TYPE_CHECKING:
    from config import Config
    from dp_core.classify import Classifier
    from server.dp_query import DPService
    from server.logs import StatementLogger
    from server.metrics import Metrics


class SessionHost(Protocol):
    """What a session needs of the proxy that serves it (server.app.ProxyServer is one)."""

    config: Config
    database: str
    classifier: Classifier
    caps: Caps
    dp: DPService
    metrics: Metrics
    statement_log: StatementLogger
    mock_secret: bytes

    def register_key(self, session: SessionCore) -> tuple[int, int]: ...
    def advertise(self, session: SessionCore, backend_pid: int) -> None: ...
    def unregister(self, session: SessionCore) -> None: ...
    def logged_in(self, session: SessionCore) -> None: ...
    def cancel(self, process_id: int, secret_key: int, relay: bool = True) -> None: ...
    async def cancel_backend(self, key: tuple[int, int]) -> None: ...
    async def connect_backend(self, analyst: str,
                              parameters: dict[str, str]) -> backend.BackendLink: ...
    def default_settings(self) -> DPSettings: ...
    def ssl_context(self) -> ssl.SSLContext: ...


log = logging.getLogger("dp_proxy.session")


_IDLE_POLL = 1.0
"""Seconds between the idle timer's looks while a query runs."""


class AlreadyReported(Exception):
    """The error has reached the client already (relayed from the backend)."""


class State(Enum):
    STARTUP = "startup"
    AUTHENTICATING = "authenticating"
    READY = "ready"
    FAILED_BATCH = "failed-batch"
    """An extended-protocol message failed: discard everything until Sync."""
    CLOSED = "closed"


READY, CLOSED = State.READY, State.CLOSED
"""For the per-read path (an Enum member is a slow class attribute on Python 3.11)."""


@dataclass(frozen=True)
class LocalStatement:
    """A prepared statement the proxy answers itself (it never reached the backend)."""

    statement: Statement
    param_types: tuple[int, ...]
    n_params: int
    """What a Bind must supply: the declared types or the highest $n, whichever is more."""


@dataclass(frozen=True)
class LocalPortal:
    statement: LocalStatement
    bind: p.Bind


class SessionCore:
    """A client session's state and output (`Session` is the whole session)."""

    # slots: attribute reads stay fast however many there are (see BackendLink)
    __slots__ = ("_clock", "_dp_charged", "_dp_task", "_idle_handle", "_input", "_last_input", "_plain",
                 "_portals_epoch", "_ran_query", "_startup_task", "_task", "_tls_ok",
                 "backlog", "block_settings", "bound_checks", "busy", "config", "exhausted_portals", "frames",
                 "link", "local_portals", "local_statements", "process_id", "proto", "reading_paused",
                 "secret_key", "server", "state", "transport", "user")

    def __init__(
        self, server: SessionHost, transport: asyncio.Transport, proto: asyncio.Protocol
    ) -> None:
        self.server = server
        self.config = server.config
        self.transport = transport
        self.proto = proto
        self.state = State.STARTUP
        self.frames = p.FrameReader(self.config.listen.max_message_size, startup=True)
        self.link: backend.BackendLink | None = None
        self.user = ""
        self.process_id, self.secret_key = server.register_key(self)
        self.block_settings = BlockSettings(server.default_settings())
        """The session's dp.* settings, with their transaction semantics."""
        self.local_statements: dict[str, LocalStatement] = {}
        self.bound_checks: dict[str, Statement] = {}
        """Forwarded prepared statements whose parameters' values are checked at Bind (their
        `at_bind`), by name."""
        self.local_portals: dict[str, LocalPortal] = {}
        self.exhausted_portals: set[str] = set()
        """Local portals whose DP answer has been sent (until the name is bound again)."""
        self._portals_epoch = 0
        """The link's `idle_readies` when the local portals were last known open: once it
        moves on, their transaction has ended, and they with it."""
        self.backlog: deque[tuple[bytes, bytes]] = deque()
        self.busy = False
        self.reading_paused = False
        self._input = asyncio.Event()
        """Set when bytes arrive during startup, which reads its frames itself."""
        self._task: asyncio.Task[None] | None = None
        self._dp_task: asyncio.Task[Any] | None = None
        self._dp_charged = False
        """The running DP query is charged: a cancel no longer changes its outcome (when a
        cancel wins would be a clock on the work that remains, DESIGN §3.11)."""
        self._idle_handle: asyncio.TimerHandle | None = None
        self._clock = asyncio.get_running_loop().time
        self._last_input = self._clock()
        """When the client last sent bytes (loop time), for the idle timeout."""
        self._ran_query = False
        """The idle timer saw a query in flight and has not yet seen it end."""
        classifier = server.classifier
        self._plain = classifier.is_plain_pass_through_bytes
        self._tls_ok = self.config.tls.enabled

    def write(self, data: bytes) -> None:
        if self.state is not State.CLOSED:
            self.transport.write(data)

    def send(self, *messages: Any) -> None:
        encoding = self.link.codec if self.link is not None else "utf-8"
        self.write(b"".join(m.encode(encoding) for m in messages))

    def send_error(self, err: DPError) -> None:
        self.server.metrics.errors.labels(err.sqlstate).inc()
        self.send(error_response(err))

    def statement_done(self, kind: str, started: float, sqlstate: str | None) -> None:
        """Count one finished statement (or pass-through cycle) and log it if the config asks."""
        server = self.server
        if kind == "pass_through" and sqlstate is None:
            server.metrics.pass_through_ok += 1
        else:
            server.metrics.statement(kind, sqlstate is None).inc()
        slog = server.statement_log
        if slog.wants(kind, sqlstate):
            slog.write(self.process_id, self.user, kind, sqlstate, time.perf_counter() - started)

    def fatal(self, err: DPError) -> None:
        """Send a FATAL error and close the connection."""
        if self.state is State.CLOSED:
            return
        if err.severity != "FATAL":
            err.severity = "FATAL"
        with contextlib.suppress(Exception):
            self.send_error(err)
        self.close()

    @property
    def idle(self) -> bool:
        """Nothing in flight: no DP or local work, nothing queued, no reply awaited from the
        backend (a session still starting up counts as idle: it has no query yet)."""
        if self.state is not State.READY:
            return True
        return not (self.busy or self.backlog or (self.link is not None and self.link.pending))

    def close(self) -> None:
        if self.state is State.CLOSED:
            return
        self.state = State.CLOSED
        if self._idle_handle is not None:
            self._idle_handle.cancel()
        self.server.unregister(self)
        if self.link is not None:
            self.link.close()
        with contextlib.suppress(Exception):
            self.transport.close()
        self._input.set()

    def client_lost(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self.close()

    def _arm_idle_timer(self, delay: float) -> None:
        self._idle_handle = asyncio.get_running_loop().call_later(delay, self._idle_check)

    def _idle_check(self) -> None:
        """The idle timeout: close a session that has had nothing in flight and no input for
        `idle_timeout` seconds. Input does not re-arm the timer (that would cost a timer per
        read on the pass-through path); the timer looks at when input last came instead, and
        polls while a query runs (idle time starts when the timer first sees it finished)."""
        self._idle_handle = None
        if self.state is not State.READY:
            return
        timeout = self.config.listen.idle_timeout
        now = self._clock()
        if not self.idle:
            self._ran_query = True
            self._arm_idle_timer(min(timeout, _IDLE_POLL))
            return
        if self._ran_query:
            self._ran_query = False
            self._last_input = now
        left = self._last_input + timeout - now
        if left > 0:
            self._arm_idle_timer(left)
        else:
            self.fatal(IdleSessionTimeout("terminating connection due to idle-session timeout"))

    def dp_charged(self) -> None:
        """The DP query this session runs has been charged: from now on it runs to its
        release (or its generic failure), whatever CancelRequest comes."""
        self._dp_charged = True

    def cancel(self) -> None:
        """A CancelRequest named this session: cancel what runs now (pass-through or DP)."""
        if self._dp_task is not None and not self._dp_task.done() and not self._dp_charged:
            self._dp_task.cancel()
        if self.link is not None and self.link.key is not None and self.link.pending:
            asyncio.get_running_loop().create_task(self.server.cancel_backend(self.link.key))
