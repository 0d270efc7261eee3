"""The statements a session answers itself: local SET/SHOW, DP queries, results the backend relays."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from dataclasses import replace

from dp_core.classify import (
    Statement,
    StatementKind,
)
from dp_core.errors import DPError, InternalError
from dp_core.result import copy_result
from server import wire as p
from server.backend_setup import quote_ident
from server.dp_query.request import DPRequest
from server.encodings import untranslatable
from server.errors import QueryCanceled
from server.session.base import AlreadyReported, State, log
from server.session.startup import WithStartup

TEXT_OID = 25


_LOG_KINDS = {
    StatementKind.DP_QUERY: "dp_query", StatementKind.DP_EXPLAIN: "dp_explain",
    StatementKind.REFUSED: "refused", StatementKind.PASS_THROUGH: "pass_through",
}
"""Statement kinds as metrics and logs name them; the proxy's other answers are "local"."""


DP_KINDS = (StatementKind.DP_QUERY, StatementKind.DP_EXPLAIN, StatementKind.LOCAL_FUNCTION)


SESSION_CONTEXT_SQL = (
    "SELECT pg_catalog.encode(pg_catalog.convert_to(CAST(pg_catalog.json_build_array("
    "pg_catalog.current_schemas(true), pg_catalog.current_setting('TimeZone')) "
    "AS pg_catalog.text), 'UTF8'), 'base64')")
"""What a DP query's text means in the session: the schemas its backend looks names up in (in
order, implicit ones included) and its TimeZone, asked on its own connection. In base64 of
UTF-8, whatever the client encoding (a schema's name may have characters it lacks)."""


def _wrapped(st: Statement, sql: str) -> str:
    """The proxy's result query `sql` for `st`, declared as the cursor `st` declares or
    copied as it copies, if it does: the cursor or copy has the released rows only."""
    if st.cursor is not None:
        return st.cursor.declare(sql, quote_ident)
    if st.wraps_result:
        return copy_result(st.stripped_sql, sql)
    return sql


