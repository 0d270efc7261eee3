"""DP answers read a few rows at a time or copied: cursors (DECLARE ... FOR a DP query),
row-limited Executes of a DP portal, as psql's FETCH_COUNT, psycopg's and psycopg2's named
cursors, asyncpg's cursors and JDBC's fetch size read them, and COPY (...) TO STDOUT (psql's
\\copy). Each is one answer, charged once; the rows come back in as many pieces as the client
asks, or in COPY's format, as Postgres sends any query's."""

from __future__ import annotations

import asyncio
import os
import subprocess
from typing import Any

import asyncpg
import psycopg
import psycopg2
import pytest
from pglast import parser

from dp_core.classify import Cursor, Statement, StatementKind
from server import wire as p
from server.embedded import find_bindir
from tests.support.backend import TEST_DATABASE
from tests.support.proxy import Proxy, spent
from tests.support.rawclient import RawClient, errors, tags

DP = "SELECT WITH ANONYMIZATION browser, ANON_COUNT(*) AS n FROM visits GROUP BY browser ORDER BY browser"
PLAIN = "SELECT browser, count(*) FROM visits GROUP BY browser ORDER BY browser"
EPSILON = 1.0  # the test config's default per query


def browsers(proxy: Proxy) -> int:
    """How many browser groups the DP query releases (all of them, in the test data)."""
    with psycopg.connect(proxy.dsn(), autocommit=True) as c:
        return len(c.execute(DP).fetchall())


# ---------------------------------------------------------------------------- the statement


@pytest.mark.parametrize("declare", [
    'DECLARE "x ""y""" BINARY INSENSITIVE NO SCROLL CURSOR WITH HOLD FOR SELECT 1',
    "DECLARE c SCROLL CURSOR WITHOUT HOLD FOR SELECT 1",
    "DECLARE c ASENSITIVE CURSOR FOR SELECT 1",
    "DECLARE C CURSOR FOR SELECT 1",
])
def test_a_cursor_is_declared_again_with_its_name_and_options(declare: str) -> None:
    """The proxy declares the client's cursor over its result query: same name, same options."""
    import json

    def parsed(sql: str) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(parser.parse_sql_json(sql))["stmts"][0]["stmt"]
        return body

    tree = parsed(declare)
    cursor = Statement(StatementKind.DP_QUERY, declare, tree=tree).cursor
    assert cursor is not None
    again = parsed(cursor.declare("SELECT 2", lambda n: '"' + n.replace('"', '""') + '"'))
    body, body_again = tree["DeclareCursorStmt"], again["DeclareCursorStmt"]
    assert body_again["portalname"] == body["portalname"]
    assert body_again["options"] == body["options"]
    assert Cursor(body["portalname"], body["options"]).hold == ("WITH HOLD" in declare)


def test_cursors_over_dp_forms_are_dp_queries(proxy: Proxy) -> None:
    classify = proxy.server.classifier.classify
    for sql in (f"DECLARE c CURSOR FOR {DP}", f"DECLARE c NO SCROLL CURSOR FOR {PLAIN}",
                "DECLARE c CURSOR FOR SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits"):
        (st,) = classify(sql)
        assert st.kind is StatementKind.DP_QUERY and st.cursor is not None, sql
    for sql in ("DECLARE c CURSOR FOR SELECT * FROM visits",
                "DECLARE c CURSOR FOR SELECT uid FROM visits WHERE browser = 'x'",
                "DECLARE c CURSOR FOR SELECT browser FROM visits"):
        (st,) = classify(sql)
        assert st.kind is StatementKind.REFUSED and st.refusal is not None, sql
        assert st.refusal.sqlstate == "42501"
    (st,) = classify("DECLARE c CURSOR FOR SELECT * FROM countries")
    assert st.kind is StatementKind.PASS_THROUGH


# ---------------------------------------------------------------------------- cursors


def test_psql_fetch_count_reads_a_dp_answer_through_a_cursor(px: Proxy) -> None:
    """psql with FETCH_COUNT wraps every query in BEGIN; DECLARE ... CURSOR; FETCH n; ...;
    CLOSE; COMMIT: both DP forms and dp_budget() are answered, each once."""
    n = browsers(px)
    before = spent(px).epsilon
    argv = [str(find_bindir() / "psql"), "-X", "-v", "FETCH_COUNT=3", "-v", "ON_ERROR_STOP=1",
            "-A", "-t", "-h", px.host, "-p", str(px.port), "-U", "alice", "-d", TEST_DATABASE,
            "-c", DP, "-c", PLAIN, "-c", "SELECT analyst FROM dp_budget()"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PGPASSWORD="alice", PGSSLMODE="disable"))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2 * n + 1 and lines[-1] == "alice"
    assert lines[:n] == sorted(lines[:n]) and len({ln.split("|")[0] for ln in lines[:n]}) == n
    assert out.stderr.count("DP answer: spent epsilon 1,") == 2
    assert spent(px).epsilon == pytest.approx(before + 2 * EPSILON)


