"""Statement routing (fail closed), the DP clause front end, and session DP settings."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dp_core.classify import (
    _SESSION_WORDS,
    Classifier,
    Effect,
    ProtectionPolicy,
    StatementKind,
)
from dp_core.errors import InvalidParameterValue, SyntaxError_, UndefinedObject
from dp_core.reach import REACH_WORDS
from dp_core.setting_changes import SettingChanges
from dp_core.settings import Caps, DPSettings, check_finite_normal, validate
from dp_core.syntax import strip_dp_clauses

K = StatementKind


def kinds(c: Classifier, sql: str) -> list[StatementKind]:
    return [s.kind for s in c.classify(sql)]


@pytest.mark.parametrize(
    ("sql", "kind"),
    [
        # pass-through: catalog, unprotected tables, session statements
        ("SELECT * FROM countries", K.PASS_THROUGH),
        ("SELECT relname FROM pg_class WHERE relname = 'visits'", K.PASS_THROUGH),
        ("SELECT * FROM information_schema.columns WHERE table_name = 'visits'", K.PASS_THROUGH),
        ("SHOW search_path", K.PASS_THROUGH),
        ("SET search_path = public", K.PASS_THROUGH),
        ("BEGIN", K.PASS_THROUGH),
        ("COMMIT", K.PASS_THROUGH),
        ("SELECT 'visits'", K.PASS_THROUGH),
        ("SELECT * FROM other.visits", K.PASS_THROUGH),
        ("SELECT * FROM public.events", K.PASS_THROUGH),
        ("INSERT INTO countries VALUES ('x', 'y', 'z')", K.PASS_THROUGH),
        ("SELECT TRUE FROM visits WHERE 1 <> 1 LIMIT 0", K.PASS_THROUGH),
        # proxy-local
        ("SET dp.epsilon = 0.5", K.LOCAL_SET),
        ("RESET dp.epsilon", K.LOCAL_SET),
        ("SHOW dp.delta", K.LOCAL_SHOW),
        ("SELECT * FROM dp_budget()", K.LOCAL_FUNCTION),
        ("SELECT dp_reset_budget('alice')", K.LOCAL_FUNCTION),
        ("SELECT * FROM dp_ledger('bob')", K.LOCAL_FUNCTION),
        # DP forms
        ("SELECT WITH ANONYMIZATION browser, ANON_COUNT(*) FROM visits GROUP BY browser", K.DP_QUERY),
        ("select with differential_privacy options(epsilon=1) anon_count(*) from visits", K.DP_QUERY),
        ("SELECT browser, COUNT(*) FROM visits GROUP BY browser", K.DP_QUERY),
        ("SELECT avg(duration) FROM visits", K.DP_QUERY),
        ("EXPLAIN SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits", K.DP_EXPLAIN),
        ("EXPLAIN SELECT count(*) FROM visits", K.DP_EXPLAIN),
        # refused: raw reads in disguises, writes, DDL, COPY, cursors, PREPARE
        ("SELECT * FROM visits", K.REFUSED),
        ("SELECT uid FROM public.visits v WHERE v.duration > 10", K.REFUSED),
        ("TABLE visits", K.REFUSED),
        ("SELECT * FROM app.events", K.REFUSED),
        ("WITH x AS (SELECT * FROM visits) SELECT * FROM x", K.REFUSED),
        ("SELECT (SELECT max(uid) FROM visits) FROM countries", K.REFUSED),
        ("SELECT * FROM countries WHERE code IN (SELECT country FROM visits)", K.REFUSED),
        ("SELECT * FROM countries c, LATERAL (SELECT * FROM visits v WHERE v.country = c.code) s",
         K.REFUSED),
        ("SELECT uid FROM visits UNION SELECT 1", K.REFUSED),
        ("COPY visits TO STDOUT", K.REFUSED),
        ("COPY (SELECT * FROM visits) TO STDOUT", K.REFUSED),
        ("DECLARE c CURSOR FOR SELECT * FROM visits", K.REFUSED),
        ("PREPARE p AS SELECT * FROM visits", K.REFUSED),
        ("PREPARE p AS SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits", K.REFUSED),
        ("CREATE VIEW v AS SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits", K.REFUSED),
        ("DELETE FROM visits", K.REFUSED),
        ("UPDATE visits SET duration = 0", K.REFUSED),
        ("INSERT INTO visits VALUES (1, 'x', 'y', 1)", K.REFUSED),
        ("CREATE TABLE copy AS SELECT * FROM visits", K.REFUSED),
        ("CREATE VIEW v AS SELECT * FROM visits", K.REFUSED),
        ("ALTER TABLE visits DISABLE ROW LEVEL SECURITY", K.REFUSED),
        ("EXPLAIN ANALYZE SELECT count(*) FROM visits", K.REFUSED),
        ("EXPLAIN SELECT * FROM visits", K.REFUSED),
        ("SELECT * FROM visits LIMIT 1", K.REFUSED),
        ("SELECT * FROM pg_temp.visits", K.REFUSED),
        ("EXPLAIN ANALYZE SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits", K.REFUSED),
    ],
)
def test_classification(classifier: Classifier, sql: str, kind: StatementKind) -> None:
    assert kinds(classifier, sql) == [kind]


def test_refusal_names_the_tables_and_what_is_allowed(classifier: Classifier) -> None:
    (st,) = classifier.classify("SELECT * FROM visits v JOIN purchases p USING (uid)")
    assert st.refusal is not None and st.refusal.sqlstate == "42501"
    assert st.refusal.message.startswith("tables purchases, visits are protected")
    assert "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM purchases" in (st.refusal.hint or "")


def test_a_dp_query_inside_other_statements_is_refused(classifier: Classifier) -> None:
    """A DP answer goes to the client only: PREPARE (use Parse), CREATE TABLE AS, INSERT
    ... SELECT get 42501 as DESIGN §1.4 says, naming the statement."""
    for sql, name in [("PREPARE p AS ", "PREPARE"), ("CREATE TABLE t AS ", "CREATE TABLE AS"),
                      ("INSERT INTO countries (code) ", "INSERT")]:
        (st,) = classifier.classify(sql + "SELECT WITH ANONYMIZATION browser FROM visits "
                                          "GROUP BY browser")
        assert st.refusal is not None and st.refusal.sqlstate == "42501"
        assert f"not used in {name}:" in st.refusal.message
        assert "extended protocol" in (st.refusal.hint or "")


def test_multi_statement_split_keeps_text(classifier: Classifier) -> None:
    stmts = classifier.classify("SET TIMEZONE TO 'UTC'; SELECT 42; SELECT WITH ANONYMIZATION "
                                "OPTIONS(epsilon=0.5) ANON_COUNT(*) FROM visits;  SHOW dp.epsilon")
    assert [s.kind for s in stmts] == [K.PASS_THROUGH, K.PASS_THROUGH, K.DP_QUERY, K.LOCAL_SHOW]
    assert [s.sql for s in stmts[:2]] == ["SET TIMEZONE TO 'UTC'", "SELECT 42"]
    assert stmts[2].sql.startswith("SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.5)")
    assert stmts[2].dp_clause is not None and stmts[2].dp_clause.option("epsilon") == 0.5
    assert stmts[3].setting == "dp.epsilon"


def test_empty_query(classifier: Classifier) -> None:
    assert kinds(classifier, "") == [K.EMPTY]
    assert kinds(classifier, " ; -- nothing") == [K.EMPTY]


def test_syntax_error_is_42601(classifier: Classifier) -> None:
    with pytest.raises(SyntaxError_) as exc:
        classifier.classify("SELEC 1")
    assert exc.value.sqlstate == "42601"
    assert 'syntax error at or near "SELEC"' in exc.value.message


def test_classification_is_cached(classifier: Classifier) -> None:
    a = classifier.classify("SELECT 1 AS cached")
    assert classifier.classify("SELECT 1 AS cached") is a


def test_dp_clause_is_never_found_in_strings_or_comments() -> None:
    sql = ("SELECT 'SELECT WITH ANONYMIZATION' /* SELECT WITH ANONYMIZATION */, "
           '"WITH ANONYMIZATION" -- SELECT WITH ANONYMIZATION\nFROM t')
    assert strip_dp_clauses(sql) == (sql, ())


def test_dp_clause_is_blanked_in_place() -> None:
    sql = "SELECT WITH ANONYMIZATION OPTIONS(epsilon = 0.5, delta=1e-7, noise='gaussian', " \
          "max_groups_contributed=3) x, ANON_COUNT(*) FROM visits GROUP BY x"
    stripped, (clause,) = strip_dp_clauses(sql)
    assert len(stripped.encode()) == len(sql.encode())
    assert stripped.split() == ["SELECT", "x,", "ANON_COUNT(*)", "FROM", "visits", "GROUP", "BY", "x"]
    assert dict(clause.options) == {"epsilon": 0.5, "delta": 1e-7, "noise": "gaussian",
                                    "max_groups_contributed": 3}
    assert clause.select_offset == 0


def test_dp_clause_offsets_survive_multibyte_text() -> None:
    sql = "SELECT 'é€' AS x; SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits"
    stripped, (clause,) = strip_dp_clauses(sql)
    raw = sql.encode()
    assert raw[clause.select_offset:clause.select_offset + 6] == b"SELECT"
    assert clause.select_offset == raw.index(b"SELECT WITH")
    assert stripped.startswith("SELECT 'é€' AS x;")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("OPTIONS(epsilon=1", r"expected ',' or '\)'"),
        ("OPTIONS(epsilon 1)", "expected '='"),
        ("OPTIONS(bogus=1)", "unknown option 'bogus'"),
        ("OPTIONS(epsilon=1, epsilon=2)", "given twice"),
        ("OPTIONS(epsilon=(1))", "is not a number or a name"),
        ("OPTIONS epsilon=1", r"expected '\('"),
    ],
)
def test_malformed_options(options: str, message: str) -> None:
    with pytest.raises(SyntaxError_, match=message):
        strip_dp_clauses(f"SELECT WITH ANONYMIZATION {options} ANON_COUNT(*) FROM visits")


def test_anon_count_star_with_bound_becomes_parseable() -> None:
    sql = "SELECT ANON_COUNT(*, 5), 'ANON_COUNT(*, 5)', anon_count ( * , 2) FROM visits"
    stripped, clauses = strip_dp_clauses(sql)
    assert clauses == ()
    assert stripped == "SELECT ANON_COUNT(1, 5), 'ANON_COUNT(*, 5)', anon_count ( 1 , 2) FROM visits"


def test_negative_and_empty_options() -> None:
    _, (clause,) = strip_dp_clauses("SELECT WITH ANONYMIZATION OPTIONS(epsilon=-1) 1")
    assert clause.option("epsilon") == -1  # parsed; the planner refuses it with its reason
    _, (clause,) = strip_dp_clauses("SELECT WITH ANONYMIZATION OPTIONS() 1")
    assert clause.options == ()


CAPS = Caps(max_epsilon=10, max_delta=1e-3, max_groups_contributed=100)
BASE = DPSettings(epsilon=1.0, delta=1e-6, max_groups_contributed=1, noise="laplace")


def test_settings_set_and_show() -> None:
    s = BASE.with_value("dp.epsilon", 0.5, CAPS).with_value("noise", "GAUSSIAN", CAPS)
    s = s.with_value("dp.max_groups_contributed", 3, CAPS).with_value("dp.delta", "1e-7", CAPS)
    assert (s.epsilon, s.noise, s.max_groups_contributed, s.delta) == (0.5, "gaussian", 3, 1e-7)
    assert s.show("dp.epsilon") == "0.5" and s.show("dp.max_groups_contributed") == "3"
    assert BASE.epsilon == 1.0, "settings are immutable values"


@pytest.mark.parametrize(
    ("name", "value"),
    [("epsilon", 0), ("epsilon", -1), ("epsilon", "NaN"), ("epsilon", 1e308), ("epsilon", "inf"),
     ("epsilon", "abc"), ("delta", 0), ("delta", 0.5), ("max_groups_contributed", 0),
     ("max_groups_contributed", 2.5), ("max_groups_contributed", 101), ("noise", "uniform")],
)
def test_settings_outside_policy_are_refused(name: str, value: object) -> None:
    with pytest.raises(InvalidParameterValue) as exc:
        BASE.with_value(name, value, CAPS)
    assert exc.value.sqlstate == "22023"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [("epsilon", 5e-324, "subnormal"), ("epsilon", "1e-310", "subnormal"),
     ("delta", 5e-324, "subnormal"), ("delta", "-1e-320", "above 0"),
     ("epsilon", float("inf"), "finite"), ("epsilon", "-Infinity", "finite"),
     ("delta", float("nan"), "finite"), ("epsilon", 1e-9, "minimum 0.001"),
     ("epsilon", "0.000999", "minimum 0.001")],
)
def test_subnormal_non_finite_and_too_small_values_are_refused(name: str, value: object,
                                                               message: str) -> None:
    caps = Caps(max_epsilon=10, max_delta=1e-3, max_groups_contributed=100, min_epsilon=1e-3)
    with pytest.raises(InvalidParameterValue) as exc:
        validate(name, value, caps)
    assert exc.value.sqlstate == "22023" and message in exc.value.message
    assert validate("epsilon", 1e-3, caps) == 1e-3 and validate("delta", 1e-300, caps) == 1e-300


def test_check_finite_normal() -> None:
    for ok in (0.0, -0.0, 2.2250738585072014e-308, -1e300, 1.0):
        assert check_finite_normal(ok, "a bound") == ok
    for bad in (5e-324, -1e-310, math.inf, -math.inf, math.nan):
        with pytest.raises(InvalidParameterValue, match=r"^a bound "):
            check_finite_normal(bad, "a bound")


def test_options_that_are_not_decimal_numbers_are_syntax_errors() -> None:
    for value in ("0x10", "0o17", "0b11", "-0x1"):
        with pytest.raises(SyntaxError_, match="is not a decimal number"):
            strip_dp_clauses(f"SELECT WITH ANONYMIZATION OPTIONS(epsilon={value}) 1")
    _, (clause,) = strip_dp_clauses("SELECT WITH ANONYMIZATION OPTIONS(epsilon=1_0, delta=1e999) 1")
    assert clause.options == (("epsilon", 10), ("delta", math.inf))  # (validated later)


def test_unknown_setting() -> None:
    with pytest.raises(UndefinedObject) as exc:
        BASE.with_value("dp.epsilonn", 1, CAPS)
    assert exc.value.sqlstate == "42704"


# ---------------------------------------------------------------- the unparsed fast path

def _needs_parse_reference(c: Classifier, sql: bytes) -> bool:
    """The fast path's rule, written plainly: a policy, session or isolation word anywhere, or
    DO/CALL as a word."""
    text = sql.lower()
    words = [w.lower().encode() for w in [*c.policy.names, *_SESSION_WORDS, *REACH_WORDS]] + [
        b"u&", b"dp.", b'"dp"', b"dp_", b"anonymization", b"differential_privacy"]
    return any(w in text for w in words) or re.search(rb"\bdo\b|\bcall\b", text) is not None


@pytest.mark.parametrize(
    ("sql", "plain"),
    [
        (b"SELECT abalance FROM pgbench_accounts WHERE aid = 42", True),
        (b"select * from VISITS", False),
        (b"DO $$ BEGIN END $$", False),
        (b"call p()", False),
        (b"SELECT double_it(2), 'local', recall, pseudo, window_size, docs", True),
        (b"SELECT 1; do $$ $$", False),
        (b"SELECT x FROM t WHERE y = 'do'", False),  # conservative: a word inside a string
        (b"SELECT caller, dots, do_it", True),
        (b"select _do", True),
        (b"select \xc3\xa1do", False),  # a non-ASCII byte is a word boundary, as for \b
        (b"SELECT dp_budget()", False),
        (b"SELECT * FROM PG_STAT_ACTIVITY", False),
        (b"select lo_get(16385)", False),
        (b"SELECT pg_column_size(x), broadcast, CAST(y AS int) FROM t", True),
    ],
)
def test_fast_path_words(classifier: Classifier, sql: bytes, plain: bool) -> None:
    assert classifier.is_plain_pass_through_bytes(sql) is plain
    assert _needs_parse_reference(classifier, sql) is not plain


def test_fast_path_finds_a_protected_name_that_overlaps_do_or_call() -> None:
    # "call_users" starts with "call", not a word here; the protected "all_users" starts
    # inside it, and "do_log" would lose to "do" if DO were tried first at its position
    c = Classifier(ProtectionPolicy({"all_users": "public", "do_log": "public", "o": "x"}))
    assert not c.is_plain_pass_through_bytes(b"SELECT * FROM call_users")
    assert not c.is_plain_pass_through_bytes(b"SELECT * FROM do_log")
    assert not c.is_plain_pass_through_bytes(b"SELECT * FROM xdo_log")
    assert not c.is_plain_pass_through_bytes(b"SELECT 1 FROM do")  # "o" is protected too
    c2 = Classifier(ProtectionPolicy({"do": "public"}))  # a table named do: a plain word
    assert not c2.is_plain_pass_through_bytes(b"SELECT * FROM undo")
    # a protected name that CALL extends: "calls" is not CALL as a word, but holds "cal"
    c3 = Classifier(ProtectionPolicy({"cal": "public"}))
    assert not c3.is_plain_pass_through_bytes(b"SELECT * FROM calls")
    assert c3.is_plain_pass_through_bytes(b"SELECT * FROM ca")


@settings(max_examples=3000, deadline=None)
@given(st.lists(st.sampled_from([
    "do", "call", "all_users", "visits", "dp_", "dp.", "u&", "_", "x", " ", "$", "DO", "CaLL",
    "1", ";", "'", "\u00e1", "o", "c", "al", "l", "users", "anonymization", "ca", "_log", "7",
    "2024", "visits20"]),
    max_size=12), st.sampled_from([0, 1, 2]))
def test_fast_path_agrees_with_its_reference(parts: list[str], policy: int) -> None:
    c = _OVERLAP[policy]
    sql = "".join(parts).encode()
    assert c.is_plain_pass_through_bytes(sql) is not _needs_parse_reference(c, sql)


_OVERLAP = (Classifier(ProtectionPolicy({"visits": "public", "all_users": "public"})),
            Classifier(ProtectionPolicy({"cal": "public", "do_log": "public", "visit": "x"})),
            Classifier(ProtectionPolicy({"visits2024": "public", "do1": "public"})))


def test_fast_path_verdicts_are_remembered_within_bounds() -> None:
    from dp_core import classify

    c = Classifier(ProtectionPolicy({"visits": "public"}))
    texts = [b"SELECT abalance FROM pgbench_accounts WHERE aid = $1", b"SELECT * FROM visits",
             b"DO $$ BEGIN END $$", b"select $1::int"]
    for _ in range(2):  # the second time from memory, with the same answers
        assert [c.is_plain_pass_through_bytes(t) for t in texts] == [True, False, False, True]
        assert [c._search_plain(t.lower()) for t in texts] == [True, False, False, True]
    assert set(c._plain_memo) == {t.lower().replace(b"1", b"0") for t in texts}
    # other numbers, other case: the same entry
    assert c.is_plain_pass_through_bytes(b"select abalance from PGBENCH_ACCOUNTS where aid = 97")
    assert b"select abalance from pgbench_accounts where aid = 00" in c._plain_memo
    long = b"SELECT 1 " + b" " * classify._PLAIN_MEMO_MAX_LENGTH + b"FROM visits"
    assert not c.is_plain_pass_through_bytes(long) and len(c._plain_memo) == 5
    for i in range(classify._PLAIN_MEMO_SIZE + 10):
        assert c.is_plain_pass_through_bytes(b"SELECT '%d'" % i)
        assert len(c._plain_memo) <= classify._PLAIN_MEMO_SIZE
    assert not c.is_plain_pass_through_bytes(b"SELECT * FROM visits")


def test_digits_are_kept_when_a_protected_name_has_one() -> None:
    c = Classifier(ProtectionPolicy({"visits2024": "public"}))
    assert c.is_plain_pass_through_bytes(b"SELECT * FROM visits2023")
    assert not c.is_plain_pass_through_bytes(b"SELECT * FROM visits2024")
    assert not c.is_plain_pass_through_bytes(b"SELECT * FROM VISITS2024")
    assert c.is_plain_pass_through_bytes(b"SELECT * FROM visits2025")


# ---------------------------------------------------------------------------- lexing settings


@pytest.mark.parametrize(("sql", "refused"), [
    ("SET standard_conforming_strings = off", True),
    ("SET standard_conforming_strings TO 0", True),
    ("SET LOCAL standard_conforming_strings = 'false'", True),
    ("SET standard_conforming_strings = on", False),
    ("SET standard_conforming_strings = 'TRUE'", False),
    ("SET standard_conforming_strings TO DEFAULT", False),
    ("RESET standard_conforming_strings", False),
    ("SET client_encoding = 'SJIS'", True),
    ("SET NAMES 'big5'", True),
    ("SET client_encoding = 'LATIN1'", True),  # the default predicate takes only UTF8
    ("SET client_encoding = 'UTF-8'", False),
    ("SET NAMES DEFAULT", False),
    ("SELECT set_config('standard_conforming_strings', 'off', false)", True),
    ("SELECT set_config('standard_conforming_strings'::text, 'on', false)", False),
    ("SELECT set_config('search_path', '', false)", False),  # as pg_dump sends
    ("SELECT set_config('search_path', $1, false)", False),
    ("SELECT set_config('client_encoding', $1, false)", False),  # (checked at Bind)
    ("SELECT set_config($1, 'x', false)", False),  # (checked at Bind)
    ("PREPARE p(text) AS SELECT set_config('client_encoding', $1, false)", True),
    ("SELECT set_config('client_encoding', $1 || '', false)", True),
    ("SELECT x FROM t WHERE set_config(name, 'x', false) IS NULL", True),
    ("UPDATE pg_settings SET setting = 'on' WHERE name = 'x'", True),
    ("SELECT name, setting FROM pg_settings", False),
])
def test_settings_that_change_how_sql_is_read(classifier: Classifier, sql: str,
                                              refused: bool) -> None:
    (stmt,) = classifier.classify(sql)
    assert (stmt.kind is K.REFUSED) is refused
    if refused:
        assert stmt.refusal is not None and stmt.refusal.sqlstate == "0A000"
    # and the fast path never forwards them unparsed
    assert not classifier.is_plain_pass_through_bytes(sql.encode())


@pytest.mark.parametrize(("sql", "values", "sqlstate"), [
    ("SELECT set_config('client_encoding', $1, false)", ["UTF8"], None),
    ("SELECT set_config('client_encoding', $1, false)", ["SJIS"], "0A000"),
    ("SELECT set_config('client_encoding', $1, false)", [None], "0A000"),  # as a NULL literal
    ("SELECT set_config('CLIENT_ENCODING', $1::text, false)", ["big5"], "0A000"),
    ("SELECT set_config($1, $2, false)", ["client_encoding", "UTF8"], None),
    ("SELECT set_config($1, $2, false)", ["Client_Encoding", "GBK"], "0A000"),
    ("SELECT set_config($1, $2, false)", ["standard_conforming_strings", "off"], "0A000"),
    ("SELECT set_config($1, $2, false)", ["standard_conforming_strings", "yes"], None),
    ("SELECT set_config($1, $2, false)", ["search_path", "x"], None),
    ("SELECT set_config($1, $2, false)", ["ROLE", "dp_pushdown"], "42501"),
    ("SELECT set_config($1, 'x', false)", ["session_authorization"], "42501"),
    ("SELECT set_config($2, $1, false)", ["off", "standard_conforming_strings"], "0A000"),
    ("SELECT set_config($1, 'SJIS', false)", ["client_encoding"], "0A000"),
    ("SELECT set_config($1, lower($2), false)", ["client_encoding", "UTF8"], "0A000"),
    ("SELECT 1 WHERE set_config($1, 'on', true) IS NOT NULL "
     "AND set_config('client_encoding', $2, true) IS NOT NULL",
     ["standard_conforming_strings", "sjis"], "0A000"),
    ("SELECT set_config($1, 'x', false)", [None], None),  # (Postgres refuses a NULL name)
])
def test_parameters_of_set_config_are_checked_at_bind(classifier: Classifier, sql: str,
                                                      values: list[str | None],
                                                      sqlstate: str | None) -> None:
    """The same rules, and errors, as the literal form: applied to the values a Bind gives."""
    (stmt,) = classifier.classify(sql)
    assert stmt.kind is K.PASS_THROUGH and stmt.at_bind, stmt
    err = classifier.settings.bound_refusal(stmt.at_bind, values)
    assert (err.sqlstate if err is not None else None) == sqlstate, err
    if err is not None:  # the literal form gets the same error
        literal_sql = sql
        for i, v in reversed(list(enumerate(values, 1))):
            literal_sql = literal_sql.replace(f"${i}", "NULL" if v is None else f"'{v}'")
        (lit,) = classifier.classify(literal_sql)
        assert lit.refusal is not None and (lit.refusal.sqlstate, str(lit.refusal)) == \
            (err.sqlstate, str(err))


def test_the_encoding_predicate_decides(classifier: Classifier) -> None:
    c = Classifier(ProtectionPolicy({}), settings=SettingChanges(lambda v: v.upper() == "LATIN1"))
    assert c.classify("SET client_encoding = 'latin1'")[0].kind is K.PASS_THROUGH
    assert c.classify("SET client_encoding = 'UTF8'")[0].kind is K.REFUSED


@pytest.mark.parametrize(("sql", "effect", "name"), [
    ("RESET ALL", Effect.RESET_ALL, None),
    ("DISCARD ALL", Effect.DISCARD_ALL, None),
    ("DEALLOCATE s1", Effect.DEALLOCATE, "s1"),
    ('DEALLOCATE PREPARE "S 1"', Effect.DEALLOCATE, "S 1"),
    ("DEALLOCATE ALL", Effect.DEALLOCATE, None),
    ("SAVEPOINT a", Effect.SAVEPOINT, "a"),
    ('RELEASE SAVEPOINT "A"', Effect.RELEASE, "A"),
    ("ROLLBACK TO a", Effect.ROLLBACK_TO, "a"),
    ("ABORT AND CHAIN", Effect.ROLLBACK_AND_CHAIN, None),
    ("ROLLBACK", None, None),
    ("COMMIT AND CHAIN", Effect.COMMIT_AND_CHAIN, None),  # (of a failed block: a rollback)
    ("DISCARD PLANS", None, None),
    ("RESET search_path", None, None),
])
def test_statements_that_reach_the_proxys_session_state(classifier: Classifier, sql: str,
                                                        effect: Effect | None,
                                                        name: str | None) -> None:
    (stmt,) = classifier.classify(sql)
    assert stmt.kind is K.PASS_THROUGH and stmt.effect is effect and stmt.setting == name
    assert not classifier.is_plain_pass_through_bytes(sql.encode())


def test_refusals_give_examples_over_the_table_refused() -> None:
    """Issue 29: the example in a refusal names the configured table it refused, not the
    demo's; a refusal that names no protected table carries no such example."""
    rides = Classifier(ProtectionPolicy({"rides": "public"}))
    (st,) = rides.classify("SELECT rider_id, fare FROM rides")
    assert st.kind is StatementKind.REFUSED and st.refusal is not None
    assert "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM rides" in (st.refusal.hint or "")
    assert "visits" not in st.refusal.message + (st.refusal.hint or "")
    (st,) = rides.classify("COPY (SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM rides) "
                           "TO '/tmp/x'")
    assert st.refusal is not None and "TO STDOUT" in (st.refusal.hint or "")
    (st,) = rides.classify("CREATE FUNCTION pg_temp.f() RETURNS int LANGUAGE sql AS 'SELECT 1'")
    assert st.refusal is not None and "FROM" not in (st.refusal.hint or "")
    assert "(none)" not in st.refusal.message


def test_a_dp_answer_is_copied_to_the_client_only(classifier: Classifier) -> None:
    """Review, session 33: libpg_query's JSON leaves an empty file name out, as it does
    STDOUT, so `COPY (DP query) TO ''` was taken for a copy to the client, charged, and
    failed after the charge (XX000). TO STDOUT is now read from the statement's tokens."""
    dp = "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits WHERE browser <> ')('"
    for target in ("STDOUT", "STDOUT WITH (FORMAT csv)", "STDOUT -- é", "STDIN"):
        (st,) = classifier.classify(f"COPY ({dp}) TO {target}")
        assert st.kind is not StatementKind.REFUSED, target
    # (review: an option's word stdout is not the target)
    for target in ("''", "'' -- é", "'/tmp/x'", "PROGRAM 'cat'", "'' WITH (FORMAT csv)",
                   "'' CSV FORCE QUOTE stdout"):
        for query in (dp, "SELECT count(*) FROM visits", "SELECT * FROM dp_budget()"):
            (st,) = classifier.classify(f"COPY ({query}) TO {target}")
            assert st.refusal is not None and "TO STDOUT" in (st.refusal.hint or ""), \
                (query, target)
