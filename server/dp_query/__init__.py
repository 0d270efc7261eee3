"""The DP query path: a statement from a session, prepared, charged, run, released, answered."""

from server.dp_query.request import DPRequest
from server.dp_query.service import DPService, LedgerUnavailable, QueryFailed

__all__ = ["DPRequest", "DPService", "LedgerUnavailable", "QueryFailed"]
