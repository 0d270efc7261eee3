"""Operator endpoint: Prometheus metrics at /metrics and a health check at /healthz.

Served on its own port (config `[metrics] port`) by a small asyncio HTTP handler,
so nothing here shares the client listener. The metrics carry no query text,
parameters or results: kinds, outcomes, SQLSTATEs, analyst names, ε and timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger("dp_proxy.metrics")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """The proxy's metrics, in a registry of their own (several proxies can live in one process)."""

    def __init__(self, sessions: Callable[[], int]) -> None:
        r = self.registry = CollectorRegistry()
        self.sessions = Gauge("dpproxy_sessions", "Client sessions open", registry=r)
        self.sessions.set_function(lambda: float(sessions()))
        self.statements = Counter(
            "dpproxy_statements",
            "Statements by kind (pass_through, dp_query, dp_explain, local, refused) and outcome "
            "(ok, error); a pass-through Query or extended-protocol batch counts once",
            ["kind", "outcome"], registry=r)
        self._statement_children: dict[tuple[str, bool], Any] = {}
        self.pass_through_ok = 0
        """Successful pass-through cycles not yet added to `statements`: a plain integer on the
        hot path, added to the counter when the metrics are read."""
        self.errors = Counter("dpproxy_errors", "Errors sent to clients, by SQLSTATE", ["sqlstate"],
                              registry=r)
        self.epsilon_spent = Counter("dpproxy_epsilon_spent", "Epsilon charged, by analyst",
                                     ["analyst"], registry=r)
        self.dp_seconds = Histogram("dpproxy_dp_answer_seconds",
                                    "End-to-end time of DP answers (analysis to released rows)",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.pushdown_seconds = Histogram("dpproxy_pushdown_seconds",
                                          "Time of DP pushdowns in the backend (all statements)",
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.pushdown_split = Counter(
            "dpproxy_pushdown_split",
            "DP pushdowns run as several at once over ranges of the uid, by number of ranges "
            "and whether users' groups were picked from their rows before aggregating them",
            ["ranges", "prefiltered"], registry=r)

    def statement(self, kind: str, ok: bool) -> Any:
        """The counter child for (kind, outcome), looked up once (it is on the pass-through path)."""
        child = self._statement_children.get((kind, ok))
        if child is None:
            child = self._statement_children[(kind, ok)] = self.statements.labels(
                kind, "ok" if ok else "error")
        return child

    def exposition(self) -> bytes:
        n, self.pass_through_ok = self.pass_through_ok, 0
        if n:
            self.statement("pass_through", True).inc(n)
        return bytes(generate_latest(self.registry))


class OpsServer:
    """GET /metrics and GET /healthz over HTTP/1.0-style one-request connections."""

    def __init__(self, exposition: Callable[[], Awaitable[bytes]],
                 health: Callable[[], Any]) -> None:
        self.exposition = exposition
        self.health = health
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port, reuse_address=True)
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("metrics and health on http://%s:%s/metrics, /healthz", host, self.port)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            parts = request.split(b"\r\n", 1)[0].split()
            method, path = (parts[0], parts[1]) if len(parts) >= 2 else (b"", b"")
            if method not in (b"GET", b"HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path.split(b"?")[0] == b"/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, await self.exposition()
            elif path.split(b"?")[0] == b"/healthz":
                ok = await self._healthy()
                status = "200 OK" if ok else "503 Service Unavailable"
                ctype, body = "text/plain", b"ok\n" if ok else b"backend unavailable\n"
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"/metrics or /healthz\n"
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n").encode()
            writer.write(head + (body if method != b"HEAD" else b""))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        finally:
            writer.close()

    async def _healthy(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self.health(), 3))
        except Exception:  # any failure of the check is "unhealthy", never a crash
            return False
