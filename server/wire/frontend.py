"""The messages a client sends: startup-phase packets and typed frontend messages, and their decoders.

`CopyData` and `CopyDone` travel in both directions; they are defined here and `backend`
decodes them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from server.wire.codec import (
    I16,
    I32,
    U32,
    MissingUserName,
    ProtocolViolation,
    Reader,
    UnsupportedProtocol,
    cstr,
    frame,
    int16s,
    read_int16s,
    read_values,
    values,
)

PROTOCOL_V3 = 196608
SSL_REQUEST_CODE = 80877103
GSSENC_REQUEST_CODE = 80877104
CANCEL_REQUEST_CODE = 80877102


# --------------------------------------------------------------------------- startup phase


@dataclass(frozen=True)
class StartupMessage:
    parameters: dict[str, str]
    protocol: int = PROTOCOL_V3

    def encode(self, encoding: str = "utf-8") -> bytes:
        body = I32.pack(self.protocol)
        body += b"".join(cstr(k) + cstr(v) for k, v in self.parameters.items()) + b"\0"
        return I32.pack(len(body) + 4) + body


@dataclass(frozen=True)
class SSLRequest:
    def encode(self, encoding: str = "utf-8") -> bytes:
        return I32.pack(8) + I32.pack(SSL_REQUEST_CODE)


@dataclass(frozen=True)
class GSSENCRequest:
    def encode(self, encoding: str = "utf-8") -> bytes:
        return I32.pack(8) + I32.pack(GSSENC_REQUEST_CODE)


@dataclass(frozen=True)
class CancelRequest:
    process_id: int
    secret_key: int

    def encode(self, encoding: str = "utf-8") -> bytes:
        return I32.pack(16) + I32.pack(CANCEL_REQUEST_CODE) + I32.pack(self.process_id) + I32.pack(
            self.secret_key
        )


StartupPacket = StartupMessage | SSLRequest | GSSENCRequest | CancelRequest


def decode_startup(body: bytes) -> StartupPacket:
    """Decode an untyped startup-phase packet (the body after its length word)."""
    r = Reader(body)
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
    if code >> 16 != PROTOCOL_V3 >> 16:
        raise UnsupportedProtocol(
            f"unsupported frontend protocol {code >> 16}.{code & 0xFFFF}: server supports "
            "3.0 to 3.0")
    params: dict[str, str] = {}
    while True:
        name = r.cstring()
        if name == "":
            break
        params[name] = r.cstring()
    r.end()
    if "user" not in params:
        raise MissingUserName("no PostgreSQL user name specified in startup packet")
    return StartupMessage(params, code)


# --------------------------------------------------------------------------- frontend (client → server)


@dataclass(frozen=True)
class Query:
    tag: ClassVar[bytes] = b"Q"
    sql: str

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, cstr(self.sql, encoding))


@dataclass(frozen=True)
class Parse:
    tag: ClassVar[bytes] = b"P"
    name: str
    sql: str
    param_types: tuple[int, ...] = ()

    def encode(self, encoding: str = "utf-8") -> bytes:
        body = cstr(self.name, encoding) + cstr(self.sql, encoding)
        body += I16.pack(len(self.param_types))
        body += b"".join(U32.pack(t) for t in self.param_types)
        return frame(self.tag, body)


@dataclass(frozen=True)
class Bind:
    tag: ClassVar[bytes] = b"B"
    portal: str
    statement: str
    param_formats: tuple[int, ...] = ()
    params: tuple[bytes | None, ...] = ()
    result_formats: tuple[int, ...] = ()

    def encode(self, encoding: str = "utf-8") -> bytes:
        body = cstr(self.portal, encoding) + cstr(self.statement, encoding)
        body += int16s(self.param_formats)
        body += values(self.params) + int16s(self.result_formats)
        return frame(self.tag, body)

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
        return frame(self.tag, self.kind + cstr(self.name, encoding))


@dataclass(frozen=True)
class Execute:
    tag: ClassVar[bytes] = b"E"
    portal: str
    max_rows: int = 0

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, cstr(self.portal, encoding) + I32.pack(self.max_rows))


@dataclass(frozen=True)
class Close:
    tag: ClassVar[bytes] = b"C"
    kind: bytes
    name: str

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, self.kind + cstr(self.name, encoding))


@dataclass(frozen=True)
class Sync:
    tag: ClassVar[bytes] = b"S"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, b"")


@dataclass(frozen=True)
class Flush:
    tag: ClassVar[bytes] = b"H"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, b"")


@dataclass(frozen=True)
class Terminate:
    tag: ClassVar[bytes] = b"X"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, b"")


@dataclass(frozen=True)
class PasswordMessage:
    """A 'p' message: cleartext/MD5 password, SASLInitialResponse or SASLResponse (by context)."""

    tag: ClassVar[bytes] = b"p"
    data: bytes

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, self.data)


@dataclass(frozen=True)
class SASLInitialResponse:
    tag: ClassVar[bytes] = b"p"
    mechanism: str
    data: bytes | None

    def encode(self, encoding: str = "utf-8") -> bytes:
        body = cstr(self.mechanism)
        body += I32.pack(-1) if self.data is None else I32.pack(len(self.data)) + self.data
        return frame(self.tag, body)

    @classmethod
    def parse(cls, msg: PasswordMessage) -> SASLInitialResponse:
        r = Reader(msg.data)
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
        return frame(self.tag, self.data)


@dataclass(frozen=True)
class CopyDone:
    tag: ClassVar[bytes] = b"c"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, b"")


@dataclass(frozen=True)
class CopyFail:
    tag: ClassVar[bytes] = b"f"
    message: str

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, cstr(self.message, encoding, "replace"))


@dataclass(frozen=True)
class FunctionCall:
    """The legacy fast-path call; kept opaque: the proxy refuses it."""

    tag: ClassVar[bytes] = b"F"
    data: bytes

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, self.data)


FrontendMessage = (
    Query | Parse | Bind | Describe | Execute | Close | Sync | Flush | Terminate
    | PasswordMessage | CopyData | CopyDone | CopyFail | FunctionCall
)


def decode_frontend(tag: bytes, body: bytes, encoding: str = "utf-8") -> FrontendMessage:
    """Decode one typed client message, its strings in `encoding` (a Python codec: the
    session's client encoding)."""
    r = Reader(body, encoding)
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
        pformats = read_int16s(r)
        params = read_values(r)
        rformats = read_int16s(r)
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
