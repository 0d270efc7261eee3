"""One client session: its input, the pass-through fast path, and each message routed by its tag.

Pass-through messages are forwarded synchronously from `data_received` when
nothing is queued ahead of them (the fast path). A message that needs the
proxy itself (a refusal, `SET dp.*`, a DP query) is handled by a task, after
the backend has answered everything forwarded before it, so replies reach
the client in the order of the requests. Messages that arrive meanwhile wait
in a backlog.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from dp_core.classify import StatementKind
from dp_core.errors import DPError, FeatureNotSupported, InternalError, SyntaxError_
from server import backend
from server import wire as p
from server.encodings import invalid_text
from server.errors import ProtocolViolationError
from server.session.base import CLOSED, READY, SessionHost, State, log
from server.session.implicit_block import WithImplicitBlock
from server.wire.peek import first_name, name_after_kind, query_text, two_names

MAX_BACKLOG = 1024
"""Queued client messages before the proxy stops reading from the client."""


_LENGTH = struct.Struct("!i")
_FAST_KINDS = {
    ord("Q"): backend.Pending.QUERY, ord("P"): backend.Pending.PARSE,
    ord("B"): backend.Pending.BIND, ord("D"): backend.Pending.DESCRIBE,
    ord("E"): backend.Pending.EXECUTE, ord("C"): backend.Pending.CLOSE,
    ord("S"): backend.Pending.SYNC, ord("H"): None,
}
"""Frames the fast path forwards, by tag byte, and the reply each awaits."""
_PARSE_TAG, _QUERY_TAG, _SYNC_TAG, _EXECUTE_TAG = ord("P"), ord("Q"), ord("S"), ord("E")
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


_NAMED = frozenset(b"BDCE")
"""Frames that name a statement or portal, which may be one the proxy answers itself."""


_FORWARDED = (StatementKind.PASS_THROUGH, StatementKind.EMPTY)


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


class Session(WithImplicitBlock):
    """A client session, whole: the layers below, and its input routed by message tag."""

    __slots__ = ()

    def __init__(
        self, server: SessionHost, transport: asyncio.Transport, proto: asyncio.Protocol
    ) -> None:
        super().__init__(server, transport, proto)
        self._startup_task = asyncio.get_running_loop().create_task(self._startup())

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state is CLOSED:
            return
        self._last_input = self._clock()  # the idle timer reads it when it fires
        link = self.link
        if (state is READY and not self.busy and not self.backlog
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
        local = bool(self.local_statements or self.local_portals or self.bound_checks)
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
            if tag == _SYNC_TAG:
                unsynced = -1
                pending.append(kind)
                cycles.append(batch)
                batch = None
            elif tag == _PARSE_TAG:
                name_end = data.find(b"\0", pos + 5, end)
                sql_end = data.find(b"\0", name_end + 1, end) if name_end >= 0 else -1
                if sql_end < 0 or self.local_statements or \
                        not plain(data[name_end + 1 : sql_end]):
                    break
                if unsynced < 0:
                    unsynced = pos
            elif tag == _QUERY_TAG:
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
                if tag == _EXECUTE_TAG and batch is None:
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
        route = _ROUTES.get(tag)
        if route is None:
            raise ProtocolViolationError(f"invalid frontend message type {tag!r}")
        return route(self, tag, raw, link)

    def _query(self, tag: bytes, raw: bytes, link: backend.BackendLink) -> Awaitable[None] | None:
        sql = query_text(raw, link.codec)
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

    def _parse(self, tag: bytes, raw: bytes, link: backend.BackendLink) -> Awaitable[None] | None:
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
            self._forwarded_parse(msg.name, st)
            link.forward(raw, tag)
            return None
        return self._local_parse(msg, st)

    def _bind(self, tag: bytes, raw: bytes, link: backend.BackendLink) -> Awaitable[None] | None:
        # only the names decide the route: decode the whole message only when local
        portal_name, statement_name = two_names(raw, link.codec)
        local = self.local_statements.get(statement_name)
        checked = local.statement if local is not None else self.bound_checks.get(statement_name)
        if checked is not None and checked.at_bind:
            decoded = p.decode_frontend(tag, raw[5:], link.codec)
            assert isinstance(decoded, p.Bind)
            self._check_bound(checked, decoded)
        if local is None:
            if portal_name == "" and "" in self.local_portals:
                return self._forward_unnamed_bind(raw)
            link.forward(raw, tag)  # (a local named portal's shadow: 42P03, as Postgres)
            return None
        bind = p.decode_frontend(tag, raw[5:], link.codec)
        assert isinstance(bind, p.Bind)
        return self._local_async(self._local_bind(bind, local))

    def _describe_or_close(self, tag: bytes, raw: bytes,
                           link: backend.BackendLink) -> Awaitable[None] | None:
        table: dict[str, Any] = (
            self.local_statements if raw[5:6] == b"S" else self.local_portals
        )
        if not table or name_after_kind(raw, link.codec) not in table:
            if tag == b"C" and raw[5:6] == b"S" and self.bound_checks:
                self.bound_checks.pop(name_after_kind(raw, link.codec), None)
            link.forward(raw, tag)
            return None
        msg = p.decode_frontend(tag, raw[5:], link.codec)
        assert isinstance(msg, (p.Describe, p.Close))
        if isinstance(msg, p.Close):
            return self._local(lambda: self._local_close(msg))
        return self._local_async(self._local_describe(msg))

    def _execute(self, tag: bytes, raw: bytes, link: backend.BackendLink) -> Awaitable[None] | None:
        portal = self.local_portals.get(first_name(raw, link.codec)) \
            if self.local_portals else None
        if portal is None:
            link.forward(raw, tag)
            return None
        ex = p.decode_frontend(tag, raw[5:], link.codec)
        assert isinstance(ex, p.Execute)
        return self._local_async(self._local_execute(ex, portal))

    def _forward(self, tag: bytes, raw: bytes, link: backend.BackendLink) -> None:
        link.forward(raw, tag)

    def _terminate(self, tag: bytes, raw: bytes, link: backend.BackendLink) -> None:
        self.close()

    def _function_call(self, tag: bytes, raw: bytes, link: backend.BackendLink) -> None:
        raise FeatureNotSupported("the fast-path function call interface is not supported")

    def _password(self, tag: bytes, raw: bytes, link: backend.BackendLink) -> None:
        raise ProtocolViolationError("unexpected password message")

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


_Route = Callable[[Session, bytes, bytes, backend.BackendLink], Awaitable[None] | None]
_ROUTES: dict[bytes, _Route] = {
    b"Q": Session._query, b"P": Session._parse, b"B": Session._bind,
    b"D": Session._describe_or_close, b"C": Session._describe_or_close, b"E": Session._execute,
    b"S": Session._forward, b"H": Session._forward,  # Sync, Flush
    b"d": Session._forward, b"c": Session._forward, b"f": Session._forward,  # COPY's data
    b"X": Session._terminate, b"F": Session._function_call, b"p": Session._password,
}
"""What each client message does once the session is ready, by its tag."""
