"""Errors of the proxy's own sessions: protocol, login, transaction state, encodings, busy.

One class per SQLSTATE (and severity), all `DPError`s so that a session reports them the
same way; the DP path's own errors are in dp_core/errors.py.
"""

from __future__ import annotations

from dp_core.errors import DPError, FeatureNotSupported


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


class InvalidCatalogName(DPError):
    """A start-up packet names a database this proxy does not serve."""

    sqlstate = "3D000"
    severity = "FATAL"


class IdleSessionTimeout(DPError):
    sqlstate = "57P05"
    severity = "FATAL"


class UnsupportedSession(FeatureNotSupported):
    """A session setting the proxy cannot work with (an encoding, non-standard strings)."""

    severity = "FATAL"


class UnsupportedProtocolVersion(FeatureNotSupported):
    """A start-up packet asking for a major protocol version other than 3."""

    severity = "FATAL"


class PushdownBusy(DPError):
    """No pushdown connection, or no turn of the analyst's, came free in time: nothing was
    charged, and trying again may succeed."""

    sqlstate = "53300"


class LedgerTooNew(RuntimeError):
    """The ledger was made or upgraded by a newer dp-proxy: this one cannot start on it (an
    older proxy would charge answers without what the newer schema keeps)."""
