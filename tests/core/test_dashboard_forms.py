"""The SQL forms of dashboards (issue 31), without a database: which statements are DP queries
and which query around one is post-processing, where its released rows go, LOCK TABLE, the
names a session's search_path gives, and relative dates found for folding.
(tests/proxy/test_dashboards.py checks each against Postgres.)"""

from __future__ import annotations

import pytest
from pglast import parse_sql
from pglast.stream import RawStream

from dp_core.analysis import analyze, parse_select
from dp_core.classify import Classifier, ProtectionPolicy, StatementKind
from dp_core.clock import clock_expressions, clock_sql, fix_clock
from dp_core.errors import FeatureNotSupported, UndefinedTable
from dp_core.result import result_sql
from tests.support.engine import POLICY, build

CLASSIFIER = Classifier(ProtectionPolicy({"visits": "public", "purchases": "public",
                                          "rides": "ops"}))
DP = "SELECT browser, country, COUNT(*) AS n FROM visits GROUP BY browser, country"


@pytest.mark.parametrize(("sql", "kind"), [
    (f"WITH t AS ({DP}) SELECT * FROM t ORDER BY n DESC", StatementKind.DP_QUERY),
    (f"SELECT browser, sum(n) FROM ({DP}) AS v GROUP BY browser", StatementKind.DP_QUERY),
    (f"EXPLAIN WITH t AS ({DP}) SELECT * FROM t", StatementKind.DP_EXPLAIN),
    ("WITH t AS (SELECT * FROM visits) SELECT * FROM t", StatementKind.REFUSED),
    ("LOCK TABLE visits, countries IN ACCESS SHARE MODE", StatementKind.PASS_THROUGH),
    ("LOCK TABLE public.visits IN ACCESS SHARE MODE NOWAIT", StatementKind.PASS_THROUGH),
    ("LOCK TABLE visits IN ROW SHARE MODE", StatementKind.REFUSED),
    ("LOCK visits", StatementKind.REFUSED),
    ("LOCK TABLE countries IN EXCLUSIVE MODE", StatementKind.PASS_THROUGH),  # (Postgres decides)
])
def test_classification(sql: str, kind: StatementKind) -> None:
    (st,) = CLASSIFIER.classify(sql)
    assert st.kind is kind, st.refusal


def test_a_dp_clause_offset_is_its_statements_own() -> None:
    sql = "SELECT 1;  \n SELECT sum(n) FROM (SELECT WITH ANONYMIZATION ANON_COUNT(*) AS n FROM visits) t"
    _, st = CLASSIFIER.classify(sql)
    assert st.dp_clause is not None
    assert st.stripped_sql.encode()[st.dp_clause.select_offset:].startswith(b"SELECT ")
    assert st.dp_clause.select_offset == st.stripped_sql.index("(SELECT") + 1


def _outer_sql(sql: str) -> str:
    query, _, _ = build(sql)
    assert query.outer is not None
    names = [o.name for o in query.outputs]
    return result_sql(names, [("pg_catalog", "text")] * len(names), [("x",) * len(names)],
                      outer=query.outer)


def test_aggregates_over_a_dp_subquery_run_over_its_rows() -> None:
    query, _, pushdown = build(f"SELECT browser, sum(n) FROM ({DP}) AS virtual_table "
                               "GROUP BY browser HAVING count(*) > 1 ORDER BY 2 DESC LIMIT 3")
    assert [o.name for o in query.outputs] == ["browser", "country", "n"]
    assert "sum(n)" not in pushdown
    (stmt,) = parse_sql(_outer_sql(f"SELECT browser, sum(n) FROM ({DP}) AS virtual_table "
                                   "GROUP BY browser"))
    outer = stmt.stmt
    assert outer.fromClause[0].alias.aliasname == "virtual_table" and outer.groupClause
    assert "VALUES" in RawStream()(outer.fromClause[0].subquery)


def test_a_with_query_becomes_the_subquery_with_the_with_queries_it_reads() -> None:
    query, _, pushdown = build("WITH long AS (SELECT uid, browser FROM visits WHERE duration > 60),"
                               " t (b, n) AS (SELECT browser, count(*) FROM long GROUP BY browser),"
                               " other AS (SELECT 1) SELECT b FROM t ORDER BY n")
    assert query.outer is not None and [o.name for o in query.outputs] == ["browser", "count"]
    assert "duration > 60" in pushdown
    sql = _outer_sql("WITH t (b, n) AS (SELECT browser, count(*) FROM visits GROUP BY browser) "
                     "SELECT b FROM t AS x ORDER BY n")
    assert "WITH" not in sql and ") AS x (b, n) ORDER BY n" in sql


