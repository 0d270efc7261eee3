"""The backend roles of DESIGN §2: a pushdown role reads protected rows, a restricted one never can."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, replace

from config import Config
from dp_core.reach import ADVISORY_LOCKS
from server.dsn import DSN, parse_dsn

DEFAULT_PUSHDOWN_ROLE = "dp_pushdown"
DEFAULT_RESTRICTED_ROLE = "dp_restricted"
DEFAULT_LEDGER_ROLE = "dp_ledger"
DEFAULT_ANALYST_PREFIX = "dp_analyst_"
POLICY_NAME = "dp_pushdown_reads_all"


def quote_ident(name: str) -> str:
    """Quote an SQL identifier the way Postgres' quote_ident does, always."""
    return '"' + name.replace('"', '""') + '"'


def quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


@dataclass(frozen=True)
class BackendRoles:
    """The backend roles: pushdown (reads protected rows, runs only generated SQL), restricted
    (the catalog role the analysts' roles mirror), ledger (owns the ledger; runs no analyst
    SQL), and one login per analyst, `analyst_prefix` + name, for its pass-through session."""

    pushdown: str = DEFAULT_PUSHDOWN_ROLE
    restricted: str = DEFAULT_RESTRICTED_ROLE
    ledger: str = DEFAULT_LEDGER_ROLE
    analyst_prefix: str = DEFAULT_ANALYST_PREFIX

    def analyst(self, name: str) -> str:
        return self.analyst_prefix + name

    def analysts(self, config: Config) -> list[str]:
        return [self.analyst(name) for name in sorted(config.analysts)]


DEFAULT_ROLES = BackendRoles()


@dataclass(frozen=True)
class BackendDSNs:
    """Where the proxy logs in to the backend database, as each of its roles."""

    restricted: DSN
    pushdown: DSN
    ledger: DSN
    analyst_prefix: str = DEFAULT_ANALYST_PREFIX
    login_secret: str | None = None
    """The key of the analysts' derived passwords (None: their roles need none)."""

    @classmethod
    def of(cls, config: Config) -> BackendDSNs:
        """The DSNs a configuration for an existing backend names."""
        b = config.backend
        assert b.restricted_dsn and b.pushdown_dsn and b.ledger_dsn
        restricted = parse_dsn(b.restricted_dsn)
        return cls(restricted, parse_dsn(b.pushdown_dsn), parse_dsn(b.ledger_dsn),
                   b.analyst_role_prefix, b.analyst_login_secret or restricted.password)

    @property
    def database(self) -> str:
        return self.restricted.database

    @property
    def roles(self) -> BackendRoles:
        return BackendRoles(self.pushdown.user, self.restricted.user, self.ledger.user,
                            self.analyst_prefix)

    def analyst(self, name: str) -> DSN:
        """The login of `name`'s pass-through sessions."""
        password = None if self.login_secret is None else analyst_password(self.login_secret, name)
        return replace(self.restricted, user=self.analyst_prefix + name, password=password)


def analyst_password(secret: str, analyst: str) -> str:
    """The backend password of `analyst`'s role, derived from one secret (DESIGN §1): the
    proxy and init-backend compute it; no analyst ever learns it."""
    mac = hmac.new(secret.encode(), b"dp-proxy analyst login\0" + analyst.encode(),
                   hashlib.sha256)
    return mac.hexdigest()


