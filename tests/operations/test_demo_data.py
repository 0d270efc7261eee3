"""The demo dataset has the shape DESIGN §1 and the foundation issue ask for, and is deterministic."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from server.demo_data import BROWSERS, COUNTRIES, DEMO_USERS, demo_data_sql, demo_schema_sql
from server.dsn import parse_dsn
from tests.support.backend import Backend


async def _fetch(dsn: str, sql: str) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(sql))
    finally:
        await conn.close()


@pytest.fixture(scope="module")
def shape(backend: Backend) -> dict[str, Any]:
    q = {
        "visits": "SELECT count(*) AS n, count(DISTINCT uid) AS users, "
                  "count(*) FILTER (WHERE duration IS NULL) AS nulls, min(duration) AS lo, "
                  "max(duration) AS hi, count(DISTINCT browser) AS browsers, "
                  "count(DISTINCT country) AS countries FROM visits",
        "per_user": "SELECT percentile_disc(0.5) WITHIN GROUP (ORDER BY n) AS median, max(n) AS max, "
                    "count(*) FILTER (WHERE n >= 1000) AS heavy FROM "
                    "(SELECT uid, count(*) AS n FROM visits GROUP BY uid) s",
        "browsers": "SELECT browser, count(*) AS n FROM visits GROUP BY browser ORDER BY n DESC",
        "small_countries": "SELECT count(*) AS n FROM (SELECT country FROM visits GROUP BY country "
                           "HAVING count(DISTINCT uid) < 10) s",
        "purchases": "SELECT count(*) AS n, count(DISTINCT uid) AS users, min(amount) AS lo, "
                     "max(amount) AS hi FROM purchases",
        "countries": "SELECT count(*) AS n, count(DISTINCT region) AS regions FROM countries",
    }
    return {k: asyncio.run(_fetch(backend.admin_dsn, v)) for k, v in q.items()}


def test_visits_size_and_users(shape: dict[str, Any]) -> None:
    v = shape["visits"][0]
    assert 180_000 <= v["n"] <= 220_000
    assert v["users"] == DEMO_USERS
    assert v["browsers"] == len(BROWSERS) == 20
    assert 140 <= v["countries"] <= len(COUNTRIES)


def test_rows_per_user_are_heavy_tailed(shape: dict[str, Any]) -> None:
    u = shape["per_user"][0]
    assert u["median"] <= 5, "most users have a handful of rows"
    assert u["max"] >= 1000 and u["heavy"] >= 3, "a few users have thousands"


def test_duration_is_bounded_and_has_nulls(shape: dict[str, Any]) -> None:
    v = shape["visits"][0]
    assert v["lo"] >= 0 and v["hi"] <= 3600
    assert 0.01 * v["n"] <= v["nulls"] <= 0.06 * v["n"]


def test_browser_is_zipf_like(shape: dict[str, Any]) -> None:
    counts = [r["n"] for r in shape["browsers"]]
    assert counts[0] > 1.5 * counts[1] > 1.5 * 0.9 * counts[2]
    assert 12 * counts[-1] < counts[0] < 30 * counts[-1]  # Zipf(1) over 20: a ratio of 20


def test_country_tail_is_long(shape: dict[str, Any]) -> None:
    assert shape["small_countries"][0]["n"] >= 20, "rare countries exist for thresholding to drop"


def test_purchases_and_countries(shape: dict[str, Any]) -> None:
    pu = shape["purchases"][0]
    assert 0.2 * DEMO_USERS <= pu["users"] <= 0.4 * DEMO_USERS
    assert pu["n"] > pu["users"]
    assert pu["lo"] >= 0.5 and pu["hi"] <= 5000
    c = shape["countries"][0]
    assert c["n"] == len(COUNTRIES) and c["regions"] == 5


def test_generation_is_deterministic(backend: Backend) -> None:
    digest = ("SELECT md5(string_agg(uid || browser || country || coalesce(duration, -1), ',' "
              "ORDER BY uid, browser, country, duration)) FROM visits")

    async def regenerate() -> tuple[str, str]:
        before = (await _fetch(backend.admin_dsn, digest))[0][0]
        admin = await asyncpg.connect(backend.admin_dsn)
        try:
            await admin.execute("DROP DATABASE IF EXISTS dpproxy_determinism")
            await admin.execute("CREATE DATABASE dpproxy_determinism")
        finally:
            await admin.close()
        other = parse_dsn(backend.admin_dsn).uri(database="dpproxy_determinism")
        conn = await asyncpg.connect(other)
        try:
            for stmt in demo_schema_sql() + demo_data_sql():
                await conn.execute(stmt)
            after = await conn.fetchval(digest)
        finally:
            await conn.close()
        admin = await asyncpg.connect(backend.admin_dsn)
        try:
            await admin.execute("DROP DATABASE dpproxy_determinism")
        finally:
            await admin.close()
        return before, after

    before, after = asyncio.run(regenerate())
    assert before == after
