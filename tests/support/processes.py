"""`dp-proxy` run as a process: a config file for the suite's database, a free port, a reload."""

from __future__ import annotations

import socket
import time
from dataclasses import replace
from pathlib import Path

import psycopg

from server.bootstrap import demo_config_text
from server.dsn import DSN

from .backend import Backend


def config_for(backend: Backend, tmp_path: Path, pushdown: str, restricted: str,
               ledger: str | None = None) -> Path:
    """demo.toml against the test database, with the given role[:password] for each DSN (the
    suite's ledger role by default)."""
    def dsn(role: str) -> DSN:
        user, _, password = role.partition(":")
        return replace(backend.pushdown, user=user, password=password or None)

    path = tmp_path / "existing.toml"
    ledger_dsn = backend.dsns.ledger if ledger is None else dsn(ledger)
    path.write_text(demo_config_text(replace(backend.dsns, pushdown=dsn(pushdown),
                                             restricted=dsn(restricted), ledger=ledger_dsn)))
    return path


def free_port() -> int:
    """A TCP port of 127.0.0.1 nothing listens on (just now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def await_epsilon_total(conn: psycopg.Connection, value: float, failure: str) -> None:
    """Wait up to 5 s until the session's dp_budget() shows `value` as its ε total (a reload
    is taken asynchronously)."""
    for _ in range(50):
        row = conn.execute("SELECT epsilon_total FROM dp_budget()").fetchone()
        if row is not None and float(row[0]) == value:
            return
        time.sleep(0.1)
    raise AssertionError(failure)
