"""Real clients through the proxy: psql, psycopg 3, psycopg2, asyncpg, SQLAlchemy, pandas, BI tools."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import psycopg
import psycopg2
import pytest

from tests.support.clients import psql
from tests.support.paths import FIXTURES
from tests.support.proxy import Proxy, reset_budget

REFUSED = "42501"


# ---------------------------------------------------------------------------- psql


def test_psql_meta_commands(proxy: Proxy) -> None:
    out = psql(proxy, r"\l", r"\dn", r"\dt", r"\d visits")
    assert out.returncode == 0, out.stderr
    assert "dpproxy_test" in out.stdout
    assert "public" in out.stdout
    for table in ("visits", "purchases", "countries"):
        assert table in out.stdout
    assert "duration" in out.stdout and "bigint" in out.stdout


def test_psql_pass_through_and_refusal(proxy: Proxy) -> None:
    out = psql(proxy, "SELECT code, name FROM countries ORDER BY code LIMIT 2",
               "SELECT * FROM visits", "SELECT 1 AS still_alive")
    assert "AD   | Andorra" in out.stdout
    assert "ERROR:  table visits is protected" in out.stderr
    assert "still_alive" in out.stdout


def test_psql_dp_settings(proxy: Proxy) -> None:
    out = psql(proxy, "SET dp.epsilon = 0.5", "SHOW dp.epsilon", "SET dp.noise = 'gaussian'",
               "SHOW dp.noise", "SET dp.epsilon = 1000", "SET dp.nonsense = 1", "RESET dp.epsilon",
               "SHOW dp.epsilon")
    assert out.stdout.splitlines().count("SET") == 2 and "RESET" in out.stdout.splitlines()
    assert " 0.5\n" in out.stdout and " gaussian\n" in out.stdout and " 1.0\n" in out.stdout
    assert "epsilon must be above 0 and at most 10.0" in out.stderr
    assert 'unrecognized configuration parameter "dp.nonsense"' in out.stderr


# ---------------------------------------------------------------------------- psycopg 3


@pytest.mark.parametrize("binary", [False, True])
def test_psycopg3_text_and_binary(proxy: Proxy, binary: bool) -> None:
    with psycopg.connect(proxy.dsn()) as conn:
        cur = conn.cursor(binary=binary)
        rows = cur.execute("SELECT code, name, region FROM countries WHERE region = %s ORDER BY code "
                           "LIMIT %s", ("Europe", 3)).fetchall()
        assert [r[0] for r in rows] == ["AD", "AL", "AT"]
        row = cur.execute("SELECT %s::int + 1, %s::numeric * 2, %s::text, now() IS NOT NULL",
                          (41, 1.25, "x")).fetchone()
        assert row is not None and row[0] == 42 and float(row[1]) == 2.5 and row[2] == "x" and row[3]
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            cur.execute("SELECT uid FROM visits WHERE uid = %s", (1,))
        conn.rollback()
        assert cur.execute("SELECT count(*) FROM countries").fetchone() == (152,)


def test_psycopg3_transactions_and_errors(proxy: Proxy) -> None:
    with psycopg.connect(proxy.dsn()) as conn:
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        conn.execute("SELECT 1")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        with pytest.raises(psycopg.errors.UndefinedTable):
            conn.execute("SELECT * FROM nope")
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
        conn.rollback()
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("INSERT INTO countries VALUES ('XX', 'x', 'y')")
        conn.rollback()
        assert conn.execute("SELECT 2").fetchone() == (2,)


def test_psycopg3_pipeline_mixes_local_and_pass_through(proxy: Proxy) -> None:
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn, conn.pipeline():
        c1 = conn.execute("SELECT 1")
        c2 = conn.execute("SET dp.epsilon = 0.25")
        c3 = conn.execute("SELECT %s::int", (3,))
        c4 = conn.execute("SHOW dp.epsilon")
    assert c1.fetchone() == (1,)
    assert c2.statusmessage == "SET"
    assert c3.fetchone() == (3,)
    assert c4.fetchone() == ("0.25",)


def test_psycopg3_server_side_cursor(proxy: Proxy) -> None:
    with psycopg.connect(proxy.dsn()) as conn:
        with conn.cursor(name="c") as cur:
            cur.execute("SELECT code FROM countries ORDER BY code")
            assert len(cur.fetchmany(10)) == 10
            assert len(cur.fetchall()) == 142
        with pytest.raises(psycopg.errors.InsufficientPrivilege), conn.cursor(name="d") as cur:
            cur.execute("SELECT * FROM visits")


# ---------------------------------------------------------------------------- psycopg2


def test_psycopg2(proxy: Proxy) -> None:
    conn = psycopg2.connect(proxy.dsn())
    try:
        cur = conn.cursor()
        cur.execute("SELECT name FROM countries WHERE code = %s", ("FR",))
        assert cur.fetchone() == ("France",)
        with pytest.raises(psycopg2.errors.InsufficientPrivilege):
            cur.execute("SELECT * FROM purchases")
        conn.rollback()
        cur.execute("SET dp.max_groups_contributed = 3")
        cur.execute("SHOW dp.max_groups_contributed")
        assert cur.fetchone() == ("3",)
    finally:
        conn.close()


# ---------------------------------------------------------------------------- asyncpg


def test_asyncpg_prepared_binary_and_introspection(proxy: Proxy) -> None:
    async def go() -> None:
        conn = await asyncpg.connect(host=proxy.host, port=proxy.port, user="alice", password="alice",
                                     database="dpproxy_test", ssl=False)
        try:
            stmt = await conn.prepare("SELECT code, name FROM countries WHERE region = $1 ORDER BY code")
            rows = await stmt.fetch("Oceania")
            assert rows[0]["code"] == "AU"
            assert [a.name for a in stmt.get_attributes()] == ["code", "name"]
            again = await stmt.fetch("Africa")
            assert len(again) > 20
            # type introspection on first use of a non-builtin shape
            rec = await conn.fetchrow("SELECT ROW(1, 'a')::record AS r, ARRAY[1,2] AS a, "
                                      "'{\"k\": 1}'::jsonb AS j")
            assert rec is not None and list(rec["a"]) == [1, 2]
            assert await conn.fetchval("SELECT $1::numeric + 1", 2) == 3
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.fetch("SELECT * FROM visits WHERE uid = $1", 1)
            assert await conn.fetchval("SELECT 7") == 7
            await conn.execute("SET dp.delta = 1e-7")
            assert await conn.fetchval("SHOW dp.delta") == "1e-07"
            async with conn.transaction():
                assert await conn.fetchval("SELECT count(*) FROM countries") == 152
            # a DP query's parameters, encoded in binary as the proxy described them (an int8
            # in 8 bytes: read as text, they reached Postgres as garbage, 08P01)
            await conn.execute("SET dp.epsilon = 0.01")
            dp = await conn.prepare("SELECT browser, count(*) FROM visits WHERE uid <> $1 "
                                    "AND duration > $2 GROUP BY browser")
            assert [t.name for t in dp.get_parameters()] == ["int8", "int4"]
            assert isinstance(await dp.fetch(42, 5), list)
            cast = await conn.prepare("SELECT count(*) FROM visits WHERE uid <> $1::int8")
            assert [t.name for t in cast.get_parameters()] == ["int8"]
            assert await cast.fetchval(42) >= 0
            assert await conn.fetchval("SELECT count(*) FROM visits WHERE duration > $1", 5) >= 0
        finally:
            await conn.close()

    asyncio.run(go())


def test_asyncpg_many_named_statements(proxy: Proxy) -> None:
    async def go() -> None:
        conn = await asyncpg.connect(proxy.uri())
        try:
            for i in range(30):
                assert await conn.fetchval(f"SELECT {i}::int + $1", 1) == i + 1
        finally:
            await conn.close()

    asyncio.run(go())


# ---------------------------------------------------------------------------- SQLAlchemy + pandas


def test_sqlalchemy_inspect_and_pandas(proxy: Proxy) -> None:
    import pandas as pd
    import sqlalchemy as sa

    engine = sa.create_engine(f"postgresql+psycopg://alice:alice@{proxy.host}:{proxy.port}/dpproxy_test")
    try:
        insp = sa.inspect(engine)
        assert {"visits", "purchases", "countries"} <= set(insp.get_table_names())
        cols = {c["name"]: str(c["type"]) for c in insp.get_columns("visits")}
        assert cols["uid"] == "BIGINT" and cols["duration"] == "INTEGER"
        assert insp.get_pk_constraint("countries")["constrained_columns"] == ["code"]
        with engine.connect() as conn:
            df = pd.read_sql(sa.text("SELECT region, count(*) AS n FROM countries GROUP BY region"), conn)
        assert set(df["region"]) == {"Europe", "Asia", "Africa", "Americas", "Oceania"}
        assert int(df["n"].sum()) == 152
    finally:
        engine.dispose()


# ---------------------------------------------------------------------------- BI tools


def test_bi_tool_connect_statements(proxy: Proxy) -> None:
    """What pgjdbc, DBeaver, Grafana and Metabase send on connect (recorded statements)."""
    with psycopg.connect(proxy.dsn(options="'-c TimeZone=UTC -c extra_float_digits=3'"),
                         autocommit=True) as conn:
        assert conn.execute("SELECT current_schema(), session_user").fetchone() == (
            "public", "dp_analyst_alice")
        assert conn.execute("SHOW search_path").fetchone() == ('"$user", public',)
        assert conn.execute("SHOW TRANSACTION ISOLATION LEVEL").fetchone() == ("read committed",)
        version = conn.execute("SELECT current_setting('server_version_num')").fetchone()
        assert version is not None and int(version[0]) >= 150000
        assert conn.execute("SHOW TimeZone").fetchone() == ("UTC",)
        assert conn.execute("SHOW extra_float_digits").fetchone() == ("3",)
        # Grafana: several statements in one simple query
        cur = conn.execute("SET TIMEZONE TO 'UTC'; SELECT 42", prepare=False)
        assert cur.statusmessage == "SET"
        assert cur.nextset() and cur.fetchone() == (42,)


def test_pgjdbc_startup_parameters_and_binary_switch(proxy: Proxy) -> None:
    """pgjdbc sends these as startup parameters, then runs the same statement unnamed,
    then named (after prepareThreshold = 5 executions) with binary results."""

    async def go() -> None:
        conn = await asyncpg.connect(
            proxy.uri(), server_settings={"extra_float_digits": "3", "DateStyle": "ISO",
                                          "TimeZone": "UTC", "application_name": "PostgreSQL JDBC Driver"})
        try:
            assert await conn.fetchval("SHOW DateStyle") == "ISO, MDY"
            assert await conn.fetchval("SHOW application_name") == "PostgreSQL JDBC Driver"
            assert conn.get_settings().server_version is not None
            for i in range(8):  # asyncpg: unnamed then named statements, binary results
                stmt = await conn.prepare("SELECT name FROM countries WHERE code = $1")
                assert await stmt.fetchval(["US", "FR"][i % 2]) in ("United States", "France")
        finally:
            await conn.close()

    asyncio.run(go())


METABASE_PRIVILEGES = (FIXTURES / "metabase_privileges.sql").read_text()


def test_metabase_sees_protected_tables(proxy: Proxy) -> None:
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        rows = conn.execute(METABASE_PRIVILEGES).fetchall()
        readable = {r[2] for r in rows if r[4]}
        writable = {r[2] for r in rows if r[3] or r[5] or r[6]}
        assert {"visits", "purchases", "countries"} <= readable
        assert not writable
        for table in ("visits", "purchases", "countries"):
            cur = conn.execute(f'SELECT TRUE FROM "public"."{table}" WHERE 1 <> 1 LIMIT 0')
            assert cur.fetchall() == [] and cur.description is not None


BI_QUESTIONS = [line for tool in ("metabase", "tableau", "looker")
                for line in (FIXTURES / f"{tool}_questions.sql")
                .read_text().splitlines() if line and not line.startswith("--")]


@pytest.mark.parametrize("sql", BI_QUESTIONS)
def test_bi_tool_questions_are_dp_answers(proxy: Proxy, sql: str) -> None:
    """Metabase's questions reference columns as "schema"."table"."column", Tableau's count
    rows as SUM(1) and filter with HAVING aggregates: each is answered as the DP query it
    is, the uid counted as users and the configured bounds used (no APPROX_BOUNDS spent on
    a column the config bounds)."""
    details: list[str] = []
    reset_budget(proxy)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        conn.add_notice_handler(lambda d: details.append(d.message_detail or ""))
        rows = conn.execute(sql).fetchall()
    assert rows and len(details) == 1
    assert "APPROX_BOUNDS" not in details[0]


def test_statistics_of_protected_tables_are_hidden(proxy: Proxy) -> None:
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        rows = conn.execute("SELECT tablename, count(*) FROM pg_stats WHERE schemaname = 'public' "
                            "GROUP BY tablename").fetchall()
        assert {r[0] for r in rows} == {"countries"}
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT * FROM pg_statistic")


def test_restricted_role_sees_no_protected_row_even_unclassified(backend: object) -> None:
    """The second wall: the restricted role itself reads zero rows of a protected table."""
    from tests.support.backend import Backend

    assert isinstance(backend, Backend)

    async def go() -> int:
        conn = await asyncpg.connect(backend.restricted.uri())
        try:
            return int(await conn.fetchval("SELECT count(*) FROM visits"))
        finally:
            await conn.close()

    assert asyncio.run(go()) == 0


# ---------------------------------------------------------------------------- auth, TLS, cancel


def test_wrong_password_and_unknown_user(proxy: Proxy) -> None:
    async def login(user: str, password: str, database: str = "dpproxy_test") -> asyncpg.PostgresError:
        try:
            conn = await asyncpg.connect(host=proxy.host, port=proxy.port, user=user, password=password,
                                         database=database, ssl=False)
        except asyncpg.PostgresError as e:
            return e
        await conn.close()
        raise AssertionError("login succeeded")

    wrong = asyncio.run(login("alice", "wrong"))
    unknown = asyncio.run(login("mallory", "x"))
    assert wrong.sqlstate == "28P01"
    assert unknown.sqlstate == "28000"
    assert str(wrong) == 'password authentication failed for user "alice"'
    assert str(unknown) == 'password authentication failed for user "mallory"'
    other_db = asyncio.run(login("alice", "alice", "other"))
    assert other_db.sqlstate == "3D000"
    # libpq clients see the same message
    with pytest.raises(psycopg.OperationalError, match='password authentication failed for user "bob"'):
        psycopg.connect(proxy.dsn(user="bob", password="nope"))


def test_cancel_pass_through_query(proxy: Proxy) -> None:
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        started = time.monotonic()
        import threading

        # cancel_safe: libpq's non-blocking cancel; plain cancel() blocks holding the GIL, which
        # would starve the proxy thread of this same process
        timer = threading.Timer(0.5, conn.cancel_safe)
        timer.start()
        with pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("SELECT pg_sleep(10)")
        assert time.monotonic() - started < 2.5
        assert conn.execute("SELECT 1").fetchone() == (1,)
