"""Names in HAVING and ORDER BY read as Postgres reads them (dp_core.names), and the extension.

Which names are input columns is Postgres's to say: the analysis lists the references it needs
(`name_checks`), and these tests give the answers Postgres gives for the demo tables (checked
against Postgres itself in tests/proxy/test_semantics.py): None for a grouped input column, else
its error.
"""

from __future__ import annotations

from typing import Any

import pytest
from pglast import parse_sql
from pglast.stream import RawStream

from dp_core.analysis import analyze, parse_select
from dp_core.errors import (
    AmbiguousColumn,
    DPError,
    FeatureNotSupported,
    GroupingError,
    InvalidColumnReference,
    UndefinedColumn,
)
from dp_core.mechanisms import NoiseKind
from dp_core.names import InputColumns
from dp_core.plan import make_plan
from dp_core.probes import column_probe_sql
from dp_core.query import AnalyzedQuery
from dp_core.result import result_sql
from dp_core.sqlnodes import node_sql
from tests.support.engine import CLASSIFIER, POLICY


def _ungrouped(column: str) -> GroupingError:
    return GroupingError(f'column "{column}" must appear in the GROUP BY clause or be used in an '
                         "aggregate function")


def _absent(name: str) -> UndefinedColumn:
    return UndefinedColumn(f'column "{name}" does not exist')


def analysed(sql: str, columns: InputColumns | None = None) -> AnalyzedQuery:
    (st,) = CLASSIFIER.classify(sql)
    return analyze(parse_select(st.stripped_sql), POLICY, plain_form=st.dp_clause is None,
                   columns=columns)


def answered(sql: str, columns: dict[tuple[str, ...], DPError | None]) -> AnalyzedQuery:
    """`sql` analysed with Postgres's answers, which must be exactly the ones it asks for."""
    first = analysed(sql)
    assert set(first.name_checks) == set(columns), first.name_checks
    query = analysed(sql, columns)
    assert query.name_checks == ()
    return query


def result_of(query: AnalyzedQuery, row: tuple[Any, ...]) -> str:
    """The result query over one released row (the types do not matter to its text)."""
    return result_sql([o.name for o in query.outputs], [("pg_catalog", "int8")] * len(row), [row],
                      sources=[o.source for o in query.outputs], having=query.having,
                      order_by=query.order_by,
                      visible=[(i.name, i.column if i.column is not None else i.expr)
                               for i in query.select])


def clause(sql: str, keyword: str) -> str:
    """The text of `sql` from `keyword` on (as pglast prints it)."""
    text = RawStream()(parse_sql(sql)[0].stmt)
    return text[text.index(keyword):]


# ---------------------------------------------------------------------------- what is asked


@pytest.mark.parametrize(("sql", "asked"), [
    # a bare ORDER BY name of an output column, an ordinal, names inside aggregates: none
    ("SELECT country, COUNT(*) AS n FROM visits GROUP BY country "
     "HAVING COUNT(DISTINCT browser) > 1 ORDER BY n, 1, SUM(duration)", []),
    ("SELECT country, COUNT(*) AS n FROM visits GROUP BY country HAVING n > 1", [("n",)]),
    ("SELECT country, COUNT(*) AS n FROM visits GROUP BY country HAVING abs(n) > 1 AND "
     "v.country <> 'x' ORDER BY n + 1, browser", [("n",), ("v", "country"), ("browser",)]),
    ("SELECT COUNT(*) FROM visits GROUP BY country ORDER BY country", [("country",)]),
])
def test_the_names_postgres_is_asked_about(sql: str, asked: list[tuple[str, ...]]) -> None:
    assert list(analysed(sql).name_checks) == asked


def test_the_probe_reads_the_name_in_the_querys_from_grouped_as_the_query_is() -> None:
    query = analysed("SELECT upper(browser) AS b, COUNT(*) AS n FROM visits v "
                     "GROUP BY 1, v.country HAVING n > 1")
    assert clause(column_probe_sql(query, ("n",)), "SELECT") == (
        "SELECT n FROM public.visits AS v WHERE FALSE GROUP BY upper(browser), v.country")
    query = analysed("WITH w AS (SELECT uid, browser FROM visits) SELECT COUNT(*) AS n FROM w "
                     "HAVING n > 1")
    probe = column_probe_sql(query, ("n",))
    assert probe.startswith("WITH w AS (") and probe.endswith("FROM w WHERE FALSE GROUP BY ()")


# ---------------------------------------------------------------------------- HAVING


