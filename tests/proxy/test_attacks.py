"""The attack catalogue: hostile statements, each with the answer it must get, the proxy healthy after.

Every case runs on its own psycopg connection as an analyst. `None` as the
expected SQLSTATE means the statement must succeed without revealing rows of a
protected table (the second wall, row-level security, returns nothing to the
restricted role). After each case the same connection, when still open, and a
new one must answer a pass-through query and a DP query.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import psycopg
import psycopg.types.string
import pytest

from config import Config
from server import wire as p
from tests.support.backend import TEST_DATABASE, Backend
from tests.support.paths import ROOT
from tests.support.proxy import LoopThread, Proxy, budgets_reset, running_proxy, spent
from tests.support.rawclient import RawClient, errors

DP = "SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.01, delta=1e-9) "
DP_COUNT = DP + "ANON_COUNT(*) FROM visits"


@dataclass(frozen=True)
class Case:
    name: str
    sql: str | tuple[str, ...]
    """One statement, or several run in order on the connection (the last one is judged)."""
    sqlstate: str | None
    no_rows: bool = False
    """Success must return no row (what RLS shows the restricted role of a protected table)."""


CASES = [
    # --- raw reads in every disguise
    Case("plain", "SELECT * FROM visits", "42501"),
    Case("schema-qualified", "SELECT * FROM public.visits", "42501"),
    Case("quoted", 'SELECT * FROM "visits"', "42501"),
    Case("unicode-escaped name", 'SELECT * FROM U&"\\0076isits"', "42501"),
    Case("upper case", "SELECT * FROM PUBLIC.VISITS", "42501"),
    Case("alias", "SELECT v.uid, v.duration FROM visits AS v", "42501"),
    Case("TABLE", "TABLE visits", "42501"),
    Case("ONLY", "SELECT * FROM ONLY visits", "42501"),
    Case("CTE", "WITH x AS (SELECT * FROM visits) SELECT * FROM x", "42501"),
    Case("subquery in FROM", "SELECT * FROM (SELECT uid, duration FROM visits) s", "42501"),
    Case("subquery in WHERE",
         "SELECT name FROM countries WHERE EXISTS (SELECT 1 FROM visits WHERE uid = 1)", "42501"),
    Case("subquery in SELECT", "SELECT (SELECT max(duration) FROM visits)", "42501"),
    Case("LATERAL", "SELECT * FROM countries c, LATERAL (SELECT duration FROM visits v "
         "WHERE v.country = c.code LIMIT 1) x", "42501"),
    Case("UNION", "SELECT name FROM countries UNION ALL SELECT browser FROM visits", "42501"),
    Case("row-returning function over it", "SELECT * FROM generate_series(1, 1) g, visits", "42501"),
    Case("FOR UPDATE", "SELECT * FROM visits FOR UPDATE", "42501"),
    Case("plain aggregate not in a DP form", "SELECT string_agg(browser, ',') FROM visits", "42501"),
    Case("query text run by the server", "SELECT query_to_xml('SELECT * FROM visits', true, "
         "false, '') AS x", "42501"),
    Case("query text run by the server, public table", "SELECT query_to_xml('SELECT "
         "pg_relation_size(''visits'')', true, false, '') AS x", "42501"),
    Case("query text of a text search statistic", "SELECT * FROM ts_stat('SELECT "
         "to_tsvector(browser) FROM visits')", "42501"),
    Case("DP form selecting a raw column", DP + "duration FROM visits", "0A000"),
    # each group would be one user's: refused before anything is spent
    Case("DP form grouped by uid (singling out)",
         DP + "uid, ANON_COUNT(*) FROM visits GROUP BY uid", "0A000"),
    Case("DP form with a raw subquery", DP + "ANON_COUNT(*) FROM visits WHERE duration > "
         "(SELECT max(duration) FROM visits)", "0A000"),
    # --- statistics leaks
    Case("pg_stats", "SELECT * FROM pg_stats WHERE tablename IN ('visits', 'purchases')", None,
         no_rows=True),
    Case("pg_statistic", "SELECT * FROM pg_statistic", "42501"),
    Case("EXPLAIN of a raw read", "EXPLAIN SELECT * FROM visits", "42501"),
    Case("EXPLAIN ANALYZE of a DP query", "EXPLAIN ANALYZE " + DP_COUNT, "42501"),
    # --- writes, DDL, COPY, cursors, PREPARE, DO, CALL
    Case("INSERT", "INSERT INTO visits (uid, duration) VALUES (1, 1)", "42501"),
    Case("UPDATE", "UPDATE visits SET duration = 0", "42501"),
    Case("DELETE", "DELETE FROM visits", "42501"),
    Case("TRUNCATE", "TRUNCATE visits", "42501"),
    Case("DROP", "DROP TABLE visits", "42501"),
    Case("ALTER: disable RLS", "ALTER TABLE visits DISABLE ROW LEVEL SECURITY", "42501"),
    Case("CREATE VIEW over it", "CREATE VIEW v AS SELECT * FROM visits", "42501"),
    Case("CREATE TABLE", "CREATE TABLE attack (x int)", "42501"),
    Case("COPY TO", "COPY visits TO STDOUT", "42501"),
    Case("COPY query", "COPY (SELECT * FROM visits) TO STDOUT", "42501"),
    Case("cursor", ("BEGIN", "DECLARE c CURSOR FOR SELECT * FROM visits"), "42501"),
    Case("PREPARE", "PREPARE leak AS SELECT * FROM visits", "42501"),
    Case("PREPARE of a DP query", "PREPARE leak AS " + DP_COUNT, "42501"),
    Case("CREATE TABLE AS of a DP query", "CREATE TABLE leak AS " + DP_COUNT, "42501"),
    Case("INSERT of a DP answer", "INSERT INTO countries (code) SELECT WITH ANONYMIZATION "
         "browser FROM visits GROUP BY browser", "42501"),
    Case("DO block", "DO $$ BEGIN PERFORM * FROM visits; END $$", "42501"),
    Case("CALL", "CALL no_such_procedure()", "42501"),
    # --- privilege games
    Case("SET ROLE", "SET ROLE dp_pushdown", "42501"),
    Case("SET SESSION AUTHORIZATION", "SET SESSION AUTHORIZATION postgres", "42501"),
    Case("set_config role", "SELECT set_config('role', 'dp_pushdown', false)", "42501"),
    Case("RESET ALL then read", ("RESET ALL", "SELECT * FROM visits"), "42501"),
    Case("temp table shadowing a protected name",
         "CREATE TEMP TABLE visits (uid int, duration int)", "42501"),
    Case("search_path shadowing",
         ("SET search_path = pg_temp, public", "SELECT * FROM visits"), "42501"),
    # --- side channels: made total or refused, never data-dependent
    Case("division by a user-dependent zero", DP + "ANON_COUNT(*) FROM visits "
         "WHERE 1 / (uid - 42) > 0", None),
    Case("division in the aggregate", DP + "ANON_SUM(100 / (uid - 42), 0, 10) FROM visits", None),
    Case("an integer cast that overflows (or meets NaN, Infinity) for one user",
         DP + "(CASE uid WHEN 1 THEN 'NaN'::float8 WHEN 2 THEN 'Infinity'::float8 WHEN 3 "
         "THEN 1e300 ELSE duration END / 1)::int AS b, ANON_COUNT(*) FROM visits GROUP BY 1",
         None),
    Case("integer arithmetic that overflows int4 for some users", DP + "ANON_COUNT(*) FROM visits "
         "WHERE uid * 2147483647 > 0 AND (uid - uid - 2147483647 - 1) / -1 > 0", None),
    Case("width_bucket of NaN or Infinity for one user", DP + "width_bucket(CASE uid WHEN 1 "
         "THEN 'NaN'::float8 WHEN 2 THEN '-Infinity'::float8 ELSE duration END, 0, 3600, 4) AS b, "
         "ANON_COUNT(*) FROM visits GROUP BY 1", None),
    Case("a smallint cast of a sum that overflows for one user", DP + "ANON_COUNT(*) FROM visits "
         "WHERE (duration * uid)::int2 > 0", None),
    Case("column aliases swapping uid and browser (the unit would be the browser)",
         "SELECT count(*) FROM visits AS v (browser, uid) WHERE v.browser = 42", "0A000"),
    Case("column aliases renaming a WITH query's uid",
         "WITH c AS (SELECT uid, browser FROM visits) SELECT count(*) FROM c AS d (browser, uid)",
         "0A000"),
    Case("column aliases in an IN subquery", DP_COUNT + " WHERE uid IN (SELECT uid FROM "
         "purchases AS p (category, uid))", "0A000"),
    # joins that tie no user: every user of one side owns one user's rows of the other
    Case("USING (uid) over a subquery's column named uid that is not its uid",
         DP + "p.category, p.amount::text AS amount, ANON_COUNT(*) FROM (SELECT uid AS user_id, "
         "32 AS uid FROM visits GROUP BY uid) s JOIN purchases p USING (uid) "
         "GROUP BY p.category, p.amount::text", "0A000"),
    Case("USING (uid) over a WITH query's column named uid that is not its uid",
         "WITH t AS (SELECT uid AS user_id, 5 AS uid FROM visits) " + DP +
         "ANON_AVG(p.amount, 0, 500) FROM t JOIN purchases p USING (uid)", "0A000"),
    Case("plain SQL: USING (uid) over a column named uid that is not the uid",
         "SELECT count(*) FROM (SELECT uid AS u, 5 AS uid FROM visits) s "
         "JOIN purchases p USING (uid)", "0A000"),
    Case("an outer join's ON equating two tables of its preserved side",
         DP + "ANON_COUNT(*) FROM visits v JOIN purchases p ON true LEFT JOIN countries c "
         "ON v.uid = p.uid WHERE p.uid = 5 AND p.amount > 10", "0A000"),
    Case("two items of the preserved side linked only through a nullable one",
         DP + "ANON_COUNT(*) FROM visits v JOIN (SELECT uid, max(amount) AS m FROM purchases "
         "GROUP BY uid) x ON true LEFT JOIN (SELECT uid FROM purchases GROUP BY uid) s "
         "ON s.uid = v.uid AND s.uid = x.uid WHERE x.uid = 42 AND x.m > 10", "0A000"),
    Case("a FULL join's ON equating two tables of one side",
         "SELECT count(*) FROM countries c FULL JOIN (visits v CROSS JOIN purchases p) "
         "ON v.uid = p.uid WHERE p.uid = 5", "0A000"),
    # joins with public tables that give one protected row many public rows: the time tells
    # one user's rows (DESIGN §3.11; dp_core.fanout)
    Case("cross joins of a public table", DP + "ANON_COUNT(*) FROM visits v CROSS JOIN countries a "
         "CROSS JOIN countries b CROSS JOIN countries c WHERE v.uid = 42", "54000"),
    Case("cross joins of VALUES lists", DP + "ANON_SUM(a.x + b.y, 0, 10) FROM visits v, (VALUES "
         + ", ".join(f"({i})" for i in range(20)) + ") a(x), (VALUES " +
         ", ".join(f"({i})" for i in range(20)) + ") b(y) WHERE v.uid = 42", "54000"),
    Case("a non-equi join with a public table", "SELECT count(*) FROM visits v JOIN countries c "
         "ON c.code <> v.country WHERE v.uid = 42", "54000"),
    Case("a join on a public column that is not unique", DP + "ANON_COUNT(*) FROM visits v JOIN "
         "countries c ON c.region = 'Europe' JOIN countries d ON d.region = c.region", "54000"),
    Case("an outer join's ON on the public table's key, between two items of one side",
         DP + "ANON_COUNT(*) FROM visits v CROSS JOIN countries c LEFT JOIN purchases p "
         "ON c.code = v.country AND p.uid = v.uid", "54000"),
    Case("a public table joined on its key", DP + "c.region, ANON_COUNT(*) FROM visits v "
         "JOIN countries c ON c.code = v.country GROUP BY c.region", None),
    Case("a public table left joined on its key, through a subquery and a WITH query",
         "WITH r AS (SELECT code, region FROM countries) " + DP + "r.region, ANON_COUNT(*) "
         "FROM visits v LEFT JOIN (SELECT code FROM countries) c ON c.code = v.country "
         "JOIN r ON r.code = c.code GROUP BY r.region", None),
    Case("a public table and a VALUES list joined on their keys", "SELECT t.n, count(*) FROM "
         "visits v JOIN countries c ON v.country = c.code JOIN (VALUES ('Europe', 1), ('Asia', 2))"
         " t(region, n) ON t.region = c.region GROUP BY t.n", None),
    Case("DISTINCT uid: every value is one user's", "SELECT DISTINCT uid FROM visits", "0A000"),
    Case("grouped by uid and a key", DP + "uid, browser, ANON_COUNT(*) FROM visits "
         "GROUP BY browser, uid", "0A000"),
    Case("semi-join on the uid in WHERE (DESIGN: WHERE subqueries on protected tables)",
         DP_COUNT + " WHERE uid IN (SELECT uid FROM purchases WHERE amount > 100)", "0A000"),
    Case("correlated EXISTS on the uid", DP_COUNT + " v WHERE EXISTS (SELECT 1 FROM purchases p "
         "WHERE p.uid = v.uid)", "0A000"),
    Case("division by the outer row in a public IN subquery (correlated: refused)", DP_COUNT +
         " WHERE country IN (SELECT code FROM countries WHERE 1 / (duration - 42) > 0)", "0A000"),
    Case("a correlated EXISTS over a public table (work per row)", DP_COUNT + " v WHERE EXISTS "
         "(SELECT 1 FROM countries c WHERE c.code = v.country AND v.duration > 1)", "0A000"),
    Case("an uncorrelated IN over a public table", DP_COUNT + " WHERE country IN "
         "(SELECT code FROM countries WHERE region = 'Europe' AND 1 / (length(code) - 2) "
         "IS NULL)", None),
    Case("IN subqueries over more than 1,000 public rows in all (compared row by row where "
         "not hashed)", DP_COUNT + " WHERE uid = 42 AND " + " AND ".join(
             f"NOT (browser || '{i}' IN (SELECT name FROM countries))" for i in range(7)),
         "54000"),
    Case("an IN subquery times a cross join", "SELECT count(*) FROM visits v CROSS JOIN "
         "(VALUES (1), (2), (3), (4), (5), (6), (7), (8), (9), (10)) t(x) WHERE v.uid = 42 AND "
         "v.browser IN (SELECT name FROM countries)", "54000"),
    Case("text parsed as a number for one user", DP_COUNT + " WHERE CASE WHEN uid = 42 THEN "
         "abs(browser) END > 0", "0A000"),
    Case("text summed as numbers per user", DP + "ANON_SUM(m, 0, 10) FROM (SELECT uid, "
         "sum(browser) AS m FROM visits GROUP BY uid) s", "0A000"),
    Case("text averaged in a per-user window", DP + "ANON_SUM(m, 0, 10) FROM (SELECT uid, "
         "avg(country) OVER (PARTITION BY uid) AS m FROM visits) s", "0A000"),
    Case("IN over other users' rows (top spenders)", DP_COUNT + " WHERE uid IN (SELECT uid FROM "
         "purchases ORDER BY amount DESC LIMIT 10)", "0A000"),
    Case("IN over a shifted uid (the neighbour's rows)", DP_COUNT + " WHERE uid IN "
         "(SELECT uid + 1 FROM purchases)", "0A000"),
    Case("IN testing a value against uids", DP_COUNT + " WHERE duration IN "
         "(SELECT uid FROM purchases)", "0A000"),
    Case("scalar subquery over all users", DP_COUNT + " WHERE duration > "
         "(SELECT avg(amount) FROM purchases)", "0A000"),
    Case("overflow", DP + "ANON_SUM(duration * 1e38 * 1e38, 0, 10) FROM visits", None),
    Case("literal beyond the arithmetic bound", DP + "ANON_SUM(duration * 1e39, 0, 10) FROM visits",
         "0A000"),
    Case("NaN and infinities", DP + "ANON_AVG(CASE WHEN uid = 42 THEN 'NaN'::float8 "
         "WHEN uid = 43 THEN 'Infinity'::float8 ELSE duration END, 0, 10) FROM visits", None),
    Case("float values whose squares overflow float8", DP + "ANON_VAR(CASE WHEN uid = 42 "
         "THEN 1e150::float8 ELSE 1.5::float8 END, 0, 1e100), ANON_AVG(CASE WHEN uid = 42 "
         "THEN -1e300::float8 ELSE 2.5::float8 END, -1e100, 1e100) FROM visits", None),
    Case("bounds whose sum over users leaves float8", DP + "ANON_SUM(duration, 0, 1e300) "
         "FROM visits", "22023"),
    Case("subnormal bounds", DP + "ANON_SUM(duration, 5e-324, 1e-323) FROM visits", "22023"),
    # float8 arithmetic that underflows to 0 is an error (22003) in Postgres: values some of
    # whose users' means, leaves or casts would underflow (a tiny value on one row of three)
    Case("a per-user mean that underflows for some users", DP + "ANON_AVG(CASE WHEN "
         "duration % 3 = 0 THEN 5e-324::float8 ELSE 0::float8 END, 0, 1), ANON_VAR(CASE WHEN "
         "duration % 3 = 0 THEN -5e-324::float8 ELSE 0::float8 END, -1, 1) FROM visits", None),
    Case("a quantile's leaf that underflows for some users", DP + "ANON_MEDIAN(CASE WHEN "
         "duration % 3 = 0 THEN 1e-250::float8 ELSE 0::float8 END, 0, 1e100), ANON_MEDIAN(CASE "
         "WHEN duration % 3 = 0 THEN 1e-400::numeric ELSE 0 END, 0, 1) FROM visits", None),
    Case("row-level means and weights of tiny values", "SELECT AVG(CASE WHEN duration % 3 = 0 "
         "THEN 5e-324::float8 ELSE duration END), SUM(CASE WHEN duration % 3 = 0 THEN "
         "1e-320::float8 ELSE duration END) FROM visits", None),
    # --- issue 26: clauses, tables and owners no rule handles; errors no value can cause
    Case("ORDER BY in a FROM subquery failing for one user's row", DP + "ANON_COUNT(*) FROM "
         "(SELECT uid FROM visits ORDER BY 1/(CASE WHEN uid=1 AND duration=663 THEN 0 ELSE 1 END)) t",
         "0A000"),
    Case("ORDER BY in a WITH query", "WITH t AS (SELECT uid, duration FROM visits ORDER BY "
         "duration / (uid - 1)) " + DP + "ANON_COUNT(*) FROM t", "0A000"),
    Case("DISTINCT ON in an IN subquery", DP_COUNT + " WHERE country IN (SELECT DISTINCT ON "
         "(region) code FROM countries ORDER BY region, 1 / (length(code) - 2))", "0A000"),
    Case("a protected table read only in a subquery's ORDER BY", DP + "ANON_COUNT(*) FROM visits v "
         "JOIN (SELECT code FROM countries ORDER BY (SELECT max(duration) FROM visits)) c "
         "ON c.code = v.country", "0A000"),
    Case("a protected table read only in a FROM subquery's select list", DP + "ANON_COUNT(*) "
         "FROM visits v JOIN (SELECT code, (SELECT max(duration) FROM visits) AS m FROM countries) c "
         "ON c.code = v.country", "0A000"),
    Case("a volatile function in a public FROM subquery", DP + "ANON_COUNT(*) FROM visits v "
         "JOIN (SELECT code, pg_sleep(0.01) AS s FROM countries) c ON c.code = v.country", "0A000"),
    Case("a division in a public FROM subquery, evaluated for joined rows only", DP +
         "ANON_COUNT(*) FROM visits v JOIN (SELECT code, 1 / (length(code) - 2) AS x FROM "
         "countries) c ON c.code = v.country WHERE c.x IS NULL OR v.uid = 1", None),
    Case("the ledger's analysts joined", DP + "a.analyst, ANON_COUNT(*) FROM visits v JOIN "
         "dpproxy.analysts a ON true GROUP BY a.analyst", "42501"),
    Case("the ledger in an IN subquery", DP_COUNT + " WHERE browser IN (SELECT analyst FROM "
         "dpproxy.ledger)", "42501"),
    Case("the ledger in a WITH query", "WITH l AS (SELECT analyst FROM dpproxy.ledger) " + DP +
         "ANON_COUNT(*) FROM visits WHERE browser IN (SELECT analyst FROM l)", "42501"),
    Case("the ledger in a public FROM subquery", DP + "ANON_COUNT(*) FROM visits v JOIN (SELECT "
         "analyst FROM dpproxy.ledger) l ON l.analyst = v.browser", "42501"),
    Case("the ledger reached through search_path", ("SET search_path = dpproxy, public",
         DP + "ANON_COUNT(*) FROM visits v JOIN analysts a ON true"), "42P01"),
    Case("statistics views", DP + "ANON_COUNT(*) FROM visits WHERE browser IN (SELECT relname "
         "FROM pg_stat_user_tables)", "42501"),
    Case("information_schema", DP + "ANON_COUNT(*) FROM visits v JOIN information_schema.tables t "
         "ON t.table_name = v.browser", "0A000"),
    Case("a per-user window over the NULL uid of an outer join", DP + "ANON_AVG(s, 0, 1000) FROM "
         "(SELECT v.uid, sum(CASE WHEN v.uid = 1 THEN v.duration ELSE 0 END) OVER "
         "(PARTITION BY p.uid) AS s FROM visits v LEFT JOIN purchases p ON v.uid = p.uid "
         "WHERE p.uid IS NULL) t", "0A000"),
    Case("per-user rows grouped by the NULL uid of an outer join", DP + "ANON_SUM(s, 0, 1e6) "
         "FROM (SELECT p.uid, sum(v.duration) AS s FROM visits v LEFT JOIN purchases p "
         "ON v.uid = p.uid GROUP BY p.uid) t", "0A000"),
    Case("a public table LEFT JOINed to a protected one (rows of no user)", DP + "c.region, "
         "ANON_COUNT(*) FROM countries c LEFT JOIN visits v ON v.country = c.code "
         "GROUP BY c.region", None),
    Case("numeric overflow for one user's value", DP_COUNT + " WHERE CASE WHEN uid = 42 AND "
         "duration > 700 THEN 1e100000 ELSE 0 END * 1e100000 > 0", "0A000"),
    Case("numeric overflow by repeated products of a user's value", DP_COUNT + " WHERE (CASE "
         "WHEN uid = 42 THEN 1e300 ELSE 0 END * 1e38 * 1e38 * 1e38 * 1e38) / 1e-38 > 0", None),
    Case("numeric overflow in a key, a JOIN and a FILTER", DP + "(CASE WHEN v.uid = 42 THEN "
         "duration * 1e38 * 1e38 * 1e38 ELSE 0 END) > 1 AS k, ANON_COUNT(*) FILTER (WHERE "
         "duration * 1e38 * 1e38 > 0) FROM visits v JOIN purchases p ON v.uid = p.uid AND "
         "p.amount * 1e38 * 1e38 * 1e38 > 0 GROUP BY 1", None),
    # values brought to one type: Postgres converts numeric to real or double precision
    # implicitly, which fails beyond their range (or below their smallest magnitude)
    Case("numeric chosen with real by GREATEST for one user", "SELECT count(*) FROM visits WHERE "
         "GREATEST(CASE WHEN uid = 42 THEN uid * 1e100 ELSE 0 END, 1::float4) > 0", "0A000"),
    Case("numeric chosen with real by COALESCE, no uid named", DP + "ANON_COUNT(*) FROM "
         "purchases WHERE COALESCE(CASE WHEN amount = 172.31 THEN amount * 1e100 END, "
         "1::real) > 0", "0A000"),
    Case("numeric chosen with real by CASE", "SELECT count(*) FROM visits WHERE CASE WHEN "
         "uid = 42 THEN uid * 1e100 ELSE 1::real END > 0", "0A000"),
    *(Case(f"numeric brought to real or double precision ({i})", sql, "0A000") for i, sql in
      enumerate([
          "SELECT browser, sum(COALESCE(CASE WHEN uid = 42 THEN uid * 1e100 END, 0::real)) "
          "FROM visits GROUP BY browser",  # (a sum)
          DP + "LEAST(duration * 1e50, 1::float4) AS k, ANON_COUNT(*) FROM visits "
               "GROUP BY 1",  # (a key)
          DP + "ANON_COUNT(*) FILTER (WHERE NULLIF(duration * 1e-30 * 1e-30, 2::float4) > 0) "
               "FROM visits",  # (a FILTER, underflow)
          DP_COUNT + " WHERE (uid * 1e-200) * 1e-200 > 1::float8",
          DP_COUNT + " WHERE duration * 1e-320 IN (1::float8, 2)",
          DP_COUNT + " WHERE duration * 1e-320 BETWEEN 0 AND 1::float8",
          DP + "ANON_COUNT(*) FROM visits v JOIN countries c ON c.code = v.country "
               "AND v.duration * 1e-320 <> 1::float8",  # (a join's ON)
          DP_COUNT + " WHERE CASE duration * 1e-320 WHEN 1::float8 THEN true END",
          DP_COUNT + " WHERE duration * 1e-320 IN (SELECT 1::float8 FROM countries)",
          # (a public value converted where the subquery runs: only if a row reaches it)
          DP_COUNT + " WHERE uid = 42 AND duration::float8 IN (SELECT 1e400 FROM countries)",
          DP_COUNT + " WHERE 1::float8 IN (1, duration * 1e-320)",  # (a list's one type)
          # constants Postgres converts on each row that reaches them: a stable conversion
          # (date to timestamptz) or a stable function's value (extract() of a timestamptz)
          "SELECT count(*) FROM visits WHERE CASE WHEN uid = 42 THEN '5874897-01-01'::date "
          "ELSE '2020-01-01'::timestamptz END > '2000-01-01'::timestamptz",
          "SELECT count(*) FROM visits WHERE COALESCE(CASE WHEN uid = 42 THEN NULL ELSE "
          "'2020-01-01'::timestamptz END, '5874897-01-01'::date) > '2000-01-01'::timestamptz",
          "SELECT count(*) FROM visits WHERE CASE WHEN uid = 42 THEN '2020-01-01'::timestamptz "
          "IN ('5874897-01-01'::date, '2020-01-02'::date) ELSE true END",
          "SELECT count(*) FROM visits WHERE CASE WHEN uid = 42 THEN '294276-12-31 23:00:00'::"
          "timestamp ELSE '2020-01-01'::timestamptz END > '2000-01-01'::timestamptz",
          "SELECT count(*) FROM visits WHERE CASE WHEN uid = 42 THEN GREATEST(extract(epoch FROM "
          "'2000-01-01 00:00:01+00'::timestamptz) * 1e100, 1::float4) ELSE 1 END > 0",
          # a join's USING column, each side's own
          "SELECT count(*) FROM purchases p JOIN (SELECT 1.5::float8 AS amount) c USING (amount)",
          "SELECT count(*) FROM (SELECT uid, amount * 1e100 AS amount FROM purchases) p "
          "JOIN (SELECT 1::real AS amount) c USING (amount)",
          "SELECT count(*) FROM visits v JOIN purchases p USING (uid) "
          "JOIN (SELECT 1::float8 AS amount) c USING (amount)",  # (a side that joins)
      ])),
    *(Case(f"values of one type, or converted where every value converts ({i})", sql, None)
      for i, sql in enumerate([
          DP_COUNT + " WHERE duration > 1.5::float8 AND duration * 2 IN (1, 2.5) AND CASE WHEN "
                     "duration > 5 THEN 1.5 ELSE 2 END > 1 AND COALESCE(duration, 0) * 1e-320 = 0",
          DP + "GREATEST(duration::float8, 1.5) AS k, ANON_COUNT(*) FROM visits GROUP BY 1",
          # (a constant converted when the pushdown is planned, whatever the rows)
          DP_COUNT + " WHERE CASE WHEN uid = 42 THEN 1e-30 ELSE 1::float4 END > 0",
          "SELECT count(*) FROM purchases p JOIN (SELECT 1.5 AS amount) c USING (amount)",
      ])),
    Case("bounds so wide the noise scale overflows", DP + "ANON_VAR(duration, 0, 1e200) "
         "FROM visits", "22023"),
    Case("text to number cast of a column", DP + "ANON_COUNT(*) FROM visits "
         "WHERE browser::int > 0", "0A000"),
    Case("pg_sleep", DP + "ANON_COUNT(*) FROM visits WHERE pg_sleep(1) IS NOT NULL", "0A000"),
    Case("random()", DP + "ANON_COUNT(*) FROM visits WHERE random() > 0.5", "0A000"),
    Case("generate_series blow-up", DP + "ANON_COUNT(*) FROM visits, "
         "generate_series(1, 1000000000) g", "0A000"),
    Case("system catalog inside a DP query", DP + "ANON_COUNT(*) FROM visits "
         "JOIN pg_class c ON c.relname = visits.browser", "0A000"),
    # --- budget games
    Case("epsilon 0", "SELECT WITH ANONYMIZATION OPTIONS(epsilon=0) ANON_COUNT(*) FROM visits",
         "22023"),
    Case("epsilon -1", "SELECT WITH ANONYMIZATION OPTIONS(epsilon=-1) ANON_COUNT(*) FROM visits",
         "22023"),
    Case("epsilon NaN", "SELECT WITH ANONYMIZATION OPTIONS(epsilon='NaN') ANON_COUNT(*) "
         "FROM visits", "22023"),
    # the budget is checked first (53400), then the per-query caps (22023)
    Case("epsilon 1e308", "SELECT WITH ANONYMIZATION OPTIONS(epsilon=1e308) ANON_COUNT(*) "
         "FROM visits", "53400"),
    Case("delta 1", "SELECT WITH ANONYMIZATION OPTIONS(delta=1) ANON_COUNT(*) FROM visits",
         "22023"),
    Case("SET dp.epsilon above the cap", "SET dp.epsilon = 1000", "22023"),
    Case("huge max_groups_contributed", "SELECT WITH ANONYMIZATION "
         "OPTIONS(max_groups_contributed=1000000000) ANON_COUNT(*) FROM visits", "22023"),
    Case("two DP clauses", "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM (SELECT WITH "
         "ANONYMIZATION ANON_COUNT(*) FROM visits) s", "42501"),
    # --- string literals read otherwise than the proxy reads them: refused before the backend
    # sees them (a change the backend reports anyway ends the session)
    Case("standard_conforming_strings off", "SET standard_conforming_strings = off", "0A000"),
    Case("standard_conforming_strings off by set_config",
         "SELECT set_config('standard_conforming_' || 'strings', 'off', false)", "0A000"),
    Case("standard_conforming_strings off in a transaction",
         ("BEGIN", "SET LOCAL standard_conforming_strings = off"), "0A000"),
    Case("standard_conforming_strings on", "SET standard_conforming_strings = on", None),
    # a client-only encoding hides ASCII bytes (a backslash: SJIS 0x95 0x5C) inside characters
    Case("client_encoding SJIS", "SET client_encoding = 'SJIS'", "0A000"),
    Case("client_encoding GBK by set_config",
         "SELECT set_config('client_encoding', 'GBK', false)", "0A000"),
    Case("client_encoding LATIN1", "SET client_encoding = 'LATIN1'", None),
    Case("SET NAMES BIG5 by an alias", "SET NAMES 'WIN950'", "0A000"),
    Case("client_encoding by UPDATE pg_settings",
         "UPDATE pg_settings SET setting = 'SJIS' WHERE name = 'client_' || 'encoding'", "0A000"),
    Case("set_config of a computed name in a subquery",
         "SELECT (SELECT set_config(lower('CLIENT_ENCODING'), 'SJIS', false))", "0A000"),
    # --- several statements in one Query
    Case("pass-through then a raw read", "SELECT 1; SELECT * FROM visits", "42501"),
    Case("DP then a raw read", DP_COUNT + "; SELECT * FROM visits", "42501"),
]


def test_catalogue_is_large_enough() -> None:
    assert len(CASES) + len(PROTOCOL_CASES) >= 40
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.fixture(scope="module")
def proxy_module(loop_thread: LoopThread, demo_config: Config, backend: Backend) -> Iterator[Proxy]:
    """One proxy for the whole catalogue (each case still gets its own session)."""
    with running_proxy(loop_thread, demo_config, backend) as px:
        with psycopg.connect(px.dsn("admin"), autocommit=True) as adm:
            adm.execute("SELECT dp_reset_budget('alice')")
        yield px


def _healthy(proxy: Proxy, conn: psycopg.Connection | None) -> None:
    for c in ([conn] if conn is not None and not conn.closed else []):
        c.rollback() if c.info.transaction_status != psycopg.pq.TransactionStatus.IDLE else None
        assert c.execute("SELECT count(*) FROM countries").fetchone()[0] > 0
    with psycopg.connect(proxy.dsn(), autocommit=True) as fresh:
        assert fresh.execute("SELECT 1").fetchone() == (1,)
        (n,) = fresh.execute(DP_COUNT).fetchone()
        assert isinstance(n, int)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_attack(proxy_module: Proxy, case: Case) -> None:
    statements = (case.sql,) if isinstance(case.sql, str) else case.sql
    conn = psycopg.connect(proxy_module.dsn(), autocommit=True)
    try:
        for sql in statements[:-1]:
            conn.execute(sql)
        if case.sqlstate is None:
            cur = conn.execute(statements[-1])
            rows = cur.fetchall() if cur.description else []
            if case.no_rows:
                assert rows == []
            for row in rows:  # nothing from the protected tables' rows
                assert "Firefox" not in repr(row) and "Chrome" not in repr(row)
        else:
            with pytest.raises(psycopg.Error) as info:
                conn.execute(statements[-1])
            assert info.value.sqlstate == case.sqlstate, info.value
            assert info.value.diag.message_primary
        _healthy(proxy_module, conn)
    finally:
        conn.close()


@pytest.mark.parametrize(("key", "texts"), [
    # the target (uid 42) spells the value one way, every later user another: the group's
    # key was printed from its first row (1.00 with the target, 1.0 without)
    ("CASE WHEN uid = 42 THEN 1.00 WHEN uid > 42 THEN 1.0 ELSE 2 END", {"1", "2"}),
    ("CASE WHEN uid = 42 THEN '-0'::float8 ELSE 0::float8 END", {"0"}),
    ("CASE WHEN uid = 42 THEN '-0'::float4 WHEN uid > 42 THEN 0::float4 ELSE 1.5 END",
     {"0", "1.5"}),
    ("round(duration / 1000.0, 1) * 1.00", None),  # (0.10, 1.00: no trailing zeros)
])
def test_a_groups_key_is_one_spelling_of_its_equal_values(proxy_module: Proxy, key: str,
                                                         texts: set[str] | None) -> None:
    """Equal numeric (1.0 = 1.00) or float (0 = -0) keys are one group, which Postgres prints
    from one of its rows: the released key is one spelling of the value, whatever rows the
    group has (numeric without trailing zeros, 0 for -0)."""
    with psycopg.connect(proxy_module.dsn(), autocommit=True) as conn:
        conn.execute("SET dp.epsilon = 0.01")
        for name in ("numeric", "float4", "float8"):
            conn.adapters.register_loader(name, psycopg.types.string.TextLoader)
        for form in (f"{DP}{key} AS k, ANON_COUNT(*) FROM visits GROUP BY 1",
                     f"SELECT {key} AS k, COUNT(*) FROM visits GROUP BY 1",
                     f"SELECT {key} AS k, COUNT(*) FROM visits GROUP BY 1 HAVING COUNT(*) > 0 "
                     "ORDER BY 1",
                     f"SELECT DISTINCT {key} AS k FROM visits"):
            released = {r[0] for r in conn.execute(form).fetchall()}
            assert released, form
            assert not any(t.startswith("-0") or re.search(r"\.\d*0$", t) for t in released)
            assert texts is None or released <= texts, (form, released)


def test_a_text_key_under_a_nondeterministic_collation_is_grouped_by_its_bytes(
        loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    """Under a nondeterministic collation 'X' = 'x' would be one group, printed from one of
    its rows: which spelling came out would tell which rows the group has. The pushdown groups
    texts under "C", so each spelling is its own group. (Needs an ICU build of Postgres: the
    embedded one has none, DPPROXY_TEST_DSN's may.)"""
    key = "CASE WHEN uid % 2 = 0 THEN upper(browser) ELSE lower(browser) END"
    # (a proxy of its own: the collation's existence is read once per proxy)
    with _browser_case_insensitive(backend), \
            running_proxy(loop_thread, demo_config, backend) as px, budgets_reset(px), \
            psycopg.connect(px.dsn(), autocommit=True) as conn:
        conn.execute("SET dp.epsilon = 0.5")
        for form in (f"SELECT WITH ANONYMIZATION {key} AS k, ANON_COUNT(*) FROM visits "
                     "GROUP BY 1",
                     f"SELECT {key} AS k, COUNT(*) FROM visits GROUP BY 1",
                     f"SELECT DISTINCT {key} AS k FROM visits"):
            # (Chrome's users are about 14k: either half is far above τ at ε 0.5)
            released = {r[0] for r in conn.execute(form).fetchall()}
            assert "CHROME" in released and "chrome" in released, (form, released)


@contextlib.contextmanager
def _browser_case_insensitive(backend: Backend) -> Iterator[None]:
    """visits.browser under an ICU case-insensitive (nondeterministic) collation for the
    block; skips the test on a Postgres without ICU (the embedded build)."""
    admin = psycopg.connect(backend.admin_dsn, autocommit=True)
    try:
        admin.execute("CREATE COLLATION dp_test_ci (provider = icu, "
                      "locale = 'und-u-ks-level2', deterministic = false)")
    except psycopg.Error as e:
        admin.close()
        pytest.skip(f"no nondeterministic collation on this Postgres: {e}")
    try:
        admin.execute("ALTER TABLE visits ALTER COLUMN browser TYPE text COLLATE dp_test_ci")
        yield
    finally:
        admin.execute('ALTER TABLE visits ALTER COLUMN browser TYPE text COLLATE "default"')
        admin.execute("DROP COLLATION dp_test_ci")
        admin.close()


def test_substring_searches_under_a_nondeterministic_collation_answer(
        loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    """Postgres refuses LIKE, ILIKE and substring searches (strpos, position, replace,
    split_part) under a nondeterministic collation on each row that reaches them: `CASE WHEN
    uid = 42 THEN browser LIKE 'C%' END` failed after the charge only where user 42 had rows.
    Their literal is under "C", which decides the search; ILIKE is lower(x) LIKE
    lower(pattern), lowered under x's collation. (Needs an ICU build of Postgres, as the test
    above.)"""
    with _browser_case_insensitive(backend), \
            running_proxy(loop_thread, demo_config, backend) as px, budgets_reset(px), \
            psycopg.connect(px.dsn(), autocommit=True) as conn:
        conn.execute("SET dp.epsilon = 0.1")
        for search in ("browser LIKE 'C%'", "strpos(browser, 'h') > 0",
                       "position('h' IN browser) > 0", "replace(browser, 'a', 'b') = 'x'",
                       "split_part(browser, 'r', 1) = 'C'", "browser ILIKE 'c%'",
                       "browser NOT ILIKE '%É%'"):
            conn.execute("SELECT count(*) FROM visits WHERE CASE WHEN uid = 42 THEN "
                         f"{search} END").fetchall()


def test_a_key_of_a_type_whose_equal_values_print_differently_is_refused(
        loop_thread: LoopThread, demo_config: Config, backend: Backend) -> None:
    """A composite of numbers is one group for '(1.0)' and '(1.00)', printed from one of its
    rows: the target (uid 42) spells it one way, every other user the other, and the released
    key told whether the target had rows. Only key types whose equal values print alike are
    released (built-ins, enums and arrays of them; numbers and texts made canonical): other
    types (composites, bpchar[], an extension's citext) are refused before any charge.
    Enums, ranges and arrays of them stay keys."""
    admin = psycopg.connect(backend.admin_dsn, autocommit=True)
    cases = {  # key: its values, the target's first
        "pair": ("ROW(1.00)::dp_test_pair", "ROW(1.0)::dp_test_pair"),
        "pairs": ("ARRAY[ROW(1.00)::dp_test_pair]", "ARRAY[ROW(1.0)::dp_test_pair]"),
        "padded": ("ARRAY['a  '::bpchar]", "ARRAY['a'::bpchar]"),
        # (its text is twice its size: a few hundred MB of one user's would pass 1 GB)
        "blob": ("'\\x01'::bytea", "'\\x02'::bytea"),
    }
    kept = {"mood": "CASE WHEN uid % 2 = 0 THEN 'low' ELSE 'high' END::dp_test_mood",
            "moods": "ARRAY[CASE WHEN uid % 2 = 0 THEN 'low' ELSE 'high' END]::dp_test_mood[]",
            "span": "int4range((uid % 2)::int4, 3)"}
    try:
        admin.execute("CREATE TYPE dp_test_pair AS (v numeric)")
        admin.execute("CREATE TYPE dp_test_mood AS ENUM ('low', 'high')")
        admin.execute("ALTER TABLE visits ADD COLUMN pair dp_test_pair, "
                      "ADD COLUMN pairs dp_test_pair[], ADD COLUMN padded bpchar[], "
                      "ADD COLUMN blob bytea, "
                      "ADD COLUMN mood dp_test_mood, ADD COLUMN moods dp_test_mood[], "
                      "ADD COLUMN span int4range")
        sets = [f"{c} = CASE WHEN uid = 42 THEN {a} ELSE {b} END" for c, (a, b) in cases.items()]
        admin.execute(f"UPDATE visits SET {', '.join(sets)}, "
                      f"{', '.join(f'{c} = {v}' for c, v in kept.items())}")
        with running_proxy(loop_thread, demo_config, backend) as px, budgets_reset(px), \
                psycopg.connect(px.dsn(), autocommit=True) as conn:
            conn.execute("SET dp.epsilon = 0.5")
            forms = ("SELECT WITH ANONYMIZATION {k} AS k, ANON_COUNT(*) FROM visits GROUP BY 1",
                     "SELECT {k} AS k, COUNT(*) FROM visits GROUP BY 1",
                     "SELECT DISTINCT {k} AS k FROM visits",
                     "SELECT k, COUNT(*) FROM (SELECT uid, {k} AS k FROM visits) s GROUP BY k")
            (spent,) = conn.execute("SELECT epsilon_spent FROM dp_budget()").fetchone()
            for key in cases:
                for form in forms:
                    with pytest.raises(psycopg.errors.FeatureNotSupported, match="print"):
                        conn.execute(form.format(k=key))
            assert conn.execute("SELECT epsilon_spent FROM dp_budget()").fetchone() == (spent,)
            for key in kept:
                for form in forms:
                    released = {str(r[0]) for r in conn.execute(form.format(k=key))}
                    assert len(released) == 2, (form, released)
    finally:
        admin.execute("ALTER TABLE visits DROP COLUMN IF EXISTS pair, "
                      "DROP COLUMN IF EXISTS pairs, DROP COLUMN IF EXISTS padded, "
                      "DROP COLUMN IF EXISTS blob, "
                      "DROP COLUMN IF EXISTS mood, DROP COLUMN IF EXISTS moods, "
                      "DROP COLUMN IF EXISTS span")
        admin.execute("DROP TYPE IF EXISTS dp_test_pair")
        admin.execute("DROP TYPE IF EXISTS dp_test_mood")
        admin.close()


@pytest.mark.parametrize("form", [
    "SELECT WITH ANONYMIZATION {k} AS k, ANON_COUNT(*) FROM visits GROUP BY 1",
    "SELECT {k} AS k, COUNT(*) FROM visits GROUP BY 1",
    "SELECT {k} AS k, COUNT(DISTINCT uid), SUM(duration) FROM visits GROUP BY 1",
    "SELECT DISTINCT {k} AS k FROM visits",
    "SELECT k FROM (SELECT {k} AS k, COUNT(*) AS n FROM visits GROUP BY 1) AS s",
])
def test_released_rows_come_in_their_keys_order(proxy_module: Proxy, form: str) -> None:
    """Red team, session 30: the pushdown's rows came in its hash table's order, which
    follows the order rows reached it (sorted by uid, from the per-user window): one user
    could swap two keys of one bucket, and the released order (or the row LIMIT kept)
    told whether it had rows. Released rows come in their keys' order, texts by code
    point, whatever the pushdown's order; LIMIT without ORDER BY keeps the first of them."""
    key = "uid % 40"  # (40 groups of 500 users: every one released)
    with budgets_reset(proxy_module, ("alice",)), \
            psycopg.connect(proxy_module.dsn(), autocommit=True) as conn:
        conn.execute("SET dp.epsilon = 0.5")
        sql = form.format(k=key)
        released = [str(r[0]) for r in conn.execute(sql).fetchall()]
        assert len(released) == 40, released
        assert released == sorted(released), released
        first = [str(r[0]) for r in conn.execute(f"{sql} LIMIT 3").fetchall()]
        assert first == sorted(released)[:3]


def test_a_login_with_standard_conforming_strings_off_is_refused(proxy_module: Proxy) -> None:
    async def login() -> asyncpg.PostgresError:
        try:
            conn = await asyncpg.connect(
                host=proxy_module.host, port=proxy_module.port, user="alice", password="alice",
                database=TEST_DATABASE, ssl=False,
                server_settings={"standard_conforming_strings": "off"})
        except asyncpg.PostgresError as e:
            return e
        await conn.close()
        raise AssertionError("login succeeded")

    refused = asyncio.run(login())
    assert refused.sqlstate == "0A000" and "standard_conforming_strings" in str(refused)
    _healthy(proxy_module, None)


def test_reltuples_is_a_documented_residual(proxy_module: Proxy) -> None:
    """pg_class is readable by every role, so the planner's size estimates of protected tables
    are visible (hiding them would break every BI tool's table browser). docs/isolation.md
    documents it: the approximate row count of a whole table, not any user's data."""
    with psycopg.connect(proxy_module.dsn(), autocommit=True) as conn:
        rows = conn.execute("SELECT reltuples, relpages FROM pg_class WHERE relname = 'visits'"
                            ).fetchall()
    assert len(rows) == 1
    docs = ROOT / "docs" / "isolation.md"
    assert "reltuples" in docs.read_text()


# --- malformed and extreme DP options: a clean error before any charge, the session lives on

MALFORMED = [
    ("epsilon=0x10", "42601"),  # Postgres 16's hexadecimal integers: not an option value
    ("epsilon=0o17", "42601"),
    ("max_groups_contributed=0b11", "42601"),
    ("epsilon=", "42601"),
    ("epsilon=1e", "42601"),
    ("epsilon='abc'", "22023"),
    ("epsilon=NULL", "42601"),
    ("epsilon=-1", "22023"),
    ("epsilon=1e999", "22023"),  # infinite
    ("epsilon=nan", "22023"),
    ("epsilon='Infinity'", "22023"),
    ("epsilon=5e-324", "22023"),  # subnormal
    ("delta=5e-324", "22023"),
    ("epsilon=1e-9", "22023"),  # below min_epsilon
    ("epsilon=" + "9" * 5000, "22023"),  # infinite as a float
    ("max_groups_contributed=1e400", "22023"),
    ("epsilon=0.1, epsilon=0.2", "42601"),
    ("epsilon=0.1, bogus=1", "42601"),
    ("epsilon=(0.1)", "42601"),
    ("epsilon=f(0.1)", "42601"),
    ("epsilon=0.1, delta=(1e-9, 2)", "42601"),
    ("(epsilon=0.1)", "42601"),
    ("epsilon=0.1,", "42601"),
]
MALFORMED_BOUNDS = [
    "ANON_SUM(duration, 5e-324, 1e-323)",
    "ANON_SUM(duration, 0, 5e-324)",
    "ANON_AVG(duration, -1e-320, 1e-320)",
    "ANON_COUNT(*, 5e-324)",
    "ANON_SUM(duration, 0, 1e-300)",  # normal, but its noise's grid would be subnormal
    "ANON_VAR(duration, 0, 1e-150)",  # normal, but a centred value's square would underflow
]


def _refused_uncharged(proxy: Proxy, sql: str, sqlstate: str) -> None:
    """`sql` gets `sqlstate` (as a simple and as a prepared statement), charges nothing, and
    the connection still answers."""
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        before = spent(conn)
        for prepare in (False, True):
            with pytest.raises(psycopg.Error) as info:
                conn.execute(sql, prepare=prepare)
            assert info.value.sqlstate == sqlstate, info.value
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert spent(conn) == before


@pytest.mark.parametrize(("options", "sqlstate"), MALFORMED, ids=[m[0][:40] for m in MALFORMED])
def test_malformed_options_are_refused_before_any_charge(proxy_module: Proxy, options: str,
                                                         sqlstate: str) -> None:
    _refused_uncharged(proxy_module,
                       f"SELECT WITH ANONYMIZATION OPTIONS({options}) ANON_COUNT(*) FROM visits",
                       sqlstate)


@pytest.mark.parametrize("aggregate", MALFORMED_BOUNDS)
def test_subnormal_bounds_are_refused_before_any_charge(proxy_module: Proxy,
                                                        aggregate: str) -> None:
    _refused_uncharged(proxy_module, f"{DP}{aggregate} FROM visits", "22023")


@pytest.mark.parametrize("value", ["1e-9", "5e-324", "'NaN'", "'Infinity'"])
def test_set_epsilon_below_the_minimum_is_refused(proxy_module: Proxy, value: str) -> None:
    with psycopg.connect(proxy_module.dsn(), autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as info:
            conn.execute(f"SET dp.epsilon = {value}")
        assert info.value.sqlstate == "22023"
        if value == "1e-9":
            assert "minimum 0.001" in str(info.value)
        assert conn.execute("SHOW dp.epsilon").fetchone() == ("1.0",)


# --- protocol tricks, on the raw protocol


def _login(proxy: Proxy) -> RawClient:
    c = RawClient(proxy.host, proxy.port)
    c.login("alice", "alice", TEST_DATABASE)
    return c


def _reuse_unnamed_statement(c: RawClient) -> list[str | None]:
    c.send(p.Parse("", DP_COUNT, ()), p.Sync())
    c.recv_until_ready()
    c.send(p.Parse("", "SELECT * FROM visits", ()), p.Bind("", "", (), (), ()),
           p.Execute("", 0), p.Sync())
    return errors(c.recv_until_ready())


def _reuse_named_statement(c: RawClient) -> list[str | None]:
    c.send(p.Parse("s1", DP_COUNT, ()), p.Sync())
    c.recv_until_ready()
    c.send(p.Parse("s1", "SELECT * FROM visits", ()), p.Sync())
    return errors(c.recv_until_ready())


def _bind_wrong_parameter_count(c: RawClient) -> list[str | None]:
    c.send(p.Parse("s2", DP + "ANON_COUNT(*) FROM visits WHERE duration > $1", (23,)),
           p.Bind("", "s2", (0,), (b"1", b"2"), (0,)), p.Execute("", 0), p.Sync())
    return errors(c.recv_until_ready())


def _bind_binary_garbage(c: RawClient) -> list[str | None]:
    c.send(p.Parse("s3", DP + "ANON_COUNT(*) FROM visits WHERE duration > $1", (23,)),
           p.Bind("", "s3", (1,), (b"\x01",), (0,)), p.Execute("", 0), p.Sync())
    return errors(c.recv_until_ready())


def _execute_with_row_limit(c: RawClient) -> list[str | None]:
    """A row limit on a DP portal: the whole answer comes at once (it is one release, charged
    once); a second Execute of the same portal neither answers nor charges again."""
    before = spent(c)
    c.send(p.Parse("s4", DP + "browser, ANON_COUNT(*) FROM visits GROUP BY browser", ()),
           p.Bind("", "s4", (), (), ()), p.Execute("", 1), p.Execute("", 1), p.Sync())
    msgs = c.recv_until_ready()
    rows = [m for m in msgs if isinstance(m, p.DataRow)]
    assert len(rows) >= 2, msgs  # more than the limit: the released answer is not split
    after = spent(c)
    assert after.epsilon - before.epsilon == pytest.approx(0.01), (before, after)
    return errors(msgs)


PROTOCOL_CASES = {
    "unnamed statement reused for a raw read": (_reuse_unnamed_statement, ["42501"]),
    "named statement redefined": (_reuse_named_statement, ["42501"]),
    "Bind with the wrong parameter count": (_bind_wrong_parameter_count, ["08P01"]),
    "Bind with a malformed binary parameter": (_bind_binary_garbage, ["22P03"]),
    "Execute with a row limit on a DP portal": (_execute_with_row_limit, []),
}


@pytest.mark.parametrize("name", list(PROTOCOL_CASES))
def test_protocol_attack(proxy_module: Proxy, name: str) -> None:
    run, expected = PROTOCOL_CASES[name]
    c = _login(proxy_module)
    try:
        got = [e for e in run(c) if e is not None]
        assert got == expected
        c.send(p.Query("SELECT 1"))
        assert errors(c.recv_until_ready()) == []
    finally:
        c.close()
    _healthy(proxy_module, None)


_EDGES = {
    "timestamp": ["2020-01-01 10:00", "infinity", "-infinity", "4713-01-01 BC",
                  "294276-12-31 23:59:59", "4714-11-24 00:00:00 BC", "4714-11-30 23:59:59 BC"],
    "timestamptz": ["2020-01-01 10:00+00", "infinity", "-infinity", "4713-01-02 BC",
                    "294276-12-30 23:59:59+00", "4714-11-24 00:00:00+00 BC",
                    "294276-12-31 23:59:59+00"],
    "date": ["2020-01-01", "infinity", "-infinity", "5874897-12-31", "4713-01-01 BC"],
    "interval": ["1 day", "-178000000 years", "178000000 years", "1 month 3 days 10:00:01.5"],
    "time": ["10:00", "24:00", "00:00"],
    "timetz": ["10:00+02", "24:00-15:59", "00:00+15:59"],
}


_VALUES = {
    **{t: [f"'{v}'" for v in vs] for t, vs in _EDGES.items()},
    "int2": ["-32768", "32767", "-1"], "int4": ["-2147483648", "2147483647", "-1"],
    "int8": ["-9223372036854775808", "9223372036854775807", "-1", "5000000000"],
    "numeric": ["1e1000", "-1e1000", "1e-1000", "'NaN'", "'Infinity'", "'-Infinity'"],
    "float4": ["'3.4e38'", "'-3.4e38'", "'1e-45'", "'NaN'", "'-Infinity'"],
    "float8": ["'1.7e308'", "'5e-324'", "'NaN'", "'Infinity'"],
    **{t: ["''", "'x'", "'nosuch_table'", "repeat('y', 70)"]
       for t in ("text", "varchar", "bpchar", "name")},
    "char": ["'x'", "''"], "bit": ["'1'", "'0101'"], "varbit": ["''", "'1'"],
    "cidr": ["'10.0.0.0/8'", "'::/0'"], "inet": ["'10.0.0.1'", "'::1/128'"],
    "macaddr": ["'08:00:2b:01:02:03'"],
    "macaddr8": ["'08:00:2b:01:02:03:04:05'", "'08:00:2b:ff:fe:01:02:03'"],
    **{t: ["'0'", "'4294967295'"] for t in ("oid", "regclass", "regcollation", "regconfig",
                                            "regdictionary", "regnamespace", "regoper",
                                            "regoperator", "regproc", "regprocedure", "regrole",
                                            "regtype")},
}
"""Values of each type a DP query's rows may hold, its ends and oddities among them."""
_INTERNAL_TYPES = {"pg_node_tree", "pg_ndistinct", "pg_dependencies", "pg_mcv_list"}
"""The catalogs' own types, which no table of the analysts' holds."""


def test_implicit_conversions_fail_only_where_listed(backend: Backend) -> None:
    """Each implicit conversion between built-in types (pg_cast) that `FAILING_CONVERSIONS`
    lists fails on some value of its source type; every other one succeeds on every value
    of `_VALUES` (in UTC and in time zones far east and west): `check_mixes` refuses exactly
    what a row's value could make fail."""
    from dp_core.catalogue import FAILING_CONVERSIONS, STABLE_CONVERSIONS

    listed = {(s, t) for s, ts in FAILING_CONVERSIONS["choose"].items() for t in ts}
    assert {(s, t) for s, ts in FAILING_CONVERSIONS["compare"].items() for t in ts} <= listed

    async def run() -> tuple[list[str], set[tuple[str, str]], set[tuple[str, str]]]:
        conn = await asyncpg.connect(backend.admin_dsn)
        wrong, failed = [], set()
        try:
            casts = {(r[0], r[1]) for r in await conn.fetch(
                "SELECT s.typname, t.typname FROM pg_cast c JOIN pg_type s ON s.oid = "
                "c.castsource JOIN pg_type t ON t.oid = c.casttarget WHERE c.castcontext = 'i' "
                "AND c.castsource <> c.casttarget AND c.castsource < 16384 "
                "AND c.casttarget < 16384")}
            for zone in ("UTC", "Pacific/Kiritimati", "Pacific/Pago_Pago"):
                await conn.execute(f"SET TimeZone = '{zone}'")
                for source, target in sorted(casts):
                    if source in _INTERNAL_TYPES:
                        continue
                    if source not in _VALUES:
                        wrong.append(f"no values of {source} to convert to {target}")
                        continue
                    for value in _VALUES[source]:
                        try:  # (OFFSET 0: converted on the row, not folded as a constant)
                            await conn.fetchval(f'SELECT (x::"{target}")::text FROM (SELECT '
                                                f'({value})::"{source}" AS x OFFSET 0) s')
                        except asyncpg.PostgresError as e:
                            failed.add((source, target))
                            if (source, target) not in listed:
                                wrong.append(f"{zone}: {source} {value} to {target}: {e}")
        finally:
            await conn.close()
        return wrong, failed, casts

    wrong, failed, casts = asyncio.run(run())
    assert wrong == []
    assert listed <= casts  # (each an implicit conversion)
    assert listed == failed  # (each fails on some value)
    assert asyncio.run(_not_immutable(backend, listed)) == STABLE_CONVERSIONS


async def _not_immutable(backend: Backend, conversions: set[tuple[str, str]]
                         ) -> set[tuple[str, str]]:
    """Those of `conversions` whose cast function (or, binary, the next one's) is not
    immutable: Postgres does not fold them into a constant when it plans a statement."""
    conn = await asyncpg.connect(backend.admin_dsn)
    try:
        out = set()
        for source, target in conversions:
            volatile = await conn.fetchval(
                "SELECT p.provolatile::text FROM pg_cast c JOIN pg_proc p ON p.oid = c.castfunc "
                "WHERE c.castsource = $1::regtype AND c.casttarget = $2::regtype",
                _REGTYPE.get(source, source), _REGTYPE.get(target, target))
            if volatile is not None and volatile != "i":
                out.add((source, target))
        return out
    finally:
        await conn.close()


_REGTYPE = {"int8": "bigint", "float4": "real", "float8": "double precision",
            "varchar": "character varying", "timestamptz": "timestamp with time zone",
            "timestamp": "timestamp without time zone"}


def test_datetime_units_never_fail_on_any_value(backend: Backend) -> None:
    """Every (function, type, unit) that `DATETIME_UNITS` accepts, written as the analysis
    writes it (`datetime_call`), evaluates on the first, last and infinite values of the type
    without an error, in UTC and in time zones far east and west (so that whether a DP query
    fails cannot depend on a user's dates)."""
    from pglast import parse_sql
    from pglast.stream import RawStream

    from dp_core.catalogue import DATETIME_UNITS, datetime_call

    def written(function: str, unit: str) -> str:
        call = f"extract({unit} FROM x)" if function == "extract" else f"{function}('{unit}', x)"
        fc = parse_sql(f"SELECT {call}")[0].stmt.targetList[0].val
        return str(RawStream()(datetime_call(fc, fc.args[1])))

    async def run() -> list[str]:
        conn = await asyncpg.connect(backend.admin_dsn)
        failures = []
        try:
            for zone in ("UTC", "Pacific/Kiritimati", "Pacific/Pago_Pago", "America/New_York"):
                await conn.execute(f"SET TimeZone = '{zone}'")
                for (function, type_), units in sorted(DATETIME_UNITS.items()):
                    for unit in sorted(units):
                        expr = written(function, unit)
                        for value in _EDGES[type_]:
                            try:  # (OFFSET 0: evaluated on the row, not folded as a constant)
                                await conn.fetchval(f"SELECT ({expr})::text FROM (SELECT "
                                                    f"'{value}'::{type_} AS x OFFSET 0) s")
                            except asyncpg.PostgresError as e:
                                failures.append(f"{zone}: {expr} of {type_} '{value}': {e}")
        finally:
            await conn.close()
        return failures

    assert asyncio.run(run()) == []


def test_arithmetic_keeps_its_digits_bounded(backend: Backend) -> None:
    """Numeric products are exact: squaring (1 + 1e-1000) / 7 over nested subqueries doubled
    its 1000 digits at each level (to 16,383), and one user's rows, given that value by a
    CASE, took half a second more through the proxy (a timing side channel: a product's work
    grows with the square of its digits). The total form rounds every operand and result to
    MAX_SCALE decimals, within ±MAX_MAGNITUDE: at most 68 digits, whatever the nesting."""
    from pglast import parse_sql
    from pglast.stream import RawStream

    from dp_core.sqlnodes import MAX_MAGNITUDE, MAX_SCALE
    from dp_core.totality import Totalizer

    def total(sql: str) -> str:
        node = parse_sql(f"SELECT {sql}")[0].stmt.targetList[0].val
        return str(RawStream()(Totalizer(frozenset())(node, "test")))

    c = total("(1 + 1e-1000) / 7")
    for _ in range(4):  # (each level as its own subquery: the value as it comes out of one)
        c = total("x * x").replace("x", f"({c})")
    huge = total(f"{MAX_MAGNITUDE:g} / 3 + 1 / 3")

    async def run() -> list[Any]:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            return [await conn.fetchrow(f"SELECT scale(v), length(v::text) FROM (SELECT {e} "
                                        "AS v OFFSET 0) s") for e in (c, huge)]
        finally:
            await conn.close()

    for scale, length in asyncio.run(run()):
        assert scale <= MAX_SCALE and length <= len(f"{MAX_MAGNITUDE:.0f}") + 1 + MAX_SCALE + 1
