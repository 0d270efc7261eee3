"""The main statement's per-group columns: the keys as released, their hashes, per-user sums."""

from __future__ import annotations

from dp_core.errors import InternalError
from dp_core.partials import clamp, num
from dp_core.plan import Component
from dp_core.query import AnalyzedQuery


def per_user_sum(component: str, p: str, lo: float, hi: float) -> str:
    """The sum over kept (user, group) rows of a per-user quantity's `component`, of the
    per-user values `p` clamped to [lo, hi] (its FILTER follows)."""
    mid = num((lo + hi) / 2)
    if component == Component.COUNT:
        return f"sum(LEAST({p}, {num(hi)}))"
    if component == Component.SUM:
        return f"sum({clamp(p, lo, hi)})"
    if component == Component.N:
        return f"count({p})"
    if component == Component.CENTERED_SUM:
        return f"sum({clamp(p, lo, hi)} - {mid})"
    if component == Component.CENTERED_SQUARES:
        c = f"({clamp(p, lo, hi)} - {mid})"
        return f"sum({c} * {c})"
    raise InternalError()


def key_columns(query: AnalyzedQuery) -> list[str]:
    """The main statement's key columns: their types (read from the prepared statement) with
    no value to decode (the client gets the key texts back as constants of these types, and
    a driver's decoding of some values, year 5874897, time 24:00, a huge interval, would fail
    on one user's key), their texts, and the hashes of hashed keys."""
    n = len(query.keys)
    return [*(f"CASE WHEN false THEN dp_k{i} END AS dp_k{i}" for i in range(n)),
            *(f"dp_k{i}::text AS dp_t{i}" for i in range(n)), *key_hashes(query)]


def key_hashes(query: AnalyzedQuery) -> list[str]:
    """The match columns of hashed keys (`Key.hashed`): the hash of the value by its type's
    own hash function, which equal values share whatever their texts."""
    return [f"hash_array_extended(ARRAY[dp_k{i}], 0) AS dp_h{i}"
            for i, k in enumerate(query.keys) if k.hashed]