def test_an_input_column_in_having_is_postgres_s_error_not_the_alias() -> None:
    """`SUM(duration) AS duration ... HAVING duration > 100000`: Postgres reads the column
    (ungrouped: 42803), so does the proxy; it read the alias."""
    sql = "SELECT country, SUM(duration) AS duration FROM visits GROUP BY country " \
          "HAVING duration > 100000"
    with pytest.raises(GroupingError) as err:
        answered(sql, {("duration",): _ungrouped("visits.duration")})
    assert err.value.sqlstate == "42803" and "visits.duration" in err.value.message


@pytest.mark.parametrize(("having", "where", "where_times_1000"), [
    ("n > 10", "dp_c1 > 10", "dp_c1 * 1000 > 10"),
    ("n * 2 > 10", "dp_c1 * 2 > 10", "dp_c1 * 1000 * 2 > 10"),
    ("abs(n) > 3", "abs(dp_c1) > 3", "abs(dp_c1 * 1000) > 3"),
    ("n BETWEEN 3 AND 1000000000", "dp_c1 BETWEEN 3 AND 1000000000",
     "dp_c1 * 1000 BETWEEN 3 AND 1000000000"),
    ("COALESCE(n, 0) > 10 AND n IS NOT NULL", "COALESCE(dp_c1, 0) > 10 AND dp_c1 IS NOT NULL",
     "COALESCE(dp_c1 * 1000, 0) > 10 AND dp_c1 * 1000 IS NOT NULL"),
])
def test_an_output_alias_in_having_is_its_released_value_in_any_expression(
        having: str, where: str, where_times_1000: str) -> None:
    """The extension: where no input column has the name, HAVING reads the output column, in
    any expression, `COUNT(*) * 1000` as well as `COUNT(*)` (the second was refused): a filter
    on the released values, post-processing, with nothing more released."""
    for select, expected in (("COUNT(*)", where), ("COUNT(*) * 1000", where_times_1000)):
        query = answered(f"SELECT country, {select} AS n FROM visits GROUP BY country "
                         f"HAVING {having}", {("n",): _absent("n")})
        assert clause(result_of(query, ("US", 50)), "WHERE") == f"WHERE {expected}"
        assert len(query.outputs) == 2 and len(query.aggregates) == 1


def test_an_alias_in_having_keeps_the_expression_s_structure() -> None:
    query = answered("SELECT country, COUNT(*) + 1 AS n FROM visits GROUP BY country "
                     "HAVING 10 - n > 1 OR n * 2 > 10", {("n",): _absent("n")})
    assert clause(result_of(query, ("US", 50)), "WHERE") == \
        "WHERE 10 - (dp_c1 + 1) > 1 OR (dp_c1 + 1) * 2 > 10"


def test_a_grouped_input_column_in_having_is_its_key_even_where_an_alias_has_its_name() -> None:
    """`browser` is grouped (as v.browser) and an output alias: HAVING reads the column, which
    is released hidden (the grouping is the query's; it costs nothing)."""
    sql = "SELECT country AS browser, COUNT(*) AS n FROM visits v GROUP BY country, v.browser " \
          "HAVING browser = 'Chrome'"
    query = answered(sql, {("browser",): None})
    assert [(o.name, RawStream()(o.source)) for o in query.outputs] == [
        ("browser", "country"), ("n", "count(*)"), ("dp_hidden2", "v.browser")]
    assert len(query.keys) == 2  # country and v.browser, as before
    assert clause(result_of(query, ("US", 50, "Chrome")), "WHERE") == "WHERE dp_c2 = 'Chrome'"


@pytest.mark.parametrize(("sql", "where", "order"), [
    # HAVING and ORDER BY repeat the key expression, grouped by it or by its position
    ("SELECT upper(browser) AS k, COUNT(*) AS n FROM visits GROUP BY upper(browser) "
     "HAVING upper(browser) <> 'CHROME' ORDER BY upper(browser)",
     "WHERE dp_c0 <> 'CHROME'", "ORDER BY dp_c0"),
    ("SELECT upper(browser), COUNT(*) AS n FROM visits GROUP BY 1 "
     "HAVING length(upper(browser)) > 3 ORDER BY lower(upper(browser)) DESC",
     "WHERE length(dp_c0) > 3", "ORDER BY lower(dp_c0) DESC"),
    # not selected: released hidden, as a grouped column is
    ("SELECT COUNT(*) AS n FROM visits v GROUP BY v.duration / 60 "
     "HAVING v.duration / 60 > 1 ORDER BY v.duration / 60",
     "WHERE dp_c1 > 1", "ORDER BY dp_c1"),
])
def test_a_key_expression_in_having_or_order_by_is_its_key(sql: str, where: str,
                                                           order: str) -> None:
    """Postgres matches an expression of HAVING or ORDER BY to an equal GROUP BY expression
    before it looks at the columns inside: `HAVING upper(browser) <> 'X'` of `GROUP BY
    upper(browser)` is a filter on the key. The proxy asked Postgres about `browser` alone
    (ungrouped: 42803) and refused what Postgres answers."""
    query = answered(sql, {})
    text = result_of(query, ("CHROME", 50) if len(query.outputs) == 2 else (50, 3))
    assert where in text and text.endswith(order), text


