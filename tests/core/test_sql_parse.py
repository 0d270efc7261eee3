"""dp_core.sql_parse gives pglast's trees and tokens, in time linear in a text of multibyte characters."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pglast
import pytest
from pglast import parser

from dp_core.errors import StatementTooComplex
from dp_core.sql_parse import SLOW_SCAN_WORK, parse_sql, scan
from tests.fuzz import test_fuzz_neighbours, test_fuzz_sql
from tests.support.engine import EXTRA_CASES, GOLDEN, GOLDEN_CASES

HANDWRITTEN = [
    "SELECT a.b, 'x', 0, 1.5, true, NULL, B'101', X'1F', x::int[], -1, $1, E'\\n', "
    "U&'\\0041', $$dollar$$, $t$tag$t$ FROM t AS a WHERE NOT (a = 1 AND b IN (1, 2))",
    "SELECT WITH ANONYMIZATION OPTIONS (epsilon = 0.5, delta = 1e-6) browser, "
    "ANON_COUNT(*, 5), ANON_SUM(duration, 0, 100) FROM visits GROUP BY browser",
    "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < 3) "
    "SELECT n, row_number() OVER (PARTITION BY n ORDER BY n DESC NULLS LAST ROWS BETWEEN "
    "UNBOUNDED PRECEDING AND CURRENT ROW) FROM r",
    "SELECT count(*) FILTER (WHERE x > 0), percentile_cont(0.5) WITHIN GROUP (ORDER BY x), "
    "CASE WHEN x IS DISTINCT FROM 1 THEN 'a' ELSE 'b' END, x COLLATE \"C\", ARRAY[1, 2][1], "
    "ROW(1, 2), (SELECT 1), EXISTS (SELECT 1), x BETWEEN 1 AND 2, x LIKE 'a%' ESCAPE '!' "
    "FROM t GROUP BY GROUPING SETS ((x), ()) HAVING count(*) > 1 ORDER BY 1 LIMIT 5 OFFSET 1",
    "SELECT * FROM a LEFT JOIN b USING (uid) FULL JOIN LATERAL (SELECT 1) c ON true "
    "CROSS JOIN generate_series(1, 3) WITH ORDINALITY AS g(i, o)",
    "SELECT make_interval(days => 1), extract(epoch FROM now()), substring('abc' FROM 1 FOR 2), "
    "position('b' IN 'abc'), trim(both 'x' FROM 'xax'), overlay('abc' PLACING 'x' FROM 1), "
    "current_date, current_user, localtimestamp(2), interval '1 day', '{1}'::jsonb -> 'a' ->> 0",
    "VALUES (1, 'a'), (2, NULL)",
    "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY",
    "COPY (SELECT 1) TO STDOUT WITH (FORMAT csv, HEADER true)",
    "DECLARE c SCROLL CURSOR WITH HOLD FOR SELECT 1",
    "EXPLAIN (ANALYZE, COSTS off) SELECT count(*) FROM visits",
    "SET LOCAL dp.epsilon = 0.5; SHOW dp.epsilon; RESET ALL",
    "PREPARE p(int) AS SELECT $1; EXECUTE p(1); DEALLOCATE p",
    "INSERT INTO t (a) VALUES (1) ON CONFLICT (a) DO UPDATE SET a = excluded.a RETURNING *",
    "CREATE TABLE t (a int PRIMARY KEY, b text NOT NULL DEFAULT 'x' CHECK (b <> ''))",
    "SELECT x.* FROM (VALUES (1)) AS b, generate_series(1, 7) AS x",
    "SELECT 1 UNION SELECT 2 INTERSECT SELECT 3 EXCEPT ALL SELECT 4",
    "SELECT xmlelement(name a, 'b'), json_object('a': 1), x IS JSON, "
    "JSON_VALUE(j, '$.a' RETURNING int)",
]
"""Forms the other sources may not have: literals of each kind, DDL, utility statements."""


def _corpus() -> list[str]:
    texts = [p.read_text() for p in GOLDEN_CASES]
    texts += [p.read_text() for p in sorted(GOLDEN.glob("*.expected.sql"))]
    texts += EXTRA_CASES + HANDWRITTEN
    rng = random.Random(33)
    texts += [test_fuzz_sql._query(rng)[0] for _ in range(150)]
    texts += [test_fuzz_neighbours._query(rng) for _ in range(150)]
    return texts


def _variants(sql: str) -> Iterator[str]:
    """`sql` with multibyte characters before, inside and after its nodes: in a comment, a
    literal, a quoted and a bare identifier (every location moves; values hold them)."""
    yield "/* é😀 */ " + sql
    yield sql.replace("'", "'é😀", 1) if "'" in sql else sql + " -- ü"
    yield sql.replace(" FROM ", " /*ß*/ FROM ", 1) + " -- 中文"
    yield sql.replace("SELECT", 'SELECT "é😀x" AS Ωmega, ', 1)


def _same_parse(text: str) -> None:
    try:
        want: Any = [s() for s in pglast.parse_sql(text)]
    except parser.ParseError as e:
        with pytest.raises(parser.ParseError) as got:
            parse_sql(text)
        assert got.value.args == e.args, text
        return
    assert [s() for s in parse_sql(text)] == want, text


def _same_scan(text: str) -> None:
    try:
        want: Any = parser.scan(text)
    except parser.ParseError as e:
        want = e.args
    try:
        got: Any = scan(text)
    except parser.ParseError as e:
        got = e.args
    assert got == want, text


def test_trees_and_tokens_of_texts_with_multibyte_characters_are_pglasts() -> None:
    """Every node, value and location (as a character index) as pglast gives them, over the
    golden inputs and pushdowns, generated DP queries and forms written for this test, each
    with multibyte characters in several places; and ParseError alike."""
    checked = 0
    for sql in _corpus():
        for text in _variants(sql):
            if text.isascii():
                continue
            _same_parse(text)
            _same_scan(text)
            checked += 1
    assert checked > 1000


@pytest.mark.parametrize("text", [
    "SELECT 'unterminated é",
    'SELECT "unterminated é',
    "SELECT 1 FROM t WHERE é = 'x' AND ü IN (1, ",
    "SELECT $é$ a $ü$ b $é$, ééé",
    "SELECT $a$é$a$, 1é, 0xé, E'\\é', U&'\\00e9' UESCAPE '!'",
    "SELECT currentédate, exéists, nextxx, éxx",
])
def test_errors_tags_and_words_of_multibyte_characters_are_pglasts(text: str) -> None:
    _same_parse(text)
    _same_scan(text)


def test_dollar_tags_of_multibyte_characters_alike_in_xs_are_told_apart() -> None:
    """$é$ and $ü$ are both $xx$ once written in x's, which would end the string too early:
    a string whose closing tag is not its opening one in the text is scanned by pglast, or
    refused (54001) where that would cost more than SLOW_SCAN_WORK tokens × bytes. Tags that
    match cost nothing more (review, session 33: 10,000 tokens and 20,000 bytes of é took
    pglast 4.6 s)."""
    _same_scan("SELECT $é$ a $ü$ b $é$, $ü$ c $é$ d $ü$")
    _same_scan("SELECT $é$x$é$" + ", 1" * 2_000 + ", '" + "é" * 20_000 + "'")
    collide = "SELECT $é$ a $ü$ b $é$"
    _same_scan(collide + ", 1" * 100 + ", '" + "é" * 100 + "'")
    tokens = SLOW_SCAN_WORK // 10_000
    with pytest.raises(StatementTooComplex):
        scan(collide + ", 1" * tokens + ", '" + "é" * 10_000 + "'")


def test_a_text_nested_deeper_than_python_reads_gets_54001() -> None:
    """(Review, session 33.) pglast builds its tree in C; this module's walk of the JSON is
    Python's, whose recursion is limited: past it, 54001 as for any statement too complex
    (not a RecursionError, XX000)."""
    with pytest.raises(StatementTooComplex):
        parse_sql("SELECT " + "lower(" * 2000 + "x" + ")" * 2000 + " -- é")
    with pytest.raises(StatementTooComplex):
        parse_sql("SELECT count(*) FROM visits WHERE duration > 1" + " + 1" * 2000 + " -- é")


def test_a_text_of_a_million_emoji_is_parsed_in_one_pass() -> None:
    """A million emoji in a literal, read by 300 columns: pglast made a list of 4 million
    multibyte bytes and walked it for each of the 600 located nodes (about 30 s here);
    dp_core.sql_parse maps each location with a binary search. The tree is checked, not the
    time: its constant holds the whole text, and the last location is a character index."""
    emoji = "😀" * 1_000_000
    columns = ", ".join(f"a AS c{i}" for i in range(300))
    sql = f"SELECT '{emoji}' AS a, {columns} FROM t -- {emoji}"
    (raw,) = parse_sql(sql)
    assert raw.stmt.targetList[0].val.val.sval == emoji
    assert raw.stmt.fromClause[0].location == sql.index(" FROM t") + 6
    *_, table, comment = scan(sql)
    assert (table.start, table.name) == (sql.index(" FROM t") + 6, "IDENT")
    assert (comment.end, comment.name) == (len(sql) - 1, "SQL_COMMENT")
