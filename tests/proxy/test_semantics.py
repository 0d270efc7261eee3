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

import asyncpg
import psycopg
import pytest

from tests.support.backend import Backend
from tests.support.proxy import Proxy, reset_budget

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
