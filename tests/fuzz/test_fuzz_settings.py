"""Differential fuzzing of dp.* settings: random Queries of one to three statements (SET,
SET LOCAL, RESET, RESET ALL, SHOW, transaction blocks, savepoints, a statement that fails)
sent to the proxy with dp.epsilon and to Postgres with a setting of its own (ref.epsilon);
after each Query both must show the same results, value, error and transaction status.
dp.epsilon is a setting the proxy keeps itself: this checks that it follows Postgres's rules
for settings, implicit blocks of several statements included: those of one simple Query, and
those of an extended-protocol batch up to its Sync (psycopg's pipeline mode).

Seeded (DPPROXY_TEST_FUZZ_SEED to replay a failure); each failure prints its Queries.
"""

from __future__ import annotations

import os
import random
from typing import Any

import psycopg
import pytest

from tests.support.backend import Backend
from tests.support.proxy import Proxy, show

SEED = int(os.environ.get("DPPROXY_TEST_FUZZ_SEED", random.randrange(1 << 30)))
SEQUENCES = int(os.environ.get("DPPROXY_TEST_FUZZ_ROUNDS", 30))

STATEMENTS = [
    "SET dp.epsilon = 0.5", "SET dp.epsilon = 0.25", "SET LOCAL dp.epsilon = 2.0",
    "SET dp.epsilon TO DEFAULT", "RESET dp.epsilon", "RESET ALL", "SHOW dp.epsilon", "SELECT 1",
    "SELECT 1/0", "BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT a", "ROLLBACK TO a", "RELEASE a",
    "SAVEPOINT b", "ROLLBACK TO SAVEPOINT b", "START TRANSACTION", "END", "ABORT",
    "COMMIT AND CHAIN", "ROLLBACK AND CHAIN", "BEGIN ISOLATION LEVEL REPEATABLE READ",
    "DISCARD ALL", "SET LOCAL dp.epsilon = 0.5",
]


PIPELINED = [s for s in STATEMENTS if "dp.epsilon" in s] + ["SELECT 1/0"]
"""What pipelines are made of. Known divergences leave the rest out: in a batch, the proxy
cannot tell whether statements the backend ran before a SET LOCAL dp.* opened a block (it
warns only when none ran; Postgres when no block is open), and DISCARD ALL after a dp.*
statement runs where Postgres refuses it (25001: the backend sees it first in the batch)."""


def _queries(rng: random.Random, pipeline: bool = False) -> list[str]:
    statements = PIPELINED if pipeline else STATEMENTS
    out = []
    for _ in range(rng.randrange(4, 14)):
        n = rng.choice([1, 1, 2, 2, 3])
        out.append("; ".join(rng.choice(statements) for _ in range(n)))
    out.append("ROLLBACK")
    return out


def _outcome(conn: psycopg.Connection, sql: str, name: str, pipeline: bool = False
             ) -> tuple[Any, ...]:
    """Every result of the Query (or its error), then SHOW and the transaction status; with
    `pipeline`, its statements are sent in one extended-protocol batch."""
    results: list[Any] = []
    error = None
    sql = sql.replace("dp.epsilon", name)
    if pipeline:
        try:
            with conn.pipeline():
                for one in sql.split("; "):
                    conn.execute(one)
        except psycopg.Error as e:
            error = e.sqlstate
        # (which results a pipeline shows before its error depends on timing: not compared)
    else:
        try:
            cur = conn.execute(sql)
            while True:
                rows = cur.fetchall() if cur.description else None
                results.append((cur.statusmessage, rows))
                if not cur.nextset():
                    break
        except psycopg.Error as e:
            error = e.sqlstate
    status = conn.info.transaction_status
    if status == psycopg.pq.TransactionStatus.INERROR:
        return (results, error, "INERROR")
    return (results, error, status.name, show(conn, name))


@pytest.mark.parametrize("pipeline", [False, True], ids=["simple", "pipeline"])
@pytest.mark.parametrize("round_", range(SEQUENCES))
def test_dp_settings_follow_postgres_in_any_sequence(
        px: Proxy, backend: Backend, round_: int, pipeline: bool) -> None:
    queries = _queries(random.Random(SEED + round_), pipeline)
    with psycopg.connect(px.dsn(), autocommit=True, prepare_threshold=None) as conn, \
            psycopg.connect(backend.admin_dsn, autocommit=True, prepare_threshold=None,
                            options="-c ref.epsilon=1.0") as ref:
        notices: list[list[str | None]] = [[], []]
        conn.add_notice_handler(lambda d: notices[0].append(d.sqlstate))
        ref.add_notice_handler(lambda d: notices[1].append(d.sqlstate))
        for i, sql in enumerate(queries):
            ours = _outcome(conn, sql, "dp.epsilon", pipeline)
            theirs = _outcome(ref, sql, "ref.epsilon", pipeline)
            assert ours == theirs, (f"DPPROXY_TEST_FUZZ_SEED={SEED} round {round_}: query {i}",
                                    queries[: i + 1])
            assert notices[0] == notices[1], (f"DPPROXY_TEST_FUZZ_SEED={SEED} round {round_}: "
                                              f"notices after query {i}", queries[: i + 1])