def test_a_cursor_holds_one_answer(px: Proxy) -> None:
    """FETCH in pieces, MOVE back, FETCH again: the same released rows, charged once."""
    n = browsers(px)
    before = spent(px).epsilon
    with psycopg.connect(px.dsn()) as c:  # (a transaction block: psycopg's default)
        c.execute(f"DECLARE dp SCROLL CURSOR FOR {DP}")
        first = c.execute("FETCH 2 FROM dp").fetchall()
        rest = c.execute("FETCH ALL FROM dp").fetchall()
        c.execute("MOVE ABSOLUTE 0 IN dp")
        again = c.execute("FETCH ALL FROM dp").fetchall()
        assert len(first) == 2 and len(first) + len(rest) == n
        assert again == first + rest  # released values, not a second draw
        c.execute("CLOSE dp")
    assert spent(px).epsilon == pytest.approx(before + EPSILON)


def test_declare_outside_a_block_is_refused_before_the_charge(px: Proxy) -> None:
    before = spent(px).epsilon
    with psycopg.connect(px.dsn(), autocommit=True) as c:
        with pytest.raises(psycopg.Error) as err:
            c.execute(f"DECLARE dp CURSOR FOR {DP}")
        assert err.value.sqlstate == "25P01"
        assert "transaction block" in str(err.value)
        # WITH HOLD outlives the statement's own transaction, as in Postgres
        c.execute(f'DECLARE "Held ""one""" CURSOR WITH HOLD FOR {PLAIN}')
        assert len(c.execute('FETCH ALL FROM "Held ""one"""').fetchall()) == browsers(px)
        c.execute('CLOSE "Held ""one"""')
    assert spent(px).epsilon == pytest.approx(before + 2 * EPSILON)


def test_a_cursor_name_in_use_is_refused_before_the_charge(px: Proxy) -> None:
    """Postgres's own error (42P03) for a DP cursor whose name is taken, and nothing spent:
    on the extended protocol (psycopg 3), the simple one (psycopg2), in a block and with
    WITH HOLD outside one; the name stays the first cursor's."""
    n = browsers(px)
    before = spent(px).epsilon
    with psycopg.connect(px.dsn()) as c:
        c.execute("DECLARE dp CURSOR FOR SELECT 1")
        with pytest.raises(psycopg.Error) as err:
            c.execute(f"DECLARE dp CURSOR FOR {DP}")
        assert err.value.sqlstate == "42P03" and str(err.value).startswith(
            'cursor "dp" already exists')
        c.rollback()
        c.autocommit = True
        c.execute("DECLARE held CURSOR WITH HOLD FOR SELECT 1")
        with pytest.raises(psycopg.Error) as err:
            c.execute(f"DECLARE held CURSOR WITH HOLD FOR {DP}")
        assert err.value.sqlstate == "42P03"
        assert c.execute("FETCH ALL FROM held").fetchall() == [(1,)]
        assert spent(px).epsilon == before
    conn = psycopg2.connect(px.dsn())
    try:
        cur = conn.cursor()
        cur.execute("DECLARE dp CURSOR FOR SELECT 1")
        with pytest.raises(psycopg2.Error) as err2:
            cur.execute(f"DECLARE dp CURSOR FOR {DP}")
        assert err2.value.pgcode == "42P03"
        conn.rollback()
        cur.execute(f"DECLARE dp CURSOR FOR {DP}; FETCH ALL FROM dp")  # free again: answered
        assert len(cur.fetchall()) == n
    finally:
        conn.close()
    assert spent(px).epsilon == pytest.approx(before + EPSILON)


def test_a_cursor_lives_through_its_query(px: Proxy) -> None:
    """One Query with DECLARE and FETCH needs no BEGIN: Postgres runs its statements in one
    implicit block, and so does the proxy (which runs them one by one)."""
    n = browsers(px)
    before = spent(px).epsilon
    with psycopg.connect(px.dsn(), autocommit=True) as c:
        c.execute(f"SET dp.epsilon = 0.5; DECLARE dp CURSOR FOR {DP}; MOVE 2 IN dp")
        cur = c.execute(f"DECLARE dp CURSOR FOR {DP}; FETCH 2 FROM dp; FETCH ALL FROM dp")
        assert cur.statusmessage == "DECLARE CURSOR"
        assert cur.nextset() and len(cur.fetchall()) == 2
        assert cur.nextset() and len(cur.fetchall()) == n - 2
        assert c.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        with pytest.raises(psycopg.Error) as err:
            c.execute("FETCH 1 FROM dp")  # ended with its block
        assert err.value.sqlstate == "34000"
    assert spent(px).epsilon == pytest.approx(before + 2 * 0.5)


