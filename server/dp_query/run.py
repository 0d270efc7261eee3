"""Running a charged pushdown: APPROX_BOUNDS, then partition selection and quantile trees, streamed."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import asyncpg

from config import Config
from dp_core.binned import Binned, TuningStats, binned_plan, binned_row, resolve, value_bin_columns
from dp_core.errors import InternalError
from dp_core.join_fence import PLANNER_SETTINGS
from dp_core.mechanisms import secure_rng
from dp_core.plan import DPQueryPlan, replan_with_bounds
from dp_core.quantiles import FoundBounds, choose_bounds
from dp_core.query import AnalyzedQuery, Bounds
from dp_core.release import (
    GroupKey,
    QuantileAnswer,
    Selection,
    SelectionStream,
    absent_groups,
    add_rows,
    add_trees,
    group_key,
    noise_deferred,
    only_counted_groups,
    released_users,
    row_order,
    tree_answer,
    tree_nodes,
    tree_order,
)
from dp_core.rewrite import binned, pushdown, ranged_pushdown
from dp_core.tuning import TunedRows, groups_threshold, replan_tuned, tune, tune_rows
from dp_core.uid_ranges import UidRange, uid_ranges

if TYPE_CHECKING:
    from server.metrics import Metrics
from server.dp_query.prepared import Prepared

_TREE_NODES_PER_FETCH = 1 << 16
_TREE_ROWS_PER_FETCH = 1024
"""Quantile-tree rows are fetched in batches of about this many nodes, at most this many rows."""
_ROWS_PER_FETCH = 2048
"""Main-statement rows per fetch (split among the ranges merged at once)."""
_ROWS_PER_SELECTION = 4096
"""Main-statement rows partition selection takes at a time (`SelectionStream`)."""
_SNAPSHOT = re.compile(r"^[0-9A-Fa-f-]+$")
_BINNED_HASH_MEM = 8
"""hash_mem_multiplier of binned pushdowns (Postgres's default is 2): hash tables of up to
8 × work_mem, which a binned main statement's estimate of its groups needs to be hashed."""


@dataclass(frozen=True)
class PushdownRun:
    """What the pushdown returned, with the plan its bounds were found for."""

    query: AnalyzedQuery
    plan: DPQueryPlan
    rows: Sequence[Any]
    quantiles: dict[tuple[GroupKey, int], QuantileAnswer]
    bounds: dict[int, FoundBounds]
    selection: Selection
    tuned: TunedRows | None = None
    """max_rows_contributed as chosen for this answer, when it was."""


async def _tree_stream(cursor: Any, timeout: float, streams: int = 1) -> AsyncIterator[Any]:
    """The rows of a tree statement's cursor; each fetch asks for about _TREE_NODES_PER_FETCH
    nodes' worth of rows (shared by `streams` merged at once), judging by the last (few big
    trees, or many small ones)."""
    batch, nodes_per_fetch = 1, _TREE_NODES_PER_FETCH // streams
    while rows := await cursor.fetch(batch, timeout=timeout + 5):
        nodes = 0
        for r in rows:
            nodes += tree_nodes(r)
            yield r
        batch = max(1, min(_TREE_ROWS_PER_FETCH, nodes_per_fetch * len(rows) // max(nodes, 1)))


async def _row_stream(cursor: Any, timeout: float, streams: int = 1,
                      binned_columns: int | None = None) -> AsyncIterator[Any]:
    """The rows of a main statement's cursor, fetched _ROWS_PER_FETCH at a time (shared by
    `streams` merged at once); with `binned_columns`, as dicts whose per-bin arrays are one
    `Binned` (which the rows of several ranges add up as)."""
    batch = max(1, _ROWS_PER_FETCH // streams)
    while rows := await cursor.fetch(batch, timeout=timeout + 5):
        for r in rows:
            if binned_columns is None:
                yield r
                continue
            yield binned_row(r, binned_columns)


async def _merged(streams: list[AsyncIterator[Any]], order: Callable[[Any], tuple[Any, ...]],
                  combine: Callable[[list[Any]], Any], what: str) -> AsyncIterator[Any]:
    """Rows of several ranges of users, each stream sorted by `order`, merged: `combine` of
    the rows that sort alike (one group's), holding one batch per range at a time."""
    # the first fetch runs each range's statement (to its sort): at once, not one by one
    heads = list(await asyncio.gather(*(anext(s, None) for s in streams)))
    while True:
        live = [order(h) for h in heads if h is not None]
        if not live:
            return
        first = min(live)
        parts = []
        for i, head in enumerate(heads):
            if head is not None and order(head) == first:
                parts.append(head)
                heads[i] = nxt = await anext(streams[i], None)
                if nxt is not None and order(nxt) <= first:
                    raise InternalError(f"{what} out of order")
        yield combine(parts)


async def _merged_rows(streams: list[AsyncIterator[Any]], keys: int,
                       binned_columns: int | None, counted_only: bool) -> AsyncIterator[Any]:
    """The main rows of several ranges (`row_order`): one row per group (`add_rows`), as
    `_row_stream` makes them. With `counted_only` (`release.only_counted_groups`), a group no
    user of any range counts in is dropped as soon as its rows are merged, before the rest
    is read from them: a range sends its groups whatever other ranges hold (a user whose
    every row is its own group sends them all), and each costs the proxy's reading of its
    sums here rather than selection's later."""
    by = [f"dp_t{i}" for i in range(keys)]
    keep = [f"dp_{c}{i}" for c in "kh" for i in range(keys)]  # (hashes are no sums)

    def combine(parts: list[Any]) -> Any:
        if counted_only and not any(p["dp_users"] for p in parts):
            return None
        if binned_columns is not None:
            parts = [binned_row(p, binned_columns) for p in parts]
        return parts[0] if len(parts) == 1 else add_rows([parts], by, keep)[0]

    async for row in _merged(streams, lambda r: row_order(r, keys), combine, "pushdown rows"):
        if row is not None:
            yield row


def merged_trees(streams: list[AsyncIterator[Any]], keys: int) -> AsyncIterator[Any]:
    """The trees of several ranges (`tree_order`): one per group and aggregate (`add_trees`)."""
    return _merged(streams, lambda r: tree_order(r, keys), add_trees, "quantile-tree rows")


class PushdownRunner:
    """Runs charged pushdowns on the pushdown pool, split over uid ranges where it may."""

    def __init__(self, config: Config, pool: asyncpg.Pool, metrics: Metrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics

    async def run(self, prepared: Prepared, conn: Any) -> PushdownRun:
        """Run the pushdown (after the charge): APPROX_BOUNDS first, then main and trees.

        All statements see one snapshot and keep the same groups per user (one order
        seed); a subquery joined row by row has its rows drawn afresh in each statement
        (`ownership._capped`), each bounding every user alone.
        Where the pushdown may be split (`UidColumn`) and the pool has connections free, each
        statement runs as one per uid range, at once, on connections that share the snapshot,
        and their rows (and trees) are added up.
        """
        timeout = self.config.backend.statement_timeout
        started = time.perf_counter()
        query, plan, statements = prepared.query, prepared.plan, dict(prepared.statements)
        found: dict[int, FoundBounds] = {}
        rng = secure_rng()
        async with contextlib.AsyncExitStack() as stack:
            # asyncpg prepares without a Sync, which leaves an implicit transaction open that
            # BEGIN ISOLATION LEVEL could not start in: a simple query ends it
            await conn.execute("SELECT")
            per_bin = binned(plan)  # T chosen from the main statement's own rows
            await self._begin(conn, stack, per_bin=per_bin, timezone=prepared.timezone)
            ranges, conns = await self._split_run(prepared, conn, stack, per_bin)
            ranged = prepared.ranged
            shards = [ranged.of(r).statements() for r in ranges] if ranged else []

            async def fetch_bounds() -> list[Any]:
                """The APPROX_BOUNDS bins (a few hundred rows at most), added over ranges."""
                if not ranges:
                    return list(await statements["bounds"].fetch(timeout=timeout + 5))
                parts = await asyncio.gather(*(c.fetch(sqls["bounds"], timeout=timeout + 5)
                                               for c, sqls in zip(conns, shards, strict=True)),
                                             return_exceptions=True)
                for part in parts:
                    if isinstance(part, BaseException):
                        raise part
                return add_rows(parts, ("dp_agg", "dp_bin"))

            tuned: TunedRows | None = None
            if "tuning" in statements:
                # (unsplit: its count of groups does not add up over ranges of users)
                tuned = tune_rows(plan, await statements["tuning"].fetch(timeout=timeout + 5),
                                  rng, query, None if prepared.public_keys is None
                                  else len(prepared.public_keys))
            if "bounds" in statements:
                bins: dict[int, dict[int, int]] = {i: {} for i in plan.auto_bounds}
                for r in await fetch_bounds():
                    bins[int(r["dp_agg"])][int(r["dp_bin"])] = int(r["dp_n"])
                for q in plan.approx_bounds:
                    assert q.aggregate is not None
                    found[q.aggregate] = choose_bounds(
                        bins[q.aggregate], q.spec, rng, query.aggregates[q.aggregate].output_name)
            if "bounds" in statements or (tuned is not None and not per_bin):
                chosen_bounds = {i: Bounds(f.lower, f.upper) for i, f in found.items()}
                if tuned is not None:
                    query, plan = replan_tuned(query, plan, tuned, chosen_bounds)
                else:
                    query, plan = replan_with_bounds(query, plan, chosen_bounds)
                seed = prepared.pushdown.order_seed
                if ranges:  # the ranges run every statement: their names are all that is used
                    ranged = ranged_pushdown(query, plan, prepared.arg_types, seed,
                                             prepared.prefilter,
                                             prepared.split is not None
                                             and prepared.split.uid_not_null)
                    shards = [ranged.of(r).statements() for r in ranges]
                    statements = dict.fromkeys(n for n in shards[0]
                                               if n not in ("bounds", "tuning"))
                else:
                    pd = pushdown(query, plan, prepared.arg_types, seed)
                    statements = {name: await conn.prepare(sql)
                                  for name, sql in pd.statements().items()
                                  if name not in ("bounds", "tuning")}
            # partition selection first (only the kept groups' trees are walked), over the
            # rows as they stream: a worker holds one batch and the kept groups, not every group
            chosen = SelectionStream(query, plan, rng, deferred=per_bin)
            public = prepared.public_keys
            listed = set(public or ())
            present: dict[tuple[str, ...], Any] = {}
            columns, terms = binned_plan(query, plan) if per_bin else ([], {})
            value_bins = value_bin_columns(query, plan) if per_bin else {}
            stats = TuningStats(groups_threshold(plan))
            own_stats = per_bin and plan.rows_stored is None  # (else a table's stored ones)
            if "main" in statements:
                if ranges:
                    streams = [_row_stream(await (await c.prepare(sqls["main"])).cursor(
                        timeout=timeout + 5), timeout, len(conns))
                        for c, sqls in zip(conns, shards, strict=True)]
                    rows_in: AsyncIterator[Any] = _merged_rows(
                        streams, len(query.keys), len(columns) if per_bin else None,
                        only_counted_groups(query))
                else:
                    rows_in = _row_stream(await statements["main"].cursor(timeout=timeout + 5),
                                          timeout, 1, len(columns) if per_bin else None)
                batch: list[Any] = []
                async for r in rows_in:
                    if own_stats:
                        stats.add(r, value_bins)
                    if public is not None:
                        key = tuple(r[f"dp_t{i}"] for i in range(len(query.keys)))
                        if key in listed:  # (a key listed since the plan was made is not)
                            present[key] = r
                        continue
                    batch.append(r)
                    if len(batch) >= _ROWS_PER_SELECTION:
                        chosen.add(batch)
                        batch = []
                chosen.add(batch)
            if public is not None:
                # every listed group, those without rows too, in the listed order (the
                # order the rows come in must not tell which groups had none)
                absent = iter(absent_groups(query, plan, public, set(present),
                                            Binned.empty(len(columns)) if per_bin else None))
                ordered = [present[k] if k in present else next(absent) for k in public]
                for at in range(0, len(ordered), _ROWS_PER_SELECTION):
                    chosen.add(ordered[at:at + _ROWS_PER_SELECTION])
            selection = chosen.done()
            if per_bin:
                # T and the clips from the statistics of every group's rows, then each kept
                # group's sums for them, and their noise
                if plan.rows_stored is not None:
                    # from a table's stored statistics (post-processing), for these groups
                    # (`Preparer._after_selection` planned it so, and tried the choice)
                    if prepared.tuned is None:
                        raise InternalError("T left to a table's tuning without the tuning")
                    tuned = prepared.tuned.chosen(
                        plan, released_users(plan, selection)).tuned
                else:
                    groups = stats.groups if prepared.public_keys is None \
                        else len(prepared.public_keys)
                    tuned = tune(plan, stats.rows(), groups,
                                 {i: dict(enumerate(v)) for i, v in stats.values.items()}, rng,
                                 query, groups_known=prepared.public_keys is not None,
                                 released_users=released_users(plan, selection))
                before = query
                query, plan = replan_tuned(query, plan, tuned)
                resolve(selection.rows, before, plan, terms, tuned.clips)
                selection = noise_deferred(selection, plan, rng)
            rows = selection.rows
            quantiles: dict[tuple[GroupKey, int], QuantileAnswer] = {}
            if "trees" in statements:
                wanted, keys = selection.matched, len(query.keys)
                # streamed: each row is one group's whole tree (up to 69,904 nodes) and only
                # its answer is kept; split, the ranges' streams are merged a group at a time
                if ranges:
                    streams = [_tree_stream(await (await c.prepare(sqls["trees"])).cursor(
                        timeout=timeout + 5), timeout, len(conns))
                        for c, sqls in zip(conns, shards, strict=True)]
                    trees = merged_trees(streams, keys)
                else:
                    trees = _tree_stream(await statements["trees"].cursor(timeout=timeout + 5),
                                         timeout)
                async for r in trees:
                    if group_key(r, query) in wanted:
                        key, value = tree_answer(query, plan, r, rng)
                        quantiles[key] = value
        self.metrics.pushdown_seconds.observe(time.perf_counter() - started)
        if ranges:
            self.metrics.pushdown_split.labels(
                str(len(ranges)), "yes" if prepared.prefilter else "no").inc()
        return PushdownRun(query, plan, rows, quantiles, found, selection, tuned)

    async def fetch_alone(self, conn: Any, sql: str) -> list[Any]:
        """The rows of one statement run as a pushdown is (read-only, under the statement
        timeout), after its charge: an admin's tuning of a table (`table_tuning`)."""
        async with contextlib.AsyncExitStack() as stack:
            await conn.execute("SELECT")  # (ends the implicit transaction a prepare leaves)
            await self._begin(conn, stack)
            return list(await conn.fetch(sql, timeout=self.config.backend.statement_timeout + 5))

    async def _begin(self, conn: Any, stack: contextlib.AsyncExitStack,
                     snapshot: str | None = None, per_bin: bool = False,
                     timezone: str | None = None) -> None:
        """Start a pushdown's read-only transaction on `conn` (in `snapshot`, exported by the
        first connection of a split run), ended by `stack`. `per_bin`: the main statement
        groups by bins of the users' row counts too (`dp_core.binned`): a few per group, but
        Postgres cannot know, and would sort every (user, group) row rather than hash them
        unless hash tables may be larger than work_mem's default share. `timezone`: the
        asking session's, in which the pushdown reads dates as the session would."""
        await stack.enter_async_context(conn.transaction(readonly=True, isolation="repeatable_read"))
        if snapshot is not None:
            await conn.execute(f"SET TRANSACTION SNAPSHOT '{snapshot}'")
        # enforced by Postgres for each statement (the ledger's have none)
        timeout = self.config.backend.statement_timeout
        await conn.execute(f"SET LOCAL statement_timeout = {int(timeout * 1000)}")
        # the joins in the order the rewrite writes them (`join_fence.PLANNER_SETTINGS`)
        await conn.execute("; ".join(f"SET LOCAL {name} = {value}"
                                     for name, value in PLANNER_SETTINGS.items()))
        if per_bin:
            await conn.execute(f"SET LOCAL hash_mem_multiplier = {_BINNED_HASH_MEM}")
        if timezone is not None:
            await conn.execute("SELECT pg_catalog.set_config('TimeZone', $1, true)", timezone)

    async def _split_run(self, prepared: Prepared, conn: Any, stack: contextlib.AsyncExitStack,
                         per_bin: bool = False) -> tuple[list[UidRange], list[Any]]:
        """The uid ranges this run splits into and a connection for each (`conn` first, the
        others in its snapshot, released by `stack`); ([], [conn]) when it does not split."""
        split, b = prepared.split, self.config.backend
        if split is None:
            return [], [conn]
        pool = self.pool
        # the free connections but one: a DP query arriving next finds one without waiting
        free = pool.get_idle_size() + pool.get_max_size() - pool.get_size() - 1
        ranges = uid_ranges(split.histogram, min(b.pushdown_split, 1 + max(0, free)))
        if len(ranges) < 2:
            return [], [conn]
        snapshot = str(await conn.fetchval("SELECT pg_export_snapshot()"))
        if not _SNAPSHOT.match(snapshot):
            raise InternalError("unexpected snapshot name")
        conns = [conn]
        for _ in range(len(ranges) - 1):
            try:
                other = await pool.acquire(timeout=1.0)
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError):
                break
            stack.push_async_callback(pool.release, other)
            await self._begin(other, stack, snapshot, per_bin, prepared.timezone)
            conns.append(other)
        if len(conns) < len(ranges):
            ranges = uid_ranges(split.histogram, len(conns))
            conns = conns[:len(ranges)]
            if len(ranges) < 2:
                return [], [conn]
        return ranges, conns