def test_having_without_group_by_reads_no_input_column() -> None:
    with pytest.raises(GroupingError):
        answered("SELECT COUNT(*) AS n FROM visits HAVING country = 'US'",
                 {("country",): _ungrouped("visits.country")})
    query = answered("SELECT COUNT(*) AS n FROM visits HAVING n > 1", {("n",): _absent("n")})
    assert clause(result_of(query, (5,)), "WHERE") == "WHERE dp_c0 > 1"


@pytest.mark.parametrize(("sql", "answers", "error"), [
    # neither an input column nor an output column
    ("SELECT country, COUNT(*) AS n FROM visits GROUP BY country HAVING nope > 1",
     {("nope",): _absent("nope")}, UndefinedColumn),
    # two output columns of the name that differ
    ("SELECT COUNT(*) AS n, SUM(duration) AS n FROM visits HAVING n > 1",
     {("n",): _absent("n")}, AmbiguousColumn),
    # a qualified name is an input column only
    ("SELECT country, COUNT(*) AS n FROM visits v GROUP BY country HAVING v.n > 1",
     {("v", "n"): UndefinedColumn("column v.n does not exist")}, UndefinedColumn),
    # grouped, but not as HAVING writes it (a primary key's table)
    ("SELECT COUNT(*) AS n FROM visits v JOIN countries c ON c.code = v.country GROUP BY c.code "
     "HAVING region = 'Europe'", {("region",): None}, FeatureNotSupported),
])
def test_having_names_that_are_refused(sql: str, answers: dict[tuple[str, ...], DPError | None],
                                       error: type[DPError]) -> None:
    with pytest.raises(error):
        answered(sql, answers)


# ---------------------------------------------------------------------------- ORDER BY


def test_a_bare_order_by_name_is_an_output_column_first() -> None:
    """`COUNT(*) AS duration ... ORDER BY duration` sorts by the count (Postgres asks no
    question: an output column of the name exists), by its position in the result."""
    query = answered("SELECT country, COUNT(*) AS duration FROM visits GROUP BY country "
                     "ORDER BY duration DESC, country", {})
    assert clause(result_of(query, ("US", 50)), "ORDER BY") == "ORDER BY 2 DESC, 1"
    # the first of equal ones
    query = answered("SELECT country AS x, country AS x, COUNT(*) FROM visits GROUP BY 1 "
                     "ORDER BY x", {})
    assert clause(result_of(query, ("US", 5)), "ORDER BY") == "ORDER BY 1"


def test_a_bare_order_by_name_of_two_different_output_columns_is_ambiguous() -> None:
    with pytest.raises(AmbiguousColumn) as err:
        analysed("SELECT country AS x, COUNT(*) AS x FROM visits GROUP BY country ORDER BY x")
    assert err.value.sqlstate == "42702" and err.value.message == 'ORDER BY "x" is ambiguous'


def test_a_bare_order_by_name_that_is_no_output_column_is_an_input_column() -> None:
    query = answered("SELECT COUNT(*) AS n FROM visits GROUP BY country ORDER BY country DESC",
                     {("country",): None})
    assert [o.name for o in query.outputs] == ["n", "dp_hidden1"]
    assert clause(result_of(query, (5, "US")), "ORDER BY") == "ORDER BY dp_c1 DESC"
    # the key, grouped by anyway, is released at no cost: the plan is the query's without it
    unsorted = analysed("SELECT COUNT(*) AS n FROM visits GROUP BY country")
    assert len(query.keys) == len(unsorted.keys) == 1
    assert make_plan(query, 1.0, 1e-6, 1, NoiseKind.LAPLACE) == \
        make_plan(unsorted, 1.0, 1e-6, 1, NoiseKind.LAPLACE)
    with pytest.raises(GroupingError):
        answered("SELECT country, COUNT(*) AS n FROM visits GROUP BY country ORDER BY browser",
                 {("browser",): _ungrouped("visits.browser")})