def test_cursor_refusals(px: Proxy) -> None:
    with psycopg.connect(px.dsn()) as c:
        with pytest.raises(psycopg.Error) as err:
            c.execute("DECLARE raw CURSOR FOR SELECT * FROM visits")
        assert err.value.sqlstate == "42501"
        c.rollback()
        with pytest.raises(psycopg.Error) as err:
            c.execute("DECLARE u CURSOR FOR SELECT WITH ANONYMIZATION v.browser, ANON_COUNT(*) "
                      "FROM visits v JOIN purchases p ON v.uid < p.uid GROUP BY v.browser")
        assert err.value.sqlstate == "0A000"
        c.rollback()
        with pytest.raises(psycopg.Error) as err:
            c.execute(f"EXPLAIN DECLARE c CURSOR FOR {DP}")
        assert err.value.sqlstate == "0A000"


def test_psycopg_named_cursors(px: Proxy) -> None:
    """psycopg 3 declares a named cursor on the extended protocol (parameters bound, binary
    rows on request) and describes its portal; psycopg2 on the simple protocol."""
    n = browsers(px)
    before = spent(px).epsilon
    with psycopg.connect(px.dsn()) as c:
        with c.cursor(name="named") as cur:
            cur.execute("SELECT WITH ANONYMIZATION browser, ANON_AVG(duration, 0, 100) AS a "
                        "FROM visits WHERE duration > %s GROUP BY browser", (5,))
            assert cur.description is not None
            assert [d.name for d in cur.description] == ["browser", "a"]
            rows = cur.fetchmany(3) + cur.fetchall()
            assert len(rows) == n and all(0 <= a <= 100 for _, a in rows)
        with c.cursor(name="bin", binary=True) as cur:
            cur.execute(PLAIN)
            assert len(cur.fetchall()) == n
    with psycopg.connect(px.dsn(), autocommit=True) as c, \
            c.cursor(name="held", withhold=True) as cur:
        cur.execute(DP)
        assert len(cur.fetchall()) == n
    c2 = psycopg2.connect(px.dsn())
    try:
        cur2 = c2.cursor(name="p2")
        cur2.itersize = 3
        cur2.execute(DP)
        assert len(list(cur2)) == n
    finally:
        c2.close()
    assert spent(px).epsilon == pytest.approx(before + 4 * EPSILON)


# ---------------------------------------------------------------------------- row limits


def test_asyncpg_cursor_fetches_exactly_what_it_asks(px: Proxy) -> None:
    """asyncpg's cursors Execute the portal with a row limit: the first limit gets that many
    rows and PortalSuspended, the next Executes the following rows (before, the whole answer
    came back for fetch(2))."""
    n = browsers(px)
    before = spent(px).epsilon

    async def go() -> None:
        conn = await asyncpg.connect(px.uri())
        try:
            async with conn.transaction():
                cur = await conn.cursor(DP)
                a, b, rest = await cur.fetch(2), await cur.fetch(3), await cur.fetch(1000)
                assert (len(a), len(b), len(a) + len(b) + len(rest)) == (2, 3, n)
                assert [r["browser"] for r in a + b + rest] == \
                    sorted(r["browser"] for r in a + b + rest)
                assert await cur.fetch(2) == []
                got = [r async for r in conn.cursor(PLAIN, prefetch=4)]
                assert len(got) == n
        finally:
            await conn.close()
        admin = await asyncpg.connect(px.uri("admin"))
        try:
            async with admin.transaction():
                ledger = [r async for r in admin.cursor("SELECT * FROM dp_ledger('alice')",
                                                        prefetch=1)]
                assert len(ledger) >= 2
        finally:
            await admin.close()

    asyncio.run(go())
    assert spent(px).epsilon == pytest.approx(before + 2 * EPSILON)


def _limited_executes(proxy: Proxy, sql: str, portal: str) -> list[list[p.BackendMessage]]:
    """Parse, Bind, Execute 2 rows, Execute 3, Execute all, Sync; then Execute the portal in
    a new batch: the messages each step gets back."""
    c = RawClient(proxy.host, proxy.port)
    try:
        assert not errors(c.login("alice", "alice", TEST_DATABASE))
        c.send(p.Query("BEGIN"))
        c.recv_until_ready()
        c.send(p.Parse("", sql), p.Bind(portal, "", (), (), (1,)), p.Describe(b"P", portal),
               p.Execute(portal, 2), p.Execute(portal, 3), p.Execute(portal, 0), p.Sync())
        batch = c.recv_until_ready()
        c.send(p.Execute(portal, 1), p.Sync())
        after = c.recv_until_ready()
        c.send(p.Close(b"P", portal), p.Execute(portal, 1), p.Sync())
        closed = c.recv_until_ready()
        c.send(p.Query("COMMIT"))
        c.recv_until_ready()
        return [batch, after, closed]
    finally:
        c.close()


