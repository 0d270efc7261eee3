"""The bench datasets, generated inside Postgres: the demo's shape at a scale, or a heavy-tailed one.

`demo` (the default): scale 1 is ≈ 2M visits over 100k users (Pareto rows per
user, Zipf browsers, long-tailed countries, NULL durations); scale s has s
times the users.

`heavy` (issue 30): scale 1 is 100k users with 1 + Exp(18) visits each, and 50
users with 1,000-6,000 (about 9% of the rows); 80% of a user's visits on their
home browser among 30 Zipf-distributed browsers, 95% in their home country
among 200 Zipf-distributed countries; durations exponential around a per-user
mean, capped at 3600, 1% NULL. The shape where contribution bounds chosen
without the data are far off.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.demo_data import (  # noqa: E402
    BROWSERS,
    COUNTRIES,
    demo_data_sql,
    demo_schema_sql,
    text_array,
    uniform,
    zipf_lower_bounds,
)

USERS_AT_SCALE_1 = 100_000
MIN_VISITS = 4
SHAPES = ("demo", "heavy")

HEAVY_USERS = 50
HEAVY_BROWSERS = [*BROWSERS, "Arc", "Tor Browser", "Epiphany", "Falkon", "Min", "Otter",
                  "Dillo", "NetSurf", "Links", "w3m"]
"""30 browsers (the demo's 20 and 10 more), Zipf(1) by rank."""
HEAVY_COUNTRIES = [code for code, _, _ in COUNTRIES] + [f"{c}{d}" for c in "QWXYZ" for d in range(10)]
"""200 country codes (the demo's 150 and 50 made-up ones), Zipf(1) by rank."""


def heavy_data_sql(users: int) -> list[str]:
    """Statements that fill `visits` (and `countries`) with the heavy-tailed shape (after
    `demo_schema_sql`); `purchases` stays empty."""
    extra = ",".join(f"('{c}', 'Country {c}', 'Elsewhere')" for c in HEAVY_COUNTRIES[len(COUNTRIES):])
    country_rows = ",".join(
        "(" + ",".join("'" + f.replace("'", "''") + "'" for f in row) + ")" for row in COUNTRIES)
    browsers, countries = text_array(HEAVY_BROWSERS), text_array(HEAVY_COUNTRIES)
    browser_zipf = zipf_lower_bounds(len(HEAVY_BROWSERS), 1.0)
    country_zipf = zipf_lower_bounds(len(HEAVY_COUNTRIES), 1.0)
    key = "u.uid::bigint * 10000 + j"
    return [
        f"INSERT INTO countries VALUES {country_rows}, {extra}",
        "CREATE TEMP TABLE heavy_users AS SELECT uid, "
        f"CASE WHEN uid <= {HEAVY_USERS} THEN 1000 + floor(5001 * {uniform('uid', 21)}) "
        f"ELSE 1 + floor(-18 * ln({uniform('uid', 22)})) END::int AS n_visits, "
        f"({browsers})[width_bucket({uniform('uid', 23)}, {browser_zipf})] AS browser, "
        f"({countries})[width_bucket({uniform('uid', 24)}, {country_zipf})] AS country, "
        f"120 + 600 * {uniform('uid', 25)} AS mean_duration "
        f"FROM generate_series(1, {int(users)}) AS uid",
        "INSERT INTO visits (uid, browser, country, duration) SELECT u.uid, "
        f"CASE WHEN {uniform(key, 26)} < 0.8 THEN u.browser "
        f"ELSE ({browsers})[width_bucket({uniform(key, 27)}, {browser_zipf})] END, "
        f"CASE WHEN {uniform(key, 28)} < 0.95 THEN u.country "
        f"ELSE ({countries})[width_bucket({uniform(key, 29)}, {country_zipf})] END, "
        f"CASE WHEN {uniform(key, 30)} < 0.01 THEN NULL "
        f"ELSE least(3600, floor(-u.mean_duration * ln({uniform(key, 31)})))::int END "
        "FROM heavy_users u, generate_series(1, u.n_visits) AS j ORDER BY u.uid, j",
        "DROP TABLE heavy_users",
        "CREATE INDEX visits_uid ON visits (uid)",
        "CREATE INDEX purchases_uid ON purchases (uid)",
        "ANALYZE countries",
        "ANALYZE visits",
        "ANALYZE purchases",
    ]


async def generate(conn: asyncpg.Connection, scale: float = 1.0, shape: str = "demo") -> float:
    """Create and fill visits, purchases and countries; returns the seconds it took."""
    if shape not in SHAPES:
        raise ValueError(f"unknown dataset shape {shape!r} (one of {', '.join(SHAPES)})")
    t0 = time.perf_counter()
    users = int(USERS_AT_SCALE_1 * scale)
    data = demo_data_sql(users, MIN_VISITS) if shape == "demo" else heavy_data_sql(users)
    async with conn.transaction():
        for stmt in demo_schema_sql() + data:
            await conn.execute(stmt)
    return time.perf_counter() - t0
