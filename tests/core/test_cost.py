"""The static per-row work bound of DP query expressions (dp_core.cost), by hand, and the refusal
of the amplifiers issue 35 names: growth by nesting, by width, behind guarded branches, in every
place an expression stands."""

from __future__ import annotations

import pytest
from pglast import parse_sql

from dp_core.analysis import analyze, parse_select
from dp_core.cost import Cost, Linear, RowWorkBudget, row_cost
from dp_core.errors import FeatureNotSupported
from dp_core.query import Bounds, TablePolicy

POLICY = {
    "visits": TablePolicy("public", "uid", {"duration": Bounds(0, 3600)}),
    "purchases": TablePolicy("public", "uid", {"amount": Bounds(0, 500)}),
}


def cost(expr: str) -> Cost:
    return row_cost(parse_sql(f"SELECT {expr}")[0].stmt.targetList[0].val)


def test_bounds_by_hand() -> None:
    # a column: its own bytes, no work beyond reading the row
    assert cost("browser") == Cost(Linear(1, 0), Linear(0, 0))
    # upper(x): the value's size (+16 for a word), reading it, then writing the result
    assert cost("upper(browser)") == Cost(Linear(1, 16), Linear(2, 16))
    # lpad to 10 characters: at most 40 bytes whatever the input (4 bytes a character)
    assert cost("lpad(browser, 10, '*')").size == Linear(0, 40)
    # replace('C' by ten of them): the value grows tenfold at most
    assert cost("replace(browser, 'C', 'CCCCCCCCCC')").size == Linear(10, 0)
    assert cost("replace(browser, 'abc', 'x')").size == Linear(1, 0)  # (shrinks: no growth)
    # nesting multiplies: three tenfold replaces of a 100-character pad
    nested = "replace(replace(replace(lpad(browser, 100, 'C'), 'C', 'CCCCCCCCCC'), 'C', " \
             "'CCCCCCCCCC'), 'C', 'CCCCCCCCCC')"
    assert cost(nested).size == Linear(0, 400_000)
    # concat adds its arguments' sizes, so does ||
    assert cost("concat(browser, country, 'xy')").size == Linear(2, 2)
    assert cost("browser || country").size == Linear(2, 0)
    # CASE: the widest branch, the work of all
    assert cost("CASE WHEN duration > 1 THEN lpad(browser, 100) ELSE browser END").size == \
        Linear(1, 400)
    # LIKE backs up over the value once per pattern character
    assert cost("browser LIKE 'C%'").work == Linear(2, 2)  # (the pattern: 2 characters)


AMPLIFIERS = [
    # growth by nesting
    "length(replace(replace(replace(lpad(browser, 10000, 'C'), 'C', 'CCCCCCCCCC'), 'C', "
    "'CCCCCCCCCC'), 'C', 'CCCCCCCCCC')) > 0",
    "length(replace(replace(browser, 'a', repeat_me), 'a', 'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa')) > 0"
    .replace("repeat_me", "'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'"),
    # growth by width
    "md5(concat(" + ", ".join(["lpad(browser, 1000, 'x')"] * 100) + ")) > 'a'",
    "md5(" + " || ".join(["browser"] * 40) + ") > 'a'",
    "length(rpad(country, 9000)) > 1",
    # behind a guarded branch: bounded as if taken
    "CASE WHEN duration > 300 THEN length(replace(replace(lpad(browser, 1000, 'C'), 'C', "
    "'CCCCCCCCCC'), 'C', 'CCCCCCCCCC')) ELSE 1 END > 0",
    "coalesce(CASE WHEN uid = 1 THEN md5(lpad(browser, 5000)) END, 'x') = 'y'",
    # LIKE over a grown value
    "lpad(browser, 1000) LIKE '%a%b%c%d%e%f%g%h%'",
]


@pytest.mark.parametrize("expr", AMPLIFIERS, ids=range(len(AMPLIFIERS)))
@pytest.mark.parametrize("place", ["WHERE", "key", "aggregate", "FILTER", "JOIN", "subquery"])
def test_amplifiers_are_refused_wherever_they_stand(expr: str, place: str) -> None:
    sql = {
        "WHERE": f"SELECT count(*) FROM visits WHERE {expr}",
        "key": f"SELECT ({expr}) AS k, count(*) FROM visits GROUP BY 1",
        "aggregate": f"SELECT sum(CASE WHEN {expr} THEN 1 ELSE 0 END) FROM visits",
        "FILTER": f"SELECT count(*) FILTER (WHERE {expr}) FROM visits",
        "JOIN": f"SELECT count(*) FROM visits JOIN purchases p ON p.uid = visits.uid AND {expr}",
        "subquery": f"SELECT count(*) FROM (SELECT uid FROM visits WHERE {expr}) s",
    }[place]
    with pytest.raises(FeatureNotSupported, match="work on one row"):
        analyze(parse_select(sql), POLICY, plain_form=True)


