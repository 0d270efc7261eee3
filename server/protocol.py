"""The Postgres v3 wire codec: frozen message dataclasses, encode to bytes, decode from bytes.

Pure: no sockets, no asyncio. `decode_frontend` / `decode_backend` raise only
`ProtocolViolation`. Message layouts follow the "Message Formats" chapter of the
Postgres documentation.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

PROTOCOL_V3 = 196608
SSL_REQUEST_CODE = 80877103
GSSENC_REQUEST_CODE = 80877104
CANCEL_REQUEST_CODE = 80877102

_I16 = struct.Struct("!h")
_I32 = struct.Struct("!i")
_U32 = struct.Struct("!I")
_HEADER = struct.Struct("!ci")


class ProtocolViolation(Exception):
    """The peer sent bytes that are not a valid message here (SQLSTATE 08P01)."""


class InvalidText(ProtocolViolation):
    """A string of a well-formed message is not valid in the encoding it was read in (Postgres
    answers this with an ERROR, 22021, and the session goes on)."""

    def __init__(self, raw: bytes, encoding: str) -> None:
        super().__init__(f"invalid byte sequence for encoding {encoding}: 0x{raw.hex()}")
        self.raw = raw
        self.encoding = encoding


# --------------------------------------------------------------------------- helpers


class _Reader:
    """Cursor over one message body; every read checks bounds."""

    __slots__ = ("buf", "encoding", "pos")

    def __init__(self, buf: bytes, encoding: str = "utf-8") -> None:
        self.buf = buf
        self.pos = 0
        self.encoding = encoding

    def _take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise ProtocolViolation("message is shorter than its contents claim")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def int16(self) -> int:
        return int(_I16.unpack(self._take(2))[0])

    def int32(self) -> int:
        return int(_I32.unpack(self._take(4))[0])

    def uint32(self) -> int:
        return int(_U32.unpack(self._take(4))[0])

    def byte(self) -> bytes:
        return self._take(1)

    def cstring(self) -> str:
        end = self.buf.find(b"\0", self.pos)
        if end < 0:
            raise ProtocolViolation("unterminated string in message")
        raw = self.buf[self.pos : end]
        self.pos = end + 1
        try:
            return raw.decode(self.encoding)
        except UnicodeDecodeError as e:
            raise InvalidText(e.object[e.start : e.end], self.encoding) from None

    def bytes_n(self, n: int) -> bytes:
        return self._take(n)

    def rest(self) -> bytes:
        out = self.buf[self.pos :]
        self.pos = len(self.buf)
        return out

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise ProtocolViolation("message has trailing bytes")


def _cstr(s: str, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """A protocol string in `encoding` (the session's client encoding); `errors` as for
    str.encode: "strict" for SQL (the caller turns a character the encoding lacks into an
    error), "replace" for messages to the client."""
    b = s.encode(encoding, errors)
    if b"\0" in b:
        raise ValueError("a protocol string cannot contain NUL")
    return b + b"\0"


def _frame(tag: bytes, body: bytes) -> bytes:
    return tag + _I32.pack(len(body) + 4) + body


def _int16s(values: Sequence[int]) -> bytes:
    return _I16.pack(len(values)) + b"".join(_I16.pack(v) for v in values)


def _values(values: Sequence[bytes | None]) -> bytes:
    parts = [_I16.pack(len(values))]
    for v in values:
        parts.append(_I32.pack(-1) if v is None else _I32.pack(len(v)) + v)
    return b"".join(parts)


def _read_values(r: _Reader) -> tuple[bytes | None, ...]:
    n = r.int16()
    if n < 0:
        raise ProtocolViolation("negative value count")
    out: list[bytes | None] = []
    for _ in range(n):
        size = r.int32()
        if size < -1:
            raise ProtocolViolation("invalid value length")
        out.append(None if size == -1 else r.bytes_n(size))
    return tuple(out)


def _read_int16s(r: _Reader) -> tuple[int, ...]:
    n = r.int16()
    if n < 0:
        raise ProtocolViolation("negative count")
    return tuple(r.int16() for _ in range(n))


# --------------------------------------------------------------------------- startup phase


@dataclass(frozen=True)
class StartupMessage:
    parameters: dict[str, str]
    protocol: int = PROTOCOL_V3

    def encode(self, encoding: str = "utf-8") -> bytes:
        body = _I32.pack(self.protocol)
        body += b"".join(_cstr(k) + _cstr(v) for k, v in self.parameters.items()) + b"\0"
        return _I32.pack(len(body) + 4) + body


@dataclass(frozen=True)
class SSLRequest:
    def encode(self, encoding: str = "utf-8") -> bytes:
        return _I32.pack(8) + _I32.pack(SSL_REQUEST_CODE)


@dataclass(frozen=True)
class GSSENCRequest:
    def encode(self, encoding: str = "utf-8") -> bytes:
        return _I32.pack(8) + _I32.pack(GSSENC_REQUEST_CODE)


@dataclass(frozen=True)
class CancelRequest:
    process_id: int
    secret_key: int

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _I32.pack(16) + _I32.pack(CANCEL_REQUEST_CODE) + _I32.pack(self.process_id) + _I32.pack(
            self.secret_key
        )


StartupPacket = StartupMessage | SSLRequest | GSSENCRequest | CancelRequest


def decode_startup(body: bytes) -> StartupPacket:
    """Decode an untyped startup-phase packet (the body after its length word)."""
    r = _Reader(body)
    code = r.int32()
    if code == SSL_REQUEST_CODE:
        r.end()
        return SSLRequest()
    if code == GSSENC_REQUEST_CODE:
        r.end()
        return GSSENCRequest()
    if code == CANCEL_REQUEST_CODE:
        pid, key = r.int32(), r.int32()
        r.end()
        return CancelRequest(pid, key)
    if code >> 16 != 3:
        raise ProtocolViolation(
            f"unsupported frontend protocol {code >> 16}.{code & 0xFFFF}: server supports 3.0"
        )
    params: dict[str, str] = {}
    while True:
        name = r.cstring()
        if name == "":
            break
        params[name] = r.cstring()
    r.end()
    if "user" not in params:
        raise ProtocolViolation("no PostgreSQL user name specified in startup packet")
    return StartupMessage(params, code)


# --------------------------------------------------------------------------- frontend (client → server)


@dataclass(frozen=True)
class Query:
    tag: ClassVar[bytes] = b"Q"
    sql: str

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, _cstr(self.sql, encoding))


@dataclass(frozen=True)
class Parse:
    tag: ClassVar[bytes] = b"P"
    name: str
    sql: str
    param_types: tuple[int, ...] = ()

    def encode(self, encoding: str = "utf-8") -> bytes:
        body = _cstr(self.name, encoding) + _cstr(self.sql, encoding)
        body += _I16.pack(len(self.param_types))
        body += b"".join(_U32.pack(t) for t in self.param_types)
        return _frame(self.tag, body)


@dataclass(frozen=True)
class Bind:
    tag: ClassVar[bytes] = b"B"
    portal: str
    statement: str
    param_formats: tuple[int, ...] = ()
    params: tuple[bytes | None, ...] = ()
    result_formats: tuple[int, ...] = ()

    def encode(self, encoding: str = "utf-8") -> bytes:
        body = _cstr(self.portal, encoding) + _cstr(self.statement, encoding)
        body += _int16s(self.param_formats)
        body += _values(self.params) + _int16s(self.result_formats)
        return _frame(self.tag, body)

    def param_format(self, i: int) -> int:
        """The format code of parameter i (0 text, 1 binary), per the Bind rules."""
        if not self.param_formats:
            return 0
        return self.param_formats[0] if len(self.param_formats) == 1 else self.param_formats[i]

    def result_format(self, i: int) -> int:
        if not self.result_formats:
            return 0
        return self.result_formats[0] if len(self.result_formats) == 1 else self.result_formats[i]


@dataclass(frozen=True)
class Describe:
    tag: ClassVar[bytes] = b"D"
    kind: bytes  # b"S" statement or b"P" portal
    name: str

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, self.kind + _cstr(self.name, encoding))


@dataclass(frozen=True)
class Execute:
    tag: ClassVar[bytes] = b"E"
    portal: str
    max_rows: int = 0

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, _cstr(self.portal, encoding) + _I32.pack(self.max_rows))


@dataclass(frozen=True)
class Close:
    tag: ClassVar[bytes] = b"C"
    kind: bytes
    name: str

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, self.kind + _cstr(self.name, encoding))


@dataclass(frozen=True)
class Sync:
    tag: ClassVar[bytes] = b"S"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, b"")


@dataclass(frozen=True)
class Flush:
    tag: ClassVar[bytes] = b"H"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, b"")


@dataclass(frozen=True)
class Terminate:
    tag: ClassVar[bytes] = b"X"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, b"")


@dataclass(frozen=True)
class PasswordMessage:
    """A 'p' message: cleartext/MD5 password, SASLInitialResponse or SASLResponse (by context)."""

    tag: ClassVar[bytes] = b"p"
    data: bytes

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, self.data)


@dataclass(frozen=True)
class SASLInitialResponse:
    tag: ClassVar[bytes] = b"p"
    mechanism: str
    data: bytes | None

    def encode(self, encoding: str = "utf-8") -> bytes:
        body = _cstr(self.mechanism)
        body += _I32.pack(-1) if self.data is None else _I32.pack(len(self.data)) + self.data
        return _frame(self.tag, body)

    @classmethod
    def parse(cls, msg: PasswordMessage) -> SASLInitialResponse:
        r = _Reader(msg.data)
        mech = r.cstring()
        n = r.int32()
        data = None if n == -1 else r.bytes_n(n)
        r.end()
        return cls(mech, data)


@dataclass(frozen=True)
class CopyData:
    tag: ClassVar[bytes] = b"d"
    data: bytes

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, self.data)


@dataclass(frozen=True)
class CopyDone:
    tag: ClassVar[bytes] = b"c"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, b"")


@dataclass(frozen=True)
class CopyFail:
    tag: ClassVar[bytes] = b"f"
    message: str

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, _cstr(self.message, encoding, "replace"))


@dataclass(frozen=True)
class FunctionCall:
    """The legacy fast-path call; kept opaque: the proxy refuses it."""

    tag: ClassVar[bytes] = b"F"
    data: bytes

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, self.data)


FrontendMessage = (
    Query | Parse | Bind | Describe | Execute | Close | Sync | Flush | Terminate
    | PasswordMessage | CopyData | CopyDone | CopyFail | FunctionCall
)


def decode_frontend(tag: bytes, body: bytes, encoding: str = "utf-8") -> FrontendMessage:
    """Decode one typed client message, its strings in `encoding` (a Python codec: the
    session's client encoding)."""
    r = _Reader(body, encoding)
    msg: FrontendMessage
    if tag == b"Q":
        msg = Query(r.cstring())
    elif tag == b"P":
        name, sql = r.cstring(), r.cstring()
        n = r.int16()
        if n < 0:
            raise ProtocolViolation("negative parameter type count")
        msg = Parse(name, sql, tuple(r.uint32() for _ in range(n)))
    elif tag == b"B":
        portal, stmt = r.cstring(), r.cstring()
        pformats = _read_int16s(r)
        params = _read_values(r)
        rformats = _read_int16s(r)
        if len(pformats) > 1 and len(pformats) != len(params):
            raise ProtocolViolation(
                f"bind message has {len(pformats)} parameter formats but {len(params)} parameters"
            )
        if any(f not in (0, 1) for f in pformats + rformats):
            raise ProtocolViolation("unsupported format code")
        msg = Bind(portal, stmt, pformats, params, rformats)
    elif tag in (b"D", b"C"):
        kind = r.byte()
        if kind not in (b"S", b"P"):
            raise ProtocolViolation(f"invalid {'DESCRIBE' if tag == b'D' else 'CLOSE'} message subtype")
        name = r.cstring()
        msg = Describe(kind, name) if tag == b"D" else Close(kind, name)
    elif tag == b"E":
        msg = Execute(r.cstring(), r.int32())
    elif tag == b"S":
        msg = Sync()
    elif tag == b"H":
        msg = Flush()
    elif tag == b"X":
        msg = Terminate()
    elif tag == b"p":
        return PasswordMessage(r.rest())
    elif tag == b"d":
        return CopyData(r.rest())
    elif tag == b"c":
        msg = CopyDone()
    elif tag == b"f":
        msg = CopyFail(r.cstring())
    elif tag == b"F":
        return FunctionCall(r.rest())
    else:
        raise ProtocolViolation(f"invalid frontend message type {tag!r}")
    r.end()
    return msg


# --------------------------------------------------------------------------- backend (server → client)

AUTH_OK = 0
AUTH_CLEARTEXT = 3
AUTH_MD5 = 5
AUTH_SASL = 10
AUTH_SASL_CONTINUE = 11
AUTH_SASL_FINAL = 12


@dataclass(frozen=True)
class Authentication:
    tag: ClassVar[bytes] = b"R"
    code: int
    data: bytes = b""
    """SASL: mechanism list / server message; MD5: the 4-byte salt."""

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, _I32.pack(self.code) + self.data)

    @classmethod
    def sasl(cls, mechanisms: Sequence[str]) -> Authentication:
        return cls(AUTH_SASL, b"".join(_cstr(m) for m in mechanisms) + b"\0")

    def mechanisms(self) -> list[str]:
        return [m.decode() for m in self.data.split(b"\0") if m]


@dataclass(frozen=True)
class ParameterStatus:
    tag: ClassVar[bytes] = b"S"
    name: str
    value: str

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, _cstr(self.name, encoding, "replace")
                      + _cstr(self.value, encoding, "replace"))


