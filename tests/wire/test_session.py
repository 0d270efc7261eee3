"""Session behaviour at the message level: ordering, error recovery, limits, TLS, failures."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import psycopg
import pytest

from config import Config
from server import wire as p
from tests.support.backend import TEST_DATABASE, Backend
from tests.support.proxy import LoopThread, Proxy, running_proxy
from tests.support.rawclient import RawClient, close_all, errors, tags


@pytest.fixture(autouse=True)
def _close_raw_clients() -> Iterator[None]:
    yield
    close_all()


@pytest.fixture
def raw(proxy: Proxy) -> Iterator[RawClient]:
    c = RawClient(proxy.host, proxy.port)
    msgs = c.login("alice", "alice", TEST_DATABASE)
    assert isinstance(msgs[-1], p.ReadyForQuery), msgs
    yield c
    c.close()


def test_startup_sequence(proxy: Proxy) -> None:
    c = RawClient(proxy.host, proxy.port)
    msgs = c.login("alice", "alice", TEST_DATABASE)
    names = tags(msgs)
    assert names[:2] == ["Authentication", "Authentication"]  # SASL final, then OK
    assert names[-2:] == ["BackendKeyData", "ReadyForQuery"]
    params = {m.name: m.value for m in msgs if isinstance(m, p.ParameterStatus)}
    for key in ("server_version", "server_encoding", "client_encoding", "DateStyle", "TimeZone",
                "integer_datetimes", "standard_conforming_strings"):
        assert key in params, key
    assert params["client_encoding"] == "UTF8"
    c.close()


def test_simple_query_mixing_local_and_pass_through(raw: RawClient) -> None:
    raw.send(p.Query("SELECT 1 AS a; SET dp.epsilon = 0.5; SHOW dp.epsilon; SELECT 2 AS b"))
    msgs = raw.recv_until_ready()
    completes = [m.command_tag for m in msgs if isinstance(m, p.CommandComplete)]
    assert completes == ["SELECT 1", "SET", "SHOW", "SELECT 1"]
    rows = [m.values for m in msgs if isinstance(m, p.DataRow)]
    assert rows == [(b"1",), (b"0.5",), (b"2",)]
    assert sum(isinstance(m, p.ReadyForQuery) for m in msgs) == 1


def test_simple_query_stops_at_a_refused_statement(raw: RawClient) -> None:
    raw.send(p.Query("SELECT 1; SELECT * FROM visits; SELECT 3"))
    msgs = raw.recv_until_ready()
    assert errors(msgs) == ["42501"]
    assert [m.values for m in msgs if isinstance(m, p.DataRow)] == [(b"1",)]
    raw.send(p.Query("SELECT 4"))
    assert [m.values for m in raw.recv_until_ready() if isinstance(m, p.DataRow)] == [(b"4",)]


def test_simple_query_stops_at_a_backend_error(raw: RawClient) -> None:
    raw.send(p.Query("SELECT 1; SHOW dp.delta; SELECT 1/0; SHOW dp.epsilon"))
    msgs = raw.recv_until_ready()
    assert errors(msgs) == ["22012"]
    assert [m.values for m in msgs if isinstance(m, p.DataRow)] == [(b"1",), (b"1e-06",)]


def test_syntax_error_and_empty_query(raw: RawClient) -> None:
    raw.send(p.Query("SELEC 1"))
    assert errors(raw.recv_until_ready()) == ["42601"]
    raw.send(p.Query(""))
    assert "EmptyQueryResponse" in tags(raw.recv_until_ready())


def test_extended_refused_parse_discards_until_sync(raw: RawClient) -> None:
    raw.send(
        p.Parse("ok", "SELECT $1::int", (23,)), p.Bind("", "ok", (), (b"5",)), p.Execute(""),
        p.Parse("bad", "SELECT * FROM visits"),
        p.Bind("", "ok", (), (b"6",)), p.Execute(""),  # skipped after the error
        p.Sync(),
    )
    msgs = raw.recv_until_ready()
    assert tags(msgs) == ["ParseComplete", "BindComplete", "DataRow", "CommandComplete",
                          "ErrorResponse", "ReadyForQuery"]
    assert errors(msgs) == ["42501"]
    raw.send(p.Bind("", "ok", (), (b"7",)), p.Execute(""), p.Sync())
    msgs = raw.recv_until_ready()
    assert [m.values for m in msgs if isinstance(m, p.DataRow)] == [(b"7",)]


def test_extended_backend_error_skips_following_local_messages(raw: RawClient) -> None:
    raw.send(
        p.Parse("", "SELECT 1/x FROM (VALUES (0), (1)) AS t(x)"), p.Bind("", ""), p.Execute(""),
        p.Parse("s", "SHOW dp.epsilon"), p.Bind("", "s"), p.Execute(""),
        p.Sync(),
    )
    msgs = raw.recv_until_ready()
    # Postgres may fail at Bind (constant folding) or Execute; either way nothing after runs
    assert tags(msgs)[0] == "ParseComplete" and tags(msgs)[-2:] == ["ErrorResponse", "ReadyForQuery"]
    assert errors(msgs) == ["22012"]
    assert "DataRow" not in tags(msgs) and tags(msgs).count("ParseComplete") == 1


def test_extended_local_statement_describe_and_execute(raw: RawClient) -> None:
    raw.send(
        p.Parse("show", "SHOW dp.max_groups_contributed"), p.Describe(b"S", "show"),
        p.Bind("portal", "show"), p.Describe(b"P", "portal"), p.Execute("portal"),
        p.Parse("set", "SET dp.max_groups_contributed = 4"), p.Describe(b"S", "set"),
        p.Bind("", "set"), p.Execute(""),
        p.Bind("", "show"), p.Execute(""), p.Close(b"S", "show"), p.Close(b"P", "portal"),
        p.Sync(),
    )
    msgs = raw.recv_until_ready()
    assert tags(msgs) == [
        "ParseComplete", "ParameterDescription", "RowDescription", "BindComplete", "RowDescription",
        "DataRow", "CommandComplete", "ParseComplete", "ParameterDescription", "NoData",
        "BindComplete", "CommandComplete", "BindComplete", "DataRow", "CommandComplete",
        "CloseComplete", "CloseComplete", "ReadyForQuery",
    ]
    rows = [m.values for m in msgs if isinstance(m, p.DataRow)]
    assert rows == [(b"1",), (b"4",)]
    desc = next(m for m in msgs if isinstance(m, p.RowDescription))
    assert desc.fields[0].name == "dp.max_groups_contributed"


def test_pipelined_batches_in_one_write_keep_their_order(raw: RawClient) -> None:
    # one write: forwarded batches (the fast path notes each as its Sync alone), a failing
    # one, a Bind/Execute left before the last Sync, and a batch the proxy answers itself
    raw.send(
        p.Parse("", "SELECT 1"), p.Bind("", ""), p.Describe(b"P", ""), p.Execute(""), p.Sync(),
        p.Parse("", "SELECT 1/x FROM (VALUES (0)) AS t(x)"), p.Bind("", ""), p.Execute(""),
        p.Sync(),
        p.Parse("two", "SELECT 2"), p.Bind("", "two"), p.Execute(""), p.Sync(),
        p.Bind("", "two"), p.Execute(""),
        p.Parse("s", "SHOW dp.epsilon"), p.Bind("", "s"), p.Execute(""), p.Sync(),
        p.Query("SELECT 3"),
    )
    batches = [raw.recv_until_ready() for _ in range(5)]
    assert tags(batches[0]) == ["ParseComplete", "BindComplete", "RowDescription", "DataRow",
                                "CommandComplete", "ReadyForQuery"]
    assert tags(batches[1])[-2:] == ["ErrorResponse", "ReadyForQuery"]
    assert errors(batches[1]) == ["22012"]
    assert tags(batches[2]) == ["ParseComplete", "BindComplete", "DataRow", "CommandComplete",
                                "ReadyForQuery"]
    assert tags(batches[3]) == ["BindComplete", "DataRow", "CommandComplete", "ParseComplete",
                                "BindComplete", "DataRow", "CommandComplete", "ReadyForQuery"]
    rows = [m.values for m in batches[3] if isinstance(m, p.DataRow)]
    assert rows[0] == (b"2",) and float(rows[1][0] or b"nan") > 0
    assert [m.values for m in batches[4] if isinstance(m, p.DataRow)] == [(b"3",)]


def test_query_after_unsynced_extended_frames_in_one_write(raw: RawClient) -> None:
    # the fast path notes the Parse/Bind/Execute before the Query one by one (no Sync ends
    # them): their replies come first, then the Query's, and the session goes on as usual
    raw.send(p.Parse("", "SELECT 1"), p.Bind("", ""), p.Execute(""), p.Query("SELECT 2"))
    msgs = raw.recv_until_ready()
    assert tags(msgs) == ["ParseComplete", "BindComplete", "DataRow", "CommandComplete",
                          "RowDescription", "DataRow", "CommandComplete", "ReadyForQuery"]
    assert [m.values for m in msgs if isinstance(m, p.DataRow)] == [(b"1",), (b"2",)]
    raw.send(p.Parse("", "SELECT 3"), p.Bind("", ""), p.Execute(""), p.Sync())
    assert [m.values for m in raw.recv_until_ready() if isinstance(m, p.DataRow)] == [(b"3",)]


def test_extended_flush_returns_replies_before_sync(raw: RawClient) -> None:
    raw.send(p.Parse("q", "SELECT 1"), p.Describe(b"S", "q"), p.Flush())
    assert tags([raw.recv(), raw.recv(), raw.recv()]) == [
        "ParseComplete", "ParameterDescription", "RowDescription"]
    raw.send(p.Bind("", "q"), p.Execute(""), p.Sync())
    assert tags(raw.recv_until_ready()) == ["BindComplete", "DataRow", "CommandComplete",
                                             "ReadyForQuery"]


def test_transaction_status_is_reported(raw: RawClient) -> None:
    raw.send(p.Query("BEGIN"))
    assert raw.recv_until_ready()[-1] == p.ReadyForQuery(b"T")
    raw.send(p.Query("SELECT 1/0"))
    assert raw.recv_until_ready()[-1] == p.ReadyForQuery(b"E")
    raw.send(p.Query("ROLLBACK"))
    assert raw.recv_until_ready()[-1] == p.ReadyForQuery(b"I")


def test_function_call_protocol_is_refused(raw: RawClient) -> None:
    raw.send(p.FunctionCall(b"\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00"), p.Sync())
    msgs = raw.recv_until_ready()
    assert errors(msgs) == ["0A000"]


# ---------------------------------------------------------------------------- malformed input


@pytest.mark.parametrize(
    "garbage",
    [
        b"Q" + struct.pack("!i", 2),  # length below 4
        b"Q" + struct.pack("!i", 9) + b"abcde",  # unterminated string
        b"?" + struct.pack("!i", 4),  # unknown message type
        b"Q" + struct.pack("!i", 2**31 - 1),  # oversized
    ],
)
def test_malformed_message_closes_only_that_session(proxy: Proxy, raw: RawClient, garbage: bytes) -> None:
    other = RawClient(proxy.host, proxy.port)
    other.login("bob", "bob", TEST_DATABASE)
    raw.send_raw(garbage)
    err = raw.recv()
    assert isinstance(err, p.ErrorResponse) and err.sqlstate == "08P01" and err.get("S") == "FATAL"
    assert raw.closed_by_server()
    other.send(p.Query("SELECT 1"))
    assert [m.values for m in other.recv_until_ready() if isinstance(m, p.DataRow)] == [(b"1",)]
    other.close()


def test_invalid_utf8_is_answered_as_postgres_does(raw: RawClient) -> None:
    raw.send_raw(b"Q" + struct.pack("!i", 8) + b"\xff\xfe\xfd\x00")
    assert errors(raw.recv_until_ready()) == ["22021"]
    # the proxy must read this one to route it: the same error, and the session goes on
    raw.send_raw(b"Q" + struct.pack("!i", 27) + b"SELECT * FROM visits\xff\xfe\x00")
    msgs = raw.recv_until_ready()
    assert errors(msgs) == ["22021"]
    assert 'invalid byte sequence for encoding "UTF8": 0xff' in str(msgs[0])
    raw.send(p.Query("SELECT 1"))
    assert [m.values for m in raw.recv_until_ready() if isinstance(m, p.DataRow)] == [(b"1",)]


def _startup(version: int, params: dict[str, str]) -> bytes:
    body = struct.pack("!i", version) + b"".join(
        k.encode() + b"\0" + v.encode() + b"\0" for k, v in params.items()) + b"\0"
    return struct.pack("!i", len(body) + 4) + body


@pytest.mark.parametrize(("minor", "options"), [(2, {}), (0, {"_pq_.unknown": "on"}),
                                                (7, {"_pq_.a": "1", "_pq_.b": "2"})])
def test_newer_minor_versions_and_protocol_options_are_negotiated_as_postgres_does(
        proxy: Proxy, minor: int, options: dict[str, str]) -> None:
    c = RawClient(proxy.host, proxy.port)
    c.send_raw(_startup(3 << 16 | minor, {"user": "alice", "database": TEST_DATABASE, **options}))
    first = c.recv()
    # as Postgres 16: the newest version it speaks, 3.0, and the options it does not know,
    # before authentication; the session then goes on at 3.0
    assert first == p.NegotiateProtocolVersion(196608, tuple(options))
    auth = c.recv()
    assert isinstance(auth, p.Authentication) and auth.code == p.AUTH_SASL
    c.close()
    # a whole login: the options are not settings for the backend
    c = RawClient(proxy.host, proxy.port)
    real_send = c.send

    def send_startup(*msgs: object) -> None:
        if msgs and isinstance(msgs[0], p.StartupMessage):
            c.send_raw(_startup(3 << 16 | minor, {**msgs[0].parameters, **options}))
            assert c.recv() == p.NegotiateProtocolVersion(196608, tuple(options))
            return
        real_send(*msgs)

    c.send = send_startup  # type: ignore[method-assign]
    msgs = c.login("alice", "alice", TEST_DATABASE)
    assert isinstance(msgs[-1], p.ReadyForQuery), msgs
    c.send = real_send  # type: ignore[method-assign]
    c.send(p.Query("SELECT 1"))
    assert not errors(c.recv_until_ready())
    c.close()


def test_a_3_0_startup_gets_no_negotiation(proxy: Proxy) -> None:
    c = RawClient(proxy.host, proxy.port)
    c.send_raw(_startup(196608, {"user": "alice", "database": TEST_DATABASE}))
    assert isinstance(c.recv(), p.Authentication)
    c.close()


def test_libpq_asking_for_the_latest_protocol_gets_3_0(proxy: Proxy) -> None:
    if psycopg.pq.version() < 180000:
        pytest.skip("libpq before 18 has no max_protocol_version")
    with psycopg.connect(host=proxy.host, port=proxy.port, user="alice", password="alice",
                         dbname=TEST_DATABASE, max_protocol_version="latest") as conn:
        assert conn.pgconn.full_protocol_version == 30000
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_bad_startup_packets(proxy: Proxy) -> None:
    for major in (2, 4):  # as Postgres: 0A000, and the connection closed
        c = RawClient(proxy.host, proxy.port)
        c.send_raw(_startup(major << 16, {"user": "alice"}))
        err = c.recv()
        assert isinstance(err, p.ErrorResponse) and err.sqlstate == "0A000", err
        assert err.message == f"unsupported frontend protocol {major}.0: server supports 3.0 " \
                              "to 3.0"
        assert c.until_closed() == []
        c.close()
    c = RawClient(proxy.host, proxy.port)
    c.send_raw(_startup(196608, {"database": TEST_DATABASE}))
    err = c.recv()
    assert isinstance(err, p.ErrorResponse) and err.sqlstate == "28000", err
    assert err.message == "no PostgreSQL user name specified in startup packet"
    c.close()
    # a length word that cannot be a start-up packet's: as Postgres, logged and closed
    # without a reply (a client closing right after connecting sends Terminate first)
    for raw in (struct.pack("!i", 3), struct.pack("!i", 7) + b"\0\3\0",
                struct.pack("!i", 10_001) + b"\0\3\0\0", b"X" + struct.pack("!i", 4)):
        c2 = RawClient(proxy.host, proxy.port)
        c2.send_raw(raw)
        assert c2.until_closed() == [], raw
        c2.close()
    # a start-up packet cut short by the client closing: no reply either
    c3 = RawClient(proxy.host, proxy.port)
    c3.send_raw(struct.pack("!i", 40) + b"\0\3\0\0user\0")
    c3.sock.shutdown(socket.SHUT_WR)
    assert c3.until_closed() == []
    c3.close()


def test_plain_ssl_request_gets_n_when_tls_is_off(proxy: Proxy) -> None:
    c = RawClient(proxy.host, proxy.port)
    c.send(p.SSLRequest())
    assert c.sock.recv(1) == b"N"
    c.send(p.GSSENCRequest())
    assert c.sock.recv(1) == b"N"
    msgs = c.login("alice", "alice", TEST_DATABASE)
    assert isinstance(msgs[-1], p.ReadyForQuery)
    c.close()


# ---------------------------------------------------------------------------- limits


def _custom(loop_thread: LoopThread, demo_config: Config, backend: Backend,
            **listen: object) -> contextlib.AbstractContextManager[Proxy]:
    cfg = demo_config.model_copy(update={"listen": demo_config.listen.model_copy(update=listen)})
    return running_proxy(loop_thread, cfg, backend)


def test_max_connections(loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    with _custom(loop_thread, demo_config, backend, max_connections=2) as px:
        a, b = RawClient(px.host, px.port), RawClient(px.host, px.port)
        a.login("alice", "alice", TEST_DATABASE)
        b.login("alice", "alice", TEST_DATABASE)
        c = RawClient(px.host, px.port)  # (refused once logged in: issue 27)
        err = c.login("alice", "alice", TEST_DATABASE)[-1]
        assert isinstance(err, p.ErrorResponse) and err.sqlstate == "53300"
        a.close()
        deadline = time.monotonic() + 10  # the slot frees once the server has seen the close
        while True:
            d = RawClient(px.host, px.port)
            msgs = d.login("alice", "alice", TEST_DATABASE)
            if isinstance(msgs[-1], p.ReadyForQuery) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert isinstance(msgs[-1], p.ReadyForQuery)
        b.close()
        d.close()


def test_startup_and_idle_timeouts(loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    with _custom(loop_thread, demo_config, backend, startup_timeout=0.5, idle_timeout=0.7) as px:
        silent = RawClient(px.host, px.port)
        t0 = time.monotonic()
        assert silent.closed_by_server()
        assert time.monotonic() - t0 < 5
        idle = RawClient(px.host, px.port)
        idle.login("alice", "alice", TEST_DATABASE)
        idle.send(p.Query("SELECT 1"))
        idle.recv_until_ready()
        t_idle = time.monotonic()
        err = idle.recv()
        assert isinstance(err, p.ErrorResponse) and "idle" in (err.message or "")
        assert err.sqlstate == "57P05"
        assert 0.6 < time.monotonic() - t_idle < 3
        assert idle.closed_by_server()
        # a query running longer than the timeout is not idle time: it finishes, and the
        # session is closed only once it has then been idle
        busy = RawClient(px.host, px.port)
        busy.login("alice", "alice", TEST_DATABASE)
        busy.send(p.Query("SELECT pg_sleep(1.6)"))
        msgs = busy.recv_until_ready()
        t_done = time.monotonic()
        assert not any(isinstance(m, p.ErrorResponse) for m in msgs)
        err = busy.recv()
        assert isinstance(err, p.ErrorResponse) and err.sqlstate == "57P05"
        assert 0.6 < time.monotonic() - t_done < 3
        assert busy.closed_by_server()


# ---------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    d = tmp_path_factory.mktemp("tls")
    cert.private_key_pem.write_to_path(str(d / "server.key"))
    cert.cert_chain_pems[0].write_to_path(str(d / "server.crt"))
    ca.cert_pem.write_to_path(str(d / "ca.crt"))
    return d / "server.crt", d / "server.key", d / "ca.crt"


def _tls_proxy(loop_thread: LoopThread, demo_config: Config, backend: Backend,
               files: tuple[Path, Path, Path], require: bool) -> contextlib.AbstractContextManager[Proxy]:
    tls = demo_config.tls.model_copy(update={"cert_file": files[0], "key_file": files[1],
                                             "require": require})
    return running_proxy(loop_thread, demo_config.model_copy(update={"tls": tls}), backend)


def test_tls_sslmode_require_and_verify_full(loop_thread: LoopThread, demo_config: Config,
                                             backend: Backend, tls_files: tuple[Path, Path, Path]) -> None:
    with _tls_proxy(loop_thread, demo_config, backend, tls_files, require=False) as px:
        with psycopg.connect(px.dsn(sslmode="require")) as conn:
            assert conn.pgconn.ssl_in_use
            assert conn.execute("SELECT count(*) FROM countries").fetchone() == (152,)
        with psycopg.connect(px.dsn(sslmode="verify-full", sslrootcert=str(tls_files[2]))) as conn:
            assert conn.pgconn.ssl_in_use
        with psycopg.connect(px.dsn(sslmode="disable")) as conn:  # allowed: require is off
            assert not conn.pgconn.ssl_in_use


def test_tls_required_refuses_plaintext(loop_thread: LoopThread, demo_config: Config,
                                        backend: Backend, tls_files: tuple[Path, Path, Path]) -> None:
    with _tls_proxy(loop_thread, demo_config, backend, tls_files, require=True) as px:
        with pytest.raises(psycopg.OperationalError, match="requires TLS"):
            psycopg.connect(px.dsn(sslmode="disable"))
        with psycopg.connect(px.dsn(sslmode="require")) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)


def test_tls_rejects_bytes_sent_after_ssl_request(loop_thread: LoopThread, demo_config: Config,
                                                  backend: Backend,
                                                  tls_files: tuple[Path, Path, Path]) -> None:
    """CVE-2021-23214: plaintext injected behind an SSLRequest must not be processed."""
    with _tls_proxy(loop_thread, demo_config, backend, tls_files, require=False) as px:
        s = socket.create_connection((px.host, px.port), timeout=5)
        s.sendall(p.SSLRequest().encode() + p.Query("SELECT 1").encode())
        data = s.recv(4096)
        assert data[:1] == b"E" and b"08P01" in data
        s.close()


def test_tls_handshake_with_plain_ssl_module(loop_thread: LoopThread, demo_config: Config,
                                             backend: Backend, tls_files: tuple[Path, Path, Path]) -> None:
    with _tls_proxy(loop_thread, demo_config, backend, tls_files, require=True) as px:
        s = socket.create_connection((px.host, px.port), timeout=5)
        s.sendall(p.SSLRequest().encode())
        assert s.recv(1) == b"S"
        ctx = ssl.create_default_context(cafile=str(tls_files[2]))
        tls = ctx.wrap_socket(s, server_hostname="127.0.0.1")
        assert tls.version() in ("TLSv1.2", "TLSv1.3")
        tls.close()


# ---------------------------------------------------------------------------- backend failures


def test_backend_terminated_gives_its_own_fatal_error_only(proxy: Proxy, backend: Backend) -> None:
    """An administrator's pg_terminate_backend: the client gets the backend's FATAL 57P01 and
    the connection closes, as directly against Postgres; no second FATAL of the proxy's."""
    import asyncpg

    async def terminate(pid: int) -> None:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            await conn.execute(f"SELECT pg_terminate_backend({pid})")
        finally:
            await conn.close()

    c = RawClient(proxy.host, proxy.port)
    c.login("alice", "alice", TEST_DATABASE)
    c.send(p.Query("SELECT pg_backend_pid()"))
    pid = int(next(m for m in c.recv_until_ready() if isinstance(m, p.DataRow)).values[0] or b"0")
    asyncio.run(terminate(pid))
    with contextlib.suppress(OSError):  # the proxy may have closed the socket already
        c.send(p.Query("SELECT 1"))
    msgs = c.until_closed()
    assert errors(msgs) == ["57P01"], msgs
    fatal = next(m for m in msgs if isinstance(m, p.ErrorResponse))
    assert fatal.get(p.FIELD_SEVERITY_V) == "FATAL"

    # a driver sees the backend's error, and its connection closed
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
        asyncio.run(terminate(pid))
        with pytest.raises(psycopg.OperationalError) as caught:
            conn.execute("SELECT 1")
        assert caught.value.sqlstate in ("57P01", None), caught.value
        assert "terminating connection due to administrator command" in str(caught.value)
        assert conn.closed
    # a new session works at once
    with psycopg.connect(proxy.dsn()) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_unreachable_backend_is_a_clean_error(loop_thread: LoopThread, demo_config: Config,
                                              backend: Backend) -> None:
    from dataclasses import replace

    from server.app import ProxyServer

    dead = replace(backend.dsns, restricted=replace(backend.restricted, host="127.0.0.1", port=1))

    async def make() -> ProxyServer:
        cfg = demo_config.model_copy(update={"listen": demo_config.listen.model_copy(update={"port": 0})})
        s = ProxyServer(cfg, dead)
        await s.start()
        return s

    server = loop_thread.run(make())
    try:
        with pytest.raises(psycopg.OperationalError, match="could not connect to the backend database"):
            psycopg.connect(f"host=127.0.0.1 port={server.port} user=alice password=alice "
                            f"dbname={TEST_DATABASE} sslmode=disable")
    finally:
        loop_thread.run(server.stop())


