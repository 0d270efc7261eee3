"""Prepare a backend database: demo data, the two roles, and a check that the wall holds."""

from __future__ import annotations

import asyncpg

from config import Config
from server.backend_setup import DEFAULT_ROLES, BackendRoles, check_statements, setup_statements
from server.demo_data import demo_data_sql, demo_schema_sql
from server.dsn import DSN
from server.embedded import EmbeddedPostgres

DEMO_DATABASE = "demo"


class BackendSetupError(RuntimeError):
    """The backend is not set up so that protected rows are walled off."""


async def apply_backend_setup(
    conn: asyncpg.Connection, config: Config, database: str, roles: BackendRoles = DEFAULT_ROLES
) -> None:
    """Create the roles and row-level security (idempotent), then verify the result."""
    async with conn.transaction():
        for stmt in setup_statements(config, database, roles):
            await conn.execute(stmt)
    problems = await find_wall_problems(conn, config, roles)
    if problems:
        raise BackendSetupError("; ".join(problems))


async def find_wall_problems(
    conn: asyncpg.Connection, config: Config, roles: BackendRoles = DEFAULT_ROLES
) -> list[str]:
    """Each way in which the restricted role could see protected rows (empty: none)."""
    problems: list[str] = []
    for check in check_statements(config, roles):
        problems.extend(r[0] for r in await conn.fetch(check))
    return problems


def demo_config_text(pushdown: DSN, restricted: DSN, port: int | None = None) -> str:
    """config/demo.toml pointed at an existing backend (for benchmarks and tests)."""
    from config import DEMO_CONFIG

    text = DEMO_CONFIG.read_text().replace(
        "[backend]\nembedded = true",
        f'[backend]\npushdown_dsn = "{pushdown.uri()}"\nrestricted_dsn = "{restricted.uri()}"',
    )
    if "embedded = true" in text:
        raise RuntimeError("config/demo.toml no longer has the expected [backend] section")
    return text if port is None else text.replace("port = 6432", f"port = {port}")


async def load_demo_data(conn: asyncpg.Connection) -> bool:
    """Create and fill the demo tables unless `visits` exists; True when it loaded them."""
    if await conn.fetchval("SELECT to_regclass('public.visits') IS NOT NULL"):
        return False
    async with conn.transaction():
        for stmt in demo_schema_sql() + demo_data_sql():
            await conn.execute(stmt)
    return True


async def prepare_embedded(pg: EmbeddedPostgres, config: Config) -> tuple[DSN, DSN]:
    """Create the demo database in `pg` (loading data unless it is there) and the roles.

    Returns the restricted and pushdown DSNs.
    """
    admin = await asyncpg.connect(pg.dsn())
    try:
        exists = await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", DEMO_DATABASE)
        if not exists:
            await admin.execute(f"CREATE DATABASE {DEMO_DATABASE}")
    finally:
        await admin.close()
    conn = await asyncpg.connect(pg.dsn(database=DEMO_DATABASE))
    try:
        await load_demo_data(conn)
        await apply_backend_setup(conn, config, DEMO_DATABASE)
    finally:
        await conn.close()
    roles = DEFAULT_ROLES
    return (
        DSN(str(pg.socket_dir), pg.port, roles.restricted, DEMO_DATABASE),
        DSN(str(pg.socket_dir), pg.port, roles.pushdown, DEMO_DATABASE),
    )
