"""The DP query path in the server: analyse, plan, charge, run the pushdown, release, answer.

Order of events for one DP answer: the pushdown is prepared (planning errors,
which do not depend on data, are reported as they are and cost nothing); the
ledger is charged and committed; only then do statements read the analyst's
tables: the split's sample of the uid and the prefilter's count of groups per
user (`DPService._split`), then the pushdown, as the pushdown role with a
statement timeout; noise and thresholding are applied; the released rows go
back to the client through the session's own backend connection as a small
VALUES query, so Postgres encodes them in the format the client asked for. A
failure after the charge returns one generic error that names no row or value.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import asyncpg
from pglast import ast
from pglast.stream import RawStream

from config import Accountant, Config
from dp_core.accounting import AnswerCost
from dp_core.analysis import analyze, parse_select
from dp_core.bounding import Prefilter, prefilter_types
from dp_core.budget import check_affordable, to_numeric
from dp_core.catalogue import INTEGER_TYPES, NUMBER_TYPES, check_casts
from dp_core.classify import Statement, StatementKind
from dp_core.cost import RowWorkBudget
from dp_core.errors import (
    BindMismatch,
    DPError,
    FeatureNotSupported,
    InsufficientPrivilege,
    InternalError,
    InvalidParameterValue,
)
from dp_core.explain import Split, explain_lines, fmt, notice_text
from dp_core.kinds import SelectionKind
from dp_core.mechanisms import NoiseKind, secure_rng
from dp_core.plan import DPQueryPlan, check_noise_scales, make_plan
from dp_core.probes import argument_probe_sql, standalone_subqueries
from dp_core.pushdown_cache import PushdownCache
from dp_core.quantiles import FoundBounds, choose_bounds
from dp_core.query import AggKind, AnalyzedQuery, Bounds, TablePolicy, TableRef
from dp_core.release import (
    GroupKey,
    Released,
    Selection,
    SelectionStream,
    add_rows,
    add_trees,
    group_key,
    output_type,
    release,
    row_order,
    tree_answer,
    tree_nodes,
    tree_order,
)
from dp_core.result import TypeRef, result_sql
from dp_core.rewrite import Pushdown, RangedPushdown, groups_sql, pushdown, ranged_pushdown
from dp_core.settings import Caps, DPSettings, validate
from dp_core.uid_ranges import UidRange, uid_ranges
from server import wire as p
from server.backend_setup import quote_ident
from server.ledger import Ledger
from server.local_functions import LocalFunctions
from server.replies import notice_response
from server.wire.params import param_text

if TYPE_CHECKING:
    from server.metrics import Metrics


class Session(Protocol):
    """What the DP path reads of the session that asks (server.session.Session is one)."""

    user: str
    process_id: int
    config: Config
    link: Any
    """The session's backend link: its client encoding decodes Bind parameters."""

    @property
    def settings(self) -> DPSettings: ...
    @property
    def caps(self) -> Caps: ...
    def dp_charged(self) -> None: ...

log = logging.getLogger("dp_proxy.dp")

_OIDS = {"int8": 20, "float8": 701, "text": 25, "numeric": 1700, "timestamptz": 1184, "int4": 23}
PG = "pg_catalog"
_TREE_NODES_PER_FETCH = 1 << 16
_TREE_ROWS_PER_FETCH = 1024
_ROWS_PER_FETCH = 2048
"""Main-statement rows per fetch (split among the ranges merged at once)."""
_ROWS_PER_SELECTION = 4096
"""Main-statement rows partition selection takes at a time (`SelectionStream`)."""
"""Quantile-tree rows are fetched in batches of about this many nodes, at most this many rows."""
_SPLIT_KEY_OIDS = frozenset({16, 18, 19, 20, 21, 23, 25, 1042, 1043, 1082, 1083, 1114, 1184,
                             2950})
"""Group-key types whose text is one per value (bool, "char", name, integers, text, bpchar
(its text drops the trailing blanks that equality ignores), varchar, date, time,
timestamp(tz), uuid): the rows of several uid ranges add up by their key texts. Not numeric
(1.0 = 1.00) nor floats (0 = -0), whose equal values can print differently."""
_TEXT_KEY_OIDS = frozenset({18, 19, 25, 1042, 1043})
_HASHED_KEY_OIDS = frozenset({700, 701, 1021, 1022, 1186, 1187, 1231, 1700, 3802, 3807, 3906,
                              3907, 4532, 6151})
"""Group-key types whose equal values can print differently and that have a hash function
(float4/8, interval ('1 day' = '24 hours'), numeric, jsonb, numrange, nummultirange and their
arrays): a group's row and its quantile trees are matched by the hash (`Key.hashed`)."""
_STATS_SECONDS = 300.0
"""How long a uid column's histogram (for splitting pushdowns) is reused before it is read again."""
_SAMPLE_ROWS = 20_000
"""About this many rows are sampled (TABLESAMPLE SYSTEM) to find the uid's percentiles."""
_PERCENTILES = [k / 100 for k in range(101)]
_PREFILTER_GROUPS_PER_USER = 5.0
_PREFILTER_KEPT_SHARE = 0.5
"""Split pushdowns pick users' groups from their rows before aggregating them (`Prefilter`)
where users have at least _PREFILTER_GROUPS_PER_USER groups on average and keep at most
_PREFILTER_KEPT_SHARE of them (C_u): measured on the bench's visits with 4 ranges at once,
the prefilter takes 0.79-0.82x the time at 6.6 groups per user (C_u 1; 0.9x at C_u 2),
1.15x at 4.0, 1.2x at 3.1, 1.5x at 2.0 and 2.3x at 1.0 (its window reads every row)."""
_GROUPS_SLICES = 25
"""(user, group) pairs per user are counted in the middle one of this many uid ranges."""
_GROUPS_TIMEOUT = 10.0
_GROUPS_MIN_USERS = 100
"""A sample of fewer users (the query's WHERE picks a few) chooses no prefilter."""
_SNAPSHOT = re.compile(r"^[0-9A-Fa-f-]+$")
_CODE_POINT_ORDER = frozenset({"UTF8", "SQL_ASCII", "LATIN1"})
"""Server encodings whose byte order (COLLATE "C") is the code points' (Python's str order)."""


