"""The public rows one protected row can meet in a DP query's joins (dp_core.fanout): the items, how
joins tie them, and the bound, hand-computed with a catalog given here."""

from __future__ import annotations

import pytest

from dp_core.errors import ProgramLimitExceeded
from dp_core.fanout import PUBLIC_ROWS_PER_ROW, check_row_bound, row_bound
from dp_core.query import PublicItem, PublicSource, Relation
from tests.support.engine import build

COUNTRIES: Relation = (None, "countries")  # (as written: no search_path here)
ROWS = {COUNTRIES: 120, (None, "regions"): 6}
"""Public tables' rows (countries: 120, code its PRIMARY KEY; regions: 6, none unique)."""
UNIQUE = {COUNTRIES: {"code"}}


def _bound(from_where: str) -> int:
    query, _, _ = build("SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM " + from_where)
    return row_bound(query.public_items, lambda r, c, k: c in UNIQUE.get(r, set()),
                     lambda r: ROWS[r])


@pytest.mark.parametrize(("from_where", "expected"), [
    # tied by equality on the key: one country per row
    ("visits v JOIN countries c ON c.code = v.country", 1),
    ("visits v JOIN countries c ON v.country = c.code", 1),
    ("visits v, countries c WHERE c.code = v.country", 1),
    ("visits v LEFT JOIN countries c ON c.code = v.country", 1),
    ("countries c LEFT JOIN visits v ON c.code = v.country", 1),
    ("visits v JOIN countries c ON c.code = 'US'", 1),  # (a constant: one row of c)
    ("visits v JOIN (SELECT code, name FROM countries WHERE region = 'Asia') c "
     "ON c.code = v.country", 1),
    ("visits v JOIN (SELECT * FROM countries) c ON c.code = v.country", 1),
    # then a second table tied to the first one's columns: its own bound
    ("visits v JOIN countries c ON c.code = v.country JOIN countries d ON d.code = c.code", 1),
    ("visits v JOIN countries c ON c.code = v.country JOIN regions r ON r.name = c.region", 6),
    # not tied on a unique column: every row
    ("visits v CROSS JOIN countries c", 120),
    ("visits v JOIN countries c ON c.code <> v.country", 120),
    ("visits v JOIN countries c ON c.region = v.country", 120),
    ("visits v JOIN countries c ON upper(c.code) = v.country", 120),
    ("visits v JOIN (SELECT lower(code) AS code FROM countries) c ON c.code = v.country", 120),
    ("visits v JOIN (SELECT code FROM countries) AS c (k) ON c.k = v.country", 1),
    ("visits v JOIN (SELECT name, code FROM countries) AS c (code, name) ON c.code = v.country",
     120),
    ("visits v JOIN countries AS c (name) ON c.name = v.country", 120),  # (order unknown)
    ("visits v JOIN countries c ON c.code = country", 120),  # (unqualified: whose?)
    # an outer join's ON between two items of its preserved side ties nothing
    ("visits v CROSS JOIN countries c LEFT JOIN purchases p ON c.code = v.country "
     "AND p.uid = v.uid", 120),
    # (from the review) an outer join's ON does not filter its preserved side: a tie there
    # holds only toward protected items all on the other side
    ("visits v CROSS JOIN countries c LEFT JOIN (SELECT 1 AS z) x ON c.code = 'US'", 120),
    ("visits v CROSS JOIN countries c LEFT JOIN countries x ON x.code = 'US' "
     "AND c.code = x.code", 120),
    ("countries c RIGHT JOIN visits v ON c.code = v.country", 1),
    ("countries c FULL JOIN visits v ON c.code = v.country", 1),
    ("visits v FULL JOIN countries c ON c.code = v.country", 1),
    ("(visits v FULL JOIN countries c ON c.code = v.country) JOIN purchases p USING (uid)",
     120),
    ("visits v LEFT JOIN countries c USING (code)", 1),
    ("countries c LEFT JOIN visits v USING (code)", 1),
    ("visits v CROSS JOIN countries c LEFT JOIN (SELECT 1 AS code) x USING (code)", 120),
    # a VALUES list's repeats count where it equals a column as it is (a join clause), not an
    # expression of an outer join's nullable item that only filters the rows joined first
    ("visits v CROSS JOIN (VALUES ('a'), ('b')) a(k) LEFT JOIN countries x ON x.code = 'US' "
     "WHERE a.k = coalesce(x.name, v.country)", 2),
    ("visits v CROSS JOIN (VALUES ('a'), ('b')) a(k) WHERE a.k = v.country", 1),
    # two items tied to each other only: the first bounded by its rows, the second tied to it
    ("visits v, countries c, countries d WHERE c.code = d.code", 120),
    ("visits v, regions r, countries c WHERE c.region = r.name", 120 * 6),
    ("visits v, regions a, regions b", 36),
    # VALUES: its rows, or the most rows of one value of the column it is tied on
    ("visits v CROSS JOIN (VALUES (1), (2), (3)) a(x)", 3),
    ("visits v JOIN (VALUES ('US'), ('DE'), ('US')) a(k) ON a.k = v.country", 2),
    ("visits v JOIN (VALUES ('US', 1), ('DE', 2)) a ON a.column1 = v.country", 1),
    ("visits v JOIN (VALUES (1 + 1), (2)) a(k) ON a.k = v.duration", 2),  # (not literals)
    # numbers written differently may be equal: only integers alone are counted
    ("visits v JOIN (VALUES (1), (1.0), (1.00), (2)) a(k) ON a.k = v.duration", 4),
    ("visits v JOIN (VALUES (1), (01), (2)) a(k) ON a.k = v.duration", 2),
    # strings as no collation or padding could tell apart fewer
    ("visits v JOIN (VALUES ('us'), ('US '), ('DE')) a(k) ON a.k = v.country", 2),
    # a partial column alias renames the first columns only
    ("visits v JOIN (VALUES ('US', 1), ('US', 2)) a(k) ON a.column2 = v.duration", 1),
    ("visits v JOIN (VALUES ('US', 1), ('US', 2)) a(k) ON a.k = v.country", 2),
    ("visits v JOIN (VALUES (1, 'US'), (2, 'US')) a(n) ON a.n = v.duration", 1),
])
def test_public_rows_per_protected_row(from_where: str, expected: int) -> None:
    bound = _bound(from_where)
    assert bound == expected or min(bound, expected) > PUBLIC_ROWS_PER_ROW, (bound, expected)


