"""Which columns of a public table or view have one row per value (server.dp_query.public_rows),
read from a real catalog: what a DP query's joins with public tables are bounded by."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import psycopg
import pytest

from server.dp_query.public_rows import unique_columns
from tests.support.backend import Backend

SCHEMA = "test_public_rows"
OBJECTS = [
    f"CREATE SCHEMA {SCHEMA}",
    f"CREATE TABLE {SCHEMA}.keyed (id int PRIMARY KEY, code text UNIQUE, region text, "
    "lower_name text)",
    f"CREATE UNIQUE INDEX ON {SCHEMA}.keyed (lower(lower_name))",  # (an expression)
    f"CREATE UNIQUE INDEX ON {SCHEMA}.keyed (region) WHERE id > 10",  # (a predicate)
    f"CREATE TABLE {SCHEMA}.parent (id int PRIMARY KEY)",
    f"CREATE TABLE {SCHEMA}.child () INHERITS ({SCHEMA}.parent)",  # (parent's index: not its)
    f"CREATE VIEW {SCHEMA}.plain AS SELECT id AS k, code, region FROM {SCHEMA}.keyed "
    "WHERE region <> 'x'",
    f"CREATE VIEW {SCHEMA}.over_plain AS SELECT k FROM {SCHEMA}.plain",
    f"CREATE VIEW {SCHEMA}.sets AS SELECT id, generate_series(1, 3) AS n FROM {SCHEMA}.keyed",
    f"CREATE VIEW {SCHEMA}.joined AS SELECT a.id FROM {SCHEMA}.keyed a, {SCHEMA}.keyed b",
    f"CREATE VIEW {SCHEMA}.unioned AS SELECT id FROM {SCHEMA}.keyed UNION ALL "
    f"SELECT id FROM {SCHEMA}.keyed",
    f"CREATE VIEW {SCHEMA}.slept AS SELECT id, pg_sleep(0)::text AS s FROM {SCHEMA}.keyed",
]


@pytest.fixture(scope="module")
def catalog(backend: Backend) -> Iterator[str]:
    with psycopg.connect(backend.admin_dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        for stmt in OBJECTS:
            conn.execute(stmt)
        try:
            yield backend.admin_dsn
        finally:
            conn.execute(f"DROP SCHEMA {SCHEMA} CASCADE")


@pytest.mark.parametrize(("name", "expected"), [
    ("keyed", {"id", "code"}),  # (not an expression's or a partial index's column)
    ("parent", set()),  # (its index does not cover its child's rows)
    ("plain", {"k", "code"}),  # (a view of one table's columns, renamed, filtered)
    ("over_plain", {"k"}),
    ("sets", set()),  # (a set-returning function repeats each row)
    ("joined", set()),
    ("unioned", set()),
    ("slept", {"id"}),  # (a function that returns one value per row)
])
def test_unique_columns(catalog: str, name: str, expected: set[str]) -> None:
    async def read() -> set[str]:
        conn = await asyncpg.connect(catalog)
        try:
            return await unique_columns((SCHEMA, name), conn)
        finally:
            await conn.close()

    assert asyncio.run(read()) == expected
