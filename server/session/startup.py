"""A session's start-up: TLS, the start-up packet, SCRAM authentication, the analyst's backend login."""

from __future__ import annotations

import asyncio
import functools
import ssl

from config import AuthMethod
from dp_core.errors import DPError, InternalError
from server import backend
from server import wire as p
from server.encodings import READABLE, UnsupportedEncoding, codec
from server.errors import (
    ConnectionFailure,
    InvalidAuthorization,
    InvalidCatalogName,
    InvalidPassword,
    ProtocolViolationError,
    TooManyConnections,
    UnsupportedProtocolVersion,
    UnsupportedSession,
)
from server.scram import MECHANISM, ScramError, ScramServer, Verifier
from server.session.base import CLOSED, State, log
from server.session.settings import WithSettings

_PROTOCOL_OPTION = "_pq_."
"""The prefix of start-up options that are protocol extensions, not settings: none is known
to the proxy, nor to Postgres 16."""


def _login_refused(analyst: str, sqlstate: str | None) -> DPError:
    """What a client is told when the backend refuses its analyst's own login: too many of
    the analyst's sessions (the role's CONNECTION LIMIT), or a role not set up yet."""
    if sqlstate == "53300":
        return TooManyConnections(
            f'too many connections for analyst "{analyst}"',
            hint="close another session of this analyst; an operator can raise its "
                 "max_connections (then run dp-proxy init-backend)")
    if sqlstate in ("28000", "28P01"):
        return InvalidAuthorization(
            f'analyst "{analyst}" has no backend login',
            hint="an operator must run dp-proxy init-backend after adding an analyst")
    return ConnectionFailure("could not connect to the backend database")


def _non_standard_strings() -> DPError:
    return UnsupportedSession(
        "dp-proxy needs standard_conforming_strings = on",
        detail="it reads string literals as Postgres does with that setting; with "
               "it off, 'a\\' would mean something else to Postgres",
        hint="leave standard_conforming_strings at its default, on")


def _unsupported_encoding(exc: UnsupportedEncoding) -> DPError:
    return UnsupportedSession(
        f"client_encoding {exc.name} is not supported by dp-proxy", detail=exc.detail,
        hint=f"use UTF8 (PGCLIENTENCODING=UTF8), or another encoding the proxy reads: {READABLE}")