@dataclass(frozen=True)
class BackendKeyData:
    tag: ClassVar[bytes] = b"K"
    process_id: int
    secret_key: int

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, _I32.pack(self.process_id) + _I32.pack(self.secret_key))


@dataclass(frozen=True)
class ReadyForQuery:
    tag: ClassVar[bytes] = b"Z"
    status: bytes = b"I"  # I idle, T in transaction, E failed transaction

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, self.status)


@dataclass(frozen=True)
class FieldDescription:
    name: str
    table_oid: int = 0
    column_attnum: int = 0
    type_oid: int = 25
    type_size: int = -1
    type_modifier: int = -1
    format: int = 0


@dataclass(frozen=True)
class RowDescription:
    tag: ClassVar[bytes] = b"T"
    fields: tuple[FieldDescription, ...]

    def encode(self, encoding: str = "utf-8") -> bytes:
        parts = [_I16.pack(len(self.fields))]
        for f in self.fields:
            parts.append(
                _cstr(f.name, encoding, "replace")
                + struct.pack("!IhIhih", f.table_oid, f.column_attnum, f.type_oid,
                              f.type_size, f.type_modifier, f.format)
            )
        return _frame(self.tag, b"".join(parts))


@dataclass(frozen=True)
class DataRow:
    tag: ClassVar[bytes] = b"D"
    values: tuple[bytes | None, ...]

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, _values(self.values))


