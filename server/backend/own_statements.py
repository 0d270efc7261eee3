"""The proxy's own statements on a backend link, sent among the client's, their replies swallowed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from server import wire as p
from server.backend.pending import Pending
from server.backend_setup import quote_ident

if TYPE_CHECKING:
    import asyncio
    from collections import deque

_FAILING_SQL = "dp-proxy: a local error aborts the transaction, as in Postgres"
"""Not SQL: the backend's syntax error is the point (and reads plainly in its log)."""
INTERNAL_NAME = "dp_proxy_internal"
SHADOW_NAME = "dp_proxy_shadow"


class OwnStatements:
    """The statements the proxy runs on its own on a `BackendLink` (mixed into it):
    transaction commands, DP results, questions, placeholders, failures, quiet closes."""

    __slots__ = ()

    if TYPE_CHECKING:  # the link's, which these statements go out on
        transport: asyncio.Transport | None
        codec: str
        pending: deque[Pending]
        skipping: bool
        closed: bool
        fetched: list[tuple[bytes | None, ...]]

        def uncork(self) -> None: ...

    def run_quietly(self, sql: str) -> None:
        """Send a transaction command of the proxy's own (BEGIN, COMMIT, ROLLBACK) whose
        replies the client does not see but for an error; await `drain()` for it."""
        self._send_own([p.Query(sql)], [Pending.INTERNAL_QUERY])

    def run_internal(self, sql: str, result_formats: tuple[int, ...], portal: str = INTERNAL_NAME,
                     max_rows: int = 0) -> None:
        """Run one statement of the proxy's own in the client's result formats.

        Only its rows and CommandComplete (or its error) reach the client; await
        `drain()` for it to finish. No Sync is sent: it runs in the client's
        transaction, and after an error the backend skips to the client's Sync as
        the client does. With a client's `portal` and a row limit, it runs as that
        portal to its first `max_rows` rows (then PortalSuspended) and the portal
        stays open for the client's further Executes, until the transaction ends.
        Raises UnicodeEncodeError, having sent nothing, when `sql` has a character
        the client encoding lacks.
        """
        assert self.transport is not None
        n = INTERNAL_NAME
        # the statement is closed first too: after an error the backend skipped the last one's
        # Close, and a named statement outlives the transaction
        messages: list[p.FrontendMessage] = [
            p.Close(b"P", portal), p.Close(b"S", n), p.Parse(n, sql),
            p.Bind(portal, n, (), (), result_formats), p.Close(b"S", n),
            p.Execute(portal, max_rows)]
        kinds = [Pending.INTERNAL_CLOSE, Pending.INTERNAL_CLOSE, Pending.INTERNAL_PARSE,
                 Pending.INTERNAL_BIND, Pending.INTERNAL_CLOSE, Pending.EXECUTE]
        if portal == INTERNAL_NAME:
            messages.append(p.Close(b"P", portal))
            kinds.append(Pending.INTERNAL_CLOSE)
        self._send_own(messages, kinds)

    def fetch_own(self, sql: str, extended: bool) -> None:
        """Ask the backend a question of the proxy's own (`sql`, one statement that reads no
        table): its rows go to `fetched`, text in the client encoding; only an error reaches
        the client. `extended`: in the client's extended batch (no Sync: it runs in the
        client's transaction, and after an error the backend skips to the client's Sync);
        else one Query. Await `drain()` for it."""
        self.fetched.clear()
        if not extended:
            self._send_own([p.Query(sql)], [Pending.INTERNAL_FETCH_QUERY])
            return
        n = SHADOW_NAME
        self._send_own([p.Close(b"S", n), p.Parse(n, sql), p.Bind(n, n, (), (), ()),
                        p.Close(b"S", n), p.Execute(n, 0), p.Close(b"P", n)],
                       [Pending.INTERNAL_CLOSE, Pending.INTERNAL_PARSE, Pending.INTERNAL_BIND,
                        Pending.INTERNAL_CLOSE, Pending.INTERNAL_FETCH, Pending.INTERNAL_CLOSE])

    def shadow_statement(self, name: str) -> None:
        """Prepare a placeholder statement of the name of one the proxy holds, so that the
        backend refuses the name as in use (42P05) until it is closed or deallocated; an error
        (the name is in use) is relayed. Await `drain()` for it."""
        self._send_own([p.Parse(name, "SELECT")], [Pending.INTERNAL_PARSE])

    def shadow_portal(self, name: str) -> None:
        """Bind a placeholder portal of the name of one the proxy holds (see
        `shadow_statement`; 42P03 for a portal)."""
        n = SHADOW_NAME
        self._send_own([p.Close(b"S", n), p.Parse(n, "SELECT"), p.Bind(name, n, (), (), ()),
                        p.Close(b"S", n)],
                       [Pending.INTERNAL_CLOSE, Pending.INTERNAL_PARSE, Pending.INTERNAL_BIND,
                        Pending.INTERNAL_CLOSE])

    def try_declare(self, declare: str, name: str, extended: bool) -> None:
        """Declare a cursor for nothing and close it again, the client told only of an error:
        whether the backend accepts the DECLARE (the name not in use) before the proxy
        answers the query it is for. `extended`: in the client's extended batch (Parse /
        Bind / Execute, no Sync, the portal closed as a cursor is); else one Query. Await
        `drain()` for it."""
        if not extended:
            self.run_quietly(f"{declare}; CLOSE {quote_ident(name)}")
            return
        self._run_shadow(declare, [p.Close(b"P", name)])

    def pipeline_step(self) -> None:
        """Run a statement of the proxy's own that does nothing, its replies swallowed, where
        the proxy answered a client's Execute itself (SET or SHOW dp.*): the backend then sees
        the client's extended batch as Postgres would have, a pipeline in a transaction,
        so that a DISCARD ALL or VACUUM after it fails (25001) as it would there. Nothing is
        sent while the backend skips to the client's Sync."""
        if not (self.skipping or self.closed):
            self._run_shadow("SELECT WHERE false")

    def _run_shadow(self, sql: str, closes: list[p.FrontendMessage] | None = None) -> None:
        """Run `sql` (no rows) as the shadow statement and portal in the client's batch, its
        replies swallowed but an error, then `closes` (Close messages, their replies
        swallowed too)."""
        n = SHADOW_NAME
        after = closes or []
        self._send_own([p.Close(b"S", n), p.Parse(n, sql), p.Bind(n, n, (), (), ()),
                        p.Close(b"S", n), p.Execute(n, 0), p.Close(b"P", n), *after],
                       [Pending.INTERNAL_CLOSE, Pending.INTERNAL_PARSE, Pending.INTERNAL_BIND,
                        Pending.INTERNAL_CLOSE, Pending.INTERNAL_EXECUTE, Pending.INTERNAL_CLOSE,
                        *[Pending.INTERNAL_CLOSE] * len(after)])

    def fail_transaction(self, extended: bool) -> None:
        """After an error of the proxy's own, have the backend fail too, as Postgres fails on
        any error: an open block is aborted (25P02 until ROLLBACK), and an extended batch's
        implicit transaction is rolled back at its Sync (with what ran before the error).
        `extended`: a Parse that fails inside the client's batch (the backend then skips to
        its Sync); else a Query. Its error is not relayed; await `drain()` for it."""
        if extended:
            self._send_own([p.Parse(SHADOW_NAME, _FAILING_SQL)], [Pending.INTERNAL_FAIL])
        else:
            self._send_own([p.Query(_FAILING_SQL)], [Pending.INTERNAL_FAIL_QUERY])

    def _send_own(self, messages: list[p.FrontendMessage], kinds: list[Pending]) -> None:
        """Send messages of the proxy's own, awaiting `kinds` of replies; encoded first, so
        that a UnicodeEncodeError leaves nothing sent nor awaited."""
        assert self.transport is not None
        frames = b"".join(m.encode(self.codec) for m in messages)
        self.uncork()
        self.pending.extend(kinds)
        self.transport.write(frames)

    def close_quietly(self, kind: bytes, name: str) -> None:
        """Close a statement (b"S") or portal (b"P") of the backend's, the client not told."""
        self._send_own([p.Close(kind, name)], [Pending.INTERNAL_CLOSE])
