"""Client encodings: the proxy reads and writes text in the session's client_encoding, as
Postgres does, and refuses the encodings in which it could not lex SQL as Postgres does."""

from __future__ import annotations

import asyncio
import codecs
import os
import struct
import subprocess
from collections.abc import Iterator

import asyncpg
import psycopg
import pytest

from server import wire as p
from server.embedded import find_bindir
from server.encodings import ALIASES, CLIENT_ONLY, CODECS, codec, encoding_named
from tests.support.backend import TEST_DATABASE, Backend
from tests.support.proxy import Proxy
from tests.support.rawclient import RawClient, close_all, errors

# a text each encoding has beyond ASCII
SAMPLES = {"LATIN1": "Zürich", "WIN1252": "€uro", "KOI8R": "Москва", "EUC_JP": "東京",
           "LATIN2": "Łódź"}


@pytest.fixture(autouse=True)
def _close_raw_clients() -> Iterator[None]:
    yield
    close_all()


# ---------------------------------------------------------------------------- the codec table


def test_every_codec_reads_ascii_bytes_as_ascii() -> None:
    """What makes a client encoding safe to classify SQL in: bytes below 0x80 are always those
    ASCII characters, so quotes, backslashes and (ASCII) table names are the same bytes."""
    ascii_bytes = bytes(range(1, 128))
    for name, py in CODECS.items():
        assert ascii_bytes.decode(py) == ascii_bytes.decode("ascii"), name
    for py in {v for v in CODECS.values() if v not in ("utf-8", "latin-1")}:
        # no ASCII byte is ever absorbed into a multibyte character
        for hi in range(0x80, 0x100):
            for lo in b"'\\\"vV;-/*$":
                try:
                    text = bytes([hi, lo]).decode(py)
                except UnicodeDecodeError:
                    continue
                assert text.endswith(chr(lo)), (py, hex(hi), chr(lo))


def test_client_only_encodings_have_no_codec() -> None:
    for name in CLIENT_ONLY:
        assert codec(name) is None
        # and they do hide ASCII bytes inside characters: SJIS 0x95 0x5C is one character
    assert b"\x95\x5c".decode("shift_jis") == "表"
    assert codec("latin1") == "latin-1" and codec("UTF8") == "utf-8"


def test_the_names_are_the_ones_postgres_reports(backend: Backend) -> None:
    """Postgres reports client_encoding by its canonical name: each name of the table is one."""
    async def check() -> None:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            for name in CODECS:
                await conn.execute(f"SET client_encoding TO '{name}'")
                assert await conn.fetchval("SHOW client_encoding") == name
                await conn.execute("RESET client_encoding")
        finally:
            await conn.close()

    asyncio.run(check())


# ---------------------------------------------------------------------------- through the proxy
# (px: a fresh proxy with alice's budget full: these tests spend it)


@pytest.mark.parametrize("encoding", sorted(SAMPLES))
def test_sql_in_the_client_encoding(px: Proxy, encoding: str) -> None:
    text = SAMPLES[encoding]
    with psycopg.connect(px.dsn(), autocommit=True, client_encoding=encoding) as conn:
        # psycopg writes in the encoding the proxy decodes with
        assert codecs.lookup(conn.info.encoding).name == codecs.lookup(str(codec(encoding))).name
        # a statement the proxy parses (it names a protected table), passed through
        assert conn.execute(f"SELECT 'visits {text}' AS t").fetchone() == (f"visits {text}",)
        # several statements in one Query: the proxy sends them one by one, re-encoded
        cur = conn.execute(f"SELECT '{text}' AS a; SHOW dp.epsilon")
        assert cur.fetchone() is not None
        # a DP query with the text in a literal and in the output name
        cur = conn.execute(f'SELECT WITH ANONYMIZATION ANON_COUNT(*) AS "n {text}" FROM visits '
                           f"WHERE browser <> '{text}'")
        assert cur.description is not None and cur.description[0].name == f"n {text}"
        (n,) = cur.fetchone()
        assert n > 100
        # and with the text as a bind parameter (extended protocol, text format)
        cur = conn.execute("SELECT WITH ANONYMIZATION browser, ANON_COUNT(*) FROM visits "
                           "WHERE browser <> %s GROUP BY browser", (text,), prepare=True)
        assert len(cur.fetchall()) > 1