@dataclass(frozen=True)
class CommandComplete:
    tag: ClassVar[bytes] = b"C"
    command_tag: str

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, _cstr(self.command_tag, encoding, "replace"))


@dataclass(frozen=True)
class EmptyQueryResponse:
    tag: ClassVar[bytes] = b"I"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, b"")


# ErrorResponse / NoticeResponse field codes
FIELD_SEVERITY = "S"
FIELD_SEVERITY_V = "V"
FIELD_CODE = "C"
FIELD_MESSAGE = "M"
FIELD_DETAIL = "D"
FIELD_HINT = "H"


@dataclass(frozen=True)
class ErrorResponse:
    tag: ClassVar[bytes] = b"E"
    fields: tuple[tuple[str, str], ...]

    def encode(self, encoding: str = "utf-8") -> bytes:
        body = b"".join(k.encode("ascii") + _cstr(v, encoding, "replace")
                        for k, v in self.fields) + b"\0"
        return _frame(self.tag, body)

    def get(self, code: str) -> str | None:
        for k, v in self.fields:
            if k == code:
                return v
        return None

    @property
    def sqlstate(self) -> str | None:
        return self.get(FIELD_CODE)

    @property
    def message(self) -> str | None:
        return self.get(FIELD_MESSAGE)


@dataclass(frozen=True)
class NoticeResponse(ErrorResponse):
    tag: ClassVar[bytes] = b"N"


