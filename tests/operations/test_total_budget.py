"""Total budgets (issue 31): every answer also charges the database's and each protected table's it
reads, shared by all analysts; no race of analysts and proxies overspends them."""

from __future__ import annotations

import asyncio
import threading
import time
from decimal import Decimal
from pathlib import Path

import asyncpg
import psycopg
import pytest

from config import DEMO_CONFIG, Config, load_config
from config.models import TotalBudgetConfig
from tests.operations.test_ledger_processes import ProxyProcess
from tests.support.backend import Backend
from tests.support.proxy import LoopThread, reset_budget, running_proxy, spent

VISITS = "SELECT WITH ANONYMIZATION OPTIONS(epsilon={e}) ANON_COUNT(*) FROM visits"
PURCHASES = "SELECT WITH ANONYMIZATION OPTIONS(epsilon={e}) ANON_COUNT(*) FROM purchases"


def _with_totals(config: Config) -> Config:
    tables = dict(config.tables)
    tables["visits"] = tables["visits"].model_copy(
        update={"total_budget": TotalBudgetConfig(epsilon=2, delta=1e-4)})
    return config.model_copy(update={"tables": tables,
                                     "total_budget": TotalBudgetConfig(epsilon=3, delta=1e-4)})


def test_answers_charge_the_total_budgets_of_what_they_read(
        loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    """The database's total and visits' are charged by every analyst's answers over visits;
    an answer over purchases only the database's. A refusal names the budget that ran out and
    charges nothing; dp_total_budgets() shows them; only an admin resets them, by scope."""
    with running_proxy(loop_thread, _with_totals(demo_config), backend) as px:
        with psycopg.connect(px.dsn("admin"), autocommit=True) as admin:
            admin.execute("SELECT dp_reset_total_budget(), "
                          "dp_reset_total_budget('public.visits')")
        for analyst in ("alice", "admin"):
            reset_budget(px, analyst)
        with psycopg.connect(px.dsn("alice"), autocommit=True) as alice, \
                psycopg.connect(px.dsn("admin"), autocommit=True) as admin:
            alice.execute(VISITS.format(e=1)).fetchall()
            admin.execute(VISITS.format(e=1)).fetchall()
            # visits' total (2) is spent, though alice has 9 left
            with pytest.raises(psycopg.errors.ConfigurationLimitExceeded) as info:
                alice.execute(VISITS.format(e=0.5)).fetchall()
            assert str(info.value).startswith("total privacy budget of public.visits (shared "
                                              "by all analysts) exhausted: epsilon spent 2 of 2")
            assert info.value.diag.message_hint is not None \
                and "dp_reset_total_budget('public.visits')" in info.value.diag.message_hint
            assert spent(alice).epsilon == 1.0  # (nothing charged)
            # purchases charge only the database's (3)
            alice.execute(PURCHASES.format(e=1)).fetchall()
            with pytest.raises(psycopg.errors.ConfigurationLimitExceeded) as info:
                admin.execute(PURCHASES.format(e=0.25)).fetchall()
            assert "total privacy budget of database" in str(info.value)
            # dp_budget(): the analyst's own, one row (DESIGN); dp_total_budgets(): the totals
            rows = alice.execute("SELECT analyst, epsilon_total, epsilon_spent, epsilon_remaining "
                                 "FROM dp_budget()").fetchall()
            assert rows == [("alice", Decimal(10), Decimal(2), Decimal(8))]
            rows = alice.execute("SELECT analyst, epsilon_total, epsilon_spent, epsilon_remaining "
                                 "FROM dp_total_budgets()").fetchall()
            assert rows == [("total:database", Decimal(3), Decimal(3), Decimal(0)),
                            ("total:public.visits", Decimal(2), Decimal(2), Decimal(0))]
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                alice.execute("SELECT dp_reset_total_budget('public.visits')")
            with pytest.raises(psycopg.errors.UndefinedObject):
                admin.execute("SELECT dp_reset_total_budget('public.nothing')")
            (text,), = admin.execute("SELECT dp_reset_total_budget('public.visits')").fetchall()
            assert text == "total budget of public.visits reset: epsilon 2, delta 0.0001 available"
            # the database's is still spent
            with pytest.raises(psycopg.errors.ConfigurationLimitExceeded):
                alice.execute(VISITS.format(e=0.5)).fetchall()
            admin.execute("SELECT dp_reset_total_budget()")
            alice.execute(VISITS.format(e=0.5)).fetchall()
            events = admin.execute("SELECT kind, outcome, by_admin FROM "
                                   "dp_ledger('total:public.visits') WHERE kind = 'reset' "
                                   "ORDER BY id DESC LIMIT 1").fetchall()
            assert events == [("reset", "total budget reset", "admin")]


async def _totals(backend: Backend) -> tuple[Decimal, Decimal]:
    """(the database total's spent, the charges since its last reset in the ledger)."""
    conn = await asyncpg.connect(backend.admin_dsn)
    try:
        spent_total = await conn.fetchval(
            "SELECT epsilon_spent FROM dpproxy.totals WHERE scope = 'database'")
        charged = await conn.fetchval(
            "SELECT coalesce(sum(epsilon), 0) FROM dpproxy.ledger WHERE kind = 'charge' AND id > "
            "(SELECT max(id) FROM dpproxy.ledger WHERE analyst = 'total:database' "
            "AND kind = 'reset')")
        return spent_total, charged
    finally:
        await conn.close()


def test_racing_analysts_and_proxies_never_overspend_the_total(backend: Backend,
                                                               tmp_path: Path) -> None:
    """The database's total is ε 6; alice and admin (ε 10 each) send 50 queries of ε 0.4
    through two proxy processes at once: exactly 15 are answered, the other 35 refused with
    53400, and the total's spent equals the ledger's charges since its reset."""
    extra = "\n[total_budget]\nepsilon = 6\ndelta = 1e-3\n"
    proxies = [ProxyProcess(backend, tmp_path, extra) for _ in range(2)]
    try:
        with psycopg.connect(proxies[0].dsn("admin"), autocommit=True) as admin:
            admin.execute("SELECT dp_reset_total_budget(), dp_reset_budget('alice'), "
                          "dp_reset_budget('admin')")
        answered: list[str] = []
        errors: list[str | None] = []

        def run(proxy: ProxyProcess, analyst: str) -> None:
            while True:  # (past an analyst's limits on sessions and DP queries at once: again)
                try:
                    with psycopg.connect(proxy.dsn(analyst), autocommit=True) as c:
                        c.execute(VISITS.format(e=0.4)).fetchall()
                        answered.append(analyst)
                        return
                except psycopg.Error as e:
                    if e.sqlstate != "53300" and "too many" not in str(e):
                        errors.append(e.sqlstate)
                        return
                time.sleep(0.05)

        threads = [threading.Thread(target=run, args=(proxies[i % 2], ("alice", "admin")[i % 3 % 2]))
                   for i in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(answered) == 15 and set(answered) == {"alice", "admin"}, (answered, errors)
        assert errors == ["53400"] * 35
        total_spent, charged = asyncio.run(_totals(backend))
        assert total_spent == charged == Decimal(6)
    finally:
        for px in proxies:
            px.stop()


def test_without_total_budgets_there_are_none_to_show(loop_thread: LoopThread,
                                                      demo_config: Config,
                                                      backend: Backend) -> None:
    with running_proxy(loop_thread, demo_config, backend) as px, \
            psycopg.connect(px.dsn(), autocommit=True) as conn:
        assert conn.execute("SELECT * FROM dp_total_budgets()").fetchall() == []
        assert conn.execute("SELECT dp_total_budgets()").fetchall() == [(None,)]
        assert len(conn.execute("SELECT * FROM dp_budget()").fetchall()) == 1


def test_a_ledger_of_a_newer_dp_proxy_is_refused(backend: Backend) -> None:
    """An older proxy on a ledger a newer one upgraded would charge without what the newer
    schema keeps (total budgets, say): it does not start."""
    from server.errors import LedgerTooNew
    from server.ledger import SCHEMA_VERSION, Ledger

    async def check() -> None:
        pool = await asyncpg.create_pool(backend.admin_dsn, min_size=1, max_size=2)
        assert pool is not None
        try:
            await pool.execute("DROP SCHEMA IF EXISTS dp_ledger_version_test CASCADE")
            await pool.execute("CREATE SCHEMA dp_ledger_version_test")
            ledger = Ledger(pool, "dp_ledger_version_test")
            config = load_config(DEMO_CONFIG, environ={})
            await ledger.migrate(config)
            await ledger.migrate(config)  # (idempotent)
            await pool.execute("INSERT INTO dp_ledger_version_test.schema_version VALUES ($1)",
                               SCHEMA_VERSION + 1)
            with pytest.raises(LedgerTooNew, match="upgrade dp-proxy"):
                await ledger.migrate(config)
        finally:
            await pool.execute("DROP SCHEMA IF EXISTS dp_ledger_version_test CASCADE")
            await pool.close()

    asyncio.run(check())
