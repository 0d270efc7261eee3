"""Answer reuse (issue 31): a DP question asked again over unchanged data gets the answer already
released, at no cost, until a table it read changes or the answer expires."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from config import Config
from tests.support.backend import ON_CITUS, Backend
from tests.support.proxy import LoopThread, Proxy, reset_budget, running_proxy, spent

pytestmark = pytest.mark.skipif(ON_CITUS, reason="answers over distributed tables are not reused: "
                                                  "Citus takes no trigger on them (docs/citus.md)")

DASHBOARD = [
    "SELECT browser, COUNT(*) AS visits FROM visits GROUP BY browser ORDER BY browser",
    "SELECT country, AVG(duration) AS avg FROM visits GROUP BY country ORDER BY country",
    "SELECT COUNT(*) FROM visits",
    "SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.5) category, ANON_SUM(amount, 0, 100) AS s "
    "FROM purchases GROUP BY category ORDER BY category",
    "SELECT WITH ANONYMIZATION ANON_MEDIAN(duration, 0, 3600) AS m FROM visits",
]
"""Five charts: plain BI SQL, the ANON form, a quantile."""


def _proxy(loop_thread: LoopThread, config: Config, backend: Backend, reuse: str,
           hours: float = 24.0, clock_minutes: int = 60) -> Any:
    defaults = config.defaults.model_copy(update={"answer_reuse": reuse,
                                                  "answer_reuse_hours": hours,
                                                  "clock_granularity_minutes": clock_minutes})
    return running_proxy(loop_thread, config.model_copy(update={"defaults": defaults}), backend)


@pytest.fixture
def reusing(loop_thread: LoopThread, demo_config: Config, backend: Backend) -> Iterator[Proxy]:
    with _proxy(loop_thread, demo_config, backend, "analyst") as px:
        for analyst in ("alice", "bob"):
            reset_budget(px, analyst)
        _touch(backend, "visits")  # (answers kept by an earlier test are not reused)
        _touch(backend, "purchases")
        yield px


def _touch(backend: Backend, table: str, as_role: str | None = None) -> None:
    """A write to `table` that changes no row (its statement trigger fires all the same), as
    `as_role` if given (a writer with no privilege in the ledger schema)."""
    with psycopg.connect(backend.admin_dsn, autocommit=True) as admin:
        if as_role is not None:
            admin.execute(f"SET ROLE {as_role}")
        admin.execute(f"UPDATE {table} SET uid = uid WHERE false")


def _ask(conn: psycopg.Connection, sql: str,
         params: tuple[Any, ...] | None = None) -> tuple[list[tuple[Any, ...]], str]:
    notices: list[str] = []
    conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
    rows = conn.execute(sql, params).fetchall()
    conn._notice_handlers.clear()  # type: ignore[attr-defined]
    return rows, notices[-1] if notices else ""


def test_a_dashboard_refreshed_ten_times_costs_one_refresh(reusing: Proxy) -> None:
    with psycopg.connect(reusing.dsn(), autocommit=True) as conn:
        first = [_ask(conn, q) for q in DASHBOARD]
        cost = spent(conn).epsilon
        assert cost == pytest.approx(4.5)
        assert all(n.startswith("DP answer: spent") for _, n in first)
        for _ in range(10):
            again = [_ask(conn, q) for q in DASHBOARD]
            assert [rows for rows, _ in again] == [rows for rows, _ in first]
            assert all(n.startswith("DP answer reused: first released at ") and
                       "spent nothing" in n for _, n in again), again
        assert spent(conn).epsilon == pytest.approx(cost)
    with psycopg.connect(reusing.dsn("admin"), autocommit=True) as admin:
        kinds = admin.execute("SELECT kind, count(*) FROM (SELECT kind FROM dp_ledger('alice') "
                              "ORDER BY id DESC LIMIT 55) l GROUP BY kind ORDER BY kind").fetchall()
        assert kinds == [("charge", 5), ("reuse", 50)]


def test_a_change_to_a_table_read_ends_reuse(reusing: Proxy, backend: Backend) -> None:
    """A write to visits (by a role with no privilege in the ledger schema, changing no row:
    its statement trigger still notes it) ends the reuse of answers over visits, not of those
    over purchases; several writes and the compaction of their log keep the versions."""
    with psycopg.connect(backend.admin_dsn, autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS dp_test_writer")
        admin.execute("CREATE ROLE dp_test_writer")
        admin.execute("GRANT UPDATE, SELECT ON visits, purchases TO dp_test_writer")
    try:
        with psycopg.connect(reusing.dsn(), autocommit=True) as conn:
            visits, purchases = DASHBOARD[2], DASHBOARD[3]
            (v1, _), (p1, _) = _ask(conn, visits), _ask(conn, purchases)
            before = spent(conn).epsilon
            assert _ask(conn, visits)[0] == v1 and spent(conn).epsilon == before
            _touch(backend, "visits", as_role="dp_test_writer")
            _, notice = _ask(conn, visits)
            assert notice.startswith("DP answer: spent") and spent(conn).epsilon == before + 1
            assert _ask(conn, purchases)[0] == p1
            assert spent(conn).epsilon == before + 1  # (purchases unchanged: reused)
            for _ in range(3):
                _touch(backend, "visits", as_role="dp_test_writer")
            _ask(conn, visits)  # (charged; its answer kept, the log of visits compacted)
            with psycopg.connect(backend.admin_dsn) as admin:
                rows = admin.execute("SELECT count(*), sum(n) FROM dpproxy.data_changes "
                                     "WHERE relation = 'public.visits'").fetchone()
            assert rows is not None and rows[0] == 1
            charged = spent(conn).epsilon
            _ask(conn, visits)
            assert spent(conn).epsilon == charged  # (the compaction kept the version)
    finally:
        with psycopg.connect(backend.admin_dsn, autocommit=True) as admin:
            admin.execute("REVOKE ALL ON visits, purchases FROM dp_test_writer")
            admin.execute("DROP ROLE dp_test_writer")


def test_the_same_question_is_what_changes_the_answer(reusing: Proxy) -> None:
    """Spacing, comments and keyword case do not make another question; ε, the DP options,
    bound parameters and the constants do."""
    with psycopg.connect(reusing.dsn(), autocommit=True) as conn:
        q = "SELECT browser, COUNT(*) FROM visits WHERE duration > %s GROUP BY browser"
        _ask(conn, q, (10,))
        charged = spent(conn).epsilon
        _ask(conn, "select  browser, count(*)  -- the same\n from visits where duration > %s "
                   "group by browser", (10,))
        assert spent(conn).epsilon == charged
        for other, params in ((q, (11,)), (q.replace("> %s", "> 10"), None)):
            _ask(conn, other, params)
            assert spent(conn).epsilon == charged + 1
            charged += 1
        conn.execute("SET dp.epsilon = 0.5")
        _ask(conn, q, (10,))
        assert spent(conn).epsilon == charged + 0.5
        # the session's TimeZone: what its dates and date_trunc read
        day = ("SELECT COUNT(*) FROM visits WHERE date_trunc('day', now()) > "
               "now() - interval '400 days'")
        _ask(conn, day)
        _ask(conn, day)
        assert spent(conn).epsilon == charged + 1.0
        conn.execute("SET TimeZone = 'Asia/Tokyo'")
        _ask(conn, day)
        assert spent(conn).epsilon == charged + 1.5


def test_by_default_an_analyst_reuses_only_its_own_answers(
        reusing: Proxy, loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    sql = DASHBOARD[2]
    with psycopg.connect(reusing.dsn(), autocommit=True) as alice, \
            psycopg.connect(reusing.dsn("bob"), autocommit=True) as bob:
        rows, _ = _ask(alice, sql)
        _, notice = _ask(bob, sql)
        assert notice.startswith("DP answer: spent") and spent(bob).epsilon == 1.0
    reset_budget(reusing, "bob")
    _touch(backend, "visits")  # (alice's own answer is not reused: the next is kept for all)
    with _proxy(loop_thread, demo_config, backend, "all") as shared, \
            psycopg.connect(shared.dsn(), autocommit=True) as alice, \
            psycopg.connect(shared.dsn("bob"), autocommit=True) as bob:
        rows, _ = _ask(alice, sql)  # (kept for everyone now)
        assert _ask(bob, sql)[0] == rows
        assert spent(bob).epsilon == 0.0


def test_a_reused_answer_expires(loop_thread: LoopThread, demo_config: Config,
                                 backend: Backend) -> None:
    with _proxy(loop_thread, demo_config, backend, "analyst", hours=1.5 / 3600) as px:
        reset_budget(px)
        with psycopg.connect(px.dsn(), autocommit=True) as conn:
            sql = "SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.25) ANON_COUNT(*) FROM visits"
            _ask(conn, sql)
            _ask(conn, sql)
            assert spent(conn).epsilon == 0.25
            time.sleep(2)
            _ask(conn, sql)
            assert spent(conn).epsilon == 0.5


def _ask_detail(conn: psycopg.Connection, sql: str) -> str:
    """The detail of a DP answer's notice."""
    details: list[str] = []
    conn.add_notice_handler(lambda d: details.append(d.message_detail or ""))
    conn.execute(sql).fetchall()
    conn._notice_handlers.clear()  # type: ignore[attr-defined]
    return details[-1]