@pytest.mark.parametrize("order_by", ["n + 1", "-n", "abs(n)"])
def test_an_alias_inside_an_order_by_expression_is_no_column(order_by: str) -> None:
    """Postgres reads names inside ORDER BY expressions as input columns only (42703 where none
    has the name): no extension there."""
    with pytest.raises(UndefinedColumn):
        answered(f"SELECT country, COUNT(*) AS n FROM visits GROUP BY country ORDER BY {order_by}",
                 {("n",): _absent("n")})


def test_an_order_by_expression_reads_the_input_column_where_an_alias_has_its_name() -> None:
    """`browser AS country ... ORDER BY country || ''`: the column country (ungrouped: 42803),
    not the output column; grouped (as written), its value, released hidden."""
    with pytest.raises(GroupingError):
        answered("SELECT browser AS country, COUNT(*) FROM visits GROUP BY browser "
                 "ORDER BY country || ''", {("country",): _ungrouped("visits.country")})
    query = answered("SELECT browser AS country, COUNT(*) FROM visits v GROUP BY browser, "
                     "v.country ORDER BY country || '', 1", {("country",): None})
    assert clause(result_of(query, ("Chrome", 5, "US")), "ORDER BY") == \
        "ORDER BY dp_c2 || '', 1"


# ---------------------------------------------------------------------------- the result query


def test_the_result_query_reads_no_name_itself() -> None:
    """A name left in an expression over released values is refused, never taken for an
    output column's (the result query's columns are dp_c0, dp_c1 ...)."""
    with pytest.raises(FeatureNotSupported, match="read only GROUP BY keys and DP aggregates"):
        result_sql(["country", "n"], [("pg_catalog", "text"), ("pg_catalog", "int8")],
                   [("US", 5)], sources=[parse_sql("SELECT country")[0].stmt.targetList[0].val,
                                         parse_sql("SELECT count(*)")[0].stmt.targetList[0].val],
                   having=parse_sql("SELECT n > 1")[0].stmt.targetList[0].val)


def test_a_group_by_name_an_input_column_has_is_that_column() -> None:
    """`browser AS country ... GROUP BY browser, country`: Postgres groups by the input column
    country (an input column has the name), so HAVING reads it grouped; the proxy asks which
    (analysis.GROUP_NAME) before it reads HAVING's names against that grouping."""
    from dp_core.analysis import GROUP_NAME

    sql = ("SELECT browser AS country, COUNT(*) FROM visits GROUP BY browser, country "
           "HAVING country = 'US'")
    assert analysed(sql).name_checks == ((GROUP_NAME, "country"),)  # (GROUP BY's names first)
    grouping: dict[tuple[str, ...], DPError | None] = {(GROUP_NAME, "country"): None}
    assert analysed(sql, grouping).name_checks == (("country",),)
    q = analysed(sql, {**grouping, ("country",): None})
    assert q.name_checks == ()
    assert [node_sql(g) for g in q.grouped_by] == ["browser", "country"]
    # where no input column has it, the alias's expression
    q = answered("SELECT left(browser, 1) AS initial, COUNT(*) FROM visits GROUP BY initial",
                 {(GROUP_NAME, "initial"): _absent("initial")})
    assert [node_sql(g) for g in q.grouped_by] == ['"left"(browser, 1)']


@pytest.mark.parametrize("sql", [
    "SELECT country, COUNT(*) AS n FROM visits GROUP BY country HAVING bool_and(duration > 0)",
    "SELECT country, COUNT(*) AS n FROM visits GROUP BY country ORDER BY string_agg(browser, ',')",
    "SELECT country, COUNT(*) AS n FROM visits GROUP BY country HAVING mode() WITHIN GROUP "
    "(ORDER BY browser) = 'Chrome'",
])
def test_an_aggregate_without_a_dp_form_in_having_or_order_by_is_refused(sql: str) -> None:
    """Postgres would aggregate rows with it: refused (0A000) before Postgres is asked about the
    columns inside, whose 42803 would say they are not inside an aggregate."""
    with pytest.raises(FeatureNotSupported, match="aggregates without a DP form"):
        analysed(sql)


def test_order_by_of_select_distinct_is_of_select_list_expressions() -> None:
    for order_by in ("country", "1", "visits.country DESC"):
        query = answered(f"SELECT DISTINCT country FROM visits ORDER BY {order_by}",
                         {("visits", "country"): None} if "." in order_by else {})
        assert len(query.order_by) == 1
    with pytest.raises(InvalidColumnReference) as err:
        answered("SELECT DISTINCT country FROM visits ORDER BY upper(country)",
                 {("country",): None})
    assert err.value.sqlstate == "42P10"