def test_with_queries_and_using_tie_too() -> None:
    query, _, _ = build("WITH c AS (SELECT code, region FROM countries) SELECT WITH "
                        "ANONYMIZATION ANON_COUNT(*) FROM visits v JOIN c ON c.code = v.country")
    assert [i.source.relation for i in query.public_items] == [COUNTRIES]
    assert row_bound(query.public_items, lambda r, c, k: c == "code", ROWS.__getitem__) == 1
    # a subquery over a WITH query: its columns traced through both
    query, _, _ = build("WITH c AS (SELECT code, name AS n FROM countries) SELECT WITH "
                        "ANONYMIZATION ANON_COUNT(*) FROM visits v JOIN (SELECT n AS code FROM c)"
                        " d ON d.code = v.country")
    assert row_bound(query.public_items, lambda r, c, k: c == "code", ROWS.__getitem__) == 120
    query, _, _ = build("WITH c AS (SELECT code AS k FROM countries) SELECT WITH "
                        "ANONYMIZATION ANON_COUNT(*) FROM visits v JOIN (SELECT k AS z FROM c) d "
                        "ON d.z = v.country")
    assert row_bound(query.public_items, lambda r, c, k: c == "code", ROWS.__getitem__) == 1


def test_a_values_with_query_keeps_its_repeats_through_renaming_subqueries() -> None:
    """(From the second review) a VALUES WITH query read through a subquery that renames its
    columns: each join repeats the value 7 of column2 in 100 rows."""
    values = ", ".join(f"({i}, 7)" for i in range(100))
    joins = " ".join(f"JOIN (SELECT column2 AS column1 FROM x) {a} ON {a}.column1 = 7"
                     for a in "abcd")
    query, _, _ = build(f"WITH x AS (VALUES {values}) SELECT WITH ANONYMIZATION ANON_COUNT(*) "
                        f"FROM visits v {joins}")
    assert [i.source.repeats for i in query.public_items] == [{"column1": 100}] * 4
    assert row_bound(query.public_items, lambda r, c, k: False, ROWS.__getitem__) > 100
    query, _, _ = build(f"WITH x AS (VALUES {values}) SELECT WITH ANONYMIZATION ANON_COUNT(*) "
                        "FROM visits v JOIN (SELECT column2, column1 FROM x) AS a (column1, k) "
                        "ON a.column1 = 7")
    assert row_bound(query.public_items, lambda r, c, k: False, ROWS.__getitem__) == 100
    query, _, _ = build(f"WITH x AS (VALUES {values}) SELECT WITH ANONYMIZATION ANON_COUNT(*) "
                        "FROM visits v JOIN (SELECT column2, column1 FROM x) AS a (k, column2) "
                        "ON a.column2 = 7")
    assert row_bound(query.public_items, lambda r, c, k: False, ROWS.__getitem__) == 1
    assert _bound("visits v JOIN countries c USING (code)") == 1
    assert _bound("visits v JOIN countries c USING (region)") == 120


