"""Backend isolation (issue 27): what Postgres cannot take away from a role is refused (42501)
wherever a statement has it, and the unparsed fast path never forwards it.

Statistics and activity, relation sizes, signals to sessions, large objects, notification
channels, role switches, the role's own settings and code made in the database; pg_stats, the
catalogs and what psql and BI tools read stay pass-through. Pure classifier tests.
"""

from __future__ import annotations

import pytest

from dp_core import reach
from dp_core.classify import Classifier, StatementKind
from tests.support.paths import FIXTURES

K = StatementKind


def assert_refused(c: Classifier, sql: str) -> None:
    """Never forwarded unparsed, and one of its statements refused by the isolation rules."""
    assert not c.is_plain_pass_through(sql)
    assert not c.is_plain_pass_through_bytes(sql.encode())
    refusals = [s.refusal for s in c.classify(sql) if s.kind is K.REFUSED]
    assert any(r is not None and r.sqlstate == "42501" and "through dp-proxy" in r.message
               for r in refusals), [(s.kind, s.refusal) for s in c.classify(sql)]


# psql 16's \l+ and \dt+ (the sizes they show are refused now: a trade-off, see below)
PSQL_L_PLUS = (
    "SELECT d.datname as \"Name\", pg_catalog.pg_get_userbyid(d.datdba) as \"Owner\", "
    "CASE WHEN pg_catalog.has_database_privilege(d.datname, 'CONNECT') THEN "
    "pg_catalog.pg_size_pretty(pg_catalog.pg_database_size(d.datname)) ELSE 'No Access' END "
    "as \"Size\" FROM pg_catalog.pg_database d ORDER BY 1;")
PSQL_DT_PLUS = (
    "SELECT n.nspname as \"Schema\", c.relname as \"Name\", "
    "pg_catalog.pg_size_pretty(pg_catalog.pg_table_size(c.oid)) as \"Size\" "
    "FROM pg_catalog.pg_class c LEFT JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
    "WHERE c.relkind IN ('r','p','') AND pg_catalog.pg_table_is_visible(c.oid) ORDER BY 1,2;")

