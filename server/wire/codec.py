"""Primitive encodings both directions share: bounds-checked reader, strings, frames, values.

The struct formats, the exceptions a decoder raises, and the helpers that the message
classes of `frontend` and `backend` encode and decode their bodies with.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

I16 = struct.Struct("!h")
I32 = struct.Struct("!i")
U32 = struct.Struct("!I")
HEADER = struct.Struct("!ci")


class ProtocolViolation(Exception):
    """The peer sent bytes that are not a valid message here (SQLSTATE 08P01)."""


class UnframedStartup(ProtocolViolation):
    """A start-up packet whose length word cannot be one (a Terminate or garbage sent before
    any start-up packet): Postgres logs it and closes the connection without a reply."""


class UnsupportedProtocol(ProtocolViolation):
    """A start-up packet asking for a major protocol version other than 3 (Postgres: 0A000)."""


class MissingUserName(ProtocolViolation):
    """A start-up packet without a user (Postgres: 28000)."""


class InvalidText(ProtocolViolation):
    """A string of a well-formed message is not valid in the encoding it was read in (Postgres
    answers this with an ERROR, 22021, and the session goes on)."""

    def __init__(self, raw: bytes, encoding: str) -> None:
        super().__init__(f"invalid byte sequence for encoding {encoding}: 0x{raw.hex()}")
        self.raw = raw
        self.encoding = encoding


# --------------------------------------------------------------------------- helpers


class Reader:
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
        return int(I16.unpack(self._take(2))[0])

    def int32(self) -> int:
        return int(I32.unpack(self._take(4))[0])

    def uint32(self) -> int:
        return int(U32.unpack(self._take(4))[0])

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


def cstr(s: str, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """A protocol string in `encoding` (the session's client encoding); `errors` as for
    str.encode: "strict" for SQL (the caller turns a character the encoding lacks into an
    error), "replace" for messages to the client."""
    b = s.encode(encoding, errors)
    if b"\0" in b:
        raise ValueError("a protocol string cannot contain NUL")
    return b + b"\0"


def frame(tag: bytes, body: bytes) -> bytes:
    return tag + I32.pack(len(body) + 4) + body


def int16s(values: Sequence[int]) -> bytes:
    return I16.pack(len(values)) + b"".join(I16.pack(v) for v in values)


def values(values: Sequence[bytes | None]) -> bytes:
    parts = [I16.pack(len(values))]
    for v in values:
        parts.append(I32.pack(-1) if v is None else I32.pack(len(v)) + v)
    return b"".join(parts)


def read_values(r: Reader) -> tuple[bytes | None, ...]:
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


def read_int16s(r: Reader) -> tuple[int, ...]:
    n = r.int16()
    if n < 0:
        raise ProtocolViolation("negative count")
    return tuple(r.int16() for _ in range(n))