def setup_statements(
    config: Config, database: str, roles: BackendRoles = DEFAULT_ROLES,
    login_secret: str | None = None,
) -> list[str]:
    """Idempotent SQL, run by a superuser, that creates the roles and walls off protected tables.

    The restricted role and every analyst's role may SELECT the protected tables (so that BI
    tools list them as readable) and the public tables and schemas the configuration names,
    nothing else; row-level security with a policy for the pushdown role alone hides every
    protected row from the others, and Postgres hides `pg_stats` rows of tables under
    row-level security from them. Analysts' roles are members of no role, so one analyst's
    role has no privilege over another's sessions or objects. The ledger schema belongs to
    the ledger role, and no other role here may use it. With `login_secret`, each analyst's
    role gets its derived password (as a SCRAM verifier: the password is never sent).
    """
    from server.scram import make_verifier

    p = quote_ident(roles.pushdown)
    analysts = roles.analysts(config)
    readers = [p, *(quote_ident(r) for r in [roles.restricted, *analysts])]
    stmts = [_create_role(r) for r in (roles.pushdown, roles.restricted, roles.ledger, *analysts)]
    for role in [*readers, quote_ident(roles.ledger)]:
        stmts.append(
            f"ALTER ROLE {role} NOSUPERUSER NOCREATEDB NOCREATEROLE NOBYPASSRLS NOREPLICATION")
        stmts.append(f"GRANT CONNECT ON DATABASE {quote_ident(database)} TO {role}")
    for name in sorted(config.analysts):
        role = quote_ident(roles.analyst(name))
        stmts.append(f"ALTER ROLE {role} LOGIN CONNECTION LIMIT "
                     f"{int(config.analysts[name].max_connections)}")
        if login_secret:
            verifier = make_verifier(analyst_password(login_secret, name))
            stmts.append(f"ALTER ROLE {role} PASSWORD {quote_literal(str(verifier))}")
    # the pushdown role's own work_mem (besides its sessions' start-up parameter): Citus
    # propagates it to the workers, where the per-user stages run and the start-up parameter
    # of the coordinator's session does not reach; none configured, the server's
    stmts.append(f"ALTER ROLE {p} SET work_mem = {quote_literal(config.backend.pushdown_work_mem)}"
                 if config.backend.pushdown_work_mem else f"ALTER ROLE {p} RESET work_mem")
    stmts.append(_disable_stale_analysts(roles, analysts))
    to_readers = ", ".join(readers)
    public_tables = config.public.qualified()
    schemas = sorted({"public", *(t.schema_ for t in config.tables.values()),
                      *config.public.schemas, *(schema for schema, _ in public_tables)})
    for schema in schemas:
        stmts.append(f"GRANT USAGE ON SCHEMA {quote_ident(schema)} TO {to_readers}")
    # only what the configuration names: the protected tables (below, under row-level
    # security) and the public tables and schemas; other tables stay closed
    for schema in sorted(set(config.public.schemas)):
        stmts.append(f"GRANT SELECT ON ALL TABLES IN SCHEMA {quote_ident(schema)} TO {to_readers}")
    for schema, name in public_tables:
        stmts.append(f"GRANT SELECT ON {quote_ident(schema)}.{quote_ident(name)} TO {to_readers}")
    stmts.extend(_ledger_schema(config.backend.ledger_schema, roles.ledger, to_readers))
    stmts.extend(_data_changes(config.backend.ledger_schema, roles.ledger))
    watched = [*((table.schema_, name) for name, table in sorted(config.tables.items())),
               *public_tables]
    for schema, name in watched:
        # plain tables only (a view, a foreign or partitioned table is not watched), not a
        # table Citus distributes, which takes no trigger (answers over those are not
        # reused), and none at all with answer reuse off; ENABLE ALWAYS: it fires in replica
        # mode too (a restore that sets session_replication_role)
        t = f"{quote_ident(schema)}.{quote_ident(name)}"
        drop = f"DROP TRIGGER IF EXISTS {DATA_CHANGE_TRIGGER} ON {t}"
        trigger = "" if config.defaults.answer_reuse == "off" else (
            f"CREATE TRIGGER {DATA_CHANGE_TRIGGER} AFTER INSERT OR UPDATE OR DELETE OR "
            f"TRUNCATE ON {t} FOR EACH STATEMENT EXECUTE FUNCTION "
            f"{quote_ident(config.backend.ledger_schema)}.note_data_change(); "
            f"ALTER TABLE {t} ENABLE ALWAYS TRIGGER {DATA_CHANGE_TRIGGER};")
        stmts.append(
            "DO $dp$ DECLARE distributed boolean := false; BEGIN "
            "IF to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL THEN EXECUTE "
            "'SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_dist_partition WHERE logicalrelid = "
            f"$1::regclass)' INTO distributed USING {quote_literal(t)}; END IF; "
            f"IF NOT distributed AND (SELECT relkind FROM pg_class WHERE oid = "
            f"{quote_literal(t)}::regclass) IN ('r', 'p') THEN {drop}; "
            f"IF (SELECT relkind FROM pg_class WHERE oid = {quote_literal(t)}::regclass) = 'r' "
            f"THEN {trigger} NULL; END IF; END IF; END $dp$")
    for name, table in sorted(config.tables.items()):
        t = f"{quote_ident(table.schema_)}.{quote_ident(name)}"
        stmts.append(f"ALTER TABLE {t} ENABLE ROW LEVEL SECURITY")
        stmts.append(f"REVOKE ALL ON {t} FROM PUBLIC")
        stmts.append(f"GRANT SELECT ON {t} TO {to_readers}")
        stmts.append(f"DROP POLICY IF EXISTS {POLICY_NAME} ON {t}")
        stmts.append(f"CREATE POLICY {POLICY_NAME} ON {t} FOR SELECT TO {p} USING (true)")
    return stmts


