"""Operator-facing pieces: init-backend on an existing Postgres, and the Docker files."""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest
import yaml

from config import Config
from server.bootstrap import demo_config_text
from server.cli import _parser
from server.dsn import parse_dsn
from tests.support.backend import TEST_DATABASE, Backend, init_backend
from tests.support.paths import ROOT
from tests.support.processes import config_for
from tests.support.proxy import LoopThread, running_proxy


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_init_backend_print(backend: Backend, tmp_path: Path) -> None:
    cfg = config_for(backend, tmp_path, "ops_push", "ops_restr")
    out = _cli("init-backend", "--config", str(cfg), "--print")
    assert out.returncode == 0, out.stderr
    sql = out.stdout
    assert 'ALTER TABLE "public"."visits" ENABLE ROW LEVEL SECURITY;' in sql
    assert 'CREATE POLICY dp_pushdown_reads_all ON "public"."visits" FOR SELECT TO "ops_push" USING (true);' \
        in sql
    # the ledger belongs to the ledger role, and no other role of the proxy may use it
    assert 'CREATE SCHEMA IF NOT EXISTS "dpproxy" AUTHORIZATION "dp_ledger";' in sql
    assert ('REVOKE ALL ON SCHEMA "dpproxy" FROM "ops_push", "ops_restr", "dp_analyst_admin", '
            '"dp_analyst_alice", "dp_analyst_bob";') in sql
    # each analyst has its own role, with its derived password only as a SCRAM verifier
    from server.backend_setup import analyst_password

    assert backend.dsns.login_secret is not None
    for name in ("admin", "alice", "bob"):
        assert f'ALTER ROLE "dp_analyst_{name}" LOGIN CONNECTION LIMIT 40;' in sql
        assert f'ALTER ROLE "dp_analyst_{name}" PASSWORD \'SCRAM-SHA-256$4096:' in sql
        assert analyst_password(backend.dsns.login_secret, name) not in sql
    assert 'ALTER ROLE "ops_restr" PASSWORD' not in sql
    # only what the configuration names (issue 29): the protected tables and [public]
    assert "ALL TABLES IN SCHEMA" not in sql.replace(
        'REVOKE ALL ON ALL TABLES IN SCHEMA "dpproxy"', "")
    assert ('GRANT SELECT ON "public"."countries" TO "ops_push", "ops_restr", '
            '"dp_analyst_admin", "dp_analyst_alice", "dp_analyst_bob";') in sql
    # the database-wide part is shown, commented out, unless --harden
    assert "-- REVOKE USAGE ON LANGUAGE sql, plpgsql FROM PUBLIC;" in sql
    hardened = _cli("init-backend", "--config", str(cfg), "--print", "--harden").stdout
    assert "\nREVOKE USAGE ON LANGUAGE sql, plpgsql FROM PUBLIC;" in hardened


def test_init_backend_runs_and_sets_verifier_passwords(backend: Backend, tmp_path: Path) -> None:
    cfg = config_for(backend, tmp_path, "ops_push:pw1", "ops_restr:pw2")
    asyncio.run(_exec(backend, "CREATE TABLE IF NOT EXISTS public.riders (email text, "
                               "home_address text)"))
    out = _cli("init-backend", "--config", str(cfg), "--admin-dsn", backend.admin_dsn)
    assert out.returncode == 0, out.stderr
    assert ("roles ops_push, ops_restr and dp_ledger, and the analysts' dp_analyst_admin, "
            "dp_analyst_alice, dp_analyst_bob, are ready") in out.stdout
    assert "the public public.countries" in out.stdout
    assert "warning: public.riders is left closed" in out.stdout, out.stdout

    async def check() -> None:
        conn = await asyncpg.connect(backend.admin_dsn)
        try:
            rows = await conn.fetch("SELECT rolname, rolpassword FROM pg_authid "
                                    "WHERE rolname IN ('ops_push', 'ops_restr')")
            assert {r["rolname"] for r in rows} == {"ops_push", "ops_restr"}
            assert all(r["rolpassword"].startswith("SCRAM-SHA-256$4096:") for r in rows)
            policies = await conn.fetchval(
                "SELECT count(*) FROM pg_policy WHERE polrelid = 'visits'::regclass")
            assert policies == 1, "re-running the setup replaces the policy, it does not add one"
        finally:
            await conn.close()
        base = parse_dsn(backend.admin_dsn)
        restricted = await asyncpg.connect(base.uri(user="ops_restr", database=TEST_DATABASE))
        try:
            assert await restricted.fetchval("SELECT count(*) FROM visits") == 0
            assert await restricted.fetchval("SELECT count(*) FROM countries") > 100
            # a table of the same schema that the configuration does not name stays closed
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await restricted.fetchval("SELECT email FROM riders")
        finally:
            await restricted.close()

    from config import DEMO_CONFIG, load_config

    try:
        asyncio.run(check())
    finally:  # the policy of the suite's own roles
        init_backend(backend, load_config(DEMO_CONFIG, environ={}))
        asyncio.run(_exec(backend, "DROP TABLE IF EXISTS public.riders"))


