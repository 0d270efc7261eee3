"""Splitting a byte stream into frames: the untyped startup packets, then tagged messages."""

from __future__ import annotations

from collections.abc import Iterator

from server.wire.codec import HEADER, I32, ProtocolViolation, UnframedStartup

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
            length = I32.unpack_from(buf, 0)[0]
            if length < 8 or length > 10_000:
                raise UnframedStartup("invalid length of startup packet")
            if len(buf) < length:
                return None
            raw = bytes(buf[:length])
            del buf[:length]
            return b"", raw
        if len(buf) < 5:
            return None
        tag, length = HEADER.unpack_from(buf, 0)
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
