"""The extended protocol's local statements and portals: Parse, Bind, Describe, Execute, Close."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from dp_core.classify import (
    Statement,
    StatementKind,
)
from dp_core.errors import DPError
from dp_core.parsetree import highest_parameter
from server import backend
from server import wire as p
from server.errors import BindMismatch, ObjectNotInPrerequisiteState
from server.session.answers import DP_KINDS, TEXT_OID, WithLocalAnswers
from server.session.base import AlreadyReported, LocalPortal, LocalStatement, State

_BIND_KEEPS_PORTAL = frozenset({"26000", "08P01", "25P02"})
"""A Bind that fails with these has not replaced the unnamed portal (postgres.c: it checks
the statement, its parameter counts and the transaction before it makes the portal)."""


class WithLocalExtended(WithLocalAnswers):
    __slots__ = ()

    def _local(self, fn: Callable[[], None]) -> Awaitable[None]:
        """Answer an extended-protocol message locally, after everything before it."""

        async def run() -> None:
            assert self.link is not None
            await self.link.drain()
            if self._backend_failed_batch():
                self.state = State.FAILED_BATCH
                return
            try:
                fn()
            except DPError as e:
                await self._fail_batch(e)

        return run()

    def _local_async(self, work: Awaitable[None]) -> Awaitable[None]:
        async def run() -> None:
            assert self.link is not None
            await self.link.drain()
            if self._backend_failed_batch():
                self.state = State.FAILED_BATCH
                if asyncio.iscoroutine(work):
                    work.close()
                return
            try:
                await work
            except AlreadyReported:
                self.state = State.FAILED_BATCH
            except DPError as e:
                await self._fail_batch(e)

        return run()

    def _forward_unnamed_bind(self, raw: bytes) -> Awaitable[None]:
        """A Bind of the unnamed portal that the backend answers, while the unnamed portal
        is a local one: as in Postgres, it replaces that portal unless it fails before
        making its own (no such statement, a malformed Bind, a failed block: the old
        portal stays), or the backend skips it after an earlier error."""
        link = self.link
        assert link is not None

        async def bind() -> None:
            await link.drain()  # (so that an error is this Bind's)
            if self._backend_failed_batch():
                self.state = State.FAILED_BATCH  # (the backend would skip it)
                return
            before = link.errors
            link.forward(raw, b"B")
            await link.drain()
            if link.errors == before or link.last_sqlstate not in _BIND_KEEPS_PORTAL:
                self.local_portals.pop("", None)

        return bind()

    async def _local_parse(self, msg: p.Parse, st: Statement) -> None:
        assert self.link is not None
        await self.link.drain()
        if self._backend_failed_batch():
            self.state = State.FAILED_BATCH
            return
        if msg.name == "":
            # as Postgres, a Parse of the unnamed statement drops the one before, even when
            # it fails, and that one may be the backend's
            self.local_statements.pop("", None)
            self.link.close_quietly(b"S", "")
        failure = self._transaction_failure(st) or st.refusal
        if failure is not None:
            self.statement_done("refused", time.perf_counter(), failure.sqlstate)
            await self._fail_batch(failure)
            return
        if msg.name:
            # the name is taken on the backend too: Postgres refuses a name in use (42P05)
            # whichever kind of statement has it
            link = self.link
            if not await self._backend_accepts(lambda: link.shadow_statement(msg.name)):
                self.state = State.FAILED_BATCH  # (its error relayed)
                return
        self.local_statements[msg.name] = LocalStatement(
            st, msg.param_types, max(len(msg.param_types), highest_parameter(st.tree)))
        self.send(p.ParseComplete())

    def _forwarded_parse(self, name: str, st: Statement | None = None) -> None:
        """A Parse the backend answers replaces the unnamed statement, local or not; for a
        named one, a local statement's shadow makes the backend refuse it (42P05), as
        Postgres refuses a name in use. `st`, when its parameters are checked at Bind."""
        if name == "":
            self.local_statements.pop("", None)
        if st is not None and st.at_bind:
            self.bound_checks[name] = st
        elif name == "" or name not in self.bound_checks:
            self.bound_checks.pop(name, None)

    def _check_bound(self, st: Statement, bind: p.Bind) -> None:
        """Refuse a Bind whose parameters' values would change a setting the proxy depends
        on, as the literal form is refused when parsed."""
        assert self.link is not None
        values: list[str | None] = []
        for value in bind.params:
            try:
                values.append(None if value is None else value.decode(self.link.codec))
            except UnicodeDecodeError:
                values.append(None)  # (Postgres refuses the Bind: 22021)
        err = self.server.classifier.settings.bound_refusal(st.at_bind, values)
        if err is not None:
            raise err

    def _drop_unnamed(self, link: backend.BackendLink) -> None:
        """As Postgres, a simple Query drops the unnamed statement, and the unnamed portal
        when it runs a statement: not in a failed block (it fails first, 25P02)."""
        self.bound_checks.pop("", None)
        if self.local_statements or self.local_portals:
            self.local_statements.pop("", None)
            if link.tx_status != b"E":
                self.local_portals.pop("", None)
                self.exhausted_portals.discard("")

    def _open_portal(self, name: str) -> LocalPortal | None:
        """The local portal `name`, if it is still open (call after draining the link): every
        portal ends with its transaction."""
        link = self.link
        assert link is not None
        if self._portals_epoch != link.idle_readies:
            self._portals_epoch = link.idle_readies
            self.local_portals.clear()
            self.exhausted_portals.clear()
        return self.local_portals.get(name)

    def _forward_instead(self, msg: p.Execute | p.Describe | p.Close) -> None:
        """The local portal `msg` names has ended with its transaction: the backend answers
        (it knows of no such portal either, unless one was made since)."""
        assert self.link is not None
        self.link.forward(msg.encode(self.link.codec), msg.tag)

    async def _local_bind(self, bind: p.Bind, local: LocalStatement) -> None:
        if len(bind.params) != local.n_params:
            raise BindMismatch(f"bind message supplies {len(bind.params)} parameters, but prepared "
                               f'statement "{bind.statement}" requires {local.n_params}')
        self._check_transaction(local.statement)
        self._open_portal(bind.portal)  # (ends the portals of a transaction that has ended)
        link = self.link
        assert link is not None
        if bind.portal == "":
            link.close_quietly(b"P", "")  # it replaces the unnamed portal, maybe the backend's
        else:
            # the name is taken on the backend too, until the portal is closed or its
            # transaction ends: Postgres refuses a name in use (42P03) whatever portal has it
            if not await self._backend_accepts(lambda: link.shadow_portal(bind.portal)):
                raise AlreadyReported()
        self.local_portals[bind.portal] = LocalPortal(local, bind)
        self.exhausted_portals.discard(bind.portal)
        self.send(p.BindComplete())

    def _local_close(self, msg: p.Close) -> None:
        if msg.kind == b"S":
            self.bound_checks.pop(msg.name, None)
            self.local_statements.pop(msg.name, None)
        elif self._open_portal(msg.name) is not None:
            self.local_portals.pop(msg.name, None)
        if msg.name:
            self._forward_instead(msg)  # (and its shadow, if it is still there)
        else:
            self.send(p.CloseComplete())

    async def _local_describe(self, msg: p.Describe) -> None:
        if msg.kind == b"P" and self._open_portal(msg.name) is None:
            self._forward_instead(msg)
            return
        local = self.local_statements[msg.name] if msg.kind == b"S" else \
            self.local_portals[msg.name].statement
        # describing a DP query reads the catalog; Postgres too refuses to describe a statement
        # that returns rows in a failed block (not ROLLBACK TO, SET, DECLARE or COPY)
        st = local.statement
        if not (st.wraps_result or st.kind is StatementKind.LOCAL_SET):
            self._check_transaction(st)
        if msg.kind == b"S":
            types = tuple(local.param_types)
            if st.kind in DP_KINDS:
                declared = types + (0,) * (local.n_params - len(types))
                request = self.dp_request() if st.kind is StatementKind.LOCAL_FUNCTION \
                    else await self.dp_request_asked(extended=True)
                types = await self.server.dp.parameter_types(request, st, declared)
                # the client encodes its parameters as described (asyncpg: an int8 in 8
                # binary bytes), so its Binds are read with these types, as Postgres's are
                self.local_statements[msg.name] = replace(local, param_types=types)
            self.send(p.ParameterDescription(types))
            self.send(await self._row_description(st, None, local.param_types, ()))
        else:
            portal = self.local_portals[msg.name]
            self.send(await self._row_description(portal.statement.statement, portal.bind,
                                                  portal.statement.param_types,
                                                  portal.bind.result_formats))

    async def _row_description(self, st: Statement, bind: p.Bind | None,
                               param_types: tuple[int, ...],
                               formats: tuple[int, ...]) -> p.RowDescription | p.NoData:
        if st.kind is StatementKind.LOCAL_SHOW:
            assert st.setting is not None
            return p.RowDescription((p.FieldDescription(
                st.setting, type_oid=TEXT_OID, format=formats[0] if formats else 0),))
        if st.kind in (StatementKind.LOCAL_SET, StatementKind.PASS_THROUGH) or st.wraps_result:
            # (a forwarded statement the proxy follows returns no rows, nor DECLARE or COPY)
            return p.NoData()
        request = self.dp_request() if st.kind is StatementKind.LOCAL_FUNCTION \
            else await self.dp_request_asked(extended=True)
        desc: p.RowDescription = await self.server.dp.describe(
            request, st, bind, param_types, formats)
        return desc

    async def _local_execute(self, ex: p.Execute, portal: LocalPortal) -> None:
        if self._open_portal(ex.portal) is not portal:
            self._forward_instead(ex)
            return
        st = portal.statement.statement
        if st.kind in DP_KINDS:
            # a DP answer is one release: executing the portal again finds it exhausted, as
            # Postgres does (no second answer, no charge); with a row limit the released rows
            # stay in the backend's portal of that name, read by the client's next Executes
            if ex.portal in self.exhausted_portals:
                self._check_transaction(st)  # (a failed block refuses it first, 25P02)
                if st.cursor is not None or st.wraps_result:  # (DECLARE, COPY: run once)
                    raise ObjectNotInPrerequisiteState(f'portal "{ex.portal}" cannot be run')
                self.send(p.CommandComplete("SELECT 0"))
                return
            self.exhausted_portals.add(ex.portal)
        await self._run_local_statement(st, describe=False, bind=portal.bind,
                                        param_types=portal.statement.param_types, execute=ex)
        if ex.max_rows > 0 and st.kind in DP_KINDS:
            # the answer is the backend's portal now (`relay_result`): the client's further
            # Executes, Describe and Close of it go there
            self.local_portals.pop(ex.portal, None)
            self.exhausted_portals.discard(ex.portal)
