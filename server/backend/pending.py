"""What the proxy expects back from the backend: the Pending kinds and the reply tag tables."""

from __future__ import annotations

from enum import Enum


class Pending(Enum):
    """What a forwarded client message is waiting for."""

    QUERY = "Q"  # simple query: ends with ReadyForQuery, relayed
    QUERY_SPLIT = "q"  # one statement of a split simple query: ReadyForQuery swallowed
    INTERNAL_QUERY = "iQ"  # the proxy's own BEGIN / COMMIT around one: all but errors swallowed
    PARSE = "P"
    BIND = "B"
    DESCRIBE = "D"  # ends with RowDescription or NoData
    EXECUTE = "E"  # ends with CommandComplete, EmptyQueryResponse or PortalSuspended
    CLOSE = "C"
    SYNC = "S"
    # the proxy's own statements (DP results): their replies are swallowed, rows relayed
    INTERNAL_PARSE = "iP"
    INTERNAL_BIND = "iB"
    INTERNAL_CLOSE = "iC"
    INTERNAL_EXECUTE = "iE"  # a statement of the proxy's own without rows (CommandComplete)
    # the proxy's own failing statement (`fail_transaction`): its error is swallowed, uncounted
    INTERNAL_FAIL = "iF"
    INTERNAL_FAIL_QUERY = "iFQ"  # (as a Query: its ReadyForQuery swallowed too)
    # the proxy's own question to the session's backend (`fetch_own`): its rows kept for the
    # proxy, nothing but an error relayed
    INTERNAL_FETCH = "iR"  # its Execute, in the client's extended batch
    INTERNAL_FETCH_QUERY = "iRQ"  # as a Query (its RowDescription and ReadyForQuery too)


EXTENDED_TAGS = {
    b"P": Pending.PARSE,
    b"B": Pending.BIND,
    b"D": Pending.DESCRIBE,
    b"E": Pending.EXECUTE,
    b"C": Pending.CLOSE,
    b"S": Pending.SYNC,
}
COMPLETES = {
    b"1": (Pending.PARSE,),
    b"2": (Pending.BIND,),
    b"3": (Pending.CLOSE,),
    b"T": (Pending.DESCRIBE,),
    b"n": (Pending.DESCRIBE,),
    b"C": (Pending.EXECUTE,),
    b"I": (Pending.EXECUTE,),
    b"s": (Pending.EXECUTE,),
}
SIMPLE = (Pending.QUERY, Pending.QUERY_SPLIT, Pending.INTERNAL_QUERY,
          Pending.INTERNAL_FAIL_QUERY, Pending.INTERNAL_FETCH_QUERY)
UNRELAYED_READY = (Pending.QUERY_SPLIT, Pending.INTERNAL_QUERY, Pending.INTERNAL_FAIL_QUERY,
                   Pending.INTERNAL_FETCH_QUERY)
"""Cycles whose ReadyForQuery the client does not see: the proxy's own."""
FAILS = (Pending.INTERNAL_FAIL, Pending.INTERNAL_FAIL_QUERY)
INTERNAL_COMPLETES = {
    b"1": Pending.INTERNAL_PARSE,
    b"2": Pending.INTERNAL_BIND,
    b"3": Pending.INTERNAL_CLOSE,
    b"C": Pending.INTERNAL_EXECUTE,
}
SYNCS = (Pending.SYNC,)
FETCHES = (Pending.INTERNAL_FETCH, Pending.INTERNAL_FETCH_QUERY)
"""The proxy's own questions, whose RowDescription, rows and CommandComplete it keeps."""
_NOT_ENDING_A_QUERY = frozenset(COMPLETES) - {b"Z", b"E"}
_TRACKED = frozenset({b"Z", b"E", b"S", *COMPLETES})
# the same sets keyed by the tag's byte value, for the relay loop
TRACKED_INT = frozenset(t[0] for t in _TRACKED)
CYCLE_TRACKED_INT = frozenset(t[0] for t in _TRACKED - _NOT_ENDING_A_QUERY)
FETCH_TRACKED_INT = TRACKED_INT | {b"D"[0]}
"""While the proxy's own question is answered, its rows are tracked too (kept, not relayed)."""
ENDS_INT = {t[0]: kinds[0] for t, kinds in COMPLETES.items()}
"""The one pending kind each tracked reply ends, by tag byte (every tuple of COMPLETES has one)."""
assert all(len(kinds) == 1 for kinds in COMPLETES.values())
