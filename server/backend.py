"""A session's own connection to the backend Postgres, as the restricted role: login, then relay.

After login the link relays the backend's bytes to the client unchanged. It
splits them into frames only to know which forwarded client message each
reply completes (so the session can answer proxy-local messages in order), to
track the transaction status, and to swallow the ReadyForQuery of statements
the proxy sent on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, cast

from server import protocol as p
from server.backend_setup import quote_ident
from server.dsn import DSN
from server.encodings import UnsupportedEncoding, codec
from server.scram import MECHANISM, ScramClient, ScramError


class BackendError(Exception):
    """The backend refused the login or closed the connection."""

    def __init__(self, message: str, fields: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


class NonStandardStrings(Exception):
    """The session turned standard_conforming_strings off: the proxy reads SQL as Postgres
    does only with it on ('a\\' is a string there, the start of one with an escaped quote
    otherwise), so the session cannot go on (whatever turned it off: SET, set_config, a
    function, a role's or database's default, a startup option)."""

    def __init__(self) -> None:
        super().__init__("standard_conforming_strings was turned off")


class Pending(Enum):
    """What a forwarded client message is waiting for."""

    QUERY = "Q"  # simple query: ends with ReadyForQuery, relayed
    QUERY_SPLIT = "q"  # one statement of a split simple query: ReadyForQuery swallowed
    INTERNAL_QUERY = "iQ"  # the proxy's own BEGIN / COMMIT around one: all but errors swallowed
    PARSE = "P"
    BIND = "B"
    DESCRIBE = "D"  # ends with RowDescription or NoData
    EXECUTE = "E"  # ends with CommandComplete, EmptyQueryResponse or PortalSuspended
    CLOSE = "C"
    SYNC = "S"
    # the proxy's own statements (DP results): their replies are swallowed, rows relayed
    INTERNAL_PARSE = "iP"
    INTERNAL_BIND = "iB"
    INTERNAL_CLOSE = "iC"
    INTERNAL_EXECUTE = "iE"  # a statement of the proxy's own without rows (CommandComplete)
    # the proxy's own failing statement (`fail_transaction`): its error is swallowed, uncounted
    INTERNAL_FAIL = "iF"
    INTERNAL_FAIL_QUERY = "iFQ"  # (as a Query: its ReadyForQuery swallowed too)


_EXTENDED_TAGS = {
    b"P": Pending.PARSE,
    b"B": Pending.BIND,
    b"D": Pending.DESCRIBE,
    b"E": Pending.EXECUTE,
    b"C": Pending.CLOSE,
    b"S": Pending.SYNC,
}
_COMPLETES = {
    b"1": (Pending.PARSE,),
    b"2": (Pending.BIND,),
    b"3": (Pending.CLOSE,),
    b"T": (Pending.DESCRIBE,),
    b"n": (Pending.DESCRIBE,),
    b"C": (Pending.EXECUTE,),
    b"I": (Pending.EXECUTE,),
    b"s": (Pending.EXECUTE,),
}
_SIMPLE = (Pending.QUERY, Pending.QUERY_SPLIT, Pending.INTERNAL_QUERY,
           Pending.INTERNAL_FAIL_QUERY)
_UNRELAYED_READY = (Pending.QUERY_SPLIT, Pending.INTERNAL_QUERY, Pending.INTERNAL_FAIL_QUERY)
"""Cycles whose ReadyForQuery the client does not see: the proxy's own."""
_FAILS = (Pending.INTERNAL_FAIL, Pending.INTERNAL_FAIL_QUERY)
_FAILING_SQL = "dp-proxy: a local error aborts the transaction, as in Postgres"
"""Not SQL: the backend's syntax error is the point (and reads plainly in its log)."""
_QUERY, _SYNC = Pending.QUERY, Pending.SYNC
"""For the relay loop (an Enum member is a slow class attribute on Python 3.11)."""
_INTERNAL_COMPLETES = {
    b"1": Pending.INTERNAL_PARSE,
    b"2": Pending.INTERNAL_BIND,
    b"3": Pending.INTERNAL_CLOSE,
    b"C": Pending.INTERNAL_EXECUTE,
}
_SYNCS = (Pending.SYNC,)
_NOT_ENDING_A_QUERY = frozenset(_COMPLETES) - {b"Z", b"E"}
INTERNAL_NAME = "dp_proxy_internal"
SHADOW_NAME = "dp_proxy_shadow"
_TRACKED = frozenset({b"Z", b"E", b"S", *_COMPLETES})
_LENGTH = struct.Struct("!i")
# the same sets keyed by the tag's byte value, for the relay loop
_TRACKED_INT = frozenset(t[0] for t in _TRACKED)
_CYCLE_TRACKED_INT = frozenset(t[0] for t in _TRACKED - _NOT_ENDING_A_QUERY)
_ENDS_INT = {t[0]: kinds[0] for t, kinds in _COMPLETES.items()}
"""The one pending kind each tracked reply ends, by tag byte (every tuple of _COMPLETES has one)."""
assert all(len(kinds) == 1 for kinds in _COMPLETES.values())
_BYTES = [bytes((i,)) for i in range(256)]
_Q, _E, _S, _Z, _C, _I = ord("Q"), ord("E"), ord("S"), ord("Z"), ord("C"), ord("I")


