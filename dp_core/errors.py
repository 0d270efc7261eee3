"""Errors that reach a client, one class per SQLSTATE; anything else is an internal bug."""

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


class InvalidBinaryRepresentation(DPError):
    sqlstate = "22P03"


class CharacterNotInRepertoire(DPError):
    """Client text that is not valid in the session's client encoding."""

    sqlstate = "22021"


class UntranslatableCharacter(DPError):
    """Text for the client with a character its client encoding lacks."""

    sqlstate = "22P05"


class InFailedSqlTransaction(DPError):
    sqlstate = "25P02"


class NoActiveSqlTransaction(DPError):
    sqlstate = "25P01"


class ObjectNotInPrerequisiteState(DPError):
    sqlstate = "55000"


class BindMismatch(DPError):
    """A Bind that does not fit its statement: an error in the batch, not the end of the session."""

    sqlstate = "08P01"


class UndefinedObject(DPError):
    sqlstate = "42704"


class InvalidPassword(DPError):
    sqlstate = "28P01"
    severity = "FATAL"


class InvalidAuthorization(DPError):
    sqlstate = "28000"
    severity = "FATAL"


class ProtocolViolationError(DPError):
    sqlstate = "08P01"
    severity = "FATAL"


class ConnectionFailure(DPError):
    sqlstate = "08006"
    severity = "FATAL"


class TooManyConnections(DPError):
    sqlstate = "53300"
    severity = "FATAL"


class CannotConnectNow(DPError):
    sqlstate = "57P03"
    severity = "FATAL"


class QueryCanceled(DPError):
    sqlstate = "57014"


class AdminShutdown(DPError):
    sqlstate = "57P01"
    severity = "FATAL"


class StatementTooComplex(DPError):
    sqlstate = "54001"


class InternalError(DPError):
    """A bug in dp-proxy; the message says so and reveals nothing about data."""

    sqlstate = "XX000"

    def __init__(self, message: str = "internal error in dp-proxy (this is a bug)") -> None:
        super().__init__(message)
