"""Splitting a DP query's pushdown over uid ranges: whether it may, the ranges, the prefilter."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import asyncpg
from pglast import ast

from config import Config
from dp_core.bounding import Prefilter, prefilter_types
from dp_core.pushdown_cache import PushdownCache
from dp_core.query import AggKind, AnalyzedQuery, TablePolicy, TableRef
from dp_core.release import only_counted_groups
from dp_core.uid_ranges import has_outer_join, uid_ranges
from server.backend_setup import quote_ident
from server.dp_query.key_types import ONE_TEXT_KEY_OIDS, TEXT_KEY_OIDS
from server.dp_query.prepared import Prepared, UidColumn

log = logging.getLogger("dp_proxy.dp")

_SPLIT_KEY_OIDS = ONE_TEXT_KEY_OIDS
"""Group-key types whose text is one per value: the rows of several uid ranges add up by
their key texts."""
_STATS_SECONDS = 300.0
"""How long a uid column's histogram (for splitting pushdowns) is reused before it is read again."""
_SAMPLE_ROWS = 100_000
"""About this many rows are sampled (TABLESAMPLE SYSTEM) to find the uid's percentiles. SYSTEM
samples whole pages, and a table loaded user by user holds few users per page: from 20,000
rows (1% of the bench's 2M) the largest of 4 ranges had up to 1.33 times the mean's rows,
and the answer waited for it; from 100,000, at most 1.1 times (7 ms here, once per
_STATS_SECONDS)."""
_PERCENTILES = [k / 100 for k in range(101)]
_CODE_POINT_ORDER = frozenset({"UTF8", "SQL_ASCII", "LATIN1"})
"""Server encodings whose byte order (COLLATE "C") is the code points' (Python's str order)."""



def _uid_table(query: AnalyzedQuery) -> TableRef | None:
    """The protected base table whose uid column is the query's uid, if it is one."""
    uid = query.uid
    if not isinstance(uid, ast.ColumnRef) or len(uid.fields) < 2:
        return None
    names = [getattr(f, "sval", None) for f in uid.fields]
    for t in query.tables:
        if not t.derived and names[-2] == t.alias and names[-1] == t.uid_column:
            return t
    return None