def _ledger_schema(schema: str, owner: str, others: str) -> list[str]:
    """The ledger schema and everything in it owned by the ledger role (a ledger made before
    the ledger role existed belonged to the pushdown role), closed to every other role."""
    s, o = quote_ident(schema), quote_ident(owner)
    return [
        f"CREATE SCHEMA IF NOT EXISTS {s} AUTHORIZATION {o}",
        f"ALTER SCHEMA {s} OWNER TO {o}",
        "DO $$ DECLARE r record; BEGIN "
        "FOR r IN SELECT c.oid::regclass AS rel FROM pg_class c "
        f"WHERE c.relnamespace = {quote_literal(s)}::regnamespace AND c.relkind IN ('r', 'p') "
        f"LOOP EXECUTE format('ALTER TABLE %s OWNER TO %I', r.rel, {quote_literal(owner)}); "
        "END LOOP; "
        "FOR r IN SELECT p.oid::regprocedure AS fn FROM pg_proc p "
        f"WHERE p.pronamespace = {quote_literal(s)}::regnamespace "
        f"LOOP EXECUTE format('ALTER FUNCTION %s OWNER TO %I', r.fn, {quote_literal(owner)}); "
        "END LOOP; END $$",
        f"REVOKE ALL ON SCHEMA {s} FROM PUBLIC",
        f"REVOKE ALL ON SCHEMA {s} FROM {others}",
        f"REVOKE ALL ON ALL TABLES IN SCHEMA {s} FROM PUBLIC, {others}",
        f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {s} FROM PUBLIC, {others}",
        f"REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {s} FROM PUBLIC, {others}",
    ]


DATA_CHANGE_TRIGGER = "dp_data_change"
"""The statement trigger on each protected table that notes, in the ledger schema, that its data
changed: a reused answer is one whose tables have not changed since (dp_query.reuse)."""


def _data_changes(schema: str, owner: str) -> list[str]:
    """The ledger's log of writes to the tables DP answers read (one row of weight n = 1 per
    writing statement, visible when its transaction commits; `dp_query.reuse` compacts a
    table's rows into one of their summed weight), and the trigger function that appends to
    it, whoever writes (SECURITY DEFINER: only the ledger role may write the ledger schema)."""
    s, o = quote_ident(schema), quote_ident(owner)
    return [
        f"CREATE TABLE IF NOT EXISTS {s}.data_changes (id bigserial PRIMARY KEY, "
        "relation text NOT NULL, n bigint NOT NULL DEFAULT 1, "
        "at timestamptz NOT NULL DEFAULT clock_timestamp())",
        f"CREATE INDEX IF NOT EXISTS data_changes_relation ON {s}.data_changes (relation, id)",
        f"ALTER TABLE {s}.data_changes OWNER TO {o}",
        f"CREATE OR REPLACE FUNCTION {s}.note_data_change() RETURNS trigger LANGUAGE plpgsql "
        "SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $dp$BEGIN "
        f"INSERT INTO {s}.data_changes (relation) VALUES (TG_TABLE_SCHEMA || '.' || "
        "TG_TABLE_NAME); RETURN NULL; END$dp$",
        f"ALTER FUNCTION {s}.note_data_change() OWNER TO {o}",
        f"REVOKE ALL ON FUNCTION {s}.note_data_change() FROM PUBLIC",
    ]


