"""Proxy-local statements (DP queries, dp.* settings, dp_budget()) inside transactions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg
import pytest

from server import wire as p
from tests.support.backend import TEST_DATABASE, Backend
from tests.support.proxy import Proxy, show, spent
from tests.support.rawclient import RawClient, errors

DP_COUNT = "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits"


@pytest.fixture
def conn(px: Proxy) -> Iterator[psycopg.Connection]:
    with psycopg.connect(px.dsn()) as c:  # not autocommit: psycopg opens a transaction
        yield c


@pytest.mark.parametrize("prepare", [False, True], ids=["simple", "extended"])
def test_an_error_of_the_proxys_own_aborts_the_block(px: Proxy, conn: psycopg.Connection,
                                                     prepare: bool) -> None:
    """As any error in Postgres: a refused statement (42501), a refused DP form (0A000) or a
    spent budget leaves the block failed (25P02 until ROLLBACK), on both protocols, and what
    the block did is rolled back."""
    for refused in ("SELECT * FROM visits", DP_COUNT + " GROUP BY uid"):
        conn.execute("SET LOCAL TIME ZONE 'Asia/Tokyo'")
        with pytest.raises(psycopg.Error):
            conn.execute(refused, prepare=prepare)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        with pytest.raises(psycopg.errors.InFailedSqlTransaction):
            conn.execute("SELECT 1", prepare=prepare)
        conn.rollback()
        assert conn.execute("SELECT 1").fetchone() == (1,)
        conn.rollback()


def test_an_error_of_the_proxys_own_rolls_back_its_pipeline(px: Proxy) -> None:
    """On the extended protocol outside a block, the statements up to Sync are one implicit
    transaction: a local error rolls back a SET before it in the same batch, as Postgres."""
    with psycopg.connect(px.dsn(), autocommit=True) as c:
        before = c.execute("SHOW TIME ZONE").fetchone()
        with pytest.raises(psycopg.errors.InsufficientPrivilege), c.pipeline():
            c.execute("SET TIME ZONE 'Asia/Tokyo'")
            c.execute("SELECT * FROM visits")
        assert c.execute("SHOW TIME ZONE").fetchone() == before
        c.execute("SET TIME ZONE 'Asia/Tokyo'")  # (alone, it lasts)
        assert c.execute("SHOW TIME ZONE").fetchone() == ("Asia/Tokyo",)


@pytest.mark.parametrize("first", ["SET dp.epsilon = 0.5", "SHOW dp.epsilon",
                                   "SET application_name = 'x'"])
def test_discard_all_behind_a_local_statement_in_a_pipeline_fails_as_in_postgres(
        px: Proxy, backend: Backend, first: str) -> None:
    """Postgres refuses DISCARD ALL in a pipeline after another statement (25001). The proxy
    answers SET / SHOW dp.* itself, so the backend runs a no-op in their place and sees the
    same pipeline; the batch fails, and the SET does not last. The same with a
    pass-through SET, through the proxy and against Postgres directly."""
    for dsn in (px.dsn(), backend.admin_dsn):
        if "dp." in first and dsn == backend.admin_dsn:
            continue
        with psycopg.connect(dsn, autocommit=True) as c:
            with pytest.raises(psycopg.errors.ActiveSqlTransaction), c.pipeline():
                c.execute(first)
                c.execute("DISCARD ALL")
            if dsn == px.dsn():
                assert c.execute("SHOW dp.epsilon").fetchone() == ("1.0",)
            assert c.execute("SELECT 1").fetchone() == (1,)  # (the session goes on)
            c.execute(first)  # alone, then DISCARD ALL alone: both run
            c.execute("DISCARD ALL")


@pytest.mark.parametrize("prepare", [False, True], ids=["simple", "extended"])
def test_a_dp_query_in_a_failed_transaction_is_refused_before_the_charge(
        px: Proxy, conn: psycopg.Connection, prepare: bool) -> None:
    """Postgres refuses every statement in a failed transaction (25P02); a DP query there was
    charged and then had its answer refused by the backend."""
    conn.execute("SELECT 1")
    with pytest.raises(psycopg.errors.DivisionByZero):
        conn.execute("SELECT 1/0")
    for sql in (DP_COUNT, "SHOW dp.epsilon", "SET dp.epsilon = 0.5", "SELECT * FROM dp_budget()"):
        with pytest.raises(psycopg.errors.InFailedSqlTransaction):
            conn.execute(sql, prepare=prepare)
    assert spent(px).epsilon == 0.0
    conn.rollback()
    (n,) = conn.execute(DP_COUNT, prepare=prepare).fetchone()
    assert n > 100 and spent(px).epsilon == 1.0


def test_a_dp_answer_in_a_transaction_stays_charged_after_rollback(
        px: Proxy, conn: psycopg.Connection) -> None:
    conn.execute("SELECT 1")
    (n,) = conn.execute(DP_COUNT).fetchone()
    assert n > 100
    conn.rollback()  # the answer was released: its cost is spent whatever happens to the block
    assert spent(px).epsilon == 1.0


@pytest.mark.parametrize(("statements", "after"), [
    (["BEGIN", "SET dp.epsilon = 0.5", "ROLLBACK"], "1.0"),
    (["BEGIN", "SET dp.epsilon = 0.5", "COMMIT"], "0.5"),
    (["BEGIN", "SET dp.epsilon = 0.5", "END"], "0.5"),
    (["BEGIN", "SET LOCAL dp.epsilon = 0.5", "COMMIT"], "1.0"),
    (["BEGIN", "SET dp.epsilon = 0.5", "SET LOCAL dp.epsilon = 0.25", "COMMIT"], "0.5"),
    (["BEGIN", "SET dp.epsilon = 0.5", "RESET dp.epsilon", "ROLLBACK"], "1.0"),
    (["SET dp.epsilon = 0.5", "BEGIN", "RESET dp.epsilon", "ROLLBACK"], "0.5"),
    # a failed block ends in a rollback whatever ends it
    (["BEGIN", "SET dp.epsilon = 0.5", "SELECT 1/0", "COMMIT"], "1.0"),
    # COMMIT AND CHAIN commits and opens another block, which rolls back alone
    (["BEGIN", "SET dp.epsilon = 0.5", "COMMIT AND CHAIN", "SET dp.epsilon = 0.25",
      "ROLLBACK"], "0.5"),
    # several statements in one Query (split by the proxy)
    (["BEGIN; SET dp.epsilon = 0.5; ROLLBACK"], "1.0"),
    # ... in one implicit block when none is open: an error rolls back what came before it
    (["SET dp.epsilon = 0.5; SELECT 1/0"], "1.0"),
    (["SET dp.epsilon = 0.5; SELECT 1; SHOW dp.epsilon"], "0.5"),
    (["SELECT 1; SET dp.epsilon = 0.5; SELECT 1/0; SET dp.epsilon = 0.25"], "1.0"),
    (["SET LOCAL dp.epsilon = 0.5; SHOW dp.epsilon"], "1.0"),
    (["SET dp.epsilon = 0.5", "RESET ALL; SELECT 1/0"], "0.5"),
    (["SET dp.epsilon = 0.5", "RESET ALL; SHOW dp.epsilon"], "1.0"),
    (["BEGIN", "SET dp.epsilon = 0.5; SELECT 1/0", "ROLLBACK"], "1.0"),
    # transaction commands inside an implicit block, as Postgres answers them (found by
    # tests/fuzz/test_fuzz_settings.py)
    (["SET dp.epsilon = 0.5; SAVEPOINT a"], "1.0"),
    (["SET dp.epsilon = 0.5; COMMIT; SET dp.epsilon = 0.25; SELECT 1/0"], "0.5"),
    (["SET dp.epsilon = 0.5; ROLLBACK; SHOW dp.epsilon"], "1.0"),
    (["SET LOCAL dp.epsilon = 0.5; BEGIN ISOLATION LEVEL REPEATABLE READ; SHOW dp.epsilon",
      "COMMIT"], "1.0"),
    (["SET dp.epsilon = 0.5; START TRANSACTION; SELECT 1/0", "ROLLBACK"], "1.0"),
    (["SET dp.epsilon = 0.5; COMMIT AND CHAIN"], "1.0"),
    # a block ended and another begun in one Query the proxy forwards whole
    (["BEGIN", "SET dp.epsilon = 0.5", "ROLLBACK; BEGIN", "COMMIT"], "1.0"),
    (["BEGIN", "SET dp.epsilon = 0.5", "ROLLBACK; COMMIT"], "1.0"),
    (["BEGIN", "SET dp.epsilon = 0.5", "COMMIT; BEGIN; ROLLBACK"], "0.5"),
    # COMMIT AND CHAIN of a failed block rolls it back
    (["BEGIN", "SET dp.epsilon = 0.5", "SELECT 1/0", "COMMIT AND CHAIN", "COMMIT"], "1.0"),
    (["BEGIN; SET dp.epsilon = 0.5; COMMIT; BEGIN; SET LOCAL dp.epsilon = 0.25; COMMIT"], "0.5"),
    # savepoints
    (["BEGIN", "SET dp.epsilon = 0.5", "SAVEPOINT a", "SET dp.epsilon = 0.25", "ROLLBACK TO a",
      "COMMIT"], "0.5"),
    (["BEGIN", "SAVEPOINT a", "SET dp.epsilon = 0.5", "ROLLBACK TO SAVEPOINT a", "COMMIT"],
     "1.0"),
    (["BEGIN", "SET dp.epsilon = 0.5", "SAVEPOINT a", "SET dp.epsilon = 0.25", "RELEASE a",
      "COMMIT"], "0.25"),
    (["BEGIN", "SET dp.epsilon = 0.5", "SAVEPOINT a", "SET LOCAL dp.epsilon = 0.25",
      "ROLLBACK TO a", "SET LOCAL dp.epsilon = 2.0", "RELEASE SAVEPOINT a", "COMMIT"], "0.5"),
    (["BEGIN", "SET dp.epsilon = 0.5", "SAVEPOINT a", "SET dp.epsilon = 0.25", "SAVEPOINT b",
      "SET dp.epsilon = 2.0", "ROLLBACK TO b", "RELEASE a", "COMMIT"], "0.25"),
    (["BEGIN", "SET dp.epsilon = 0.5", "SAVEPOINT a", "SET dp.epsilon = 0.25", "SAVEPOINT b",
      "SET dp.epsilon = 2.0", "ROLLBACK TO a", "COMMIT"], "0.5"),
    # the same name twice: the newer one hides the older until released
    (["BEGIN", "SET dp.epsilon = 0.5", "SAVEPOINT a", "SET dp.epsilon = 0.25", "SAVEPOINT a",
      "SET dp.epsilon = 2.0", "ROLLBACK TO a", "RELEASE a", "ROLLBACK TO a", "COMMIT"], "0.5"),
    (["BEGIN", "SAVEPOINT a", "SET dp.epsilon = 0.5", "SAVEPOINT a", "SET dp.epsilon = 0.25",
      "RELEASE a", "ROLLBACK TO a", "COMMIT"], "1.0"),
    # a failed block brought back by ROLLBACK TO
    (["BEGIN", "SET dp.epsilon = 0.5", "SAVEPOINT a", "SET dp.epsilon = 0.25", "SELECT 1/0",
      "ROLLBACK TO a", "COMMIT"], "0.5"),
    (["BEGIN", "SET dp.epsilon = 0.5", "SAVEPOINT a", "SELECT 1/0", "ROLLBACK", ], "1.0"),
    # ROLLBACK AND CHAIN rolls back and opens another block
    (["BEGIN", "SET dp.epsilon = 0.5", "ROLLBACK AND CHAIN", "SET dp.epsilon = 0.25",
      "COMMIT"], "0.25"),
    (["BEGIN", "SET dp.epsilon = 0.5", "ABORT AND CHAIN", "COMMIT"], "1.0"),
    (["BEGIN; SET dp.epsilon = 0.5; SAVEPOINT a; SET dp.epsilon = 0.25; ROLLBACK TO a; COMMIT"],
     "0.5"),
    (["BEGIN; SET dp.epsilon = 0.5; SAVEPOINT a; SET dp.epsilon = 0.25; RELEASE a",
      "ROLLBACK AND CHAIN; COMMIT"], "1.0"),
])
def test_dp_settings_follow_the_transaction_block(
        px: Proxy, backend: Backend, statements: list[str], after: str) -> None:
    """As any Postgres setting: a SET inside a block lasts if it commits, a SET LOCAL until the
    block ends, and ROLLBACK TO SAVEPOINT undoes what was set since the savepoint. Checked
    after every statement against Postgres itself, on a setting of its own (ref.epsilon)."""
    with psycopg.connect(px.dsn(), autocommit=True) as conn, \
            psycopg.connect(backend.admin_dsn, autocommit=True,
                            options="-c ref.epsilon=1.0") as ref:
        assert show(conn) == "1.0"
        for sql in statements:
            seen = []
            for c, name in ((conn, "dp.epsilon"), (ref, "ref.epsilon")):
                with contextlib.suppress(psycopg.errors.DivisionByZero,
                                         psycopg.errors.NoActiveSqlTransaction):
                    c.execute(sql.replace("dp.epsilon", name))
                status = c.info.transaction_status
                seen.append(status.name if status == psycopg.pq.TransactionStatus.INERROR
                            else show(c, name))
            assert seen[0] == seen[1], (sql, seen)
        assert show(conn) == after
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_set_local_applies_inside_the_block_and_warns_outside(px: Proxy) -> None:
    notices: list[tuple[str | None, str | None]] = []
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append((d.severity, d.sqlstate)))
        conn.execute("SET LOCAL dp.epsilon = 0.5")
        assert notices == [("WARNING", "25P01")]
        assert show(conn) == "1.0"
        conn.execute("BEGIN")
        conn.execute("SET LOCAL dp.epsilon = 0.25")
        assert show(conn) == "0.25"
        conn.execute(DP_COUNT)  # charged at the block's setting
        conn.execute("COMMIT")
        assert show(conn) == "1.0"
    assert spent(px).epsilon == 0.25


def test_dp_settings_in_driver_transactions(px: Proxy) -> None:
    """psycopg opens blocks itself (and prepares statements): the same rules."""
    with psycopg.connect(px.dsn()) as conn:
        conn.execute("SET dp.epsilon = 0.5", prepare=True)
        conn.rollback()
        assert show(conn) == "1.0"
        conn.execute("SET dp.epsilon = 0.5", prepare=True)
        conn.commit()
        assert show(conn) == "0.5"
        conn.execute("SET LOCAL dp.epsilon = 0.25")
        (n,) = conn.execute(DP_COUNT, prepare=True).fetchone()
        assert n > 100
        conn.commit()
        assert show(conn) == "0.5"
    assert spent(px).epsilon == 0.25


def test_dp_settings_in_driver_savepoints(px: Proxy) -> None:
    """psycopg's nested transaction() blocks are savepoints."""
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        with conn.transaction():
            conn.execute("SET dp.epsilon = 0.5")
            with contextlib.suppress(ZeroDivisionError), conn.transaction():
                conn.execute("SET dp.epsilon = 0.25")
                assert show(conn) == "0.25"
                raise ZeroDivisionError  # rolls back to the savepoint
            assert show(conn) == "0.5"
            with conn.transaction():
                conn.execute("SET LOCAL dp.epsilon = 0.25", prepare=True)
            assert show(conn) == "0.25"
            (n,) = conn.execute(DP_COUNT, prepare=True).fetchone()
            assert n > 100
        assert show(conn) == "0.5"
    assert spent(px).epsilon == 0.25