def test_ordinary_queries_fit_and_the_budget_is_configurable() -> None:
    ordinary = ("SELECT upper(browser) || '-' || lower(country) AS k, count(*), sum(duration), "
                "avg(duration * 2 + 1) FROM visits WHERE browser LIKE 'C%' AND country IN "
                "('US', 'DE', 'FR') AND substring(browser, 1, 3) <> 'x' GROUP BY 1")
    analyze(parse_select(ordinary), POLICY, plain_form=True)
    with pytest.raises(FeatureNotSupported, match="work on one row"):
        analyze(parse_select(ordinary), POLICY, plain_form=True,
                row_work=RowWorkBudget(per_byte=4, fixed=4096))
    wide = "SELECT count(*) FROM visits WHERE length(lpad(browser, 3000)) > 1"
    with pytest.raises(FeatureNotSupported, match="the costliest is WHERE: length"):
        analyze(parse_select(wide), POLICY, plain_form=True)
    analyze(parse_select(wide), POLICY, plain_form=True,
            row_work=RowWorkBudget(per_byte=64, fixed=40_000))


def _levels(inner: str, step: str, n: int, cte: bool = False) -> str:
    """A query reading `b` through `n` nested subqueries (or WITH queries), each making
    `step` of the level below's `b`, the first level `inner` of visits."""
    if cte:
        withs = [f"s0 AS (SELECT uid, {inner} AS b FROM visits)"]
        withs += [f"s{i} AS (SELECT uid, {step} AS b FROM s{i - 1})" for i in range(1, n + 1)]
        return f"WITH {', '.join(withs)} SELECT count(*) FROM s{n} WHERE length(b) > 3"
    sql = f"SELECT uid, {inner} AS b FROM visits"
    for i in range(n):
        sql = f"SELECT uid, {step} AS b FROM ({sql}) s{i}"
    return f"SELECT count(*) FROM ({sql}) s WHERE length(b) > 3"


@pytest.mark.parametrize("cte", [False, True])
def test_growth_through_nested_queries_counts_at_each_level(cte: bool) -> None:
    """A column of a subquery or WITH query holds what its select list made: seven levels of
    `concat(b, b)` over `lpad(browser, 230)` make 29 kB of each row (one user's rows, given
    it by a CASE, took 0.65 s more through the proxy), each level priced as if it read the
    row's own values. The level above reads the level below's largest value."""
    grown = _levels("CASE WHEN uid = 42 THEN lpad(browser, 230, 'e') ELSE '' END",
                    "concat(b, b)", 7, cte)
    with pytest.raises(FeatureNotSupported, match="work on one row"):
        analyze(parse_select(grown), POLICY, plain_form=True)
    with pytest.raises(FeatureNotSupported, match="work on one row"):
        analyze(parse_select(_levels("lpad(browser, 230, 'e')", "b || b", 4, cte)), POLICY,
                plain_form=True)
    # levels that keep the row's size, or add a little, fit
    analyze(parse_select(_levels("lower(browser)", "concat(b, 'x')", 7, cte)), POLICY,
            plain_form=True)
    analyze(parse_select(_levels("browser", "concat(b, b)", 2, cte)), POLICY, plain_form=True)


def test_deep_nesting_is_refused_before_the_analysis_recurses() -> None:
    from dp_core.errors import StatementTooComplex

    deep = "SELECT count(*) FROM visits WHERE md5(" + " || ".join(["browser"] * 300) + ") > 'a'"
    with pytest.raises(StatementTooComplex) as exc:
        parse_select(deep)
    assert exc.value.sqlstate == "54001"


def test_nested_date_trunc_counts_the_copies_its_total_form_makes() -> None:
    """date_trunc's total form tests its value twice before the call: nested, the pushdown
    (and the work per row) would triple at each level."""
    policy = {"events": TablePolicy("public", "uid", {})}
    one = "SELECT count(*) FROM events WHERE date_trunc('day', ts) IS NOT NULL"
    analyze(parse_select(one), policy, plain_form=True)
    nested = "ts"
    for unit in ("hour", "day", "week", "month", "year", "hour", "day", "week"):
        nested = f"date_trunc('{unit}', {nested})"
    assert cost(nested).work.per_byte >= 3 ** 8
    with pytest.raises(FeatureNotSupported, match="work on one row"):
        analyze(parse_select(f"SELECT count(*) FROM events WHERE {nested} IS NOT NULL"), policy,
                plain_form=True)