def test_results_and_messages_in_the_client_encoding(px: Proxy) -> None:
    with psycopg.connect(px.dsn(), autocommit=True, client_encoding="LATIN1") as conn:
        # the backend converts pass-through rows
        (name,) = conn.execute("SELECT name FROM countries WHERE code = 'CI'").fetchone()
        assert name == "Côte d'Ivoire"
        # the proxy's own error messages are written in the client encoding
        with pytest.raises(psycopg.Error) as info:
            conn.execute("SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits v "
                         "JOIN visits w ON v.browser = w.browser WHERE v.browser = 'Zürich'")
        assert info.value.sqlstate == "0A000"
        assert "Zürich" in str(info.value) or "\ufffd" not in str(info.value)
        # the session goes on
        assert conn.execute("SELECT 'ä'").fetchone() == ("ä",)


def test_a_released_key_the_client_encoding_lacks(px: Proxy) -> None:
    """As Postgres fails a query whose rows have a character the client encoding lacks (22P05),
    so does a DP answer; WIN1252 has the euro sign, LATIN1 has not."""
    sql = ("SELECT WITH ANONYMIZATION CASE WHEN browser = 'Chrome' THEN U&'Chrome \\20AC' "
           "ELSE U&'other \\20AC' END AS b, ANON_COUNT(*) FROM visits GROUP BY 1")
    with psycopg.connect(px.dsn(), autocommit=True, client_encoding="WIN1252") as conn:
        rows = conn.execute(sql).fetchall()
        assert rows and all(b.endswith("€") for b, _ in rows)
    with psycopg.connect(px.dsn(), autocommit=True, client_encoding="LATIN1") as conn:
        with pytest.raises(psycopg.Error) as info:
            conn.execute(sql)
        assert info.value.sqlstate == "22P05"
        assert 'no equivalent in encoding "LATIN1"' in str(info.value)
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_invalid_bytes_in_the_client_encoding_are_an_error(px: Proxy) -> None:
    c = RawClient(px.host, px.port)
    c.login("alice", "alice", TEST_DATABASE)
    c.send(p.Query("SET client_encoding TO 'WIN1252'"))
    assert errors(c.recv_until_ready()) == []
    # 0x81 is no character in WIN1252: Postgres answers 22021; so does the proxy, which must
    # read this statement (it names a protected table)
    sql = b"SELECT * FROM visits WHERE browser = '\x81'\x00"
    c.send_raw(b"Q" + struct.pack("!i", len(sql) + 4) + sql)
    assert errors(c.recv_until_ready()) == ["22021"]
    sql = b"SELECT 'caf\xe9' AS visits\x00"  # parsed by the proxy too; valid in WIN1252
    c.send_raw(b"Q" + struct.pack("!i", len(sql) + 4) + sql)
    msgs = c.recv_until_ready()
    assert [m.values for m in msgs if isinstance(m, p.DataRow)] == [(b"caf\xe9",)]
    c.close()


@pytest.mark.parametrize("how", [
    "SET client_encoding TO 'SJIS'",
    "SET NAMES 'Shift-JIS'",
    "SET SESSION client_encoding = mskanji",
    "SELECT set_config('client_encoding', 'BIG5', false)",
    "SELECT set_config('Client_Encoding', 'windows-950', true)",
    "SELECT set_config('client_' || 'encoding', 'UTF8', false)",  # a name it cannot read
    "SELECT set_config('client_encoding', %s, false)",  # a value it cannot read
    "UPDATE pg_settings SET setting = 'GBK' WHERE name = 'client_encoding'",
])
def test_switching_to_a_client_only_encoding_is_refused(px: Proxy, how: str) -> None:
    """Refused before the backend sees it (so nothing sent behind it is read otherwise), with
    an error the session survives."""
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as info:
            conn.execute(how, ("UHC",) if "%s" in how else None)
        assert info.value.sqlstate == "0A000", info.value
        assert "client_encoding" in str(info.value) or "set_config" in str(info.value) \
            or "pg_settings" in str(info.value)
        assert conn.execute("SHOW client_encoding").fetchone() == ("UTF8",)


