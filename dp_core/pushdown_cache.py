"""Printed pushdowns reused across answers, each time with a fresh order seed written in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dp_core.bounding import Prefilter
from dp_core.plan import DPQueryPlan
from dp_core.query import AnalyzedQuery
from dp_core.rewrite import (
    SENTINELS,
    NotSeedable,
    Pushdown,
    RangedPushdown,
    build_pushdown,
    ranged_pushdown,
)


class PushdownCache:
    """Printed pushdowns by query, reused with a fresh order seed written in.

    Building a pushdown (splicing the query into the templates and printing it) was most of
    the proxy's Python per answer; a query asked again (dashboards, the same statement with
    the same parameters and settings) has the same statements but for the seed. They are
    built once with a random sentinel seed of 19 digits, checked to appear exactly where the
    templates put it, and each answer gets them with its own fresh secret seed in its place.
    `key` must determine everything the statements depend on but the seed: the query and its
    parameters, the settings, the argument types, the prefilter and the uid's nullability.
    """

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._entries: dict[Any, tuple[int, Pushdown | RangedPushdown]] = {}

    def pushdown(self, key: Any, query: AnalyzedQuery, plan: DPQueryPlan,
                 arg_types: dict[int, str] | None) -> Pushdown:
        """`pushdown(query, plan, arg_types)`, with a fresh seed."""
        import secrets

        got = self._get(("pushdown", key), lambda s: build_pushdown(query, plan, arg_types, s, None))
        seed = secrets.randbits(62)
        if got is None:
            return build_pushdown(query, plan, arg_types, seed, None)
        sentinel, built = got
        assert isinstance(built, Pushdown)
        return _seeded(built, sentinel, seed)

    def ranged(self, key: Any, query: AnalyzedQuery, plan: DPQueryPlan,
               arg_types: dict[int, str] | None, order_seed: int, prefilter: Prefilter | None,
               uid_not_null: bool) -> RangedPushdown:
        """`ranged_pushdown(...)` with `order_seed`."""
        got = self._get(("ranged", key, prefilter, uid_not_null), lambda s: ranged_pushdown(
            query, plan, arg_types, s, prefilter, uid_not_null))
        if got is None:
            return ranged_pushdown(query, plan, arg_types, order_seed, prefilter, uid_not_null)
        sentinel, built = got
        assert isinstance(built, RangedPushdown)
        return RangedPushdown(_seeded(built.marked, sentinel, order_seed), built.token,
                              built.null_uids)

    def _get(self, key: Any, build: Callable[[int], Pushdown | RangedPushdown]
             ) -> tuple[int, Pushdown | RangedPushdown] | None:
        import secrets

        hit = self._entries.pop(key, None)
        if hit is None:
            sentinel = SENTINELS + secrets.randbits(60)
            try:
                hit = (sentinel, build(sentinel))
            except NotSeedable:
                return None
            if len(self._entries) >= self.size:
                self._entries.pop(next(iter(self._entries)))
        self._entries[key] = hit  # (most recently used last)
        return hit


def _seeded(built: Pushdown, sentinel: int, seed: int) -> Pushdown:
    old, new = str(sentinel), str(seed)

    def put(sql: str | None) -> str | None:
        return None if sql is None else sql.replace(old, new)

    return Pushdown(put(built.main), put(built.tuning), put(built.trees), put(built.bounds),
                    seed)
