"""The backend roles of DESIGN §2: a pushdown role reads protected rows, a restricted one never can."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from config import Config

DEFAULT_PUSHDOWN_ROLE = "dp_pushdown"
DEFAULT_RESTRICTED_ROLE = "dp_restricted"
POLICY_NAME = "dp_pushdown_reads_all"


def quote_ident(name: str) -> str:
    """Quote an SQL identifier the way Postgres' quote_ident does, always."""
    return '"' + name.replace('"', '""') + '"'


def quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@dataclass(frozen=True)
class BackendRoles:
    pushdown: str = DEFAULT_PUSHDOWN_ROLE
    restricted: str = DEFAULT_RESTRICTED_ROLE


DEFAULT_ROLES = BackendRoles()


def setup_statements(
    config: Config, database: str, roles: BackendRoles = DEFAULT_ROLES
) -> list[str]:
    """Idempotent SQL, run by a superuser, that creates both roles and walls off protected tables.

    Both roles may SELECT the protected tables (so that BI tools list them as readable) and
    the public tables and schemas the configuration names, nothing else; row-level security
    with no policy for the restricted role hides every protected row, and Postgres hides
    `pg_stats` rows of tables under row-level security from it. The pushdown role gets a
    policy that shows it every row.
    """
    p, r = quote_ident(roles.pushdown), quote_ident(roles.restricted)
    stmts = [_create_role(roles.pushdown), _create_role(roles.restricted)]
    for role in (p, r):
        stmts.append(
            f"ALTER ROLE {role} NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS NOREPLICATION"
        )
        stmts.append(f"GRANT CONNECT ON DATABASE {quote_ident(database)} TO {role}")
    public_tables = config.public.qualified()
    schemas = sorted({"public", *(t.schema_ for t in config.tables.values()),
                      *config.public.schemas, *(schema for schema, _ in public_tables)})
    for schema in schemas:
        stmts.append(f"GRANT USAGE ON SCHEMA {quote_ident(schema)} TO {p}, {r}")
    # only what the configuration names: the protected tables (below, under row-level
    # security) and the public tables and schemas; other tables stay closed
    for schema in sorted(set(config.public.schemas)):
        stmts.append(f"GRANT SELECT ON ALL TABLES IN SCHEMA {quote_ident(schema)} TO {p}, {r}")
    for schema, name in public_tables:
        stmts.append(f"GRANT SELECT ON {quote_ident(schema)}.{quote_ident(name)} TO {p}, {r}")
    ledger = quote_ident(config.backend.ledger_schema)
    stmts.append(f"CREATE SCHEMA IF NOT EXISTS {ledger} AUTHORIZATION {p}")
    stmts.append(f"REVOKE ALL ON SCHEMA {ledger} FROM PUBLIC")
    for name, table in sorted(config.tables.items()):
        t = f"{quote_ident(table.schema_)}.{quote_ident(name)}"
        stmts.append(f"ALTER TABLE {t} ENABLE ROW LEVEL SECURITY")
        stmts.append(f"REVOKE ALL ON {t} FROM PUBLIC")
        stmts.append(f"GRANT SELECT ON {t} TO {p}, {r}")
        stmts.append(f"DROP POLICY IF EXISTS {POLICY_NAME} ON {t}")
        stmts.append(f"CREATE POLICY {POLICY_NAME} ON {t} FOR SELECT TO {p} USING (true)")
    return stmts


def closed_tables_sql(schemas: Iterable[str], role: str) -> str:
    """A query listing the tables of `schemas` that `role` may not read (left closed)."""
    names = ", ".join(quote_literal(s) for s in sorted(set(schemas)))
    return ("SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n "
            f"ON n.oid = c.relnamespace WHERE n.nspname IN ({names}) AND c.relkind IN "
            f"('r', 'p', 'v', 'm', 'f') AND NOT has_table_privilege({quote_literal(role)}, "
            "c.oid, 'SELECT') ORDER BY 1")


def check_statements(config: Config, roles: BackendRoles = DEFAULT_ROLES) -> list[str]:
    """Queries whose rows each name a way the wall is broken (no rows: the setup holds)."""
    checks = []
    for name, table in sorted(config.tables.items()):
        rel = quote_literal(f"{quote_ident(table.schema_)}.{quote_ident(name)}")
        checks.append(
            "SELECT 'protected table ' || c.oid::regclass::text || ' ' || problem FROM ("
            f"SELECT {rel}::regclass AS oid) c, LATERAL (VALUES "
            "((SELECT 'has no row-level security' FROM pg_class WHERE oid = c.oid "
            "AND NOT relrowsecurity)), "
            "((SELECT 'is owned by the restricted role' FROM pg_class WHERE oid = c.oid "
            f"AND relowner = (SELECT oid FROM pg_roles WHERE rolname = {quote_literal(roles.restricted)}))), "
            "((SELECT 'has a policy that shows rows to the restricted role' FROM pg_policy pol "
            "WHERE pol.polrelid = c.oid AND (0 = ANY(pol.polroles) OR "
            f"(SELECT oid FROM pg_roles WHERE rolname = {quote_literal(roles.restricted)}) "
            "= ANY(pol.polroles))))"
            ") AS v(problem) WHERE problem IS NOT NULL"
        )
    checks.append(
        "SELECT 'restricted role ' || rolname || ' is privileged' FROM pg_roles "
        f"WHERE rolname = {quote_literal(roles.restricted)} "
        "AND (rolsuper OR rolbypassrls OR rolcreaterole)"
    )
    checks.append(
        "SELECT 'restricted role is a member of ' || g.rolname FROM pg_auth_members m "
        "JOIN pg_roles g ON g.oid = m.roleid JOIN pg_roles u ON u.oid = m.member "
        f"WHERE u.rolname = {quote_literal(roles.restricted)}"
    )
    return checks


def _create_role(name: str) -> str:
    return (
        "DO $$ BEGIN "
        f"IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {quote_literal(name)}) THEN "
        f"CREATE ROLE {quote_ident(name)} LOGIN; END IF; END $$"
    )


def as_script(statements: Iterable[str]) -> str:
    return "".join(f"{s};\n" for s in statements)
