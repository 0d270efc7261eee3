"""What a DP query's text means in the asking session: its tables' schemas, and now() when planned.

The pushdown runs on a connection of the pushdown role, whose search_path and TimeZone are
not the session's. Before the analysis, the proxy asks Postgres (the catalog: no row is read)
which schema each unqualified relation name means in the session's search_path
(`DPRequest.search_path`, asked of the session's own backend), so that the pushdown names the
same tables; and evaluates the query's relative dates once (`dp_core.clock`) in the session's
TimeZone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pglast import ast

from dp_core.clock import ClockValue, clock_expressions, clock_sql
from dp_core.sqlnodes import walk_nodes

_RESOLVE_SQL = """
SELECT r.name, (SELECT s.nsp FROM pg_catalog.unnest($1::pg_catalog.text[]) WITH ORDINALITY
                AS s (nsp, i)
                JOIN pg_catalog.pg_namespace n ON n.nspname = s.nsp
                JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = r.name
                ORDER BY s.i LIMIT 1) AS schema
FROM pg_catalog.unnest($2::pg_catalog.text[]) AS r (name)"""
"""Each name's schema: the first of the search_path's schemas with a relation of that name,
as Postgres looks a relation name up (any kind of relation; NULL: none)."""


def unqualified_names(stmt: ast.Node) -> list[str]:
    """The relation names `stmt` writes without a schema (WITH queries' names among them)."""
    return sorted({str(n.relname) for n in walk_nodes(stmt)
                   if isinstance(n, ast.RangeVar) and not n.schemaname and not n.catalogname})


async def relation_schemas(conn: Any, stmt: ast.Node,
                           search_path: Sequence[str]) -> dict[str, str | None]:
    """The schema each unqualified relation name of `stmt` means in `search_path` (None: no
    relation of that name there, which Postgres reports as 42P01)."""
    names = unqualified_names(stmt)
    if not names:
        return {}
    rows = await conn.fetch(_RESOLVE_SQL, list(search_path), names)
    return {str(r["name"]): None if r["schema"] is None else str(r["schema"]) for r in rows}


async def fixed_clock(conn: Any, stmt: ast.Node, timezone: str | None,
                      granularity: int = 0) -> tuple[list[ClockValue], str | None]:
    """The relative dates of `stmt` (`dp_core.clock`), each evaluated once now, in the
    session's `timezone`, with the clock read at the start of its quantum of `granularity`
    seconds (0: exactly): its value and type, in the order `fix_clock` takes them; and the
    time they were read at (None with none, or granularity 0). Raises asyncpg's error when one
    fails (a malformed interval, say): by the text alone."""
    exprs = clock_expressions(stmt)
    if not exprs:
        return [], None
    # (prepared statements on `conn` leave an implicit transaction open without a Sync)
    await conn.execute("SELECT")
    async with conn.transaction(readonly=True):
        await conn.execute(
            "SELECT pg_catalog.set_config('DateStyle', 'ISO, YMD', true), "
            "pg_catalog.set_config('IntervalStyle', 'postgres', true), "
            "pg_catalog.set_config('extra_float_digits', '1', true)")
        if timezone is not None:
            await conn.execute("SELECT pg_catalog.set_config('TimeZone', $1, true)", timezone)
        row = await conn.fetchrow(clock_sql(exprs, granularity))
        oids = [int(row[f"t{i}"]) for i in range(len(exprs))]
        types = {int(r["oid"]): (str(r["nspname"]), str(r["typname"])) for r in await conn.fetch(
            "SELECT t.oid, n.nspname, t.typname FROM pg_catalog.pg_type t JOIN "
            "pg_catalog.pg_namespace n ON n.oid = t.typnamespace WHERE t.oid = ANY($1::oid[])",
            oids)}
    return ([(None if row[f"v{i}"] is None else str(row[f"v{i}"]), *types[oid])
             for i, oid in enumerate(oids)], str(row["now"]) if granularity else None)