async def _exec(backend: Backend, sql: str) -> None:
    conn = await asyncpg.connect(backend.admin_dsn)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def test_init_backend_refuses_embedded_config() -> None:
    out = _cli("init-backend", "--config", "config/demo.toml", "--print")
    assert out.returncode == 2 and "embedded" in out.stderr


def _dp_proxy_args(command: list[str]) -> list[str]:
    """The arguments after `dp-proxy` in a container command."""
    return command[1:] if command and command[0] == "dp-proxy" else command


def test_dockerfile_names_real_commands() -> None:
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    entry = next(ln for ln in lines if ln.startswith("ENTRYPOINT"))
    cmd = next(ln for ln in lines if ln.startswith("CMD"))
    assert yaml.safe_load(entry.split(None, 1)[1]) == ["dp-proxy"]
    args = yaml.safe_load(cmd.split(None, 1)[1])
    ns = _parser().parse_args(args)
    assert ns.command == "serve"
    for ln in lines:
        if ln.startswith("COPY "):
            for src in shlex.split(ln)[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"
    assert "USER dpproxy" in lines
    health = next(ln for ln in text.replace("\\\n", " ").splitlines() if ln.startswith("HEALTHCHECK"))
    check = yaml.safe_load(health.split("CMD", 1)[1])
    assert check[0] == "dp-proxy" and _parser().parse_args(check[1:]).command == "healthcheck"
    assert "ENV DPPROXY_METRICS__PORT=9187" in lines  # so that the check has /healthz to ask


def test_compose_names_real_commands_and_files() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert services["postgres"]["image"].startswith("postgres:16")
    for name in ("init", "proxy"):
        args = _dp_proxy_args(services[name]["command"])
        ns = _parser().parse_args(args)
        config = Path(ns.config)
        assert config.parts[:2] == ("/", "app") and (ROOT / Path(*config.parts[2:])).exists()
    assert _parser().parse_args(services["init"]["command"]).demo_data
    check = services["proxy"]["healthcheck"]["test"]
    assert check[:2] == ["CMD", "dp-proxy"]
    assert _parser().parse_args(check[2:]).config == Path(ns.config)
    assert services["proxy"]["depends_on"]["init"]["condition"] == "service_completed_successfully"


@pytest.mark.parametrize("path", ["config/docker.toml", "config/demo.toml", "config/example.toml"])
def test_shipped_configs_pass_check_config(path: str) -> None:
    out = _cli("check-config", path)
    assert out.returncode == 0, out.stderr


def test_budget_cli_show_and_reset(backend: Backend, tmp_path: Path) -> None:
    base = parse_dsn(backend.admin_dsn)
    password = backend.pushdown.password
    cfg = config_for(backend, tmp_path, f"dp_pushdown:{password}", f"dp_restricted:{password}")
    out = _cli("budget", "show", "bob", "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    assert "epsilon_total" in out.stdout and "analyst            bob" in out.stdout
    out = _cli("budget", "reset", "bob", "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    assert "budget of bob reset" in out.stdout
    assert "epsilon_spent      0" in out.stdout
    out = _cli("budget", "show", "nobody", "--config", str(cfg))
    assert out.returncode == 1 and "no analyst 'nobody'" in out.stderr
    out = _cli("budget", "show", "bob", "--config", "config/demo.toml")
    assert out.returncode == 2 and "embedded" in out.stderr
    # a total budget: by its name, total:SCOPE
    out = _cli("budget", "show", "total:database", "--config", str(cfg))
    assert out.returncode == 1 and "no total budget 'database'" in out.stderr
    cfg.write_text(cfg.read_text() + "\n[total_budget]\nepsilon = 7\n")
    out = _cli("budget", "reset", "total:database", "--config", str(cfg))
    assert out.returncode == 0, out.stderr
    assert "analyst            total:database" in out.stdout
    assert "epsilon_total      7" in out.stdout and "epsilon_spent      0" in out.stdout
    del base


def test_healthcheck_command(loop_thread: LoopThread, demo_config: Config, backend: Backend,
                             tmp_path: Path) -> None:
    config = demo_config.model_copy(update={"metrics": demo_config.metrics.model_copy(
        update={"port": 0})})
    path = tmp_path / "health.toml"
    path.write_text((ROOT / "config" / "demo.toml").read_text())

    def check(**env: int) -> int:
        environ = dict(os.environ, **{k: str(v) for k, v in env.items()})
        return subprocess.run([sys.executable, "-m", "server.cli", "healthcheck", "--config",
                               str(path), "--timeout", "2"], capture_output=True, text=True,
                              timeout=60, cwd=ROOT, env=environ).returncode

    with running_proxy(loop_thread, config, backend) as px:
        assert px.server.ops is not None
        metrics_port, listen_port = px.server.ops.port, px.port
        assert check(DPPROXY_METRICS__PORT=metrics_port) == 0
        assert check(DPPROXY_LISTEN__PORT=listen_port) == 0  # no metrics: a TCP connect
        loop_thread.run(px.server.pool.close())  # the backend no longer answers: 503
        assert check(DPPROXY_METRICS__PORT=metrics_port) == 1
    assert check(DPPROXY_METRICS__PORT=metrics_port) == 1
    assert check(DPPROXY_LISTEN__PORT=listen_port) == 1


def test_ordinary_mistakes_get_one_line_not_a_traceback(backend: Backend, tmp_path: Path) -> None:
    """Issue 29: a wrong password, a database or port that is not there, a DSN without the
    password the server wants: one line saying what failed and what to do, exit status 1."""
    wrong = parse_dsn(backend.admin_dsn)
    from dataclasses import replace

    cfg = config_for(backend, tmp_path, "ops_push:pw1", "ops_restr:pw2")
    cases = [
        ("init-backend", "--config", str(cfg), "--admin-dsn",
         replace(wrong, database="no_such_database").uri()),
        ("init-backend", "--config", str(cfg), "--admin-dsn",
         "postgresql://postgres@127.0.0.1:1/postgres"),
        ("budget", "show", "alice", "--config",
         str(config_for(backend, tmp_path, "ops_push:pw1", "ops_restr:pw2",
                         ledger="no_such_role:nope"))),
    ]
    for args in cases:
        out = _cli(*args)
        assert out.returncode == 1, (args, out.stdout, out.stderr)
        assert "Traceback" not in out.stderr, out.stderr
        lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"dp-proxy {args[0]}: "), out.stderr


def test_check_config_connect_lists_every_mismatch_and_serve_refuses_to_start(
        backend: Backend, tmp_path: Path) -> None:
    """Issue 29: a misspelt uid column, a bound on a column that is not there or not a number,
    a public table or public keys' column that is not there: all listed at once by `check-config --connect` and by
    `serve` at start-up (exit 2), before any analyst meets them."""
    from dataclasses import replace

    good = tmp_path / "good.toml"
    good.write_text(demo_config_text(backend.dsns))
    out = _cli("check-config", str(good), "--connect")
    assert out.returncode == 0, out.stderr
    assert "checked against the database" in out.stdout
    text = good.read_text()
    bad_text = (text.replace('[tables.visits]\nuid_column = "uid"',
                             '[tables.visits]\nuid_column = "user_id"\n'
                             'columns.browser = { lower = 0, upper = 1 }\n'
                             'columns.seconds = { lower = 0, upper = 1 }\n'
                             'columns.country = { public_keys_from = "countries.nope" }')
                .replace('tables = ["countries"]', 'tables = ["countries", "ops.nope"]'))
    assert bad_text != text
    bad = tmp_path / "bad.toml"
    bad.write_text(bad_text)
    out = _cli("check-config", str(bad), "--connect")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    for problem in ("tables.visits.uid_column: public.visits has no column 'user_id'",
                    "tables.visits.columns.browser: bounds on a column of type text",
                    "tables.visits.columns.seconds: public.visits has no such column",
                    "public.tables: there is no table ops.nope",
                    "tables.visits.columns.country.public_keys_from: there is no column "
                    "public.countries.nope"):
        assert problem in out.stderr, out.stderr
    assert "(its columns: browser, country, duration, uid)" in out.stderr
    served = _cli("serve", "--config", str(bad))
    assert served.returncode == 2 and "user_id" in served.stderr, served.stderr
    wrong = replace(backend.restricted, user="no_such_role")  # (the test cluster trusts sockets)
    login = tmp_path / "login.toml"
    login.write_text(demo_config_text(replace(backend.dsns, restricted=wrong)))
    out = _cli("check-config", str(login), "--connect")
    assert out.returncode == 2 and "backend.restricted_dsn: cannot log in" in out.stderr, out.stderr