class QueryFailed(DPError):
    """A charged DP query failed while running: one generic message, nothing about data."""

    sqlstate = "XX000"

    def __init__(self) -> None:
        super().__init__("the DP query failed after its privacy cost was charged; the charge stands",
                         hint="nothing about the data is revealed by this error")


class LedgerUnavailable(DPError):
    """The charge could not be recorded, so the query did not run."""

    sqlstate = "58000"

    def __init__(self) -> None:
        super().__init__("the privacy budget ledger is unavailable: the query was not run",
                         hint="try again; if it persists, tell the proxy's operator")


@dataclass(frozen=True)
class _Run:
    """What the pushdown returned, with the plan its bounds were found for."""

    query: AnalyzedQuery
    plan: DPQueryPlan
    rows: Sequence[Any]
    quantiles: dict[tuple[GroupKey, int], float]
    bounds: dict[int, FoundBounds]
    selection: Selection


def _planning_error(e: asyncpg.PostgresError) -> DPError:
    """Postgres's error on preparing a generated statement, as the analyst's: planning reads
    no rows, so its errors (unknown column, type mismatch) are safe to show."""
    message = str(e).replace("dp_per_user", "the query").replace("dp_result.", "")
    err = DPError(message.replace("dp_result", "the result"))
    err.sqlstate = e.sqlstate or "XX000"
    return err


@dataclass(frozen=True)
class UidSplit:
    """A DP query's pushdown may run as several, each over one range of the uid.

    Each range's statements read only its users, and every column but the keys is a sum over
    users, so the rows of all ranges add up to the unsplit rows (users are never in two
    ranges). Postgres finishes one per-user aggregation per connection instead of gathering
    every (user, group) row into one process.
    """

    table: str
    uid_column: str
    rows: int
    histogram: tuple[str, ...]
    """Percentiles 0, 1, ..., 100 of the uid column in a sample of the table, as text
    (ascending in the column's order). `pg_stats` would have them, but Postgres hides it for
    tables with row-level security, as protected tables are."""
    uid_type: str = ""
    """The uid column's type (pg_type name)."""
    uid_not_null: bool = False
    """The uid column is declared NOT NULL."""


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


async def _row_stream(cursor: Any, timeout: float, streams: int = 1) -> AsyncIterator[Any]:
    """The rows of a main statement's cursor, fetched _ROWS_PER_FETCH at a time (shared by
    `streams` merged at once)."""
    batch = max(1, _ROWS_PER_FETCH // streams)
    while rows := await cursor.fetch(batch, timeout=timeout + 5):
        for r in rows:
            yield r


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


def _merged_rows(streams: list[AsyncIterator[Any]], keys: int) -> AsyncIterator[Any]:
    """The main rows of several ranges (`row_order`): one row per group (`add_rows`)."""
    by, keep = [f"dp_t{i}" for i in range(keys)], [f"dp_k{i}" for i in range(keys)]
    return _merged(streams, lambda r: row_order(r, keys),
                   lambda parts: parts[0] if len(parts) == 1 else add_rows([parts], by, keep)[0],
                   "pushdown rows")


def _merged_trees(streams: list[AsyncIterator[Any]], keys: int) -> AsyncIterator[Any]:
    """The trees of several ranges (`tree_order`): one per group and aggregate (`add_trees`)."""
    return _merged(streams, lambda r: tree_order(r, keys), add_trees, "quantile-tree rows")


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


@dataclass
class Prepared:
    """A DP query analysed, planned and prepared on the backend (not yet charged or run)."""

    query: AnalyzedQuery
    plan: DPQueryPlan
    pushdown: Pushdown
    statements: dict[str, Any]
    """asyncpg PreparedStatements of the pushdown's statements: "main", "trees", "bounds"."""
    arg_types: dict[int, str]
    key_types: list[TypeRef]
    key_oids: list[int]
    param_oids: list[int]
    columns: list[Any] = field(default_factory=list)
    """The result query's columns (asyncpg Attributes), from preparing it with no rows."""
    split: UidSplit | None = None
    """Set after the charge, when the pushdown runs split (`DPService._split`); for EXPLAIN,
    the table it may be split over, without a histogram."""
    ranged: RangedPushdown | None = None
    """The pushdown for any uid range, when `split`."""
    split_ranges: int = 1
    """How many uid ranges `split` gives at most (by the configured number of pushdowns)."""
    prefilter: Prefilter | None = None
    """Whether (and with which types) `ranged` picks users' groups from their rows before
    aggregating them (`DPService._prefilter`)."""
    cache_key: Any = None
    """What the pushdown's statements depend on but the order seed (`PushdownCache`)."""

    @property
    def sql(self) -> list[str]:
        return list(self.pushdown.statements().values())

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.query.outputs]

    def types(self) -> list[TypeRef]:
        out: list[TypeRef] = []
        for c in self.query.outputs:
            if c.key is not None:
                out.append(self.key_types[c.key])
            else:
                assert c.aggregate is not None
                out.append((PG, output_type(self.query.aggregates[c.aggregate])))
        return out


