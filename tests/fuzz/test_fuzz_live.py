"""Live fuzzing: malformed input to a running proxy never crashes it, leaks, or touches other sessions.

Seeded (DPPROXY_TEST_FUZZ_SEED to replay a failure), bounded in time. Each round logs
in, sends one kind of damage, reads until the proxy answers or closes, and
hangs up; a bystander session keeps working throughout.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import time

import psycopg

from server import wire as p
from tests.support.backend import TEST_DATABASE, Backend
from tests.support.proxy import LoopThread, Proxy, process_rss_mib
from tests.support.rawclient import RawClient

ROUNDS = 150
SEED = int(os.environ.get("DPPROXY_TEST_FUZZ_SEED", random.randrange(1 << 30)))
_TAGS = b"QPBDEHSXCdcfFp" + bytes(random.Random(1).sample(range(256), 16))


def _frame(tag: bytes, body: bytes) -> bytes:
    return tag + struct.pack("!i", len(body) + 4) + body


def _damage(rng: random.Random) -> tuple[str, bytes]:
    """One piece of malformed (or merely odd) client input, after a successful login."""
    kind = rng.choice(["random tag", "bad length", "huge length", "truncated", "bad utf-8",
                       "random stream", "bad bind", "bad parse", "flipped byte"])
    if kind == "random tag":
        return kind, _frame(bytes([rng.choice(_TAGS)]), rng.randbytes(rng.randrange(0, 64)))
    if kind == "bad length":
        return kind, bytes([rng.choice(_TAGS)]) + struct.pack("!i", rng.randrange(-2**31, 4))
    if kind == "huge length":
        return kind, b"Q" + struct.pack("!i", rng.randrange(2**26 + 1, 2**31)) + b"SELECT"
    if kind == "truncated":
        full = p.Query("SELECT name FROM countries").encode()
        return kind, full[: rng.randrange(1, len(full))]
    if kind == "bad utf-8":
        return kind, _frame(b"Q", b"SELECT '" + rng.randbytes(8) + b"'\0")
    if kind == "random stream":
        return kind, rng.randbytes(rng.randrange(1, 300))
    if kind == "bad bind":
        body = b"\0s\0" + struct.pack("!h", rng.randrange(-3, 5)) + rng.randbytes(rng.randrange(0, 20))
        return kind, p.Parse("s", "SELECT 1", ()).encode() + _frame(b"B", body) + p.Sync().encode()
    if kind == "bad parse":
        body = b"\0" + b"SELECT $1" + b"\0" + struct.pack("!h", rng.randrange(-5, 100))
        return kind, _frame(b"P", body) + p.Sync().encode()
    msg = bytearray(p.Query("SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits").encode())
    msg[rng.randrange(len(msg))] = rng.randrange(256)
    return kind, bytes(msg) + p.Sync().encode()


def _drain(c: RawClient, seconds: float) -> None:
    """Read what the proxy says until it is ready again or closes (or `seconds` pass)."""
    c.sock.settimeout(seconds)
    try:
        while True:
            if isinstance(c.recv(), p.ReadyForQuery):
                return
    except (ConnectionError, OSError, p.ProtocolViolation):
        return


def _restricted_backends(backend: Backend) -> int:
    with psycopg.connect(backend.admin_dsn, autocommit=True) as admin:
        row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE usename LIKE 'dp\\_analyst\\_%%' "
                            "AND datname = %s", (TEST_DATABASE,)).fetchone()
    assert row is not None
    return int(row[0])


def test_live_fuzz(proxy: Proxy, backend: Backend, loop_thread: LoopThread) -> None:
    rng = random.Random(SEED)
    bystander = psycopg.connect(proxy.dsn(), autocommit=True)
    rss_before = process_rss_mib()
    kinds: dict[str, int] = {}
    try:
        for i in range(ROUNDS):
            kind, data = _damage(rng)
            kinds[kind] = kinds.get(kind, 0) + 1
            c = RawClient(proxy.host, proxy.port)
            try:
                c.login("alice", "alice", TEST_DATABASE)
                c.send_raw(data)
                if rng.random() < 0.5:
                    c.sock.shutdown(socket.SHUT_WR)  # half-close: the proxy sees EOF mid-frame
                _drain(c, 0.5)
            except (ConnectionError, OSError):
                pass
            finally:
                c.close()
            if i % 25 == 0:
                assert bystander.execute("SELECT count(*) FROM countries").fetchone()[0] > 0, \
                    f"seed {SEED}, round {i} ({kind})"
        assert bystander.execute("EXPLAIN SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits"
                                 ).fetchall()
    finally:
        bystander.close()
    assert set(kinds) >= {"random tag", "bad length", "truncated"}, kinds
    # nothing leaked: every fuzzed session and its backend connection are gone
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (proxy.server.sessions or _restricted_backends(backend)):
        time.sleep(0.1)
    assert not proxy.server.sessions, f"seed {SEED}: sessions left open"
    assert _restricted_backends(backend) == 0, f"seed {SEED}: backend connections leaked"
    # memory stays bounded: huge declared lengths are refused before anything is buffered
    assert process_rss_mib() - rss_before < 64, f"seed {SEED}"
    with psycopg.connect(proxy.dsn(), autocommit=True) as fresh:
        assert fresh.execute("SELECT 1").fetchone() == (1,)
