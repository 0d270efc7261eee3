"""A session's own link to the backend Postgres: relays its bytes, tracking what each reply ends.

After login the link relays the backend's bytes to the client unchanged. It
splits them into frames only to know which forwarded client message each
reply completes (so the session can answer proxy-local messages in order), to
track the transaction status, and to swallow the ReadyForQuery of statements
the proxy sent on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

from server import wire as p
from server.backend.own_statements import OwnStatements
from server.backend.pending import (
    COMPLETES,
    CYCLE_TRACKED_INT,
    ENDS_INT,
    EXTENDED_TAGS,
    FAILS,
    FETCH_TRACKED_INT,
    FETCHES,
    INTERNAL_COMPLETES,
    SIMPLE,
    SYNCS,
    TRACKED_INT,
    UNRELAYED_READY,
    Pending,
)
from server.encodings import UnsupportedEncoding, codec


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


_QUERY, _SYNC = Pending.QUERY, Pending.SYNC
"""For the relay loop (an Enum member is a slow class attribute on Python 3.11)."""
_LENGTH = struct.Struct("!i")
_BYTES = [bytes((i,)) for i in range(256)]
_QUERY_TAG, _EXECUTE_TAG, _SYNC_TAG = ord("Q"), ord("E"), ord("S")
"""Client messages whose forwarding `note_cycle` notes."""
_READY_TAG, _COMPLETE_TAG = ord("Z"), ord("C")
"""ReadyForQuery and CommandComplete, from the backend."""
_IDLE_STATUS = ord("I")
"""ReadyForQuery's transaction status outside a block."""


class CycleCounter(Protocol):
    """Where the relay counts client cycles that succeeded (the metrics)."""

    pass_through_ok: int


@dataclass
class RelayTarget:
    """Where relayed bytes go, and what to do when the backend is lost."""

    write: Callable[[bytes], None]
    lost: Callable[[Exception | None], None]