@dataclass(frozen=True)
class ParseComplete:
    tag: ClassVar[bytes] = b"1"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, b"")


@dataclass(frozen=True)
class BindComplete:
    tag: ClassVar[bytes] = b"2"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, b"")


@dataclass(frozen=True)
class CloseComplete:
    tag: ClassVar[bytes] = b"3"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, b"")


@dataclass(frozen=True)
class NoData:
    tag: ClassVar[bytes] = b"n"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, b"")


@dataclass(frozen=True)
class ParameterDescription:
    tag: ClassVar[bytes] = b"t"
    type_oids: tuple[int, ...]

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(
            self.tag, _I16.pack(len(self.type_oids)) + b"".join(_U32.pack(t) for t in self.type_oids)
        )


@dataclass(frozen=True)
class PortalSuspended:
    tag: ClassVar[bytes] = b"s"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, b"")


@dataclass(frozen=True)
class NotificationResponse:
    tag: ClassVar[bytes] = b"A"
    process_id: int
    channel: str
    payload: str

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.tag, _I32.pack(self.process_id) + _cstr(self.channel, encoding, "replace")
                      + _cstr(self.payload, encoding, "replace"))


@dataclass(frozen=True)
class CopyResponse:
    """CopyInResponse 'G', CopyOutResponse 'H', CopyBothResponse 'W'."""

    kind: bytes
    overall_format: int
    column_formats: tuple[int, ...] = field(default=())

    def encode(self, encoding: str = "utf-8") -> bytes:
        return _frame(self.kind, bytes([self.overall_format]) + _int16s(self.column_formats))