REFUSED = [
    # SQL the server runs from text, hidden from the checks
    "SELECT query_to_xml('SELECT pg_relation_size(''visits'')', true, false, '')",
    "SELECT * FROM pg_catalog.QUERY_TO_XMLSCHEMA('SELECT 1', true, false, '')",
    "SELECT x FROM countries, LATERAL query_to_xml_and_xmlschema('SELECT 1', true, true, '') x",
    "SELECT * FROM ts_stat('SELECT to_tsvector(name) FROM countries')",
    "SELECT ts_rewrite('a & b'::tsquery, 'SELECT ''a''::tsquery, ''c''::tsquery')",
    # statistics and activity views, in any spelling
    "SELECT * FROM pg_stat_activity",
    'SELECT query FROM "pg_stat_activity" WHERE pid <> pg_backend_pid()',
    "select relname, n_live_tup from PG_CATALOG.PG_STAT_USER_TABLES",
    "SELECT * FROM pg_catalog.pg_stat_all_indexes",
    "SELECT heap_blks_read FROM pg_statio_user_tables WHERE relname = 'visits'",
    "SELECT calls, rows, query FROM public.pg_stat_statements",
    "SELECT * FROM pg_stat_progress_vacuum",
    "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    "SELECT n_tup_ins FROM pg_stat_xact_user_tables",
    "SELECT * FROM pg_locks",
    "SELECT gid FROM pg_catalog.pg_prepared_xacts",
    "SELECT loid, pageno FROM pg_largeobject",
    "SELECT oid, lomowner FROM pg_largeobject_metadata",
    "SELECT * FROM pg_backend_memory_contexts",
    "TABLE pg_stat_activity",
    'SELECT * FROM U&"pg_stat_\\0061ctivity"',
    # ... nested anywhere
    "SELECT * FROM countries WHERE code IN (SELECT application_name FROM pg_stat_activity)",
    "WITH a AS (SELECT * FROM pg_stat_activity) SELECT count(*) FROM a",
    "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r, pg_locks WHERE n < 2) "
    "SELECT * FROM r",
    "SELECT c.code, s.n FROM countries c, LATERAL (SELECT count(*) AS n FROM pg_locks "
    "WHERE pid = length(c.code)) s",
    "SELECT coalesce((SELECT max(n_tup_ins) FROM pg_stat_user_tables), 0)",
    "SELECT EXISTS (SELECT 1 FROM pg_stat_user_tables WHERE relname = 'visits' AND n_live_tup > 9)",
    "SELECT * FROM countries UNION ALL SELECT query, NULL, NULL FROM pg_stat_activity",
    "EXPLAIN SELECT * FROM pg_stat_activity",
    "EXPLAIN (ANALYZE, BUFFERS) SELECT * FROM pg_stat_user_tables",
    "DECLARE c CURSOR FOR SELECT query FROM pg_stat_activity",
    "COPY (SELECT * FROM pg_stat_activity) TO STDOUT",
    "COPY pg_stat_user_tables TO STDOUT",
    "PREPARE p AS SELECT * FROM pg_stat_activity WHERE pid = $1",
    "CREATE TEMP VIEW v AS SELECT * FROM pg_stat_activity",
    "CREATE TEMP TABLE t AS SELECT * FROM pg_stat_user_tables",
    "INSERT INTO countries (code) SELECT left(query, 2) FROM pg_stat_activity",
    "SELECT 1; SELECT * FROM pg_stat_activity",
    # ... and in DP queries and schema probes of protected tables
    "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits WHERE browser IN "
    "(SELECT query FROM pg_stat_activity)",
    "SELECT browser, COUNT(*) FROM visits WHERE duration < (SELECT n_live_tup FROM "
    "pg_stat_user_tables LIMIT 1) GROUP BY browser",
    "SELECT *, pg_relation_size('visits') FROM visits LIMIT 0",
    # statistics functions, also in FROM and qualified
    "SELECT pg_stat_get_numscans('countries'::regclass)",
    "SELECT pg_catalog.pg_stat_get_tuples_returned('visits'::regclass)",
    "SELECT * FROM pg_stat_get_activity(NULL)",
    "SELECT * FROM ROWS FROM (PG_CATALOG.PG_STAT_GET_ACTIVITY(NULL)) a",
    'SELECT "pg_stat_get_live_tuples"(16385)',
    "SELECT pg_stat_clear_snapshot()",
    "SELECT pg_stat_reset()",
    "SELECT * FROM pg_stat_statements(true)",
    "SELECT * FROM pg_lock_status()",
    # sizes
    "SELECT pg_relation_size('visits')",
    "SELECT pg_size_pretty(pg_total_relation_size('public.visits'))",
    "SELECT pg_table_size('visits'), pg_indexes_size('visits')",
    "SELECT pg_database_size(current_database())",
    "SELECT pg_tablespace_size('pg_default')",
    PSQL_L_PLUS,
    PSQL_DT_PLUS,
    # signals and other sessions
    "SELECT pg_cancel_backend(pid) FROM generate_series(1, 10) pid",
    "SELECT pg_terminate_backend(12345)",
    "SELECT pg_blocking_pids(pg_backend_pid())",
    "SELECT pg_safe_snapshot_blocking_pids(1)",
    "SELECT pg_log_backend_memory_contexts(1)",
    # large objects
    "SELECT lo_create(0)",
    "SELECT lo_creat(-1)",
    "SELECT lo_import('/etc/passwd')",
    "SELECT lo_export(16385, '/tmp/x')",
    "SELECT encode(lo_get(16385), 'hex')",
    "SELECT lo_put(16385, 0, '\\x00')",
    "SELECT lo_from_bytea(0, 'secret')",
    "SELECT lo_unlink(16385)",
    "BEGIN; SELECT loread(lo_open(16385, 262144), 100)",
    "SELECT lowrite(0, 'x')",
    "SELECT lo_truncate(0, 1), lo_truncate64(0, 10), lo_lseek(0, 0, 0), lo_lseek64(0, 0, 0)",
    "SELECT LO_TELL(0), Lo_Tell64(0), lo_close(0)",
    "SELECT myschema.lo_open(1, 2)",  # another schema's: refused too (fail closed)
    "ALTER LARGE OBJECT 16385 OWNER TO someone",
    "GRANT SELECT ON LARGE OBJECT 16385 TO PUBLIC",
    "REVOKE ALL ON LARGE OBJECT 16385 FROM PUBLIC",
    "COMMENT ON LARGE OBJECT 16385 IS 'hello'",
    "ALTER DEFAULT PRIVILEGES GRANT SELECT ON LARGE OBJECTS TO PUBLIC",
    # transaction and WAL positions
    "SELECT txid_current()",
    "SELECT txid_current_if_assigned(), txid_current_snapshot()",
    "SELECT pg_current_xact_id()",
    "SELECT pg_current_xact_id_if_assigned()",
    "SELECT pg_snapshot_xmax(pg_current_snapshot())",
    "SELECT pg_current_wal_lsn(), pg_current_wal_insert_lsn(), pg_current_wal_flush_lsn()",
    "SELECT * FROM pg_last_committed_xact()",
    # what the catalogs show every session of another's temporary objects
    "CREATE TEMP VIEW v AS SELECT name FROM countries WHERE region = 'Africa'",
    "CREATE VIEW pg_temp.v AS SELECT 1",
    "COMMENT ON TABLE t IS 'target: user 4711'",
    "CREATE INDEX ON t (n) WHERE n > 1234",
    "ANALYZE t", "ANALYSE t", "VACUUM t", "VACUUM (ANALYZE) t", "CLUSTER t USING i",
    "REINDEX TABLE t",
    "CREATE STATISTICS s ON a, b FROM t",
    "SELECT txid_status(780), pg_xact_status('780')",  # (another session's transaction state)
    "SELECT next_xid FROM pg_control_checkpoint()",
    "SELECT * FROM pg_control_system(), pg_control_init(), pg_control_recovery()",
    # advisory locks: shared by every session (the proxy's ledger migration takes one)
    "SELECT pg_advisory_lock(hashtext('dp-proxy ledger migration'))",
    "SELECT pg_try_advisory_lock(1, 2), pg_advisory_lock_shared(1)",
    "BEGIN; SELECT pg_advisory_xact_lock(7)",
    "SELECT pg_catalog.pg_try_advisory_xact_lock_shared(7)",
    "SELECT code FROM countries WHERE pg_try_advisory_xact_lock(length(code))",
    # refused functions in every clause
    "SELECT code FROM countries ORDER BY pg_relation_size('visits')",
    "SELECT code FROM countries GROUP BY code HAVING count(*) > pg_stat_get_numscans(1)",
    "SELECT code FROM countries WHERE length(code) < txid_current()",
    "SELECT count(*) FILTER (WHERE txid_current() > 0) FROM countries",
    "SELECT row_number() OVER (ORDER BY pg_current_wal_lsn()) FROM countries",
    "SELECT CASE WHEN true THEN lo_get(1) END",
    "SELECT ARRAY[pg_database_size('x')]",
    "VALUES (pg_stat_get_db_xact_commit(1))",
    "SELECT upper(lower(pg_stat_get_backend_activity(1)))",
    "SELECT * FROM countries LIMIT pg_stat_get_numscans(1)",
    "UPDATE countries SET name = pg_stat_get_backend_activity(1) WHERE false",
    "DELETE FROM countries WHERE code = pg_stat_get_backend_activity(1)",
    "CREATE TEMP TABLE t (x bigint DEFAULT txid_current())",
    "SELECT * FROM dp_budget() WHERE pg_stat_get_numscans(1) > 0",
    # code made in the database
    "CREATE FUNCTION f() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    "CREATE OR REPLACE FUNCTION pg_temp.f() RETURNS int AS $$ SELECT 1 $$ LANGUAGE sql",
    "create procedure p() language plpgsql as $$ begin end $$",
    "ALTER FUNCTION f() SECURITY DEFINER",
    "ALTER PROCEDURE p() SET search_path = public",
    "ALTER ROUTINE f() IMMUTABLE",
    "CREATE TRIGGER t BEFORE UPDATE ON countries FOR EACH ROW "
    "EXECUTE FUNCTION suppress_redundant_updates_trigger()",
    "CREATE CONSTRAINT TRIGGER t AFTER INSERT ON countries FOR EACH ROW EXECUTE PROCEDURE f()",
    "CREATE EVENT TRIGGER e ON ddl_command_start EXECUTE FUNCTION f()",
    "CREATE RULE r AS ON INSERT TO countries DO INSTEAD NOTHING",
    "CREATE AGGREGATE pg_temp.mysum (int) (SFUNC = int4pl, STYPE = int)",
    "CREATE OPERATOR pg_temp.=== (FUNCTION = int4eq, LEFTARG = int, RIGHTARG = int)",
    "CREATE OPERATOR CLASS c FOR TYPE int USING btree AS STORAGE int",
    "CREATE OPERATOR FAMILY f USING btree",
    "ALTER OPERATOR FAMILY f USING btree ADD FUNCTION 1 (int, int) btint4cmp(int, int)",
    "ALTER OPERATOR === (int, int) SET (RESTRICT = eqsel)",
    "CREATE CAST (int AS text) WITH INOUT",
    "CREATE CAST (int AS text) WITHOUT FUNCTION",
    "CREATE LANGUAGE plsample HANDLER plsample_call_handler",
    "CREATE TRUSTED LANGUAGE plperl",
    "CREATE EXTENSION IF NOT EXISTS hstore",
    "CREATE TRANSFORM FOR int LANGUAGE sql (FROM SQL WITH FUNCTION f(internal))",
    "CREATE SCHEMA s CREATE TRIGGER t AFTER INSERT ON x FOR EACH ROW EXECUTE FUNCTION f()",
    "DO $$ BEGIN PERFORM 1; END $$",
    "CALL p()",
    # role switches and the role's own settings
    "SET ROLE dp_pushdown",
    "SET LOCAL ROLE postgres",
    'SET "ROLE" TO postgres',
    "SET SESSION AUTHORIZATION postgres",
    "SET session_authorization = 'postgres'",
    "SELECT set_config('role', 'dp_pushdown', false)",
    "SELECT set_config('SESSION_AUTHORIZATION', 'postgres', true)",
    "ALTER ROLE CURRENT_USER SET statement_timeout = 1",
    "ALTER USER CURRENT_USER PASSWORD 'x'",
    # Citus: shard sizes (a shard holds ~1/32 of the users) and every node's activity
    "SELECT citus_table_size('visits')",
    "SELECT pg_catalog.citus_total_relation_size('visits'::regclass)",
    "SELECT shard_size FROM citus_shards WHERE table_name = 'visits'::regclass",
    "SELECT table_size FROM citus_tables",
    "SELECT * FROM citus_shard_sizes()",
    "SELECT get_shard_id_for_distribution_column('visits', 42)",
    "SELECT shardid, shardlength FROM pg_dist_placement",
    "SELECT query FROM citus_stat_statements",
    "SELECT * FROM citus_stat_activity",
    "SELECT * FROM citus_dist_stat_activity",
    "SELECT * FROM citus_lock_waits",
    # notification channels
    "LISTEN ch",
    "NOTIFY \"ch\", 'payload'",
    "BEGIN; NOTIFY ch; COMMIT",
    "SELECT pg_notify('ch', 'hello')",
    "SELECT Pg_Catalog.PG_NOTIFY('ch', code) FROM countries",
]