@pytest.mark.parametrize("prepare", [False, True])
def test_set_config_from_bound_values_is_checked_at_bind(px: Proxy, prepare: bool) -> None:
    """How psycopg changes the encoding: `set_config('client_encoding', $1, false)`. The
    values are checked at Bind against the literal form's rules, with its errors: on the
    unnamed statement and a named (prepared) one, used again."""
    with psycopg.connect(px.dsn(), autocommit=True, prepare_threshold=0 if prepare else None) \
            as conn:
        for value in ("LATIN1", "UTF8", "WIN1252", "UTF8"):
            conn.execute("SELECT set_config('client_encoding', %s, false)", (value,),
                         prepare=prepare)
            assert conn.execute("SHOW client_encoding").fetchone() == (value,)
        for name, value, sqlstate in (("client_encoding", "SJIS", "0A000"),
                                      ("CLIENT_ENCODING", "Big5", "0A000"),
                                      ("standard_conforming_strings", "off", "0A000"),
                                      ("role", "dp_pushdown", "42501"),
                                      ("session_authorization", "admin", "42501")):
            with pytest.raises(psycopg.Error) as info:
                conn.execute("SELECT set_config(%s, %s, false)", (name, value), prepare=prepare)
            assert info.value.sqlstate == sqlstate, info.value
            with pytest.raises(psycopg.Error) as literal:  # the literal form's error
                conn.execute(f"SELECT set_config('{name}', '{value}', false)")
            assert str(info.value) == str(literal.value)
        assert conn.execute("SHOW client_encoding").fetchone() == ("UTF8",)
        assert conn.execute("SHOW standard_conforming_strings").fetchone() == ("on",)
        conn.execute("SELECT set_config(%s, %s, false)", ("application_name", "mine"),
                     prepare=prepare)
        assert conn.execute("SHOW application_name").fetchone() == ("mine",)


def test_set_config_at_bind_in_pipelines_and_after_the_statement_is_gone(px: Proxy) -> None:
    """Pipelined Parse/Bind/Execute: a refused Bind fails its batch (the rest skipped to Sync,
    the session goes on); a named statement's check lasts while it does, whatever else is
    parsed, and ends with it."""
    c = RawClient(px.host, px.port)
    c.login("alice", "alice", TEST_DATABASE)
    sql = "SELECT set_config('client_encoding', $1, false)"
    c.send(p.Parse("enc", sql), p.Bind("", "enc", (), (b"LATIN1",), ()), p.Execute("", 0),
           p.Bind("", "enc", (), (b"SJIS",), ()), p.Execute("", 0),
           p.Parse("", "SELECT 2"), p.Bind("", "", (), (), ()), p.Execute("", 0), p.Sync())
    msgs = c.recv_until_ready()
    assert errors(msgs) == ["0A000"]
    rows = [m.values for m in msgs if isinstance(m, p.DataRow)]
    assert rows == [(b"LATIN1",)]  # (SELECT 2 was skipped)
    # an unnamed statement parsed in between does not drop the named one's check
    c.send(p.Parse("", "SELECT $1::text"), p.Bind("", "", (), (b"SJIS",), ()), p.Execute("", 0),
           p.Bind("", "enc", (), (b"GBK",), ()), p.Execute("", 0), p.Sync())
    msgs = c.recv_until_ready()
    assert errors(msgs) == ["0A000"]
    assert [m.values for m in msgs if isinstance(m, p.DataRow)] == [(b"SJIS",)]
    # binary-format values too
    c.send(p.Bind("", "enc", (1,), (b"UHC",), ()), p.Execute("", 0), p.Sync())
    assert errors(c.recv_until_ready()) == ["0A000"]
    c.send(p.Query("SHOW client_encoding"))  # (each failed batch's transaction rolled back)
    assert [m.values for m in c.recv_until_ready() if isinstance(m, p.DataRow)] == [(b"UTF8",)]
    # once closed, the name is free for a statement without a check
    c.send(p.Close(b"S", "enc"), p.Parse("enc", "SELECT $1::text"),
           p.Bind("", "enc", (), (b"SJIS",), ()), p.Execute("", 0), p.Sync())
    msgs = c.recv_until_ready()
    assert not errors(msgs) and [m.values for m in msgs if isinstance(m, p.DataRow)] == [(b"SJIS",)]
    # the unnamed statement's check, until a simple query drops it
    c.send(p.Parse("", sql), p.Bind("", "", (), (b"SJIS",), ()), p.Execute("", 0), p.Sync())
    assert errors(c.recv_until_ready()) == ["0A000"]
    c.send(p.Query("DEALLOCATE ALL"))
    assert not errors(c.recv_until_ready())
    c.close()


