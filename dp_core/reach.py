"""Statements that reach past the analyst's own session, refused wherever they appear.

What Postgres cannot take away from a role, however restricted: reading the statistics and
activity of the whole database (the rows other analysts' queries, and the proxy's own, read),
watching and signalling sessions, large objects and notification channels that outlive or cross
sessions, the role's own settings; and code made in the database runs where the proxy cannot
see. `init-backend --harden` closes the same in Postgres (docs/isolation.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dp_core.errors import InsufficientPrivilege
from dp_core.parsetree import func_name, literal

_OPAQUE_CODE = {
    "DoStmt": "DO blocks", "CallStmt": "procedure calls (CALL)",
    "CreateFunctionStmt": "functions and procedures (CREATE FUNCTION, CREATE PROCEDURE)",
    "AlterFunctionStmt": "changes to functions and procedures (ALTER FUNCTION, ALTER PROCEDURE)",
    "CreateTrigStmt": "triggers (CREATE TRIGGER)",
    "CreateEventTrigStmt": "event triggers (CREATE EVENT TRIGGER)",
    "RuleStmt": "rules (CREATE RULE)",
    "CreateCastStmt": "casts (CREATE CAST)",
    "CreatePLangStmt": "languages (CREATE LANGUAGE)",
    "CreateExtensionStmt": "extensions (CREATE EXTENSION, CREATE LANGUAGE)",
    "CreateTransformStmt": "transforms (CREATE TRANSFORM)",
    "CreateOpClassStmt": "operator classes (CREATE OPERATOR CLASS)",
    "CreateOpFamilyStmt": "operator families (CREATE OPERATOR FAMILY)",
    "AlterOpFamilyStmt": "changes to operator families (ALTER OPERATOR FAMILY)",
    "AlterOperatorStmt": "changes to operators (ALTER OPERATOR)",
}
"""Statements that run or make code the proxy cannot see into: refused whatever they name."""
_DEFINED_CODE = {"OBJECT_AGGREGATE": "aggregates (CREATE AGGREGATE)",
                 "OBJECT_OPERATOR": "operators (CREATE OPERATOR)"}
"""The kinds of DefineStmt that attach functions to new objects (the others, collations,
text search objects and types, run no code a non-superuser chooses)."""

_STATISTICS = "statistics and activity views reveal what other analysts' queries read"
_STATISTICS_FUNCTIONS = "statistics and activity functions reveal what other analysts' queries read"
_SIZES = "relation and database sizes reveal how much protected tables hold and what other " \
         "analysts' queries write"
_SIGNALS = "it signals or watches other sessions of the database"
_LARGE_OBJECTS = "large objects outlive the session and can be shared with other analysts"
_COUNTERS = "transaction and WAL positions reveal other analysts' activity"
_CHANNELS = "notification channels are shared by every session of the database: one analyst " \
            "could signal another"
_CATALOG = "the catalogs every session reads show a temporary object's definition, comments, " \
           "indexes and row counts to the other analysts"
_LOCKS = "advisory locks are shared by every session of the database: one analyst could " \
         "block another, or the proxy's own work"
_ROLE = "the proxy decides which backend role a session's statements run as"
_QUERY_TEXT = "it runs SQL from text, hidden from the proxy's checks"
_CODE = "the code they run is hidden from its checks"
_ROLES = "backend roles are set up by dp-proxy init-backend"
_INSTEAD = {
    _CODE: "send the statements inside it one by one; functions, triggers and the like are "
           "made in the database by its owner, not through the proxy",
    _STATISTICS: "column statistics are in pg_stats; a DP query counts a protected table's rows",
    _STATISTICS_FUNCTIONS: "column statistics are in pg_stats; a DP query counts a protected "
                           "table's rows",
    _SIZES: "a DP query counts a protected table's rows; pg_column_size and pg_size_pretty "
            "stay available",
    _SIGNALS: "cancel your own statement from your client (a CancelRequest); an administrator "
              "ends sessions from a direct connection to Postgres",
    _LARGE_OBJECTS: "keep binary data in a bytea column of a table of your own",
    _COUNTERS: "for the time, use now() or clock_timestamp()",
    _CHANNELS: "pass messages through a table of your own",
    _LOCKS: "lock rows of a table of your own (SELECT ... FOR UPDATE)",
    _CATALOG: "keep the query in your client; temporary tables stay available (their names "
              "and columns show in the catalogs)",
    _ROLE: "connect as the analyst whose access you need",
    _ROLES: "an operator changes analysts in the proxy's configuration and runs dp-proxy "
            "init-backend",
    _QUERY_TEXT: "run the query itself",
}
"""What to do instead, for each reason a statement is refused here."""

_ISOLATION_RELATIONS = {
    **dict.fromkeys(("pg_locks", "pg_prepared_xacts", "pg_backend_memory_contexts"), _STATISTICS),
    **dict.fromkeys(("pg_largeobject", "pg_largeobject_metadata"), _LARGE_OBJECTS),
    # Citus: its shards' sizes (a shard holds about 1/32 of the users: its size is theirs),
    # and the activity of every node
    **dict.fromkeys(("citus_shards", "citus_tables", "citus_shards_on_worker",
                     "citus_shard_indexes_on_worker", "pg_dist_placement",
                     "pg_dist_shard_placement"), _SIZES),
    **dict.fromkeys(("citus_dist_stat_activity", "citus_worker_stat_activity",
                     "citus_lock_waits", "citus_locks"), _STATISTICS),
}
"""Relations refused besides `pg_stat_*` and `pg_statio_*` (pg_stats, pg_statistic stay:
Postgres hides rows of tables under row-level security there, or all of it)."""
ADVISORY_LOCKS = tuple(f"pg_{t}advisory_{x}lock{m}" for t in ("", "try_") for x in ("", "xact_")
                       for m in ("", "_shared"))
"""The functions that take advisory locks (their unlock functions stay: a client's pool runs
pg_advisory_unlock_all() when it takes a connection back)."""
_ISOLATION_FUNCTIONS = {
    **dict.fromkeys(("pg_lock_status", "pg_prepared_xact", "pg_get_backend_memory_contexts"),
                    _STATISTICS_FUNCTIONS),
    **dict.fromkeys(("pg_relation_size", "pg_total_relation_size", "pg_table_size",
                     "pg_indexes_size", "pg_database_size", "pg_tablespace_size"), _SIZES),
    **dict.fromkeys(("pg_cancel_backend", "pg_terminate_backend", "pg_blocking_pids",
                     "pg_safe_snapshot_blocking_pids", "pg_isolation_test_session_is_blocked",
                     "pg_log_backend_memory_contexts"), _SIGNALS),
    **dict.fromkeys(("loread", "lowrite"), _LARGE_OBJECTS),
    **dict.fromkeys(("txid_current", "txid_current_if_assigned", "txid_current_snapshot",
                     "pg_current_xact_id", "pg_current_xact_id_if_assigned", "pg_current_snapshot",
                     "pg_current_wal_lsn", "pg_current_wal_insert_lsn", "pg_current_wal_flush_lsn",
                     "pg_last_committed_xact", "pg_xact_commit_timestamp",
                     "pg_xact_commit_timestamp_origin", "txid_status", "pg_xact_status",
                     "pg_control_checkpoint", "pg_control_system", "pg_control_init",
                     "pg_control_recovery", "mxid_age", "pg_get_multixact_members"), _COUNTERS),
    "pg_notify": _CHANNELS,
    **dict.fromkeys(ADVISORY_LOCKS, _LOCKS),
    **dict.fromkeys(("citus_table_size", "citus_relation_size", "citus_total_relation_size",
                     "citus_shard_sizes", "get_shard_id_for_distribution_column",
                     "get_rebalance_progress"), _SIZES),
    **dict.fromkeys(("citus_dist_stat_activity", "citus_worker_stat_activity",
                     "citus_lock_waits", "citus_locks"), _STATISTICS_FUNCTIONS),
    **dict.fromkeys(("query_to_xml", "query_to_xmlschema", "query_to_xml_and_xmlschema",
                     "ts_stat", "ts_rewrite", "cursor_to_xml", "cursor_to_xmlschema",
                     *(f"{what}_to_xml{form}" for what in ("table", "schema", "database")
                       for form in ("", "schema", "_and_xmlschema"))), _QUERY_TEXT),
}
"""Functions refused (by their last name, with any schema) besides `pg_stat_*` and `lo_*`
ones: pg_column_size, pg_size_pretty, pg_backend_pid stay."""
_ROLE_SETTINGS = frozenset({"role", "session_authorization"})
_SHARED_STATEMENTS = {
    "ListenStmt": ("LISTEN", _CHANNELS), "NotifyStmt": ("NOTIFY", _CHANNELS),
    "AlterRoleStmt": ("ALTER ROLE", _ROLES),
    "AlterRoleSetStmt": ("ALTER ROLE ... SET", _ROLES),
    "ViewStmt": ("CREATE VIEW", _CATALOG), "CommentStmt": ("COMMENT", _CATALOG),
    "IndexStmt": ("CREATE INDEX", _CATALOG), "VacuumStmt": ("VACUUM and ANALYZE", _CATALOG),
    "ClusterStmt": ("CLUSTER", _CATALOG), "ReindexStmt": ("REINDEX", _CATALOG),
    "CreateStatsStmt": ("CREATE STATISTICS", _CATALOG),
}
"""Statements reaching past the session: (what to call it, why it is refused)."""
_WATCHED_KEYS = frozenset({*_OPAQUE_CODE, *_SHARED_STATEMENTS, "DefineStmt", "VariableSetStmt",
                           "objtype", "objectType", "funcname", "relname"})

REACH_WORDS = (
    "pg_stat", "pg_lock", "pg_prepared_xact", "memory_contexts", "large", "relation_size",
    "table_size", "indexes_size", "database_size", "tablespace_size", "pg_cancel_backend",
    "pg_terminate_backend", "blocking_pids", "session_is_blocked", "lo_", "loread", "lowrite",
    "txid_current", "pg_current_", "committed_xact", "commit_timestamp", "notify", "listen",
    "txid_status", "xact_status", "pg_control_", "advisory_", "view", "comment", "index",
    "vacuum", "analyze", "analyse", "cluster", "statistics",
    "function", "procedure", "rule", "aggregate", "operator", "inout", "language", "extension",
    "role", "authorization", "alter", "_to_xml", "ts_stat", "ts_rewrite", "citus_",
    "multixact", "mxid_age",
    "pg_dist_", "get_shard_id", "get_rebalance")
"""Words of everything `reach_refusal` refuses, each statement by a keyword it must
have: CREATE TRIGGER and EVENT TRIGGER say EXECUTE FUNCTION or PROCEDURE, CREATE CAST says
FUNCTION or INOUT, CREATE TRANSFORM says FUNCTION, every ALTER (ROUTINE, USER) says ALTER,
SET SESSION AUTHORIZATION and session_authorization share AUTHORIZATION, `large` covers LARGE
OBJECT and pg_largeobject*. None has a digit (lo_truncate64 is an lo_ word)."""


def reach_refusal(tree: Any) -> InsufficientPrivilege | None:
    """The refusal of a statement that reaches what the backend role cannot keep apart between
    analysts, or makes code, anywhere in it: subqueries, CTEs, function arguments and FROM,
    DECLARE, COPY, EXPLAIN, PREPARE, CREATE VIEW / TABLE AS, CREATE SCHEMA's parts."""
    stack = [tree]
    while stack:
        cur = stack.pop()
        if isinstance(cur, list):
            stack.extend(cur)
        elif isinstance(cur, dict):
            for key in cur.keys() & _WATCHED_KEYS:
                err = _watched_refusal(key, cur)
                if err is not None:
                    return err
            stack.extend(v for v in cur.values() if isinstance(v, (dict, list)))
    return None