PSQL_DT = (
    'SELECT n.nspname as "Schema",\n  c.relname as "Name",\n  CASE c.relkind WHEN \'r\' THEN '
    "'table' WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view' WHEN 'i' THEN 'index' WHEN "
    "'S' THEN 'sequence' WHEN 't' THEN 'TOAST table' WHEN 'f' THEN 'foreign table' WHEN 'p' THEN "
    "'partitioned table' WHEN 'I' THEN 'partitioned index' END as \"Type\",\n  "
    'pg_catalog.pg_get_userbyid(c.relowner) as "Owner"\nFROM pg_catalog.pg_class c\n     LEFT '
    "JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace\n     LEFT JOIN pg_catalog.pg_am am "
    "ON am.oid = c.relam\nWHERE c.relkind IN ('r','p','')\n      AND n.nspname <> 'pg_catalog'\n"
    "      AND n.nspname !~ '^pg_toast'\n      AND n.nspname <> 'information_schema'\n  AND "
    "pg_catalog.pg_table_is_visible(c.oid)\nORDER BY 1,2;")
PSQL_D_LOOKUP = (
    "SELECT c.oid,\n  n.nspname,\n  c.relname\nFROM pg_catalog.pg_class c\n     LEFT JOIN "
    "pg_catalog.pg_namespace n ON n.oid = c.relnamespace\nWHERE c.relname OPERATOR(pg_catalog.~) "
    "'^(visits)$' COLLATE pg_catalog.default\n  AND pg_catalog.pg_table_is_visible(c.oid)\n"
    "ORDER BY 2, 3;")
