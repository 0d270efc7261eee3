"""One client session: startup and authentication, then routing every message in order.

Pass-through messages are forwarded synchronously from `data_received` when
nothing is queued ahead of them (the fast path). A message that needs the
proxy itself (a refusal, `SET dp.*`, a DP query) is handled by a task, after
the backend has answered everything forwarded before it, so replies reach
the client in the order of the requests. Messages that arrive meanwhile wait
in a backlog.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol, cast

from config import AuthMethod
from dp_core.classify import (
    TRANSACTION_EFFECTS,
    Effect,
    Statement,
    StatementKind,
)
from dp_core.errors import (
    BindMismatch,
    ConnectionFailure,
    DPError,
    FeatureNotSupported,
    InFailedSqlTransaction,
    InternalError,
    InvalidAuthorization,
    InvalidPassword,
    NoActiveSqlTransaction,
    ObjectNotInPrerequisiteState,
    ProtocolViolationError,
    QueryCanceled,
    SyntaxError_,
    TooManyConnections,
)
from dp_core.parsetree import const_value, highest_parameter
from dp_core.result import copy_result, set_transaction_sql
from dp_core.settings import Caps, DPSettings
from server import backend
from server import protocol as p
from server.backend_setup import quote_ident
from server.block_settings import BlockSettings
from server.encodings import UnsupportedEncoding, codec, invalid_text, untranslatable
from server.replies import error_response
from server.scram import MECHANISM, ScramError, ScramServer, Verifier

if TYPE_CHECKING:
    from config import Config
    from dp_core.classify import Classifier
    from server.logs import StatementLogger
    from server.metrics import Metrics


class SessionHost(Protocol):
    """What a session needs of the proxy that serves it (server.app.ProxyServer is one)."""

    config: Config
    database: str
    classifier: Classifier
    caps: Caps
    dp: Any
    """The DP path (server.dp.DPService)."""
    metrics: Metrics
    statement_log: StatementLogger
    mock_secret: bytes

    def register_key(self, session: Session) -> tuple[int, int]: ...
    def unregister(self, session: Session) -> None: ...
    def logged_in(self, session: Session) -> None: ...
    def cancel(self, process_id: int, secret_key: int) -> None: ...
    async def cancel_backend(self, key: tuple[int, int]) -> None: ...
    async def connect_backend(self, analyst: str,
                              parameters: dict[str, str]) -> backend.BackendLink: ...
    def default_settings(self) -> DPSettings: ...
    def ssl_context(self) -> ssl.SSLContext: ...

log = logging.getLogger("dp_proxy.session")

MAX_BACKLOG = 1024
"""Queued client messages before the proxy stops reading from the client."""

TEXT_OID = 25
_LENGTH = struct.Struct("!i")
_FAST_KINDS = {
    ord("Q"): backend.Pending.QUERY, ord("P"): backend.Pending.PARSE,
    ord("B"): backend.Pending.BIND, ord("D"): backend.Pending.DESCRIBE,
    ord("E"): backend.Pending.EXECUTE, ord("C"): backend.Pending.CLOSE,
    ord("S"): backend.Pending.SYNC, ord("H"): None,
}
"""Frames the fast path forwards, by tag byte, and the reply each awaits."""
_P, _Q, _S, _E = ord("P"), ord("Q"), ord("S"), ord("E")
_SLOW: Any = object()
"""`_FAST_KINDS.get`'s default: a frame the fast path does not forward."""


def _pending_kinds(data: bytes, start: int, stop: int) -> list[backend.Pending]:
    """The replies awaited by the frames of data[start:stop] (whole frames `_FAST_KINDS` knows)."""
    out = []
    while start < stop:
        kind = _FAST_KINDS[data[start]]
        if kind is not None:
            out.append(kind)
        start += 1 + _LENGTH.unpack_from(data, start + 1)[0]
    return out


_LOG_KINDS = {
    StatementKind.DP_QUERY: "dp_query", StatementKind.DP_EXPLAIN: "dp_explain",
    StatementKind.REFUSED: "refused", StatementKind.PASS_THROUGH: "pass_through",
}
"""Statement kinds as metrics and logs name them; the proxy's other answers are "local"."""
_NAMED = frozenset(b"BDCE")
"""Frames that name a statement or portal, which may be one the proxy answers itself."""
_FORWARDED = (StatementKind.PASS_THROUGH, StatementKind.EMPTY)
_DP_KINDS = (StatementKind.DP_QUERY, StatementKind.DP_EXPLAIN, StatementKind.LOCAL_FUNCTION)
_IDLE_POLL = 1.0
"""Seconds between the idle timer's looks while a query runs."""


class _AlreadyReported(Exception):
    """The error has reached the client already (relayed from the backend)."""


class State(Enum):
    STARTUP = "startup"
    AUTHENTICATING = "authenticating"
    READY = "ready"
    FAILED_BATCH = "failed-batch"
    """An extended-protocol message failed: discard everything until Sync."""
    CLOSED = "closed"


_READY, _CLOSED = State.READY, State.CLOSED
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


def _login_refused(analyst: str, sqlstate: str | None) -> DPError:
    """What a client is told when the backend refuses its analyst's own login: too many of
    the analyst's sessions (the role's CONNECTION LIMIT), or a role not set up yet."""
    if sqlstate == "53300":
        return TooManyConnections(
            f'too many connections for analyst "{analyst}"',
            hint="close another session of this analyst; an operator can raise its "
                 "max_connections (then run dp-proxy init-backend)")
    if sqlstate in ("28000", "28P01"):
        return InvalidAuthorization(
            f'analyst "{analyst}" has no backend login',
            hint="an operator must run dp-proxy init-backend after adding an analyst")
    return ConnectionFailure("could not connect to the backend database")


def _non_standard_strings() -> DPError:
    err = DPError("dp-proxy needs standard_conforming_strings = on",
                  detail="it reads string literals as Postgres does with that setting; with "
                         "it off, 'a\\' would mean something else to Postgres",
                  hint="leave standard_conforming_strings at its default, on")
    err.sqlstate = "0A000"
    err.severity = "FATAL"
    return err


def _unsupported_encoding(exc: UnsupportedEncoding) -> DPError:
    err = DPError(f"client_encoding {exc.name} is not supported by dp-proxy", detail=exc.detail,
                  hint="use UTF8 (PGCLIENTENCODING=UTF8, or SET client_encoding TO 'UTF8'); the "
                       "LATIN, WIN, KOI8 and EUC encodings work too")
    err.sqlstate = "0A000"
    err.severity = "FATAL"
    return err


