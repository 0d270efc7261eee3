"""Prepare a backend database: demo data, the two roles, and a check that the wall holds."""

from __future__ import annotations

from dataclasses import replace

import asyncpg

from config import Config
from server.backend_setup import (
    DEFAULT_ROLES,
    BackendDSNs,
    BackendRoles,
    check_statements,
    citus_check_statements,
    hardening_statements,
    setup_statements,
)
from server.demo_data import demo_data_sql, demo_schema_sql
from server.dsn import DSN
from server.embedded import EmbeddedPostgres

DEMO_DATABASE = "demo"


class BackendSetupError(RuntimeError):
    """The backend is not set up so that protected rows are walled off."""


async def apply_backend_setup(
    conn: asyncpg.Connection, config: Config, database: str, roles: BackendRoles = DEFAULT_ROLES,
    login_secret: str | None = None, harden: bool = False,
) -> None:
    """Create the roles and row-level security (idempotent), with `harden` also the
    database-wide closing of `hardening_statements`, then verify the result."""
    async with conn.transaction():
        # one setup at a time: concurrent GRANTs on one object fail ("tuple concurrently updated")
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('dp-proxy backend setup'))")
        if await conn.fetchval("SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL"):
            # Citus: a schema command after a parallel one on a distributed table in one
            # transaction fails ("cannot run schema command because there was a parallel
            # operation"): one connection per worker, one command after the other
            await conn.execute("SET LOCAL citus.multi_shard_modify_mode TO 'sequential'")
        for stmt in setup_statements(config, database, roles, login_secret):
            await conn.execute(stmt)
        if harden:
            for stmt in hardening_statements(roles):
                await conn.execute(stmt)
    problems = await find_wall_problems(conn, config, roles)
    if problems:
        raise BackendSetupError("; ".join(problems))


async def find_wall_problems(
    conn: asyncpg.Connection, config: Config, roles: BackendRoles = DEFAULT_ROLES
) -> list[str]:
    """Each way in which the restricted role could see protected rows (empty: none)."""
    problems: list[str] = []
    checks = check_statements(config, roles)
    if await conn.fetchval("SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL"):
        checks += citus_check_statements(config, roles)  # the shards on the workers too
    for check in checks:
        problems.extend(r[0] for r in await conn.fetch(check))
    return problems


_NUMBER_TYPES = frozenset({"int2", "int4", "int8", "numeric", "float4", "float8"})


async def config_problems(conn: asyncpg.Connection, config: Config) -> list[str]:
    """Each way the configuration does not match the database (empty: none), all at once:
    a protected table, its uid column or a bounded column that is not there, a bounded
    column that is not a number, a public table or schema or a public key column that is
    not there."""
    from server.backend_setup import quote_ident

    problems: list[str] = []
    for name, table in sorted(config.tables.items()):
        qualified = f"{quote_ident(table.schema_)}.{quote_ident(name)}"
        where = f"tables.{name}"
        if await conn.fetchval("SELECT to_regclass($1)", qualified) is None:
            problems.append(f"{where}: there is no table {table.schema_}.{name}")
            continue
        columns = {str(r[0]): str(r[1]) for r in await conn.fetch(
            "SELECT a.attname, t.typname FROM pg_attribute a JOIN pg_type t ON t.oid = "
            "a.atttypid WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT "
            "a.attisdropped", qualified)}
        known = ", ".join(sorted(columns))
        if table.uid_column not in columns:
            problems.append(f"{where}.uid_column: {table.schema_}.{name} has no column "
                            f"{table.uid_column!r} (its columns: {known})")
        for column in sorted(table.columns):
            if column not in columns:
                problems.append(f"{where}.columns.{column}: {table.schema_}.{name} has no such "
                                f"column (its columns: {known})")
            elif table.columns[column].bounded and columns[column] not in _NUMBER_TYPES:
                problems.append(f"{where}.columns.{column}: bounds on a column of type "
                                f"{columns[column]}, not a number")
            source = table.columns[column].keys_source()
            if source is not None and not await conn.fetchval(
                    "SELECT EXISTS (SELECT FROM pg_attribute WHERE attrelid = "
                    "to_regclass($1) AND attname = $2 AND NOT attisdropped)",
                    f"{quote_ident(source[0])}.{quote_ident(source[1])}", source[2]):
                problems.append(f"{where}.columns.{column}.public_keys_from: there is no "
                                f"column {'.'.join(source)}")
    for schema, name in config.public.qualified():
        if await conn.fetchval("SELECT to_regclass($1)",
                               f"{quote_ident(schema)}.{quote_ident(name)}") is None:
            problems.append(f"public.tables: there is no table {schema}.{name}")
    for schema in config.public.schemas:
        if not await conn.fetchval("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)",
                                   schema):
            problems.append(f"public.schemas: there is no schema {schema}")
    if not problems:
        problems.extend(await citus_problems(conn, config))
    return problems


