"""The public tables' unique columns and sizes a DP query's joins are bounded by (dp_core.fanout)."""

from __future__ import annotations

from typing import Any

from dp_core.fanout import PUBLIC_ROWS_PER_ROW, check_row_bound
from dp_core.query import AnalyzedQuery, Relation
from server.backend_setup import quote_ident

_UNIQUE_COLUMNS = (
    "SELECT a.attname FROM pg_catalog.pg_index i JOIN pg_catalog.pg_attribute a "
    "ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] "
    "JOIN pg_catalog.pg_class c ON c.oid = i.indrelid "
    "WHERE i.indrelid = pg_catalog.to_regclass($1) AND i.indisunique AND i.indisvalid "
    "AND i.indnkeyatts = 1 AND i.indpred IS NULL AND i.indexprs IS NULL "
    "AND (c.relkind = 'p' OR NOT c.relhassubclass)")
"""The columns of a table that a valid unique index (a PRIMARY KEY, UNIQUE) covers alone,
with no predicate and no expression: one row per value (not of a table with inheritance
children, whose rows its index does not cover; a partitioned table's unique index covers its
partitions)."""


async def check_public_rows(query: AnalyzedQuery, conn: Any) -> None:
    """54000 (before any charge) where the query's joins may give one protected row more than
    PUBLIC_ROWS_PER_ROW public rows (`dp_core.fanout`): each public table's unique columns
    from the catalog and its rows counted up to the limit (public data the analysts may read;
    nothing of a protected table is read)."""
    tables = {item.source.relation for item in query.public_items
              if item.source.relation is not None}
    unique: dict[Relation, set[str]] = {}
    rows: dict[Relation, int] = {}
    for relation in tables:
        schema, name = relation
        qualified = quote_ident(name) if schema is None \
            else f"{quote_ident(schema)}.{quote_ident(name)}"
        if await conn.fetchval("SELECT pg_catalog.to_regclass($1) IS NULL", qualified):
            unique[relation], rows[relation] = set(), 0  # (Postgres says 42P01 when prepared)
            continue
        unique[relation] = {str(r[0]) for r in await conn.fetch(_UNIQUE_COLUMNS, qualified)}
        rows[relation] = int(await conn.fetchval(
            f"SELECT count(*) FROM (SELECT FROM {qualified} LIMIT {PUBLIC_ROWS_PER_ROW + 1}) s"))
    check_row_bound(query.public_items, lambda r, c: c in unique[r], rows.__getitem__)
