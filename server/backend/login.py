"""Connecting a backend link and logging in as the analyst's role; asking the backend to cancel."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Callable

from server import wire as p
from server.backend.link import BackendError, BackendLink
from server.dsn import DSN
from server.scram import MECHANISM, ScramClient, ScramError


async def login(link: BackendLink, dsn: DSN, parameters: dict[str, str]) -> None:
    """Send the startup packet and authenticate; returns at the first ReadyForQuery."""
    assert link.transport is not None
    params = {"user": dsn.user, "database": dsn.database, **parameters}
    link.transport.write(p.StartupMessage(params).encode())
    scram: ScramClient | None = None
    while True:
        msg = await link.next_login_message()
        if isinstance(msg, p.Authentication):
            scram = _answer_auth(link, msg, dsn, scram)
        elif isinstance(msg, p.ParameterStatus):
            link.parameters[msg.name] = msg.value
            if msg.name == "client_encoding":
                # the session refuses an encoding without a codec once logged in
                link.client_encoding(msg.value)
        elif isinstance(msg, p.BackendKeyData):
            link.key = (msg.process_id, msg.secret_key)
        elif isinstance(msg, p.ReadyForQuery):
            link.tx_status = msg.status
            return
        elif isinstance(msg, p.ErrorResponse) and not isinstance(msg, p.NoticeResponse):
            raise BackendError(msg.message or "backend login failed", msg.fields)


def _answer_auth(
    link: BackendLink, msg: p.Authentication, dsn: DSN, scram: ScramClient | None
) -> ScramClient | None:
    assert link.transport is not None
    if msg.code == p.AUTH_OK:
        return scram
    if msg.code in (p.AUTH_CLEARTEXT, p.AUTH_MD5, p.AUTH_SASL) and dsn.password is None:
        raise BackendError(f"the backend asks for a password for role {dsn.user!r}; none is configured")
    assert dsn.password is not None
    if msg.code == p.AUTH_CLEARTEXT:
        link.transport.write(p.PasswordMessage(dsn.password.encode() + b"\0").encode())
    elif msg.code == p.AUTH_MD5:
        inner = hashlib.md5((dsn.password + dsn.user).encode()).hexdigest()
        outer = hashlib.md5(inner.encode() + msg.data[:4]).hexdigest()
        link.transport.write(p.PasswordMessage(f"md5{outer}".encode() + b"\0").encode())
    elif msg.code == p.AUTH_SASL:
        if MECHANISM not in msg.mechanisms():
            raise BackendError(f"backend offers no supported SASL mechanism: {msg.mechanisms()}")
        scram = ScramClient(dsn.password)
        link.transport.write(p.SASLInitialResponse(MECHANISM, scram.client_first()).encode())
    elif msg.code == p.AUTH_SASL_CONTINUE and scram is not None:
        try:
            link.transport.write(p.PasswordMessage(scram.client_final(msg.data)).encode())
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
            await login(link, dsn, parameters)
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
