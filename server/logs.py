"""Logging: a JSON formatter, and one line per statement (session, analyst, kind, outcome, time).

Statement lines never carry query text, parameter values or results: an
operator's log must not become a copy of the data the proxy protects. Their
fields go both into the text message and, for the JSON format, as keys.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from config.models import LogConfig, LogFormat, StatementLog

STATEMENT_LOGGER = "dp_proxy.statement"
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any `fields` given as extra."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                    + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def _formatter(fmt: LogFormat) -> logging.Formatter:
    return JSONFormatter() if fmt is LogFormat.JSON else logging.Formatter(_TEXT_FORMAT)


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The proxy's own handler on the root logger (others, such as a test runner's, stay)."""


def configure(level: str, fmt: LogFormat = LogFormat.TEXT) -> None:
    """Log to standard error at `level` in the given format."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    handler = _Handler()
    handler.setFormatter(_formatter(fmt))
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))


def set_format(fmt: LogFormat) -> None:
    """Switch the format of the proxy's log lines (at start from the config, and on reload)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, _Handler):
            handler.setFormatter(_formatter(fmt))


class StatementLogger:
    """Writes the per-statement lines a `LogConfig` asks for."""

    def __init__(self, config: LogConfig) -> None:
        self.mode = config.statements
        self.log_all = self.mode is StatementLog.ALL
        self._log = logging.getLogger(STATEMENT_LOGGER)

    def wants(self, kind: str, sqlstate: str | None) -> bool:
        if self.mode is StatementLog.NONE or not self._log.isEnabledFor(logging.INFO):
            return False
        return self.mode is StatementLog.ALL or kind != "pass_through" or sqlstate is not None

    def write(self, session: int, analyst: str, kind: str, sqlstate: str | None,
              seconds: float) -> None:
        outcome = "ok" if sqlstate is None else "error"
        ms = round(seconds * 1000, 3)
        fields = {"session": session, "analyst": analyst, "kind": kind, "outcome": outcome,
                  "sqlstate": sqlstate, "duration_ms": ms}
        self._log.info("session=%s analyst=%s kind=%s outcome=%s sqlstate=%s duration_ms=%s",
                       session, analyst, kind, outcome, sqlstate or "-", ms,
                       extra={"fields": fields})
