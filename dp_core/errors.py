"""The DP errors that reach a client, one class per SQLSTATE; anything else is an internal bug.

Errors of the protocol, logins and transaction state are the server's (server/errors.py).
"""

from __future__ import annotations


class DPError(Exception):
    """An error a client should see, with its SQLSTATE.

    `detail` and `hint` are optional and go to the ErrorResponse fields of the
    same names; messages never echo protected values or pushdown SQL.
    """

    sqlstate = "XX000"
    severity = "ERROR"

    def __init__(self, message: str, *, detail: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail
        self.hint = hint


class InsufficientPrivilege(DPError):
    """Protected data read outside the DP path, or an admin call by a non-admin."""

    sqlstate = "42501"


class FeatureNotSupported(DPError):
    """A DP query outside the supported rules; the message names the rule."""

    sqlstate = "0A000"


class BudgetExhausted(DPError):
    """The query's cost would take the analyst past the budget."""

    sqlstate = "53400"


class SyntaxError_(DPError):
    sqlstate = "42601"


class InvalidParameterValue(DPError):
    sqlstate = "22023"


class UndefinedColumn(DPError):
    sqlstate = "42703"


class AmbiguousColumn(DPError):
    sqlstate = "42702"


class InvalidColumnReference(DPError):
    sqlstate = "42P10"


class GroupingError(DPError):
    """A column outside an aggregate that is not a GROUP BY key (Postgres's 42803)."""

    sqlstate = "42803"


class UndefinedObject(DPError):
    sqlstate = "42704"


class UndefinedTable(DPError):
    """A relation name that the session's search_path does not find (Postgres's 42P01)."""

    sqlstate = "42P01"


class StatementTooComplex(DPError):
    sqlstate = "54001"


class ProgramLimitExceeded(DPError):
    sqlstate = "54000"


class InternalError(DPError):
    """A bug in dp-proxy; the message says so and reveals nothing about data."""

    sqlstate = "XX000"

    def __init__(self, message: str = "internal error in dp-proxy (this is a bug)") -> None:
        super().__init__(message)
