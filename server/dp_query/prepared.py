"""A DP query prepared for its answer: analysis, plan, pushdown, and how it may split by uid."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dp_core.bounding import Prefilter
from dp_core.plan import DPQueryPlan
from dp_core.query import AnalyzedQuery
from dp_core.release import FLOAT8, output_type
from dp_core.result import TypeRef, result_sql
from dp_core.rewrite import Pushdown, RangedPushdown
from dp_core.table_tuning import Applied

PG = "pg_catalog"


@dataclass(frozen=True)
class UidColumn:
    """The uid column of a protected table that a DP query's pushdown may be split over.

    A pushdown may run as several, each over one range of the uid. Each range's statements
    read only its users, and every column but the keys is a sum over users, so the rows of
    all ranges add up to the unsplit rows (users are never in two ranges). Postgres finishes
    one per-user aggregation per connection instead of gathering every (user, group) row
    into one process.
    """

    table: str
    uid_column: str
    rows: int
    """The table's rows, by the catalog's estimate."""
    histogram: tuple[str, ...]
    """Percentiles 0, 1, ..., 100 of the uid column in a sample of the table, as text
    (ascending in the column's order). `pg_stats` would have them, but Postgres hides it for
    tables with row-level security, as protected tables are."""
    uid_type: str = ""
    """The uid column's type (pg_type name)."""
    uid_not_null: bool = False
    """The uid column is declared NOT NULL."""


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
    split: UidColumn | None = None
    """Set after the charge, when the pushdown runs split (`UidSplitter.split`); for EXPLAIN,
    the table it may be split over, without a histogram."""
    ranged: RangedPushdown | None = None
    """The pushdown for any uid range, when `split`."""
    split_ranges: int = 1
    """How many uid ranges `split` gives at most (by the configured number of pushdowns)."""
    prefilter: Prefilter | None = None
    """Whether (and with which types) `ranged` picks users' groups from their rows before
    aggregating them (`UidSplitter`)."""
    cache_key: Any = None
    """What the pushdown's statements depend on but the order seed (`PushdownCache`)."""
    meaning: Any = None
    """What the text means in the session beside its parameters (settings, types, the
    schemas its names find, its relative dates as read): part of the question's key."""
    fanout: float = 1.0
    """The most public rows one protected row is joined with (`public_rows.check_public_rows`)."""
    public_keys: list[tuple[str, ...]] | None = None
    """Of a query of public groups, the key texts of every group it releases."""
    timezone: str | None = None
    """The asking session's TimeZone: the pushdown's too, so that it reads dates as the
    session does (`date_trunc('day', t)`, `t::date` of a timestamptz)."""
    tuned: Applied | None = None
    """The tuned bounds of the table it reads (`dp_core.table_tuning`), where it uses them."""
    clock_now: str | None = None
    """The time the query's relative dates were read at: the start of the clock's quantum
    (`defaults.clock_granularity_minutes`; None: no relative dates, or the exact time)."""

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
            elif c.bound is not None:  # an end of a noise interval
                out.append((PG, FLOAT8))
            else:
                assert c.aggregate is not None
                out.append((PG, output_type(self.query.aggregates[c.aggregate])))
        return out


def answer_sql(prepared: Prepared, rows: Sequence[Sequence[Any]]) -> str:
    """The result query: `rows` released for `prepared`, with its post-processing around them."""
    q = prepared.query
    visible = [(item.name, item.column if item.column is not None else item.expr)
               for item in q.select]
    return result_sql(prepared.names, prepared.types(), rows,
                      sources=[o.source for o in q.outputs], having=q.having,
                      order_by=q.order_by, limit=q.limit, offset=q.offset, visible=visible,
                      outer=q.outer)
