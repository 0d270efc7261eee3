"""Faults: clients that vanish or never read, pushdowns that time out.

SLOW is a DP query whose pushdown takes seconds (a join with a public view that sleeps on
each row, `SLOW_DP_QUERY` of tests/support/backend.py), so that things can happen while it
runs, after its charge.
"""

from __future__ import annotations

import socket
import time

import psycopg
import pytest

from config import Config
from tests.support.backend import SLOW_DP_QUERY, TEST_DATABASE, Backend, prepared_backend
from tests.support.proxy import LoopThread, Proxy, process_rss_mib, running_proxy, spent
from tests.support.rawclient import RawClient

Q = "SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.125) browser, ANON_COUNT(*) FROM visits GROUP BY browser"
SLOW = SLOW_DP_QUERY.replace("epsilon=0.2", "epsilon=0.125")
"""Its pushdown runs for seconds (a join with a view that sleeps 50 ms a row)."""


def _charges(backend: Backend, analyst: str) -> list[tuple[str, float]]:
    with psycopg.connect(backend.admin_dsn, autocommit=True) as admin:
        rows = admin.execute("SELECT kind, epsilon FROM dpproxy.ledger WHERE analyst = %s "
                             "ORDER BY id", (analyst,)).fetchall()
    return [(str(k), float(e or 0)) for k, e in rows]


def _reset(proxy: Proxy, analyst: str) -> None:
    with psycopg.connect(proxy.dsn("admin"), autocommit=True) as adm:
        adm.execute(f"SELECT dp_reset_budget('{analyst}')")


def _waiting_pushdowns(backend: Backend) -> int:
    with psycopg.connect(backend.admin_dsn, autocommit=True) as admin:
        row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE usename = 'dp_pushdown' "
                            "AND state = 'active' AND backend_type = 'client backend' AND datname = %s",
                            (TEST_DATABASE,)).fetchone()
    assert row is not None
    return int(row[0])


def _wait_for(condition: object, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def test_client_gone_mid_query_charges_once_and_leaks_nothing(proxy: Proxy, backend: Backend) -> None:
    from server import wire as p

    _reset(proxy, "alice")
    before = _charges(backend, "alice")
    c = RawClient(proxy.host, proxy.port)
    c.login("alice", "alice", TEST_DATABASE)
    c.send(p.Query(SLOW))
    assert _wait_for(lambda: len(_charges(backend, "alice")) > len(before)), "never charged"
    assert _waiting_pushdowns(backend) == 1, "the pushdown should still run"
    c.sock.close()  # the client vanishes while its pushdown runs
    assert _wait_for(lambda: not proxy.server.sessions)
    # the proxy stopped its pushdown when the client went: nothing left running
    assert _wait_for(lambda: _waiting_pushdowns(backend) == 0, 5.0)
    new = _charges(backend, "alice")[len(before):]
    assert [k for k, _ in new if k == "charge"] == ["charge"], new
    assert sum(e for k, e in new if k == "charge") == pytest.approx(0.125)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:  # and the proxy answers again
        assert conn.execute(Q).fetchall()


def test_pushdown_timeout_is_a_generic_charged_error(loop_thread: LoopThread, demo_config: Config,
                                                     backend: Backend) -> None:
    config = demo_config.model_copy(update={"backend": demo_config.backend.model_copy(
        update={"statement_timeout": 0.5})})
    with running_proxy(loop_thread, config, backend) as px:
        _reset(px, "alice")
        with psycopg.connect(px.dsn(), autocommit=True) as conn:
            started = time.monotonic()
            with pytest.raises(psycopg.Error) as info:
                conn.execute(SLOW)
            assert time.monotonic() - started < 5
            assert "charged" in str(info.value)  # the generic error after a charge
            assert "visits" not in str(info.value) and "browser" not in str(info.value)
            assert spent(conn).epsilon == pytest.approx(0.125)
        with psycopg.connect(px.dsn(), autocommit=True) as conn:
            assert conn.execute(Q).fetchall()


def test_a_client_that_never_reads_does_not_fill_the_proxy(proxy: Proxy) -> None:
    """Backpressure: the proxy stops reading the backend when the client stops reading."""
    from server import wire as p

    c = RawClient(proxy.host, proxy.port)
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    c.login("alice", "alice", TEST_DATABASE)
    before = process_rss_mib()
    # about 400 MB of rows, pass-through
    c.send(p.Query("SELECT repeat('x', 2000) FROM generate_series(1, 200000)"))
    time.sleep(3)
    grown = process_rss_mib() - before
    c.close()
    assert grown < 64, f"the proxy buffered {grown:.0f} MiB for a client that does not read"
    assert _wait_for(lambda: not proxy.server.sessions)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


@pytest.mark.live  # starts a Postgres of its own
def test_backend_restart_mid_session(loop_thread: LoopThread, demo_config: Config) -> None:
    """Postgres restarted under a running proxy: sessions get a clean error, new sessions work
    within seconds, and the ledger (in that Postgres) still matches what was spent."""
    from server.embedded import EmbeddedPostgres

    with EmbeddedPostgres() as pg:
        own = prepared_backend(pg.dsn(), demo_config, embedded=pg)
        with running_proxy(loop_thread, demo_config, own) as px:
            _reset(px, "alice")
            conn = psycopg.connect(px.dsn(), autocommit=True)
            assert conn.execute(Q).fetchall()
            pg.restart()
            with pytest.raises(psycopg.Error) as info:
                conn.execute("SELECT 1").fetchall()
            assert info.value.sqlstate in (None, "08006", "57P01"), info.value
            conn.close()
            answered = time.monotonic()

            def works() -> bool:
                try:
                    with psycopg.connect(px.dsn(), autocommit=True) as fresh:
                        fresh.execute("SELECT 1").fetchall()
                        return bool(fresh.execute(Q).fetchall())
                except psycopg.Error:
                    return False

            assert _wait_for(works, 15.0), "no working session after the restart"
            assert time.monotonic() - answered < 15
            events = _charges(own, "alice")
            last_reset = max(i for i, (k, _) in enumerate(events) if k == "reset")
            charged = sum(e for k, e in events[last_reset:] if k == "charge")
            # the running total and the ledger's rows agree, and both answers are in them
            assert spent(px).epsilon == pytest.approx(charged) and charged >= 0.25 - 1e-9


def test_a_ledger_that_fails_after_the_charge_loses_no_answer(px: Proxy) -> None:
    """The budget left is read after the answer is charged, for its notice: a ledger that does
    not answer then leaves the notice without it, and the charged answer is released."""
    ledger = px.server.dp.ledger
    real, real_charge = ledger.budget, ledger.charge
    charged = False

    async def charge(*args: object, **kwargs: object) -> object:
        nonlocal charged
        out = await real_charge(*args, **kwargs)
        charged = True
        return out

    async def flaky(analyst: str, conn: object = None) -> object:
        if charged:  # (the checks before the charge read it too)
            raise OSError("the ledger went away")
        return await real(analyst, conn)

    ledger.budget, ledger.charge = flaky, charge
    try:
        with psycopg.connect(px.dsn(), autocommit=True) as conn:
            notices: list[str] = []
            conn.add_notice_handler(lambda d: notices.append(d.message_primary or ""))
            rows = conn.execute("SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits").fetchall()
            assert len(rows) == 1 and rows[0][0] > 0
            assert notices and notices[-1].startswith("DP answer: spent epsilon 1,")
            assert notices[-1].endswith("the budget left is unknown (the ledger did not answer)")
    finally:
        ledger.budget, ledger.charge = real, real_charge
    assert spent(px).epsilon == 1.0