@pytest.mark.parametrize("value", ["LATIN1", "iso-8859-1", "Windows-1252", "koi8", "UNICODE",
                                   "euc_jp", "ISO_8859_5"])
def test_switching_to_an_encoding_it_reads_works(px: Proxy, value: str) -> None:
    with psycopg.connect(px.dsn(), autocommit=True) as conn:
        conn.execute(f"SET client_encoding TO '{value}'")
        (name,) = conn.execute("SHOW client_encoding").fetchone()
        assert codec(name) is not None
        conn.execute(f"SELECT set_config('client_encoding', '{value}', false)")


def test_every_name_it_takes_is_one_postgres_takes(backend: Backend) -> None:
    """The aliases the classifier lets through name, to Postgres, the encoding the proxy
    expects (so no alias reaches an encoding it cannot read)."""
    async def check() -> None:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            for alias in ALIASES:
                await conn.execute(f"SET client_encoding TO '{alias}'")
                assert await conn.fetchval("SHOW client_encoding") == encoding_named(alias), alias
            for name in CLIENT_ONLY:
                assert encoding_named(name) is None
        finally:
            await conn.close()

    asyncio.run(check())


@pytest.fixture
def switch_function(backend: Backend) -> Iterator[str]:
    """A function that changes a setting where the classifier cannot see it: only the relay's
    check of what the backend reports stands between it and a misread statement."""
    async def run(sql: str) -> None:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(run("CREATE FUNCTION public.quietly(name text, value text) RETURNS text "
                    "LANGUAGE sql AS $$ SELECT set_config(name, value, false) $$"))
    try:
        yield "quietly"
    finally:
        asyncio.run(run("DROP FUNCTION public.quietly(text, text)"))


@pytest.mark.parametrize("args", ["'client_encoding', 'SJIS'", "'client_encoding', 'WIN950'",
                                  "'standard_conforming_strings', 'off'"])
def test_a_switch_the_backend_reports_ends_the_session(px: Proxy, switch_function: str,
                                                       args: str) -> None:
    conn = psycopg.connect(px.dsn(), autocommit=True)
    with pytest.raises(psycopg.Error) as info:
        conn.execute(f"SELECT {switch_function}({args})")
    assert info.value.sqlstate == "0A000", info.value
    assert conn.closed or conn.broken
    conn.close()
    with psycopg.connect(px.dsn(), autocommit=True) as fresh:
        assert fresh.execute("SELECT 1").fetchone() == (1,)


def test_a_login_in_a_client_only_encoding_is_refused(px: Proxy) -> None:
    with pytest.raises(psycopg.OperationalError) as info:
        psycopg.connect(px.dsn(), client_encoding="SJIS")
    assert "client_encoding SJIS is not supported" in str(info.value)
    with psycopg.connect(px.dsn(), client_encoding="EUC_JP") as ok:
        assert ok.execute("SELECT '東京'").fetchone() == ("東京",)