def test_a_savepoint_prepared_by_name_before_any_dp_setting(px: Proxy) -> None:
    """psycopg prepares a statement by name after its fifth run (SQLAlchemy's savepoint names
    recur from block to block): prepared while no dp.* setting had changed, it still counts
    when it runs in a block where one has."""
    with psycopg.connect(px.dsn(), autocommit=True, prepare_threshold=0) as conn:
        conn.execute("BEGIN")
        conn.execute("SAVEPOINT sp1")  # prepared here (psycopg forgets all at a ROLLBACK)
        conn.execute("RELEASE sp1")
        conn.execute("COMMIT")
        conn.execute("BEGIN")
        conn.execute("SET dp.epsilon = 0.5")
        conn.execute("SAVEPOINT sp1")  # the prepared statement, run again
        conn.execute("SET dp.epsilon = 0.25")
        conn.execute("ROLLBACK TO sp1")
        assert show(conn) == "0.5"
        conn.execute("COMMIT")
        assert show(conn) == "0.5"


def test_a_failed_savepoint_block_is_rolled_back_by_the_driver(px: Proxy) -> None:
    """psycopg rolls a failed nested block back to its savepoint (a Describe and an Execute of
    ROLLBACK TO in the failed block, which Postgres allows)."""
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        with conn.transaction():
            conn.execute("SET dp.epsilon = 0.5")
            with pytest.raises(psycopg.errors.DivisionByZero), conn.transaction():
                conn.execute("SET dp.epsilon = 0.25")
                conn.execute("SELECT 1/0")
            assert show(conn) == "0.5"
            (n,) = conn.execute(DP_COUNT).fetchone()
            assert n > 100
        assert show(conn) == "0.5"
    assert spent(px).epsilon == 0.5