def test_queries_around_queries_around_the_dp_query() -> None:
    sql = _outer_sql(f"SELECT count(*) FROM (SELECT browser, sum(n) AS s FROM ({DP}) AS v "
                     "GROUP BY browser LIMIT 10) AS rowcount_qry")
    assert sql.startswith("SELECT count(*) FROM (SELECT browser, sum(n) AS s FROM (SELECT ")
    assert sql.count("VALUES") == 1 and sql.endswith("AS v GROUP BY browser LIMIT 10) AS rowcount_qry")


@pytest.mark.parametrize("sql", [
    # grouped by the uid: per-user rows, the query around is the DP query
    "SELECT sum(n) FROM (SELECT uid, count(*) AS n FROM visits GROUP BY uid) s",
    "WITH s AS (SELECT uid, count(*) AS n FROM visits GROUP BY uid) SELECT avg(n) FROM s",
    # a projection of rows
    "SELECT t.browser, count(*) FROM (SELECT browser FROM visits) t GROUP BY t.browser",
    # the paper's clause on the query around
    "SELECT WITH ANONYMIZATION s.n, ANON_COUNT(*) FROM (SELECT uid, count(*) AS n FROM visits "
    "GROUP BY uid) s GROUP BY s.n",
])
def test_the_query_around_is_the_dp_query(sql: str) -> None:
    query, _, _ = build(sql)
    assert query.outer is None


def test_the_paper_clause_marks_the_dp_query() -> None:
    query, _, _ = build("SELECT sum(users) FROM (SELECT WITH ANONYMIZATION country, "
                        "ANON_COUNT(*) AS users FROM visits GROUP BY country) t")
    assert query.outer is not None
    with pytest.raises(FeatureNotSupported, match="must group by the uid"):
        build("SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM (SELECT browser, count(*) "
              "FROM visits GROUP BY browser) s")


def _analyze(sql: str, schemas: dict[str, str | None]) -> object:
    return analyze(parse_select(sql), POLICY, plain_form=True, schemas=schemas)


def test_names_take_the_schema_the_session_finds() -> None:
    query = _analyze("SELECT c.region, count(*) FROM visits v JOIN countries c ON c.code = "
                     "v.country GROUP BY 1", {"visits": "public", "countries": "geo"})
    assert query.relations == (("geo", "countries"),)  # type: ignore[attr-defined]
    with pytest.raises(UndefinedTable, match='relation "countries" does not exist'):
        _analyze("SELECT count(*) FROM visits v JOIN countries c ON c.code = v.country",
                 {"visits": "public", "countries": None})
    with pytest.raises(UndefinedTable, match='relation "visits" does not exist'):
        _analyze("SELECT count(*) FROM visits", {"visits": None})
    with pytest.raises(FeatureNotSupported, match=r"means pg_temp_3\.visits"):
        _analyze("SELECT count(*) FROM visits", {"visits": "pg_temp_3"})
    with pytest.raises(FeatureNotSupported, match="system catalogs"):
        _analyze("SELECT count(*) FROM visits v JOIN tables t ON t.table_name = v.browser",
                 {"visits": "public", "tables": "information_schema"})


def test_relative_dates_are_found_and_replaced() -> None:
    sql = ("SELECT count(*) FROM visits WHERE d > now() - interval '30 days' AND "
           "d::date >= current_date - 7 AND e < date_trunc('month', now()) - "
           "make_interval(months => 1) AND f > clock_timestamp() AND g = current_user")
    found = clock_expressions(parse_select(sql))
    assert len(found) == 3
    assert "pg_catalog.now()" in clock_sql(found) and "clock_timestamp" not in clock_sql(found)
    stmt = parse_select(sql)
    fix_clock(stmt, [("2026-01-31 00:00:00+00", "pg_catalog", "timestamptz"),
                     ("2026-01-24", "pg_catalog", "date"),
                     ("2025-12-01 00:00:00+00", "pg_catalog", "timestamptz")])
    text = RawStream()(stmt)
    assert "now()" not in text and "current_date" not in text.lower()
    assert "CAST('2026-01-24' AS pg_catalog.date)" in text
    assert "clock_timestamp()" in text and "CURRENT_USER" in text
