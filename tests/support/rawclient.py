"""A minimal protocol-level client over our codec, for tests that need exact message sequences."""

from __future__ import annotations

import contextlib
import socket
import struct

from server import wire as p
from server.scram import MECHANISM, ScramClient

OPEN: list[RawClient] = []
"""Every client made, so a fixture can close them all after each test."""


class RawClient:
    """Blocking socket client: send frontend messages, read backend messages one by one."""

    def __init__(self, host: str, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.reader = p.FrameReader(max_size=1 << 30)
        OPEN.append(self)

    def send(self, *msgs: object) -> None:
        self.sock.sendall(b"".join(m.encode() for m in msgs))  # type: ignore[attr-defined]

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> p.BackendMessage:
        while True:
            frame = self.reader.next_raw()
            if frame is not None:
                tag, raw = frame
                return p.decode_backend(tag, raw[5:])
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("server closed the connection")
            self.reader.feed(data)

    def recv_until_ready(self) -> list[p.BackendMessage]:
        out = []
        while True:
            m = self.recv()
            out.append(m)
            if isinstance(m, p.ReadyForQuery):
                return out

    def until_closed(self) -> list[p.BackendMessage]:
        """Every message the server sends until it closes the connection."""
        seen: list[p.BackendMessage] = []
        try:
            while True:
                seen.append(self.recv())
        except (ConnectionError, OSError):
            return seen

    def closed_by_server(self) -> bool:
        self.until_closed()
        return True

    def login(self, user: str, password: str, database: str) -> list[p.BackendMessage]:
        self.send(p.StartupMessage({"user": user, "database": database}))
        auth = self.recv()
        if isinstance(auth, p.ErrorResponse):  # e.g. too many connections
            return [auth]
        assert isinstance(auth, p.Authentication) and auth.code == p.AUTH_SASL, auth
        scram = ScramClient(password)
        self.send(p.SASLInitialResponse(MECHANISM, scram.client_first()))
        cont = self.recv()
        if isinstance(cont, p.ErrorResponse):
            return [cont]
        assert isinstance(cont, p.Authentication) and cont.code == p.AUTH_SASL_CONTINUE, cont
        self.send(p.PasswordMessage(scram.client_final(cont.data)))
        return self.recv_until_ready()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.send(p.Terminate())
        self.sock.close()


def errors(msgs: list[p.BackendMessage]) -> list[str | None]:
    return [m.sqlstate for m in msgs if type(m) is p.ErrorResponse]


def tags(msgs: list[p.BackendMessage]) -> list[str]:
    return [type(m).__name__ for m in msgs]


def struct_len(n: int) -> bytes:
    return struct.pack("!i", n)


def close_all() -> None:
    while OPEN:
        OPEN.pop().sock.close()