def test_relative_dates_ask_the_same_question_within_the_clocks_quantum(
        loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    """A chart of the last 400 days refreshed within the clock's quantum (a day here, so that
    the test does not straddle one) is the same question: reused, its notice saying when now()
    was read; with granularity 0 each refresh reads another now(), a new question."""
    sql = ("SELECT browser, COUNT(*) FROM visits WHERE now() - interval '400 days' < "
           "current_date GROUP BY browser")
    with _proxy(loop_thread, demo_config, backend, "analyst", clock_minutes=24 * 60) as px:
        reset_budget(px)
        _touch(backend, "visits")
        with psycopg.connect(px.dsn(), autocommit=True) as conn:
            conn.execute("SET TimeZone = 'Asia/Kolkata'")
            detail = _ask_detail(conn, sql)
            midnight = conn.execute("SELECT current_date::timestamptz::text").fetchone()
            assert midnight is not None
            assert f"now() read as {midnight[0]}, the start of its quantum of 1440 minutes" \
                in detail, detail
            _, notice = _ask(conn, sql)
            assert notice.startswith("DP answer reused") and spent(conn).epsilon == 1.0
    with _proxy(loop_thread, demo_config, backend, "analyst", clock_minutes=0) as px:
        reset_budget(px)
        with psycopg.connect(px.dsn(), autocommit=True) as conn:
            detail = _ask_detail(conn, sql)
            _ask(conn, sql)
            assert spent(conn).epsilon == 2.0 and "now() read as" not in detail


def test_reuse_off_answers_afresh(loop_thread: LoopThread, demo_config: Config,
                                  backend: Backend) -> None:
    with _proxy(loop_thread, demo_config, backend, "off") as px:
        reset_budget(px)
        with psycopg.connect(px.dsn(), autocommit=True) as conn:
            for _ in range(2):
                _ask(conn, DASHBOARD[2])
            assert spent(conn).epsilon == 2.0


def test_a_table_is_watched_only_while_its_trigger_fires_always(reusing: Proxy,
                                                                backend: Backend) -> None:
    """The version holds the trigger's catalog row: disabled (a write may go unseen), or
    enabled only for origin sessions (a restore in replica mode), the table is not watched;
    enabled ALWAYS again, its version is another (what was written in between is unknown),
    so an answer kept before is not reused."""
    with psycopg.connect(reusing.dsn(), autocommit=True) as conn, \
            psycopg.connect(backend.admin_dsn, autocommit=True) as admin:
        sql = "SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.25) ANON_COUNT(*) FROM visits"
        _ask(conn, sql)
        _ask(conn, sql)
        assert spent(conn).epsilon == 0.25
        try:
            admin.execute("ALTER TABLE visits DISABLE TRIGGER dp_data_change")
            _ask(conn, sql)
            admin.execute("ALTER TABLE visits ENABLE TRIGGER dp_data_change")  # (origin only)
            _ask(conn, sql)
            assert spent(conn).epsilon == 0.75  # (not watched: each answered afresh)
        finally:
            admin.execute("ALTER TABLE visits ENABLE ALWAYS TRIGGER dp_data_change")
        _ask(conn, sql)
        assert spent(conn).epsilon == 1.0  # (watched again, another version)
        _ask(conn, sql)
        assert spent(conn).epsilon == 1.0


def test_the_configured_meaning_is_part_of_the_question(
        reusing: Proxy, loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    """The same text over a table configured with other bounds is another question."""
    sql = "SELECT browser, AVG(duration) FROM visits GROUP BY browser"
    with psycopg.connect(reusing.dsn(), autocommit=True) as conn:
        _ask(conn, sql)
        assert spent(conn).epsilon == 1.0
    tables = dict(demo_config.tables)
    columns = dict(tables["visits"].columns)
    columns["duration"] = columns["duration"].model_copy(update={"upper": 1800.0})
    tables["visits"] = tables["visits"].model_copy(update={"columns": columns})
    other = demo_config.model_copy(update={"tables": tables})
    with _proxy(loop_thread, other, backend, "analyst") as px, \
            psycopg.connect(px.dsn(), autocommit=True) as conn:
        _, notice = _ask(conn, sql)
        assert notice.startswith("DP answer: spent") and spent(conn).epsilon == 2.0
