"""Proxy-local statements (DP queries, dp.* settings, dp_budget()) inside transactions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg
import pytest

from .conftest import Proxy, reset_budget

DP_COUNT = "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits"


@pytest.fixture
def px(proxy: Proxy) -> Proxy:
    reset_budget(proxy)
    return proxy


@pytest.fixture
def conn(px: Proxy) -> Iterator[psycopg.Connection]:
    with psycopg.connect(px.dsn()) as c:  # not autocommit: psycopg opens a transaction
        yield c


def _spent(px: Proxy) -> float:
    with psycopg.connect(px.dsn(), autocommit=True) as other:
        (spent,) = other.execute("SELECT epsilon_spent FROM dp_budget()").fetchone()
    return float(spent)


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
    assert _spent(px) == 0.0
    conn.rollback()
    (n,) = conn.execute(DP_COUNT, prepare=prepare).fetchone()
    assert n > 100 and _spent(px) == 1.0


def test_a_dp_answer_in_a_transaction_stays_charged_after_rollback(
        px: Proxy, conn: psycopg.Connection) -> None:
    conn.execute("SELECT 1")
    (n,) = conn.execute(DP_COUNT).fetchone()
    assert n > 100
    conn.rollback()  # the answer was released: its cost is spent whatever happens to the block
    assert _spent(px) == 1.0


def _show(conn: psycopg.Connection) -> str:
    (value,) = conn.execute("SHOW dp.epsilon").fetchone()
    return str(value)


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
    (["BEGIN; SET dp.epsilon = 0.5; COMMIT; BEGIN; SET LOCAL dp.epsilon = 0.25; COMMIT"], "0.5"),
])
def test_dp_settings_follow_the_transaction_block(
        px: Proxy, statements: list[str], after: str) -> None:
    """As any Postgres setting: a SET inside a block lasts if it commits, a SET LOCAL until the
    block ends."""
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        assert _show(conn) == "1.0"
        for sql in statements:
            with contextlib.suppress(psycopg.errors.DivisionByZero):
                conn.execute(sql)
        assert _show(conn) == after
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_set_local_applies_inside_the_block_and_warns_outside(px: Proxy) -> None:
    notices: list[tuple[str | None, str | None]] = []
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append((d.severity, d.sqlstate)))
        conn.execute("SET LOCAL dp.epsilon = 0.5")
        assert notices == [("WARNING", "25P01")]
        assert _show(conn) == "1.0"
        conn.execute("BEGIN")
        conn.execute("SET LOCAL dp.epsilon = 0.25")
        assert _show(conn) == "0.25"
        conn.execute(DP_COUNT)  # charged at the block's setting
        conn.execute("COMMIT")
        assert _show(conn) == "1.0"
    assert _spent(px) == 0.25


def test_dp_settings_in_driver_transactions(px: Proxy) -> None:
    """psycopg opens blocks itself (and prepares statements): the same rules."""
    with psycopg.connect(px.dsn()) as conn:
        conn.execute("SET dp.epsilon = 0.5", prepare=True)
        conn.rollback()
        assert _show(conn) == "1.0"
        conn.execute("SET dp.epsilon = 0.5", prepare=True)
        conn.commit()
        assert _show(conn) == "0.5"
        conn.execute("SET LOCAL dp.epsilon = 0.25")
        (n,) = conn.execute(DP_COUNT, prepare=True).fetchone()
        assert n > 100
        conn.commit()
        assert _show(conn) == "0.5"
    assert _spent(px) == 0.25