class WithLocalAnswers(WithStartup):
    __slots__ = ()

    def dp_request(self) -> DPRequest:
        """What the DP path needs of this session for one statement, as things stand now."""
        link = self.link
        assert link is not None
        analyst = self.config.analysts.get(self.user)
        return DPRequest(self.user, analyst is not None and analyst.admin, self.process_id,
                         self.settings, self.caps, link.codec, link.encoding, self.dp_charged)

    async def dp_request_asked(self, extended: bool) -> DPRequest:
        """`dp_request()` with the session's search_path and TimeZone, asked of its own backend
        (`SESSION_CONTEXT_SQL`; `extended`: inside the client's extended batch): a DP query
        reads the tables its names mean there. Raises AlreadyReported (the backend's error
        relayed) when the backend fails the question."""
        link = self.link
        assert link is not None
        before = link.errors
        link.fetch_own(SESSION_CONTEXT_SQL, extended)
        await link.drain()
        if link.errors != before or link.closed or len(link.fetched) != 1:
            raise AlreadyReported()
        (value,) = link.fetched[0]
        assert value is not None
        schemas, timezone = json.loads(base64.b64decode(value).decode("utf-8"))
        return replace(self.dp_request(), search_path=tuple(str(s) for s in schemas),
                       timezone=str(timezone))

    def _backend_failed_batch(self) -> bool:
        """True when the backend reported an error since its last ReadyForQuery."""
        assert self.link is not None
        return self.link.errors > self.link.errors_at_ready

    async def _backend_accepts(self, send: Callable[[], None]) -> bool:
        """Send messages of the proxy's own (`send`) and wait for their replies: False when
        the backend refused one (its error relayed; the backend then skips to Sync)."""
        link = self.link
        assert link is not None
        before = link.errors
        send()
        await link.drain()
        return link.errors == before

    async def _fail_batch(self, err: DPError) -> None:
        """An extended-protocol message the proxy answers failed: the error, then everything
        up to Sync ignored, by the backend too (`_fail_backend`)."""
        self.send_error(err)
        self.state = State.FAILED_BATCH
        await self._fail_backend(extended=True)

    async def _fail_backend(self, extended: bool) -> None:
        """After an error of the proxy's own, the backend fails as Postgres would: an open
        block is aborted; an extended batch skips to its Sync, its implicit transaction
        rolled back (`BackendLink.fail_transaction`). A Query outside a block has nothing
        to abort."""
        link = self.link
        if link is None or link.closed or (not extended and link.tx_status != b"T"):
            return
        link.fail_transaction(extended)
        await link.drain()

    async def _run_local_statement(
        self, st: Statement, describe: bool, bind: p.Bind | None = None,
        param_types: tuple[int, ...] = (), execute: p.Execute | None = None,
    ) -> None:
        """Answer one non-pass-through statement, counted and logged with its outcome."""
        started = time.perf_counter()
        sqlstate: str | None = "XX000"
        try:
            await self._answer_local(st, describe, bind, param_types, execute)
            sqlstate = None
        except DPError as e:
            sqlstate = e.sqlstate
            raise
        except asyncio.CancelledError:
            sqlstate = "57014"
            raise
        finally:
            self.statement_done(_LOG_KINDS.get(st.kind, "local"), started, sqlstate)

    async def _answer_local(
        self, st: Statement, describe: bool, bind: p.Bind | None, param_types: tuple[int, ...],
        execute: p.Execute | None = None,
    ) -> None:
        """Answer one non-pass-through statement (or a forwarded one the proxy follows): its
        rows (with RowDescription if asked); `execute`, the client's Execute of its portal."""
        self._check_transaction(st)
        if st.kind is StatementKind.REFUSED:
            assert st.refusal is not None
            raise st.refusal
        if st.kind is StatementKind.LOCAL_SET:
            self._set(st, extended=bind is not None)
            reset = st.tree.get("VariableSetStmt", {}).get("kind") == "VAR_RESET"
            self._pipeline_step(execute)
            self.send(p.CommandComplete("RESET" if reset else "SET"))
            return
        if st.kind is StatementKind.LOCAL_SHOW:
            assert st.setting is not None
            value = self.settings.show(st.setting)
            if describe:
                self.send(p.RowDescription((p.FieldDescription(st.setting, type_oid=TEXT_OID),)))
            self._pipeline_step(execute)
            self.send(p.DataRow((value.encode(),)), p.CommandComplete("SHOW"))
            return
        if st.kind is StatementKind.LOCAL_FUNCTION:
            self._check_cursor_block(st)
            sql = await self.server.dp.local_function(self.dp_request(), st, bind=bind,
                                                      param_types=param_types)
            await self.relay_result(_wrapped(st, sql), bind, execute=execute)
            return
        if st.kind is StatementKind.PASS_THROUGH:  # one with an effect on the proxy's state
            await self.relay_result(st.sql, bind, client_statement=True)
            self._follow(st, extended=bind is not None)
            return
        if st.kind in DP_KINDS:
            self._check_cursor_block(st)
            cursor = st.cursor
            if cursor is not None:  # a name in use is refused before the charge
                link = self.link
                assert link is not None
                declare = cursor.declare("SELECT", quote_ident)
                if not await self._backend_accepts(
                        lambda: link.try_declare(declare, cursor.name, bind is not None)):
                    raise AlreadyReported()
            request = await self.dp_request_asked(extended=bind is not None)
            # its own task, so that a CancelRequest can stop it (and its pushdown) alone
            self._dp_charged = False
            self._dp_task = asyncio.get_running_loop().create_task(
                self.server.dp.answer(request, st, bind, param_types))
            try:
                sql, notices = await self._dp_task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the session itself is closing
                raise QueryCanceled("canceling statement due to user request") from None
            except (DPError, AlreadyReported):
                raise
            except Exception:
                # a bug in the DP path (which has not touched the session's backend): this
                # statement fails, as any error of one user's data would, the session lives on
                log.exception("session %s: internal error in a DP query", self.process_id)
                raise InternalError() from None
            finally:
                self._dp_task = None
            await self.relay_result(_wrapped(st, sql), bind, execute=execute)
            self.send(*notices)
            return
        raise InternalError()

    async def relay_result(self, sql: str, bind: p.Bind | None,
                           client_statement: bool = False,
                           execute: p.Execute | None = None) -> None:
        """Have the backend answer `sql` (the proxy's own query, or the client's statement
        that the proxy must follow) to the client.

        Simple protocol: its RowDescription, rows and CommandComplete are
        relayed. Extended: only rows and CommandComplete, in the Bind's formats;
        for an `execute` with a row limit, its first rows and PortalSuspended as
        Postgres sends them, the rest left in the backend's portal of that name
        (what the client's next Execute reads). An error is relayed too; it
        raises AlreadyReported.
        """
        link = self.link
        assert link is not None
        before = link.errors
        try:
            if bind is None:
                link.send_split_query(sql)
            elif execute is not None and execute.max_rows > 0:
                link.run_internal(sql, bind.result_formats, execute.portal, execute.max_rows)
            else:
                link.run_internal(sql, bind.result_formats)
        except UnicodeEncodeError as e:
            # a released key (or an analyst's name) the client encoding cannot show: Postgres
            # fails a query the same way when a row has such a character
            raise untranslatable(e, link.encoding) from None
        await link.drain()
        if link.errors > before:
            if not client_statement:
                # (HAVING, ORDER BY or a query around the DP query can fail on released
                # values, 1/(n - 5) say; anything else that fails here is a bug)
                log.warning("session %s: the backend refused a result query (sqlstate %s)",
                            self.process_id, link.last_sqlstate)
            raise AlreadyReported()
