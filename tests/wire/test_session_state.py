"""RESET ALL, DISCARD ALL and DEALLOCATE reach the session state the proxy keeps itself (dp.*
settings, the DP queries prepared by name), as they reach Postgres's: a pooler that sends
DISCARD ALL between clients hands the next one a clean session."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import psycopg
import pytest

from server import wire as p
from tests.support.backend import TEST_DATABASE
from tests.support.proxy import Proxy, show
from tests.support.rawclient import RawClient, close_all, errors

DP_COUNT = "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits"


@pytest.fixture
def raw(px: Proxy) -> Iterator[RawClient]:
    c = RawClient(px.host, px.port)
    c.login("alice", "alice", TEST_DATABASE)
    yield c
    close_all()


@pytest.mark.parametrize("reset", ["RESET ALL", "DISCARD ALL", "reset all; select 1"])
@pytest.mark.parametrize("prepare", [False, True], ids=["simple", "extended"])
def test_reset_all_and_discard_all_reset_dp_settings(px: Proxy, reset: str,
                                                     prepare: bool) -> None:
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        default = show(conn)
        conn.execute("SET dp.epsilon = 0.25")
        conn.execute("SET dp.max_groups_contributed = 3")
        conn.execute("SET search_path = pg_catalog")
        if ";" in reset:
            conn.execute(reset)  # several statements: the simple protocol
        else:
            conn.execute(reset, prepare=prepare)
        assert show(conn) == default
        assert show(conn, "dp.max_groups_contributed") != "3"
        assert show(conn, "search_path") != "pg_catalog"  # and Postgres's own, as ever


def test_reset_all_in_a_block_follows_the_block(px: Proxy) -> None:
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        default = show(conn)
        conn.execute("SET dp.epsilon = 0.25")
        conn.execute("BEGIN")
        conn.execute("RESET ALL")
        assert show(conn) == default
        conn.execute("ROLLBACK")
        assert show(conn) == "0.25"
        conn.execute("BEGIN")
        conn.execute("RESET ALL")
        conn.execute("COMMIT")
        assert show(conn) == default


def test_discard_all_in_a_block_is_refused_and_changes_nothing(px: Proxy) -> None:
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        conn.execute("SET dp.epsilon = 0.25")
        conn.execute("BEGIN")
        with pytest.raises(psycopg.errors.ActiveSqlTransaction):
            conn.execute("DISCARD ALL")
        conn.execute("ROLLBACK")
        assert show(conn) == "0.25"


def _prepare_dp(c: RawClient, name: str) -> None:
    c.send(p.Parse(name, DP_COUNT), p.Sync())
    assert errors(c.recv_until_ready()) == []


def _execute(c: RawClient, name: str) -> list[p.BackendMessage]:
    c.send(p.Bind("", name, (), (), ()), p.Execute("", 0), p.Sync())
    return c.recv_until_ready()


def _count(msgs: list[p.BackendMessage]) -> int:
    rows = [m.values for m in msgs if isinstance(m, p.DataRow)]
    assert errors(msgs) == [] and len(rows) == 1, msgs
    return int(rows[0][0] or b"0")


def test_discard_all_drops_dp_statements_prepared_by_name(raw: RawClient) -> None:
    _prepare_dp(raw, "dp1")
    assert _count(_execute(raw, "dp1")) > 100
    raw.send(p.Query("DISCARD ALL"))
    msgs = raw.recv_until_ready()
    assert errors(msgs) == [] and [m.command_tag for m in msgs if isinstance(m, p.CommandComplete)] == \
        ["DISCARD ALL"]
    assert errors(_execute(raw, "dp1")) == ["26000"]  # as Postgres: no such statement


@pytest.mark.parametrize("how", ["simple", "extended"])
def test_deallocate_of_a_dp_statement(raw: RawClient, how: str) -> None:
    """Drivers deallocate by SQL the statements they prepared (psycopg when its cache is
    full): a DP query prepared by name is the proxy's, not the backend's."""
    _prepare_dp(raw, "dp1")
    raw.send(p.Parse("plain", "SELECT 1"), p.Sync())
    assert errors(raw.recv_until_ready()) == []
    for sql in ("DEALLOCATE dp1", "DEALLOCATE plain"):
        if how == "simple":
            raw.send(p.Query(sql))
        else:
            raw.send(p.Parse("", sql), p.Bind("", "", (), (), ()), p.Execute("", 0), p.Sync())
        msgs = raw.recv_until_ready()
        assert errors(msgs) == [] and \
            [m.command_tag for m in msgs if isinstance(m, p.CommandComplete)] == ["DEALLOCATE"], msgs
    assert errors(_execute(raw, "dp1")) == ["26000"]
    assert errors(_execute(raw, "plain")) == ["26000"]
    raw.send(p.Query("DEALLOCATE dp1"))  # gone: the backend says so
    assert errors(raw.recv_until_ready()) == ["26000"]


def test_deallocate_all(raw: RawClient) -> None:
    _prepare_dp(raw, "dp1")
    raw.send(p.Parse("plain", "SELECT 1"), p.Sync())
    assert errors(raw.recv_until_ready()) == []
    raw.send(p.Query("DEALLOCATE ALL"))
    assert errors(raw.recv_until_ready()) == []
    assert errors(_execute(raw, "dp1")) == ["26000"]
    assert errors(_execute(raw, "plain")) == ["26000"]


def test_deallocate_in_a_failed_transaction_is_refused(raw: RawClient) -> None:
    _prepare_dp(raw, "dp1")
    raw.send(p.Query("BEGIN; SELECT 1/0"))
    assert errors(raw.recv_until_ready()) == ["22012"]
    raw.send(p.Query("DEALLOCATE dp1"))
    assert errors(raw.recv_until_ready()) == ["25P02"]
    raw.send(p.Query("ROLLBACK"))
    assert errors(raw.recv_until_ready()) == []
    assert _count(_execute(raw, "dp1")) > 100  # still there


def test_psycopg_evicting_prepared_dp_queries(px: Proxy) -> None:
    """psycopg keeps `prepared_max` statements and deallocates the oldest by SQL."""
    with psycopg.connect(px.dsn(), autocommit=True, prepare_threshold=0) as conn:
        conn.prepared_max = 2
        for round_ in range(2):
            for k in range(4):
                (n,) = conn.execute(f"{DP_COUNT} WHERE duration > {k}").fetchone()
                assert n > 0, (round_, k)


def test_an_asyncpg_pool_resets_dp_settings_between_clients(px: Proxy) -> None:
    """asyncpg's pool runs RESET ALL (with CLOSE ALL, UNLISTEN *...) when a connection is
    released: the next user of the connection gets the default dp.* settings."""
    async def run() -> tuple[str, str]:
        pool = await asyncpg.create_pool(host=px.host, port=px.port, user="alice",
                                         password="alice", database=TEST_DATABASE, ssl=False,
                                         min_size=1, max_size=1)
        try:
            async with pool.acquire() as conn:
                default = await conn.fetchval("SHOW dp.epsilon")
                await conn.execute("SET dp.epsilon = 0.25")
            async with pool.acquire() as conn:
                return default, await conn.fetchval("SHOW dp.epsilon")
        finally:
            await pool.close()

    default, after = asyncio.run(run())
    assert after == default
