"""Read a TOML config file, apply DPPROXY_* environment overrides, and report every problem."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from config.models import Config

ENV_PREFIX = "DPPROXY_"
"""`DPPROXY_LISTEN__PORT=7000` sets `listen.port`; `__` separates levels."""

_NOT_OVERRIDES = {"DPPROXY_CONFIG"}
_NOT_OVERRIDES_PREFIX = "DPPROXY_TEST_"
"""The test suite's own variables (DPPROXY_TEST_DSN, DPPROXY_TEST_FUZZ_SEED, ...)."""


class ConfigError(Exception):
    """The configuration is invalid; `problems` lists each one as `location: message`."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s)\n" + "\n".join(problems))


def load_config(path: str | Path, environ: Mapping[str, str] | None = None) -> Config:
    """Load and validate `path`; raises ConfigError listing every problem found."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(str(path), [f"cannot read the file: {e.strerror}"]) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), [f"not valid TOML: {e}"]) from None
    except UnicodeDecodeError:
        raise ConfigError(str(path), ["not valid UTF-8 text"]) from None
    return config_from_mapping(raw, source=str(path), environ=environ)


def config_from_mapping(
    raw: dict[str, Any], source: str = "<config>", environ: Mapping[str, str] | None = None
) -> Config:
    """Validate an already parsed config, after applying environment overrides."""
    problems: list[str] = []
    data = apply_env_overrides(raw, os.environ if environ is None else environ, problems)
    try:
        config = Config.model_validate(data)
    except ValidationError as e:
        problems.extend(format_validation_error(e))
        raise ConfigError(source, problems) from None
    if problems:
        raise ConfigError(source, problems)
    return config


def apply_env_overrides(
    raw: dict[str, Any], environ: Mapping[str, str], problems: list[str]
) -> dict[str, Any]:
    """Return a copy of `raw` with every DPPROXY_A__B=v applied as raw[a][b] = v."""
    data = _deep_copy(raw)
    for key in sorted(environ):
        if not key.startswith(ENV_PREFIX) or key in _NOT_OVERRIDES or \
                key.startswith(_NOT_OVERRIDES_PREFIX):
            continue
        path = [p.lower() for p in key[len(ENV_PREFIX):].split("__")]
        if not all(path):
            problems.append(f"{key}: empty level in the variable name")
            continue
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(f"{key}: {'.'.join(path)} crosses a value that is not a table")
                break
            node = child
        else:
            node[path[-1]] = _parse_env_value(environ[key])
    return data


def _parse_env_value(text: str) -> Any:
    """Interpret a variable's value as a TOML value when it is one, else as a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _deep_copy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def format_validation_error(e: ValidationError) -> list[str]:
    """One line per error: the dotted location, then what is wrong."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"]
        for prefix in ("Value error, ", "Assertion failed, "):
            if msg.startswith(prefix):
                msg = msg[len(prefix):]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (a typo?)"
        elif err["type"] == "missing":
            msg = "required but missing"
        lines.append(f"{loc}: {msg}")
    return lines


def reloaded(current: Config, new: Config) -> Config:
    """`current` with what a reload takes from `new`: the analysts and [log]."""
    return current.model_copy(update={"analysts": new.analysts, "log": new.log})