def _watched_refusal(key: str, node: Mapping[str, Any]) -> InsufficientPrivilege | None:
    """The refusal for `node`'s field `key` (one of `_WATCHED_KEYS`), if any."""
    value = node[key]
    if key in _OPAQUE_CODE:
        return _code_refusal(_OPAQUE_CODE[key])
    if key == "DefineStmt" and value.get("kind") in _DEFINED_CODE:
        return _code_refusal(_DEFINED_CODE[value["kind"]])
    if key in _SHARED_STATEMENTS:
        what, why = _SHARED_STATEMENTS[key]
        return _refusal(f"{what} is not allowed through dp-proxy", why)
    if key == "VariableSetStmt" and value.get("kind") == "VAR_SET_VALUE" \
            and value.get("name", "").lower() in _ROLE_SETTINGS:
        what = "SET ROLE" if value["name"].lower() == "role" else "SET SESSION AUTHORIZATION"
        return _refusal(f"{what} is not allowed through dp-proxy", _ROLE)
    if key in ("objtype", "objectType") and value == "OBJECT_LARGEOBJECT":
        return _refusal("large objects are not available through dp-proxy", _LARGE_OBJECTS)
    if key == "funcname" and isinstance(value, list):
        return _function_refusal(node)
    if key == "relname" and isinstance(value, str):
        return _relation_refusal(value)
    return None