def _disable_stale_analysts(roles: BackendRoles, current: list[str]) -> str:
    """Roles with the analysts' prefix whose analyst the configuration no longer names lose
    their login (they are kept: they may own objects, and other databases may know them)."""
    keep = ", ".join(quote_literal(r) for r in current) or "NULL"
    prefix = roles.analyst_prefix.replace("\\", "\\\\").replace("_", "\\_").replace("%", "\\%")
    return ("DO $$ DECLARE r record; BEGIN FOR r IN SELECT rolname FROM pg_roles "
            f"WHERE rolname LIKE {quote_literal(prefix + '%')} AND rolname NOT IN ({keep}) "
            "AND rolcanlogin LOOP EXECUTE format('ALTER ROLE %I NOLOGIN', r.rolname); "
            "END LOOP; END $$")


HARDENED_FUNCTIONS = (
    "proname LIKE 'pg\\_stat\\_%' OR proname LIKE 'lo\\_%' OR proname IN ("
    "'loread', 'lowrite', 'pg_relation_size', 'pg_total_relation_size', 'pg_table_size', "
    "'pg_indexes_size', 'pg_database_size', 'pg_tablespace_size', 'pg_cancel_backend', "
    "'pg_terminate_backend', 'pg_blocking_pids', 'pg_safe_snapshot_blocking_pids', "
    "'txid_current', 'txid_current_if_assigned', 'txid_current_snapshot', "
    "'pg_current_xact_id', 'pg_current_xact_id_if_assigned', 'pg_current_snapshot', "
    "'pg_current_wal_lsn', 'pg_current_wal_insert_lsn', 'pg_current_wal_flush_lsn', "
    "'pg_last_committed_xact', 'pg_xact_commit_timestamp', 'pg_xact_commit_timestamp_origin', "
    "'txid_status', 'pg_xact_status', 'pg_control_checkpoint', 'pg_control_system', "
    "'pg_control_init', 'pg_control_recovery', "
    f"{', '.join(repr(f) for f in ADVISORY_LOCKS)}, "
    "'pg_lock_status', 'pg_prepared_xact', 'pg_isolation_test_session_is_blocked', "
    "'pg_notify', 'query_to_xml', 'query_to_xmlschema', 'query_to_xml_and_xmlschema', "
    "'ts_stat', 'ts_rewrite', 'table_to_xml', 'table_to_xmlschema', "
    "'table_to_xml_and_xmlschema', 'schema_to_xml', 'schema_to_xmlschema', "
    "'schema_to_xml_and_xmlschema', 'database_to_xml', 'database_to_xmlschema', "
    "'database_to_xml_and_xmlschema', 'cursor_to_xml', 'cursor_to_xmlschema', "
    "'mxid_age', 'pg_get_multixact_members', 'citus_table_size', 'citus_relation_size', "
    "'citus_total_relation_size', "
    "'citus_shard_sizes', 'get_rebalance_progress', 'citus_stat_activity', "
    "'citus_stat_statements', 'citus_stat_tenants', 'citus_stat_tenants_local')"
)
"""The catalog functions that reveal statistics, sizes or other sessions' activity, signal
sessions, or share objects between sessions (large objects, notifications); and Citus's
(where it is installed): its shards' sizes (a shard holds about 1/32 of the users) and every
node's activity; and the advisory lock functions (an analyst holding the ledger's migration
lock would hold up every reload of the configuration)."""