PSQL_D_STATISTICS = (
    "SELECT oid, stxrelid::pg_catalog.regclass, stxnamespace::pg_catalog.regnamespace::"
    "pg_catalog.text AS nsp, stxname,\npg_catalog.pg_get_statisticsobjdef_columns(oid) AS columns,"
    "\n  'd' = any(stxkind) AS ndist_enabled,\n  'f' = any(stxkind) AS deps_enabled,\n  'm' = "
    "any(stxkind) AS mcv_enabled,\nstxstattarget\nFROM pg_catalog.pg_statistic_ext\nWHERE "
    "stxrelid = '16385'\nORDER BY nsp, stxname;")
PSQL_D_TRIGGERS = (
    "SELECT t.tgname, pg_catalog.pg_get_triggerdef(t.oid, true), t.tgenabled, t.tgisinternal,\n"
    "  CASE WHEN t.tgparentid != 0 THEN\n    (SELECT u.tgrelid::pg_catalog.regclass\n     FROM "
    "pg_catalog.pg_trigger AS u,\n          pg_catalog.pg_partition_ancestors(t.tgrelid) WITH "
    "ORDINALITY AS a(relid, depth)\n     WHERE u.tgname = t.tgname AND u.tgrelid = a.relid\n"
    "           AND u.tgparentid = 0\n     ORDER BY a.depth LIMIT 1)\n  END AS parent\nFROM "
    "pg_catalog.pg_trigger t\nWHERE t.tgrelid = '16385' AND (NOT t.tgisinternal OR "
    "(t.tgisinternal AND t.tgenabled = 'D')\n    OR EXISTS (SELECT 1 FROM pg_catalog.pg_depend "
    "WHERE objid = t.oid\n        AND refclassid = 'pg_catalog.pg_trigger'::pg_catalog.regclass))"
    "\nORDER BY 1;")