class WithStartup(WithSettings):
    __slots__ = ()

    async def _next_startup_frame(self) -> tuple[bytes, bytes]:
        while True:
            if self.state is State.CLOSED:
                raise ConnectionResetError
            frame = self.frames.next_raw()
            if frame is not None:
                return frame
            self._input.clear()
            await self._input.wait()

    async def _startup(self) -> None:
        try:
            async with asyncio.timeout(self.config.listen.startup_timeout):
                await self._negotiate()
        except TimeoutError:
            self.fatal(ProtocolViolationError("canceling authentication due to timeout"))
        except ConnectionResetError:
            self.close()
        except p.UnframedStartup as e:
            # as Postgres: logged, and the connection closed without a reply (a client that
            # sends Terminate before its start-up packet is closing, not asking)
            log.info("session %s: %s", self.process_id, e)
            self.close()
        except p.UnsupportedProtocol as e:
            self.fatal(UnsupportedProtocolVersion(str(e)))
        except p.MissingUserName as e:
            self.fatal(InvalidAuthorization(str(e)))
        except p.ProtocolViolation as e:
            self.fatal(ProtocolViolationError(str(e)))
        except DPError as e:
            self.fatal(e)
        except Exception:
            log.exception("session %s: internal error during startup", self.process_id)
            self.fatal(InternalError())

    async def _negotiate(self) -> None:
        while True:
            _, raw = await self._next_startup_frame()
            packet = p.decode_startup(raw[4:])
            if isinstance(packet, (p.SSLRequest, p.GSSENCRequest)) and self.frames.buffered:
                # bytes behind an encryption request could be injected by a third party
                raise ProtocolViolationError("received unencrypted data after SSL request")
            if isinstance(packet, p.SSLRequest):
                await self._ssl_request()
                continue
            if isinstance(packet, p.GSSENCRequest):
                self.write(b"N")
                continue
            if isinstance(packet, p.CancelRequest):
                self.server.cancel(packet.process_id, packet.secret_key)
                self.close()
                return
            assert isinstance(packet, p.StartupMessage)
            self.frames.startup = False  # from here on, messages are typed
            break
        if self.config.tls.require and not isinstance(
            self.transport.get_extra_info("ssl_object"), ssl.SSLObject
        ):
            raise InvalidAuthorization("this proxy requires TLS: connect with sslmode=require")
        params = packet.parameters
        unknown = tuple(name for name in params if name.startswith(_PROTOCOL_OPTION))
        if packet.protocol != p.PROTOCOL_V3 or unknown:
            # as Postgres 16: the session goes on at 3.0, without the protocol options (the
            # client decides whether that will do)
            self.send(p.NegotiateProtocolVersion(p.PROTOCOL_V3, unknown))
        if params.get("replication", "false").lower() not in ("false", "0", "off", "no"):
            raise InvalidAuthorization("replication connections are not allowed through dp-proxy")
        self.user = params["user"]
        self.state = State.AUTHENTICATING
        await self._authenticate()
        self.server.logged_in(self)
        database = params.get("database") or self.user
        if database != self.server.database:
            raise InvalidCatalogName(
                f'database "{database}" does not exist',
                hint=f'this proxy serves the database "{self.server.database}"')
        forwarded = {k: v for k, v in params.items()
                     if k not in ("user", "database") and not k.startswith(_PROTOCOL_OPTION)}
        try:
            self.link = await self.server.connect_backend(self.user, forwarded)
        except backend.BackendError as e:
            log.warning("session %s: backend connection failed: %s", self.process_id, e)
            raise _login_refused(self.user, dict(e.fields).get("C")) from None
        except (OSError, TimeoutError) as e:
            log.warning("session %s: backend connection failed: %s", self.process_id, e)
            raise ConnectionFailure("could not connect to the backend database") from None
        if self.link.parameters.get("standard_conforming_strings") != "on":
            self.link.close()
            raise _non_standard_strings()
        encoding = self.link.parameters.get("client_encoding", "UTF8")
        if codec(encoding) is None:  # (the link kept the encoding it had: UTF8)
            self.link.close()
            raise _unsupported_encoding(UnsupportedEncoding(encoding))
        # relayed bytes go straight to the transport: it no longer changes (TLS is set up)
        self.link.target = backend.RelayTarget(self.transport.write, self._backend_lost)
        self.link.on_cycle = functools.partial(self.statement_done, "pass_through")
        self.link.counter = self.server.metrics
        self.link.on_tx_end = self._settle
        self.link.log_cycles = self.server.statement_log.log_all
        self.write(b"".join(self.link.startup_frames))
        if self.link.key is not None:
            # the pid of the backend that serves the session, as pg_backend_pid() and
            # notifications give it; the secret key is the proxy's own
            self.server.advertise(self, self.link.key[0])
        self.send(p.BackendKeyData(self.process_id, self.secret_key),
                  p.ReadyForQuery(self.link.tx_status))
        self.state = State.READY
        self._last_input = self._clock()
        if self.config.listen.idle_timeout > 0:
            self._arm_idle_timer(self.config.listen.idle_timeout)
        self._pump()  # anything the client pipelined behind its login

    async def _ssl_request(self) -> None:
        if not self._tls_ok or self.transport.get_extra_info("ssl_object") is not None:
            self.write(b"N")
            return
        self.write(b"S")
        loop = asyncio.get_running_loop()
        new_transport = await loop.start_tls(
            self.transport, self.proto, self.server.ssl_context(), server_side=True
        )
        assert new_transport is not None
        self.transport = new_transport

    async def _authenticate(self) -> None:
        analyst = self.config.analysts.get(self.user)
        if self.config.auth_method is AuthMethod.TRUST:
            if analyst is None:
                raise InvalidAuthorization(f'role "{self.user}" does not exist')
            self.send(p.Authentication(p.AUTH_OK))
            return
        verifier = None
        if analyst is not None and analyst.scram_verifier is not None:
            verifier = Verifier.parse(analyst.scram_verifier)
        exchange = ScramServer(verifier, mock_seed=self.server.mock_secret + self.user.encode())
        self.send(p.Authentication.sasl([MECHANISM]))
        message = f'password authentication failed for user "{self.user}"'
        failed: DPError = InvalidPassword(message) if analyst else InvalidAuthorization(message)
        try:
            tag, raw = await self._next_startup_frame()
            if tag != b"p":
                raise ProtocolViolationError(f"expected SASL response, got message type {tag!r}")
            first = p.SASLInitialResponse.parse(p.PasswordMessage(raw[5:]))
            if first.mechanism != MECHANISM or first.data is None:
                raise ProtocolViolationError("client selected an invalid SASL authentication mechanism")
            server_first = exchange.handle_client_first(first.data)
            self.send(p.Authentication(p.AUTH_SASL_CONTINUE, server_first))
            tag, raw = await self._next_startup_frame()
            if tag != b"p":
                raise ProtocolViolationError(f"expected SASL response, got message type {tag!r}")
            server_final = exchange.verify_final(raw[5:])
        except (ScramError, UnicodeDecodeError, p.ProtocolViolation):
            raise failed from None
        self.send(p.Authentication(p.AUTH_SASL_FINAL, server_final), p.Authentication(p.AUTH_OK))

    def _backend_lost(self, exc: Exception | None) -> None:
        if self.state is CLOSED:
            return
        if self.link is not None and self.link.fatal_relayed:
            # the backend said why it ended the session (57P01 after pg_terminate_backend,
            # say) and the client has that FATAL error: as Postgres, nothing more, the end
            self.close()
            return
        if isinstance(exc, backend.NonStandardStrings):
            self.fatal(_non_standard_strings())
        elif isinstance(exc, UnsupportedEncoding):
            self.fatal(_unsupported_encoding(exc))
        else:
            self.fatal(ConnectionFailure("the connection to the backend database was lost"))

    def _pump(self, fast: bool = True) -> None:
        """Handle the input received so far (`Session`'s input pump: the start-up's last step)."""
        raise NotImplementedError
