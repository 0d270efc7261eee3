"""Preparing a DP query before any charge: analysis, plan, pushdown statements planned by Postgres."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import asyncpg
from pglast import ast

from config import Config
from config.models import MAX_PUBLIC_KEYS, TableConfig
from dp_core.analysis import analyze, parse_select
from dp_core.catalogue import INTEGER_TYPES, NUMBER_TYPES, check_casts, check_mixes
from dp_core.classify import Statement
from dp_core.clock import fix_clock
from dp_core.cost import RowWorkBudget
from dp_core.errors import (
    DPError,
    FeatureNotSupported,
    InsufficientPrivilege,
    InternalError,
    InvalidParameterValue,
    ProgramLimitExceeded,
    StatementTooComplex,
)
from dp_core.names import InputColumns
from dp_core.partials import digested_whole
from dp_core.plan import DPQueryPlan, make_plan
from dp_core.probes import argument_probe_sql, column_probe_sql, standalone_subqueries
from dp_core.pushdown_cache import PushdownCache
from dp_core.query import (
    AggKind,
    AnalyzedQuery,
    Bounds,
    KeyDomain,
    TablePolicy,
)
from dp_core.result import TypeRef
from dp_core.rewrite import binned
from dp_core.settings import QuerySettings, query_settings
from dp_core.table_tuning import Applied, TableTuning, applied, may_use_tuning
from server import wire as p
from server.backend_setup import quote_ident
from server.dp_query.context import fixed_clock, relation_schemas
from server.dp_query.key_types import (
    HASHED_KEY_OIDS,
    ONE_TEXT_KEY_OIDS,
    TEXT_KEY_OIDS,
    canonical_keys,
)
from server.dp_query.prepared import Prepared, answer_sql
from server.dp_query.public_rows import check_public_rows
from server.dp_query.request import DPRequest
from server.dp_query.type_shapes import (
    check_collations,
    check_comparisons,
    check_text_outputs,
    probed_shapes,
)
from server.wire.params import param_text


def planning_error(e: asyncpg.PostgresError) -> DPError:
    """Postgres's error on preparing a generated statement, as the analyst's: planning reads
    no rows, so its errors (unknown column, type mismatch) are safe to show."""
    message = str(e).replace("dp_per_user", "the query").replace("dp_result.", "")
    err = DPError(message.replace("dp_result", "the result"))
    err.sqlstate = e.sqlstate or "XX000"
    return err


def table_policy(t: TableConfig) -> TablePolicy:
    """What the analysis needs of a protected table's configuration."""
    return TablePolicy(
        t.schema_, t.uid_column,
        {c: Bounds(b.lower, b.upper) for c, b in t.columns.items()
         if b.lower is not None and b.upper is not None},
        {c: KeyDomain(None if b.public_keys is None else tuple(str(k) for k in b.public_keys),
                      b.keys_source())
         for c, b in t.columns.items() if b.public_keys is not None or b.public_keys_from})


_ANALYSIS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dp-analysis")
"""Threads of their own for DP queries' parse and analysis (not the default executor's,
which releases answers: a burst of long analyses must not hold those up)."""


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(_ANALYSIS, fn, *args)


def _planned(query: AnalyzedQuery, settings: QuerySettings, **options: Any) -> DPQueryPlan:
    """`make_plan` for the query's settings (ε, δ, C_u, noise, selection) and `options`."""
    return make_plan(query, settings.epsilon, settings.delta, settings.max_groups_contributed,
                     settings.noise, selection=settings.selection, **options)


TuningsSource = Callable[[], Awaitable[Mapping[str, TableTuning]]]
"""Reads the tables' tuned bounds (the ledger's), when a query could use them."""