def test_query_after_failing_unsynced_extended_frames_waits_for_sync(raw: RawClient) -> None:
    # as Postgres: after an extended error the backend skips everything up to a Sync, the
    # Query included; the proxy knows the error ends its extended frames, not the Query
    raw.send(p.Parse("", "SELECT 1/x FROM (VALUES (0)) AS t(x)"), p.Bind("", ""),
             p.Execute(""), p.Query("SELECT 2"))
    first = [raw.recv()]
    while not isinstance(first[-1], p.ErrorResponse):
        first.append(raw.recv())
    assert tags(first)[0] == "ParseComplete" and errors(first) == ["22012"]
    raw.send(p.Sync())
    assert tags(raw.recv_until_ready())[-1:] == ["ReadyForQuery"]
    raw.send(p.Query("SELECT 3"))
    assert [m.values for m in raw.recv_until_ready() if isinstance(m, p.DataRow)] == [(b"3",)]
    raw.send(p.Query("SHOW dp.epsilon"))  # answered once every reply awaited has come
    assert [m.values for m in raw.recv_until_ready() if isinstance(m, p.DataRow)] == [(b"1.0",)]


# ---------------------------------------------------------------------------- backend pid


def test_the_client_is_told_its_backends_pid_and_cancels_by_it(proxy: Proxy,
                                                               backend: Backend) -> None:
    """BackendKeyData carries the pid of the backend that serves the session, as
    pg_backend_pid() (and pg_stat_activity) give it; the secret key is the proxy's own."""
    c = RawClient(proxy.host, proxy.port)
    msgs = c.login("alice", "alice", TEST_DATABASE)
    key = next(m for m in msgs if isinstance(m, p.BackendKeyData))
    c.send(p.Query("SELECT pg_backend_pid()"))
    row = next(m for m in c.recv_until_ready() if isinstance(m, p.DataRow))
    assert row.values[0] == str(key.process_id).encode()
    c.close()

    async def with_asyncpg() -> None:
        conn = await asyncpg.connect(host=proxy.host, port=proxy.port, user="alice",
                                     password="alice", database=TEST_DATABASE, ssl=False)
        try:
            assert conn.get_server_pid() == await conn.fetchval("SELECT pg_backend_pid()")
        finally:
            await conn.close()

    asyncio.run(with_asyncpg())
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn, \
            psycopg.connect(proxy.dsn(), autocommit=True) as other:
        pid = conn.info.backend_pid
        assert conn.execute("SELECT pg_backend_pid()").fetchone() == (pid,)
        assert other.info.backend_pid != pid
        # an administrator finds the session's backend by it (analysts cannot read
        # pg_stat_activity through the proxy: it shows other analysts' queries)
        with psycopg.connect(backend.admin_dsn) as admin:
            assert admin.execute("SELECT query FROM pg_stat_activity WHERE pid = %s",
                                 (pid,)).fetchone() == ("SELECT pg_backend_pid()",)
        # a wrong key cancels nothing, and is answered as soon as a right one
        wrong = struct.pack("!iiii", 16, 80877102, pid, 12345)

        def answered_in(packet: bytes) -> float:
            with socket.create_connection((proxy.host, proxy.port)) as sock:
                t0 = time.monotonic()
                sock.sendall(packet)
                assert sock.recv(1) == b""
                return time.monotonic() - t0

        timer = threading.Timer(0.3, answered_in, (wrong,))
        timer.start()
        assert conn.execute("SELECT 1 FROM pg_sleep(1)").fetchone() == (1,)
        timer.join()
        assert answered_in(wrong) < 1
        # the right key (psycopg's own cancel) cancels the running statement
        threading.Timer(0.3, conn.cancel_safe).start()
        t0 = time.monotonic()
        with pytest.raises(psycopg.errors.QueryCanceled):
            conn.execute("SELECT pg_sleep(10)")
        assert time.monotonic() - t0 < 5