class CycleCounter(Protocol):
    """Where the relay counts client cycles that succeeded (the metrics)."""

    pass_through_ok: int


@dataclass
class RelayTarget:
    """Where relayed bytes go, and what to do when the backend is lost."""

    write: Callable[[bytes], None]
    lost: Callable[[Exception | None], None]


class BackendLink(asyncio.Protocol):
    # slots: more than 30 instance attributes in a dict would cost every attribute read on
    # the relay's path (CPython 3.11 stops sharing the keys and inlining the values)
    __slots__ = ("_began_after_end", "_corked", "_drained", "_end_tag", "_frames", "_handshake",
                 "_partial", "_relaying", "_skip", "batch_started", "closed", "codec", "counter",
                 "cycles", "encoding", "errors", "errors_at_ready", "idle_readies", "key",
                 "last_split_failed", "last_sqlstate", "log_cycles", "on_cycle", "on_tx_end",
                 "parameters", "pending", "skipping", "startup_frames", "target", "transport",
                 "tx_ends", "tx_status", "watch_tx")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._frames = p.FrameReader(max_size=1 << 30)
        self._handshake: asyncio.Queue[p.BackendMessage | BaseException] = asyncio.Queue()
        self._relaying = False
        self.target: RelayTarget | None = None
        self.pending: deque[Pending] = deque()
        self._drained: asyncio.Future[None] | None = None
        """What `drain()` awaits: set when the pending queue empties."""
        self.errors = 0
        """ErrorResponses relayed so far."""
        self.errors_at_ready = 0
        """`errors` when the last ReadyForQuery arrived: more since means a failed batch."""
        self.last_split_failed = False
        self.tx_status = b"I"
        self.skipping = False
        """The backend ignores what it gets until the client's next Sync (an error came back
        before that Sync was forwarded): nothing but the Sync may be forwarded."""
        self.idle_readies = 0
        """ReadyForQuery messages with status idle so far: each ends a transaction, and with
        it every portal."""
        self.parameters: dict[str, str] = {}
        self.watch_tx = False
        """Set while the session has dp.* settings changed in an open transaction block: the
        relay then notes in `tx_ends` how transaction blocks end."""
        self.tx_ends: list[bool] = []
        """While watching: one entry per transaction block ended, True when it committed."""
        self.on_tx_end: Callable[[], None] | None = None
        """Called when an entry is added to `tx_ends` (the session settles its settings at
        once, and the relay stops watching)."""
        self._end_tag: bytes | None = None
        """The first COMMIT or ROLLBACK CommandComplete since the last ReadyForQuery, while
        watching."""
        self._began_after_end = False
        """A BEGIN since `_end_tag`: the block ended and another began (in one Query)."""
        self.encoding = "UTF8"
        """The session's client_encoding, as the backend last reported it (and a name Postgres
        uses in messages)."""
        self.codec = "utf-8"
        """Its Python codec: what client text is read in and the proxy's own SQL and messages
        are written in."""
        self.startup_frames: list[bytes] = []
        """ParameterStatus frames from login, to replay to the client byte for byte."""
        self.key: tuple[int, int] | None = None
        self.closed = False
        self._partial = b""
        self._skip = 0
        """Bytes still to relay of an untracked frame that spans reads."""
        self._corked: list[bytes] | None = None
        self.cycles: deque[float | None] = deque()
        """Per client Query or Sync awaiting its ReadyForQuery: when its pass-through work was
        sent (perf_counter), or None when it carried none (a batch the proxy answered)."""
        self.batch_started: float | None = None
        """When the first forwarded Execute of the current extended batch was sent."""
        self.last_sqlstate: str | None = None
        self.on_cycle: Callable[[float, str | None], None] | None = None
        """Called at the end of each client cycle that did pass-through work: its start, and
        the SQLSTATE of its last error (None when it succeeded); for a success only when
        `log_cycles` is set, else the cycle is just counted in `counter`."""
        self.log_cycles = True
        self.counter: CycleCounter | None = None

    # ------------------------------------------------------------------ asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self._relaying:
            self._frames.feed(data)
            self._handshake_frames()
            if self._relaying and self._frames.buffered:
                self._relay(self._frames.take_buffer())
            return
        self._relay(data)

    def _relay(self, data: bytes) -> None:
        """Relay backend bytes, scanning frame headers in place.

        Untracked frames (rows, notices...) stream through as they arrive, even
        when a frame spans many reads; only small tracked frames are ever held
        back, and only until they are complete. The replies that end a
        forwarded message, and the ReadyForQuery of a cycle that succeeded, are
        handled inline (this loop runs for every reply a pass-through statement
        gets); the rest goes through `_track`.
        """
        out: list[bytes] = []
        if self._skip:
            k = min(self._skip, len(data))
            out.append(data[:k])
            self._skip -= k
            data = data[k:]
        buf = self._partial + data if self._partial else data
        self._partial = b""
        n = len(buf)
        pos = keep_from = 0
        unpack, tracked, pending = _LENGTH.unpack_from, _TRACKED_INT, self.pending
        ends, query, sync = _ENDS_INT, _QUERY, _SYNC
        watch = self.watch_tx
        head = pending[0] if pending else None
        # before the ReadyForQuery that ends a client cycle only errors and parameters matter
        look = _CYCLE_TRACKED_INT if (head is query or head is sync) and not watch else tracked
        while pos + 5 <= n:
            tag = buf[pos]  # an int: cheaper than a one-byte slice on this hot path
            length = unpack(buf, pos + 1)[0]
            if length < 4:
                self._lose(p.ProtocolViolation("invalid message length from the backend"))
                return
            end = pos + 1 + length
            if end > n:
                if tag not in tracked:
                    self._skip = end - n
                    pos = n
                break
            if tag in look:
                if head is not None and head is ends.get(tag) and not watch:
                    pending.popleft()
                    head = pending[0] if pending else None
                elif tag == _Z and (head is query or head is sync) \
                        and self.errors == self.errors_at_ready and self.cycles and not watch:
                    # a client cycle that succeeded: `_track`'s common case
                    pending.popleft()
                    head = pending[0] if pending else None
                    status = buf[pos + 5]
                    self.tx_status = _BYTES[status]
                    if status == _I:
                        self.idle_readies += 1
                    started = self.cycles.popleft()
                    if started is not None:
                        self._cycle_done(started, None)
                else:
                    if watch:
                        self._note_transaction(tag, buf, pos, end)
                    if not self._track(_BYTES[tag], buf, pos, end):
                        out.append(buf[keep_from:pos])
                        keep_from = end
                    if self.closed:
                        return  # (nothing more goes to the client)
                    head = pending[0] if pending else None
                look = _CYCLE_TRACKED_INT if (head is query or head is sync) and not watch \
                    else tracked
            pos = end
        if head is None and self._drained is not None:
            self._wake()
        out.append(buf[keep_from:pos])
        self._partial = buf[pos:]
        if self.target is not None:
            chunk = out[0] if len(out) == 1 else b"".join(out)
            if chunk:
                self.target.write(chunk)

    def _wake(self) -> None:
        """Nothing is pending any more: let `drain()` return."""
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(exc)

    def _lose(self, exc: Exception | None) -> None:
        if self.closed:
            return
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        self._handshake.put_nowait(BackendError("the backend closed the connection"))
        self.pending.clear()
        self.cycles.clear()
        self._wake()
        if self._relaying and self.target is not None:
            self.target.lost(exc)

    # ------------------------------------------------------------------ relay bookkeeping

    def _track(self, tag: bytes, buf: bytes, start: int, end: int) -> bool:
        """Update the pending queue for the frame buf[start:end]; False: do not relay it."""
        pending = self.pending
        head = pending[0] if pending else None
        relay = True
        if tag == b"Z":
            self.tx_status = buf[start + 5 : start + 6]
            if self.tx_status == b"I":
                self.idle_readies += 1
            failed = self.errors > self.errors_at_ready
            self.errors_at_ready = self.errors
            if head in _SIMPLE or head in _SYNCS:
                pending.popleft()
                relay = head not in _UNRELAYED_READY
                if relay and self.cycles:
                    started = self.cycles.popleft()
                    if started is not None:
                        self._cycle_done(started, self.last_sqlstate if failed else None)
        elif tag == b"E" and head in _FAILS:
            relay = False  # (the client has the proxy's own error)
            if head is Pending.INTERNAL_FAIL:
                while pending and pending[0] not in _SYNCS:  # the backend skips to Sync
                    pending.popleft()
                if not pending:
                    self.skipping = True
        elif tag == b"E":
            self.errors += 1
            code = buf.find(b"\0C", start + 4, end)  # a field boundary, then the SQLSTATE field
            self.last_sqlstate = buf[code + 2 : code + 7].decode("ascii", "replace") \
                if code >= 0 else "XX000"
            if head is Pending.QUERY_SPLIT:
                self.last_split_failed = True
            if head is not None and head not in _SIMPLE:
                # the backend now skips everything up to the next Sync
                while pending and pending[0] not in _SYNCS:
                    pending.popleft()
                if not pending:
                    self.skipping = True  # (the error came before the Sync was forwarded)
        elif tag == b"S":
            with contextlib.suppress(p.ProtocolViolation):
                msg = p.decode_backend(tag, buf[start + 5 : end], self.codec)
                assert isinstance(msg, p.ParameterStatus)
                self.parameters[msg.name] = msg.value
                if msg.name == "standard_conforming_strings" and msg.value != "on":
                    self._lose(NonStandardStrings())
                    return False
                if msg.name == "client_encoding" and not self._client_encoding(msg.value):
                    self._lose(UnsupportedEncoding(msg.value))
                    return False
        elif head is Pending.INTERNAL_QUERY:
            relay = False  # (its CommandComplete)
        elif head is not None and head is _INTERNAL_COMPLETES.get(tag):
            pending.popleft()
            relay = False
        elif head is not None and head in _COMPLETES.get(tag, ()):
            pending.popleft()
        return relay

    def _client_encoding(self, name: str) -> bool:
        """The backend reported client_encoding `name`; False: the proxy has no codec for it
        (the encoding in use stays as it was)."""
        py = codec(name)
        if py is None:
            return False
        self.encoding, self.codec = name, py
        return True

    def _note_transaction(self, tag: int, buf: bytes, start: int, end: int) -> None:
        """While watching: note a transaction block that ends (before `_track` reads the new
        transaction status), and whether it committed.

        The first COMMIT or ROLLBACK since the last ReadyForQuery ends the block (later
        ones in the same Query end implicit blocks, or blocks it began itself)."""
        if tag == _C:
            text = buf[start + 5 : end - 1]
            if text in (b"COMMIT", b"ROLLBACK"):
                if self._end_tag is None:
                    self._end_tag = text
            elif text in (b"BEGIN", b"START TRANSACTION") and self._end_tag is not None:
                self._began_after_end = True
        elif tag == _Z:
            command, self._end_tag = self._end_tag, None
            began, self._began_after_end = self._began_after_end, False
            if command is None:
                if buf[start + 5] == _I:
                    # an implicit transaction ended (an extended batch's, at its Sync): it
                    # committed unless something in it failed
                    self._tx_end(self.errors == self.errors_at_ready)
                return
            if buf[start + 5] == _I or began:
                self._tx_end(command == b"COMMIT")  # (COMMIT of a failed block: ROLLBACK)
            elif command == b"COMMIT":
                self._tx_end(True)  # COMMIT AND CHAIN: a new block began
            # ROLLBACK with the block still open and none begun: ROLLBACK TO SAVEPOINT or
            # ROLLBACK AND CHAIN, which the session follows itself (it knows which it was)

    def _tx_end(self, committed: bool) -> None:
        self.tx_ends.append(committed)
        if self.on_tx_end is not None:
            self.on_tx_end()

    def _cycle_done(self, started: float, sqlstate: str | None) -> None:
        """A client cycle that did pass-through work ended: count it or report it."""
        if sqlstate is None and not self.log_cycles:
            if self.counter is not None:
                self.counter.pass_through_ok += 1
        elif self.on_cycle is not None:
            self.on_cycle(started, sqlstate)

    def forward(self, raw: bytes, tag: bytes) -> None:
        """Send one raw client frame to the backend and note the reply it awaits."""
        assert self.transport is not None
        kind = Pending.QUERY if tag == b"Q" else _EXTENDED_TAGS.get(tag)
        if kind is _SYNC:
            self.skipping = False
        if kind is not None:
            self.pending.append(kind)
            self.note_cycle(tag[0], time.perf_counter())
        if self._corked is not None:
            self._corked.append(raw)
        else:
            self.transport.write(raw)

    def note_cycle(self, tag: int, now: float) -> None:
        """Note a forwarded client Query, Execute or Sync for the statement log and metrics."""
        if tag == _Q:
            self.cycles.append(now)
        elif tag == _E:
            if self.batch_started is None:
                self.batch_started = now
        elif tag == _S:
            self.cycles.append(self.batch_started)
            self.batch_started = None

    def write(self, data: bytes) -> None:
        """Send raw client frames whose pending replies the caller has already noted."""
        assert self.transport is not None
        if self._corked is not None:
            self.uncork()
        self.transport.write(data)

    def cork(self) -> None:
        """Hold forwarded frames until `uncork`, to send them in one write."""
        if self._corked is None:
            self._corked = []

    def uncork(self) -> None:
        corked, self._corked = self._corked, None
        if corked and self.transport is not None and not self.closed:
            self.transport.write(b"".join(corked) if len(corked) > 1 else corked[0])

    def send_split_query(self, sql: str) -> None:
        """Run one statement on our own; its ReadyForQuery is not relayed.

        Raises UnicodeEncodeError, having sent nothing, when `sql` has a character
        the client encoding lacks."""
        assert self.transport is not None
        frame = p.Query(sql).encode(self.codec)
        self.pending.append(Pending.QUERY_SPLIT)
        self.last_split_failed = False
        self.uncork()
        self.transport.write(frame)

    def run_quietly(self, sql: str) -> None:
        """Send a transaction command of the proxy's own (BEGIN, COMMIT, ROLLBACK) whose
        replies the client does not see but for an error; await `drain()` for it."""
        self._send_own([p.Query(sql)], [Pending.INTERNAL_QUERY])

    def run_internal(self, sql: str, result_formats: tuple[int, ...], portal: str = INTERNAL_NAME,
                     max_rows: int = 0) -> None:
        """Run one statement of the proxy's own in the client's result formats.

        Only its rows and CommandComplete (or its error) reach the client; await
        `drain()` for it to finish. No Sync is sent: it runs in the client's
        transaction, and after an error the backend skips to the client's Sync as
        the client does. With a client's `portal` and a row limit, it runs as that
        portal to its first `max_rows` rows (then PortalSuspended) and the portal
        stays open for the client's further Executes, until the transaction ends.
        Raises UnicodeEncodeError, having sent nothing, when `sql` has a character
        the client encoding lacks.
        """
        assert self.transport is not None
        n = INTERNAL_NAME
        # the statement is closed first too: after an error the backend skipped the last one's
        # Close, and a named statement outlives the transaction
        messages: list[p.FrontendMessage] = [
            p.Close(b"P", portal), p.Close(b"S", n), p.Parse(n, sql),
            p.Bind(portal, n, (), (), result_formats), p.Close(b"S", n),
            p.Execute(portal, max_rows)]
        kinds = [Pending.INTERNAL_CLOSE, Pending.INTERNAL_CLOSE, Pending.INTERNAL_PARSE,
                 Pending.INTERNAL_BIND, Pending.INTERNAL_CLOSE, Pending.EXECUTE]
        if portal == INTERNAL_NAME:
            messages.append(p.Close(b"P", portal))
            kinds.append(Pending.INTERNAL_CLOSE)
        self._send_own(messages, kinds)

    def shadow_statement(self, name: str) -> None:
        """Prepare a placeholder statement of the name of one the proxy holds, so that the
        backend refuses the name as in use (42P05) until it is closed or deallocated; an error
        (the name is in use) is relayed. Await `drain()` for it."""
        self._send_own([p.Parse(name, "SELECT")], [Pending.INTERNAL_PARSE])

    def shadow_portal(self, name: str) -> None:
        """Bind a placeholder portal of the name of one the proxy holds (see
        `shadow_statement`; 42P03 for a portal)."""
        n = SHADOW_NAME
        self._send_own([p.Close(b"S", n), p.Parse(n, "SELECT"), p.Bind(name, n, (), (), ()),
                        p.Close(b"S", n)],
                       [Pending.INTERNAL_CLOSE, Pending.INTERNAL_PARSE, Pending.INTERNAL_BIND,
                        Pending.INTERNAL_CLOSE])

    def try_declare(self, declare: str, name: str, extended: bool) -> None:
        """Declare a cursor for nothing and close it again, the client told only of an error:
        whether the backend accepts the DECLARE (the name not in use) before the proxy
        answers the query it is for. `extended`: in the client's extended batch (Parse /
        Bind / Execute, no Sync, the portal closed as a cursor is); else one Query. Await
        `drain()` for it."""
        if not extended:
            self.run_quietly(f"{declare}; CLOSE {quote_ident(name)}")
            return
        self._run_shadow(declare, [p.Close(b"P", name)])

    def pipeline_step(self) -> None:
        """Run a statement of the proxy's own that does nothing, its replies swallowed, where
        the proxy answered a client's Execute itself (SET or SHOW dp.*): the backend then sees
        the client's extended batch as Postgres would have, a pipeline in a transaction,
        so that a DISCARD ALL or VACUUM after it fails (25001) as it would there. Nothing is
        sent while the backend skips to the client's Sync."""
        if not (self.skipping or self.closed):
            self._run_shadow("SELECT WHERE false")

    def _run_shadow(self, sql: str, closes: list[p.FrontendMessage] | None = None) -> None:
        """Run `sql` (no rows) as the shadow statement and portal in the client's batch, its
        replies swallowed but an error, then `closes` (Close messages, their replies
        swallowed too)."""
        n = SHADOW_NAME
        after = closes or []
        self._send_own([p.Close(b"S", n), p.Parse(n, sql), p.Bind(n, n, (), (), ()),
                        p.Close(b"S", n), p.Execute(n, 0), p.Close(b"P", n), *after],
                       [Pending.INTERNAL_CLOSE, Pending.INTERNAL_PARSE, Pending.INTERNAL_BIND,
                        Pending.INTERNAL_CLOSE, Pending.INTERNAL_EXECUTE, Pending.INTERNAL_CLOSE,
                        *[Pending.INTERNAL_CLOSE] * len(after)])

    def fail_transaction(self, extended: bool) -> None:
        """After an error of the proxy's own, have the backend fail too, as Postgres fails on
        any error: an open block is aborted (25P02 until ROLLBACK), and an extended batch's
        implicit transaction is rolled back at its Sync (with what ran before the error).
        `extended`: a Parse that fails inside the client's batch (the backend then skips to
        its Sync); else a Query. Its error is not relayed; await `drain()` for it."""
        if extended:
            self._send_own([p.Parse(SHADOW_NAME, _FAILING_SQL)], [Pending.INTERNAL_FAIL])
        else:
            self._send_own([p.Query(_FAILING_SQL)], [Pending.INTERNAL_FAIL_QUERY])

    def _send_own(self, messages: list[p.FrontendMessage], kinds: list[Pending]) -> None:
        """Send messages of the proxy's own, awaiting `kinds` of replies; encoded first, so
        that a UnicodeEncodeError leaves nothing sent nor awaited."""
        assert self.transport is not None
        frames = b"".join(m.encode(self.codec) for m in messages)
        self.uncork()
        self.pending.extend(kinds)
        self.transport.write(frames)

    def close_quietly(self, kind: bytes, name: str) -> None:
        """Close a statement (b"S") or portal (b"P") of the backend's, the client not told."""
        self._send_own([p.Close(kind, name)], [Pending.INTERNAL_CLOSE])

    async def drain(self) -> None:
        """Wait until every forwarded message has its reply relayed (sending Flush if needed)."""
        self.uncork()
        if not self.pending:
            return
        if self.pending[-1] not in _SIMPLE and self.pending[-1] not in _SYNCS:
            assert self.transport is not None
            self.transport.write(p.Flush().encode())
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._drained)

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            with contextlib.suppress(Exception):
                self.transport.write(p.Terminate().encode())
            self.closed = True
            self.transport.close()

    # ------------------------------------------------------------------ login

    def _handshake_frames(self) -> None:
        try:
            while (frame := self._frames.next_raw()) is not None:
                tag, raw = frame
                msg = p.decode_backend(tag, raw[5:])
                if isinstance(msg, p.ParameterStatus):
                    self.startup_frames.append(raw)
                self._handshake.put_nowait(msg)
                if isinstance(msg, p.ReadyForQuery):
                    self._relaying = True  # later bytes are relayed
                    break
        except p.ProtocolViolation as e:
            self._handshake.put_nowait(BackendError(f"backend sent an invalid message: {e}"))

    async def _next(self) -> p.BackendMessage:
        item = await self._handshake.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def login(self, dsn: DSN, parameters: dict[str, str]) -> None:
        """Send the startup packet and authenticate; returns at the first ReadyForQuery."""
        assert self.transport is not None
        params = {"user": dsn.user, "database": dsn.database, **parameters}
        self.transport.write(p.StartupMessage(params).encode())
        scram: ScramClient | None = None
        while True:
            msg = await self._next()
            if isinstance(msg, p.Authentication):
                scram = self._answer_auth(msg, dsn, scram)
            elif isinstance(msg, p.ParameterStatus):
                self.parameters[msg.name] = msg.value
                if msg.name == "client_encoding":
                    # the session refuses an encoding without a codec once logged in
                    self._client_encoding(msg.value)
            elif isinstance(msg, p.BackendKeyData):
                self.key = (msg.process_id, msg.secret_key)
            elif isinstance(msg, p.ReadyForQuery):
                self.tx_status = msg.status
                return
            elif isinstance(msg, p.ErrorResponse) and not isinstance(msg, p.NoticeResponse):
                raise BackendError(msg.message or "backend login failed", msg.fields)

    def _answer_auth(
        self, msg: p.Authentication, dsn: DSN, scram: ScramClient | None
    ) -> ScramClient | None:
        assert self.transport is not None
        if msg.code == p.AUTH_OK:
            return scram
        if msg.code in (p.AUTH_CLEARTEXT, p.AUTH_MD5, p.AUTH_SASL) and dsn.password is None:
            raise BackendError(f"the backend asks for a password for role {dsn.user!r}; none is configured")
        assert dsn.password is not None
        if msg.code == p.AUTH_CLEARTEXT:
            self.transport.write(p.PasswordMessage(dsn.password.encode() + b"\0").encode())
        elif msg.code == p.AUTH_MD5:
            inner = hashlib.md5((dsn.password + dsn.user).encode()).hexdigest()
            outer = hashlib.md5(inner.encode() + msg.data[:4]).hexdigest()
            self.transport.write(p.PasswordMessage(f"md5{outer}".encode() + b"\0").encode())
        elif msg.code == p.AUTH_SASL:
            if MECHANISM not in msg.mechanisms():
                raise BackendError(f"backend offers no supported SASL mechanism: {msg.mechanisms()}")
            scram = ScramClient(dsn.password)
            self.transport.write(p.SASLInitialResponse(MECHANISM, scram.client_first()).encode())
        elif msg.code == p.AUTH_SASL_CONTINUE and scram is not None:
            try:
                self.transport.write(p.PasswordMessage(scram.client_final(msg.data)).encode())
            except ScramError as e:
                raise BackendError(str(e)) from None
        elif msg.code == p.AUTH_SASL_FINAL and scram is not None:
            try:
                scram.verify_server_final(msg.data)
            except ScramError as e:
                raise BackendError(str(e)) from None
        else:
            raise BackendError(f"unsupported authentication request {msg.code} from the backend")
        return scram


