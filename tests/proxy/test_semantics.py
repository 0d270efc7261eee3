"""What a DP query computes is what the same SQL computes in Postgres, up to the noise.

Each user of the demo data has one country, so counting users by country at C_u = 1 drops
nothing by contribution bounding; at ε = 10 (the cap) a user count's Laplace noise has scale
0.1, so the released count is the true one within 2 (probability of a miss e^-15 per group)
and every group of 7 users or more passes τ (2.31; 3.62 where ε is split between the
threshold and a filtered count, scale 0.2: a group of 5 would miss it with probability 5e-4,
of 7 with 2e-8). Each case pairs a DP query with the plain query Postgres runs as superuser;
the released groups must be the groups of 7 users or more (with none of fewer than 2; a
FILTER leaves the groups as they are), their counts within 2 of Postgres's. This is what checks the
rewrites that change SQL (FILTER to CASE, subqueries over public tables made total, integer
arithmetic and casts made total, a query
around a DP query, DISTINCT to GROUP BY) against Postgres's own reading of it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import psycopg
import pytest

from tests.support.backend import Backend
from tests.support.proxy import Proxy, reset_budget, spent

DP = "SELECT WITH ANONYMIZATION OPTIONS(epsilon=10) "

GROUPS = "SELECT country, count(DISTINCT uid) FROM visits GROUP BY country"
"""A FILTER leaves the groups as they are: partition selection counts all their users."""

CASES: dict[str, tuple[str, ...]] = {
    "a join on the uid (the semi-join a WHERE subquery would be)": (
        DP + "country, ANON_COUNT(DISTINCT uid) FROM visits v JOIN purchases p USING (uid) "
        "WHERE p.amount > 100 GROUP BY country",
        "SELECT country, count(DISTINCT uid) FROM visits v WHERE uid IN "
        "(SELECT uid FROM purchases WHERE amount > 100) GROUP BY country"),
    # (a correlated EXISTS is refused: it would run once per row; the same filter as an IN)
    "IN over a public table, outside Europe": (
        DP + "country, ANON_COUNT(DISTINCT uid) FROM visits v WHERE country IN (SELECT code FROM "
        "countries c WHERE c.region <> 'Europe') GROUP BY country",
        "SELECT country, count(DISTINCT uid) FROM visits v WHERE EXISTS (SELECT 1 FROM "
        "countries c WHERE c.code = v.country AND c.region <> 'Europe') GROUP BY country"),
    "IN over a public table": (
        DP + "country, ANON_COUNT(DISTINCT uid) FROM visits WHERE country IN "
        "(SELECT code FROM countries WHERE region = 'Europe') GROUP BY country",
        "SELECT country, count(DISTINCT uid) FROM visits WHERE country IN "
        "(SELECT code FROM countries WHERE region = 'Europe') GROUP BY country"),
    "COUNT(DISTINCT uid) FILTER": (
        DP + "country, ANON_COUNT(DISTINCT uid) FILTER (WHERE duration > 600) FROM visits "
        "GROUP BY country",
        "SELECT country, count(DISTINCT uid) FILTER (WHERE duration > 600) FROM visits "
        "GROUP BY country", GROUPS),
    "COUNT(*) FILTER (one per user)": (
        DP + "country, ANON_COUNT(*) FILTER (WHERE browser = 'Chrome') FROM visits "
        "GROUP BY country",
        "SELECT country, count(DISTINCT uid) FILTER (WHERE browser = 'Chrome') FROM visits "
        "GROUP BY country", GROUPS),
    "integer division truncates, as in Postgres": (
        DP + "country, ANON_COUNT(DISTINCT uid) FROM visits WHERE duration / 600 = 1 "
        "GROUP BY country",
        "SELECT country, count(DISTINCT uid) FROM visits WHERE duration / 600 = 1 "
        "GROUP BY country"),
    "an integer cast of arithmetic (guarded)": (
        DP + "country, ANON_COUNT(DISTINCT uid) FROM visits WHERE (duration / 600.0)::int = 1 "
        "AND (uid % 7 + 1)::int2 > 2 GROUP BY country",
        "SELECT country, count(DISTINCT uid) FROM visits WHERE (duration / 600.0)::int = 1 "
        "AND (uid % 7 + 1)::int2 > 2 GROUP BY country"),
    "text functions with literal arguments": (
        DP + "country, ANON_COUNT(DISTINCT uid) FROM visits WHERE substring(country from 1 for 1) "
        "IN ('B', 'C') AND left(browser, 2) <> 'Ed' GROUP BY country",
        "SELECT country, count(DISTINCT uid) FROM visits WHERE substring(country from 1 for 1) "
        "IN ('B', 'C') AND left(browser, 2) <> 'Ed' GROUP BY country"),
    "width_bucket (NaN guarded)": (
        DP + "country, ANON_COUNT(DISTINCT uid) FROM visits WHERE width_bucket(duration, 0, "
        "3600, 6) = 2 GROUP BY country",
        "SELECT country, count(DISTINCT uid) FROM visits WHERE width_bucket(duration, 0, "
        "3600, 6) = 2 GROUP BY country"),
    "|| of text": (
        DP + "country, ANON_COUNT(DISTINCT uid) FROM visits WHERE lower(browser) || '/' || "
        "country LIKE 'chrome/%' GROUP BY country",
        "SELECT country, count(DISTINCT uid) FROM visits WHERE lower(browser) || '/' || "
        "country LIKE 'chrome/%' GROUP BY country"),
    # (ILIKE runs as lower(x) LIKE lower(pattern), the LIKE under "C": so Postgres computes it
    # in a multibyte database, and it answers under a nondeterministic collation too)
    "ILIKE and NOT ILIKE": (
        DP + "country, ANON_COUNT(DISTINCT uid) FROM visits WHERE browser ILIKE '%R_m%' AND "
        "country NOT ILIKE 'u%' GROUP BY country",
        "SELECT country, count(DISTINCT uid) FROM visits WHERE browser ILIKE '%R_m%' AND "
        "country NOT ILIKE 'u%' GROUP BY country"),
    "a query around a DP query": (
        "SELECT t.country, t.n FROM (" + DP + "country, ANON_COUNT(DISTINCT uid) AS n "
        "FROM visits GROUP BY country) AS t WHERE t.country LIKE 'B%'",
        "SELECT country, count(DISTINCT uid) FROM visits WHERE country LIKE 'B%' "
        "GROUP BY country"),
}


def _truth(backend: Backend, sql: str) -> dict[object, int]:
    async def go() -> dict[object, int]:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            return {r[0]: int(r[1]) for r in await conn.fetch(sql)}
        finally:
            await conn.close()

    return asyncio.run(go())


def _check(released: dict[object, int], truth: dict[object, int],
           groups: dict[object, int]) -> None:
    """`groups`: each group's users, what partition selection counts."""
    for key, n in groups.items():
        if n >= 7:
            assert key in released, (key, n)
    for key, n in released.items():
        assert groups.get(key, 0) >= 2, (key, n)  # (τ 2.31: one user's group never passes)
        assert abs(n - truth[key]) <= 2, (key, n, truth[key])


