"""An admin's tuning of a protected table's contribution bounds: charged, measured, stored.

`SELECT * FROM dp_tune_bounds('visits' [, epsilon [, groups]])` (admins only): the
statistics per-query tuning reads (`dp_core.table_tuning.tuning_sql`'s query over the whole
table), with Laplace noise for `epsilon` (a tenth of the default ε unless given), charged
to the admin and to the table's and the database's total budgets before the statement reads
a row; the choice is kept in the ledger's schema, where later queries find it
(`DPService` passes it to the preparer) and each analyst pays `epsilon` once, with the
first answer that uses it. A failure after the charge stays charged and says nothing of
the data. `dp_drop_tuned_bounds('visits')` forgets it: queries tune their own again.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import replace
from fractions import Fraction
from typing import Any

import asyncpg

from config import Accountant, Config
from dp_core.accounting import AnswerCost
from dp_core.analysis import analyze, parse_select
from dp_core.catalogue import NUMBER_TYPES
from dp_core.errors import DPError, InvalidParameterValue, UndefinedTable
from dp_core.mechanisms import secure_rng
from dp_core.plan import TUNING_SHARE, check_noise_scales, make_plan
from dp_core.query import TablePolicy
from dp_core.rewrite import tuning_statement
from dp_core.table_tuning import TableTuning, table_tuning, tuning_sql, with_tuning_epsilon
from dp_core.tuning import tune_rows
from server.backend_setup import quote_ident
from server.dp_query.prepare import planning_error
from server.dp_query.run import PushdownRunner
from server.ledger import TUNED, Ledger

log = logging.getLogger("dp_proxy.dp")

MAX_TUNING_GROUPS = 1 << 20
"""The most groups an admin may ask the noise of T to be weighed over."""


class TuningFailed(DPError):
    """A charged tuning failed while running: one generic message, nothing about data."""

    sqlstate = "XX000"

    def __init__(self) -> None:
        super().__init__("the tuning failed after it was charged (its cost stays spent); "
                         "the error says nothing about the data")


class TableTuner:
    """Tunes protected tables' bounds for admins (`dp_tune_bounds`)."""

    def __init__(self, config: Config, policy: dict[str, TablePolicy], runner: PushdownRunner,
                 ledger: Ledger) -> None:
        self.config = config
        self.policy = policy
        self.runner = runner
        self.ledger = ledger

    def table(self, name: str) -> tuple[str, str]:
        """(configured name, schema.table) of the protected table `name` ("t" or "s.t")."""
        schema, _, table = name.rpartition(".")
        t = self.config.tables.get(table)
        if t is None or (schema and schema != t.schema_):
            raise UndefinedTable(f'"{name}" is not a protected table',
                                 hint="the protected tables are " + ", ".join(
                                     f"{c.schema_}.{n}" for n, c in
                                     sorted(self.config.tables.items())))
        return table, f"{t.schema_}.{table}"

    def epsilon(self, asked: float | None) -> Fraction:
        d = self.config.defaults
        if asked is None:
            return Fraction(repr(d.epsilon)) * TUNING_SHARE
        if not (d.min_epsilon <= asked <= d.max_epsilon_per_query):
            raise InvalidParameterValue(
                f"dp_tune_bounds: epsilon {asked:g} is outside [{d.min_epsilon:g}, "
                f"{d.max_epsilon_per_query:g}]", hint="the tuning's epsilon is charged once to "
                "the admin, the table's total budgets and each analyst")
        return Fraction(repr(float(asked)))

    async def tune(self, admin: str, name: str, epsilon: float | None,
                   groups: int | None) -> TableTuning:
        table, qualified = self.table(name)
        eps = self.epsilon(epsilon)
        g = 1 if groups is None else groups
        if not 1 <= g <= MAX_TUNING_GROUPS:
            raise InvalidParameterValue(f"dp_tune_bounds: groups {g} is outside [1, "
                                        f"{MAX_TUNING_GROUPS}]")
        policy = self.policy[table]
        d = self.config.defaults
        async with self.runner.pool.acquire() as conn:
            types = await self._numeric_columns(conn, policy, table)
            columns = sorted(types)
            query = analyze(parse_select(tuning_sql(policy.schema, table, columns)),
                            self.policy, plain_form=True)
            arg_types = {i: types[columns[(i - 1) // 2]] for i in range(1, len(query.aggregates))}
            plan = make_plan(query, d.epsilon, d.delta, d.max_groups_contributed, d.noise)
            plan = with_tuning_epsilon(plan, eps)
            check_noise_scales(query, plan)
            sql = tuning_statement(query, plan, arg_types, secrets.randbits(63))
            try:
                await conn.prepare(sql)  # (its planning errors cost nothing)
            except asyncpg.PostgresError as e:
                raise planning_error(e) from None
            token = f"{TUNED}{qualified}:{secrets.token_hex(8)}"
            names = {q.name for q in plan.tuning}  # (the statistics are all it releases)
            mechanisms = {n: m for n, m in plan.mechanisms().items() if n in names}
            analyst = self.config.analysts.get(admin)
            charged = await self.ledger.charge(
                admin, AnswerCost(eps, Fraction(0)), f"SELECT dp_tune_bounds('{qualified}')",
                {"tuned_bounds": {"table": qualified, "groups": g, "epsilon": str(eps)},
                 **mechanisms}, scopes=self.config.total_scopes([qualified]), token=token,
                accountant=Accountant.BASIC if analyst is None else analyst.accountant)
            try:
                rows = await self.runner.fetch_alone(conn, sql)
                tuned = tune_rows(plan, rows, secure_rng(), query, known_groups=g)
            except Exception as e:  # (charged: one generic error, whatever failed)
                log.warning("tuning of %s failed after its charge: %s", qualified,
                            type(e).__name__)
                raise TuningFailed() from None
        stored = table_tuning(qualified, token, eps, query, policy, tuned, g)
        return await self.ledger.store_tuning(replace(stored, ledger_id=charged.ledger_id),
                                              admin)

    async def _numeric_columns(self, conn: Any, policy: TablePolicy,
                               table: str) -> dict[str, str]:
        """The table's bounded columns of a numeric type, with their type names."""
        rows = await conn.fetch(
            "SELECT a.attname, t.typname FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_type "
            "t ON t.oid = a.atttypid WHERE a.attrelid = pg_catalog.to_regclass($1) AND "
            "a.attnum > 0 AND NOT a.attisdropped AND a.attname = ANY($2::text[])",
            f"{quote_ident(policy.schema)}.{quote_ident(table)}", list(policy.columns))
        return {str(r[0]): str(r[1]) for r in rows if str(r[1]) in NUMBER_TYPES}