def test_psql_in_a_latin1_locale(px: Proxy) -> None:
    """psql takes its client encoding from the locale: a LATIN1 terminal sends LATIN1 bytes."""
    script = ("SELECT WITH ANONYMIZATION ANON_COUNT(*) AS \"Zählung\" FROM visits "
              "WHERE browser <> 'Zürich';\nSELECT name FROM countries WHERE code = 'CI';\n")
    argv = [str(find_bindir() / "psql"), "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1",
            "-h", px.host, "-p", str(px.port), "-U", "alice", "-d", TEST_DATABASE]
    env = dict(os.environ, PGPASSWORD="alice", PGSSLMODE="disable", PGCLIENTENCODING="LATIN1")
    out = subprocess.run(argv, input=script.encode("latin-1"), capture_output=True, env=env,
                         timeout=60)
    assert out.returncode == 0, out.stderr.decode("latin-1")
    lines = out.stdout.decode("latin-1").split("\n")
    assert int(lines[0]) > 100 and lines[1] == "Côte d'Ivoire", lines


EVIL = b"SELECT E'\xe3\x81\x81\\'; SELECT uid, browser FROM visits LIMIT 3; --'"
"""Read as UTF-8, one string literal; read as SJIS (0xe3 0x81, then 0x81 0x5c: the backslash
is inside a character) it ends the literal early and reads visits raw."""


def _evil_query() -> bytes:
    return b"Q" + struct.pack("!i", len(EVIL) + 5) + EVIL + b"\x00"


def test_a_statement_pipelined_behind_a_refused_switch_is_read_as_postgres_reads_it(
        px: Proxy) -> None:
    """The switch is refused before anything behind it is read: both the proxy and Postgres
    read the second Query as UTF-8, where it is one literal."""
    c = RawClient(px.host, px.port)
    c.login("alice", "alice", TEST_DATABASE)
    c.send_raw(p.Query("SET client_encoding TO 'SJIS'").encode() + _evil_query())
    assert errors(c.recv_until_ready()) == ["0A000"]
    msgs = c.recv_until_ready()
    rows = [m.values for m in msgs if isinstance(m, p.DataRow)]
    assert errors(msgs) == [] and len(rows) == 1 and b"FROM visits" in (rows[0][0] or b"")
    # extended protocol: the refusal fails the batch, so what follows it up to Sync is skipped
    c.send_raw(b"".join(m.encode() for m in (
        p.Parse("", "SET client_encoding TO 'SJIS'"), p.Bind("", "", (), (), ()),
        p.Execute("", 0), p.Parse("", EVIL.decode()), p.Bind("", "", (), (), ()),
        p.Execute("", 0), p.Sync())))
    msgs = c.recv_until_ready()
    assert errors(msgs) == ["0A000"]
    assert not any(isinstance(m, (p.RowDescription, p.DataRow)) for m in msgs), msgs
    c.close()


def test_a_statement_pipelined_behind_an_unseen_switch_is_not_answered(
        px: Proxy, switch_function: str) -> None:
    """A switch the classifier cannot see (inside a function): the statement sent behind it in
    the same write has been forwarded before the backend reports the new encoding; the
    session ends there and none of its rows reach the client (and the restricted role sees no
    rows of visits anyway: the second wall)."""
    c = RawClient(px.host, px.port)
    c.login("alice", "alice", TEST_DATABASE)
    c.send_raw(p.Query(f"SELECT {switch_function}('client_encoding', 'SJIS')").encode()
               + _evil_query())
    seen = c.until_closed()
    fatal = [m for m in seen if isinstance(m, p.ErrorResponse) and m.get("S") == "FATAL"]
    assert [m.sqlstate for m in fatal] == ["0A000"], seen
    described = [m for m in seen if isinstance(m, p.RowDescription)]
    # (the first statement's own reply may be cut short too)
    assert all(f.name == switch_function for m in described for f in m.fields), seen
