"""A Query of several statements the proxy answers one by one, in Postgres's implicit block."""

from __future__ import annotations

import time

from dp_core.classify import (
    Statement,
    StatementKind,
)
from dp_core.errors import DPError
from dp_core.result import set_transaction_sql
from server import wire as p
from server.encodings import untranslatable
from server.errors import NoActiveSqlTransaction
from server.session.base import AlreadyReported
from server.session.extended import WithLocalExtended
from server.session.settings import no_transaction_warning

_BEGINS = ("TRANS_STMT_BEGIN", "TRANS_STMT_START")


_ENDS = ("TRANS_STMT_COMMIT", "TRANS_STMT_ROLLBACK")


_SAVEPOINT_COMMANDS = {"TRANS_STMT_SAVEPOINT": "SAVEPOINT", "TRANS_STMT_RELEASE": "RELEASE SAVEPOINT",
                       "TRANS_STMT_ROLLBACK_TO": "ROLLBACK TO SAVEPOINT"}


_NOT_EMULATED = ("TRANS_STMT_PREPARE", "TRANS_STMT_COMMIT_PREPARED",
                 "TRANS_STMT_ROLLBACK_PREPARED")
"""Queries with these run statement by statement, without an implicit block of the proxy's."""


def _transaction_command(st: Statement) -> str | None:
    """The kind of a transaction command (TransactionStmt), None for any other statement."""
    body = st.tree.get("TransactionStmt")
    return None if body is None else str(body.get("kind", ""))


class WithImplicitBlock(WithLocalExtended):
    __slots__ = ()

    async def _simple_query(self, stmts: tuple[Statement, ...]) -> None:
        """A Query the proxy answers statement by statement (some are its own).

        Postgres runs the statements of a Query of several in an implicit block
        wherever no block is open: an error rolls back those before it, a cursor
        lives until the end, SET LOCAL lasts until then; BEGIN makes it the
        client's block, COMMIT and ROLLBACK end it with a warning, savepoints are
        refused. The proxy opens its own BEGIN for such a block (COMMIT or, after
        an error, ROLLBACK at its end, the client told nothing) and answers the
        transaction commands inside it as Postgres does (`_in_implicit_block`).
        """
        link = self.link
        assert link is not None
        await link.drain()
        # as Postgres, a Query drops the unnamed statement, and the unnamed portal when it
        # runs a statement: not in a failed block, where it fails first (a divergence is left
        # for a Query that the backend fails in planning: it keeps the portal there)
        link.close_quietly(b"S", "")
        if link.tx_status != b"E":
            link.close_quietly(b"P", "")
        several = sum(st.kind is not StatementKind.EMPTY for st in stmts) > 1 \
            and not any(_transaction_command(st) in _NOT_EMULATED for st in stmts)
        implicit = False
        """The proxy's own block is open (the client sees no block)."""
        failed = False
        for st in stmts:
            if st.kind is StatementKind.EMPTY:
                continue
            command = _transaction_command(st)
            if several and not implicit and link.tx_status == b"I" and command not in _BEGINS:
                link.run_quietly("BEGIN")
                await link.drain()
                implicit = True
            try:
                if implicit and command is not None:
                    implicit = await self._in_implicit_block(st, command)
                elif st.kind is StatementKind.PASS_THROUGH:
                    await self._split_statement(st)
                else:
                    await self._run_local_statement(st, describe=True)
            except AlreadyReported:
                failed = True
                break
            except DPError as e:
                self.send_error(e)
                failed = True
                if not implicit:
                    await self._fail_backend(extended=False)
                break
        if implicit and not link.closed:
            link.run_quietly("ROLLBACK" if failed else "COMMIT")
            await link.drain()
        self.send(p.ReadyForQuery(link.tx_status))

    async def _split_statement(self, st: Statement) -> None:
        """Run one forwarded statement of a split Query on the backend (its replies relayed
        but its ReadyForQuery); raises AlreadyReported when it fails."""
        link = self.link
        assert link is not None
        started = time.perf_counter()
        try:
            link.send_split_query(st.sql)
        except UnicodeEncodeError as e:
            raise untranslatable(e, link.encoding) from None
        await link.drain()
        failed = link.last_split_failed
        self.statement_done("pass_through", started, link.last_sqlstate if failed else None)
        if failed:
            raise AlreadyReported()
        self._follow(st)

    async def _in_implicit_block(self, st: Statement, command: str) -> bool:
        """A transaction command inside the proxy's implicit block, answered as Postgres
        answers it inside its own (xact.c); returns whether the block stays the proxy's."""
        link = self.link
        assert link is not None
        if command in _BEGINS:
            if st.tree["TransactionStmt"].get("options") and not await self._backend_accepts(
                    lambda: link.run_quietly(set_transaction_sql(st.sql))):
                raise AlreadyReported()  # (its errors as BEGIN's)
            # the block is the client's from now on
            self.send(p.CommandComplete(
                "START TRANSACTION" if command == "TRANS_STMT_START" else "BEGIN"))
            return False
        chain = bool(st.tree["TransactionStmt"].get("chain"))
        if command in _ENDS:
            commit = command == "TRANS_STMT_COMMIT"
            if chain:
                raise NoActiveSqlTransaction(
                    f"{'COMMIT' if commit else 'ROLLBACK'} AND CHAIN can only be used in "
                    "transaction blocks")
            link.run_quietly("COMMIT" if commit else "ROLLBACK")
            await link.drain()
            self.send(no_transaction_warning("there is no transaction in progress"),
                      p.CommandComplete("COMMIT" if commit else "ROLLBACK"))
            return False
        raise NoActiveSqlTransaction(f"{_SAVEPOINT_COMMANDS[command]} can only be used in "
                                     "transaction blocks")