PSQL_D_POLICIES = (
    "SELECT pol.polname, pol.polpermissive,\n  CASE WHEN pol.polroles = '{0}' THEN NULL ELSE "
    "pg_catalog.array_to_string(array(select rolname from pg_catalog.pg_roles where oid = any "
    "(pol.polroles) order by 1),',') END,\n  pg_catalog.pg_get_expr(pol.polqual, pol.polrelid),\n"
    "  pg_catalog.pg_get_expr(pol.polwithcheck, pol.polrelid),\n  CASE pol.polcmd\n    WHEN 'r' "
    "THEN 'SELECT'\n    WHEN 'a' THEN 'INSERT'\n    WHEN 'w' THEN 'UPDATE'\n    WHEN 'd' THEN "
    "'DELETE'\n    END AS cmd\nFROM pg_catalog.pg_policy pol\nWHERE pol.polrelid = '16385' "
    "ORDER BY 1;")
PSQL_DF = (
    'SELECT n.nspname as "Schema",\n  p.proname as "Name",\n  pg_catalog.pg_get_function_result'
    '(p.oid) as "Result data type",\n  pg_catalog.pg_get_function_arguments(p.oid) as "Argument '
    "data types\",\n CASE p.prokind\n  WHEN 'a' THEN 'agg'\n  WHEN 'w' THEN 'window'\n  WHEN 'p' "
    "THEN 'proc'\n  ELSE 'func'\n END as \"Type\"\nFROM pg_catalog.pg_proc p\n     LEFT JOIN "
    "pg_catalog.pg_namespace n ON n.oid = p.pronamespace\nWHERE pg_catalog.pg_function_is_visible"
    "(p.oid)\n      AND n.nspname <> 'pg_catalog'\n      AND n.nspname <> 'information_schema'\n"
    "ORDER BY 1, 2, 4;")