async def open_transport(
    dsn: DSN, factory: Callable[[], asyncio.Protocol]
) -> tuple[asyncio.Transport, asyncio.Protocol]:
    loop = asyncio.get_running_loop()
    if dsn.is_unix:
        transport, proto = await loop.create_unix_connection(factory, dsn.socket_path)
    else:
        transport, proto = await loop.create_connection(factory, dsn.host, dsn.port)
    return transport, proto


async def connect(dsn: DSN, parameters: dict[str, str], timeout: float = 30.0) -> BackendLink:
    """Open and log in a backend connection; raises BackendError or OSError."""
    link = BackendLink()
    try:
        async with asyncio.timeout(timeout):
            await open_transport(dsn, lambda: link)
            await link.login(dsn, parameters)
    except BaseException:
        link.close()
        raise
    return link


async def send_cancel(dsn: DSN, key: tuple[int, int]) -> None:
    """Ask the backend to cancel the query running under `key` (pid, secret)."""
    loop = asyncio.get_running_loop()
    if dsn.is_unix:
        reader, writer = await asyncio.open_unix_connection(dsn.socket_path)
    else:
        reader, writer = await asyncio.open_connection(dsn.host, dsn.port)
    try:
        writer.write(p.CancelRequest(*key).encode())
        await writer.drain()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(reader.read(1), 2.0)
    finally:
        writer.close()
        del loop
