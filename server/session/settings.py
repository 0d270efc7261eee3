"""A session's dp.* settings and transaction state: SET, SHOW's values, what blocks do to them."""

from __future__ import annotations

from collections.abc import Callable

from dp_core.classify import (
    TRANSACTION_EFFECTS,
    Effect,
    Statement,
    StatementKind,
)
from dp_core.errors import SyntaxError_
from dp_core.parsetree import const_value
from dp_core.settings import Caps, DPSettings
from server import wire as p
from server.errors import InFailedSqlTransaction, NoActiveSqlTransaction
from server.session.base import SessionCore


def no_transaction_warning(message: str) -> p.NoticeResponse:
    """Postgres's WARNING 25P01 (a transaction command where no block is open)."""
    return p.NoticeResponse(((p.FIELD_SEVERITY, "WARNING"), (p.FIELD_SEVERITY_V, "WARNING"),
                             (p.FIELD_CODE, "25P01"), (p.FIELD_MESSAGE, message)))


class WithSettings(SessionCore):
    __slots__ = ()

    @property
    def settings(self) -> DPSettings:
        """The session's dp.* settings now."""
        return self.block_settings.now(self.link)

    @property
    def caps(self) -> Caps:
        """The proxy's caps on dp.* settings."""
        return self.server.caps

    def _settle(self) -> None:
        """Settle the dp.* settings of a block that changed them and has ended (the link
        calls this when it notes an end)."""
        self.block_settings.settle(self.link)

    def _set(self, st: Statement, extended: bool = False) -> None:
        """SET [LOCAL] / RESET dp.*, with Postgres's transaction semantics (`BlockSettings`)."""
        assert st.setting is not None
        name = st.setting
        body = st.tree.get("VariableSetStmt", {})
        kind = body.get("kind", "VAR_SET_VALUE")
        value: str | float | int | None
        if kind in ("VAR_SET_DEFAULT", "VAR_RESET"):
            value = self.server.default_settings().show(name)
        else:
            args = body.get("args", [])
            if len(args) != 1:
                raise SyntaxError_(f"SET {name} takes one value")
            value = const_value(args[0])
            if value is None:
                raise SyntaxError_(f"SET {name} takes a number or a name")
        caps = self.server.caps
        self._assign(lambda s: s.with_value(name, value, caps), bool(body.get("is_local")),
                     extended)

    def _pipeline_step(self, execute: p.Execute | None) -> None:
        """A client's Execute the proxy answers itself without the backend: the backend runs
        a no-op in its place (`BackendLink.pipeline_step`), as it would have run the statement
        in the client's pipeline."""
        if execute is not None and self.link is not None:
            self.link.pipeline_step()

    def _assign(self, change: Callable[[DPSettings], DPSettings], is_local: bool,
                extended: bool = False) -> None:
        """Change the session's dp.* settings as a SET [LOCAL] does (see `BlockSettings`),
        with Postgres's warning for a SET LOCAL outside a block."""
        link = self.link
        assert link is not None
        if self.block_settings.assign(link, change, is_local, extended):
            self.send(no_transaction_warning("SET LOCAL can only be used in transaction blocks"))

    def _follows(self, st: Statement, prepared: bool = False) -> bool:
        """A forwarded statement the proxy must see run, to follow what it does to its own
        state: savepoints only while dp.* settings have changed in the open block, unless it
        is `prepared` by name (it may run later, in another block)."""
        if st.effect is None:
            return False
        if st.effect in TRANSACTION_EFFECTS and not prepared:
            return self.block_settings.changed_in_block(self.link)
        return True

    def _follow(self, st: Statement, extended: bool = False) -> None:
        """After the backend ran `st`: what it also does to the proxy's own session state
        (`extended`: run on the extended protocol)."""
        effect = st.effect
        if effect in TRANSACTION_EFFECTS:
            assert self.link is not None
            self.block_settings.follow_savepoint(self.link, effect, st.setting)
            return
        if effect is Effect.DEALLOCATE:  # (the backend dropped the statement's shadow too)
            if st.setting is None:
                self.local_statements.clear()
                self.bound_checks.clear()
            else:
                self.local_statements.pop(st.setting, None)
                self.bound_checks.pop(st.setting, None)
            return
        if effect is Effect.DISCARD_ALL:
            self.local_statements.clear()
            self.bound_checks.clear()
            self.local_portals.clear()
            self.exhausted_portals.clear()
        if effect in (Effect.DISCARD_ALL, Effect.RESET_ALL):
            defaults = self.server.default_settings()
            self._assign(lambda _: defaults, is_local=False, extended=extended)

    def _transaction_failure(self, st: Statement | None = None) -> InFailedSqlTransaction | None:
        """As Postgres, statements in a transaction that failed are refused: a DP query there
        would be charged and then its answer refused by the backend. A forwarded statement
        `st` the proxy follows is the backend's to refuse (it runs ROLLBACK TO there)."""
        if st is not None and st.kind is StatementKind.PASS_THROUGH:
            return None
        if self.link is not None and self.link.tx_status == b"E":
            return InFailedSqlTransaction(
                "current transaction is aborted, commands ignored until end of transaction block")
        return None

    def _check_transaction(self, st: Statement | None = None) -> None:
        failure = self._transaction_failure(st)
        if failure is not None:
            raise failure

    def _check_cursor_block(self, st: Statement) -> None:
        """As Postgres, a cursor without WITH HOLD is declared only in a transaction block:
        refused before the DP answer is charged, since the backend would refuse the DECLARE
        only after. Where an extended batch has run statements since the last ReadyForQuery
        (a BEGIN among them, as pgjdbc sends), the backend decides."""
        link = self.link
        assert link is not None
        if st.cursor is not None and not st.cursor.hold and link.tx_status == b"I" \
                and link.batch_started is None:
            raise NoActiveSqlTransaction("DECLARE CURSOR can only be used in transaction blocks")