PSQL_L = (
    'SELECT\n  d.datname as "Name",\n  pg_catalog.pg_get_userbyid(d.datdba) as "Owner",\n  '
    'pg_catalog.pg_encoding_to_char(d.encoding) as "Encoding",\n  CASE d.datlocprovider WHEN '
    "'c' THEN 'libc' WHEN 'i' THEN 'icu' END AS \"Locale Provider\",\n  d.datcollate as "
    '"Collate",\n  d.datctype as "Ctype",\n  d.daticulocale as "ICU Locale",\n  NULL as "ICU '
    "Rules\",\n  pg_catalog.array_to_string(d.datacl, E'\\n') AS \"Access privileges\"\nFROM "
    "pg_catalog.pg_database d\nORDER BY 1;")
METABASE_PRIVILEGES = (FIXTURES / "metabase_privileges.sql").read_text()

ALLOWED = [
    "SELECT * FROM pg_stats WHERE tablename='countries'",
    "SELECT histogram_bounds::text::text[] FROM pg_catalog.pg_stats WHERE tablename = $1",
    "SELECT * FROM pg_stats_ext",
    "SELECT * FROM pg_statistic_ext",
    "SELECT pg_column_size('abc')",
    "SELECT pg_size_pretty(1024::bigint)",
    "SELECT pg_size_bytes('1 MB')",
    "SELECT pg_backend_pid()",
    "SELECT * FROM pg_class",
    "CREATE TEMP TABLE t(x int)",
    "CREATE TEMP TABLE s (id serial PRIMARY KEY, note text DEFAULT 'x')",
    "CREATE TEMP SEQUENCE q",
    "UNLISTEN *",
    "SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL;",  # asyncpg's reset
    "SELECT pg_advisory_unlock(1), pg_advisory_unlock_shared(1)",  # (one's own locks only)
    "SELECT pg_snapshot_xmin('10:20:10,14,15'::pg_snapshot)",  # (of the values given)
    "SET search_path TO public",
    "SELECT 'pg_stat_activity'",
    "SELECT 'pg_stat_activity'::regclass, has_table_privilege('pg_locks', 'SELECT')",
    "SELECT 1 AS lo_x",
    "SELECT * FROM lo_table",
    "SELECT CAST(code AS varchar(3)), broadcast FROM (SELECT code, 1 AS broadcast FROM countries) c",
    "RESET ROLE",
    "SET SESSION AUTHORIZATION DEFAULT",
    "SET role TO DEFAULT",
    "SHOW role",
    "SELECT current_role, session_user, current_user",
    "SELECT set_config('search_path', 'public', false)",
    "SELECT * FROM information_schema.routines WHERE routine_schema = 'public'",
    "SELECT proname, prokind FROM pg_proc WHERE proname = 'lo_open'",
    "DROP FUNCTION IF EXISTS pg_temp.f()",
    "CREATE TEMP TABLE language (code text, \"function\" text, operator text, rule text)",
    "DISCARD ALL",
    PSQL_L, PSQL_DT, PSQL_D_LOOKUP, PSQL_D_STATISTICS, PSQL_D_TRIGGERS, PSQL_D_POLICIES, PSQL_DF,
    METABASE_PRIVILEGES,
]


@pytest.mark.parametrize("sql", REFUSED)
def test_refused(classifier: Classifier, sql: str) -> None:
    assert_refused(classifier, sql)


@pytest.mark.parametrize("sql", ALLOWED)
def test_still_pass_through(classifier: Classifier, sql: str) -> None:
    stmts = classifier.classify(sql)
    assert stmts and all(s.kind is K.PASS_THROUGH and s.refusal is None for s in stmts), \
        [(s.kind, s.refusal) for s in stmts]


# every name of the tables, in every place a call or read can be, in any case
_FUNCTIONS = [*sorted(reach._ISOLATION_FUNCTIONS), "pg_stat_get_xact_blocks_hit",
              "pg_stat_reset_shared", "lo_truncate64", "lo_tell64", "lo_open"]
_RELATIONS = [*sorted(reach._ISOLATION_RELATIONS), "pg_stat_replication",
              "pg_statio_all_sequences", "pg_stat_wal", "pg_stat_io"]
_PLACES = [
    "SELECT {}", "SELECT * FROM countries WHERE code = {}", "SELECT * FROM {} AS f",
    "WITH w AS (SELECT {} AS x) SELECT x FROM w", "EXPLAIN SELECT {}",
    "DECLARE c CURSOR FOR SELECT {}", "COPY (SELECT {}) TO STDOUT", "PREPARE p AS SELECT {}",
    "CREATE TEMP VIEW v AS SELECT {}", "SELECT count(*) FROM countries GROUP BY code HAVING {}",
    "SELECT 1; SELECT coalesce({}, 0)",
]