@pytest.mark.parametrize("name", list(CASES))
def test_dp_query_computes_what_postgres_computes(proxy: Proxy, backend: Backend,
                                                   name: str) -> None:
    dp_sql, raw_sql, *groups_sql = CASES[name]
    truth = _truth(backend, raw_sql)
    groups = _truth(backend, groups_sql[0]) if groups_sql else truth
    assert sum(n >= 7 for n in truth.values()) >= 2, "a case that tests little"
    reset_budget(proxy)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        released = {r[0]: int(r[1]) for r in conn.execute(dp_sql).fetchall()}
    _check(released, truth, groups)


def test_distinct_keys_are_the_groups_of_enough_users(proxy: Proxy, backend: Backend) -> None:
    truth = _truth(backend, "SELECT country, count(DISTINCT uid) FROM visits "
                            "WHERE duration > 600 GROUP BY country")
    reset_budget(proxy)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        conn.execute("SET dp.epsilon = 10")
        released = {r[0] for r in conn.execute(
            "SELECT DISTINCT country FROM visits WHERE duration > 600")}
    assert {k for k, n in truth.items() if n >= 5} <= released
    assert all(truth.get(k, 0) >= 2 for k in released)


# ---------------------------------------------------------------------------- names (issue 34)
# A name in HAVING or ORDER BY means what it means to Postgres: HAVING reads input columns (the
# FROM items'), a bare ORDER BY name is an output column first, a name inside an ORDER BY
# expression an input column. The one extension: an output alias in HAVING where no input
# column has the name, in any expression (a filter on released values).