def test_rollback_to_in_a_failed_block_on_the_extended_protocol(px: Proxy) -> None:
    """Postgres parses, binds, describes and runs a ROLLBACK TO in a failed block (it returns
    no rows); so does the proxy when it follows one."""
    c = RawClient(px.host, px.port)
    c.login("alice", "alice", TEST_DATABASE)
    try:
        c.send(p.Query("BEGIN; SET dp.epsilon = 0.5; SAVEPOINT a; SET dp.epsilon = 0.25"))
        assert errors(c.recv_until_ready()) == []
        c.send(p.Query("SELECT 1/0"))
        assert errors(c.recv_until_ready()) == ["22012"]
        c.send(p.Parse("", "ROLLBACK TO a"), p.Bind("", "", (), (), ()), p.Describe(b"P", ""),
               p.Execute("", 0), p.Sync())
        msgs = c.recv_until_ready()
        assert errors(msgs) == [] and isinstance(msgs[-1], p.ReadyForQuery), msgs
        assert msgs[-1].status == b"T"
        c.send(p.Query("SHOW dp.epsilon"))
        rows = [m.values for m in c.recv_until_ready() if isinstance(m, p.DataRow)]
        assert rows == [(b"0.5",)]
    finally:
        c.close()


@pytest.mark.parametrize("statements", [
    ["BEGIN", "SET dp.epsilon = 0.5", "COMMIT"],
    ["BEGIN", "SET dp.epsilon = 0.5", "SELECT 1/0", "ROLLBACK"],
    ["SET dp.epsilon = 0.5; SELECT 1"],
])
def test_the_relay_stops_watching_when_the_block_ends(px: Proxy, statements: list[str]) -> None:
    """While dp.* settings have changed in an open block the relay reads every reply (to
    see how the block ends); it goes back to its fast path as soon as the block has ended,
    not at the next dp.* statement (pass-through traffic would stay on the slow path)."""
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        (pid,) = conn.execute("SELECT pg_backend_pid()").fetchone()  # (the restricted role's)
        session = next(s for s in px.server.sessions
                       if s.link is not None and s.link.key and s.link.key[0] == pid)
        for sql in statements:
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                conn.execute(sql)
        assert session.link is not None and not session.link.watch_tx
