"""The privacy-budget ledger, in the backend Postgres: limits, running totals, one row per event.

A charge is one transaction that locks the analyst's row, then the rows of the total
budgets the answer also charges (the database's, each protected table's it reads: shared
by all analysts, locked in name order, so that two charges never wait for each other in
turn), checks `spent + cost <= limit` for each in exact `numeric` arithmetic, adds the
cost and appends the ledger row, and commits before the pushdown runs: an answer is
never released uncharged, and concurrent queries (from any number of proxy processes
sharing the ledger) cannot spend past any limit. Resets are appended events, never
deletions; a total budget's events name it as their subject ("total:database").
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import asyncpg

from config import Accountant, Config
from dp_core.accounting import AnswerCost, rdp_total
from dp_core.budget import TOTAL, Budget, check_affordable, to_numeric
from dp_core.errors import InsufficientPrivilege, UndefinedObject
from dp_core.table_tuning import TableTuning
from server.backend_setup import quote_ident
from server.errors import LedgerTooNew

SCHEMA_VERSION = 4
TUNED = "tuned:"
"""The ledger subject of a table's tuning events (a drop), and the prefix of its tokens."""
BUDGET_COLUMNS = ["analyst", "epsilon_total", "epsilon_spent", "epsilon_remaining", "delta_total",
                  "delta_spent", "delta_remaining"]
LEDGER_COLUMNS = ["id", "at", "kind", "epsilon", "delta", "outcome", "fingerprint", "query",
                  "mechanisms", "by_admin"]


@dataclass(frozen=True)
class OnceCost:
    """A cost each analyst pays once, with the first answer that needs it (`Ledger.charge`)."""

    token: str
    """What its payment is recorded under (the ledger row's fingerprint)."""
    cost: AnswerCost
    outcome: str
    """What the ledger row says it paid for."""


@dataclass(frozen=True)
class Charged:
    """A charge made: the answer's ledger row, and the once-costs it paid with it."""

    ledger_id: int
    paid_once: tuple[OnceCost, ...] = ()


def fingerprint(sql: str) -> str:
    """A stable identifier of the query's shape (pglast's fingerprint, hashed text as fallback)."""
    from pglast.parser import fingerprint as pg_fingerprint

    try:
        return str(pg_fingerprint(sql))
    except Exception:
        return hashlib.sha256(sql.encode()).hexdigest()[:16]


LEDGER_QUERY_CHARS = 20_000
"""The most characters of a query's text the ledger keeps (`logged_text`): refusals and reused
answers cost nothing, and each 30 MB query (a comment of random text) appended 30 MB the
append-only ledger could never shed, about 22 MB a second from one session (red team,
session 32)."""