REJECTED_BY_POSTGRES = [
    # HAVING reads the input column, which is not grouped, not the alias of its name
    "SELECT country, SUM(duration) AS duration FROM visits GROUP BY country "
    "HAVING duration > 100000",
    # ... a column of any FROM item: a joined table's, a subquery's, a WITH query's
    "SELECT country, COUNT(*) AS amount FROM visits JOIN purchases USING (uid) GROUP BY country "
    "HAVING amount > 10",
    "SELECT s.country, COUNT(*) AS duration FROM (SELECT uid, country, duration FROM visits) s "
    "GROUP BY s.country HAVING duration > 5",
    "WITH w AS (SELECT uid, country, duration FROM visits) SELECT country, COUNT(*) AS duration "
    "FROM w GROUP BY country HAVING duration > 5",
    "SELECT COUNT(*) AS n FROM visits HAVING country = 'US'",
    "SELECT country, COUNT(*) AS n FROM visits GROUP BY country HAVING nope > 1",
    # a name inside an ORDER BY expression is an input column only: never an alias
    "SELECT country, COUNT(*) AS n FROM visits GROUP BY country ORDER BY n + 1",
    "SELECT country, COUNT(*) AS n FROM visits GROUP BY country ORDER BY -n",
    "SELECT browser AS country, COUNT(*) AS n FROM visits GROUP BY browser ORDER BY country || ''",
    "SELECT country, COUNT(*) AS n FROM visits GROUP BY country ORDER BY browser",
    # a bare ORDER BY name of two different output columns
    "SELECT country AS x, COUNT(*) AS x FROM visits GROUP BY country ORDER BY x",
    # SELECT DISTINCT sorts by its select list only
    "SELECT DISTINCT country FROM visits ORDER BY upper(country)",
]


def _postgres_error(backend: Backend, sql: str) -> tuple[str | None, str | None]:
    with psycopg.connect(backend.admin_dsn, autocommit=True) as conn, \
            pytest.raises(psycopg.Error) as err:
        conn.execute(sql)
    return err.value.sqlstate, err.value.diag.message_primary


@pytest.mark.parametrize("sql", REJECTED_BY_POSTGRES)
def test_names_postgres_rejects_are_rejected_with_its_error(proxy: Proxy, backend: Backend,
                                                            sql: str) -> None:
    """Before, the proxy answered most of these with an alias's meaning (`SUM(duration) AS
    duration ... HAVING duration > 100000` filtered on the sum)."""
    expected = _postgres_error(backend, sql)
    reset_budget(proxy)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        with pytest.raises(psycopg.Error) as err:
            conn.execute(sql)
        assert (err.value.sqlstate, err.value.diag.message_primary) == expected
        assert spent(conn).epsilon == 0


@pytest.mark.parametrize("sql", [
    "SELECT upper(browser) AS k, {agg} AS n FROM visits GROUP BY upper(browser) "
    "HAVING upper(browser) <> 'CHROME' AND upper(browser) IN ({big}) "
    "ORDER BY upper(browser) DESC",
    "SELECT upper(browser) AS k, {agg} AS n FROM visits GROUP BY 1 "
    "HAVING length(upper(browser)) > 4 AND upper(browser) IN ({big}) "
    "ORDER BY lower(upper(browser))",
])
def test_a_key_expression_in_having_and_order_by_is_the_key(proxy: Proxy, backend: Backend,
                                                            sql: str) -> None:
    """HAVING and ORDER BY may repeat a GROUP BY expression that reads columns, as Postgres
    allows (it matches the expression before the columns inside): the proxy refused it with
    42803 (`browser` must appear in the GROUP BY clause)."""
    big = "'CHROME', 'SAFARI', 'EDGE', 'FIREFOX'"  # (thousands of users each: all released)
    truth = [k for k, _ in _truth(backend, sql.format(agg="count(*)", big=big)).items()]
    assert len(truth) == 3
    reset_budget(proxy)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        for agg in ("COUNT(*)", "ANON_COUNT(*)"):
            assert [k for k, _ in conn.execute(sql.format(agg=agg, big=big))] == truth
    reset_budget(proxy)


def test_a_grouped_input_column_in_having_is_its_value(proxy: Proxy, backend: Backend) -> None:
    """HAVING reads a grouped column (selected or not), also where an output alias has its name
    (`country AS browser ... HAVING browser = 'Chrome'`: the browser, which the proxy read as
    the country, and released no row)."""
    truth = _truth(backend, "SELECT country, count(DISTINCT uid) FROM visits "
                            "WHERE country IN ('US', 'IN', 'BR') GROUP BY country")
    reset_budget(proxy)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        counts = [int(n) for n, in conn.execute(
            DP + "ANON_COUNT(DISTINCT uid) AS n FROM visits GROUP BY country "
            "HAVING country IN ('US', 'IN', 'BR') ORDER BY country")]
        assert len(counts) == 3
        assert all(abs(n - truth[c]) <= 2 for n, c in zip(counts, sorted(truth), strict=True))
        truth = _truth(backend, "SELECT country AS browser, count(DISTINCT uid) FROM visits v "
                                "GROUP BY country, v.browser HAVING browser = 'Chrome'")
        reset_budget(proxy)
        released = {r[0]: int(r[1]) for r in conn.execute(
            DP + "country AS browser, ANON_COUNT(DISTINCT uid) AS n FROM visits v "
            "GROUP BY country, v.browser HAVING browser = 'Chrome'")}
    assert "US" in released and len(released) >= 3
    # (a user counts in one of its groups, C_u = 1: a Chrome group keeps at most its users)
    assert all(truth.get(c, 0) >= 2 and n <= truth[c] + 2 for c, n in released.items())