@pytest.mark.parametrize("portal", ["", "named"])
def test_row_limited_executes_match_postgres(px: Proxy, portal: str) -> None:
    """The same raw sequence on a DP portal and on a pass-through one (the lookup table) gets
    the same messages: rows in the asked pieces with PortalSuspended, binary as bound, the
    portal readable until its end, closed by Close."""
    dp = _limited_executes(px, "SELECT WITH ANONYMIZATION browser, ANON_COUNT(*) AS n FROM visits "
                               "GROUP BY browser ORDER BY browser LIMIT 7", portal)
    raw = _limited_executes(px, "SELECT name, 1::bigint AS n FROM countries ORDER BY name "
                                "LIMIT 7", portal)
    def kinds(msgs: list[p.BackendMessage]) -> list[str]:
        return [t for t in tags(msgs) if t != "NoticeResponse"]  # (the DP answer's notice)

    assert kinds(dp[0]) == kinds(raw[0])
    assert kinds(dp[0]).count("PortalSuspended") == 2 and kinds(dp[0]).count("DataRow") == 7
    rows = [m for m in dp[0] if isinstance(m, p.DataRow)]
    assert all(len(r.values[1] or b"") == 8 for r in rows)  # bigint, in binary as bound
    assert kinds(dp[1]) == kinds(raw[1])
    assert kinds(dp[2]) == kinds(raw[2]) and errors(dp[2]) == ["34000"]


# ---------------------------------------------------------------------------- COPY


def test_psql_copy_of_a_dp_answer(px: Proxy, tmp_path: Any) -> None:
    """psql's \\copy (query) TO file sends COPY (query) TO STDOUT with the options."""
    n = browsers(px)
    before = spent(px).epsilon
    out_file = tmp_path / "answer.csv"
    argv = [str(find_bindir() / "psql"), "-X", "-v", "ON_ERROR_STOP=1", "-h", px.host, "-p",
            str(px.port), "-U", "alice", "-d", TEST_DATABASE,
            "-c", f"\\copy ({DP}) TO '{out_file}' WITH (FORMAT csv, HEADER, DELIMITER ';')"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PGPASSWORD="alice", PGSSLMODE="disable"))
    assert out.returncode == 0, out.stderr
    lines = out_file.read_text().splitlines()
    assert lines[0] == "browser;n" and len(lines) == n + 1
    assert all(int(ln.split(";")[1]) >= 0 for ln in lines[1:])
    assert spent(px).epsilon == pytest.approx(before + EPSILON)


def test_copy_of_dp_answers_through_drivers(px: Proxy) -> None:
    n = browsers(px)
    before = spent(px).epsilon
    with psycopg.connect(px.dsn(), autocommit=True) as c:
        with c.cursor() as cur, cur.copy(f"COPY ({PLAIN}) TO STDOUT") as copy:
            rows = list(copy.rows())
        assert len(rows) == n and all(int(k) >= 0 for _, k in rows)
        with c.cursor() as cur, cur.copy(f"COPY ({DP}) TO STDOUT (FORMAT binary)") as copy:
            copy.set_types(["text", "int8"])
            assert len(list(copy.rows())) == n
        with c.cursor() as cur, cur.copy("COPY (SELECT analyst FROM dp_budget()) TO STDOUT") as copy:
            assert [r[0] for r in copy.rows()] == ["alice"]
    c2 = psycopg2.connect(px.dsn())
    try:
        import io
        buf = io.StringIO()
        c2.cursor().copy_expert(f"COPY ({DP}) TO STDOUT WITH CSV", buf)
        assert len(buf.getvalue().splitlines()) == n
    finally:
        c2.close()
    assert spent(px).epsilon == pytest.approx(before + 3 * EPSILON)


def test_copy_refusals_cost_nothing(px: Proxy) -> None:
    before = spent(px).epsilon
    with psycopg.connect(px.dsn(), autocommit=True) as c:
        for sql in (f"COPY ({DP}) TO '/tmp/dp_answer.csv'", f"COPY ({PLAIN}) TO PROGRAM 'cat'",
                    "COPY (SELECT * FROM dp_budget()) TO '/tmp/budget'",
                    "COPY (SELECT * FROM visits) TO STDOUT", "COPY visits TO STDOUT"):
            with pytest.raises(psycopg.Error) as err:
                c.execute(sql)
            assert err.value.sqlstate == "42501", sql
        # an unprotected query's COPY to a file is Postgres's to refuse, as it is
        with pytest.raises(psycopg.Error) as err:
            c.execute("COPY (SELECT * FROM countries) TO '/tmp/countries'")
        assert err.value.sqlstate == "42501" and "pg_write_server_files" in str(err.value.diag.message_detail)
    assert spent(px).epsilon == before