async def citus_problems(conn: asyncpg.Connection, config: Config) -> list[str]:
    """On a Citus coordinator, each table not distributed as DP queries need (empty: none, or
    not Citus): every protected table distributed by its uid column, all in one colocation
    group, so that every per-user stage runs on the workers and joins on the uid need no
    repartitioning (which would fail after the charge); each public table a reference table,
    which every worker holds."""
    from server.backend_setup import quote_ident

    if not await conn.fetchval("SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL"):
        return []
    problems: list[str] = []
    groups: dict[int, list[str]] = {}
    for name, table in sorted(config.tables.items()):
        qualified = f"{quote_ident(table.schema_)}.{quote_ident(name)}"
        row = await conn.fetchrow(
            "SELECT partmethod, colocationid, CASE WHEN partmethod = 'h' THEN "
            "column_to_column_name(logicalrelid, partkey) END AS column "
            "FROM pg_catalog.pg_dist_partition WHERE logicalrelid = $1::regclass", qualified)
        colocate = "" if not groups else \
            f", colocate_with => '{next(iter(groups.values()))[0]}'"
        fix = (f"SELECT create_distributed_table('{table.schema_}.{name}', "
               f"'{table.uid_column}'{colocate})")
        where = f"tables.{name}"
        if row is None or _char(row["partmethod"]) != "h":
            how = "not distributed" if row is None else "a reference or local table of Citus"
            problems.append(f"{where}: {table.schema_}.{name} is {how}: on Citus a protected "
                            f"table must be distributed by its uid column ({fix})")
            continue
        if row["column"] != table.uid_column:
            problems.append(f"{where}: Citus distributes {table.schema_}.{name} by "
                            f"{row['column']}, not by its uid column {table.uid_column}: "
                            "per-user stages and joins on the uid would need repartitioning "
                            f"(SELECT alter_distributed_table('{table.schema_}.{name}', "
                            f"distribution_column := '{table.uid_column}'))")
            continue
        groups.setdefault(int(row["colocationid"]), []).append(f"{table.schema_}.{name}")
    if len(groups) > 1:
        listed = "; ".join(", ".join(t) for t in groups.values())
        problems.append(f"tables: the protected tables are in {len(groups)} Citus colocation "
                        f"groups ({listed}): joins on the uid need them in one "
                        "(SELECT alter_distributed_table(..., colocate_with := ...))")
    for schema, name in config.public.qualified():
        method = await conn.fetchval(
            "SELECT partmethod FROM pg_catalog.pg_dist_partition WHERE logicalrelid = "
            "$1::regclass", f"{quote_ident(schema)}.{quote_ident(name)}")
        if _char(method) != "n":
            problems.append(f"public.tables: {schema}.{name} is not a Citus reference table: "
                            "DP queries join it on the workers "
                            f"(SELECT create_reference_table('{schema}.{name}'))")
    return problems


def _char(value: object) -> str | None:
    """A "char" column's value as asyncpg gives it (bytes), as text."""
    return value.decode() if isinstance(value, bytes) else None if value is None else str(value)


def demo_config_text(dsns: BackendDSNs, port: int | None = None) -> str:
    """config/demo.toml pointed at an existing backend (for benchmarks and tests)."""
    from config import DEMO_CONFIG

    secret = "" if dsns.login_secret in (None, dsns.restricted.password) else \
        f'\nanalyst_login_secret = "{dsns.login_secret}"'
    text = DEMO_CONFIG.read_text().replace(
        "[backend]\nembedded = true",
        f'[backend]\npushdown_dsn = "{dsns.pushdown.uri()}"\n'
        f'restricted_dsn = "{dsns.restricted.uri()}"\nledger_dsn = "{dsns.ledger.uri()}"\n'
        f'analyst_role_prefix = "{dsns.analyst_prefix}"{secret}',
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


async def prepare_embedded(pg: EmbeddedPostgres, config: Config) -> BackendDSNs:
    """Create the demo database in `pg` (loading data unless it is there), the roles, and the
    database-wide hardening (the database is the proxy's alone); returns the roles' DSNs."""
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
        roles = replace(DEFAULT_ROLES, analyst_prefix=config.backend.analyst_role_prefix)
        await apply_backend_setup(conn, config, DEMO_DATABASE, roles, harden=True)
    finally:
        await conn.close()
    return embedded_dsns(pg, DEMO_DATABASE, roles)


def embedded_dsns(pg: EmbeddedPostgres, database: str,
                  roles: BackendRoles = DEFAULT_ROLES) -> BackendDSNs:
    """The roles' logins to `database` of an embedded Postgres (its socket trusts them)."""
    def login(role: str) -> DSN:
        return DSN(str(pg.socket_dir), pg.port, role, database)

    return BackendDSNs(login(roles.restricted), login(roles.pushdown), login(roles.ledger),
                       roles.analyst_prefix)
