"""The `dp-proxy` command: demo, serve, budget, check-config, hash-password, init-backend."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import logging
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from config import DEMO_CONFIG, Config
from server.logs import configure as configure_logs
from server.serve import EXIT_CONFIG, run
from server.serve import load_or_report as _load

if TYPE_CHECKING:
    from server.backend_setup import BackendDSNs



def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dp-proxy",
        description="A Postgres proxy that answers aggregate SQL with differential privacy.",
    )
    ap.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    sub = ap.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="embedded Postgres + demo data + the proxy")
    demo.add_argument("--port", type=int, default=6432, help="proxy port (0: any free port)")
    demo.add_argument("--host", default="127.0.0.1")
    demo.add_argument("--data-dir", type=Path, help="keep the Postgres data here (default: "
                      "a temporary directory removed on exit)")
    demo.add_argument("--config", type=Path, default=DEMO_CONFIG, help=argparse.SUPPRESS)

    serve = sub.add_parser("serve", help="run the proxy in front of an existing Postgres")
    serve.add_argument("--config", type=Path, required=True)

    check = sub.add_parser("check-config", help="validate a config file and list every problem")
    check.add_argument("path", type=Path)
    check.add_argument("--connect", action="store_true", help="also check it against the "
                       "database: tables, uid and bounded columns, public tables, the roles")

    hc = sub.add_parser("healthcheck", help="exit 0 when the proxy of a config is healthy "
                        "(GET /healthz when [metrics] port is set, else a TCP connect)")
    hc.add_argument("--config", type=Path, required=True)
    hc.add_argument("--timeout", type=float, default=3.0)

    hp = sub.add_parser("hash-password", help="print a SCRAM-SHA-256 verifier for a password")
    hp.add_argument("--stdin", action="store_true", help="read the password from standard input")

    bud = sub.add_parser("budget", help="show or reset an analyst's privacy budget, or a total "
                                        "budget (total:database, total:schema.table)")
    bud.add_argument("action", choices=["show", "reset"])
    bud.add_argument("analyst")
    bud.add_argument("--config", type=Path, required=True)

    ib = sub.add_parser("init-backend",
                        help="create the backend roles (pushdown, restricted, ledger, one per analyst) in an "
                             "existing Postgres")
    ib.add_argument("--config", type=Path, required=True)
    ib.add_argument("--admin-dsn", help="a superuser connection string to run the setup with")
    ib.add_argument("--print", action="store_true", dest="print_only",
                    help="print the SQL instead of running it")
    ib.add_argument("--harden", action="store_true",
                    help="also close, database-wide, what Postgres cannot take from the "
                         "analysts' roles alone (statistics and size functions, signals, large "
                         "objects, creating functions): see docs/isolation.md")
    ib.add_argument("--demo-data", action="store_true",
                    help="first load the demo tables (visits, purchases, countries) if absent")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logs(str(args.log_level))
    handler = {
        "demo": _cmd_demo,
        "serve": _cmd_serve,
        "check-config": _cmd_check_config,
        "healthcheck": _cmd_healthcheck,
        "hash-password": _cmd_hash_password,
        "init-backend": _cmd_init_backend,
        "budget": _cmd_budget,
    }[args.command]
    try:
        return handler(args)
    except Exception as e:  # (expected failures become one line; a bug is raised again)
        message = _expected_failure(e)
        if message is None:
            raise
        print(f"dp-proxy {args.command}: {message}", file=sys.stderr)
        return 1


_WHAT_TO_DO = {
    "28P01": "check the password in the connection string",
    "28000": "check the user name and pg_hba.conf",
    "3D000": "create the database, or fix its name in the connection string",
    "42P01": "create the table, or fix its name in the configuration",
    "42703": "fix the column name in the configuration",
    "42704": "create the role, or run init-backend first",
    "42501": "connect as a role that may do this (a superuser for init-backend)",
    "3F000": "create the schema, or fix its name in the configuration",
}


def _expected_failure(e: BaseException) -> str | None:
    """One line saying what failed and what to do, for the failures an operator meets (the
    database refused, was not there, or lacked something); None for anything else (a bug)."""
    import asyncpg

    from server.embedded import EmbeddedPostgresError

    if isinstance(e, asyncpg.PostgresError):
        state = str(getattr(e, "sqlstate", "") or "")
        hint = _WHAT_TO_DO.get(state, "see the Postgres log for more")
        return f"the database said: {str(e).splitlines()[0]} (SQLSTATE {state}): {hint}"
    if isinstance(e, asyncpg.exceptions.ClientConfigurationError | asyncpg.InterfaceError):
        return f"cannot use the connection string: {e}"
    if isinstance(e, ConnectionRefusedError | TimeoutError | socket.gaierror):
        return f"cannot reach the database ({e}): is Postgres running, and the host and port right?"
    if isinstance(e, OSError) and e.errno is not None:
        return f"{e.strerror or e} ({getattr(e, 'filename', None) or 'connection'})"
    if isinstance(e, EmbeddedPostgresError):
        return str(e)
    return None


def _load_existing_backend(path: Path, embedded_message: str) -> tuple[Config, BackendDSNs] | int:
    """The config at `path` and its backend DSNs, or an exit code after a message."""
    from server.backend_setup import BackendDSNs
    from server.dsn import DSNError

    config = _load(path)
    if config is None:
        return EXIT_CONFIG
    if config.backend.embedded:
        print(f"this config uses the embedded backend: {embedded_message}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        return config, BackendDSNs.of(config)
    except DSNError as e:
        print(f"backend DSN: {e}", file=sys.stderr)
        return EXIT_CONFIG


def _cmd_healthcheck(args: argparse.Namespace) -> int:
    """For container health checks: /healthz answers 200 only when the backend answers too."""
    import socket
    import urllib.error
    import urllib.request

    config = _load(args.config)
    if config is None:
        return EXIT_CONFIG

    def local(host: str) -> str:
        return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host

    port = config.metrics.port
    try:
        if port:
            url = f"http://{local(config.metrics.host)}:{port}/healthz"
            with urllib.request.urlopen(url, timeout=args.timeout) as r:
                ok = r.status == 200
        else:
            socket.create_connection((local(config.listen.host), config.listen.port),
                                     args.timeout).close()
            ok = True
    except (OSError, urllib.error.URLError) as e:
        print(f"dp-proxy: unhealthy: {e}", file=sys.stderr)
        return 1
    return 0 if ok else 1


def _cmd_check_config(args: argparse.Namespace) -> int:
    config = _load(args.path)
    if config is None:
        return EXIT_CONFIG
    if args.connect:
        if config.backend.embedded:
            print(f"{args.path}: the embedded backend is made by dp-proxy itself: nothing to "
                  "check it against", file=sys.stderr)
        else:
            problems = asyncio.run(_database_problems(config))
            if problems:
                print(f"{args.path}: does not match the database:", file=sys.stderr)
                for problem in problems:
                    print(f"  {problem}", file=sys.stderr)
                return EXIT_CONFIG
    print(f"{args.path}: ok ({len(config.analysts)} analysts, {len(config.tables)} protected tables"
          f"{', checked against the database' if args.connect and not config.backend.embedded else ''})")
    return 0


async def _database_problems(config: Config) -> list[str]:
    """`config_problems` and the wall's, read through the pushdown DSN; and the restricted
    and ledger DSNs must log in."""
    import asyncpg

    from server.backend_setup import BackendDSNs
    from server.bootstrap import config_problems, find_wall_problems

    dsns = BackendDSNs.of(config)
    conn = await asyncpg.connect(dsns.pushdown.uri())
    try:
        problems = await config_problems(conn, config)
        if not problems:  # (the wall's checks name the tables: only once they are there)
            problems = await find_wall_problems(conn, config, dsns.roles)
    finally:
        await conn.close()
    for name, dsn in (("restricted_dsn", dsns.restricted), ("ledger_dsn", dsns.ledger)):
        try:
            await (await asyncpg.connect(dsn.uri())).close()
        except (asyncpg.PostgresError, OSError) as e:
            problems.append(f"backend.{name}: cannot log in: {e}")
    return problems


def _cmd_hash_password(args: argparse.Namespace) -> int:
    from server.scram import make_verifier

    if args.stdin or not sys.stdin.isatty():
        password = sys.stdin.readline().rstrip("\n")
    else:
        password = getpass.getpass("Password: ")
        if getpass.getpass("Again: ") != password:
            print("the passwords differ", file=sys.stderr)
            return 1
    if not password:
        print("empty password", file=sys.stderr)
        return 1
    print(make_verifier(password))
    return 0


def _cmd_init_backend(args: argparse.Namespace) -> int:
    from server.backend_setup import as_script, hardening_statements, setup_statements

    loaded = _load_existing_backend(args.config, "nothing to initialise")
    if isinstance(loaded, int):
        return loaded
    config, dsns = loaded
    if args.print_only:
        print(as_script(setup_statements(config, dsns.database, dsns.roles, dsns.login_secret)),
              end="")
        harden = as_script(hardening_statements(dsns.roles))
        if args.harden:
            print(harden, end="")
        else:
            print("-- Database-wide (with --harden): what Postgres cannot take from the analysts'"
                  "\n-- roles alone, taken from every role without a monitoring role; dp-proxy "
                  "refuses\n-- these statements itself (42501) either way.\n"
                  + "".join(f"-- {line}\n" for line in harden.splitlines()), end="")
        return 0
    if not args.admin_dsn:
        print("give --admin-dsn (a superuser) or --print", file=sys.stderr)
        return 1
    return asyncio.run(_init_backend(config, args.admin_dsn, dsns, args.demo_data, args.harden))


async def _init_backend(config: Config, admin_dsn: str, dsns: object, demo_data: bool,
                        harden: bool) -> int:
    import asyncpg

    from server.backend_setup import BackendDSNs, closed_tables_sql, quote_ident, quote_literal
    from server.bootstrap import BackendSetupError, apply_backend_setup, load_demo_data
    from server.scram import make_verifier

    assert isinstance(dsns, BackendDSNs)
    roles, database = dsns.roles, dsns.database
    passwords = {d.user: d.password for d in (dsns.pushdown, dsns.restricted, dsns.ledger)
                 if d.password}
    conn = await asyncpg.connect(admin_dsn)
    try:
        if demo_data:
            await load_demo_data(conn)
        await apply_backend_setup(conn, config, database, roles, dsns.login_secret, harden)
        for user, password in passwords.items():
            # a verifier made here: the password itself never reaches the server or its logs
            verifier = quote_literal(str(make_verifier(password)))
            await conn.execute(f"ALTER ROLE {quote_ident(user)} PASSWORD {verifier}")
        schemas = {"public", *(t.schema_ for t in config.tables.values()),
                   *(s for s, _ in config.public.qualified())}
        closed = [str(r[0]) for r in await conn.fetch(closed_tables_sql(schemas,
                                                                        roles.restricted))]
    except BackendSetupError as e:
        print(f"the setup ran but the wall does not hold: {e}", file=sys.stderr)
        return 1
    finally:
        await conn.close()
    unset = sorted({roles.pushdown, roles.restricted, roles.ledger} - set(passwords))
    print(f"roles {roles.pushdown}, {roles.restricted} and {roles.ledger}, and the analysts' "
          f"{', '.join(roles.analysts(config))}, are ready in database {database}"
          f"{' (hardened)' if harden else ''}.")
    public = [f"{s}.{t}" for s, t in config.public.qualified()] + \
        [f"{s}.*" for s in config.public.schemas]
    print(f"analysts may read: the protected tables ({', '.join(sorted(config.tables)) or 'none'})"
          f" and the public {', '.join(public) or 'nothing'}.")
    for table in closed:
        print(f"warning: {table} is left closed to analysts (list it under [public] to open it)")
    if unset:
        print(f"Set the password of {', '.join(unset)} (\\password in psql) if the backend asks for one.")
    return 0


def _cmd_budget(args: argparse.Namespace) -> int:
    loaded = _load_existing_backend(
        args.config, "its ledger lives only while `dp-proxy demo` runs: use SELECT * FROM "
        "dp_budget() there")
    if isinstance(loaded, int):
        return loaded
    config, dsns = loaded
    total = args.analyst.startswith("total:")
    if total and args.analyst.removeprefix("total:") not in config.total_budgets():
        print(f"no total budget {args.analyst.removeprefix('total:')!r} in {args.config} "
              f"(there: {', '.join(sorted(config.total_budgets())) or 'none'})", file=sys.stderr)
        return 1
    if not total and args.analyst not in config.analysts:
        print(f"no analyst {args.analyst!r} in {args.config}", file=sys.stderr)
        return 1
    return asyncio.run(_budget(config, dsns.ledger.uri(), args.action, args.analyst))


async def _budget(config: Config, dsn: str, action: str, analyst: str) -> int:
    import asyncpg

    from dp_core.errors import DPError
    from server.ledger import BUDGET_COLUMNS, Ledger

    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        ledger = Ledger(pool, config.backend.ledger_schema)
        await ledger.migrate(config)
        scope = analyst.removeprefix("total:") if analyst.startswith("total:") else None
        try:
            if scope is not None:
                budget = (await ledger.reset_total(scope, "dp-proxy budget reset")
                          if action == "reset" else (await ledger.totals([scope]))[0])
            else:
                budget = (await ledger.reset(analyst, "dp-proxy budget reset")
                          if action == "reset" else await ledger.budget(analyst))
        except DPError as e:
            print(f"dp-proxy: {e.message}", file=sys.stderr)
            return 1
    finally:
        await pool.close()
    if action == "reset":
        print(f"budget of {analyst} reset (an event is appended to the ledger)")
    for name, value in zip(BUDGET_COLUMNS, budget.row(), strict=True):
        print(f"{name:18s} {value}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if config is None:
        return EXIT_CONFIG
    listen = config.listen.model_copy(update={"port": args.port, "host": args.host})
    config = config.model_copy(update={"listen": listen})
    return run(config, data_dir=args.data_dir, demo=True, config_path=args.config)


def _cmd_serve(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if config is None:
        return EXIT_CONFIG
    if not config.backend.embedded:
        # the checks of check-config --connect, at start-up: a misspelt uid column is the
        # operator's to fix, not the analysts' to discover (a backend not up yet is not a
        # problem of the config: the proxy starts and reports it unhealthy until it is)
        try:
            problems = asyncio.run(_database_problems(config))
        except (OSError, TimeoutError) as e:
            logging.getLogger("dp_proxy").warning("could not check the config against the "
                                                  "database at start-up: %s", e)
            problems = []
        if problems:
            print(f"{args.config}: does not match the database:", file=sys.stderr)
            for problem in problems:
                print(f"  {problem}", file=sys.stderr)
            return EXIT_CONFIG
    return run(config, data_dir=None, demo=config.backend.embedded, config_path=args.config)




if __name__ == "__main__":
    sys.exit(main())