def hardening_statements(roles: BackendRoles = DEFAULT_ROLES) -> list[str]:
    """SQL that closes, for every role of the database without a monitoring role, what Postgres
    cannot take from the analysts' roles alone (DESIGN §2; the proxy refuses the same
    statements, 42501): executing the functions of HARDENED_FUNCTIONS (monitoring roles keep
    them through pg_read_all_stats and pg_signal_backend), and creating functions and
    procedures in SQL or PL/pgSQL, temporary ones included (the ledger role keeps PL/pgSQL for
    its append-only trigger), and creating tables in the schema public."""
    return [
        "DO $$ DECLARE r record; BEGIN FOR r IN SELECT oid::regprocedure AS fn, proname "
        f"FROM pg_proc WHERE pronamespace = 'pg_catalog'::regnamespace AND ({HARDENED_FUNCTIONS}) "
        "LOOP EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', r.fn); "
        "EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', r.fn, CASE WHEN r.proname IN "
        "('pg_cancel_backend', 'pg_terminate_backend') THEN 'pg_signal_backend' "
        f"WHEN r.proname LIKE '%advisory%' THEN {quote_literal(roles.ledger)} "
        "ELSE 'pg_read_all_stats' END); END LOOP; END $$",
        "REVOKE USAGE ON LANGUAGE sql, plpgsql FROM PUBLIC",
        # (Postgres 15 creates databases so; one made earlier lets every role create tables
        # in public, which analysts could share with each other)
        "REVOKE CREATE ON SCHEMA public FROM PUBLIC",
        f"GRANT USAGE ON LANGUAGE plpgsql TO {quote_ident(roles.ledger)}",
    ]


def closed_tables_sql(schemas: Iterable[str], role: str) -> str:
    """A query listing the tables of `schemas` that `role` may not read (left closed)."""
    names = ", ".join(quote_literal(s) for s in sorted(set(schemas)))
    return ("SELECT n.nspname || '.' || c.relname FROM pg_class c JOIN pg_namespace n "
            f"ON n.oid = c.relnamespace WHERE n.nspname IN ({names}) AND c.relkind IN "
            f"('r', 'p', 'v', 'm', 'f') AND NOT has_table_privilege({quote_literal(role)}, "
            "c.oid, 'SELECT') ORDER BY 1")


def check_statements(config: Config, roles: BackendRoles = DEFAULT_ROLES) -> list[str]:
    """Queries whose rows each name a way the wall is broken (no rows: the setup holds)."""
    walled = [roles.restricted, *roles.analysts(config)]
    names = ", ".join(quote_literal(r) for r in walled)
    checks = []
    for name, table in sorted(config.tables.items()):
        rel = quote_literal(f"{quote_ident(table.schema_)}.{quote_ident(name)}")
        checks.append(
            "SELECT 'protected table ' || c.oid::regclass::text || ' ' || problem FROM ("
            f"SELECT {rel}::regclass AS oid) c, LATERAL (VALUES "
            "((SELECT 'has no row-level security' FROM pg_class WHERE oid = c.oid "
            "AND NOT relrowsecurity)), "
            "((SELECT 'is owned by a restricted or analyst role' FROM pg_class WHERE oid = c.oid "
            f"AND relowner IN (SELECT oid FROM pg_roles WHERE rolname IN ({names})))), "
            "((SELECT 'has a policy that shows rows to a restricted or analyst role' FROM "
            "pg_policy pol WHERE pol.polrelid = c.oid AND (0 = ANY(pol.polroles) OR "
            f"EXISTS (SELECT FROM pg_roles r WHERE r.rolname IN ({names}) "
            "AND r.oid = ANY(pol.polroles))) LIMIT 1))"
            ") AS v(problem) WHERE problem IS NOT NULL"
        )
    checks.append(
        "SELECT 'role ' || rolname || ' is privileged' FROM pg_roles "
        f"WHERE rolname IN ({names}) AND (rolsuper OR rolbypassrls OR rolcreaterole)"
    )
    checks.append(
        "SELECT 'role ' || u.rolname || ' is a member of ' || g.rolname FROM pg_auth_members m "
        "JOIN pg_roles g ON g.oid = m.roleid JOIN pg_roles u ON u.oid = m.member "
        f"WHERE u.rolname IN ({names})"
    )
    for name in sorted(config.analysts):
        role = roles.analyst(name)
        checks.append(
            f"SELECT 'analyst {name} has no backend login {role} (run dp-proxy init-backend)' "
            f"WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {quote_literal(role)} "
            "AND rolcanlogin)")
    ledger = quote_literal(config.backend.ledger_schema)
    others = ", ".join(quote_literal(r) for r in [roles.pushdown, *walled])
    checks.append(
        f"SELECT 'role ' || r.rolname || ' may use the ledger schema ' || {ledger} "
        f"FROM pg_roles r WHERE r.rolname IN ({others}) AND EXISTS (SELECT FROM pg_namespace "
        f"WHERE nspname = {ledger}) AND has_schema_privilege(r.oid, {ledger}, 'USAGE')")
    return checks


