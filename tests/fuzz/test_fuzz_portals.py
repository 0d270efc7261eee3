"""Differential fuzzing of the extended protocol: statements the proxy answers itself (a DP
query, dp_budget()) against statements of the same shape that Postgres answers, in random
well-formed sequences of Parse, Bind, Describe, Execute with and without row limits, Close,
Flush, Sync and transaction blocks. The client must see the same messages either way (but
the DP answer's notice): the proxy's own statements are indistinguishable, to a driver, from
Postgres's.

Seeded (DPPROXY_TEST_FUZZ_SEED to replay a failure); each failure prints its sequence.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import psycopg
import pytest

from server import wire as p
from tests.support.backend import TEST_DATABASE
from tests.support.proxy import Proxy, spent
from tests.support.rawclient import RawClient, errors

SEED = int(os.environ.get("DPPROXY_TEST_FUZZ_SEED", random.randrange(1 << 30)))
SEQUENCES = int(os.environ.get("DPPROXY_TEST_FUZZ_ROUNDS", 30))

# (answered by the proxy, answered by Postgres): the same columns and number of rows
SHAPES = {
    "rows": ("SELECT x.* FROM dp_budget() AS b, generate_series(1, 7) AS x",
             "SELECT x.* FROM (VALUES (1)) AS b, generate_series(1, 7) AS x"),
    "dp": ("SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.01) ANON_COUNT(*) AS n FROM visits",
           "SELECT count(*) AS n FROM countries"),
    "fails": ("SELECT 1/0", "SELECT 1/0"),
    "copy": ("COPY (SELECT x.* FROM dp_budget() AS b, generate_series(1, 3) AS x) TO STDOUT",
             "COPY (SELECT x.* FROM (VALUES (1)) AS b, generate_series(1, 3) AS x) TO STDOUT"),
    "cursor": ("DECLARE c NO SCROLL CURSOR FOR SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.01) "
               "ANON_COUNT(*) AS n FROM visits",
               "DECLARE c NO SCROLL CURSOR FOR SELECT count(*) AS n FROM countries"),
    "fetch": ("FETCH 2 FROM c", "FETCH 2 FROM c"),
}


@dataclass
class _Model:
    """What the generator believes exists, to keep sequences well formed (no name defined
    twice without a Close, as drivers never do)."""

    statements: set[str] = field(default_factory=set)
    portals: set[str] = field(default_factory=set)
    in_block: bool = False
    unnamed_portal_unknown: bool = False
    """After a simple Query: Postgres drops the unnamed portal when the Query gets to run a
    statement, not when it fails before (1/0 fails in planning); the proxy cannot tell, so
    the unnamed portal is not used until bound again."""


def _sequence(rng: random.Random) -> list[tuple[str, tuple[object, ...]]]:
    """Messages as (kind, arguments), with the query given by shape name."""
    m = _Model()
    out: list[tuple[str, tuple[object, ...]]] = []
    for _ in range(rng.randrange(8, 30)):
        kind = rng.choice(["parse", "bind", "bind", "describe", "execute", "execute", "close",
                           "flush", "sync", "sync", "query", "block"])
        stmt, portal = rng.choice(["", "s1"]), rng.choice(["", "p1"])
        if kind == "parse" and (stmt == "" or stmt not in m.statements):
            out.append(("parse", (stmt, rng.choice(list(SHAPES)))))
            m.statements.add(stmt)
        elif kind == "bind" and (portal == "" or portal not in m.portals):
            out.append(("bind", (portal, stmt, rng.choice([(), (0,), (1,)]))))
            m.portals.add(portal)
            m.unnamed_portal_unknown &= portal != ""
        elif kind == "describe" and not (portal == "" and m.unnamed_portal_unknown):
            out.append(("describe", rng.choice([(b"S", stmt), (b"P", portal)])))
        elif kind == "execute" and not (portal == "" and m.unnamed_portal_unknown):
            out.append(("execute", (portal, rng.choice([0, 0, 1, 2, 3, 10]))))
        elif kind == "close":
            which = rng.choice([b"S", b"P"])
            out.append(("close", (which, stmt if which == b"S" else portal)))
            (m.statements if which == b"S" else m.portals).discard(
                stmt if which == b"S" else portal)
        elif kind == "flush":
            out.append(("flush", ()))
        elif kind in ("sync", "query", "block"):
            out.append(("sync", ()))  # a simple Query only after a batch is synced
            if kind == "query":
                out.append(("query", (rng.choice(list(SHAPES)),)))
                m.portals.discard("")
                m.unnamed_portal_unknown = True
            elif kind == "block":
                command = "BEGIN" if not m.in_block else rng.choice(["COMMIT", "ROLLBACK"])
                out.append(("command", (command,)))
                m.in_block = command == "BEGIN"
            if not m.in_block:
                m.portals.clear()  # (the implicit transaction ended)
    out.append(("sync", ()))
    if m.in_block:
        out.append(("command", ("ROLLBACK",)))
    return out


def _run(proxy: Proxy, seq: list[tuple[str, tuple[object, ...]]], side: int) -> list[list[str]]:
    """Send `seq` with the proxy's (side 0) or Postgres's (side 1) statements; the messages
    back, cycle by cycle, as type names (SQLSTATEs for errors), notices left out."""
    c = RawClient(proxy.host, proxy.port)
    try:
        assert not errors(c.login("alice", "alice", TEST_DATABASE))
        cycles: list[list[str]] = []
        for kind, args in seq:
            if kind == "parse":
                name, shape = args
                c.send(p.Parse(str(name), SHAPES[str(shape)][side]))
            elif kind == "bind":
                portal, stmt, formats = args
                c.send(p.Bind(str(portal), str(stmt), (), (), formats))  # type: ignore[arg-type]
            elif kind == "describe":
                c.send(p.Describe(args[0], str(args[1])))  # type: ignore[arg-type]
            elif kind == "execute":
                c.send(p.Execute(str(args[0]), int(args[1])))  # type: ignore[call-overload]
            elif kind == "close":
                c.send(p.Close(args[0], str(args[1])))  # type: ignore[arg-type]
            elif kind == "flush":
                c.send(p.Flush())
            else:
                if kind == "sync":
                    c.send(p.Sync())
                elif kind == "query":
                    c.send(p.Query(SHAPES[str(args[0])][side]))
                else:
                    c.send(p.Query(str(args[0])))
                cycle = []
                for msg in c.recv_until_ready():
                    if isinstance(msg, p.NoticeResponse):
                        continue
                    if isinstance(msg, p.ErrorResponse):
                        cycle.append(f"Error {msg.sqlstate}")
                    elif isinstance(msg, p.ReadyForQuery):
                        cycle.append(f"Ready {msg.status.decode()}")
                    else:
                        cycle.append(type(msg).__name__)
                cycles.append(cycle)
        return cycles
    finally:
        c.close()


@pytest.mark.parametrize("round_", range(SEQUENCES))
def test_proxy_answers_look_like_postgres_answers(px: Proxy, round_: int) -> None:
    seed = SEED + round_
    seq = _sequence(random.Random(seed))
    ours, theirs = _run(px, seq, 0), _run(px, seq, 1)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == b, (f"DPPROXY_TEST_FUZZ_SEED={SEED} round {round_}: cycle {i} differs",
                        [s for s in seq], a, b)


# ---------------------------------------------------------------------------- what it found


def _kinds(c: RawClient) -> list[str]:
    return [f"Error {m.sqlstate}" if isinstance(m, p.ErrorResponse) else type(m).__name__
            for m in c.recv_until_ready() if not isinstance(m, p.NoticeResponse)]


def test_an_error_back_before_the_batch_is_forwarded(px: Proxy) -> None:
    """The backend's error for an Execute can come back before the rest of the batch (sent in
    other writes) is forwarded: the backend ignores that rest, so the proxy expects no reply
    to it. Before, it waited for one, and the session hung at its next statement."""
    c = RawClient(px.host, px.port, timeout=5)
    try:
        assert not errors(c.login("alice", "alice", TEST_DATABASE))
        c.send(p.Query("BEGIN"))
        assert _kinds(c) == ["CommandComplete", "ReadyForQuery"]
        c.send(p.Parse("s1", SHAPES["dp"][0]), p.Sync())
        assert _kinds(c) == ["ParseComplete", "ReadyForQuery"]
        for msg in (p.Execute("", 10), p.Describe(b"S", ""), p.Sync()):
            c.send(msg)  # one write each
        assert _kinds(c) == ["Error 34000", "ReadyForQuery"]
        c.send(p.Query(SHAPES["dp"][0]))
        assert _kinds(c) == ["Error 25P02", "ReadyForQuery"]
        c.send(p.Query("ROLLBACK"))
        assert _kinds(c) == ["CommandComplete", "ReadyForQuery"]
    finally:
        c.close()


def test_a_result_that_fails_leaves_nothing_behind(px: Proxy) -> None:
    """A Bind with more result formats than the DP answer has columns is refused before the
    charge (Postgres refuses it at Bind: 08P01), and the next answers work. Before, it was
    refused by the backend after the charge, and the proxy's result statement, whose Close
    the backend then skipped, made every later answer of the session fail (42P05)."""
    with psycopg.connect(px.dsn(), autocommit=True) as other:
        before = spent(other).epsilon
        c = RawClient(px.host, px.port, timeout=10)
        try:
            assert not errors(c.login("alice", "alice", TEST_DATABASE))
            c.send(p.Parse("", SHAPES["dp"][0]), p.Bind("", "", (), (), (0, 0, 0)),
                   p.Execute("", 0), p.Sync())
            assert _kinds(c) == ["ParseComplete", "BindComplete", "Error 08P01", "ReadyForQuery"]
            assert spent(other).epsilon == before
            for _ in range(2):
                c.send(p.Parse("", SHAPES["dp"][0]), p.Bind("", "", (), (), (1,)),
                       p.Execute("", 0), p.Sync())
                assert _kinds(c) == ["ParseComplete", "BindComplete", "DataRow",
                                     "CommandComplete", "ReadyForQuery"]
        finally:
            c.close()
        assert spent(other).epsilon == pytest.approx(before + 2 * 0.01)