def row_description(names: Sequence[str], oids: Sequence[int],
                    formats: Sequence[int] = ()) -> p.RowDescription:
    def fmt(i: int) -> int:
        if not formats:
            return 0
        return formats[0] if len(formats) == 1 else formats[i]

    return p.RowDescription(tuple(p.FieldDescription(n, type_oid=o, format=fmt(i))
                                  for i, (n, o) in enumerate(zip(names, oids, strict=True))))


class DPService:
    def __init__(self, config: Config, pool: asyncpg.Pool, ledger: Ledger,
                 metrics: Metrics, restricted_role: str) -> None:
        self.config = config
        self.pool = pool
        self.ledger = ledger
        self.metrics = metrics
        self.policy = {
            name: TablePolicy(t.schema_, t.uid_column,
                              {c: Bounds(b.lower, b.upper) for c, b in t.columns.items()})
            for name, t in config.tables.items()
        }
        self._type_names: dict[int, TypeRef] = {}
        self._turns: dict[str, tuple[int, asyncio.Semaphore]] = {}
        """Each analyst's limit of DP queries at once in this process, and its turns (`_turn`)."""
        self._uid_columns: dict[str, tuple[float, UidSplit | None]] = {}
        """(until when it holds, the table's size and uid type, or None) by table name."""
        self._histograms: dict[str, tuple[float, tuple[str, ...] | None]] = {}
        """(until when it holds, the uid's histogram in a sample, or None) by table name."""
        self._pushdowns = PushdownCache()
        self._groups_per_user: dict[Any, tuple[float, float | None]] = {}
        """(until when it holds, groups per user) by query (`Prepared.cache_key`) and slice."""
        self._nondeterministic: bool | None = None
        self._restricted_role = restricted_role
        """The role analysts' own SQL runs as: a DP query reads no table it cannot."""
        d = config.defaults
        self._row_work = RowWorkBudget(d.max_row_work_passes, d.max_row_work_bytes)
        self._quantum = d.release_quantum_ms / 1000.0

    # ------------------------------------------------------------------ analysis and planning

    def _settings(self, session: Session, st: Statement) -> tuple[float, float, int, NoiseKind,
                                                                  SelectionKind]:
        s = session.settings
        values: dict[str, Any] = {"epsilon": s.epsilon, "delta": s.delta,
                                  "max_groups_contributed": s.max_groups_contributed,
                                  "noise": s.noise, "partition_selection": s.partition_selection}
        # the per-query caps are checked against the plan's cost, after the budget; the
        # least ε, here, before anything runs (whether set by SET, OPTIONS or the defaults)
        unlimited = Caps(math.inf, 1.0 - 1e-12, 10_000, session.caps.min_epsilon)
        if st.dp_clause is not None:
            for name, value in st.dp_clause.options:
                if name == "max_rows_contributed":
                    raise FeatureNotSupported(
                        "max_rows_contributed is not supported: dp-proxy bounds each user's "
                        "groups (max_groups_contributed) and each user's value in a group (the "
                        "aggregates' bounds)", hint="use max_groups_contributed")
                if name != "privacy_unit_column":  # (checked by the analysis)
                    values[name] = validate(name, value, unlimited)
        values["epsilon"] = validate("epsilon", values["epsilon"], unlimited)
        return (float(values["epsilon"]), float(values["delta"]),
                int(values["max_groups_contributed"]), NoiseKind(values["noise"]),
                SelectionKind(values["partition_selection"]))

    @staticmethod
    async def _probe(query: AnalyzedQuery, conn: Any) -> list[Any]:
        """The result attributes of `argument_probe_sql(query)` (none when it has nothing to
        ask), which Postgres reports when the statement is prepared (never run)."""
        probe = argument_probe_sql(query)
        return [] if probe is None else list((await conn.prepare(probe)).get_attributes())

    async def prepare(self, session: Session, st: Statement, bind: p.Bind | None,
                      param_types: Sequence[int] = (), conn: Any = None) -> Prepared:
        """Analyse and plan `st` and prepare its pushdown; raises DPError on refusal.

        With `conn` (a pushdown connection the caller holds) the prepared statement
        stays usable for running the pushdown without planning it again.
        """
        if conn is None:
            async with self.pool.acquire() as own:
                return await self.prepare(session, st, bind, param_types, own)
        link = session.link
        assert link is not None
        params = None if bind is None else \
            await self._bind_params(bind, param_types, link.codec, link.encoding)
        unit = st.dp_clause.option("privacy_unit_column") if st.dp_clause is not None else None

        def analysis(integer_types: dict[int, str] | None = None) -> AnalyzedQuery:
            return analyze(parse_select(st.stripped_sql, params), self.policy,
                           plain_form=st.dp_clause is None,
                           privacy_unit=None if unit is None else str(unit),
                           integer_types=integer_types, row_work=self._row_work)

        query = analysis()
        epsilon, delta, max_groups, noise, selection = self._settings(session, st)
        try:
            await self._check_relations(query, conn)
            attrs = await self._probe(query, conn)
            types = {a.name: a.type.name for a in attrs}
            for i in range(len(query.arithmetic)):
                if types[f"t{i}"] not in NUMBER_TYPES:
                    # (the total form computes in numeric: a cast of jsonb, say, that fails on
                    # some values)
                    raise FeatureNotSupported(
                        f"not allowed in a DP query (arithmetic on {types[f't{i}']}: only on "
                        "numbers)")
            integers = {c.location: types[f"t{i}"] for i, c in enumerate(query.arithmetic)
                        if types[f"t{i}"] in INTEGER_TYPES}
            if integers:
                # integer arithmetic as Postgres types it: analysed again with that known,
                # so that `duration / 60` truncates and keeps its type (`_as_integer`)
                query = analysis(integers)
                attrs = await self._probe(query, conn)
                types = {a.name: a.type.name for a in attrs}
            arg_types = {int(name[1:]): t for name, t in types.items() if name[0] == "a"}
            check_casts(query.casts, [types[f"c{i}"] for i in range(len(query.casts))])
            if attrs:
                query = query.with_hashed_keys(await self._hashed_keys(
                    [a.type.oid for a in attrs if a.name[0] == "k"], conn))
            # what the statements depend on but the order seed (`PushdownCache`)
            cache_key = (st.sql, bind.param_formats if bind else None,
                         bind.params if bind else None, tuple(param_types), epsilon, delta,
                         max_groups, noise, selection, tuple(sorted(arg_types.items())),
                         tuple(k.hashed for k in query.keys), tuple(sorted(integers.items())))
            plan = make_plan(query, epsilon, delta, max_groups, noise, selection=selection)
            pd = self._pushdowns.pushdown(cache_key, query, plan, arg_types)
            statements = {name: await conn.prepare(sql) for name, sql in pd.statements().items()}
        except asyncpg.PostgresError as e:
            raise _planning_error(e) from None
        key_types: list[TypeRef] = []
        key_oids: list[int] = []
        if query.keys:  # grouped: the main statement has the keys (it counts the users)
            main = {a.name: a.type for a in statements["main"].get_attributes()}
            key_types = [(main[f"dp_k{i}"].schema, main[f"dp_k{i}"].name)
                         for i in range(len(query.keys))]
            key_oids = [main[f"dp_k{i}"].oid for i in range(len(query.keys))]
        param_oids: list[int] = []
        for stmt in statements.values():
            found = [t.oid for t in stmt.get_parameters()]
            param_oids = found if len(found) > len(param_oids) else param_oids
        prepared = Prepared(query, plan, pd, statements, arg_types, key_types, key_oids,
                            param_oids, cache_key=cache_key)
        # The result query (HAVING, ORDER BY and expressions over the released values), with
        # no rows: what it cannot use is refused here, before any charge, not after the run.
        try:
            result = await conn.prepare(self._result_sql(prepared, []))
        except asyncpg.PostgresError as e:
            raise _planning_error(e) from None
        prepared.columns = list(result.get_attributes())
        return prepared

    async def _check_relations(self, query: AnalyzedQuery, conn: Any) -> None:
        """Refuse (42501) a DP query that reads by name a table the analysts may not read
        themselves: the ledger's schema, a system schema, or one the restricted role has no
        SELECT on. The pushdown role reads more (the ledger, protected rows): a DP query
        reads nothing through it that is not protected (and so bounded) or public. A name
        that resolves to nothing is left to Postgres (42P01 when the pushdown is prepared)."""
        closed = {self.config.backend.ledger_schema, "information_schema"}
        for schema, name in query.relations:
            qualified = quote_ident(name) if schema is None \
                else f"{quote_ident(schema)}.{quote_ident(name)}"
            row = await conn.fetchrow(
                "SELECT n.nspname, has_table_privilege($2::text, c.oid, 'SELECT') AS readable, "
                "c.relrowsecurity FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n "
                "ON n.oid = c.relnamespace WHERE c.oid = pg_catalog.to_regclass($1)",
                qualified, self._restricted_role)
            if row is None:
                continue
            namespace = str(row["nspname"])
            # (a table under row-level security shows the pushdown role other rows than the
            # analysts: unless protected, it is not public)
            if namespace in closed or namespace.startswith("pg_") or not row["readable"] \
                    or row["relrowsecurity"]:
                raise InsufficientPrivilege(
                    f"a DP query reads only protected tables and tables the analysts may read, "
                    f"not {qualified}")
        for sql in standalone_subqueries(query):
            try:
                await conn.prepare(sql)
            except (asyncpg.UndefinedColumnError, asyncpg.UndefinedTableError):
                raise FeatureNotSupported(
                    "not allowed in a DP query (IN and EXISTS subqueries that read the DP "
                    "query's row: they would run once per row; write a join instead)") from None

    async def _hashed_keys(self, key_oids: list[int], conn: Any) -> list[int]:
        """Which keys (of a query with quantiles, by type) match a group's row with its trees
        by hash rather than text (`Key.hashed`)."""
        if any(o in _TEXT_KEY_OIDS for o in key_oids) and await self._has_nondeterministic(conn):
            hashed = _HASHED_KEY_OIDS | _TEXT_KEY_OIDS  # 'a' = 'A' may be a group
        else:
            hashed = _HASHED_KEY_OIDS
        return [i for i, o in enumerate(key_oids) if o in hashed]

    async def _has_nondeterministic(self, conn: Any) -> bool:
        """Whether the database has a nondeterministic collation (read once)."""
        if self._nondeterministic is None:
            self._nondeterministic = bool(await conn.fetchval(
                "SELECT EXISTS (SELECT FROM pg_collation WHERE NOT collisdeterministic)"))
        return self._nondeterministic

    async def _split_candidate(self, prepared: Prepared, conn: Any) -> UidSplit | None:
        """Whether the pushdown may be split by uid ranges, before any charge (and for
        EXPLAIN): only over a large table (by the catalog's estimate of its rows), with group
        keys whose texts rows can be added up by, no COUNT(DISTINCT x), and (grouped rows and
        trees merge as streams in key order) a server encoding whose byte order is the
        code points'. Reads the catalog only, never a row of a table: the uid's histogram,
        which the ranges are cut from, is sampled after the charge (`_split`), without
        `histogram` here."""
        b = self.config.backend
        table = _uid_table(prepared.query)
        if b.pushdown_split < 2 or table is None or any(
                o not in _SPLIT_KEY_OIDS for o in prepared.key_oids):
            return None
        if any(a.kind is AggKind.COUNT_DISTINCT for a in prepared.query.aggregates):
            return None  # (distinct values do not add up over ranges of users: one value, many)
        if prepared.key_oids and conn.get_settings().server_encoding not in _CODE_POINT_ORDER:
            return None
        try:
            # a nondeterministic collation makes 'a' = 'A' a group
            if any(o in _TEXT_KEY_OIDS for o in prepared.key_oids) and \
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

    async def _split(self, prepared: Prepared, candidate: UidSplit, conn: Any) -> None:
        """After the charge: sets how the pushdown is split by uid ranges (`prepared.split`,
        `.ranged`, `.split_ranges`, `.prefilter`), from a sample of the uid column (remembered
        for _STATS_SECONDS) and the prefilter's count of groups per user. Where that cannot
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
            prefilter = await self._prefilter(prepared, split, conn)
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

    async def _prefilter(self, prepared: Prepared, split: UidSplit, conn: Any) -> Prefilter | None:
        """Whether the split pushdown picks users' groups from their rows before aggregating
        them (`Prefilter`): where that is faster, for users with many groups, few of which
        they keep. Counted on a slice of about 4% of the rows (remembered for
        _STATS_SECONDS); where the pushdown runs unsplit (no pool connection free) it stays
        as it is.

        The answer does not depend on the choice: either way each user keeps C_u of its
        groups chosen by a keyed hash with a fresh key, and the statements of one answer
        all run split or all unsplit, so they keep the same groups. The choice shows only in
        the time an answer takes (and the operators' metrics), never in EXPLAIN; a sample
        of fewer than _GROUPS_MIN_USERS users (a WHERE clause that picks a few) gets none,
        and keys that read the uid get none, so that no one user decides it: its effect on
        the average is its groups over the sample's users."""
        query, plan = prepared.query, prepared.plan
        if not query.keys or any(schema != "pg_catalog" for schema, _ in prepared.key_types) \
                or query.keys_read_uid:
            return None
        types = prefilter_types(split.uid_type, [name for _, name in prepared.key_types])
        slices = uid_ranges(split.histogram, _GROUPS_SLICES)
        if types is None or len(slices) < 3:
            return None
        middle = slices[len(slices) // 2]
        key = (prepared.cache_key, middle, split.uid_not_null)
        now = time.monotonic()
        cached = self._groups_per_user.get(key)
        if cached is None or cached[0] < now:
            try:
                row = await conn.fetchrow(groups_sql(query, middle, split.uid_not_null),
                                          timeout=min(_GROUPS_TIMEOUT,
                                                      self.config.backend.statement_timeout))
            except (asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as e:
                log.warning("could not count the groups per user of a DP pushdown: %s", e)
                row = None
            ratio = row["dp_groups"] / row["dp_users"] \
                if row and row["dp_users"] >= _GROUPS_MIN_USERS else None
            if len(self._groups_per_user) >= 1000:  # (bounded: fresh ones too, if need be)
                fresh = {k: v for k, v in self._groups_per_user.items() if v[0] >= now}
                self._groups_per_user = fresh if len(fresh) < 1000 else {}
            cached = self._groups_per_user[key] = (now + _STATS_SECONDS, ratio)
        ratio = cached[1]
        if ratio is None or ratio < _PREFILTER_GROUPS_PER_USER or \
                plan.max_groups_contributed > _PREFILTER_KEPT_SHARE * ratio:
            return None
        return types

    async def _uid_column(self, table: TableRef, conn: Any) -> UidSplit | None:
        """The table's size and its uid column's type, from the catalog (no histogram yet);
        None for a table too small to split, or never analysed."""
        schema = self.policy[table.name].schema
        rows = await conn.fetchval(
            "SELECT c.reltuples::float8 FROM pg_class c JOIN pg_namespace n ON n.oid = "
            "c.relnamespace WHERE n.nspname = $1 AND c.relname = $2", schema, table.name)
        if rows is None or rows < max(1, self.config.backend.pushdown_split_min_rows):
            return None  # (-1: never analysed or vacuumed)
        name = f"{quote_ident(schema)}.{quote_ident(table.name)}"
        column = await conn.fetchrow(
            "SELECT t.typname, a.attnotnull FROM pg_attribute a JOIN pg_type t ON t.oid = "
            "a.atttypid WHERE a.attrelid = $1::regclass AND a.attname = $2", name,
            table.uid_column)
        if column is None:
            return None
        return UidSplit(table.name, table.uid_column, int(rows), (), str(column["typname"]),
                        bool(column["attnotnull"]))

    async def _uid_histogram(self, split: UidSplit, conn: Any) -> tuple[str, ...] | None:
        """Percentiles of the uid column in a sample of the table (`UidSplit.histogram`): read
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

    async def _type_name(self, oid: int) -> TypeRef:
        if oid not in self._type_names:
            row = await self.pool.fetchrow(
                "SELECT n.nspname, t.typname FROM pg_type t JOIN pg_namespace n "
                "ON n.oid = t.typnamespace WHERE t.oid = $1", oid)
            if row is None:
                raise InvalidParameterValue(f"unknown parameter type oid {oid}")
            self._type_names[oid] = (row[0], row[1])
        return self._type_names[oid]

    async def _bind_params(self, bind: p.Bind, param_types: Sequence[int], codec: str,
                           encoding: str) -> dict[int, Any]:
        """The Bind's parameter values (text in the client encoding: its Python codec and
        name) as typed constants for the analysis."""
        out: dict[int, Any] = {}
        for i, raw in enumerate(bind.params):
            oid = param_types[i] if i < len(param_types) and param_types[i] else 0
            text = None if raw is None else \
                param_text(raw, bind.param_format(i), oid, codec, encoding)
            const: Any = ast.A_Const(isnull=True) if text is None else ast.A_Const(
                val=ast.String(sval=text))
            if oid:
                schema, name = await self._type_name(oid)
                const = ast.TypeCast(arg=const, typeName=ast.TypeName(
                    names=(ast.String(sval=schema), ast.String(sval=name))))
            out[i + 1] = const
        return out

    # ------------------------------------------------------------------ answering

    async def describe(self, session: Session, st: Statement, bind: p.Bind | None,
                       param_types: Sequence[int], formats: Sequence[int]) -> p.RowDescription:
        if st.kind is StatementKind.DP_EXPLAIN:
            return row_description(["QUERY PLAN"], [_OIDS["text"]], formats)
        if st.kind is StatementKind.LOCAL_FUNCTION:
            # the rewritten query (with a reset not performed) tells its own columns
            sql = await self.local_function(session, st, dry_run=True, bind=bind,
                                            param_types=param_types)
            async with self._acquire() as conn:
                attrs = (await conn.prepare(sql)).get_attributes()
            return row_description([a.name for a in attrs], [a.type.oid for a in attrs], formats)
        async with self._acquire() as conn:
            # the result query, with no rows, tells the columns (computed ones included)
            attrs = (await self.prepare(session, st, bind, param_types, conn)).columns
        return row_description([a.name for a in attrs], [a.type.oid for a in attrs], formats)

    @contextlib.asynccontextmanager
    async def _acquire(self) -> AsyncIterator[Any]:
        """A pushdown connection, waited for at most `pushdown_wait` seconds; a pool or a
        backend with no connection free is a clean 53300 (nothing charged), not a bug."""
        wait = self.config.backend.pushdown_wait
        try:
            conn = await self.pool.acquire(timeout=wait)
        except TimeoutError:
            err = DPError(f"no connection for DP queries became free within {fmt(wait)} s: "
                          "other DP queries hold them all",
                          hint="try again; an operator can raise pushdown_pool_size")
            err.sqlstate = "53300"
            raise err from None
        except (asyncpg.TooManyConnectionsError, asyncpg.CannotConnectNowError, OSError):
            err = DPError("the backend database has no connection slot free for the DP engine",
                          hint="try again; an operator can raise the backend's max_connections")
            err.sqlstate = "53300"
            raise err from None
        try:
            yield conn
        finally:
            await self.pool.release(conn)

    @contextlib.asynccontextmanager
    async def _turn(self, analyst: str) -> AsyncIterator[None]:
        """One of the analyst's `max_dp_queries` DP queries at once in this process: beyond it
        a query waits for one of them to end, at most `pushdown_wait` seconds (then 53300,
        before anything is charged), so that one analyst's burst (a dashboard's) queues
        behind itself and never holds every pushdown connection while the others wait."""
        limit = self.config.analysts[analyst].max_dp_queries
        turns = self._turns.get(analyst)
        if turns is None or turns[0] != limit:  # (a reload may change the limit)
            turns = self._turns[analyst] = (limit, asyncio.Semaphore(limit))
        wait = self.config.backend.pushdown_wait
        try:
            await asyncio.wait_for(turns[1].acquire(), wait)
        except TimeoutError:
            err = DPError(f'analyst "{analyst}" has {limit} DP queries running (max_dp_queries) '
                          f"and none ended within {fmt(wait)} s",
                          hint="run fewer at once; nothing was charged")
            err.sqlstate = "53300"
            raise err from None
        try:
            yield
        finally:
            turns[1].release()

    async def parameter_types(self, session: Session, st: Statement,
                              declared: Sequence[int]) -> tuple[int, ...]:
        if st.kind in (StatementKind.DP_QUERY, StatementKind.DP_EXPLAIN):
            prepared = await self.prepare(session, st, None)
            found = list(prepared.param_oids)
            return tuple(d or f for d, f in zip(list(declared) + [0] * len(found), found,
                                                strict=False))
        if st.kind is StatementKind.LOCAL_FUNCTION:  # analyst names: text
            return tuple(d or _OIDS["text"] for d in declared)
        return tuple(declared)

    async def answer(self, session: Session, st: Statement, bind: p.Bind | None,
                     param_types: Sequence[int]) -> tuple[str, list[p.NoticeResponse]]:
        """Run a DP query or EXPLAIN; returns the result query to relay and notices to send.

        Every attempt that does not end in an answer is appended to the ledger with
        its outcome (the audit trail); answers are there as charges.
        """
        started = time.perf_counter()
        async with self._turn(session.user) if st.kind is StatementKind.DP_QUERY else \
                contextlib.nullcontext():
            return await self._answer_turn(session, st, bind, param_types, started)

    async def _answer_turn(self, session: Session, st: Statement, bind: p.Bind | None,
                           param_types: Sequence[int],
                           started: float) -> tuple[str, list[p.NoticeResponse]]:
        async with self._acquire() as conn:
            try:
                answer = await self._answer(session, st, bind, param_types, conn,
                                            time.monotonic())
                if st.kind is StatementKind.DP_QUERY:
                    self.metrics.dp_seconds.observe(time.perf_counter() - started)
                return answer
            except DPError as e:
                if st.kind is not StatementKind.DP_EXPLAIN:
                    try:
                        await self.ledger.record(session.user, f"{e.sqlstate}: {e.message}",
                                                 st.sql)
                    except (asyncpg.PostgresError, OSError):
                        log.warning("session %s: could not audit a refused query", session.process_id)
                raise

    async def _release_on_quantum(self, arrived: float) -> None:
        """Hold a charged outcome until the next multiple of the release quantum after the
        query arrived (DESIGN §3.11): its time then tells only how many quanta the work took."""
        if self._quantum <= 0:
            return
        elapsed = time.monotonic() - arrived
        quanta = max(1, math.ceil(elapsed / self._quantum))
        await asyncio.sleep(max(0.0, quanta * self._quantum - elapsed))

    async def _answer(self, session: Session, st: Statement, bind: p.Bind | None,
                      param_types: Sequence[int], conn: Any,
                      arrived: float) -> tuple[str, list[p.NoticeResponse]]:
        prepared = await self.prepare(session, st, bind, param_types, conn)
        if bind is not None and len(bind.result_formats) > 1:
            # Postgres checks this at Bind; the proxy, before the charge
            columns = 0 if st.wraps_result else 1 if st.kind is StatementKind.DP_EXPLAIN \
                else len(prepared.columns)
            if len(bind.result_formats) != columns:
                raise BindMismatch(f"bind message has {len(bind.result_formats)} result formats "
                                   f"but query has {columns} columns")
        # whether the pushdown may be split: from the catalog, reading no row (the split's
        # sample and the prefilter's choice read the analyst's tables, after the charge)
        candidate = await self._split_candidate(prepared, conn)
        plan = prepared.plan
        if st.kind is StatementKind.DP_EXPLAIN:
            if candidate is not None:
                prepared.split = candidate
                prepared.split_ranges = self.config.backend.pushdown_split
            lines = explain_lines(prepared.query, plan, prepared.sql, None if prepared.split is None
                                  else Split(prepared.split_ranges, prepared.split.table,
                                             prepared.split.uid_column, prepared.split.rows))
            return result_sql(["QUERY PLAN"], [(PG, "text")], [(ln,) for ln in lines]), []
        mechanisms = plan.mechanisms()
        accountant = self.config.analysts[session.user].accountant
        try:
            await self._check_affordable(session, prepared.query, plan, accountant)
            await self.ledger.charge(session.user, AnswerCost.of(plan), st.sql, mechanisms,
                                     accountant=accountant)
            self.metrics.epsilon_spent.labels(session.user).inc(float(plan.cost.epsilon))
            session.dp_charged()
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as e:
            log.error("session %s: ledger unavailable: %s", session.process_id, e)
            raise LedgerUnavailable() from None
        try:
            if candidate is not None:
                await self._split(prepared, candidate, conn)
            run = await self._run(prepared, conn)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as e:
            log.warning("session %s: charged DP query failed: %s", session.process_id,
                        type(e).__name__)
            await self._release_on_quantum(arrived)
            raise QueryFailed() from None
        released = release(run.query, run.plan, run.rows, quantiles=run.quantiles,
                           selection=run.selection)
        sql = self._result_sql(prepared, released.rows)
        budget = await self.ledger.budget(session.user)
        await self._release_on_quantum(arrived)
        return sql, [self._notice(prepared, run, released, budget)]

    async def _run(self, prepared: Prepared, conn: Any) -> _Run:
        """Run the pushdown (after the charge): APPROX_BOUNDS first, then main and trees.

        All statements see one snapshot and keep the same rows per user (one order seed).
        Where the pushdown may be split (`UidSplit`) and the pool has connections free, each
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
            await self._begin(conn, stack)
            ranges, conns = await self._split_run(prepared, conn, stack)
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

            if "bounds" in statements:
                bins: dict[int, dict[int, int]] = {i: {} for i in plan.auto_bounds}
                for r in await fetch_bounds():
                    bins[int(r["dp_agg"])][int(r["dp_bin"])] = int(r["dp_n"])
                for q in plan.approx_bounds:
                    assert q.aggregate is not None
                    found[q.aggregate] = choose_bounds(
                        bins[q.aggregate], q.spec, rng, query.aggregates[q.aggregate].output_name)
                query = query.with_bounds({i: Bounds(f.lower, f.upper) for i, f in found.items()})
                plan = make_plan(query, float(plan.epsilon), float(plan.delta),
                                 plan.max_groups_contributed, plan.noise_kind, plan.auto_bounds,
                                 plan.selection_asked)
                if plan.cost != prepared.plan.cost:
                    raise InternalError("the plan's cost changed with its bounds (this is a bug)")
                seed = prepared.pushdown.order_seed
                if ranges:  # the ranges run every statement: their names are all that is used
                    ranged = ranged_pushdown(query, plan, prepared.arg_types, seed,
                                             prepared.prefilter,
                                             prepared.split is not None
                                             and prepared.split.uid_not_null)
                    shards = [ranged.of(r).statements() for r in ranges]
                    statements = dict.fromkeys(n for n in shards[0] if n != "bounds")
                else:
                    pd = pushdown(query, plan, prepared.arg_types, seed)
                    statements = {name: await conn.prepare(sql)
                                  for name, sql in pd.statements().items() if name != "bounds"}
            # partition selection first (only the kept groups' trees are walked), over the
            # rows as they stream: a worker holds one batch and the kept groups, not every group
            chosen = SelectionStream(query, plan, rng)
            if "main" in statements:
                if ranges:
                    streams = [_row_stream(await (await c.prepare(sqls["main"])).cursor(
                        timeout=timeout + 5), timeout, len(conns))
                        for c, sqls in zip(conns, shards, strict=True)]
                    rows_in: AsyncIterator[Any] = _merged_rows(streams, len(query.keys))
                else:
                    rows_in = _row_stream(await statements["main"].cursor(timeout=timeout + 5),
                                          timeout)
                batch: list[Any] = []
                async for r in rows_in:
                    batch.append(r)
                    if len(batch) >= _ROWS_PER_SELECTION:
                        chosen.add(batch)
                        batch = []
                chosen.add(batch)
            selection = chosen.done()
            rows = selection.rows
            quantiles: dict[tuple[GroupKey, int], float] = {}
            if "trees" in statements:
                wanted, keys = selection.matched, len(query.keys)
                # streamed: each row is one group's whole tree (up to 69,904 nodes) and only
                # its answer is kept; split, the ranges' streams are merged a group at a time
                if ranges:
                    streams = [_tree_stream(await (await c.prepare(sqls["trees"])).cursor(
                        timeout=timeout + 5), timeout, len(conns))
                        for c, sqls in zip(conns, shards, strict=True)]
                    trees = _merged_trees(streams, keys)
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
        return _Run(query, plan, rows, quantiles, found, selection)

    async def _begin(self, conn: Any, stack: contextlib.AsyncExitStack,
                     snapshot: str | None = None) -> None:
        """Start a pushdown's read-only transaction on `conn` (in `snapshot`, exported by the
        first connection of a split run), ended by `stack`."""
        await stack.enter_async_context(conn.transaction(readonly=True, isolation="repeatable_read"))
        if snapshot is not None:
            await conn.execute(f"SET TRANSACTION SNAPSHOT '{snapshot}'")
        # enforced by Postgres for each statement (the ledger's have none)
        timeout = self.config.backend.statement_timeout
        await conn.execute(f"SET LOCAL statement_timeout = {int(timeout * 1000)}")

    async def _split_run(self, prepared: Prepared, conn: Any,
                         stack: contextlib.AsyncExitStack) -> tuple[list[UidRange], list[Any]]:
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
            await self._begin(other, stack, snapshot)
            conns.append(other)
        if len(conns) < len(ranges):
            ranges = uid_ranges(split.histogram, len(conns))
            conns = conns[:len(ranges)]
            if len(ranges) < 2:
                return [], [conn]
        return ranges, conns

    async def _check_affordable(self, session: Session, query: AnalyzedQuery,
                                plan: DPQueryPlan, accountant: Accountant) -> None:
        """A query costing more than is left gets 53400; then the per-query caps and noise
        too small for its grid (22023).

        (With the RDP accountant an answer may cost less than its nominal ε: the charge decides.)
        """
        if accountant is Accountant.BASIC:
            budget = await self.ledger.budget(session.user)
            check_affordable(budget, to_numeric(plan.cost.epsilon), to_numeric(plan.cost.delta))
        caps = session.caps
        if float(plan.epsilon) > caps.max_epsilon:
            raise InvalidParameterValue(
                f"epsilon {fmt(float(plan.epsilon))} is above this proxy's per-query limit "
                f"{fmt(caps.max_epsilon)}")
        if float(plan.delta) > caps.max_delta:
            raise InvalidParameterValue(
                f"delta {fmt(float(plan.delta))} is above this proxy's per-query limit "
                f"{fmt(caps.max_delta)}")
        if plan.max_groups_contributed > caps.max_groups_contributed:
            raise InvalidParameterValue(
                f"max_groups_contributed {plan.max_groups_contributed} is above this proxy's "
                f"limit {caps.max_groups_contributed}")
        check_noise_scales(query, plan)

    @staticmethod
    def _result_sql(prepared: Prepared, rows: Sequence[Sequence[Any]]) -> str:
        q = prepared.query
        visible = [(item.name, item.column if item.column is not None else item.expr)
                   for item in q.select]
        return result_sql(prepared.names, prepared.types(), rows,
                          sources=[o.source for o in q.outputs], having=q.having,
                          order_by=q.order_by, limit=q.limit, offset=q.offset, visible=visible,
                          outer=q.outer)

    def _notice(self, prepared: Prepared, run: _Run, released: Released,
                budget: Any) -> p.NoticeResponse:
        message, detail = notice_text(prepared.query, run.plan, released.spread, run.bounds,
                                      float(budget.epsilon_remaining),
                                      float(budget.delta_remaining))
        return notice_response(message, detail)

    # ------------------------------------------------------------------ dp_budget() and friends

    async def local_function(self, session: Session, st: Statement, dry_run: bool = False,
                             bind: p.Bind | None = None, param_types: Sequence[int] = ()) -> str:
        """Rewrite the statement with the function's result in place; returns SQL to relay.

        With `dry_run` nothing is changed (a reset is not done): the SQL only tells the
        columns, and an analyst name still unbound (`$1` before Bind) stands for the caller.
        """
        if st.protected:
            raise FeatureNotSupported("dp_budget(), dp_ledger() and dp_reset_budget() cannot be "
                                      "combined with protected tables")
        params = None
        if bind is not None:
            link = session.link
            assert link is not None
            params = await self._bind_params(bind, param_types, link.codec, link.encoding)
        stmt = parse_select(st.stripped_sql, params)
        is_admin = session.config.analysts[session.user].admin
        replacer = LocalFunctions(self.ledger, session.user, is_admin, dry_run)
        await replacer.resolve(stmt)
        replacer(stmt)
        return str(RawStream()(stmt))


__all__ = ["DPService", "InternalError", "QueryFailed"]