def logged_text(sql: str) -> str:
    """`sql` as the ledger keeps it: whole up to LEDGER_QUERY_CHARS characters, else their
    first ones, its length and a SHA-256 of the whole."""
    if len(sql) <= LEDGER_QUERY_CHARS:
        return sql
    digest = hashlib.sha256(sql.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{sql[:LEDGER_QUERY_CHARS]} [... {len(sql)} characters in all, sha256 {digest}]"


class Ledger:
    """Ledger operations over the ledger role's own pool (no analyst SQL runs as that role)."""

    def __init__(self, pool: asyncpg.Pool, schema: str,
                 refresh_days: Mapping[str, int | None] | None = None) -> None:
        self.pool = pool
        self.s = quote_ident(schema)
        self.refresh_days = dict(refresh_days or {})
        """Analysts whose budget renews itself, and after how many days."""

    async def _refresh_if_due(self, conn: Any, analyst: str) -> None:
        """Inside a transaction holding the analyst's row lock: renew the budget if its period
        has passed since the last reset (or since the analyst was added)."""
        days = self.refresh_days.get(analyst)
        if not days:
            return
        s = self.s
        due = await conn.fetchval(
            f"SELECT coalesce((SELECT max(at) FROM {s}.ledger WHERE analyst = $1 AND kind = 'reset'), "
            f"(SELECT created_at FROM {s}.analysts WHERE analyst = $1)) "
            "<= now() - make_interval(days => $2)", analyst, days)
        if due:
            await conn.execute(f"UPDATE {s}.analysts SET epsilon_spent = 0, delta_spent = 0, "
                               "updated_at = now() WHERE analyst = $1", analyst)
            await conn.execute(
                f"INSERT INTO {s}.ledger (analyst, kind, outcome, by_admin) "
                f"VALUES ($1, 'reset', 'budget renewed: refresh period of {int(days)} days', "
                "'refresh period')", analyst)

    async def migrate(self, config: Config, totals: bool = True) -> None:
        """Create or upgrade the schema (idempotent) and load the analysts' limits from the
        config, and the total budgets' unless `totals` is False (a reload: they take effect at
        the next start)."""
        s = self.s
        async with self.pool.acquire() as conn, conn.transaction():
            # (bounded: a lock held elsewhere fails this migration, 55P03, rather than hold up
            # every reload behind it)
            await conn.execute("SET LOCAL lock_timeout = '60s'")
            await conn.execute("SELECT pg_advisory_xact_lock(hashtext('dp-proxy ledger migration'))")
            await conn.execute(f"CREATE TABLE IF NOT EXISTS {s}.schema_version (version int NOT NULL)")
            version = await conn.fetchval(f"SELECT max(version) FROM {s}.schema_version")
            if version is not None and version > SCHEMA_VERSION:
                # (an older proxy would charge an answer without what the newer schema keeps:
                # total budgets, say)
                raise LedgerTooNew(f"the ledger's schema is version {version}, newer than this "
                                   f"dp-proxy's ({SCHEMA_VERSION}): upgrade dp-proxy")
            if version is None:
                await conn.execute(f"""
                    CREATE TABLE {s}.analysts (
                        analyst text PRIMARY KEY,
                        epsilon_total numeric NOT NULL CHECK (epsilon_total >= 0),
                        delta_total numeric NOT NULL CHECK (delta_total >= 0),
                        epsilon_spent numeric NOT NULL DEFAULT 0,
                        delta_spent numeric NOT NULL DEFAULT 0,
                        created_at timestamptz NOT NULL DEFAULT now(),
                        updated_at timestamptz NOT NULL DEFAULT now())""")
                await conn.execute(f"""
                    CREATE TABLE {s}.ledger (
                        id bigserial PRIMARY KEY,
                        at timestamptz NOT NULL DEFAULT clock_timestamp(),
                        analyst text NOT NULL,
                        kind text NOT NULL CHECK (kind IN ('charge', 'reset', 'refused', 'limits')),
                        epsilon numeric NOT NULL DEFAULT 0,
                        delta numeric NOT NULL DEFAULT 0,
                        outcome text NOT NULL,
                        fingerprint text,
                        query text,
                        mechanisms jsonb,
                        by_admin text)""")
                await conn.execute(f"CREATE INDEX ledger_analyst_at ON {s}.ledger (analyst, at)")
                # append-only: the table refuses UPDATE and DELETE, whoever asks
                await conn.execute(f"""
                    CREATE FUNCTION {s}.ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS
                    $$BEGIN RAISE EXCEPTION 'the privacy ledger is append-only'; END$$""")
                await conn.execute(f"""
                    CREATE TRIGGER ledger_append_only BEFORE UPDATE OR DELETE ON {s}.ledger
                    FOR EACH STATEMENT EXECUTE FUNCTION {s}.ledger_append_only()""")
                await conn.execute(f"INSERT INTO {s}.schema_version VALUES (1)")
                version = 1
            if version < 2:  # total budgets, shared by all analysts
                await conn.execute(f"""
                    CREATE TABLE {s}.totals (
                        scope text PRIMARY KEY,
                        epsilon_total numeric NOT NULL CHECK (epsilon_total >= 0),
                        delta_total numeric NOT NULL CHECK (delta_total >= 0),
                        epsilon_spent numeric NOT NULL DEFAULT 0,
                        delta_spent numeric NOT NULL DEFAULT 0,
                        created_at timestamptz NOT NULL DEFAULT now(),
                        updated_at timestamptz NOT NULL DEFAULT now())""")
                await conn.execute(f"INSERT INTO {s}.schema_version VALUES (2)")
            if version < 3:  # answers released, reused while their tables have not changed
                await conn.execute(f"""
                    CREATE TABLE {s}.answers (
                        key text NOT NULL,
                        analyst text NOT NULL,
                        released_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                        expires_at timestamptz NOT NULL,
                        versions jsonb NOT NULL,
                        result text NOT NULL,
                        detail text,
                        ledger_id bigint NOT NULL,
                        PRIMARY KEY (key, analyst))""")
                await conn.execute(f"CREATE INDEX answers_expires ON {s}.answers (expires_at)")
                await conn.execute(f"ALTER TABLE {s}.ledger DROP CONSTRAINT ledger_kind_check")
                await conn.execute(
                    f"ALTER TABLE {s}.ledger ADD CONSTRAINT ledger_kind_check CHECK "
                    "(kind IN ('charge', 'reset', 'refused', 'limits', 'reuse'))")
                await conn.execute(f"INSERT INTO {s}.schema_version VALUES (3)")
            if version < 4:  # bounds an admin tuned per table (`dp_core.table_tuning`)
                await conn.execute(f"""
                    CREATE TABLE {s}.tuned_bounds (
                        table_name text PRIMARY KEY,
                        tuning jsonb NOT NULL,
                        ledger_id bigint NOT NULL,
                        tuned_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                        by_admin text NOT NULL)""")
                await conn.execute(f"INSERT INTO {s}.schema_version VALUES (4)")
        # the limits in a transaction of their own, analysts' rows then totals' in name order,
        # as a charge locks them (an analyst's row, then totals' in scope order): no cycle
        async with self.pool.acquire() as conn, conn.transaction():
            for name, a in sorted(config.analysts.items()):
                await self._set_limits(conn, "analysts", "analyst", name, name,
                                       a.epsilon_budget, a.delta_budget,
                                       "limits set from the configuration")
            for scope, total in sorted(config.total_budgets().items()) if totals else ():
                await self._set_limits(conn, "totals", "scope", scope, TOTAL + scope,
                                       total.epsilon, total.delta,
                                       "total limits set from the configuration")

    async def _set_limits(self, conn: Any, table: str, column: str, key: str, subject: str,
                          epsilon: float, delta: float, outcome: str) -> None:
        """Set the limits of `key`'s row of `table` (made if absent); where they change, a
        'limits' event of `subject` is appended to the ledger."""
        s = self.s
        eps, dlt = decimal.Decimal(repr(epsilon)), decimal.Decimal(repr(delta))
        changed = await conn.fetchval(f"""
            INSERT INTO {s}.{table} AS t ({column}, epsilon_total, delta_total)
            VALUES ($1, $2, $3)
            ON CONFLICT ({column}) DO UPDATE SET epsilon_total = EXCLUDED.epsilon_total,
                delta_total = EXCLUDED.delta_total, updated_at = now()
            WHERE t.epsilon_total <> EXCLUDED.epsilon_total
               OR t.delta_total <> EXCLUDED.delta_total
            RETURNING true""", key, eps, dlt)
        if changed:
            await conn.execute(
                f"INSERT INTO {s}.ledger (analyst, kind, outcome, mechanisms) "
                "VALUES ($1, 'limits', $2, $3)", subject, outcome,
                json.dumps({"epsilon_total": str(eps), "delta_total": str(dlt)}))

    async def budget(self, analyst: str, conn: Any = None) -> Budget:
        if conn is None:
            async with self.pool.acquire() as own:
                return await self.budget(analyst, own)
        if self.refresh_days.get(analyst):
            async with conn.transaction():
                await conn.execute(f"SELECT 1 FROM {self.s}.analysts WHERE analyst = $1 FOR UPDATE",
                                   analyst)
                await self._refresh_if_due(conn, analyst)
        row = await conn.fetchrow(
            f"SELECT analyst, epsilon_total, epsilon_spent, delta_total, delta_spent "
            f"FROM {self.s}.analysts WHERE analyst = $1", analyst)
        if row is None:
            raise UndefinedObject(f'analyst "{analyst}" has no budget')
        return Budget(row[0], row[1], row[2], row[3], row[4])

    async def totals(self, scopes: Sequence[str] | None = None, conn: Any = None) -> list[Budget]:
        """The total budgets of `scopes` (every one in the ledger when None), by scope."""
        rows = await (conn or self.pool).fetch(
            f"SELECT scope, epsilon_total, epsilon_spent, delta_total, delta_spent "
            f"FROM {self.s}.totals WHERE $1::text[] IS NULL OR scope = ANY($1::text[]) "
            "ORDER BY scope", None if scopes is None else list(scopes))
        return [Budget(TOTAL + r[0], r[1], r[2], r[3], r[4]) for r in rows]

    async def charge(self, analyst: str, cost: AnswerCost, sql: str,
                     mechanisms: Mapping[str, Any], conn: Any = None,
                     accountant: Accountant = Accountant.BASIC,
                     scopes: Sequence[str] = (), once: Sequence[OnceCost] = (),
                     token: str | None = None) -> Charged:
        """Debit the answer or raise BudgetExhausted (53400, nothing charged).

        Basic composition adds the cost exactly; the RDP accountant recomputes the
        analyst's totals from the history since the last reset. The total budgets of
        `scopes` are charged the cost as basic composition adds it (all analysts' answers
        together). `once`: costs each analyst pays once (since its last reset), with the
        first answer that needs them (a table's tuned bounds), each its own ledger row under
        its token; the total budgets paid them when they were made. Pass `conn` when the
        caller already holds a pool connection (never wait for a second one while holding
        the first: that deadlocks a busy pool). `token`: the charge is recorded under it, not
        the query's fingerprint (the admin's payment of a table's tuning, made once).
        """
        if conn is None:
            async with self.pool.acquire() as own:
                return await self.charge(analyst, cost, sql, mechanisms, own, accountant, scopes,
                                         once, token)
        s = self.s
        mechanisms = {**mechanisms, "cost": cost.to_json(), "accountant": accountant.value}
        async with conn.transaction():
            row = await conn.fetchrow(
                f"SELECT epsilon_total, epsilon_spent, delta_total, delta_spent "
                f"FROM {s}.analysts WHERE analyst = $1 FOR UPDATE", analyst)
            if row is None:
                raise UndefinedObject(f'analyst "{analyst}" has no budget')
            if self.refresh_days.get(analyst):
                await self._refresh_if_due(conn, analyst)
                row = await conn.fetchrow(
                    f"SELECT epsilon_total, epsilon_spent, delta_total, delta_spent "
                    f"FROM {s}.analysts WHERE analyst = $1", analyst)
            unpaid = [o for o in once if not await self._paid(conn, analyst, o.token)]
            costs = [o.cost for o in unpaid] + [cost]
            eps = sum((to_numeric(c.epsilon) for c in costs), decimal.Decimal(0))
            dlt = sum((to_numeric(c.delta) for c in costs), decimal.Decimal(0))
            e_total, e_spent, d_total, d_spent = row
            budget = Budget(analyst, e_total, e_spent, d_total, d_spent)
            if accountant is Accountant.RDP:
                history = await self._history(conn, analyst)
                new_eps, new_dlt = rdp_total([*history, *costs])
                spent_eps = decimal.Decimal(repr(new_eps))
                spent_dlt = decimal.Decimal(repr(new_dlt))
                check_affordable(budget, max(spent_eps - e_spent, decimal.Decimal(0)),
                                 max(spent_dlt - d_spent, decimal.Decimal(0)))
                await conn.execute(
                    f"UPDATE {s}.analysts SET epsilon_spent = $2, delta_spent = $3, "
                    f"updated_at = now() WHERE analyst = $1", analyst, spent_eps, spent_dlt)
            else:
                check_affordable(budget, eps, dlt)
                await conn.execute(
                    f"UPDATE {s}.analysts SET epsilon_spent = epsilon_spent + $2, "
                    f"delta_spent = delta_spent + $3, updated_at = now() WHERE analyst = $1",
                    analyst, eps, dlt)
            if scopes:
                totals = await conn.fetch(
                    f"SELECT scope, epsilon_total, epsilon_spent, delta_total, delta_spent "
                    f"FROM {s}.totals WHERE scope = ANY($1::text[]) ORDER BY scope FOR UPDATE",
                    sorted(scopes))
                if len(totals) != len(set(scopes)):
                    raise UndefinedObject("a total budget of the configuration is not in the "
                                          "ledger (this is a bug)")
                own_eps, own_dlt = to_numeric(cost.epsilon), to_numeric(cost.delta)
                for r in totals:
                    check_affordable(Budget(TOTAL + r[0], r[1], r[2], r[3], r[4]), own_eps,
                                     own_dlt)
                await conn.execute(
                    f"UPDATE {s}.totals SET epsilon_spent = epsilon_spent + $2, "
                    f"delta_spent = delta_spent + $3, updated_at = now() "
                    f"WHERE scope = ANY($1::text[])", sorted(scopes), own_eps, own_dlt)
            for o in unpaid:
                await conn.execute(
                    f"INSERT INTO {s}.ledger (analyst, kind, epsilon, delta, outcome, "
                    f"fingerprint, query, mechanisms) VALUES ($1, 'charge', $2, $3, $4, $5, "
                    "NULL, $6)", analyst, to_numeric(o.cost.epsilon), to_numeric(o.cost.delta),
                    o.outcome, o.token, json.dumps({"cost": o.cost.to_json(),
                                                    "accountant": accountant.value}))
            ledger_id: int = await conn.fetchval(
                f"INSERT INTO {s}.ledger (analyst, kind, epsilon, delta, outcome, fingerprint, "
                f"query, mechanisms) VALUES ($1, 'charge', $2, $3, 'charged', $4, $5, $6) "
                "RETURNING id",
                analyst, to_numeric(cost.epsilon), to_numeric(cost.delta),
                fingerprint(sql) if token is None else token, logged_text(sql),
                json.dumps(mechanisms))
        return Charged(ledger_id, tuple(unpaid))

    async def paid(self, analyst: str, token: str) -> bool:
        """Whether the analyst paid the cost recorded under `token` since its last reset."""
        async with self.pool.acquire() as conn:
            return await self._paid(conn, analyst, token)

    async def _paid(self, conn: Any, analyst: str, token: str) -> bool:
        """Whether the analyst paid the cost recorded under `token` since its last reset."""
        return bool(await conn.fetchval(
            f"SELECT EXISTS (SELECT 1 FROM {self.s}.ledger WHERE analyst = $1 AND kind = "
            f"'charge' AND fingerprint = $2 AND id > coalesce((SELECT max(id) FROM "
            f"{self.s}.ledger WHERE analyst = $1 AND kind = 'reset'), 0))", analyst, token))

    async def _history(self, conn: Any, analyst: str) -> list[AnswerCost]:
        """The costs of the analyst's answers since the last reset."""
        rows = await conn.fetch(
            f"SELECT mechanisms FROM {self.s}.ledger WHERE analyst = $1 AND kind = 'charge' AND id > "
            f"coalesce((SELECT max(id) FROM {self.s}.ledger WHERE analyst = $1 AND kind = 'reset'), 0) "
            "ORDER BY id", analyst)
        out = []
        for (mech,) in rows:
            data = json.loads(mech) if isinstance(mech, str) else mech
            out.append(AnswerCost.from_json(data["cost"]))
        return out

    async def record(self, analyst: str, outcome: str, sql: str, conn: Any = None) -> None:
        """Append an uncharged event (a refused or failed query) for the audit trail."""
        await (conn or self.pool).execute(
            f"INSERT INTO {self.s}.ledger (analyst, kind, outcome, fingerprint, query) "
            "VALUES ($1, 'refused', $2, $3, $4)", analyst, outcome[:500], fingerprint(sql),
            logged_text(sql))

    async def record_reuse(self, analyst: str, sql: str, released: str) -> None:
        """Append the event of an answer given again (no cost) for the audit trail."""
        await self.pool.execute(
            f"INSERT INTO {self.s}.ledger (analyst, kind, outcome, fingerprint, query) "
            "VALUES ($1, 'reuse', $2, $3, $4)", analyst,
            f"answer reused (first released at {released})", fingerprint(sql), logged_text(sql))

    async def reset(self, analyst: str, by_admin: str) -> Budget:
        s = self.s
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(
                f"UPDATE {s}.analysts SET epsilon_spent = 0, delta_spent = 0, updated_at = now() "
                "WHERE analyst = $1 RETURNING analyst, epsilon_total, epsilon_spent, delta_total, "
                "delta_spent", analyst)
            if row is None:
                raise UndefinedObject(f'analyst "{analyst}" does not exist')
            await conn.execute(
                f"INSERT INTO {s}.ledger (analyst, kind, outcome, by_admin) "
                "VALUES ($1, 'reset', 'budget reset', $2)", analyst, by_admin)
        return Budget(row[0], row[1], row[2], row[3], row[4])

    async def reset_total(self, scope: str, by_admin: str) -> Budget:
        s = self.s
        async with self.pool.acquire() as conn, conn.transaction():
            row = await conn.fetchrow(
                f"UPDATE {s}.totals SET epsilon_spent = 0, delta_spent = 0, updated_at = now() "
                "WHERE scope = $1 RETURNING scope, epsilon_total, epsilon_spent, delta_total, "
                "delta_spent", scope)
            if row is None:
                raise UndefinedObject(f'there is no total budget "{scope}"',
                                      hint="the total budgets are \"database\" and "
                                           "\"schema.table\" of protected tables that have one")
            await conn.execute(
                f"INSERT INTO {s}.ledger (analyst, kind, outcome, by_admin) "
                "VALUES ($1, 'reset', 'total budget reset', $2)", TOTAL + scope, by_admin)
        return Budget(TOTAL + row[0], row[1], row[2], row[3], row[4])

    async def store_tuning(self, tuning: TableTuning, by_admin: str) -> TableTuning:
        """Keep a table's tuned bounds (in place of any before), as the ledger dates them."""
        row = await self.pool.fetchrow(
            f"INSERT INTO {self.s}.tuned_bounds AS t (table_name, tuning, ledger_id, by_admin) "
            "VALUES ($1, $2, $3, $4) ON CONFLICT (table_name) DO UPDATE SET tuning = "
            "EXCLUDED.tuning, ledger_id = EXCLUDED.ledger_id, by_admin = EXCLUDED.by_admin, "
            "tuned_at = clock_timestamp() RETURNING tuned_at", tuning.table,
            json.dumps(tuning.to_json()), tuning.ledger_id, by_admin)
        return replace(tuning, tuned_at=ledger_time(row[0]))

    async def tunings(self) -> dict[str, TableTuning]:
        """The tables' tuned bounds, by schema.table."""
        rows = await self.pool.fetch(
            f"SELECT tuning::text, tuned_at, ledger_id FROM {self.s}.tuned_bounds")
        out = {}
        for tuning, at, ledger_id in rows:
            t = TableTuning.from_json(json.loads(tuning), ledger_time(at), int(ledger_id))
            out[t.table] = t
        return out

    async def drop_tuning(self, table: str, by_admin: str) -> bool:
        """Forget a table's tuned bounds (later queries tune their own again); an event of
        the table's tuning in the ledger. False: it had none."""
        async with self.pool.acquire() as conn, conn.transaction():
            gone = await conn.fetchval(f"DELETE FROM {self.s}.tuned_bounds WHERE table_name = $1 "
                                       "RETURNING ledger_id", table)
            if gone is None:
                return False
            await conn.execute(
                f"INSERT INTO {self.s}.ledger (analyst, kind, outcome, by_admin) "
                "VALUES ($1, 'limits', $2, $3)", TUNED + table,
                f"tuned bounds of {table} (ledger #{gone}) dropped", by_admin)
        return True

    async def entries(self, analyst: str) -> list[tuple[Any, ...]]:
        rows = await self.pool.fetch(
            f"SELECT id, at, kind, epsilon, delta, outcome, fingerprint, query, mechanisms::text, "
            f"by_admin FROM {self.s}.ledger WHERE analyst = $1 ORDER BY id", analyst)
        return [tuple(r) for r in rows]


def ledger_time(at: Any) -> str:
    """A ledger time as the notices print it."""
    return str(at.astimezone(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"))


def require_admin(is_admin: bool, function: str) -> None:
    if not is_admin:
        raise InsufficientPrivilege(f"{function}() is for admins only")