class ClientProtocol(asyncio.Protocol):
    """The asyncio protocol of one client connection; all logic is in Session."""

    def __init__(self, server: SessionHost) -> None:
        self.server = server
        self.session: Session | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.session = Session(self.server, cast(asyncio.Transport, transport), self)

    def data_received(self, data: bytes) -> None:
        if self.session is not None:
            self.session.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.session is not None:
            self.session.client_lost()

    def pause_writing(self) -> None:
        if self.session is not None and self.session.link is not None:
            self.session.link.pause_reading()

    def resume_writing(self) -> None:
        if self.session is not None and self.session.link is not None:
            self.session.link.resume_reading()


class Session:
    # slots: attribute reads stay fast however many there are (see BackendLink)
    __slots__ = ("_clock", "_dp_charged", "_dp_task", "_idle_handle", "_input", "_last_input", "_plain",
                 "_portals_epoch", "_ran_query", "_startup_task", "_task", "_tls_ok",
                 "backlog", "block_settings", "busy", "config", "exhausted_portals", "frames",
                 "link", "local_portals", "local_statements", "process_id", "proto", "reading_paused",
                 "secret_key", "server", "state", "transport", "user")

    def __init__(
        self, server: SessionHost, transport: asyncio.Transport, proto: ClientProtocol
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
        self._startup_task = asyncio.get_running_loop().create_task(self._startup())

    # ------------------------------------------------------------------ input

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state is _CLOSED:
            return
        self._last_input = self._clock()  # the idle timer reads it when it fires
        link = self.link
        if (state is _READY and not self.busy and not self.backlog
                and not self.frames.buffered and link is not None and not link.skipping):
            rest = self._fast_forward(link, data)  # the common case: no copy into the buffer
            if not rest:
                return
            self.frames.feed(rest)
            self._pump(fast=False)
            return
        self.frames.feed(data)
        if self.state in (State.STARTUP, State.AUTHENTICATING):
            # the startup coroutine frames the input itself, one packet at a time, so
            # that nothing sent behind an SSLRequest is parsed before the handshake
            self._input.set()
            return
        self._pump()

    def _pump(self, fast: bool = True) -> None:
        link = self.link
        if fast and link is not None and self.state is State.READY and not self.busy \
                and not self.backlog and not link.skipping:
            rest = self._fast_forward(link, self.frames.take_buffer())
            if not rest:
                return
            self.frames.feed(rest)
        if link is not None:
            link.cork()  # one write to the backend for everything this read forwards
        try:
            while self.state is not State.CLOSED and (frame := self.frames.next_raw()) is not None:
                self.on_frame(*frame)
        except p.ProtocolViolation as e:
            self.fatal(ProtocolViolationError(str(e)))
        finally:
            if link is not None:
                link.uncork()

    def _fast_forward(self, link: backend.BackendLink, data: bytes) -> bytes:
        """Forward the leading run of plain pass-through frames of `data` without decoding them.

        Stops at the first frame that needs the proxy (or is malformed, or
        incomplete) and returns the bytes from there on, for the general path.
        Each forwarded frame is noted in the link's pending queue and cycles as
        `BackendLink.forward` would, except that the frames before a forwarded
        Sync are noted as the Sync alone: up to its ReadyForQuery the backend's
        replies are all theirs, as they are a simple Query's.
        """
        n = len(data)
        pos = 0
        limit = self.frames.max_size
        plain = self._plain
        local = bool(self.local_statements or self.local_portals)
        pending, cycles = link.pending, link.cycles
        kinds, unpack = _FAST_KINDS, _LENGTH.unpack_from
        unsynced = -1
        """Where the frames forwarded since the last Sync of this run begin (-1: none)."""
        batch = link.batch_started  # (`BackendLink.note_cycle`'s state, in a local for the loop)
        now = time.perf_counter()
        while pos + 5 <= n:
            tag = data[pos]  # an int: cheaper than a one-byte slice
            length = unpack(data, pos + 1)[0]
            end = pos + 1 + length
            kind = kinds.get(tag, _SLOW)
            if length < 4 or length > limit or end > n or kind is _SLOW:
                break
            if tag == _S:
                unsynced = -1
                pending.append(kind)
                cycles.append(batch)
                batch = None
            elif tag == _P:
                name_end = data.find(b"\0", pos + 5, end)
                sql_end = data.find(b"\0", name_end + 1, end) if name_end >= 0 else -1
                if sql_end < 0 or self.local_statements or \
                        not plain(data[name_end + 1 : sql_end]):
                    break
                if unsynced < 0:
                    unsynced = pos
            elif tag == _Q:
                if data[end - 1] != 0 or not plain(data[pos + 5 : end - 1]):
                    break
                if local:
                    self._drop_unnamed(link)
                if unsynced >= 0:
                    pending.extend(_pending_kinds(data, unsynced, pos))
                    unsynced = -1
                pending.append(kind)
                cycles.append(now)
            elif local and tag in _NAMED:
                break  # names may be local: let the general path look
            elif kind is not None:  # Bind, Describe, Execute, Close (a Flush awaits nothing)
                if unsynced < 0:
                    unsynced = pos
                if tag == _E and batch is None:
                    batch = now
            pos = end
        link.batch_started = batch
        if unsynced >= 0:
            pending.extend(_pending_kinds(data, unsynced, pos))
        if pos:
            link.write(data[:pos] if pos < n else data)
        return data[pos:] if pos else data

    def on_frame(self, tag: bytes, raw: bytes) -> None:
        if self.busy or self.backlog:
            self.backlog.append((tag, raw))
            if len(self.backlog) > MAX_BACKLOG and not self.reading_paused:
                self.reading_paused = True
                self.transport.pause_reading()
            return
        work = self.handle(tag, raw)
        if work is not None:
            self._run(work)

    def _run(self, work: Awaitable[None]) -> None:
        self.busy = True
        self._task = asyncio.get_running_loop().create_task(self._work(work))

    async def _work(self, work: Awaitable[None]) -> None:
        try:
            await work
            while self.backlog and self.state is not State.CLOSED:
                tag, raw = self.backlog.popleft()
                if self.reading_paused and len(self.backlog) < MAX_BACKLOG // 2:
                    self.reading_paused = False
                    self.transport.resume_reading()
                nxt = self.handle(tag, raw)
                if nxt is not None:
                    await nxt
        except asyncio.CancelledError:
            raise
        except p.ProtocolViolation as e:
            self.fatal(ProtocolViolationError(str(e)))
        except DPError as e:
            self.fatal(e)
        except Exception:
            log.exception("session %s: internal error", self.process_id)
            self.fatal(InternalError())
        finally:
            self.busy = False

    # ------------------------------------------------------------------ output

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
            err = DPError("terminating connection due to idle-session timeout")
            err.sqlstate = "57P05"
            self.fatal(err)

    # ------------------------------------------------------------------ startup

    async def _next_startup_frame(self) -> tuple[bytes, bytes]:
        while True:
            if self.state is State.CLOSED:
                raise ConnectionResetError
            frame = self.frames.next_raw()
            if frame is not None:
                return frame
            self._input.clear()
            await self._input.wait()

    async def _startup(self) -> None:
        try:
            async with asyncio.timeout(self.config.listen.startup_timeout):
                await self._negotiate()
        except TimeoutError:
            self.fatal(ProtocolViolationError("canceling authentication due to timeout"))
        except ConnectionResetError:
            self.close()
        except p.ProtocolViolation as e:
            self.fatal(ProtocolViolationError(str(e)))
        except DPError as e:
            self.fatal(e)
        except Exception:
            log.exception("session %s: internal error during startup", self.process_id)
            self.fatal(InternalError())

    async def _negotiate(self) -> None:
        while True:
            _, raw = await self._next_startup_frame()
            packet = p.decode_startup(raw[4:])
            if isinstance(packet, (p.SSLRequest, p.GSSENCRequest)) and self.frames.buffered:
                # bytes behind an encryption request could be injected by a third party
                raise ProtocolViolationError("received unencrypted data after SSL request")
            if isinstance(packet, p.SSLRequest):
                await self._ssl_request()
                continue
            if isinstance(packet, p.GSSENCRequest):
                self.write(b"N")
                continue
            if isinstance(packet, p.CancelRequest):
                self.server.cancel(packet.process_id, packet.secret_key)
                self.close()
                return
            assert isinstance(packet, p.StartupMessage)
            self.frames.startup = False  # from here on, messages are typed
            break
        if self.config.tls.require and not isinstance(
            self.transport.get_extra_info("ssl_object"), ssl.SSLObject
        ):
            raise InvalidAuthorization("this proxy requires TLS: connect with sslmode=require")
        params = packet.parameters
        if params.get("replication", "false").lower() not in ("false", "0", "off", "no"):
            raise InvalidAuthorization("replication connections are not allowed through dp-proxy")
        self.user = params["user"]
        self.state = State.AUTHENTICATING
        await self._authenticate()
        self.server.logged_in(self)
        database = params.get("database") or self.user
        if database != self.server.database:
            err = DPError(f'database "{database}" does not exist',
                          hint=f'this proxy serves the database "{self.server.database}"')
            err.sqlstate = "3D000"
            raise err
        forwarded = {k: v for k, v in params.items() if k not in ("user", "database")}
        try:
            self.link = await self.server.connect_backend(self.user, forwarded)
        except backend.BackendError as e:
            log.warning("session %s: backend connection failed: %s", self.process_id, e)
            raise _login_refused(self.user, dict(e.fields).get("C")) from None
        except (OSError, TimeoutError) as e:
            log.warning("session %s: backend connection failed: %s", self.process_id, e)
            raise ConnectionFailure("could not connect to the backend database") from None
        if self.link.parameters.get("standard_conforming_strings") != "on":
            self.link.close()
            raise _non_standard_strings()
        encoding = self.link.parameters.get("client_encoding", "UTF8")
        if codec(encoding) is None:  # (the link kept the encoding it had: UTF8)
            self.link.close()
            raise _unsupported_encoding(UnsupportedEncoding(encoding))
        # relayed bytes go straight to the transport: it no longer changes (TLS is set up)
        self.link.target = backend.RelayTarget(self.transport.write, self._backend_lost)
        self.link.on_cycle = functools.partial(self.statement_done, "pass_through")
        self.link.counter = self.server.metrics
        self.link.on_tx_end = self._settle
        self.link.log_cycles = self.server.statement_log.log_all
        self.write(b"".join(self.link.startup_frames))
        self.send(p.BackendKeyData(self.process_id, self.secret_key),
                  p.ReadyForQuery(self.link.tx_status))
        self.state = State.READY
        self._last_input = self._clock()
        if self.config.listen.idle_timeout > 0:
            self._arm_idle_timer(self.config.listen.idle_timeout)
        self._pump()  # anything the client pipelined behind its login

    async def _ssl_request(self) -> None:
        if not self._tls_ok or self.transport.get_extra_info("ssl_object") is not None:
            self.write(b"N")
            return
        self.write(b"S")
        loop = asyncio.get_running_loop()
        new_transport = await loop.start_tls(
            self.transport, self.proto, self.server.ssl_context(), server_side=True
        )
        assert new_transport is not None
        self.transport = new_transport

    async def _authenticate(self) -> None:
        analyst = self.config.analysts.get(self.user)
        if self.config.auth_method is AuthMethod.TRUST:
            if analyst is None:
                raise InvalidAuthorization(f'role "{self.user}" does not exist')
            self.send(p.Authentication(p.AUTH_OK))
            return
        verifier = None
        if analyst is not None and analyst.scram_verifier is not None:
            verifier = Verifier.parse(analyst.scram_verifier)
        exchange = ScramServer(verifier, mock_seed=self.server.mock_secret + self.user.encode())
        self.send(p.Authentication.sasl([MECHANISM]))
        message = f'password authentication failed for user "{self.user}"'
        failed: DPError = InvalidPassword(message) if analyst else InvalidAuthorization(message)
        try:
            tag, raw = await self._next_startup_frame()
            if tag != b"p":
                raise ProtocolViolationError(f"expected SASL response, got message type {tag!r}")
            first = p.SASLInitialResponse.parse(p.PasswordMessage(raw[5:]))
            if first.mechanism != MECHANISM or first.data is None:
                raise ProtocolViolationError("client selected an invalid SASL authentication mechanism")
            server_first = exchange.handle_client_first(first.data)
            self.send(p.Authentication(p.AUTH_SASL_CONTINUE, server_first))
            tag, raw = await self._next_startup_frame()
            if tag != b"p":
                raise ProtocolViolationError(f"expected SASL response, got message type {tag!r}")
            server_final = exchange.verify_final(raw[5:])
        except (ScramError, UnicodeDecodeError, p.ProtocolViolation):
            raise failed from None
        self.send(p.Authentication(p.AUTH_SASL_FINAL, server_final), p.Authentication(p.AUTH_OK))

    def _backend_lost(self, exc: Exception | None) -> None:
        if self.state is _CLOSED:
            return
        if isinstance(exc, backend.NonStandardStrings):
            self.fatal(_non_standard_strings())
        elif isinstance(exc, UnsupportedEncoding):
            self.fatal(_unsupported_encoding(exc))
        else:
            self.fatal(ConnectionFailure("the connection to the backend database was lost"))

    # ------------------------------------------------------------------ routing

    def handle(self, tag: bytes, raw: bytes) -> Awaitable[None] | None:
        """Handle one client message; returns work to await when it cannot finish now."""
        link = self.link
        assert link is not None
        if self.state is State.FAILED_BATCH or link.skipping:
            # after an error in an extended batch, everything up to Sync is ignored (by the
            # backend too, for its own errors: it would answer nothing the proxy forwarded)
            if tag == b"S":
                self.state = State.READY
                link.forward(raw, tag)
            elif tag == b"X":
                self.close()
            return None
        try:
            return self._route(tag, raw, link)
        except DPError as e:
            return self._fail(e, extended=tag != b"Q")
        except p.InvalidText as e:
            # as Postgres: an error in this statement (or batch), not the end of the session
            return self._fail(invalid_text(e.raw, link.encoding), extended=tag != b"Q")

    def _route(self, tag: bytes, raw: bytes, link: backend.BackendLink) -> Awaitable[None] | None:
        if tag == b"Q":
            sql = _query_text(raw, link.codec)
            if self.server.classifier.is_plain_pass_through(sql):
                self._drop_unnamed(link)
                link.forward(raw, tag)
                return None
            self.local_statements.pop("", None)
            stmts = self.server.classifier.classify(sql)  # (a syntax error keeps the portal)
            self._drop_unnamed(link)
            if all(s.kind in _FORWARDED and not self._follows(s) for s in stmts):
                link.forward(raw, tag)
                return None
            return self._simple_query(stmts)
        if tag == b"P":
            msg = p.decode_frontend(tag, raw[5:], link.codec)
            assert isinstance(msg, p.Parse)
            if self.server.classifier.is_plain_pass_through(msg.sql):
                self._forwarded_parse(msg.name)
                link.forward(raw, tag)
                return None
            stmts = self.server.classifier.classify(msg.sql)
            if len(stmts) > 1:
                raise SyntaxError_("cannot insert multiple commands into a prepared statement")
            st = stmts[0]
            if st.kind in _FORWARDED and not self._follows(st, prepared=bool(msg.name)):
                self._forwarded_parse(msg.name)
                link.forward(raw, tag)
                return None
            return self._local_parse(msg, st)
        if tag == b"B":
            # only the names decide the route: decode the whole message only when local
            portal_name, statement_name = _two_names(raw, link.codec)
            local = self.local_statements.get(statement_name)
            if local is None:
                if portal_name == "" and "" in self.local_portals:
                    return self._forward_unnamed_bind(raw)
                link.forward(raw, tag)  # (a local named portal's shadow: 42P03, as Postgres)
                return None
            bind = p.decode_frontend(tag, raw[5:], link.codec)
            assert isinstance(bind, p.Bind)
            return self._local_async(self._local_bind(bind, local))
        if tag in (b"D", b"C"):
            table: dict[str, Any] = (
                self.local_statements if raw[5:6] == b"S" else self.local_portals
            )
            if not table or _name_after_kind(raw, link.codec) not in table:
                link.forward(raw, tag)
                return None
            msg = p.decode_frontend(tag, raw[5:], link.codec)
            assert isinstance(msg, (p.Describe, p.Close))
            if isinstance(msg, p.Close):
                return self._local(lambda: self._local_close(msg))
            return self._local_async(self._local_describe(msg))
        if tag == b"E":
            portal = self.local_portals.get(_first_name(raw, link.codec)) \
                if self.local_portals else None
            if portal is None:
                link.forward(raw, tag)
                return None
            ex = p.decode_frontend(tag, raw[5:], link.codec)
            assert isinstance(ex, p.Execute)
            return self._local_async(self._local_execute(ex, portal))
        if tag in (b"S", b"H", b"d", b"c", b"f"):
            link.forward(raw, tag)
            return None
        if tag == b"X":
            self.close()
            return None
        if tag == b"F":
            raise FeatureNotSupported("the fast-path function call interface is not supported")
        if tag == b"p":
            raise ProtocolViolationError("unexpected password message")
        raise ProtocolViolationError(f"invalid frontend message type {tag!r}")

    def _fail(self, err: DPError, extended: bool) -> Awaitable[None] | None:
        self.statement_done("refused", time.perf_counter(), err.sqlstate)
        if err.severity == "FATAL":
            self.fatal(err)
            return None

        async def report() -> None:
            assert self.link is not None
            await self.link.drain()
            if self._backend_failed_batch():
                self.state = State.FAILED_BATCH if extended else self.state
                return
            if extended:
                await self._fail_batch(err)
            else:
                self.send_error(err)
                await self._fail_backend(extended=False)
                self.send(p.ReadyForQuery(self.link.tx_status))

        return report()

    def _forward_unnamed_bind(self, raw: bytes) -> Awaitable[None]:
        """A Bind of the unnamed portal that the backend answers, while the unnamed portal
        is a local one: as in Postgres, it replaces that portal unless it fails before
        making its own (no such statement, a malformed Bind, a failed block: the old
        portal stays), or the backend skips it after an earlier error."""
        link = self.link
        assert link is not None

        async def bind() -> None:
            await link.drain()  # (so that an error is this Bind's)
            if self._backend_failed_batch():
                self.state = State.FAILED_BATCH  # (the backend would skip it)
                return
            before = link.errors
            link.forward(raw, b"B")
            await link.drain()
            if link.errors == before or link.last_sqlstate not in _BIND_KEEPS_PORTAL:
                self.local_portals.pop("", None)

        return bind()

    def _backend_failed_batch(self) -> bool:
        """True when the backend reported an error since its last ReadyForQuery."""
        assert self.link is not None
        return self.link.errors > self.link.errors_at_ready

    def _local(self, fn: Callable[[], None]) -> Awaitable[None]:
        """Answer an extended-protocol message locally, after everything before it."""

        async def run() -> None:
            assert self.link is not None
            await self.link.drain()
            if self._backend_failed_batch():
                self.state = State.FAILED_BATCH
                return
            try:
                fn()
            except DPError as e:
                await self._fail_batch(e)

        return run()

    def _local_async(self, work: Awaitable[None]) -> Awaitable[None]:
        async def run() -> None:
            assert self.link is not None
            await self.link.drain()
            if self._backend_failed_batch():
                self.state = State.FAILED_BATCH
                if asyncio.iscoroutine(work):
                    work.close()
                return
            try:
                await work
            except _AlreadyReported:
                self.state = State.FAILED_BATCH
            except DPError as e:
                await self._fail_batch(e)

        return run()

    async def _fail_batch(self, err: DPError) -> None:
        """An extended-protocol message the proxy answers failed: the error, then everything
        up to Sync ignored, by the backend too (`_fail_backend`)."""
        self.send_error(err)
        self.state = State.FAILED_BATCH
        await self._fail_backend(extended=True)

    async def _fail_backend(self, extended: bool) -> None:
        """After an error of the proxy's own, the backend fails as Postgres would: an open
        block is aborted; an extended batch skips to its Sync, its implicit transaction
        rolled back (`BackendLink.fail_transaction`). A Query outside a block has nothing
        to abort."""
        link = self.link
        if link is None or link.closed or (not extended and link.tx_status != b"T"):
            return
        link.fail_transaction(extended)
        await link.drain()

    # ------------------------------------------------------------------ simple query

    async def _simple_query(self, stmts: tuple[Statement, ...]) -> None:
        """A Query the proxy answers statement by statement (some are its own).

        Postgres runs the statements of a Query of several in an implicit block
        wherever no block is open: an error rolls back those before it, a cursor
        lives until the end, SET LOCAL lasts until then; BEGIN makes it the
        client's block, COMMIT and ROLLBACK end it with a warning, savepoints are
        refused. The proxy opens its own BEGIN for such a block (COMMIT or, after
        an error, ROLLBACK at its end, the client told nothing) and answers the
        transaction commands inside it as Postgres does (`_in_implicit_block`).
        """
        link = self.link
        assert link is not None
        await link.drain()
        # as Postgres, a Query drops the unnamed statement, and the unnamed portal when it
        # runs a statement: not in a failed block, where it fails first (a divergence is left
        # for a Query that the backend fails in planning: it keeps the portal there)
        link.close_quietly(b"S", "")
        if link.tx_status != b"E":
            link.close_quietly(b"P", "")
        several = sum(st.kind is not StatementKind.EMPTY for st in stmts) > 1 \
            and not any(_transaction_command(st) in _NOT_EMULATED for st in stmts)
        implicit = False
        """The proxy's own block is open (the client sees no block)."""
        failed = False
        for st in stmts:
            if st.kind is StatementKind.EMPTY:
                continue
            command = _transaction_command(st)
            if several and not implicit and link.tx_status == b"I" and command not in _BEGINS:
                link.run_quietly("BEGIN")
                await link.drain()
                implicit = True
            try:
                if implicit and command is not None:
                    implicit = await self._in_implicit_block(st, command)
                elif st.kind is StatementKind.PASS_THROUGH:
                    await self._split_statement(st)
                else:
                    await self._run_local_statement(st, describe=True)
            except _AlreadyReported:
                failed = True
                break
            except DPError as e:
                self.send_error(e)
                failed = True
                if not implicit:
                    await self._fail_backend(extended=False)
                break
        if implicit and not link.closed:
            link.run_quietly("ROLLBACK" if failed else "COMMIT")
            await link.drain()
        self.send(p.ReadyForQuery(link.tx_status))

    async def _backend_accepts(self, send: Callable[[], None]) -> bool:
        """Send messages of the proxy's own (`send`) and wait for their replies: False when
        the backend refused one (its error relayed; the backend then skips to Sync)."""
        link = self.link
        assert link is not None
        before = link.errors
        send()
        await link.drain()
        return link.errors == before

    async def _split_statement(self, st: Statement) -> None:
        """Run one forwarded statement of a split Query on the backend (its replies relayed
        but its ReadyForQuery); raises _AlreadyReported when it fails."""
        link = self.link
        assert link is not None
        started = time.perf_counter()
        try:
            link.send_split_query(st.sql)
        except UnicodeEncodeError as e:
            raise untranslatable(e, link.encoding) from None
        await link.drain()
        failed = link.last_split_failed
        self.statement_done("pass_through", started, link.last_sqlstate if failed else None)
        if failed:
            raise _AlreadyReported()
        self._follow(st)

    async def _in_implicit_block(self, st: Statement, command: str) -> bool:
        """A transaction command inside the proxy's implicit block, answered as Postgres
        answers it inside its own (xact.c); returns whether the block stays the proxy's."""
        link = self.link
        assert link is not None
        if command in _BEGINS:
            if st.tree["TransactionStmt"].get("options") and not await self._backend_accepts(
                    lambda: link.run_quietly(set_transaction_sql(st.sql))):
                raise _AlreadyReported()  # (its errors as BEGIN's)
            # the block is the client's from now on
            self.send(p.CommandComplete(
                "START TRANSACTION" if command == "TRANS_STMT_START" else "BEGIN"))
            return False
        chain = bool(st.tree["TransactionStmt"].get("chain"))
        if command in _ENDS:
            commit = command == "TRANS_STMT_COMMIT"
            if chain:
                raise NoActiveSqlTransaction(
                    f"{'COMMIT' if commit else 'ROLLBACK'} AND CHAIN can only be used in "
                    "transaction blocks")
            link.run_quietly("COMMIT" if commit else "ROLLBACK")
            await link.drain()
            self.send(_no_transaction_warning("there is no transaction in progress"),
                      p.CommandComplete("COMMIT" if commit else "ROLLBACK"))
            return False
        raise NoActiveSqlTransaction(f"{_SAVEPOINT_COMMANDS[command]} can only be used in "
                                     "transaction blocks")

    async def _run_local_statement(
        self, st: Statement, describe: bool, bind: p.Bind | None = None,
        param_types: tuple[int, ...] = (), execute: p.Execute | None = None,
    ) -> None:
        """Answer one non-pass-through statement, counted and logged with its outcome."""
        started = time.perf_counter()
        sqlstate: str | None = "XX000"
        try:
            await self._answer_local(st, describe, bind, param_types, execute)
            sqlstate = None
        except DPError as e:
            sqlstate = e.sqlstate
            raise
        except asyncio.CancelledError:
            sqlstate = "57014"
            raise
        finally:
            self.statement_done(_LOG_KINDS.get(st.kind, "local"), started, sqlstate)

    async def _answer_local(
        self, st: Statement, describe: bool, bind: p.Bind | None, param_types: tuple[int, ...],
        execute: p.Execute | None = None,
    ) -> None:
        """Answer one non-pass-through statement (or a forwarded one the proxy follows): its
        rows (with RowDescription if asked); `execute`, the client's Execute of its portal."""
        self._check_transaction(st)
        if st.kind is StatementKind.REFUSED:
            assert st.refusal is not None
            raise st.refusal
        if st.kind is StatementKind.LOCAL_SET:
            self._set(st, extended=bind is not None)
            reset = st.tree.get("VariableSetStmt", {}).get("kind") == "VAR_RESET"
            self._pipeline_step(execute)
            self.send(p.CommandComplete("RESET" if reset else "SET"))
            return
        if st.kind is StatementKind.LOCAL_SHOW:
            assert st.setting is not None
            value = self.settings.show(st.setting)
            if describe:
                self.send(p.RowDescription((p.FieldDescription(st.setting, type_oid=TEXT_OID),)))
            self._pipeline_step(execute)
            self.send(p.DataRow((value.encode(),)), p.CommandComplete("SHOW"))
            return
        if st.kind is StatementKind.LOCAL_FUNCTION:
            self._check_cursor_block(st)
            sql = await self.server.dp.local_function(self, st, bind=bind, param_types=param_types)
            await self.relay_result(_wrapped(st, sql), bind, execute=execute)
            return
        if st.kind is StatementKind.PASS_THROUGH:  # one with an effect on the proxy's state
            await self.relay_result(st.sql, bind, client_statement=True)
            self._follow(st, extended=bind is not None)
            return
        if st.kind in _DP_KINDS:
            self._check_cursor_block(st)
            cursor = st.cursor
            if cursor is not None:  # a name in use is refused before the charge
                link = self.link
                assert link is not None
                declare = cursor.declare("SELECT", quote_ident)
                if not await self._backend_accepts(
                        lambda: link.try_declare(declare, cursor.name, bind is not None)):
                    raise _AlreadyReported()
            # its own task, so that a CancelRequest can stop it (and its pushdown) alone
            self._dp_charged = False
            self._dp_task = asyncio.get_running_loop().create_task(
                self.server.dp.answer(self, st, bind, param_types))
            try:
                sql, notices = await self._dp_task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the session itself is closing
                raise QueryCanceled("canceling statement due to user request") from None
            finally:
                self._dp_task = None
            await self.relay_result(_wrapped(st, sql), bind, execute=execute)
            self.send(*notices)
            return
        raise InternalError()

    @property
    def settings(self) -> DPSettings:
        """The session's dp.* settings now."""
        return self.block_settings.now(self.link)

    @property
    def caps(self) -> Caps:
        """The proxy's caps on dp.* settings."""
        return self.server.caps

    def _settle(self) -> None:
        """Settle the dp.* settings of a block that changed them and has ended (the link
        calls this when it notes an end)."""
        self.block_settings.settle(self.link)

    def _set(self, st: Statement, extended: bool = False) -> None:
        """SET [LOCAL] / RESET dp.*, with Postgres's transaction semantics (`BlockSettings`)."""
        assert st.setting is not None
        name = st.setting
        body = st.tree.get("VariableSetStmt", {})
        kind = body.get("kind", "VAR_SET_VALUE")
        value: str | float | int | None
        if kind in ("VAR_SET_DEFAULT", "VAR_RESET"):
            value = self.server.default_settings().show(name)
        else:
            args = body.get("args", [])
            if len(args) != 1:
                raise SyntaxError_(f"SET {name} takes one value")
            value = const_value(args[0])
            if value is None:
                raise SyntaxError_(f"SET {name} takes a number or a name")
        caps = self.server.caps
        self._assign(lambda s: s.with_value(name, value, caps), bool(body.get("is_local")),
                     extended)

    def _pipeline_step(self, execute: p.Execute | None) -> None:
        """A client's Execute the proxy answers itself without the backend: the backend runs
        a no-op in its place (`BackendLink.pipeline_step`), as it would have run the statement
        in the client's pipeline."""
        if execute is not None and self.link is not None:
            self.link.pipeline_step()

    def _assign(self, change: Callable[[DPSettings], DPSettings], is_local: bool,
                extended: bool = False) -> None:
        """Change the session's dp.* settings as a SET [LOCAL] does (see `BlockSettings`),
        with Postgres's warning for a SET LOCAL outside a block."""
        link = self.link
        assert link is not None
        if self.block_settings.assign(link, change, is_local, extended):
            self.send(_no_transaction_warning("SET LOCAL can only be used in transaction blocks"))

    def _follows(self, st: Statement, prepared: bool = False) -> bool:
        """A forwarded statement the proxy must see run, to follow what it does to its own
        state: savepoints only while dp.* settings have changed in the open block, unless it
        is `prepared` by name (it may run later, in another block)."""
        if st.effect is None:
            return False
        if st.effect in TRANSACTION_EFFECTS and not prepared:
            return self.block_settings.changed_in_block(self.link)
        return True

    def _follow(self, st: Statement, extended: bool = False) -> None:
        """After the backend ran `st`: what it also does to the proxy's own session state
        (`extended`: run on the extended protocol)."""
        effect = st.effect
        if effect in TRANSACTION_EFFECTS:
            assert self.link is not None
            self.block_settings.follow_savepoint(self.link, effect, st.setting)
            return
        if effect is Effect.DEALLOCATE:  # (the backend dropped the statement's shadow too)
            if st.setting is None:
                self.local_statements.clear()
            else:
                self.local_statements.pop(st.setting, None)
            return
        if effect is Effect.DISCARD_ALL:
            self.local_statements.clear()
            self.local_portals.clear()
            self.exhausted_portals.clear()
        if effect in (Effect.DISCARD_ALL, Effect.RESET_ALL):
            defaults = self.server.default_settings()
            self._assign(lambda _: defaults, is_local=False, extended=extended)

    # ------------------------------------------------------------------ extended protocol, local

    async def _local_parse(self, msg: p.Parse, st: Statement) -> None:
        assert self.link is not None
        await self.link.drain()
        if self._backend_failed_batch():
            self.state = State.FAILED_BATCH
            return
        if msg.name == "":
            # as Postgres, a Parse of the unnamed statement drops the one before, even when
            # it fails, and that one may be the backend's
            self.local_statements.pop("", None)
            self.link.close_quietly(b"S", "")
        failure = self._transaction_failure(st) or st.refusal
        if failure is not None:
            self.statement_done("refused", time.perf_counter(), failure.sqlstate)
            await self._fail_batch(failure)
            return
        if msg.name:
            # the name is taken on the backend too: Postgres refuses a name in use (42P05)
            # whichever kind of statement has it
            link = self.link
            if not await self._backend_accepts(lambda: link.shadow_statement(msg.name)):
                self.state = State.FAILED_BATCH  # (its error relayed)
                return
        self.local_statements[msg.name] = LocalStatement(
            st, msg.param_types, max(len(msg.param_types), highest_parameter(st.tree)))
        self.send(p.ParseComplete())

    def _transaction_failure(self, st: Statement | None = None) -> InFailedSqlTransaction | None:
        """As Postgres, statements in a transaction that failed are refused: a DP query there
        would be charged and then its answer refused by the backend. A forwarded statement
        `st` the proxy follows is the backend's to refuse (it runs ROLLBACK TO there)."""
        if st is not None and st.kind is StatementKind.PASS_THROUGH:
            return None
        if self.link is not None and self.link.tx_status == b"E":
            return InFailedSqlTransaction(
                "current transaction is aborted, commands ignored until end of transaction block")
        return None

    def _check_transaction(self, st: Statement | None = None) -> None:
        failure = self._transaction_failure(st)
        if failure is not None:
            raise failure

    def _check_cursor_block(self, st: Statement) -> None:
        """As Postgres, a cursor without WITH HOLD is declared only in a transaction block:
        refused before the DP answer is charged, since the backend would refuse the DECLARE
        only after. Where an extended batch has run statements since the last ReadyForQuery
        (a BEGIN among them, as pgjdbc sends), the backend decides."""
        link = self.link
        assert link is not None
        if st.cursor is not None and not st.cursor.hold and link.tx_status == b"I" \
                and link.batch_started is None:
            raise NoActiveSqlTransaction("DECLARE CURSOR can only be used in transaction blocks")

    def _forwarded_parse(self, name: str) -> None:
        """A Parse the backend answers replaces the unnamed statement, local or not; for a
        named one, a local statement's shadow makes the backend refuse it (42P05), as
        Postgres refuses a name in use."""
        if name == "":
            self.local_statements.pop("", None)

    def _drop_unnamed(self, link: backend.BackendLink) -> None:
        """As Postgres, a simple Query drops the unnamed statement, and the unnamed portal
        when it runs a statement: not in a failed block (it fails first, 25P02)."""
        if self.local_statements or self.local_portals:
            self.local_statements.pop("", None)
            if link.tx_status != b"E":
                self.local_portals.pop("", None)
                self.exhausted_portals.discard("")

    def _open_portal(self, name: str) -> LocalPortal | None:
        """The local portal `name`, if it is still open (call after draining the link): every
        portal ends with its transaction."""
        link = self.link
        assert link is not None
        if self._portals_epoch != link.idle_readies:
            self._portals_epoch = link.idle_readies
            self.local_portals.clear()
            self.exhausted_portals.clear()
        return self.local_portals.get(name)

    def _forward_instead(self, msg: p.Execute | p.Describe | p.Close) -> None:
        """The local portal `msg` names has ended with its transaction: the backend answers
        (it knows of no such portal either, unless one was made since)."""
        assert self.link is not None
        self.link.forward(msg.encode(self.link.codec), msg.tag)

    async def _local_bind(self, bind: p.Bind, local: LocalStatement) -> None:
        if len(bind.params) != local.n_params:
            raise BindMismatch(f"bind message supplies {len(bind.params)} parameters, but prepared "
                               f'statement "{bind.statement}" requires {local.n_params}')
        self._check_transaction(local.statement)
        self._open_portal(bind.portal)  # (ends the portals of a transaction that has ended)
        link = self.link
        assert link is not None
        if bind.portal == "":
            link.close_quietly(b"P", "")  # it replaces the unnamed portal, maybe the backend's
        else:
            # the name is taken on the backend too, until the portal is closed or its
            # transaction ends: Postgres refuses a name in use (42P03) whatever portal has it
            if not await self._backend_accepts(lambda: link.shadow_portal(bind.portal)):
                raise _AlreadyReported()
        self.local_portals[bind.portal] = LocalPortal(local, bind)
        self.exhausted_portals.discard(bind.portal)
        self.send(p.BindComplete())

    def _local_close(self, msg: p.Close) -> None:
        if msg.kind == b"S":
            self.local_statements.pop(msg.name, None)
        elif self._open_portal(msg.name) is not None:
            self.local_portals.pop(msg.name, None)
        if msg.name:
            self._forward_instead(msg)  # (and its shadow, if it is still there)
        else:
            self.send(p.CloseComplete())

    async def _local_describe(self, msg: p.Describe) -> None:
        if msg.kind == b"P" and self._open_portal(msg.name) is None:
            self._forward_instead(msg)
            return
        local = self.local_statements[msg.name] if msg.kind == b"S" else \
            self.local_portals[msg.name].statement
        # describing a DP query reads the catalog; Postgres too refuses to describe a statement
        # that returns rows in a failed block (not ROLLBACK TO, SET, DECLARE or COPY)
        st = local.statement
        if not (st.wraps_result or st.kind is StatementKind.LOCAL_SET):
            self._check_transaction(st)
        if msg.kind == b"S":
            types = tuple(local.param_types)
            if st.kind in _DP_KINDS:
                declared = types + (0,) * (local.n_params - len(types))
                types = await self.server.dp.parameter_types(self, st, declared)
            self.send(p.ParameterDescription(types))
            self.send(await self._row_description(st, None, local.param_types, ()))
        else:
            portal = self.local_portals[msg.name]
            self.send(await self._row_description(portal.statement.statement, portal.bind,
                                                  portal.statement.param_types,
                                                  portal.bind.result_formats))

    async def _row_description(self, st: Statement, bind: p.Bind | None,
                               param_types: tuple[int, ...],
                               formats: tuple[int, ...]) -> p.RowDescription | p.NoData:
        if st.kind is StatementKind.LOCAL_SHOW:
            assert st.setting is not None
            return p.RowDescription((p.FieldDescription(
                st.setting, type_oid=TEXT_OID, format=formats[0] if formats else 0),))
        if st.kind in (StatementKind.LOCAL_SET, StatementKind.PASS_THROUGH) or st.wraps_result:
            # (a forwarded statement the proxy follows returns no rows, nor DECLARE or COPY)
            return p.NoData()
        desc: p.RowDescription = await self.server.dp.describe(self, st, bind, param_types, formats)
        return desc

    async def _local_execute(self, ex: p.Execute, portal: LocalPortal) -> None:
        if self._open_portal(ex.portal) is not portal:
            self._forward_instead(ex)
            return
        st = portal.statement.statement
        if st.kind in _DP_KINDS:
            # a DP answer is one release: executing the portal again finds it exhausted, as
            # Postgres does (no second answer, no charge); with a row limit the released rows
            # stay in the backend's portal of that name, read by the client's next Executes
            if ex.portal in self.exhausted_portals:
                self._check_transaction(st)  # (a failed block refuses it first, 25P02)
                if st.cursor is not None or st.wraps_result:  # (DECLARE, COPY: run once)
                    raise ObjectNotInPrerequisiteState(f'portal "{ex.portal}" cannot be run')
                self.send(p.CommandComplete("SELECT 0"))
                return
            self.exhausted_portals.add(ex.portal)
        await self._run_local_statement(st, describe=False, bind=portal.bind,
                                        param_types=portal.statement.param_types, execute=ex)
        if ex.max_rows > 0 and st.kind in _DP_KINDS:
            # the answer is the backend's portal now (`relay_result`): the client's further
            # Executes, Describe and Close of it go there
            self.local_portals.pop(ex.portal, None)
            self.exhausted_portals.discard(ex.portal)

    async def relay_result(self, sql: str, bind: p.Bind | None,
                           client_statement: bool = False,
                           execute: p.Execute | None = None) -> None:
        """Have the backend answer `sql` (the proxy's own query, or the client's statement
        that the proxy must follow) to the client.

        Simple protocol: its RowDescription, rows and CommandComplete are
        relayed. Extended: only rows and CommandComplete, in the Bind's formats;
        for an `execute` with a row limit, its first rows and PortalSuspended as
        Postgres sends them, the rest left in the backend's portal of that name
        (what the client's next Execute reads). An error is relayed too; it
        raises _AlreadyReported.
        """
        link = self.link
        assert link is not None
        before = link.errors
        try:
            if bind is None:
                link.send_split_query(sql)
            elif execute is not None and execute.max_rows > 0:
                link.run_internal(sql, bind.result_formats, execute.portal, execute.max_rows)
            else:
                link.run_internal(sql, bind.result_formats)
        except UnicodeEncodeError as e:
            # a released key (or an analyst's name) the client encoding cannot show: Postgres
            # fails a query the same way when a row has such a character
            raise untranslatable(e, link.encoding) from None
        await link.drain()
        if link.errors > before:
            if not client_statement:
                # (HAVING, ORDER BY or a query around the DP query can fail on released
                # values, 1/(n - 5) say; anything else that fails here is a bug)
                log.warning("session %s: the backend refused a result query (sqlstate %s)",
                            self.process_id, link.last_sqlstate)
            raise _AlreadyReported()

    # ------------------------------------------------------------------ cancel

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


_BEGINS = ("TRANS_STMT_BEGIN", "TRANS_STMT_START")
_BIND_KEEPS_PORTAL = frozenset({"26000", "08P01", "25P02"})
"""A Bind that fails with these has not replaced the unnamed portal (postgres.c: it checks
the statement, its parameter counts and the transaction before it makes the portal)."""
_ENDS = ("TRANS_STMT_COMMIT", "TRANS_STMT_ROLLBACK")
_SAVEPOINT_COMMANDS = {"TRANS_STMT_SAVEPOINT": "SAVEPOINT", "TRANS_STMT_RELEASE": "RELEASE SAVEPOINT",
                       "TRANS_STMT_ROLLBACK_TO": "ROLLBACK TO SAVEPOINT"}
_NOT_EMULATED = ("TRANS_STMT_PREPARE", "TRANS_STMT_COMMIT_PREPARED",
                 "TRANS_STMT_ROLLBACK_PREPARED")
"""Queries with these run statement by statement, without an implicit block of the proxy's."""


def _no_transaction_warning(message: str) -> p.NoticeResponse:
    """Postgres's WARNING 25P01 (a transaction command where no block is open)."""
    return p.NoticeResponse(((p.FIELD_SEVERITY, "WARNING"), (p.FIELD_SEVERITY_V, "WARNING"),
                             (p.FIELD_CODE, "25P01"), (p.FIELD_MESSAGE, message)))


def _transaction_command(st: Statement) -> str | None:
    """The kind of a transaction command (TransactionStmt), None for any other statement."""
    body = st.tree.get("TransactionStmt")
    return None if body is None else str(body.get("kind", ""))


def _wrapped(st: Statement, sql: str) -> str:
    """The proxy's result query `sql` for `st`, declared as the cursor `st` declares or
    copied as it copies, if it does: the cursor or copy has the released rows only."""
    if st.cursor is not None:
        return st.cursor.declare(sql, quote_ident)
    if st.wraps_result:
        return copy_result(st.stripped_sql, sql)
    return sql


def _query_text(raw: bytes, encoding: str) -> str:
    """The SQL of a raw Query frame in the client encoding; raises ProtocolViolation (or
    InvalidText) like the full decoder."""
    if len(raw) < 6 or raw[-1] != 0 or raw.find(b"\0", 5) != len(raw) - 1:
        msg = p.decode_frontend(b"Q", raw[5:], encoding)  # raises the precise error
        assert isinstance(msg, p.Query)
        return msg.sql
    try:
        return raw[5:-1].decode(encoding)
    except UnicodeDecodeError as e:
        raise p.InvalidText(e.object[e.start : e.end], encoding) from None


# Statement and portal names, read before deciding whether to decode a whole message: as the
# full decoder reads them where valid (so that they find what a Parse or Bind stored), and
# never failing (a name that is not valid text cannot have been stored).

def _first_name(raw: bytes, encoding: str) -> str:
    end = raw.find(b"\0", 5)
    if end < 0:
        raise p.ProtocolViolation("unterminated string in message")
    return raw[5:end].decode(encoding, errors="replace")


def _two_names(raw: bytes, encoding: str) -> tuple[str, str]:
    """Portal and statement names at the start of a Bind frame."""
    end1 = raw.find(b"\0", 5)
    end2 = raw.find(b"\0", end1 + 1) if end1 >= 0 else -1
    if end2 < 0:
        raise p.ProtocolViolation("unterminated string in message")
    return (raw[5:end1].decode(encoding, errors="replace"),
            raw[end1 + 1:end2].decode(encoding, errors="replace"))


def _name_after_kind(raw: bytes, encoding: str) -> str:
    """The name in a Describe or Close frame (after its S/P byte)."""
    if raw[5:6] not in (b"S", b"P"):
        raise p.ProtocolViolation("invalid DESCRIBE/CLOSE message subtype")
    end = raw.find(b"\0", 6)
    if end < 0:
        raise p.ProtocolViolation("unterminated string in message")
    return raw[6:end].decode(encoding, errors="replace")


__all__ = ["ClientProtocol", "Session", "State"]
