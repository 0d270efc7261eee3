"""Peeking into raw frames: a Query's text and the names a message addresses, before decoding it."""

from __future__ import annotations

from server import wire as p


def query_text(raw: bytes, encoding: str) -> str:
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

def first_name(raw: bytes, encoding: str) -> str:
    end = raw.find(b"\0", 5)
    if end < 0:
        raise p.ProtocolViolation("unterminated string in message")
    return raw[5:end].decode(encoding, errors="replace")


def two_names(raw: bytes, encoding: str) -> tuple[str, str]:
    """Portal and statement names at the start of a Bind frame."""
    end1 = raw.find(b"\0", 5)
    end2 = raw.find(b"\0", end1 + 1) if end1 >= 0 else -1
    if end2 < 0:
        raise p.ProtocolViolation("unterminated string in message")
    return (raw[5:end1].decode(encoding, errors="replace"),
            raw[end1 + 1:end2].decode(encoding, errors="replace"))


def name_after_kind(raw: bytes, encoding: str) -> str:
    """The name in a Describe or Close frame (after its S/P byte)."""
    if raw[5:6] not in (b"S", b"P"):
        raise p.ProtocolViolation("invalid DESCRIBE/CLOSE message subtype")
    end = raw.find(b"\0", 6)
    if end < 0:
        raise p.ProtocolViolation("unterminated string in message")
    return raw[6:end].decode(encoding, errors="replace")