@pytest.mark.parametrize(("having", "kept"), [
    ("n >= 500000", lambda n: n >= 500000),
    ("n / 1000 BETWEEN 500 AND 1000000", lambda n: 500 <= n / 1000 <= 1000000),
    ("abs(n) * 2 >= 1000000 AND n IS NOT NULL", lambda n: n * 2 >= 1000000),
])
def test_an_output_alias_in_having_filters_released_values(proxy: Proxy, backend: Backend,
                                                           having: str, kept: Any) -> None:
    """The extension: `n`, an alias of any expression (`ANON_COUNT(DISTINCT uid) * 1000`, which
    was refused where `ANON_COUNT(DISTINCT uid)` alone was not), in any expression of HAVING,
    where no input column is named n (Postgres: 42703). Post-processing: one charge."""
    assert _postgres_error(backend, "SELECT country, count(DISTINCT uid) * 1000 AS n "
                                    f"FROM visits GROUP BY country HAVING {having}")[0] == "42703"
    truth = _truth(backend, GROUPS)
    reset_budget(proxy)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        released = {r[0]: int(r[1]) for r in conn.execute(
            DP + "country, ANON_COUNT(DISTINCT uid) * 1000 AS n FROM visits GROUP BY country "
            f"HAVING {having}")}
        assert spent(conn).epsilon == 10
    assert all(kept(n) for n in released.values())
    assert {c for c, n in truth.items() if n >= 503} <= set(released) \
        <= {c for c, n in truth.items() if n >= 497}


def test_a_bare_order_by_name_is_an_output_column_first(proxy: Proxy, backend: Backend) -> None:
    """`... AS duration ORDER BY duration` sorts by the output column, though visits has a
    column duration (Postgres's rule); a bare name no output column has sorts by the input
    column, released hidden."""
    top = list(_truth(backend, "SELECT country, count(DISTINCT uid) AS duration FROM visits "
                               "GROUP BY country ORDER BY duration DESC LIMIT 5"))
    truth = _truth(backend, GROUPS)
    reset_budget(proxy)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        rows = conn.execute(DP + "country, ANON_COUNT(DISTINCT uid) AS duration FROM visits "
                                 "GROUP BY country ORDER BY duration DESC LIMIT 5").fetchall()
        assert [r[0] for r in rows] == top
        reset_budget(proxy)
        rows = conn.execute(DP + "ANON_COUNT(DISTINCT uid) AS n FROM visits "
                                 "WHERE country IN ('US', 'IN', 'BR') GROUP BY country "
                                 "ORDER BY country DESC").fetchall()
    assert [len(r) for r in rows] == [1, 1, 1]
    assert all(abs(int(n) - truth[c]) <= 2 for (n,), c in zip(rows, ["US", "IN", "BR"],
                                                               strict=True))


def test_a_group_by_name_is_an_input_column_first(proxy: Proxy, backend: Backend) -> None:
    """`GROUP BY browser` of `left(browser, 1) AS browser` groups by the input column browser,
    as Postgres does (one row per browser: several share an initial); `GROUP BY initial` of
    `left(browser, 1) AS initial`, which no input column has, by the alias's expression."""
    by_input = "SELECT left(browser, 1) AS browser, COUNT(*) AS n FROM visits GROUP BY browser"
    by_alias = "SELECT left(browser, 1) AS initial, COUNT(*) AS n FROM visits GROUP BY initial"
    with psycopg.connect(backend.admin_dsn) as admin:
        truth_input = sorted(r[0] for r in admin.execute(by_input).fetchall())
        truth_alias = sorted(r[0] for r in admin.execute(by_alias).fetchall())
    assert len(truth_input) > len(truth_alias)  # (the data tells the two readings apart)
    reset_budget(proxy)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        assert sorted(r[0] for r in conn.execute(by_input).fetchall()) == truth_input
        assert sorted(r[0] for r in conn.execute(by_alias).fetchall()) == truth_alias
        # and HAVING, read against that grouping: the input column browser, grouped
        rows = conn.execute("SELECT left(browser, 1) AS browser, COUNT(*) AS n FROM visits "
                            "GROUP BY browser HAVING browser = 'Safari'").fetchall()
        assert [r[0] for r in rows] == ["S"]