class Preparer:
    """Analyses, plans and prepares DP queries on pushdown connections, reading no row."""

    def __init__(self, config: Config, pool: asyncpg.Pool, restricted_role: str) -> None:
        self.config = config
        self.pool = pool
        self.policy = {name: table_policy(t) for name, t in config.tables.items()}
        self.pushdowns = PushdownCache()
        self._type_names: dict[int, TypeRef] = {}
        self._nondeterministic: bool | None = None
        self._restricted_role = restricted_role
        """The role analysts' own SQL runs as: a DP query reads no table it cannot."""
        d = config.defaults
        self._row_work = RowWorkBudget(d.max_row_work_passes, d.max_row_work_bytes)

    @staticmethod
    async def _probe(query: AnalyzedQuery, conn: Any) -> list[Any]:
        """The result attributes of `argument_probe_sql(query)` (none when it has nothing to
        ask), which Postgres reports when the statement is prepared (never run)."""
        probe = argument_probe_sql(query)
        return [] if probe is None else list((await conn.prepare(probe)).get_attributes())

    async def prepare(self, request: DPRequest, st: Statement, bind: p.Bind | None,
                      param_types: Sequence[int] = (), conn: Any = None,
                      tunings: TuningsSource | None = None) -> Prepared:
        """`_prepare`, where a query too large for the analysis's recursion gets 54001 (not
        an internal error: 1,500 select items and keys exceeded it comparing nodes)."""
        try:
            return await self._prepare(request, st, bind, param_types, conn, tunings)
        except RecursionError:
            raise StatementTooComplex(
                "a DP query too large to analyse (its expressions or lists nest or repeat "
                "past what the proxy reads)",
                hint="write fewer select items, keys or nested expressions") from None

    async def _prepare(self, request: DPRequest, st: Statement, bind: p.Bind | None,
                       param_types: Sequence[int] = (), conn: Any = None,
                       tunings: TuningsSource | None = None) -> Prepared:
        """Analyse and plan `st` and prepare its pushdown; raises DPError on refusal.

        With `conn` (a pushdown connection the caller holds) the prepared statement
        stays usable for running the pushdown without planning it again. `tunings`: reads the
        tables' tuned bounds (`dp_core.table_tuning`), which a query of one of them alone
        uses where neither it nor the session fixes max_rows_contributed (read only then).
        """
        if conn is None:
            async with self.pool.acquire() as own:
                return await self._prepare(request, st, bind, param_types, own, tunings)
        params = None if bind is None else \
            await self.bind_params(bind, param_types, request.codec, request.encoding)
        unit = st.dp_clause.option("privacy_unit_column") if st.dp_clause is not None else None

        columns: InputColumns | None = None
        # what the text means in the session: the tables its names find in the session's
        # search_path, and its relative dates fixed now (catalog reads and constants only)
        # (parsed and analysed in a thread: that work grows with the text, and the event
        # loop serves the worker's other sessions meanwhile)
        parsed = await _in_thread(parse_select, st.stripped_sql, params)
        try:
            schemas = None if request.search_path is None else \
                await relation_schemas(conn, parsed, request.search_path)
            clock, clock_now = await fixed_clock(
                conn, parsed, request.timezone, 60 * self.config.defaults.clock_granularity_minutes)
        except asyncpg.PostgresError as e:
            raise planning_error(e) from None

        def analysis(integer_types: dict[int, str] | None = None) -> AnalyzedQuery:
            stmt = parse_select(st.stripped_sql, params)
            fix_clock(stmt, clock)
            return analyze(stmt, self.policy, plain_form=st.dp_clause is None,
                           privacy_unit=None if unit is None else str(unit),
                           integer_types=integer_types, row_work=self._row_work,
                           columns=columns, schemas=schemas,
                           dp_at=None if st.dp_clause is None else st.dp_clause.select_offset)

        query = await _in_thread(analysis)
        settings = query_settings(request.settings, request.caps,
                                  st.dp_clause.options if st.dp_clause is not None else ())
        try:
            await self._check_relations(query, conn)
            fanout = await check_public_rows(query, conn)
            for _ in range(2):
                # names of GROUP BY, then of HAVING and ORDER BY (read against its grouping),
                # as Postgres reads them in the query's FROM
                if not query.name_checks:
                    break
                columns = {**(columns or {}), **await self._input_columns(query, conn)}
                query = await _in_thread(analysis)
            if query.name_checks:
                raise InternalError()
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
                query = await _in_thread(analysis, integers)
                attrs = await self._probe(query, conn)
                types = {a.name: a.type.name for a in attrs}
            arg_types = {int(name[1:]): t for name, t in types.items() if name[0] == "a"}
            shapes = await probed_shapes(attrs, conn)
            check_casts(query.casts, [types[f"c{i}"] for i in range(len(query.casts))])
            check_text_outputs([(c.text, shapes[f"c{i}"]) for i, c in enumerate(query.casts)
                                if c.output])
            check_text_outputs([(a.output_name, shapes[f"a{i}"])
                                for i, a in enumerate(query.aggregates)
                                if a.kind is AggKind.COUNT_DISTINCT and f"a{i}" in shapes
                                and not digested_whole(types[f"a{i}"])])
            # (an array's or a domain's values converted as their elements' or base's)
            check_mixes(query.mixes, [[shapes[f"m{i}_{j}"].name for j in range(len(m.operands))]
                                      for i, m in enumerate(query.mixes)])
            await check_comparisons(query, shapes, conn)
            await check_collations(query, shapes, conn)
            probed_keys = {int(a.name[1:]): a.type for a in attrs if a.name[0] == "k"}
            query = await canonical_keys(query, probed_keys, conn)
            if query.has_quantiles:
                query = query.with_hashed_keys(await self._hashed_keys(
                    [probed_keys[i].oid for i in range(len(query.keys))], conn))
            # what the text means in the session, the answer's settings aside from the text:
            # with the text and its parameters, what the statements depend on but the order
            # seed (`PushdownCache`); a part of the question's key (`reuse.question_key`)
            meaning: tuple[Any, ...] = (settings, tuple(sorted(arg_types.items())),
                       tuple(sorted((i, t.oid) for i, t in probed_keys.items())),
                       tuple(k.hashed for k in query.keys), tuple(sorted(integers.items())),
                       tuple(sorted((name, e is None) for name, e in (columns or {}).items())),
                       None if schemas is None else tuple(sorted(schemas.items(), key=str)),
                       tuple(clock))
            cache_key: tuple[Any, ...] = (st.sql, bind.param_formats if bind else None,
                         bind.params if bind else None, tuple(param_types), *meaning)
            # the groups a query of public groups releases (read now, as the analysts could)
            public_keys = None
            if query.public_groups:
                domains = await self._domains(query, conn)
                public_keys = _combinations(domains)
                # a table's keys written into the pushdown as a list, as listed keys are: its
                # IN subquery would run only where a row reaches it (`dp_core.join_fence`)
                query = _listed(query, domains)
                cache_key = (*cache_key, tuple(tuple(d) for d in domains))
            tuned = None
            if settings.max_rows is None and tunings is not None and may_use_tuning(query):
                tuned = applied(query, self.policy, await tunings())
            if tuned is None:
                plan = _planned(query, settings, max_rows=settings.max_rows)
            else:  # (the tuning's token: a question asked again after a new tuning is new)
                meaning = (*meaning, tuned.tuning.token)
                cache_key = (*cache_key, tuned.tuning.token)
                later = self._after_selection(tuned, settings)
                if later is not None:  # (T and the clips chosen when the groups are known)
                    query, plan = tuned.base, later
                else:
                    query = tuned.query
                    # T for this query's noise: its shares first (T does not change them),
                    # weighed over the public groups it releases, where it has them
                    tuned = tuned.chosen(_planned(query, settings, max_rows=1),
                                         public=None if public_keys is None else len(public_keys))
                    t = tuned.tuned
                    plan = _planned(query, settings, max_rows=t.max_rows, mean_rows=t.mean_rows,
                                    sum_rows=t.sum_rows or t.max_rows, weights=t.weights)
            pd = self.pushdowns.pushdown(cache_key, query, plan, arg_types)
            statements = {name: await conn.prepare(sql) for name, sql in pd.statements().items()}
        except asyncpg.PostgresError as e:
            raise planning_error(e) from None
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
                            param_oids, cache_key=cache_key, meaning=meaning,
                            timezone=request.timezone,
                            clock_now=clock_now, tuned=tuned, fanout=fanout)
        if query.public_groups:
            odd = [query.keys[i] for i, o in enumerate(key_oids) if o not in ONE_TEXT_KEY_OIDS]
            if odd or (any(o in TEXT_KEY_OIDS for o in key_oids)
                       and await self.has_nondeterministic(conn)):
                # (a group's text would be whichever of its values' texts Postgres kept)
                raise FeatureNotSupported(
                    "public keys of a column whose equal values can print differently "
                    "(numeric, floats, intervals, or a database with a nondeterministic "
                    "collation)", hint="group by a cast of it to text, which partition "
                    "selection releases")
            prepared.public_keys = public_keys
        # The result query (HAVING, ORDER BY and expressions over the released values), with
        # no rows: what it cannot use is refused here, before any charge, not after the run.
        try:
            result = await conn.prepare(answer_sql(prepared, []))
        except asyncpg.PostgresError as e:
            raise planning_error(e) from None
        prepared.columns = list(result.get_attributes())
        return prepared

    @staticmethod
    def _after_selection(tuned: Applied, settings: QuerySettings) -> DPQueryPlan | None:
        """For a grouped query with a table's tuned bounds, whose groups partition selection
        picks: the plan whose T (and clips) the run chooses from the table's statistics once
        the groups are selected (`DPQueryPlan.rows_stored`: the main statement returns its
        sums per bin of the users' rows, `dp_core.binned`), for the released groups as
        per-query tuning weighs them; None where T is chosen now (no GROUP BY, public
        groups, truncated-geometric selection (which releases no noisy user counts), clips
        stored under other bounds, bounds APPROX_BOUNDS finds, or sums that do not add up
        over bins)."""
        query = tuned.base
        if not query.keys or query.public_groups or not tuned.clips_rechosen:
            return None
        plan = _planned(query, settings, stored=frozenset(tuned.columns))
        if not binned(plan) or plan.tau is None or plan.auto_bounds:
            return None
        try:  # (what the run will do after the charge, done once here before it: pure)
            tuned.chosen(plan, [1.0])
        except InternalError:
            return None
        return plan

    @staticmethod
    async def _domains(query: AnalyzedQuery, conn: Any) -> list[list[str]]:
        """Each key's public domain (a public table's keys read now, as the analysts could)."""
        domains: list[list[str]] = []
        for key in query.keys:
            d = key.domain
            assert d is not None
            if d.keys is not None:
                domains.append(list(dict.fromkeys(d.keys)))
                continue
            assert d.source is not None
            schema, table, column = (quote_ident(p) for p in d.source)
            rows = await conn.fetch(f"SELECT DISTINCT ({column})::text AS k FROM {schema}.{table} "
                                    f"WHERE {column} IS NOT NULL LIMIT {MAX_PUBLIC_KEYS + 1}")
            domains.append([str(r["k"]) for r in rows])
        return domains

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

    @staticmethod
    async def _input_columns(query: AnalyzedQuery, conn: Any) -> InputColumns:
        """Postgres's reading of each of the query's `name_checks` (`column_probe_sql`, prepared
        on `conn` outside any transaction, never run): None for a GROUP BY key, else its error."""
        found: dict[tuple[str, ...], DPError | None] = {}
        for name in query.name_checks:
            try:
                await conn.prepare(column_probe_sql(query, name))
                found[name] = None
            except asyncpg.PostgresError as e:
                found[name] = planning_error(e)
        return found

    async def _hashed_keys(self, key_oids: list[int], conn: Any) -> list[int]:
        """Which keys (of a query with quantiles, by type) match a group's row with its trees
        by hash rather than text (`Key.hashed`)."""
        if any(o in TEXT_KEY_OIDS for o in key_oids) and await self.has_nondeterministic(conn):
            hashed = HASHED_KEY_OIDS | TEXT_KEY_OIDS  # 'a' = 'A' may be a group
        else:
            hashed = HASHED_KEY_OIDS
        return [i for i, o in enumerate(key_oids) if o in hashed]

    async def has_nondeterministic(self, conn: Any) -> bool:
        """Whether the database has a nondeterministic collation (read once)."""
        if self._nondeterministic is None:
            self._nondeterministic = bool(await conn.fetchval(
                "SELECT EXISTS (SELECT FROM pg_collation WHERE NOT collisdeterministic)"))
        return self._nondeterministic

    async def _type_name(self, oid: int) -> TypeRef:
        if oid not in self._type_names:
            row = await self.pool.fetchrow(
                "SELECT n.nspname, t.typname FROM pg_type t JOIN pg_namespace n "
                "ON n.oid = t.typnamespace WHERE t.oid = $1", oid)
            if row is None:
                raise InvalidParameterValue(f"unknown parameter type oid {oid}")
            self._type_names[oid] = (row[0], row[1])
        return self._type_names[oid]

    async def bind_params(self, bind: p.Bind, param_types: Sequence[int], codec: str,
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


def _combinations(domains: list[list[str]]) -> list[tuple[str, ...]]:
    """Every combination of the keys' public domains: the groups a query of public groups
    releases."""
    total = math.prod(len(d) for d in domains)
    if total > MAX_PUBLIC_KEYS or total == 0:
        raise ProgramLimitExceeded(
            f"the public keys of this GROUP BY make {total} groups (a query of public groups "
            f"releases 1 to {MAX_PUBLIC_KEYS} of them)",
            hint="filter in a subquery, or group by fewer columns with public keys")
    return list(itertools.product(*domains))


def _listed(query: AnalyzedQuery, domains: list[list[str]]) -> AnalyzedQuery:
    """`query` with each key's domain read from a public table listed instead."""
    keys = tuple(k if k.domain is None or k.domain.keys is not None
                 else replace(k, domain=KeyDomain(tuple(d)))
                 for k, d in zip(query.keys, domains, strict=True))
    return replace(query, keys=keys)