class BackendLink(OwnStatements, asyncio.Protocol):
    # slots: more than 30 instance attributes in a dict would cost every attribute read on
    # the relay's path (CPython 3.11 stops sharing the keys and inlining the values)
    __slots__ = ("_began_after_end", "_corked", "_drained", "_end_tag", "_frames", "_handshake",
                 "_partial", "_relaying", "_skip", "batch_started", "closed", "codec", "counter",
                 "cycles", "encoding", "errors", "errors_at_ready", "fatal_relayed", "fetched",
                 "idle_readies",
                 "key", "last_split_failed", "last_sqlstate", "log_cycles", "on_cycle", "on_tx_end",
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
        self.fatal_relayed = False
        """The backend sent the client a FATAL (or PANIC) error: it is ending the session."""
        self.on_cycle: Callable[[float, str | None], None] | None = None
        """Called at the end of each client cycle that did pass-through work: its start, and
        the SQLSTATE of its last error (None when it succeeded); for a success only when
        `log_cycles` is set, else the cycle is just counted in `counter`."""
        self.log_cycles = True
        self.counter: CycleCounter | None = None
        self.fetched: list[tuple[bytes | None, ...]] = []
        """The rows of the proxy's last own question (`fetch_own`)."""

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
        unpack, tracked, pending = _LENGTH.unpack_from, TRACKED_INT, self.pending
        fetching = FETCHES
        ends, query, sync = ENDS_INT, _QUERY, _SYNC
        watch = self.watch_tx
        head = pending[0] if pending else None
        # before the ReadyForQuery that ends a client cycle only errors and parameters matter
        look = CYCLE_TRACKED_INT if (head is query or head is sync) and not watch else \
            FETCH_TRACKED_INT if head in fetching else tracked
        while pos + 5 <= n:
            tag = buf[pos]  # an int: cheaper than a one-byte slice on this hot path
            length = unpack(buf, pos + 1)[0]
            if length < 4:
                self._lose(p.ProtocolViolation("invalid message length from the backend"))
                return
            end = pos + 1 + length
            if end > n:
                if tag not in tracked and tag not in look:
                    self._skip = end - n
                    pos = n
                break
            if tag in look:
                if head is not None and head is ends.get(tag) and not watch:
                    pending.popleft()
                    head = pending[0] if pending else None
                elif tag == _READY_TAG and (head is query or head is sync) \
                        and self.errors == self.errors_at_ready and self.cycles and not watch:
                    # a client cycle that succeeded: `_track`'s common case
                    pending.popleft()
                    head = pending[0] if pending else None
                    status = buf[pos + 5]
                    self.tx_status = _BYTES[status]
                    if status == _IDLE_STATUS:
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
                look = CYCLE_TRACKED_INT if (head is query or head is sync) and not watch \
                    else FETCH_TRACKED_INT if head in fetching else tracked
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
            if head in SIMPLE or head in SYNCS:
                pending.popleft()
                relay = head not in UNRELAYED_READY
                if relay and self.cycles:
                    started = self.cycles.popleft()
                    if started is not None:
                        self._cycle_done(started, self.last_sqlstate if failed else None)
        elif tag == b"E" and head in FAILS:
            relay = False  # (the client has the proxy's own error)
            if head is Pending.INTERNAL_FAIL:
                while pending and pending[0] not in SYNCS:  # the backend skips to Sync
                    pending.popleft()
                if not pending:
                    self.skipping = True
        elif tag == b"E":
            self.errors += 1
            code = buf.find(b"\0C", start + 4, end)  # a field boundary, then the SQLSTATE field
            self.last_sqlstate = buf[code + 2 : code + 7].decode("ascii", "replace") \
                if code >= 0 else "XX000"
            if buf.find(b"\0VFATAL\0", start + 4, end) >= 0 or \
                    buf.find(b"\0VPANIC\0", start + 4, end) >= 0:
                self.fatal_relayed = True
            if head is Pending.QUERY_SPLIT:
                self.last_split_failed = True
            if head is not None and head not in SIMPLE:
                # the backend now skips everything up to the next Sync
                while pending and pending[0] not in SYNCS:
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
                if msg.name == "client_encoding" and not self.client_encoding(msg.value):
                    self._lose(UnsupportedEncoding(msg.value))
                    return False
        elif head in FETCHES and tag in b"TDC":
            relay = False  # (the proxy's own question: its rows are the proxy's)
            if tag == b"D":
                row = p.decode_backend(tag, buf[start + 5 : end], self.codec)
                assert isinstance(row, p.DataRow)
                self.fetched.append(row.values)
            elif tag == b"C" and head is Pending.INTERNAL_FETCH:
                pending.popleft()
        elif head is Pending.INTERNAL_QUERY:
            relay = False  # (its CommandComplete)
        elif head is not None and head is INTERNAL_COMPLETES.get(tag):
            pending.popleft()
            relay = False
        elif head is not None and head in COMPLETES.get(tag, ()):
            pending.popleft()
        return relay

    def client_encoding(self, name: str) -> bool:
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
        if tag == _COMPLETE_TAG:
            text = buf[start + 5 : end - 1]
            if text in (b"COMMIT", b"ROLLBACK"):
                if self._end_tag is None:
                    self._end_tag = text
            elif text in (b"BEGIN", b"START TRANSACTION") and self._end_tag is not None:
                self._began_after_end = True
        elif tag == _READY_TAG:
            command, self._end_tag = self._end_tag, None
            began, self._began_after_end = self._began_after_end, False
            if command is None:
                if buf[start + 5] == _IDLE_STATUS:
                    # an implicit transaction ended (an extended batch's, at its Sync): it
                    # committed unless something in it failed
                    self._tx_end(self.errors == self.errors_at_ready)
                return
            if buf[start + 5] == _IDLE_STATUS or began:
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
        kind = Pending.QUERY if tag == b"Q" else EXTENDED_TAGS.get(tag)
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
        if tag == _QUERY_TAG:
            self.cycles.append(now)
        elif tag == _EXECUTE_TAG:
            if self.batch_started is None:
                self.batch_started = now
        elif tag == _SYNC_TAG:
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

    async def drain(self) -> None:
        """Wait until every forwarded message has its reply relayed (sending Flush if needed)."""
        self.uncork()
        if not self.pending:
            return
        if self.pending[-1] not in SIMPLE and self.pending[-1] not in SYNCS:
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

    async def next_login_message(self) -> p.BackendMessage:
        item = await self._handshake.get()
        if isinstance(item, BaseException):
            raise item
        return item

