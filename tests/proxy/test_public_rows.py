"""Which columns of a public table or view have one row per value (server.dp_query.public_rows),
read from a real catalog: what a DP query's joins with public tables are bounded by."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import asyncpg
import pytest

from dp_core.errors import ProgramLimitExceeded
from dp_core.query import AnalyzedQuery
from server.dp_query.public_rows import check_public_rows, unique_columns
from tests.support.backend import Backend, scratch_schema
from tests.support.engine import build

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
    f"CREATE VIEW {SCHEMA}.lowered AS SELECT id, lower(code) AS s FROM {SCHEMA}.keyed",
    f"CREATE VIEW {SCHEMA}.ordered AS SELECT id FROM {SCHEMA}.keyed "
    "ORDER BY generate_series(1, 3)",  # (a set-returning function outside the select list)
    f"CREATE TABLE {SCHEMA}.collated (name text COLLATE \"C\", other text)",
    f"CREATE UNIQUE INDEX ON {SCHEMA}.collated (name COLLATE \"POSIX\")",
    f"CREATE UNIQUE INDEX ON {SCHEMA}.collated (other text_pattern_ops)",
    # keys of another type than visits.country (char(2)), and of the same
    f"CREATE TABLE {SCHEMA}.vpub (code varchar PRIMARY KEY)",
    f"INSERT INTO {SCHEMA}.vpub SELECT 'US' || repeat(' ', i) FROM generate_series(0, 10) i",
    f"CREATE TABLE {SCHEMA}.ipub (id int4 PRIMARY KEY, f float8 UNIQUE)",
    f"INSERT INTO {SCHEMA}.ipub SELECT i, i FROM generate_series(1, 11) i",
    f"CREATE TABLE {SCHEMA}.comp (a int4, b text, PRIMARY KEY (a, b))",
    f"INSERT INTO {SCHEMA}.comp SELECT i % 3, 'x' || i FROM generate_series(0, 10) i",
    f"CREATE TABLE {SCHEMA}.large (code char(2))",
    f"INSERT INTO {SCHEMA}.large SELECT 'US' FROM generate_series(1, 10001)",
    f"CREATE TABLE {SCHEMA}.cpub (code char(2) PRIMARY KEY)",
    f"INSERT INTO {SCHEMA}.cpub SELECT chr(65 + i) || 'X' FROM generate_series(0, 10) i",
]


@pytest.fixture(scope="module")
def catalog(backend: Backend) -> Iterator[str]:
    with scratch_schema(backend.admin_dsn, SCHEMA, OBJECTS) as dsn:
        yield dsn


@pytest.mark.parametrize(("name", "expected"), [
    ("keyed", {"id", "code"}),  # (not an expression's or a partial index's column)
    ("parent", set()),  # (its index does not cover its child's rows)
    ("plain", {"k", "code"}),  # (a view of one table's columns, renamed, filtered)
    ("over_plain", {"k"}),
    ("sets", set()),  # (a set-returning function repeats each row)
    ("joined", set()),
    ("unioned", set()),
    ("slept", set()),  # (volatile: not inlined, its rows maybe scanned for each row)
    ("lowered", {"id"}),  # (a function that returns one value per row, inlined)
    ("ordered", set()),
    ("collated", set()),  # (an index under another collation, or operator class)
])
def test_unique_columns(catalog: str, name: str, expected: set[str]) -> None:
    async def read() -> set[str]:
        conn = await asyncpg.connect(catalog)
        try:
            return await unique_columns((SCHEMA, name), conn)
        finally:
            await conn.close()

    assert asyncio.run(read()) == expected


@pytest.mark.parametrize(("joins", "refused"), [
    # varchar = char(2) compares as char(2), blind to trailing spaces: 'US' and 'US  ' are
    # one value there, though the varchar key holds both (11 rows each: 121 per row)
    ("JOIN {s}.vpub a ON a.code = v.country JOIN {s}.vpub b ON b.code = v.country", True),
    ("JOIN {s}.cpub a ON a.code = v.country JOIN {s}.cpub b ON b.code = v.country", False),
    ("JOIN {s}.cpub a ON v.country = a.code JOIN {s}.vpub b ON b.code = 'US'", False),
    # a cross join (11 rows) and a table tied to it on its key (1 each): 11
    ("JOIN {s}.cpub a ON true JOIN {s}.cpub b ON b.code = a.code", False),
    ("JOIN {s}.cpub a ON true JOIN {s}.vpub b ON b.code = a.code", True),  # (121)
    ("JOIN {s}.cpub a ON a.code = v.country JOIN {s}.cpub b ON b.code = a.code", False),
    # integers of other widths compare exactly (visits.uid is int8); a float does not
    ("JOIN {s}.ipub a ON a.id = v.uid JOIN {s}.ipub b ON b.id = v.uid", False),
    ("JOIN {s}.ipub a ON a.f = v.uid JOIN {s}.ipub b ON b.f = v.uid", True),
    # an expression cast to a type without a collation compares under that type's equality
    ("JOIN {s}.ipub a ON a.id = CAST(v.duration AS int8) JOIN {s}.ipub b ON b.id = "
     "v.duration::int4", False),
    ("JOIN {s}.ipub a ON a.f = CAST(v.uid AS float8) JOIN {s}.ipub b ON b.f = v.uid::float8",
     False),
    ("JOIN {s}.ipub a ON a.id = CAST(v.uid AS float8) JOIN {s}.ipub b ON b.id = "
     "v.uid::float8", True),  # (an integer key compared as a float)
    ("JOIN {s}.vpub a ON a.code = CAST(v.country AS varchar) JOIN {s}.vpub b ON b.code = "
     "v.country::varchar", True),  # (a collation: the expression's, not the key's)
    # a composite PRIMARY KEY: tied on all its columns, one row; on some, its rows (11)
    ("JOIN {s}.comp a ON a.a = v.duration AND a.b = v.browser JOIN {s}.comp b "
     "ON b.b = v.browser AND b.a = 2", False),
    ("JOIN {s}.comp a ON a.a = v.duration JOIN {s}.comp b ON b.a = v.duration", True),
    ("JOIN {s}.comp a ON a.a = v.uid::float8 AND a.b = v.browser JOIN {s}.comp b "
     "ON b.b = v.browser AND b.a = v.uid::float8", True),  # (one compared as a float)
    # through a protected subquery of one table's columns (and not of a computed one)
    ("JOIN {s}.cpub a ON a.code = w.country JOIN {s}.cpub b ON b.code = w.country", False),
    ("JOIN {s}.cpub a ON a.code = w.c JOIN {s}.cpub b ON b.code = w.c", True),
    # through a protected WITH query of one table's columns
    ("w JOIN {s}.cpub a ON a.code = w.country JOIN {s}.cpub b ON b.code = w.country", False),
    ("w JOIN {s}.cpub a ON a.code = w.c JOIN {s}.cpub b ON b.code = w.c", True),
    # a public subquery's own WHERE: a unique column equal to a literal, one row (11 else)
    ("CROSS JOIN (SELECT id FROM {s}.ipub WHERE id = 5) a "
     "CROSS JOIN (SELECT f FROM {s}.ipub AS t WHERE 3 = t.id) b", False),
    ("CROSS JOIN (SELECT * FROM {s}.comp WHERE a = 1 AND b = 'x1') a "
     "CROSS JOIN (SELECT f FROM {s}.ipub WHERE f = 2 AND id > 0) b", False),
    ("CROSS JOIN (SELECT id FROM {s}.ipub WHERE id > 5) a "
     "CROSS JOIN (SELECT f FROM {s}.ipub WHERE id = 5 OR id = 6) b", True),
    ("CROSS JOIN (SELECT a FROM {s}.comp WHERE a = 1) a "
     "CROSS JOIN (SELECT id FROM {s}.ipub WHERE id > 5) b", True),  # (part of its key)
    ("CROSS JOIN (SELECT id FROM {s}.ipub WHERE f = 2.0) a "
     "CROSS JOIN (SELECT id FROM {s}.ipub AS t WHERE u.id = 5) b", True),  # (not a plain
    # literal; another item's column)
])
def test_a_unique_key_counts_under_its_own_types_equality(catalog: str, joins: str,
                                                          refused: bool) -> None:
    inner = "SELECT uid, country, lower(country) AS c FROM visits WHERE duration > 60"
    outer = "w" if joins.startswith("w ") else f"({inner}) w" if "w." in joins else "visits v"
    query, _, _ = build(f"WITH w AS ({inner}) SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM "
                        f"{outer} " + joins.removeprefix("w ").format(s=SCHEMA))

    _check(query, catalog, refused)


@pytest.mark.parametrize(("where", "refused"), [
    ("v.country IN (SELECT code FROM {s}.cpub)", False),
    ("v.country IN (SELECT code FROM {s}.large WHERE code = 'FR')", True),
    ("EXISTS (SELECT 1 FROM {s}.large WHERE code = 'FR')", True),
    ("v.country IN (VALUES ('US'), ('FR'))", False),
    # through a WITH query: what it reads, its own WHERE aside
    ("v.country IN (SELECT code FROM w)", True),
])
def test_in_and_exists_subqueries_read_few_rows(catalog: str, where: str, refused: bool) -> None:
    """An IN or EXISTS subquery runs once, and only where a row reaches it: what it reads (its
    table's rows, its WHERE aside) is at most SUBLINK_READ_ROWS (10,000), else 54000."""
    query, _, _ = build(f"WITH w AS (SELECT code FROM {SCHEMA}.large WHERE code = 'FR') "
                        "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits v WHERE "
                        + where.format(s=SCHEMA))

    _check(query, catalog, refused, "IN or EXISTS")


def _check(query: AnalyzedQuery, catalog: str, refused: bool, match: str | None = None) -> None:
    """`check_public_rows` on the catalog: 54000 where `refused`, else nothing."""
    async def check() -> None:
        conn = await asyncpg.connect(catalog)
        try:
            await check_public_rows(query, conn)
        finally:
            await conn.close()

    if refused:
        with pytest.raises(ProgramLimitExceeded, match=match):
            asyncio.run(check())
    else:
        asyncio.run(check())

