"""The bench dataset: the demo's shape at a scale factor, generated inside Postgres.

Scale 1 is ≈ 2M visits over 100k users (heavy-tailed rows per user, Zipf
browsers, long-tailed countries, NULL durations); scale s has s times the users.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.demo_data import demo_data_sql, demo_schema_sql  # noqa: E402

USERS_AT_SCALE_1 = 100_000
MIN_VISITS = 4


async def generate(conn: asyncpg.Connection, scale: float = 1.0) -> float:
    """Create and fill visits, purchases and countries; returns the seconds it took."""
    t0 = time.perf_counter()
    async with conn.transaction():
        for stmt in demo_schema_sql() + demo_data_sql(int(USERS_AT_SCALE_1 * scale), MIN_VISITS):
            await conn.execute(stmt)
    return time.perf_counter() - t0