BackendMessage = (
    Authentication | ParameterStatus | BackendKeyData | ReadyForQuery | RowDescription | DataRow
    | CommandComplete | EmptyQueryResponse | ErrorResponse | NoticeResponse | ParseComplete
    | BindComplete | CloseComplete | NoData | ParameterDescription | PortalSuspended
    | NotificationResponse | CopyResponse | CopyData | CopyDone
)


def _error_fields(r: _Reader) -> tuple[tuple[str, str], ...]:
    out = []
    while True:
        code = r.byte()
        if code == b"\0":
            break
        out.append((code.decode("latin-1"), r.cstring()))
    return tuple(out)


def decode_backend(tag: bytes, body: bytes, encoding: str = "utf-8") -> BackendMessage:
    """Decode one server message, its strings in `encoding` (the client encoding it was sent in)."""
    r = _Reader(body, encoding)
    msg: BackendMessage
    if tag == b"R":
        return Authentication(r.int32(), r.rest())
    if tag == b"S":
        msg = ParameterStatus(r.cstring(), r.cstring())
    elif tag == b"K":
        msg = BackendKeyData(r.int32(), r.int32())
    elif tag == b"Z":
        status = r.byte()
        if status not in (b"I", b"T", b"E"):
            raise ProtocolViolation(f"invalid transaction status {status!r}")
        msg = ReadyForQuery(status)
    elif tag == b"T":
        n = r.int16()
        fields = []
        for _ in range(n):
            name = r.cstring()
            table_oid, attnum, type_oid, size, mod, fmt = struct.unpack("!IhIhih", r.bytes_n(18))
            fields.append(FieldDescription(name, table_oid, attnum, type_oid, size, mod, fmt))
        msg = RowDescription(tuple(fields))
    elif tag == b"D":
        msg = DataRow(_read_values(r))
    elif tag == b"C":
        msg = CommandComplete(r.cstring())
    elif tag == b"I":
        msg = EmptyQueryResponse()
    elif tag == b"E":
        msg = ErrorResponse(_error_fields(r))
    elif tag == b"N":
        msg = NoticeResponse(_error_fields(r))
    elif tag == b"1":
        msg = ParseComplete()
    elif tag == b"2":
        msg = BindComplete()
    elif tag == b"3":
        msg = CloseComplete()
    elif tag == b"n":
        msg = NoData()
    elif tag == b"t":
        n = r.int16()
        msg = ParameterDescription(tuple(r.uint32() for _ in range(n)))
    elif tag == b"s":
        msg = PortalSuspended()
    elif tag == b"A":
        msg = NotificationResponse(r.int32(), r.cstring(), r.cstring())
    elif tag in (b"G", b"H", b"W"):
        overall = r.byte()[0]
        msg = CopyResponse(tag, overall, _read_int16s(r))
    elif tag == b"d":
        return CopyData(r.rest())
    elif tag == b"c":
        msg = CopyDone()
    else:
        raise ProtocolViolation(f"invalid backend message type {tag!r}")
    r.end()
    return msg


