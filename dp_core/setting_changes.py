"""Setting changes the proxy refuses: when a statement is parsed, or at Bind for parameters' values.

A session must not make Postgres read SQL differently from the proxy (standard_conforming_strings
off, a client-only encoding) nor run as another role. `SET`, `set_config()` and `UPDATE
pg_settings` are the ways a statement changes them. Where `set_config()` takes its name or value
from a parameter (`set_config('client_encoding', $1, false)`, as psycopg changes the encoding),
the statement carries `SettingAtBind`s and `bound_refusal` checks the values at Bind, against
the same rules and with the same errors as the literal form.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dp_core.errors import DPError, FeatureNotSupported
from dp_core.parsetree import func_name, literal, walk
from dp_core.reach import role_setting_refusal

EncodingCheck = Callable[[str], bool]
"""Whether a client_encoding value (as SET takes it) names an encoding the proxy reads as Postgres does."""
EncodingHelp = Callable[[str], tuple[str, str]]
"""Why a client_encoding value is refused, and what to use instead (a detail and a hint)."""

LEXING_SETTINGS = frozenset({"standard_conforming_strings", "client_encoding"})
TRUE_WORDS = frozenset({"on", "1", "t", "tr", "tru", "true", "y", "ye", "yes"})
"""What Postgres reads as boolean true."""


@dataclass(frozen=True)
class Parameter:
    """A statement's parameter `$number`, where a literal could be."""

    number: int


@dataclass(frozen=True)
class SettingAtBind:
    """A `set_config(name, value, ...)` with a parameter for its name or value: checked at Bind."""

    name: str | Parameter
    value: str | int | Parameter | None
    """A literal, a parameter, or None for anything else (no literal, to the rules)."""


def utf8_only(value: str) -> bool:
    return re.sub(r"[^0-9a-z]", "", value.lower()) in ("utf8", "unicode")


def utf8_help(value: str) -> tuple[str, str]:
    return ("the proxy must read SQL in the client encoding as Postgres does, and reads it "
            "only in UTF8 here", "use UTF8")


class SettingChanges:
    """The refusals of setting changes, for a classifier with its encoding rule."""

    def __init__(self, encoding_ok: EncodingCheck = utf8_only,
                 encoding_help: EncodingHelp = utf8_help) -> None:
        self._encoding_ok = encoding_ok
        self._encoding_help = encoding_help

    def refusal(self, ntype: str, body: Mapping[str, Any]
                ) -> tuple[DPError | None, tuple[SettingAtBind, ...]]:
        """The refusal of a statement that changes a setting the proxy depends on (refused
        before anything pipelined behind it is read the old way), or the checks left for Bind."""
        if ntype == "VariableSetStmt" and body.get("kind") == "VAR_SET_VALUE":
            args = body.get("args", [])
            err = self.value_refusal(body.get("name", "").lower(),
                                     literal(args[0]) if len(args) == 1 else None)
            if err is not None:
                return err, ()
        at_bind: list[SettingAtBind] = []
        for fc in walk(body, "FuncCall"):
            if func_name(fc) != "set_config":
                continue
            args = fc.get("args", [])
            name = _literal_or_parameter(args[0]) if args else None
            value: str | int | Parameter | None = \
                _literal_or_parameter(args[1]) if len(args) > 1 else None
            deferred = isinstance(name, Parameter) or (
                isinstance(value, Parameter) and isinstance(name, str)
                and name.lower() in LEXING_SETTINGS)
            if deferred and ntype != "PrepareStmt":  # (a PREPARE's values come by EXECUTE)
                assert isinstance(name, (str, Parameter))
                at_bind.append(SettingAtBind(name, value))
                continue
            if not isinstance(name, str):
                return FeatureNotSupported(
                    "set_config() with a name that is not a literal or a parameter is not "
                    "allowed through dp-proxy",
                    detail="the proxy must know which setting it changes: some change how "
                           "SQL is read, or the session's role",
                    hint="write the setting's name as a string literal, or pass it as a "
                         "parameter"), ()
            err = self.value_refusal(name.lower(), None if isinstance(value, Parameter) else value)
            if err is not None:
                return err, ()
        for upd in walk({ntype: body}, "UpdateStmt"):  # (its rule calls set_config)
            if upd.get("relation", {}).get("relname") == "pg_settings":
                return FeatureNotSupported(
                    "UPDATE of pg_settings is not allowed through dp-proxy",
                    detail="it changes settings the proxy cannot follow there: some change how "
                           "SQL is read", hint="use SET"), ()
        return None, tuple(at_bind)

    def bound_refusal(self, checks: Sequence[SettingAtBind],
                      values: Sequence[str | None]) -> DPError | None:
        """The refusal of a Bind's parameter `values` (as text; None for NULL) for `checks`:
        what the literal form would get."""
        for check in checks:
            name = _bound(check.name, values)
            if not isinstance(name, str):
                continue  # (Postgres refuses a NULL name itself)
            err = role_setting_refusal(name) or self.value_refusal(
                name.lower(), _bound(check.value, values))
            if err is not None:
                return err
        return None

    def value_refusal(self, name: str, value: str | int | None) -> DPError | None:
        """The refusal of setting `name` to `value` (a literal; None for anything else), when
        it changes how SQL is read."""
        if name not in LEXING_SETTINGS:
            return None
        if name == "standard_conforming_strings":
            if value is None or str(value).lower() not in TRUE_WORDS:
                return FeatureNotSupported(
                    "dp-proxy needs standard_conforming_strings = on",
                    detail="it reads string literals as Postgres does with that setting; with "
                           "it off, 'a\\' would mean something else to Postgres",
                    hint="leave standard_conforming_strings at its default, on")
            return None
        if value is None:
            return FeatureNotSupported(
                "client_encoding can only be set to a literal or a parameter through dp-proxy",
                detail="the proxy must know the encoding to read what follows as Postgres does",
                hint="write the encoding's name as a string literal, e.g. 'UTF8', or pass it "
                     "as a parameter")
        if not self._encoding_ok(str(value)):
            detail, hint = self._encoding_help(str(value))
            return FeatureNotSupported(f"client_encoding {value} is not supported by dp-proxy",
                                       detail=detail, hint=hint)
        return None


def _literal_or_parameter(node: Any) -> str | int | Parameter | None:
    """A literal, a parameter (also cast: `$1::text`), or None for anything else."""
    inner = node["TypeCast"].get("arg") if isinstance(node, dict) and "TypeCast" in node else node
    ref = inner.get("ParamRef") if isinstance(inner, dict) else None
    if isinstance(ref, dict):
        return Parameter(int(ref.get("number", 0)))
    return literal(node)


def _bound(arg: str | int | Parameter | None, values: Sequence[str | None]) -> str | int | None:
    if not isinstance(arg, Parameter):
        return arg
    return values[arg.number - 1] if 0 < arg.number <= len(values) else None