@pytest.mark.parametrize("name", _FUNCTIONS)
def test_every_refused_function_anywhere(classifier: Classifier, name: str) -> None:
    for spelling in (name, name.upper(), f"pg_catalog.{name}", f'"{name}"'):
        for place in _PLACES:
            assert_refused(classifier, place.format(f"{spelling}('a', 'b')"))


@pytest.mark.parametrize("name", _RELATIONS)
def test_every_refused_relation_anywhere(classifier: Classifier, name: str) -> None:
    for spelling in (name, name.upper(), f"pg_catalog.{name}", f'"{name}"'):
        for place in _PLACES:
            assert_refused(classifier, place.format(f"(SELECT count(*) FROM {spelling})"))


def test_every_refused_statement_type_has_a_case(classifier: Classifier) -> None:
    refused = {s.node_type for sql in REFUSED for s in classifier.classify(sql)
               if s.kind is K.REFUSED}
    assert {*reach._OPAQUE_CODE, *reach._SHARED_STATEMENTS, "DefineStmt",
            "VariableSetStmt", "GrantStmt", "AlterOwnerStmt", "CommentStmt"} <= refused


def test_messages_say_what_and_why(classifier: Classifier) -> None:
    def refusal(sql: str) -> tuple[str, str | None]:
        (st,) = classifier.classify(sql)
        assert st.kind is K.REFUSED and st.refusal is not None and st.refusal.sqlstate == "42501"
        return st.refusal.message, st.refusal.hint

    assert refusal("SELECT * FROM pg_stat_user_tables") == (
        "pg_stat_user_tables is not available through dp-proxy: statistics and activity views "
        "reveal what other analysts' queries read",
        "column statistics are in pg_stats; a DP query counts a protected table's rows")
    message, hint = refusal("SELECT pg_relation_size('visits')")
    assert message.startswith("pg_relation_size() is not available through dp-proxy: ")
    assert hint is not None and "pg_size_pretty" in hint
    assert refusal("SELECT lo_get(1)")[0].startswith("lo_get() is not available")
    assert refusal("CREATE FUNCTION f() RETURNS int LANGUAGE sql AS 'SELECT 1'")[0] == (
        "functions and procedures (CREATE FUNCTION, CREATE PROCEDURE) are not allowed through "
        "dp-proxy: the code they run is hidden from its checks")
    assert refusal("DO $$ $$")[0] == ("DO blocks are not allowed through dp-proxy: the code "
                                      "they run is hidden from its checks")
    assert refusal("LISTEN ch")[0].startswith("LISTEN is not allowed through dp-proxy: "
                                              "notification channels are shared")
    assert refusal("SET ROLE x")[0].startswith("SET ROLE is not allowed through dp-proxy")
    assert refusal("SELECT set_config('role', 'x', false)")[0].startswith(
        "set_config('role', ...) is not allowed")
    assert refusal("GRANT SELECT ON LARGE OBJECT 1 TO PUBLIC")[0].startswith(
        "large objects are not available through dp-proxy")


def test_a_refused_statement_among_others(classifier: Classifier) -> None:
    stmts = classifier.classify("SELECT 1; LISTEN ch; SELECT pg_backend_pid()")
    assert [s.kind for s in stmts] == [K.PASS_THROUGH, K.REFUSED, K.PASS_THROUGH]


def test_a_dp_query_is_refused_before_the_engine(classifier: Classifier) -> None:
    """Not only pass-through: a DP query reading statistics is refused here, 42501."""
    (st,) = classifier.classify("SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits "
                                "WHERE duration > pg_stat_get_numscans(1)")
    assert st.kind is K.REFUSED and st.refusal is not None and st.refusal.sqlstate == "42501"


@pytest.mark.parametrize("word", reach.REACH_WORDS)
def test_every_word_reaches_the_parser(classifier: Classifier, word: str) -> None:
    for text in (f"SELECT x{word}y FROM t", f"select {word.upper()}"):
        assert not classifier.is_plain_pass_through(text)
        assert not classifier.is_plain_pass_through_bytes(text.encode())
