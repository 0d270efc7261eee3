"""The DP query path: analyse, plan, charge, run the pushdown, release, answer."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import asyncpg
from pglast.stream import RawStream

from config import Accountant, Config
from dp_core.accounting import AnswerCost
from dp_core.analysis import parse_select
from dp_core.budget import check_affordable, to_numeric
from dp_core.classify import Statement, StatementKind
from dp_core.errors import DPError, FeatureNotSupported
from dp_core.explain import Split, explain_lines, fmt, notice_text
from dp_core.plan import DPQueryPlan, check_noise_scales
from dp_core.query import AnalyzedQuery
from dp_core.release import (
    Released,
    release,
)
from dp_core.result import result_sql
from dp_core.settings import check_caps
from dp_core.table_tuning import TableTuning
from server import wire as p
from server.errors import BindMismatch, PushdownBusy
from server.ledger import Ledger, OnceCost, ledger_time
from server.local_functions import LocalFunctions
from server.replies import notice_response

if TYPE_CHECKING:
    from server.metrics import Metrics
from server.dp_query.prepare import Preparer
from server.dp_query.prepared import PG, Prepared, answer_sql
from server.dp_query.request import DPRequest
from server.dp_query.reuse import (
    EVERYONE,
    AnswerStore,
    Reused,
    Versions,
    question_key,
    tables_read,
)
from server.dp_query.run import PushdownRun, PushdownRunner
from server.dp_query.table_tuning import TableTuner
from server.dp_query.uid_split import UidSplitter

log = logging.getLogger("dp_proxy.dp")
_OIDS = {"int8": 20, "float8": 701, "text": 25, "numeric": 1700, "timestamptz": 1184, "int4": 23}


class QueryFailed(DPError):
    """A charged DP query failed while running: one generic message, nothing about data."""

    sqlstate = "XX000"

    def __init__(self) -> None:
        super().__init__("the DP query failed after its privacy cost was charged; the charge stands",
                         hint="nothing about the data is revealed by this error")


class LedgerUnavailable(DPError):
    """The charge could not be recorded, so the query did not run."""

    sqlstate = "58000"

    def __init__(self) -> None:
        super().__init__("the privacy budget ledger is unavailable: the query was not run",
                         hint="try again; if it persists, tell the proxy's operator")


def _once_cost(tuning: TableTuning) -> OnceCost:
    """What an analyst pays once for a table's tuned bounds."""
    return OnceCost(tuning.token, AnswerCost(tuning.epsilon, Fraction(0)),
                    f"paid once for {tuning.describe()}")


def row_description(names: Sequence[str], oids: Sequence[int],
                    formats: Sequence[int] = ()) -> p.RowDescription:
    def fmt(i: int) -> int:
        if not formats:
            return 0
        return formats[0] if len(formats) == 1 else formats[i]

    return p.RowDescription(tuple(p.FieldDescription(n, type_oid=o, format=fmt(i))
                                  for i, (n, o) in enumerate(zip(names, oids, strict=True))))


