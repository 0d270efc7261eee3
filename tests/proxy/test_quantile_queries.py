"""Quantiles and APPROX_BOUNDS end to end: psql and drivers through the proxy, the SQL tree
and histogram checked against the Python ones on the real data."""

from __future__ import annotations

import asyncio
import math
import re
import subprocess

import asyncpg
import numpy as np
import psycopg
import pytest

from dp_core.quantiles import BINS, EDGES, bin_of, tree_codes
from dp_core.release import tree_arrays
from dp_core.rewrite import pushdown
from tests.support.backend import Backend
from tests.support.clients import psql
from tests.support.engine import build
from tests.support.proxy import Proxy, spent


def _fetch(dsn: str, sql: str, *args: object) -> list[asyncpg.Record]:
    async def go() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(dsn)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    return asyncio.run(go())


def _notices(proxy: Proxy, sql: str) -> tuple[list[tuple], list[tuple[str, str]]]:
    notices: list[tuple[str, str]] = []
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notices.append((d.message_primary or "",
                                                          d.message_detail or "")))
        rows = conn.execute(sql).fetchall()
    return rows, notices


def test_median_by_country_through_psql(proxy: Proxy, fresh_budgets: None) -> None:
    """The issue's query, as an analyst types it."""
    done = psql(proxy, "SELECT WITH ANONYMIZATION country, ANON_MEDIAN(duration, 0, 3600) "
                       "FROM visits GROUP BY country ORDER BY 1")
    assert done.returncode == 0 and not done.stderr.startswith("ERROR"), done.stderr
    lines = [ln for ln in done.stdout.splitlines() if "|" in ln]
    assert lines[0].split("|")[0].strip() == "country" and lines[0].split("|")[1].strip() == "anon_median"
    values = [float(ln.split("|")[1]) for ln in lines[1:]]
    assert len(values) >= 5 and all(0 <= v <= 3600 for v in values)


def test_global_median_lands_near_the_users_median(proxy: Proxy, fresh_budgets: None, backend: Backend) -> None:
    (truth,) = _fetch(backend.pushdown.uri(),
                      "SELECT array_agg(m ORDER BY m) AS ms FROM (SELECT percentile_cont(0.5) WITHIN GROUP "
                      "(ORDER BY duration::float8) AS m FROM visits GROUP BY uid) s WHERE m IS NOT NULL")
    users = np.array(truth["ms"], dtype=np.float64)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        cur = conn.execute("SELECT WITH ANONYMIZATION ANON_MEDIAN(duration, 0, 3600) AS m, "
                           "ANON_MIN(duration, 0, 3600), ANON_MAX(duration, 0, 3600) FROM visits")
        assert [d.name for d in cur.description] == ["m", "anon_min", "anon_max"]
        assert [d.type_code for d in cur.description] == [701, 701, 701]
        m, lo, hi = cur.fetchone() or ()
    rank = np.searchsorted(users, m) / len(users)
    # 20k users, epsilon 1/3 per tree: rank error far below 0.05
    assert abs(rank - 0.5) <= 0.05, (m, rank)
    assert np.searchsorted(users, lo) / len(users) <= 0.05
    assert np.searchsorted(users, hi) / len(users) >= 0.95


@pytest.mark.parametrize("null_parity", [0, 1])
def test_a_group_whose_equal_keys_print_differently_gets_its_tree(
        proxy: Proxy, fresh_budgets: None, backend: Backend, null_parity: int) -> None:
    """One group of 1.0 (even users) and 1.00 (odd users): only the users of one parity have
    values, so the tree statement prints the key as they do; the main statement prints
    whichever of its users comes first. Matched by text, one of the two parities left the
    group with an empty tree's answer; numeric keys are matched by hash."""
    value = f"CASE WHEN uid % 2 = {null_parity} THEN NULL ELSE duration END"
    (truth,) = _fetch(backend.pushdown.uri(),
                      "SELECT array_agg(m ORDER BY m) AS ms FROM (SELECT percentile_cont(0.5) WITHIN "
                      f"GROUP (ORDER BY ({value})::float8) AS m FROM visits GROUP BY uid) s "
                      "WHERE m IS NOT NULL")
    users = np.array(truth["ms"], dtype=np.float64)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        rows = conn.execute("SELECT WITH ANONYMIZATION CASE WHEN uid % 2 = 0 THEN 1.0 ELSE 1.00 END "
                            f"AS k, ANON_MEDIAN({value}, 0, 3600) FROM visits GROUP BY 1").fetchall()
    assert len(rows) == 1 and rows[0][0] in (1, 1.0), rows
    rank = np.searchsorted(users, rows[0][1]) / len(users)
    assert abs(rank - 0.5) <= 0.05, (rows, rank)


def test_plain_percentile_cont_min_max_for_bi_tools(proxy: Proxy, fresh_budgets: None) -> None:
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        for binary in (False, True):
            cur = conn.cursor(binary=binary)
            rows = cur.execute("SELECT browser, percentile_cont(0.5) WITHIN GROUP (ORDER BY duration), "
                               "min(duration), max(duration) FROM visits GROUP BY browser "
                               "ORDER BY 2 DESC").fetchall()
            assert [d.name for d in cur.description] == ["browser", "percentile_cont", "min", "max"]
            assert rows and all(0 <= v <= 3600 for r in rows for v in r[1:])
            assert [r[1] for r in rows] == sorted((r[1] for r in rows), reverse=True)