def citus_check_statements(config: Config, roles: BackendRoles = DEFAULT_ROLES) -> list[str]:
    """On a Citus coordinator, the wall's checks on the workers (`check_statements`' form;
    run only where Citus is, whose functions they call): every shard
    of a protected table (which a role logging in to a worker reads as a table of its own)
    under row-level security, owned by no restricted or analyst role, with no policy showing
    them rows; no restricted or analyst role privileged on a worker. Each check runs through
    Citus's run_command_on_* functions, only where pg_dist_partition is there: a shard that
    cannot be checked (a worker down) is named too. (The roles themselves, their grants and
    the tables' security are made on the workers by Citus, which propagates them.)"""
    names = ", ".join(quote_literal(r) for r in [roles.restricted, *roles.analysts(config)])
    shard = (
        "SELECT CASE WHEN NOT c.relrowsecurity THEN 'has no row-level security' "
        f"WHEN c.relowner IN (SELECT oid FROM pg_roles WHERE rolname IN ({names})) "
        "THEN 'is owned by a restricted or analyst role' "
        "WHEN EXISTS (SELECT FROM pg_policy pol WHERE pol.polrelid = c.oid AND "
        "(0 = ANY(pol.polroles) OR EXISTS (SELECT FROM pg_roles r WHERE r.rolname IN "
        f"({names}) AND r.oid = ANY(pol.polroles)))) THEN 'has a policy that shows rows to a "
        "restricted or analyst role' ELSE 'ok' END FROM pg_class c WHERE c.oid = "
        "$dp$%s$dp$::regclass")
    checks = []
    for name, table in sorted(config.tables.items()):
        rel = quote_literal(f"{quote_ident(table.schema_)}.{quote_ident(name)}")
        checks.append(
            f"SELECT 'shard ' || p.shardid || ' of ' || d.logicalrelid::text || ' on ' || "
            "p.nodename || ':' || p.nodeport || ' ' || CASE WHEN p.success THEN p.result ELSE "
            "'could not be checked: ' || p.result END FROM pg_catalog.pg_dist_partition d, "
            f"LATERAL run_command_on_placements(d.logicalrelid, {quote_literal(shard)}) p "
            f"WHERE d.logicalrelid = to_regclass({rel}) AND (NOT p.success OR p.result <> 'ok')")
    privileged = (
        "SELECT coalesce(string_agg(p, ', ' ORDER BY p), '') FROM ("
        "SELECT 'role ' || rolname || ' is privileged' FROM pg_roles "
        f"WHERE rolname IN ({names}) AND (rolsuper OR rolbypassrls OR rolcreaterole) "
        "UNION ALL SELECT 'role ' || u.rolname || ' is a member of ' || g.rolname FROM "
        "pg_auth_members m JOIN pg_roles g ON g.oid = m.roleid JOIN pg_roles u ON u.oid = "
        f"m.member WHERE u.rolname IN ({names})) AS x(p)")
    checks.append(
        "SELECT 'on worker ' || w.nodename || ':' || w.nodeport || CASE WHEN w.success THEN "
        "': ' || w.result ELSE ', the roles could not be checked: ' || "
        f"w.result END FROM run_command_on_workers({quote_literal(privileged)}) w "
        "WHERE NOT w.success OR w.result <> ''")
    return checks


def _create_role(name: str) -> str:
    return (
        "DO $$ BEGIN "
        f"IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {quote_literal(name)}) THEN "
        f"CREATE ROLE {quote_ident(name)} LOGIN; END IF; END $$"
    )


def as_script(statements: Iterable[str]) -> str:
    return "".join(f"{s};\n" for s in statements)