class DPService:
    """Answers a session's DP statements: each one prepared, charged, run and released.

    Order of events for one DP answer: the pushdown is prepared (`Preparer`; planning
    errors, which do not depend on data, are reported as they are and cost nothing); the
    ledger is charged and committed; only then do statements read the analyst's tables: the
    split's sample of the uid (`UidSplitter.split`), then the pushdown (`PushdownRunner`), as
    the pushdown role with a statement timeout; noise and thresholding are applied; the
    released rows go back to the client through the session's own backend connection as a
    small VALUES query, so
    Postgres encodes them in the format the client asked for. A failure after the charge
    returns one generic error that names no row or value.
    """

    def __init__(self, config: Config, pool: asyncpg.Pool, ledger: Ledger,
                 metrics: Metrics, restricted_role: str) -> None:
        self.pool = pool
        self.ledger = ledger
        self.metrics = metrics
        self.preparer = Preparer(config, pool, restricted_role)
        self.splitter = UidSplitter(config, self.preparer.policy, self.preparer.pushdowns,
                                    self.preparer.has_nondeterministic)
        self.runner = PushdownRunner(config, pool, metrics)
        self.answers = AnswerStore(ledger.pool, config.backend.ledger_schema)
        self.tuner = TableTuner(config, self.preparer.policy, self.runner, ledger)
        self._turns: dict[str, tuple[int, asyncio.Semaphore]] = {}
        """Each analyst's limit of DP queries at once in this process, and its turns (`_turn`)."""
        self.config = config

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        """The proxy's config, and its parts' (a reload replaces it)."""
        self._config = config
        self.preparer.config = self.splitter.config = self.runner.config = config
        self.tuner.config = config
        self._quantum = config.defaults.release_quantum_ms / 1000.0

    async def describe(self, request: DPRequest, st: Statement, bind: p.Bind | None,
                       param_types: Sequence[int], formats: Sequence[int]) -> p.RowDescription:
        if st.kind is StatementKind.DP_EXPLAIN:
            return row_description(["QUERY PLAN"], [_OIDS["text"]], formats)
        if st.kind is StatementKind.LOCAL_FUNCTION:
            # the rewritten query (with a reset not performed) tells its own columns
            sql = await self.local_function(request, st, dry_run=True, bind=bind,
                                            param_types=param_types)
            async with self._acquire() as conn:
                attrs = (await conn.prepare(sql)).get_attributes()
            return row_description([a.name for a in attrs], [a.type.oid for a in attrs], formats)
        async with self._acquire() as conn:
            # the result query, with no rows, tells the columns (computed ones included)
            attrs = (await self.preparer.prepare(request, st, bind, param_types, conn)).columns
        return row_description([a.name for a in attrs], [a.type.oid for a in attrs], formats)

    @contextlib.asynccontextmanager
    async def _acquire(self) -> AsyncIterator[Any]:
        """A pushdown connection, waited for at most `pushdown_wait` seconds; a pool or a
        backend with no connection free is a clean 53300 (nothing charged), not a bug."""
        wait = self.config.backend.pushdown_wait
        try:
            conn = await self.pool.acquire(timeout=wait)
        except TimeoutError:
            raise PushdownBusy(f"no connection for DP queries became free within {fmt(wait)} s: "
                               "other DP queries hold them all",
                               hint="try again; an operator can raise pushdown_pool_size") from None
        except (asyncpg.TooManyConnectionsError, asyncpg.CannotConnectNowError, OSError):
            raise PushdownBusy(
                "the backend database has no connection slot free for the DP engine",
                hint="try again; an operator can raise the backend's max_connections") from None
        try:
            yield conn
        finally:
            await self.pool.release(conn)

    @contextlib.asynccontextmanager
    async def _turn(self, analyst: str) -> AsyncIterator[None]:
        """One of the analyst's `max_dp_queries` DP queries at once in this process: beyond it
        a query waits for one of them to end, at most `pushdown_wait` seconds (then 53300,
        before anything is charged), so that one analyst's burst (a dashboard's) queues
        behind itself and never holds every pushdown connection while the others wait."""
        limit = self.config.analysts[analyst].max_dp_queries
        turns = self._turns.get(analyst)
        if turns is None or turns[0] != limit:  # (a reload may change the limit)
            turns = self._turns[analyst] = (limit, asyncio.Semaphore(limit))
        wait = self.config.backend.pushdown_wait
        try:
            await asyncio.wait_for(turns[1].acquire(), wait)
        except TimeoutError:
            raise PushdownBusy(f'analyst "{analyst}" has {limit} DP queries running '
                               f"(max_dp_queries) and none ended within {fmt(wait)} s",
                               hint="run fewer at once; nothing was charged") from None
        try:
            yield
        finally:
            turns[1].release()

    async def parameter_types(self, request: DPRequest, st: Statement,
                              declared: Sequence[int]) -> tuple[int, ...]:
        if st.kind in (StatementKind.DP_QUERY, StatementKind.DP_EXPLAIN):
            prepared = await self.preparer.prepare(request, st, None)
            found = list(prepared.param_oids)
            return tuple(d or f for d, f in zip(list(declared) + [0] * len(found), found,
                                                strict=False))
        if st.kind is StatementKind.LOCAL_FUNCTION:  # analyst names: text
            return tuple(d or _OIDS["text"] for d in declared)
        return tuple(declared)

    async def answer(self, request: DPRequest, st: Statement, bind: p.Bind | None,
                     param_types: Sequence[int]) -> tuple[str, list[p.NoticeResponse]]:
        """Run a DP query or EXPLAIN; returns the result query to relay and notices to send.

        Every attempt that does not end in an answer is appended to the ledger with
        its outcome (the audit trail); answers are there as charges.
        """
        started = time.perf_counter()
        async with self._turn(request.analyst) if st.kind is StatementKind.DP_QUERY else \
                contextlib.nullcontext():
            return await self._answer_turn(request, st, bind, param_types, started)

    async def _answer_turn(self, request: DPRequest, st: Statement, bind: p.Bind | None,
                           param_types: Sequence[int],
                           started: float) -> tuple[str, list[p.NoticeResponse]]:
        async with self._acquire() as conn:
            try:
                answer = await self._answer(request, st, bind, param_types, conn,
                                            time.monotonic())
                if st.kind is StatementKind.DP_QUERY:
                    self.metrics.dp_seconds.observe(time.perf_counter() - started)
                return answer
            except DPError as e:
                if st.kind is not StatementKind.DP_EXPLAIN:
                    try:
                        await self.ledger.record(request.analyst, f"{e.sqlstate}: {e.message}",
                                                 st.sql)
                    except (asyncpg.PostgresError, OSError):
                        log.warning("session %s: could not audit a refused query", request.process_id)
                raise

    async def _release_on_quantum(self, arrived: float) -> None:
        """Hold a charged outcome until the next multiple of the release quantum after the
        query arrived (DESIGN §3.11): its time then tells only how many quanta the work took."""
        if self._quantum <= 0:
            return
        elapsed = time.monotonic() - arrived
        quanta = max(1, math.ceil(elapsed / self._quantum))
        await asyncio.sleep(max(0.0, quanta * self._quantum - elapsed))

    async def _answer(self, request: DPRequest, st: Statement, bind: p.Bind | None,
                      param_types: Sequence[int], conn: Any,
                      arrived: float) -> tuple[str, list[p.NoticeResponse]]:
        prepared = await self.preparer.prepare(request, st, bind, param_types, conn,
                                               functools.partial(self._tunings, request))
        if st.kind is StatementKind.DP_EXPLAIN and prepared.tuned is not None \
                and not await self._paid(request, prepared.tuned.tuning):
            # EXPLAIN spends nothing: tuned bounds the analyst has not paid for are not shown
            # (the plan of per-query tuning instead, and what running it would use)
            unpaid = prepared.tuned.tuning
            prepared = await self.preparer.prepare(request, st, bind, param_types, conn)
        else:
            unpaid = None
        if bind is not None and len(bind.result_formats) > 1:
            # Postgres checks this at Bind; the proxy, before the charge
            columns = 0 if st.wraps_result else 1 if st.kind is StatementKind.DP_EXPLAIN \
                else len(prepared.columns)
            if len(bind.result_formats) != columns:
                raise BindMismatch(f"bind message has {len(bind.result_formats)} result formats "
                                   f"but query has {columns} columns")
        # whether the pushdown may be split: from the catalog, reading no row (the split's
        # sample reads the analyst's tables, after the charge)
        candidate = await self.splitter.candidate(prepared, conn)
        plan = prepared.plan
        if st.kind is StatementKind.DP_EXPLAIN:
            if candidate is not None:
                prepared.split = candidate
                prepared.split_ranges = self.config.backend.pushdown_split
            lines = explain_lines(prepared.query, plan, prepared.sql, None if prepared.split is None
                                  else Split(prepared.split_ranges, prepared.split.table,
                                             prepared.split.uid_column, prepared.split.rows,
                                             self.splitter.prefilter(prepared, prepared.split)
                                             is not None),
                                  None if prepared.tuned is None
                                  else prepared.tuned.tuning.describe(),
                                  None if unpaid is None else unpaid.describe())
            return result_sql(["QUERY PLAN"], [(PG, "text")], [(ln,) for ln in lines]), []
        reuse = self.config.defaults.answer_reuse
        key, versions = None, None
        if reuse != "off" and st.kind is StatementKind.DP_QUERY:
            try:
                key, versions, found = await self._find_reusable(request, st, bind, param_types,
                                                                 prepared)
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as e:
                log.warning("session %s: could not look for a reusable answer: %s",
                            request.process_id, type(e).__name__)
                key, versions, found = None, None, None
            if found is not None and prepared.tuned is not None and reuse == "all" \
                    and not await self._paid(request, prepared.tuned.tuning):
                # (another analyst's answer with tuned bounds shows them: this analyst pays
                # for them once first, with an answer of its own)
                found = None
            if found is not None:
                return await self._reused(request, st, found, arrived)
        mechanisms = plan.mechanisms()
        accountant = self.config.analysts[request.analyst].accountant
        try:
            await self._check_affordable(request, prepared.query, plan, accountant)
            read = frozenset().union(*(t.bases for t in prepared.query.tables))
            once = [] if prepared.tuned is None else [_once_cost(prepared.tuned.tuning)]
            if prepared.tuned is not None:
                mechanisms["tuned_bounds"] = {"table": prepared.tuned.tuning.table,
                                              "ledger_id": prepared.tuned.tuning.ledger_id}
            charged = await self.ledger.charge(request.analyst, AnswerCost.of(plan), st.sql,
                                               mechanisms, accountant=accountant,
                                               scopes=self.config.total_scopes(read), once=once)
            ledger_id = charged.ledger_id
            self.metrics.epsilon_spent.labels(request.analyst).inc(float(
                plan.cost.epsilon + sum((o.cost.epsilon for o in charged.paid_once),
                                        Fraction(0))))
            request.charged()
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as e:
            log.error("session %s: ledger unavailable: %s", request.process_id, e)
            raise LedgerUnavailable() from None
        try:
            if candidate is not None:
                await self.splitter.split(prepared, candidate, conn)
            run = await self.runner.run(prepared, conn)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as e:
            log.warning("session %s: charged DP query failed: %s", request.process_id,
                        type(e).__name__)
            await self._release_on_quantum(arrived)
            raise QueryFailed() from None
        # (in a thread: the noise and the intervals' simulation of many groups take a while,
        # which the other sessions of this worker would otherwise wait out)
        released = await asyncio.to_thread(release, run.query, run.plan, run.rows,
                                           quantiles=run.quantiles, selection=run.selection)
        sql = answer_sql(prepared, released.rows)
        try:
            budget = await self.ledger.budget(request.analyst)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as e:
            # the answer is charged: released all the same, without what is left
            log.warning("session %s: could not read the budget left: %s", request.process_id,
                        type(e).__name__)
            budget = None
        notice = self._notice(prepared, run, released, budget, charged.paid_once)
        if key is not None and versions is not None:
            try:
                await self.answers.store(key, EVERYONE if reuse == "all" else request.analyst,
                                         versions, sql, notice.get(p.FIELD_DETAIL), ledger_id,
                                         self.config.defaults.answer_reuse_hours)
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as e:
                log.warning("session %s: could not keep an answer for reuse: %s",
                            request.process_id, type(e).__name__)
        await self._release_on_quantum(arrived)
        return sql, [notice]

    async def _find_reusable(self, request: DPRequest, st: Statement, bind: p.Bind | None,
                             param_types: Sequence[int], prepared: Prepared
                             ) -> tuple[str | None, Versions | None, Reused | None]:
        """The question's key and its tables' versions, and the answer released for them, if
        any. The versions are read before the pushdown: a write that commits after this
        changes the version the next asker reads."""
        tables = tables_read(prepared.query, self.config)
        versions = await self.answers.versions(tables) if tables else None
        if versions is None:
            return None, None, None
        policies = sorted((t.name, repr(self.preparer.policy.get(t.name)))
                          for t in prepared.query.tables)
        meaning = (prepared.meaning, policies, prepared.public_keys)
        key = question_key(st, bind, param_types, prepared.plan,
                           (request.timezone, request.search_path, request.encoding), meaning)
        reuse = self.config.defaults.answer_reuse
        who = [request.analyst, *([EVERYONE] if reuse == "all" else [])]
        return key, versions, await self.answers.find(key, who, versions)

    async def _reused(self, request: DPRequest, st: Statement, found: Reused,
                      arrived: float) -> tuple[str, list[p.NoticeResponse]]:
        """An answer released before, given again: no charge, a 'reuse' event in the ledger;
        on the release quantum as a fresh one, so that its time does not tell reuse apart."""
        released = ledger_time(found.released_at)
        try:
            await self.ledger.record_reuse(request.analyst, st.sql, released)
            budget = await self.ledger.budget(request.analyst)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as e:
            log.error("session %s: ledger unavailable: %s", request.process_id, e)
            raise LedgerUnavailable() from None
        message = (f"DP answer reused: first released at {released}, its data unchanged since; "
                   f"spent nothing; budget left epsilon {fmt(float(budget.epsilon_remaining))}, "
                   f"delta {fmt(float(budget.delta_remaining))}")
        await self._release_on_quantum(arrived)
        return found.result, [notice_response(message, found.detail)]

    async def _check_affordable(self, request: DPRequest, query: AnalyzedQuery,
                                plan: DPQueryPlan, accountant: Accountant) -> None:
        """A query costing more than is left gets 53400; then the per-query caps and noise
        too small for its grid (22023).

        (With the RDP accountant an answer may cost less than its nominal ε: the charge decides.)
        """
        if accountant is Accountant.BASIC:
            budget = await self.ledger.budget(request.analyst)
            check_affordable(budget, to_numeric(plan.cost.epsilon), to_numeric(plan.cost.delta))
        check_caps(float(plan.epsilon), float(plan.delta), plan.max_groups_contributed,
                   request.caps)
        check_noise_scales(query, plan)

    def _notice(self, prepared: Prepared, run: PushdownRun, released: Released,
                budget: Any, paid_once: Sequence[OnceCost] = ()) -> p.NoticeResponse:
        """The answer's notice; `budget` None: the ledger did not say what is left."""
        tuned = run.tuned or (prepared.tuned.tuned if prepared.tuned else None)
        message, detail = notice_text(
            prepared.query, run.plan, released.spread, run.bounds,
            float("nan") if budget is None else float(budget.epsilon_remaining),
            float("nan") if budget is None else float(budget.delta_remaining), tuned,
            None if prepared.tuned is None else prepared.tuned.tuning.describe(),
            sum((o.cost.epsilon for o in paid_once), Fraction(0)))
        if budget is None:
            message = message.split("; budget left")[0] + "; the budget left is unknown (the " \
                "ledger did not answer)"
        if prepared.clock_now is not None:
            minutes = self.config.defaults.clock_granularity_minutes
            clock = (f"now() read as {prepared.clock_now}, the start of its quantum of "
                     f"{minutes} minutes (clock_granularity_minutes)")
            detail = clock if detail is None else f"{detail}; {clock}"
        return notice_response(message, detail)

    async def _tunings(self, request: DPRequest) -> dict[str, TableTuning]:
        """The tables' tuned bounds (none where the ledger does not answer: queries then
        tune their own, as they do for tables without)."""
        try:
            return await self.ledger.tunings()
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as e:
            log.warning("session %s: could not read the tuned bounds: %s", request.process_id,
                        type(e).__name__)
            return {}

    async def _paid(self, request: DPRequest, tuning: TableTuning) -> bool:
        """Whether the analyst has paid for `tuning` (since its last reset)."""
        try:
            return await self.ledger.paid(request.analyst, tuning.token)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as e:
            log.error("session %s: ledger unavailable: %s", request.process_id, e)
            raise LedgerUnavailable() from None

    async def local_function(self, request: DPRequest, st: Statement, dry_run: bool = False,
                             bind: p.Bind | None = None, param_types: Sequence[int] = ()) -> str:
        """Rewrite the statement with the function's result in place; returns SQL to relay.

        With `dry_run` nothing is changed (a reset is not done): the SQL only tells the
        columns, and an analyst name still unbound (`$1` before Bind) stands for the caller.
        """
        if st.protected:
            raise FeatureNotSupported("dp_budget(), dp_ledger() and the resets cannot be "
                                      "combined with protected tables")
        params = None
        if bind is not None:
            params = await self.preparer.bind_params(bind, param_types, request.codec,
                                                     request.encoding)
        stmt = parse_select(st.stripped_sql, params)
        replacer = LocalFunctions(self.ledger, request.analyst, request.admin, dry_run,
                                  sorted(self.config.total_budgets()), self.tuner)
        await replacer.resolve(stmt)
        replacer(stmt)
        return str(RawStream()(stmt))