class UidSplitter:
    """Chooses how a prepared pushdown splits: from the catalog before the charge, a sample after."""

    def __init__(self, config: Config, policy: dict[str, TablePolicy], pushdowns: PushdownCache,
                 has_nondeterministic: Callable[[Any], Awaitable[bool]]) -> None:
        self.config = config
        self.policy = policy
        self._pushdowns = pushdowns
        self._has_nondeterministic = has_nondeterministic
        """Whether the database has a nondeterministic collation ('a' = 'A' may be a group)."""
        self._uid_columns: dict[str, tuple[float, UidColumn | None]] = {}
        """(until when it holds, the table's size and uid type, or None) by table name."""
        self._histograms: dict[str, tuple[float, tuple[str, ...] | None]] = {}
        """(until when it holds, the uid's histogram in a sample, or None) by table name."""

    async def candidate(self, prepared: Prepared, conn: Any) -> UidColumn | None:
        """Whether the pushdown may be split by uid ranges, before any charge (and for
        EXPLAIN): only over a large table (by the catalog's estimate of its rows), with group
        keys whose texts rows can be added up by, no COUNT(DISTINCT x), and (grouped rows and
        trees merge as streams in key order) a server encoding whose byte order is the
        code points'. Reads the catalog only, never a row of a table: the uid's histogram,
        which the ranges are cut from, is sampled after the charge (`split`), without
        `histogram` here."""
        b = self.config.backend
        table = _uid_table(prepared.query)
        if b.pushdown_split < 2 or table is None or any(
                o not in _SPLIT_KEY_OIDS for o in prepared.key_oids):
            return None
        if any(a.kind is AggKind.COUNT_DISTINCT for a in prepared.query.aggregates):
            return None  # (distinct values do not add up over ranges of users: one value, many)
        if prepared.fanout > 1 and only_counted_groups(prepared.query):
            # a public item joined on no unique key gives each protected row up to 100 rows:
            # grouped by it, one user's rows make that many groups, each of which every range
            # of a row-level query sends (it may be a candidate in another range), where the
            # whole statement leaves the groups no user counts in to Postgres (red team,
            # session 31: 5,492 rows joined with 100 made 62 quanta split against 12
            # unsplit); per-user aggregates keep each user's counted groups only, either way
            return None
        if prepared.query.ranges_after_joins or has_outer_join(prepared.query):
            # a range tests the rows' owner alone there (`uid_ranges._range_uids`), or after
            # the joins (`join_fence`): a side it does not filter would be read whole in each
            # range, and whether it is read at all would follow whether the range's filtered
            # side has a row (a range of one heavy user's rows)
            return None
        if prepared.key_oids and conn.get_settings().server_encoding not in _CODE_POINT_ORDER:
            return None
        try:
            # a nondeterministic collation makes 'a' = 'A' a group
            if any(o in TEXT_KEY_OIDS for o in prepared.key_oids) and \
                    await self._has_nondeterministic(conn):
                return None
            now = time.monotonic()
            cached = self._uid_columns.get(table.name)
            if cached is None or cached[0] < now:
                cached = self._uid_columns[table.name] = (now + _STATS_SECONDS,
                                                          await self._uid_column(table, conn))
        except asyncpg.PostgresError as e:
            log.warning("a DP pushdown will not be split by uid: %s", e)
            return None
        split = cached[1]
        if split is None or split.rows < b.pushdown_split_min_rows:
            return None
        return split

    async def split(self, prepared: Prepared, candidate: UidColumn, conn: Any) -> None:
        """After the charge: sets how the pushdown is split by uid ranges (`prepared.split`,
        `.ranged`, `.split_ranges`, `.prefilter`), from a sample of the uid column (remembered
        for _STATS_SECONDS) and the configured prefilter (`prefilter`). Where that cannot
        be done (the sample fails, a few users hold most rows, Postgres does not take a
        range's bounds for the query's uid) the pushdown runs unsplit, with the same answer."""
        b = self.config.backend
        try:
            now = time.monotonic()
            cached = self._histograms.get(candidate.table)
            if cached is None or cached[0] < now:
                try:
                    found = await self._uid_histogram(candidate, conn)
                except asyncpg.PostgresError as e:  # a view, say: cannot be sampled
                    log.warning("DP pushdowns over %s will not be split by uid: %s",
                                candidate.table, e)
                    found = None
                cached = self._histograms[candidate.table] = (now + _STATS_SECONDS, found)
            if cached[1] is None:
                return
            split = replace(candidate, histogram=cached[1])
            ranges = uid_ranges(split.histogram, b.pushdown_split)
            if len(ranges) < 2:
                return
            prefilter = self.prefilter(prepared, split)
            # the ranges' bounds are the column's own values as text: checked here that
            # Postgres takes them for the query's uid (and that it plans each statement), in
            # a transaction: asyncpg prepares without a Sync, which leaves an implicit one
            # open (with a snapshot) that the run's BEGIN ISOLATION LEVEL could not start in
            while True:
                ranged = self._pushdowns.ranged(
                    prepared.cache_key, prepared.query, prepared.plan, prepared.arg_types,
                    prepared.pushdown.order_seed, prefilter, split.uid_not_null)
                try:
                    async with conn.transaction():
                        for sql in ranged.of(ranges[len(ranges) // 2]).statements().values():
                            await conn.prepare(sql)
                    break
                except asyncpg.PostgresError as e:
                    if prefilter is None:
                        raise
                    log.warning("a DP pushdown will not be prefiltered: %s", e)
                    prefilter = None
        except asyncpg.PostgresError as e:
            log.warning("a DP pushdown will not be split by uid: %s", e)
            return
        # (the configured number, not len(ranges): fewer ranges would tell EXPLAIN's reader
        # that a few users hold a large share of the rows)
        prepared.split, prepared.ranged, prepared.split_ranges = split, ranged, b.pushdown_split
        prepared.prefilter = prefilter

    def prefilter(self, prepared: Prepared, split: UidColumn) -> Prefilter | None:
        """Whether the split pushdown picks users' groups from their rows before aggregating
        them (`Prefilter`): where the configuration says so (`pushdown_prefilter`) and the
        query's keys and aggregates allow it. The answer does not depend on the choice: either
        way each user keeps C_u of its groups chosen by a keyed hash with a fresh key, and the
        statements of one answer all run split or all unsplit, so they keep the same groups.
        It was chosen from a sample of the groups per user, with an exact threshold: one user
        decided it, and the time an answer took told it (red team, session 31); the choice
        now depends on the configuration, the query's text and the schema only."""
        query = prepared.query
        if not self.config.backend.pushdown_prefilter or not query.keys \
                or any(schema != "pg_catalog" for schema, _ in prepared.key_types) \
                or query.keys_read_uid or any(a.row_level for a in query.aggregates):
            # (row-level aggregates read every group of a user: none to drop)
            return None
        return prefilter_types(split.uid_type, [name for _, name in prepared.key_types])

    async def _uid_column(self, table: TableRef, conn: Any) -> UidColumn | None:
        """The table's size and its uid column's type, from the catalog (no histogram yet);
        None for a table too small to split, or never analysed."""
        schema = self.policy[table.name].schema
        name = f"{quote_ident(schema)}.{quote_ident(table.name)}"
        if await conn.fetchval(
                "SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL") and \
                await conn.fetchval("SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition "
                                    "WHERE logicalrelid = $1::regclass)", name):
            # Citus runs the pushdown on every shard at once already: its shards are the
            # ranges (the coordinator's reltuples of a distributed table is 0 anyway)
            return None
        rows = await conn.fetchval(
            "SELECT c.reltuples::float8 FROM pg_class c JOIN pg_namespace n ON n.oid = "
            "c.relnamespace WHERE n.nspname = $1 AND c.relname = $2", schema, table.name)
        if rows is None or rows < max(1, self.config.backend.pushdown_split_min_rows):
            return None  # (-1: never analysed or vacuumed)
        column = await conn.fetchrow(
            "SELECT t.typname, a.attnotnull FROM pg_attribute a JOIN pg_type t ON t.oid = "
            "a.atttypid WHERE a.attrelid = $1::regclass AND a.attname = $2", name,
            table.uid_column)
        if column is None:
            return None
        return UidColumn(table.name, table.uid_column, int(rows), (), str(column["typname"]),
                        bool(column["attnotnull"]))

    async def _uid_histogram(self, split: UidColumn, conn: Any) -> tuple[str, ...] | None:
        """Percentiles of the uid column in a sample of the table (`UidColumn.histogram`): read
        only after a charge."""
        schema = self.policy[split.table].schema
        percent = min(100.0, max(0.01, 100.0 * _SAMPLE_ROWS / max(split.rows, 1)))
        name = f"{quote_ident(schema)}.{quote_ident(split.table)}"
        bounds = await conn.fetchval(
            f"SELECT (percentile_disc($1::float8[]) WITHIN GROUP (ORDER BY {quote_ident(split.uid_column)}"
            f"))::text[] FROM {name} TABLESAMPLE SYSTEM ($2)", _PERCENTILES, percent)
        if not bounds or any(b is None for b in bounds):
            return None
        return tuple(bounds)