# --------------------------------------------------------------------------- framing


class FrameReader:
    """Splits a byte stream into (tag, body) frames; startup packets have tag b"".

    `max_size` bounds a frame's declared length, so a peer cannot make us buffer
    more than that before we notice.
    """

    __slots__ = ("_buf", "max_size", "startup")

    def __init__(self, max_size: int = 64 * 1024 * 1024, startup: bool = False) -> None:
        self._buf = bytearray()
        self.max_size = max_size
        self.startup = startup

    def feed(self, data: bytes) -> None:
        self._buf += data

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        return self

    def __next__(self) -> tuple[bytes, bytes]:
        frame = self.next_raw()
        if frame is None:
            raise StopIteration
        tag, raw = frame
        return tag, raw[5:] if tag else raw[4:]

    def next_raw(self) -> tuple[bytes, bytes] | None:
        """The next complete frame as (tag, its raw bytes including the header), or None."""
        buf = self._buf
        if self.startup:
            if len(buf) < 4:
                return None
            length = _I32.unpack_from(buf, 0)[0]
            if length < 8 or length > 10_000:
                raise ProtocolViolation("invalid length of startup packet")
            if len(buf) < length:
                return None
            raw = bytes(buf[:length])
            del buf[:length]
            return b"", raw
        if len(buf) < 5:
            return None
        tag, length = _HEADER.unpack_from(buf, 0)
        if length < 4:
            raise ProtocolViolation(f"invalid message length {length}")
        if length > self.max_size:
            raise ProtocolViolation(f"message of {length} bytes exceeds the limit of {self.max_size}")
        total = length + 1
        if len(buf) < total:
            return None
        raw = bytes(buf[:total])
        del buf[:total]
        return tag, raw

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def take_buffer(self) -> bytes:
        """Remove and return whatever is buffered (used when switching to TLS)."""
        out = bytes(self._buf)
        self._buf.clear()
        return out