def test_quantile_with_parameters_over_the_extended_protocol(proxy: Proxy, fresh_budgets: None) -> None:
    async def go() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(proxy.uri())
        try:
            stmt = await conn.prepare("SELECT WITH ANONYMIZATION ANON_NTILE(duration, 0.9, 0, 3600) AS p90, "
                                      "ANON_COUNT(*) AS n FROM visits WHERE browser = $1")
            return list(await stmt.fetch("Firefox"))
        finally:
            await conn.close()

    (row,) = asyncio.run(go())
    assert 0 <= row["p90"] <= 3600 and row["n"] > 100


def test_pushed_down_tree_equals_the_python_tree(backend: Backend) -> None:
    """The tree statement's nodes are exactly tree_codes of the users' own quantiles."""
    query, plan, _ = build("SELECT WITH ANONYMIZATION ANON_NTILE(duration, 0.75, 0, 3600) FROM visits "
                           "WHERE browser = 'Safari'")
    pd = pushdown(query, plan, {0: "int4"}, order_seed=1)
    assert pd.main is None and pd.trees is not None
    (row,) = _fetch(backend.pushdown.uri(), pd.trees)
    (truth,) = _fetch(backend.pushdown.uri(),
                      "SELECT array_agg(q) AS qs FROM (SELECT percentile_cont(0.75) WITHIN GROUP "
                      "(ORDER BY duration::float8) AS q FROM visits WHERE browser = 'Safari' GROUP BY uid) s "
                      "WHERE q IS NOT NULL")
    codes, counts = tree_codes(np.array(truth["qs"], dtype=np.float64), 0.0, 3600.0)
    assert row["dp_agg"] == 0
    got_codes, got_counts = tree_arrays(row)
    assert got_codes.tolist() == codes.tolist() and got_counts.tolist() == counts.tolist()


def test_width_bucket_equals_the_python_bins(backend: Backend) -> None:
    specials = [0.0, -0.0, 1.0, 1.5, 3600.0, -0.75, 1e-12, 2.0**-32, 2.0**95, 1e40, -1e40, 7e-300]
    edges = ", ".join(str(e) for e in EDGES)
    rows = _fetch(backend.pushdown.uri(),
                  f"SELECT v::float8 AS v, width_bucket(v::numeric, (ARRAY[{edges}])::numeric[]) AS b "
                  "FROM unnest($1::float8[]) AS v", specials)
    for r in rows:
        assert r["b"] == int(bin_of(np.array([r["v"]]))[0]), r
    (nan,) = _fetch(backend.pushdown.uri(),
                    f"SELECT width_bucket('NaN'::numeric, (ARRAY[{edges}])::numeric[]) AS b")
    assert nan["b"] == BINS - 1 == int(bin_of(np.array([math.nan]))[0])


# ---------------------------------------------------------------------------- APPROX_BOUNDS


def test_approx_bounds_spends_its_share_and_says_what_it_chose(proxy: Proxy, fresh_budgets: None) -> None:
    sql = ("SELECT WITH ANONYMIZATION OPTIONS(epsilon=1) browser, ANON_AVG(duration + 0) AS a, "
           "ANON_MEDIAN(duration * 2) AS m FROM visits GROUP BY browser")
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        before = spent(conn)
        plan_text = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql).fetchall())
        assert spent(conn) == before
    assert "APPROX_BOUNDS for a: log-scale histogram" in plan_text and "epsilon 0.125" in plan_text
    assert "noise scaled to the bounds APPROX_BOUNDS finds" in plan_text
    rows, notices = _notices(proxy, sql)
    ((message, detail),) = notices
    assert "spent epsilon 1," in message
    assert "APPROX_BOUNDS chose [" in detail and "for a (epsilon 0.125)" in detail
    assert "of its per-user values were clamped" in detail
    assert rows and all(0 <= r[1] <= 4096 and 0 <= r[2] <= 8192 for r in rows)
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        assert spent(conn).epsilon == pytest.approx(before.epsilon + 1.0)


def test_approx_bounds_without_enough_users_is_a_clear_charged_error(proxy: Proxy, fresh_budgets: None) -> None:
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InvalidParameterValue) as exc:
            conn.execute("SELECT WITH ANONYMIZATION OPTIONS(epsilon=0.05) ANON_SUM(duration + 0) AS s "
                         "FROM visits WHERE uid < 50").fetchall()
        assert "APPROX_BOUNDS found no value range for s" in str(exc.value)
        assert exc.value.diag.message_hint and "write the bounds" in exc.value.diag.message_hint
        assert spent(conn).epsilon == pytest.approx(0.05)


def test_psql_shows_the_approx_bounds_notice(proxy: Proxy, fresh_budgets: None) -> None:
    done: subprocess.CompletedProcess[str] = psql(
        proxy, "SELECT WITH ANONYMIZATION ANON_SUM(duration + 0) FROM visits")
    assert done.returncode == 0
    assert "APPROX_BOUNDS chose" in done.stderr, done.stderr


def test_a_quantiles_notice_and_explain_give_its_rank_error(proxy: Proxy,
                                                             fresh_budgets: None) -> None:
    """Issue 30: a quantile's error measure is the rank its answer may be off by, in users
    (`quantiles.rank_half_width_95`), the same in EXPLAIN (before any charge) and the notice."""
    sql = ("SELECT WITH ANONYMIZATION browser, ANON_MEDIAN(duration, 0, 3600) AS med "
           "FROM visits GROUP BY browser")
    with psycopg.connect(proxy.dsn(), autocommit=True) as conn:
        plan_text = "\n".join(r[0] for r in conn.execute("EXPLAIN " + sql).fetchall())
    explained = re.search(r"the answer within about ±([\d.]+) users of the wanted rank \(95%\)",
                          plan_text)
    assert explained is not None, plan_text
    _, notices = _notices(proxy, sql)
    ((_, detail),) = notices
    told = re.search(r"med rank ±([\d.]+) users", detail)
    assert told is not None and told.group(1) == explained.group(1), detail
