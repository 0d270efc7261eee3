"""Bounds an admin tunes once per table (issue 30): dp_tune_bounds() charges the admin and the
table's total budgets, later plain queries of that table use them at no ε of their own, and
each analyst pays the tuning's ε once, with the first answer that uses it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg
import pytest

from config import Config
from config.models import TotalBudgetConfig
from tests.support.backend import Backend
from tests.support.proxy import LoopThread, Proxy, reset_budget, running_proxy, spent

GROUPED = "SELECT browser, COUNT(*), SUM(duration), AVG(duration) FROM visits GROUP BY browser"


def _notices(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    got: list[tuple[str, str]] = []
    conn.add_notice_handler(lambda d: got.append((d.message_primary or "",
                                                  d.message_detail or "")))
    return got


@pytest.fixture
def dropped(proxy: Proxy) -> Iterator[None]:
    """visits without tuned bounds before and after the test (the ledger is the suite's)."""
    def drop() -> None:
        with psycopg.connect(proxy.dsn("admin"), autocommit=True) as admin:
            admin.execute("SELECT dp_drop_tuned_bounds('visits')")
    drop()
    try:
        yield
    finally:
        drop()


def test_an_admin_tunes_a_table_and_each_analyst_pays_once(proxy: Proxy, dropped: None) -> None:
    for who in ("alice", "bob", "admin"):
        reset_budget(proxy, who)
    with psycopg.connect(proxy.dsn("admin"), autocommit=True) as admin:
        before = spent(admin).epsilon
        row = admin.execute("SELECT * FROM dp_tune_bounds('visits', 0.2)").fetchone()
        assert row is not None
        names = [d.name for d in admin.execute(
            "SELECT * FROM dp_tuned_bounds()").description or ()]
        table, t_rows, t_means, t_sums, clips, rows_cut, users_cut, groups, eps, ledger_id, \
            at = row
        assert names[:2] == ["table_name", "max_rows_contributed"]
        assert table == "public.visits" and groups == 1 and Decimal(eps) == Decimal("0.2")
        assert 1 <= t_means <= t_rows and 1 <= t_sums <= t_rows
        assert re.fullmatch(r"duration \[0, [0-9.e+]+\] \(about [0-9.e+-]+% of its value beyond\)",
                            clips), clips
        assert 0 <= rows_cut <= 1 and 0 <= users_cut <= 1 and at.endswith("UTC")
        # the admin paid it (and only it), as one charge recorded under the tuning's token
        assert spent(admin).epsilon == pytest.approx(before + 0.2)
        kinds = admin.execute("SELECT id, kind, epsilon, fingerprint FROM dp_ledger('admin') "
                              "ORDER BY id DESC LIMIT 1").fetchone()
        assert kinds is not None and kinds[0] == ledger_id and kinds[1] == "charge" \
            and float(kinds[2]) == 0.2 and kinds[3].startswith("tuned:public.visits:")
        listed = admin.execute("SELECT table_name, max_rows_contributed FROM "
                               "dp_tuned_bounds()").fetchall()
        assert listed == [("public.visits", t_rows)]
        # the admin's own queries use it without paying again
        admin.execute(GROUPED).fetchall()
        assert spent(admin).epsilon == pytest.approx(before + 1.2)

    with psycopg.connect(proxy.dsn("bob"), autocommit=True) as bob:
        bob.execute("SET dp.epsilon = 0.3")  # (bob's budget is 1)
        # EXPLAIN spends nothing: bob has not paid, so it shows no tuned value
        plan = "\n".join(r[0] for r in bob.execute("EXPLAIN " + GROUPED).fetchall())
        assert "when run: max_rows_contributed and the clips from the bounds an admin tuned " \
               "for public.visits" in plan, plan
        assert "chosen per query (below)" in plan and f"T {t_rows};" not in plan
        assert "Cost charged when run: epsilon 0.3, delta 1e-06, and once the tuned bounds' " \
               "epsilon (below)" in plan, plan
        notices = _notices(bob)
        bob.execute("SELECT COUNT(*) FROM visits").fetchall()
        assert spent(bob).epsilon == pytest.approx(0.5)  # 0.3 + the tuning's 0.2, once
        message, detail = notices[-1]
        assert "spent epsilon 0.3, delta" in message \
            and "(and epsilon 0.2 once for tuned bounds)" in message, message
        # (T chosen again for this query's noise from the stored statistics: post-processing)
        assert re.search(r"max_rows_contributed chose \d+ rows per user(, \d+ for \w+)* \(from "
                         rf"the bounds an admin tuned for public.visits \(ledger #{ledger_id}",
                         detail), detail
        bob.execute("SELECT SUM(duration) FROM visits WHERE browser <> 'x'").fetchall()
        assert spent(bob).epsilon == pytest.approx(0.8)  # paid once: the query's ε alone
        assert "once for tuned bounds" not in notices[-1][0]
        # without GROUP BY: T and the clip chosen for this query's noise, shown
        plan = "\n".join(r[0] for r in bob.execute(
            "EXPLAIN SELECT SUM(duration), AVG(duration) FROM visits").fetchall())
        assert re.search(r"max_rows_contributed T \d+;", plan), plan
        assert "sum: each row's value clamped to [0, 3600]; each user's mean in a group " \
               "clamped to [0, " in plan, plan
        assert "none of this query's epsilon goes to choosing them" in plan
        assert "max_rows_contributed from DP statistics" not in plan  # no tuning share
        # grouped: T and the clip chosen once the groups are selected, from the same statistics
        plan = "\n".join(r[0] for r in bob.execute("EXPLAIN " + GROUPED).fetchall())
        assert "T chosen per query (below)" in plan and "none of this query's epsilon" in plan
        assert "chosen after partition selection from the statistics of the table's tuned " \
               "bounds" in plan, plan
        assert "each user's mean in a group clamped to a clip within it" in plan, plan
        assert "max_rows_contributed from DP statistics" not in plan  # no tuning share
        bob.execute("SET dp.epsilon = 0.2")
        bob.execute(GROUPED).fetchall()
        assert spent(bob).epsilon == pytest.approx(1.0)  # the query's ε alone
        assert re.search(r"max_rows_contributed chose \d+ rows per user(, \d+ for [\w ]+)* "
                         rf"\(from the bounds an admin tuned for public.visits \(ledger "
                         rf"#{ledger_id}", notices[-1][1]), notices[-1][1]
        assert re.search(r"sum: each user's mean in a group clipped to \[0, [0-9.e+]+\]",
                         notices[-1][1]), notices[-1][1]
        # a query that fixes T, or reads another table, does not use them
        bob.execute("SET dp.max_rows_contributed = 3")
        plan = "\n".join(r[0] for r in bob.execute("EXPLAIN " + GROUPED).fetchall())
        assert "T 3;" in plan and "admin tuned" not in plan
        bob.execute("RESET dp.max_rows_contributed")
        plan = "\n".join(r[0] for r in bob.execute(
            "EXPLAIN SELECT category, SUM(amount) FROM purchases GROUP BY category").fetchall())
        assert "admin tuned" not in plan and "max_rows_contributed from DP statistics" in plan

    # after a reset, the next answer pays it again
    reset_budget(proxy, "bob")
    with psycopg.connect(proxy.dsn("bob"), autocommit=True) as bob:
        bob.execute("SET dp.epsilon = 0.3")
        bob.execute("SELECT COUNT(*) FROM visits").fetchall()
        assert spent(bob).epsilon == pytest.approx(0.5)

    # dropped: per-query tuning again
    with psycopg.connect(proxy.dsn("admin"), autocommit=True) as admin:
        (msg,) = admin.execute("SELECT dp_drop_tuned_bounds('public.visits')").fetchone() or ("",)
        assert msg == "tuned bounds of public.visits dropped"
        assert admin.execute("SELECT * FROM dp_tuned_bounds()").fetchall() == []
    with psycopg.connect(proxy.dsn("bob"), autocommit=True) as bob:
        plan = "\n".join(r[0] for r in bob.execute("EXPLAIN " + GROUPED).fetchall())
        assert "admin tuned" not in plan and "max_rows_contributed from DP statistics" in plan
    for who in ("alice", "bob", "admin"):
        reset_budget(proxy, who)


def test_tuning_is_for_admins_and_refuses_bad_arguments(proxy: Proxy, dropped: None) -> None:
    reset_budget(proxy, "admin")
    with psycopg.connect(proxy.dsn("bob"), autocommit=True) as bob:
        for sql in ("SELECT * FROM dp_tune_bounds('visits')", "SELECT * FROM dp_tuned_bounds()",
                    "SELECT dp_drop_tuned_bounds('visits')"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                bob.execute(sql)
    with psycopg.connect(proxy.dsn("admin"), autocommit=True) as admin:
        for sql, error in (
                ("SELECT * FROM dp_tune_bounds('nosuch')", psycopg.errors.UndefinedTable),
                ("SELECT * FROM dp_tune_bounds('app.visits')", psycopg.errors.UndefinedTable),
                ("SELECT * FROM dp_tune_bounds('countries')", psycopg.errors.UndefinedTable),
                ("SELECT * FROM dp_tune_bounds('visits', -1)",
                 psycopg.errors.InvalidParameterValue),
                ("SELECT * FROM dp_tune_bounds('visits', 1e9)",
                 psycopg.errors.InvalidParameterValue),
                ("SELECT * FROM dp_tune_bounds('visits', 'x')",
                 psycopg.errors.InvalidParameterValue),
                ("SELECT * FROM dp_tune_bounds('visits', 0.1, 0)",
                 psycopg.errors.InvalidParameterValue),
                ("SELECT * FROM dp_tune_bounds('visits', 0.1, 2.5)",
                 psycopg.errors.InvalidParameterValue),
                ("SELECT * FROM dp_tune_bounds()", psycopg.errors.FeatureNotSupported),
                ("SELECT * FROM dp_tune_bounds(NULL)", psycopg.errors.FeatureNotSupported),
                ("SELECT * FROM dp_tuned_bounds('visits')", psycopg.errors.FeatureNotSupported)):
            with pytest.raises(error):
                admin.execute(sql)
        assert spent(admin).epsilon == 0.0, "a refused tuning charges nothing"
        assert admin.execute("SELECT * FROM dp_tuned_bounds()").fetchall() == []
        # a parameter (drivers bind them), as text
        row = admin.execute("SELECT table_name, epsilon FROM dp_tune_bounds(%s, %s)",
                            ("visits", "0.05")).fetchone()
        assert row == ("public.visits", Decimal("0.05"))
        assert spent(admin).epsilon == pytest.approx(0.05)
    reset_budget(proxy, "admin")


def test_tuning_charges_the_tables_total_budget_once(loop_thread: LoopThread,
                                                     demo_config: Config,
                                                     backend: Backend) -> None:
    """The tuning is one release, whoever reads it: the table's and the database's total
    budgets pay it when it is made; each analyst's first answer with it pays it on their own
    budget only (the totals are charged the answer's ε alone)."""
    tables = dict(demo_config.tables)
    tables["visits"] = tables["visits"].model_copy(
        update={"total_budget": TotalBudgetConfig(epsilon=50, delta=1e-2)})
    config = demo_config.model_copy(update={"tables": tables})
    with running_proxy(loop_thread, config, backend) as px, \
            psycopg.connect(px.dsn("admin"), autocommit=True) as admin:
        admin.execute("SELECT dp_reset_total_budget('public.visits')")
        admin.execute("SELECT dp_drop_tuned_bounds('visits')")
        for who in ("alice", "admin"):
            reset_budget(px, who)

        def total() -> float:
            rows = admin.execute("SELECT analyst, epsilon_spent FROM "
                                 "dp_total_budgets()").fetchall()
            return float(dict(rows)["total:public.visits"])

        try:
            admin.execute("SELECT * FROM dp_tune_bounds('visits', 0.3)").fetchall()
            assert total() == pytest.approx(0.3)
            with psycopg.connect(px.dsn("alice"), autocommit=True) as alice:
                alice.execute("SELECT COUNT(*) FROM visits").fetchall()
                assert spent(alice).epsilon == pytest.approx(1.3)
            assert total() == pytest.approx(1.3)  # alice's answer: its own ε
        finally:
            admin.execute("SELECT dp_drop_tuned_bounds('visits')")
            admin.execute("SELECT dp_reset_total_budget('public.visits')")
            for who in ("alice", "admin"):
                reset_budget(px, who)


def test_tuned_bounds_answer_the_demo_count_closely(proxy: Proxy, dropped: None,
                                                    backend: Backend) -> None:
    """With the table tuned at ε = 0.5, `SELECT count(*) FROM visits` is within 10% of the
    true count (T from the whole table's DP statistics). (At the default tuning ε, a tenth
    of the default ε split over its statistics, the histogram's noise chooses T too small
    for this in about a third of the runs: a table's tuning is worth more ε than one
    query's share.)"""
    reset_budget(proxy, "admin")
    reset_budget(proxy)
    with psycopg.connect(proxy.dsn("admin"), autocommit=True) as admin:
        admin.execute("SELECT * FROM dp_tune_bounds('visits', 0.5)").fetchall()
    with psycopg.connect(backend.admin_dsn, autocommit=True) as raw:
        (true,) = raw.execute("SELECT count(*) FROM visits").fetchone() or (0,)
    with psycopg.connect(proxy.dsn(), autocommit=True) as alice:
        (got,) = alice.execute("SELECT count(*) FROM visits").fetchone() or (0,)
    assert abs(got - true) <= 0.1 * true, (got, true)
    reset_budget(proxy, "admin")
    reset_budget(proxy)


def test_shared_answer_reuse_does_not_skip_the_once_cost(loop_thread: LoopThread,
                                                         demo_config: Config,
                                                         backend: Backend) -> None:
    """With answer_reuse = "all", another analyst's answer that used tuned bounds shows them:
    an analyst who has not paid for them gets an answer of its own, and pays once."""
    defaults = demo_config.defaults.model_copy(update={"answer_reuse": "all"})
    config = demo_config.model_copy(update={"defaults": defaults})
    with running_proxy(loop_thread, config, backend) as px, \
            psycopg.connect(px.dsn("admin"), autocommit=True) as admin:
        admin.execute("SELECT dp_drop_tuned_bounds('visits')")
        for who in ("alice", "bob", "admin"):
            reset_budget(px, who)
        try:
            admin.execute("SELECT * FROM dp_tune_bounds('visits', 0.1)").fetchall()
            with psycopg.connect(px.dsn("alice"), autocommit=True) as alice:
                alice.execute("SET dp.epsilon = 0.3")
                alice.execute("SELECT COUNT(*) FROM visits").fetchall()
                assert spent(alice).epsilon == pytest.approx(0.4)
            with psycopg.connect(px.dsn("bob"), autocommit=True) as bob:
                bob.execute("SET dp.epsilon = 0.3")
                bob.execute("SELECT COUNT(*) FROM visits").fetchall()
                assert spent(bob).epsilon == pytest.approx(0.4)  # not alice's answer, free
                bob.execute("SELECT COUNT(*) FROM visits").fetchall()
                assert spent(bob).epsilon == pytest.approx(0.4)  # paid: reused, at no cost
        finally:
            admin.execute("SELECT dp_drop_tuned_bounds('visits')")
            for who in ("alice", "bob", "admin"):
                reset_budget(px, who)


@pytest.mark.parametrize(("sql", "after_selection", "clipped"), [
    (GROUPED, True, True),
    # filtered: T after selection, no clip (its values may lie anywhere in the range)
    ("SELECT browser, COUNT(*), SUM(duration) FROM visits WHERE duration > 10 GROUP BY browser",
     True, False),
    ("SELECT COUNT(*), SUM(duration) FROM visits", False, True),  # no groups to select
    # COUNT(DISTINCT x)'s sums do not add up over bins: T chosen when planned
    ("SELECT country, COUNT(*), COUNT(DISTINCT browser) FROM visits GROUP BY country",
     False, False),
])
def test_which_grouped_queries_of_a_tuned_table_choose_t_after_selection(
        proxy: Proxy, dropped: None, sql: str, after_selection: bool, clipped: bool) -> None:
    """The admin has paid (tuning it): EXPLAIN shows what a run does. Grouped queries whose
    groups τ-thresholding selects choose T (and the clips, for all the table's rows) once
    the groups are released; the others when planned (EXPLAIN shows T), as do grouped ones
    under truncated-geometric selection (which releases no noisy user count)."""
    reset_budget(proxy, "admin")
    with psycopg.connect(proxy.dsn("admin"), autocommit=True) as admin:
        admin.execute("SELECT * FROM dp_tune_bounds('visits', 0.2)").fetchall()
        plan = "\n".join(r[0] for r in admin.execute("EXPLAIN " + sql).fetchall())
        assert "admin tuned" in plan, plan
        assert ("chosen after partition selection" in plan) == after_selection, plan
        assert (re.search(r"max_rows_contributed T \d+;", plan) is None) == after_selection
        assert ("each user's mean in a group clamped to" in plan) == clipped, plan
        if after_selection:
            rows = admin.execute(sql).fetchall()
            assert rows and spent(admin).epsilon == pytest.approx(1.2)
            admin.execute("SET dp.partition_selection = 'truncated_geometric'")
            plan = "\n".join(r[0] for r in admin.execute("EXPLAIN " + sql).fetchall())
            assert "chosen after partition selection" not in plan, plan
            assert re.search(r"max_rows_contributed T \d+;", plan), plan
    reset_budget(proxy, "admin")
