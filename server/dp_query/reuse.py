"""Answers given again: a DP question asked before, its tables' data unchanged, gets the answer released.

Re-sending an answer already released reveals nothing new (post-processing), so it costs no
budget. "The same question" is the normalised statement (its parse tree, without positions),
its DP clause, its bound parameters and everything that changes the answer's distribution (the
plan: ε, δ, C_u, bounds, noise, selection, T), hashed (`question_key`). Answers are kept in the
ledger schema (`answers`), so they outlive a restart and several proxies share them; whose
answers an analyst may reuse is `defaults.answer_reuse` ("analyst": its own; "all": anyone's).

An answer is reused only while the data of every table it read is unchanged. `init-backend`
puts a statement trigger (enabled ALWAYS) on each protected and public table that appends a
row of weight 1 to the ledger's `data_changes` (in the writer's transaction: visible when it
commits); a table's version is its oid, its file, the xmin of its and its trigger's catalog
rows, and the sum of its rows' weights, read by the ledger role from the catalog and that log
(no protected row is read). The versions are read before the answer's pushdown runs, so a
write that commits after that, before or after the pushdown's snapshot, changes the version
the next asker reads: a stale answer is never reused (an answer whose data changed in
between is only not reused). Compaction replaces a table's rows by one of their summed weight
in one statement, which keeps every version. Answers also expire after
`defaults.answer_reuse_hours`. A table without the trigger enabled ALWAYS (init-backend not
run since), a partitioned table or one with inheritance children, a table a subscription
writes, or a relation that is not a configured table (a table of a public schema, a view) is
not watched: answers that read one are not reused.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from pglast import parser

from config import Config
from dp_core.classify import Statement
from dp_core.plan import DPQueryPlan
from dp_core.query import AnalyzedQuery
from server import wire as p
from server.backend_setup import DATA_CHANGE_TRIGGER, quote_ident

_COMPACT_FROM = 256
"""A table's rows in the log from which reading its version compacts them."""

EVERYONE = "*"
"""The `answers.analyst` of an answer any analyst may reuse (`answer_reuse = "all"`)."""

Versions = dict[str, str]
"""The data version of each table an answer read ("schema.table")."""


@dataclass(frozen=True)
class Reused:
    """An answer released before: its result query, its notice's detail, when it was released."""

    result: str
    detail: str | None
    released_at: datetime.datetime


