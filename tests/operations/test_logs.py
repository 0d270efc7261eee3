"""Logs: one line per statement with session, analyst, kind, outcome and duration; never values."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest

from config import Config
from config.models import LogConfig, LogFormat, StatementLog
from server.logs import STATEMENT_LOGGER, JSONFormatter, configure, set_format
from tests.support.backend import Backend
from tests.support.proxy import LoopThread, Proxy, running_proxy

SECRET_LITERAL = "zq-literal-5531"
SECRET_PARAM = "zq-param-8812"


@contextmanager
def _proxy_logging(loop_thread: LoopThread, config: Config, backend: Backend,
                   mode: StatementLog) -> Iterator[tuple[Proxy, list[logging.LogRecord]]]:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger(STATEMENT_LOGGER)
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    cfg = config.model_copy(update={"log": LogConfig(statements=mode)})
    try:
        with running_proxy(loop_thread, cfg, backend) as px:
            yield px, records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _fields(records: list[logging.LogRecord]) -> list[dict[str, object]]:
    return [r.fields for r in records]  # type: ignore[attr-defined]


def test_every_statement_is_one_line_without_values(
        loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    with _proxy_logging(loop_thread, demo_config, backend, StatementLog.ALL) as (px, records):
        with psycopg.connect(px.dsn("admin"), autocommit=True) as adm:
            adm.execute("SELECT dp_reset_budget('alice')")
        records.clear()
        with psycopg.connect(px.dsn(), autocommit=True) as conn:
            conn.execute(f"SELECT name FROM countries WHERE name <> '{SECRET_LITERAL}'").fetchall()
            with pytest.raises(psycopg.errors.UndefinedTable):
                conn.execute(f"SELECT '{SECRET_LITERAL}' FROM no_such_table")
            conn.execute("SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.1) browser, ANON_COUNT(*) "
                         f"FROM visits WHERE browser <> '{SECRET_LITERAL}' GROUP BY browser").fetchall()
            conn.execute("SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.1) ANON_COUNT(*) FROM visits "
                         "WHERE browser <> %s", (SECRET_PARAM,), prepare=True).fetchall()
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(f"SELECT * FROM visits WHERE browser = '{SECRET_LITERAL}'")
            conn.execute("SET dp.epsilon = 0.25")
            conn.execute("SELECT code FROM countries WHERE code = %s", (SECRET_PARAM,),
                         prepare=True).fetchall()
            pid = conn.info.backend_pid
    fields = _fields(records)
    got = [(f["kind"], f["outcome"], f["sqlstate"]) for f in fields]
    assert got == [
        ("pass_through", "ok", None),
        ("pass_through", "error", "42P01"),
        ("dp_query", "ok", None),
        ("dp_query", "ok", None),
        ("refused", "error", "42501"),
        ("local", "ok", None),
        ("pass_through", "ok", None),
    ]
    for f in fields:
        assert f["session"] == pid and f["analyst"] == "alice"
        assert isinstance(f["duration_ms"], float) and f["duration_ms"] >= 0
    dp_ms = [f["duration_ms"] for f in fields if f["kind"] == "dp_query"]
    assert all(isinstance(ms, float) and ms > 0 for ms in dp_ms)
    text = "\n".join(r.getMessage() + json.dumps(r.fields) for r in records)  # type: ignore[attr-defined]
    for secret in (SECRET_LITERAL, SECRET_PARAM, "countries", "visits", "browser"):
        assert secret not in text


def test_default_mode_logs_what_the_proxy_answers_and_failures_only(
        loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    assert demo_config.log.statements is StatementLog.DP
    with _proxy_logging(loop_thread, demo_config, backend, StatementLog.DP) as (px, records), \
            psycopg.connect(px.dsn(), autocommit=True) as conn:
        for _ in range(3):
            conn.execute("SELECT 1").fetchall()
        conn.execute("SHOW dp.epsilon").fetchall()
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
    assert [(f["kind"], f["sqlstate"]) for f in _fields(records)] == [
        ("local", None), ("pass_through", "22012")]


def test_reload_to_all_logs_an_open_sessions_pass_through(
        loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    with _proxy_logging(loop_thread, demo_config, backend, StatementLog.DP) as (px, records), \
            psycopg.connect(px.dsn(), autocommit=True) as conn:
        conn.execute("SELECT 1").fetchall()
        assert records == []
        loop_thread.run(px.server.reload(px.server.config.model_copy(
            update={"log": LogConfig(statements=StatementLog.ALL)})))
        conn.execute("SELECT 2").fetchall()
        assert [(f["kind"], f["sqlstate"]) for f in _fields(records)] == [("pass_through", None)]
        loop_thread.run(px.server.reload(px.server.config.model_copy(
            update={"log": LogConfig(statements=StatementLog.DP)})))
        conn.execute("SELECT 3").fetchall()
        assert len(records) == 1


def test_none_logs_nothing(loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    with _proxy_logging(loop_thread, demo_config, backend, StatementLog.NONE) as (px, records), \
            psycopg.connect(px.dsn(), autocommit=True) as conn:
        conn.execute("SHOW dp.epsilon").fetchall()
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
    assert records == []


def test_json_format_one_object_per_line(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    root = logging.getLogger()
    level = root.level
    try:
        configure("INFO", LogFormat.JSON)
        logging.getLogger(STATEMENT_LOGGER).info(
            "session=%s", 7, extra={"fields": {"session": 7, "kind": "dp_query"}})
        set_format(LogFormat.TEXT)
        logging.getLogger("dp_proxy").info("plain %s", "text")
    finally:
        for h in [h for h in root.handlers if type(h).__name__ == "_Handler"]:
            root.removeHandler(h)
        root.setLevel(level)
    first, second = stream.getvalue().splitlines()
    obj = json.loads(first)
    assert obj["level"] == "INFO" and obj["logger"] == STATEMENT_LOGGER
    assert obj["message"] == "session=7" and obj["session"] == 7 and obj["kind"] == "dp_query"
    assert obj["time"].endswith("Z")
    assert second.endswith("INFO dp_proxy: plain text")


def test_json_formatter_keeps_exceptions() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    obj = json.loads(JSONFormatter().format(record))
    assert obj["message"] == "failed" and "ValueError: boom" in obj["exception"]