def test_a_subquery_over_protected_rows_multiplies_the_outer_bound() -> None:
    """Each scope's public items count: a subquery's public join, then the outer query's."""
    assert _bound("(SELECT v.uid, c.region FROM visits v CROSS JOIN (VALUES (1), (2)) c(x)) s "
                  "CROSS JOIN (VALUES (1), (2), (3)) d(y)") == 6


def test_over_the_limit_is_refused_before_anything_runs() -> None:
    items = [PublicItem(PublicSource(COUNTRIES)), PublicItem(PublicSource(rows=2))]
    with pytest.raises(ProgramLimitExceeded, match="more than 100 public rows"):
        check_row_bound(items, lambda r, c, k: False, ROWS.__getitem__)
    check_row_bound(items[1:], lambda r, c, k: False, ROWS.__getitem__)
    assert PUBLIC_ROWS_PER_ROW == 100


def test_in_subqueries_multiply_by_their_rows() -> None:
    """Where Postgres does not hash an IN subquery's rows, it compares each protected row with
    every one: their rows (counted up to the limit by the statement below) multiply."""
    from dp_core.probes import standalone_subqueries

    query, _, _ = build("SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits WHERE country IN "
                        "(SELECT code FROM countries WHERE region = 'Asia') AND EXISTS "
                        "(SELECT 1 FROM countries)")
    assert len(query.in_lists) == 1 and len(query.sublinks) == 2  # (EXISTS runs once)
    (sql,) = standalone_subqueries(query, in_lists=True, limit=101)
    assert sql == ("SELECT count(*) FROM (SELECT 1 FROM (SELECT code FROM countries WHERE "
                   "region = 'Asia') AS dp_s LIMIT 101) AS dp_n")
    # a comparison is a tenth of a joined row: 38 rows, 3.8; 1,064 rows, 106.4
    assert row_bound(query.public_items, lambda r, c, k: False, ROWS.__getitem__,
                     [38]) == pytest.approx(3.8)
    assert row_bound((), lambda r, c, k: False, ROWS.__getitem__, [152] * 7) > 100
    assert row_bound((), lambda r, c, k: False, ROWS.__getitem__, [5]) == 1  # (at least 1)
    items = [PublicItem(PublicSource(rows=10))]
    assert row_bound(items, lambda r, c, k: False, ROWS.__getitem__, [152]) > 100


def test_a_composite_unique_key_counts_one_row_when_all_its_columns_are_tied() -> None:
    """regions' (name, country) is unique together: tied on both, one row; on one, its 6."""
    def composite(relation: Relation, tied: object) -> bool:
        return relation == (None, "regions") and {"name", "country"} <= {c for c, _ in tied}  # type: ignore[attr-defined]

    def bound(on: str) -> float:
        query, _, _ = build("SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits v JOIN regions r "
                            f"ON {on}")
        return row_bound(query.public_items, lambda r, c, k: False, ROWS.__getitem__,
                         composite=composite)

    assert bound("r.name = v.browser AND r.country = v.country") == 1
    assert bound("r.name = v.browser AND r.country = 'FR'") == 1
    assert bound("r.name = v.browser") == 6
    assert bound("r.name = v.browser AND r.other = v.country") == 6