def question_key(st: Statement, bind: p.Bind | None, param_types: Sequence[int],
                 plan: DPQueryPlan, session: Sequence[Any] = (), meaning: Any = None) -> str:
    """What makes two DP questions the same: the statement's parse tree without positions
    (spacing, comments and keyword case aside), its DP clause's options, its bound
    parameters, the plan's every parameter of the answer's distribution, what the text
    means in the asking `session` (its TimeZone, which dates and date_trunc read; its
    search_path; its client encoding, which the parameters' bytes are in), and `meaning`:
    what the preparer found the query to mean (the policies of the tables it reads, their
    configured bounds and uid columns; the argument and key types; the public keys)."""
    tree = _without_locations(json.loads(parser.parse_sql_json(st.stripped_sql)))
    parts = {
        "tree": tree,
        "clause": None if st.dp_clause is None else [[k, str(v)] for k, v in st.dp_clause.options],
        "kind": st.kind.value,
        "session": list(session),
        "meaning": repr(meaning),
        # (a statement without parameters is the same question by simple Query or prepared)
        "params": None if bind is None or not bind.params else [
            list(bind.param_formats), [None if v is None else v.hex() for v in bind.params],
            list(param_types)],
        "plan": [str(plan.epsilon), str(plan.delta), plan.max_groups_contributed,
                 plan.noise_kind.value, plan.selection_asked.value, plan.max_rows,
                 plan.mechanisms()],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _without_locations(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_locations(v) for k, v in node.items()
                if k not in ("location", "stmt_location", "stmt_len")}
    if isinstance(node, list):
        return [_without_locations(v) for v in node]
    return node


def tables_read(query: AnalyzedQuery, config: Config) -> list[str] | None:
    """Every table `query` reads, "schema.table" (and those its public keys come from); None
    where one is not a configured table (a table of a public schema, an unqualified name of
    no configured public table): its changes are not watched."""
    read = set().union(*(t.bases for t in query.tables))
    for base in list(read):
        base_schema, _, base_name = base.partition(".")
        table = config.tables.get(base_name)
        if table is None or table.schema_ != base_schema:
            continue
        for column in table.columns.values():
            source = column.keys_source()
            if source is not None:
                read.add(f"{source[0]}.{source[1]}")
    public = config.public.qualified()
    for schema, name in query.relations:
        if schema is not None and (schema, name) in public:
            read.add(f"{schema}.{name}")
            continue
        named: list[tuple[str, str]] = \
            [(s, n) for s, n in public if n == name] if schema is None else []
        if len(named) != 1:
            return None
        read.add(f"{named[0][0]}.{named[0][1]}")
    return sorted(read)


class AnswerStore:
    """The released answers in the ledger schema, and the data versions they depend on (read
    and written as the ledger role)."""

    def __init__(self, pool: Any, schema: str) -> None:
        self.pool = pool
        self.s = quote_ident(schema)

    async def versions(self, tables: Iterable[str]) -> Versions | None:
        """Each table's data version; None unless every one is watched: a plain table (no
        partitions, no inheritance children, no logical replication subscription, whose apply
        fires no statement trigger) with its trigger enabled ALWAYS (it fires in replica mode
        too), and the log exists. The version is the table's oid, its file (a rewrite, a
        TRUNCATE), the xmin of its catalog row (any ALTER TABLE) and of its trigger's (a
        disable and enable in between), and the sum of its log's weights."""
        tables = sorted(set(tables))
        if not tables:
            return None
        try:
            rows = await self.pool.fetch(
                "SELECT r.rel, c.oid IS NOT NULL AND c.relkind = 'r' AND t.tgenabled = 'A' "
                "AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_inherits i "
                "WHERE i.inhparent = c.oid OR i.inhrelid = c.oid) "
                "AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_subscription_rel sr "
                "WHERE sr.srrelid = c.oid) AS watched, "
                "concat_ws(':', c.oid, c.relfilenode, c.xmin, t.xmin, "
                f"(SELECT coalesce(sum(d.n), 0) FROM {self.s}.data_changes d "
                "WHERE d.relation = r.rel)) AS version, "
                f"(SELECT count(*) FROM {self.s}.data_changes d WHERE d.relation = r.rel) AS logged "
                "FROM unnest($1::text[]) AS r(rel) "
                "LEFT JOIN pg_catalog.pg_namespace n ON n.nspname = split_part(r.rel, '.', 1) "
                "LEFT JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid "
                "AND c.relname = split_part(r.rel, '.', 2) "
                "LEFT JOIN pg_catalog.pg_trigger t ON t.tgrelid = c.oid AND t.tgname = $2",
                tables, DATA_CHANGE_TRIGGER)
        except Exception as e:  # (no log yet: init-backend not run since the upgrade)
            if getattr(e, "sqlstate", None) == "42P01":
                return None
            raise
        if not all(r["watched"] for r in rows):
            return None
        for r in rows:
            if int(r["logged"]) > _COMPACT_FROM:
                await self._compact(self.pool, str(r["rel"]))
        return {r["rel"]: str(r["version"]) for r in rows}

    async def find(self, key: str, who: Sequence[str], versions: Versions) -> Reused | None:
        """The answer to question `key` released to one of `who` over data at `versions`, if
        it has not expired (the latest, where several have)."""
        row = await self.pool.fetchrow(
            f"SELECT result, detail, released_at FROM {self.s}.answers WHERE key = $1 "
            "AND analyst = ANY($2::text[]) AND versions = $3::jsonb "
            "AND expires_at > clock_timestamp() ORDER BY released_at DESC LIMIT 1",
            key, list(who), json.dumps(versions, sort_keys=True))
        return None if row is None else Reused(row["result"], row["detail"], row["released_at"])

    async def store(self, key: str, who: str, versions: Versions, result: str,
                    detail: str | None, ledger_id: int, hours: float) -> None:
        """Keep a released answer (replacing an older one to the same question), and compact
        the data log of the tables it read."""
        async with self.pool.acquire() as conn:
            await conn.execute(
                f"INSERT INTO {self.s}.answers AS a (key, analyst, expires_at, versions, result, "
                "detail, ledger_id) VALUES ($1, $2, clock_timestamp() + make_interval(secs => $3), "
                "$4::jsonb, $5, $6, $7) ON CONFLICT (key, analyst) DO UPDATE SET "
                "released_at = clock_timestamp(), expires_at = EXCLUDED.expires_at, "
                "versions = EXCLUDED.versions, result = EXCLUDED.result, "
                "detail = EXCLUDED.detail, ledger_id = EXCLUDED.ledger_id",
                key, who, hours * 3600.0, json.dumps(versions, sort_keys=True), result, detail,
                ledger_id)
            await conn.execute(f"DELETE FROM {self.s}.answers WHERE expires_at < clock_timestamp()")
            for table in versions:
                await self._compact(conn, table)

    async def _compact(self, conn: Any, table: str) -> None:
        """Replace `table`'s rows in the log by one of their summed weight. One statement: the
        rows it deletes are the ones it sums (a concurrent compaction's are not counted twice),
        so every version is kept."""
        await conn.execute(
            f"WITH gone AS (DELETE FROM {self.s}.data_changes WHERE relation = $1 "
            f"AND (SELECT count(*) FROM {self.s}.data_changes WHERE relation = $1) > 1 "
            f"RETURNING n) INSERT INTO {self.s}.data_changes (relation, n) "
            "SELECT $1, sum(n) FROM gone HAVING count(*) > 0", table)
