"""One bound parameter value, text or binary format, decoded to the SQL text of a constant."""

from __future__ import annotations

import struct

from dp_core.errors import FeatureNotSupported
from server.encodings import invalid_text
from server.errors import InvalidBinaryRepresentation


def param_text(raw: bytes, fmt: int, oid: int, codec: str, encoding: str) -> str:
    """A parameter's value as text, decoding binary for the common scalar types; text (and the
    binary form of text types) is in the client encoding (`codec`, named `encoding`)."""
    if fmt == 0:
        try:
            return raw.decode(codec)
        except UnicodeDecodeError as e:
            raise invalid_text(e.object[e.start : e.end], encoding) from None
    try:
        if oid == 21:
            return str(struct.unpack("!h", raw)[0])
        if oid == 23:
            return str(struct.unpack("!i", raw)[0])
        if oid == 20:
            return str(struct.unpack("!q", raw)[0])
        if oid == 700:
            return repr(struct.unpack("!f", raw)[0])
        if oid == 701:
            return repr(struct.unpack("!d", raw)[0])
        if oid == 16:
            return "true" if raw == b"\x01" else "false"
        if oid in (25, 1043, 1042, 19, 0):
            return raw.decode(codec)
    except (struct.error, UnicodeDecodeError):
        raise InvalidBinaryRepresentation("incorrect binary data format in a bind parameter") from None
    raise FeatureNotSupported(f"binary parameters of type oid {oid} are not supported in DP "
                              "queries; send them in text format")
