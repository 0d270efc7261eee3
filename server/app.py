"""The proxy server: listens, keeps the session registry, and owns what sessions share."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import ssl
import weakref
from typing import TYPE_CHECKING, Any

from config import Config, reloaded
from dp_core.classify import Classifier, ProtectionPolicy
from dp_core.setting_changes import SettingChanges
from dp_core.settings import Caps, DPSettings
from server import backend
from server.backend_setup import BackendDSNs
from server.encodings import encoding_help, encoding_named
from server.errors import AdminShutdown, TooManyConnections
from server.logs import StatementLogger, set_format
from server.metrics import Metrics, OpsServer
from server.replies import Refuse
from server.session import ClientProtocol

if TYPE_CHECKING:
    from server.session import SessionCore
    from server.workers import WorkerLink

log = logging.getLogger("dp_proxy.server")

PUSHDOWN_APPLICATION_NAME = "dp-proxy pushdown"
LEDGER_APPLICATION_NAME = "dp-proxy ledger"


class ProxyServer:
    """One listening proxy in front of one backend database."""

    def __init__(self, config: Config, dsns: BackendDSNs) -> None:
        self.config = config
        self.dsns = dsns
        self.restricted = dsns.restricted
        self.pushdown = dsns.pushdown
        self.database = dsns.database
        self.classifier = Classifier(
            ProtectionPolicy({name: t.schema_ for name, t in config.tables.items()}),
            settings=SettingChanges(lambda value: encoding_named(value) is not None,
                                    encoding_help),
        )
        d = config.defaults
        self.caps = Caps(d.max_epsilon_per_query, d.max_delta_per_query,
                         d.max_groups_contributed_limit, d.min_epsilon)
        self._default_settings = DPSettings(d.epsilon, d.delta, d.max_groups_contributed,
                                            d.noise.value, d.partition_selection.value,
                                            d.max_rows_contributed)
        self.mock_secret = secrets.token_bytes(16)
        self.pool: Any = None
        self.ledger_pool: Any = None
        self.dp: Any = None
        self.sessions: set[SessionCore] = set()
        self._logged_in: set[SessionCore] = set()
        """Sessions past their login."""
        self._by_pid: dict[int, list[SessionCore]] = {}
        """Logged-in sessions by the process id their client was told: their backend
        connection's pid (one Postgres has one live backend of a pid, but a session whose
        backend has just ended may still be here)."""
        self._starting: weakref.WeakSet[asyncio.Protocol] = weakref.WeakSet()
        """Connections taken and not logged in yet (counted from the moment they are taken,
        before their session exists; one asyncio dropped unopened leaves with the object)."""
        self.metrics = Metrics(lambda: len(self.sessions))
        self.statement_log = StatementLogger(config.log)
        self.ops: OpsServer | None = None
        self._server: asyncio.Server | None = None
        self._ssl: ssl.SSLContext | None = None
        self.port = 0
        self.worker: WorkerLink | None = None
        """In workers mode (`[listen] workers` > 1), this worker's link to the supervisor,
        which owns the listener: `start` then opens none."""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        import asyncpg

        from server.dp_query import DPService
        from server.ledger import Ledger

        b = self.config.backend
        size = b.pushdown_pool_size if self.worker is None else \
            pool_share(b.pushdown_pool_size, self.worker.index, self.worker.workers)
        if self.worker is not None and self.worker.index == 0 and size < b.pushdown_split:
            log.warning("each of the %d workers has %d of the %d pushdown connections "
                        "(pushdown_pool_size), fewer than pushdown_split (%d), so DP queries "
                        "split less; raise pushdown_pool_size to %d for full splits",
                        self.worker.workers, size, b.pushdown_pool_size, b.pushdown_split,
                        b.pushdown_split * self.worker.workers)
        self.pool = await asyncpg.create_pool(
            self.pushdown.uri(), min_size=1, max_size=size,
            server_settings=await self._pushdown_settings(),
        )
        # the ledger's own pool, as the ledger role: no analyst SQL runs on it, and a budget
        # never waits behind DP queries holding every pushdown connection
        self.ledger_pool = await asyncpg.create_pool(
            self.dsns.ledger.uri(), min_size=1, max_size=max(2, min(size, 4)),
            server_settings={"application_name": LEDGER_APPLICATION_NAME})
        ledger = Ledger(self.ledger_pool, b.ledger_schema,
                        {name: a.refresh_days for name, a in self.config.analysts.items()})
        await ledger.migrate(self.config)
        self.dp = DPService(self.config, self.pool, ledger, self.metrics, self.restricted.user)
        loop = asyncio.get_running_loop()
        if self.worker is not None:
            self.worker.start()
            return
        self._server = await loop.create_server(
            self.new_connection, self.config.listen.host, self.config.listen.port,
            reuse_address=True,
        )
        sock = self._server.sockets[0]
        self.port = int(sock.getsockname()[1])
        log.info("listening on %s:%s", self.config.listen.host, self.port)
        m = self.config.metrics
        if m.port is not None:
            self.ops = OpsServer(self._exposition, self.healthy)
            await self.ops.start(m.host, m.port)

    async def _exposition(self) -> bytes:
        return self.metrics.exposition()

    async def healthy(self) -> bool:
        """Accepting clients, and the backend answers the pushdown pool."""
        if (self._server is None and self.worker is None) or self.pool is None:
            return False
        async with self.pool.acquire() as conn:
            return bool(await conn.fetchval("SELECT true"))

    async def _pushdown_settings(self) -> dict[str, str]:
        """Session defaults of pushdown connections (startup parameters survive the pool's
        RESET ALL). Enforced by Postgres, so they hold even if this proxy dies."""
        import asyncpg

        b = self.config.backend
        settings = {"application_name": PUSHDOWN_APPLICATION_NAME}
        if b.pushdown_work_mem:
            settings["work_mem"] = b.pushdown_work_mem
        probe = await asyncpg.connect(self.pushdown.uri())
        try:
            if probe.get_server_version().major >= 14:
                # abort a running pushdown within a second once its client (this proxy) is gone
                settings["client_connection_check_interval"] = "1000"
        finally:
            await probe.close()
        return settings

    def new_connection(self) -> asyncio.Protocol:
        """A new client: refused while max_unauthenticated others are in their start-up or
        login (they cannot take the logged-in clients' slots), or max_connections are in."""
        listen = self.config.listen
        if self.worker is None and (len(self._starting) >= listen.max_unauthenticated
                                    or len(self._logged_in) >= listen.max_connections):
            return Refuse(TooManyConnections("sorry, too many clients already"))
        proto = ClientProtocol(self)
        self._starting.add(proto)
        return proto

    def logged_in(self, session: SessionCore) -> None:
        """`session` has logged in: it counts against max_connections (53300 beyond it)."""
        if self.worker is None and len(self._logged_in) >= self.config.listen.max_connections:
            raise TooManyConnections("sorry, too many clients already")
        self._logged_in.add(session)
        self._starting.discard(session.proto)
        if self.worker is not None:
            self.worker.client_logged_in()

    async def shutdown(self, grace: float | None = None) -> None:
        """Stop accepting; let running queries finish for up to `grace` seconds (the
        configured shutdown_grace by default), closing each session once it is idle; then stop."""
        if self._server is not None:
            self._server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (self.config.listen.shutdown_grace if grace is None else grace)
        log.info("shutting down: %d sessions", len(self.sessions))
        while True:
            for session in list(self.sessions):
                if session.idle:
                    session.fatal(_shutdown_error())
            if not self.sessions or loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        await self.stop()

    async def reload(self, new: Config) -> list[str]:
        """Take the analysts (accounts, admin flags, budgets, accountants) and [log] from `new` without
        dropping sessions; returns the changed sections that need a restart (kept as they were).

        Budget limits go to the ledger as appended 'limits' events; sessions of analysts no
        longer configured are closed.
        """
        from server.errors import InvalidAuthorization

        ignored = [name for name in ("listen", "tls", "metrics", "auth_method", "backend", "defaults",
                                     "tables", "total_budget")
                   if getattr(new, name) != getattr(self.config, name)]
        merged = reloaded(self.config, new)
        if new.log != self.config.log:
            set_format(new.log.format)
            self.statement_log = StatementLogger(new.log)
        if self.dp is not None:
            await self.dp.ledger.migrate(merged, totals=False)
            self.dp.ledger.refresh_days = {n: a.refresh_days for n, a in merged.analysts.items()}
            self.dp.config = merged
        self.config = merged
        for session in list(self.sessions):
            session.config = merged
            if session.link is not None:
                session.link.log_cycles = self.statement_log.log_all
            if session.user and session.user not in merged.analysts:
                session.fatal(InvalidAuthorization(
                    f'role "{session.user}" was removed from the configuration'))
        log.info("configuration reloaded: %d analysts", len(merged.analysts))
        for name in ignored:
            log.warning("configuration reload: [%s] changed; it takes effect at the next start",
                        name)
        return ignored

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self.ops is not None:
            await self.ops.stop()
            self.ops = None
        for session in list(self.sessions):
            session.fatal(_shutdown_error())
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None
        for pool in (self.pool, self.ledger_pool):
            if pool is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(pool.close(), 10)
        self.pool = self.ledger_pool = None

    # ------------------------------------------------------------------ sessions

    def register_key(self, session: SessionCore) -> tuple[int, int]:
        """A new session's secret key, and a process id for its log lines until it has a
        backend connection (`advertise`)."""
        self.sessions.add(session)
        return secrets.randbelow(2**31 - 1) + 1, secrets.randbits(31)

    def advertise(self, session: SessionCore, backend_pid: int) -> None:
        """`session`'s client is told `backend_pid`, its backend connection's own: a
        CancelRequest naming it (with the session's secret key) cancels what it runs."""
        session.process_id = backend_pid
        self._by_pid.setdefault(backend_pid, []).append(session)

    def unregister(self, session: SessionCore) -> None:
        if session in self.sessions:
            self.sessions.discard(session)
            same = self._by_pid.get(session.process_id, [])
            if session in same:
                same.remove(session)
                if not same:
                    del self._by_pid[session.process_id]
            logged_in = session in self._logged_in
            self._logged_in.discard(session)
            self._starting.discard(session.proto)
            if self.worker is not None:
                self.worker.client_closed(logged_in)

    def cancel(self, process_id: int, secret_key: int, relay: bool = True) -> None:
        """A CancelRequest: the session told `process_id` whose key is `secret_key`, if any,
        cancels what it runs. With workers, any of them may have it: the request goes to
        the others too (`relay`), whatever is found here, so that how long it takes says
        nothing of the key."""
        key = secret_key.to_bytes(4, "big", signed=True)
        for session in list(self._by_pid.get(process_id, ())):
            if secrets.compare_digest(session.secret_key.to_bytes(4, "big"), key):
                session.cancel()
        if relay and self.worker is not None:
            self.worker.cancel_elsewhere(process_id, secret_key)

    async def cancel_backend(self, key: tuple[int, int]) -> None:
        with contextlib.suppress(OSError, TimeoutError):
            await backend.send_cancel(self.restricted, key)

    def ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            tls = self.config.tls
            assert tls.cert_file is not None and tls.key_file is not None
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(os.fspath(tls.cert_file), os.fspath(tls.key_file))
            self._ssl = ctx
        return self._ssl

    async def connect_backend(self, analyst: str,
                              parameters: dict[str, str]) -> backend.BackendLink:
        """A pass-through connection as `analyst`'s own backend role."""
        return await backend.connect(self.dsns.analyst(analyst), parameters)

    def default_settings(self) -> DPSettings:
        return self._default_settings

def _shutdown_error() -> AdminShutdown:
    return AdminShutdown("terminating connection due to administrator command")


def pool_share(size: int, index: int, workers: int) -> int:
    """Worker `index`'s part of a pushdown pool of `size` connections divided among
    `workers`: the parts add up to `size`, and each is at least one."""
    return max(1, size // workers + (1 if index < size % workers else 0))
