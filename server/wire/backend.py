"""The messages the server sends: authentication, status, results, errors, notices; their decoder."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from server.wire.codec import (
    I16,
    I32,
    U32,
    ProtocolViolation,
    Reader,
    cstr,
    frame,
    int16s,
    read_int16s,
    read_values,
    values,
)
from server.wire.frontend import CopyData, CopyDone

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
        return frame(self.tag, I32.pack(self.code) + self.data)

    @classmethod
    def sasl(cls, mechanisms: Sequence[str]) -> Authentication:
        return cls(AUTH_SASL, b"".join(cstr(m) for m in mechanisms) + b"\0")

    def mechanisms(self) -> list[str]:
        return [m.decode() for m in self.data.split(b"\0") if m]


@dataclass(frozen=True)
class ParameterStatus:
    tag: ClassVar[bytes] = b"S"
    name: str
    value: str

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, cstr(self.name, encoding, "replace")
                      + cstr(self.value, encoding, "replace"))


@dataclass(frozen=True)
class BackendKeyData:
    tag: ClassVar[bytes] = b"K"
    process_id: int
    secret_key: int

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, I32.pack(self.process_id) + I32.pack(self.secret_key))


@dataclass(frozen=True)
class NegotiateProtocolVersion:
    """The newest protocol version the server speaks (as Postgres 16 sends it: the whole
    version word, 3.0) and the `_pq_.` start-up options it does not know."""

    tag: ClassVar[bytes] = b"v"
    newest: int
    unrecognized: tuple[str, ...] = ()

    def encode(self, encoding: str = "utf-8") -> bytes:
        body = I32.pack(self.newest) + I32.pack(len(self.unrecognized))
        return frame(self.tag, body + b"".join(cstr(o, encoding, "replace")
                                               for o in self.unrecognized))


@dataclass(frozen=True)
class ReadyForQuery:
    tag: ClassVar[bytes] = b"Z"
    status: bytes = b"I"  # I idle, T in transaction, E failed transaction

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, self.status)


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
        parts = [I16.pack(len(self.fields))]
        for f in self.fields:
            parts.append(
                cstr(f.name, encoding, "replace")
                + struct.pack("!IhIhih", f.table_oid, f.column_attnum, f.type_oid,
                              f.type_size, f.type_modifier, f.format)
            )
        return frame(self.tag, b"".join(parts))


@dataclass(frozen=True)
class DataRow:
    tag: ClassVar[bytes] = b"D"
    values: tuple[bytes | None, ...]

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, values(self.values))


@dataclass(frozen=True)
class CommandComplete:
    tag: ClassVar[bytes] = b"C"
    command_tag: str

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, cstr(self.command_tag, encoding, "replace"))


@dataclass(frozen=True)
class EmptyQueryResponse:
    tag: ClassVar[bytes] = b"I"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, b"")


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
        body = b"".join(k.encode("ascii") + cstr(v, encoding, "replace")
                        for k, v in self.fields) + b"\0"
        return frame(self.tag, body)

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
        return frame(self.tag, b"")


@dataclass(frozen=True)
class BindComplete:
    tag: ClassVar[bytes] = b"2"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, b"")


@dataclass(frozen=True)
class CloseComplete:
    tag: ClassVar[bytes] = b"3"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, b"")


@dataclass(frozen=True)
class NoData:
    tag: ClassVar[bytes] = b"n"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, b"")


@dataclass(frozen=True)
class ParameterDescription:
    tag: ClassVar[bytes] = b"t"
    type_oids: tuple[int, ...]

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(
            self.tag, I16.pack(len(self.type_oids)) + b"".join(U32.pack(t) for t in self.type_oids)
        )


@dataclass(frozen=True)
class PortalSuspended:
    tag: ClassVar[bytes] = b"s"

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, b"")


@dataclass(frozen=True)
class NotificationResponse:
    tag: ClassVar[bytes] = b"A"
    process_id: int
    channel: str
    payload: str

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.tag, I32.pack(self.process_id) + cstr(self.channel, encoding, "replace")
                      + cstr(self.payload, encoding, "replace"))


@dataclass(frozen=True)
class CopyResponse:
    """CopyInResponse 'G', CopyOutResponse 'H', CopyBothResponse 'W'."""

    kind: bytes
    overall_format: int
    column_formats: tuple[int, ...] = field(default=())

    def encode(self, encoding: str = "utf-8") -> bytes:
        return frame(self.kind, bytes([self.overall_format]) + int16s(self.column_formats))


BackendMessage = (
    Authentication | ParameterStatus | BackendKeyData | ReadyForQuery | RowDescription | DataRow
    | CommandComplete | EmptyQueryResponse | ErrorResponse | NoticeResponse | ParseComplete
    | BindComplete | CloseComplete | NoData | ParameterDescription | PortalSuspended
    | NotificationResponse | CopyResponse | CopyData | CopyDone | NegotiateProtocolVersion
)


def _error_fields(r: Reader) -> tuple[tuple[str, str], ...]:
    out = []
    while True:
        code = r.byte()
        if code == b"\0":
            break
        out.append((code.decode("latin-1"), r.cstring()))
    return tuple(out)


def decode_backend(tag: bytes, body: bytes, encoding: str = "utf-8") -> BackendMessage:
    """Decode one server message, its strings in `encoding` (the client encoding it was sent in)."""
    r = Reader(body, encoding)
    msg: BackendMessage
    if tag == b"R":
        return Authentication(r.int32(), r.rest())
    if tag == b"S":
        msg = ParameterStatus(r.cstring(), r.cstring())
    elif tag == b"K":
        msg = BackendKeyData(r.int32(), r.int32())
    elif tag == b"v":
        newest, n = r.int32(), r.int32()
        msg = NegotiateProtocolVersion(newest, tuple(r.cstring() for _ in range(n)))
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
        msg = DataRow(read_values(r))
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
        msg = CopyResponse(tag, overall, read_int16s(r))
    elif tag == b"d":
        return CopyData(r.rest())
    elif tag == b"c":
        msg = CopyDone()
    else:
        raise ProtocolViolation(f"invalid backend message type {tag!r}")
    r.end()
    return msg
