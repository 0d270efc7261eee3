"""Proxy-local statements (DP queries, dp.* settings, dp_budget()) inside transactions."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from .conftest import Proxy

DP_COUNT = "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits"


@pytest.fixture
def px(proxy: Proxy) -> Proxy:
    with psycopg.connect(proxy.dsn("admin"), autocommit=True) as adm:
        adm.execute("SELECT dp_reset_budget('alice')")
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