def _refusal(what: str, why: str) -> InsufficientPrivilege:
    """`what` the statement did, `why` the proxy refuses it, and (the hint) what to do instead."""
    return InsufficientPrivilege(f"{what}: {why}", hint=_INSTEAD[why])


def _code_refusal(what: str) -> InsufficientPrivilege:
    return _refusal(f"{what} are not allowed through dp-proxy", _CODE)


def _relation_refusal(relname: str) -> InsufficientPrivilege | None:
    name = relname.lower()
    why = _STATISTICS if name.startswith(("pg_stat_", "pg_statio_", "citus_stat")) \
        else _ISOLATION_RELATIONS.get(name)
    if why is None:
        return None
    return _refusal(f"{relname} is not available through dp-proxy", why)


def role_setting_refusal(setting: str) -> InsufficientPrivilege | None:
    """The refusal of `set_config(setting, ...)` when it would change the session's role."""
    if setting.lower() in _ROLE_SETTINGS:
        return _refusal(f"set_config('{setting}', ...) is not allowed through dp-proxy", _ROLE)
    return None


def _function_refusal(fc: Mapping[str, Any]) -> InsufficientPrivilege | None:
    """The refusal of a call (or of a function named where one is attached) by its last name."""
    name, args = func_name(fc), fc.get("args", [])
    if name == "set_config":
        setting = literal(args[0]) if args else None
        return role_setting_refusal(setting) if isinstance(setting, str) else None
    if name.startswith(("pg_stat_", "citus_stat")):
        why: str | None = _STATISTICS_FUNCTIONS
    elif name.startswith("lo_"):
        why = _LARGE_OBJECTS
    else:
        why = _ISOLATION_FUNCTIONS.get(name)
    if why is None:
        return None
    return _refusal(f"{name}() is not available through dp-proxy", why)
