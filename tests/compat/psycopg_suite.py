"""psycopg's own test suite run directly and through dp-proxy: what passes only directly, by cause.

Issue 34: given a psycopg source tree (of the psycopg version installed where its tests will
run) and a superuser DSN of a Postgres server, this script

1. creates a scratch database there with one protected table the suite never touches
   (`dp_compat.untouched`), writes a dp-proxy configuration for it with one analyst, runs
   `dp-proxy init-backend` (roles named `dpcompat_TAG_...`, TAG random), and grants the
   analyst's backend role what psycopg's tests need: CREATE on the database (their `create
   schema`) and on the schema public (their tables and types); temporary objects are every
   role's already;
2. runs psycopg's suite (`pytest -m "not slow"`, without tests/crdb, pytest-randomly off)
   directly against Postgres, logged in as the analyst's backend role (the privileges the
   proxy's session has, so that only the proxy differs), on a fresh database;
3. on a fresh database again, starts `dp-proxy serve` on a free loopback port and runs the
   suite through it, logged in as the analyst; the failures whose message names no cause
   (libpq-level tests only assert a result status) run once more, alone, with psycopg's
   `--pq-trace`, whose ErrorResponses give the server's (or the proxy's) SQLSTATE and message;
4. prints the tests that passed directly but not through the proxy, grouped by cause (read
   from their errors, and from what the proxy logged while each ran: the refusals' and
   failing statements' SQLSTATEs), and writes them to WORK_DIR/differences.json.

Nothing is fetched: the psycopg tree and the interpreter that runs its tests (with psycopg,
pytest, anyio and pproxy installed; pytest-timeout too, so that a hang cannot stop the run)
are given. Not part of CI, and not collected by dp-proxy's own pytest (not a test_*.py).

    .venv/bin/python tests/compat/psycopg_suite.py --psycopg-src /tmp/psycopg-src \\
        --dsn postgresql://postgres:pw@127.0.0.1:5432/postgres \\
        --python /tmp/pgtest-venv/bin/python [--pytest-args='-k copy']

Run it with dp-proxy's interpreter (the repo's .venv): it runs dp-proxy as `python -m
server.cli` from this checkout, or from `--proxy-root DIR` (an export of a commit, say).
The scratch database and roles are dropped at the end (`--keep` leaves them). `--only proxy`
runs the proxy's pass again against the direct pass already in `--work-dir`; `--only report`
only reads what is there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from bisect import bisect_left, bisect_right
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ANALYST = "psycopg"
PROTECTED_SCHEMA = "dp_compat"
PROTECTED_TABLE = "untouched"
TIMES_PLUGIN = '''"""When each test ran (wall clock): written by dp-proxy's tests/compat/psycopg_suite.py."""
import json
import os
import time

_out = open(os.environ["DPCOMPAT_TIMES"], "a")


def pytest_runtest_logstart(nodeid, location):
    _out.write(json.dumps(["start", nodeid, time.time()]) + "\\n")


def pytest_runtest_logfinish(nodeid, location):
    _out.write(json.dumps(["end", nodeid, time.time()]) + "\\n")
    _out.flush()


def pytest_runtest_setup(item):
    mark = item.get_closest_marker("flakey")
    if mark is not None:
        _out.write(json.dumps(["flakey", item.nodeid, str(mark.args[0] if mark.args else "")])
                   + "\\n")


def pytest_unconfigure(config):
    _out.close()
'''
"""A pytest plugin (loaded from WORK_DIR) so that what the proxy logged is told to each test, and
the tests psycopg marks flakey are known."""


# ------------------------------------------------------------------------------ the set-up


@dataclass
class Setup:
    """The scratch database, its roles and the dp-proxy configuration."""

    admin_dsn: str
    """The superuser DSN given, as dp-proxy parses it."""
    database: str
    work: Path
    root: Path
    """The dp-proxy checkout that runs (`python -m server.cli` there)."""
    analyst_password: str = field(default_factory=lambda: secrets.token_hex(12))
    role_password: str = field(default_factory=lambda: secrets.token_hex(12))
    port: int = 0
    workers: str = "auto"
    harden: bool = False
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    """In the names of the roles (and of the default database): runs on one server at once
    do not trample on each other's roles."""

    @property
    def prefix(self) -> str:
        return f"dpcompat_{self.tag}_"

    def _dsn(self) -> Any:
        from server.dsn import parse_dsn

        return parse_dsn(self.admin_dsn)

    def admin_uri(self, database: str | None = None) -> str:
        """The superuser's URI on the scratch database (or on `database`)."""
        return str(self._dsn().uri(database=database or self.database))

    def server_uri(self) -> str:
        """The superuser's URI on the database the DSN names (to make and drop the scratch one)."""
        return str(self._dsn().uri())

    def role_uri(self, role: str) -> str:
        """URI of one of the proxy's backend roles (pushdown, restricted, ledger)."""
        from dataclasses import replace

        dsn = replace(self._dsn(), user=self.prefix + role, password=self.role_password,
                      database=self.database)
        return str(dsn.uri())

    @property
    def analyst_role(self) -> str:
        return f"{self.prefix}analyst_{ANALYST}"

    def direct_dsn(self) -> str:
        """libpq key=value DSN of the analyst's backend role, straight to Postgres."""
        from server.backend_setup import analyst_password

        base = self._dsn()
        password = analyst_password(self.role_password, ANALYST)
        return _conninfo(host=base.host, port=base.port, user=self.analyst_role,
                         password=password, dbname=self.database)

    def proxy_dsn(self) -> str:
        return _conninfo(host="127.0.0.1", port=self.port, user=ANALYST,
                         password=self.analyst_password, dbname=self.database)

    def config_text(self) -> str:
        from server.scram import make_verifier

        verifier = make_verifier(self.analyst_password)
        return f"""# dp-proxy in front of psycopg's test suite (tests/compat/psycopg_suite.py)
auth_method = "scram-sha-256"

[listen]
host = "127.0.0.1"
port = {self.port}
max_connections = 400
max_unauthenticated = 200
workers = {'"auto"' if self.workers == "auto" else int(self.workers)}

[log]
format = "json"      # read back to tell each failing test what the proxy logged meanwhile
statements = "dp"    # refusals and failing pass-through statements, with their SQLSTATE

[backend]
pushdown_dsn = "{self.role_uri('pushdown')}"
restricted_dsn = "{self.role_uri('restricted')}"
ledger_dsn = "{self.role_uri('ledger')}"
analyst_role_prefix = "{self.prefix}analyst_"

[analysts.{ANALYST}]
scram_verifier = "{verifier}"
max_connections = 250

[tables.{PROTECTED_TABLE}]
schema = "{PROTECTED_SCHEMA}"
uid_column = "uid"
columns.amount = {{ lower = 0, upper = 100 }}
"""


def _conninfo(**params: object) -> str:
    def value(v: object) -> str:
        s = str(v)
        return s if s and re.fullmatch(r"[^\s'\\]+", s) else "'" + s.replace("\\", "\\\\") \
            .replace("'", "\\'") + "'"

    return " ".join(f"{k}={value(v)}" for k, v in params.items())


async def _execute(uri: str, statements: list[str]) -> None:
    import asyncpg

    conn = await asyncpg.connect(uri)
    try:
        for stmt in statements:
            await conn.execute(stmt)
    finally:
        await conn.close()


def fresh_database(setup: Setup) -> None:
    """(Re)create the scratch database, its protected table, the backend roles (init-backend)
    and the analyst's extra grants."""
    db = _ident(setup.database)
    asyncio.run(_execute(setup.server_uri(), [
        f"DROP DATABASE IF EXISTS {db} WITH (FORCE)",
        f"CREATE DATABASE {db}",
    ]))
    asyncio.run(_execute(setup.admin_uri(), [
        f"CREATE SCHEMA {PROTECTED_SCHEMA}",
        f"CREATE TABLE {PROTECTED_SCHEMA}.{PROTECTED_TABLE} (uid int NOT NULL, amount int)",
        f"INSERT INTO {PROTECTED_SCHEMA}.{PROTECTED_TABLE} "
        "SELECT i % 50, i % 100 FROM generate_series(1, 500) i",
    ]))
    config = setup.work / "dp-proxy.toml"
    config.write_text(setup.config_text())
    config.chmod(0o600)
    command = [sys.executable, "-m", "server.cli", "--log-level", "WARNING", "init-backend",
               "--config", str(config), "--admin-dsn", setup.admin_uri()]
    if setup.harden:
        command.append("--harden")
    done = subprocess.run(command, cwd=setup.root, env=_proxy_env(setup), capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"init-backend failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    role = _ident(setup.analyst_role)
    asyncio.run(_execute(setup.admin_uri(), [
        # what psycopg's tests make: schemas (types/test_composite, test_range), tables,
        # types and domains in public; TEMP is PUBLIC's in every database
        f"GRANT CREATE ON DATABASE {db} TO {role}",
        f"GRANT CREATE ON SCHEMA public TO {role}",
    ]))


def _proxy_env(setup: Setup) -> dict[str, str]:
    """The environment of dp-proxy's commands: its modules from setup.root, no DPPROXY_ or PG
    variables of the caller's (they would override the configuration or the DSNs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPPROXY_", "PG"))}
    env["PYTHONPATH"] = str(setup.root)
    return env


def drop_everything(setup: Setup) -> None:
    roles = [setup.prefix + r for r in ("pushdown", "restricted", "ledger")] + [setup.analyst_role]
    asyncio.run(_execute(setup.server_uri(), [
        f"DROP DATABASE IF EXISTS {_ident(setup.database)} WITH (FORCE)",
        *(f"DROP ROLE IF EXISTS {_ident(r)}" for r in roles),
    ]))


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the forked proxy: SIGTERM when this script dies (killed, it runs no `finally`)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def running_proxy(setup: Setup) -> Iterator[None]:
    """`dp-proxy serve` on setup.port, its log in WORK_DIR/dp-proxy.log."""
    log = (setup.work / "dp-proxy.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--config", str(setup.work / "dp-proxy.toml")],
        cwd=setup.root, env=_proxy_env(setup), stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=_die_with_parent)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"dp-proxy exited ({proc.returncode}): see "
                                 f"{setup.work}/dp-proxy.log")
            try:
                socket.create_connection(("127.0.0.1", setup.port), 1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("dp-proxy did not start within 60 s") from None
                time.sleep(0.2)
        yield
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


# ------------------------------------------------------------------------------- the runs


def run_suite(name: str, dsn: str, args: argparse.Namespace, work: Path,
              tests: list[str] | None = None) -> Path:
    """Run psycopg's suite against `dsn` (or only `tests`, node ids, with a libpq trace of
    their connections in WORK/trace.txt): its junit XML (the output goes to WORK/NAME.log)."""
    src = args.psycopg_src.resolve()
    xml = work / f"{name}.xml"
    command = [args.python, "-m", "pytest", "-m", "not slow", "--ignore=tests/crdb",
               "-p", "no:randomly", "-p", "no:cov", "-p", "dpcompat_times", f"--junitxml={xml}",
               "-o", "junit_family=xunit1", "-o", f"cache_dir={work / ('cache-' + name)}",
               "--test-dsn", dsn, "-rN", "-q"]
    has_timeout = subprocess.run([args.python, "-c", "import pytest_timeout"],
                                 capture_output=True).returncode == 0
    if has_timeout and args.timeout:
        command += [f"--timeout={args.timeout}"]
    if tests is None:
        command += shlex.split(args.pytest_args or "")
    else:
        command += [f"--pq-trace={work / 'trace.txt'}", *tests]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    (work / "dpcompat_times.py").write_text(TIMES_PLUGIN)
    times = work / f"{name}-times.jsonl"
    times.unlink(missing_ok=True)
    env.update(PSYCOPG_TEST_DSN=dsn, PYTHONDONTWRITEBYTECODE="1", DPCOMPAT_TIMES=str(times),
               PYTHONPATH=os.pathsep.join([str(work), *filter(None, [env.get("PYTHONPATH")])]))
    log_path = work / f"{name}.log"
    print(f"== {name}: {shlex.join(command[:3])} ... (output: {log_path})", flush=True)
    started = time.monotonic()
    with log_path.open("w") as log:
        done = subprocess.run(command, cwd=src, env=env, stdout=log, stderr=subprocess.STDOUT)
    tail = [ln for ln in log_path.read_text(errors="replace").splitlines()
            if re.search(r"\d+ (passed|failed|errors?)\b.* in [\d.]+s", ln)][-1:]
    print(f"   {name}: exit {done.returncode} in {time.monotonic() - started:.0f} s: "
          f"{tail[0] if tail else '(no output)'}", flush=True)
    if not xml.exists():
        raise SystemExit(f"{name}: pytest wrote no junit XML: see {log_path}")
    return xml


@dataclass
class Result:
    outcome: str
    """passed, failed, skipped or xfailed."""
    message: str = ""
    """The error: the failure's message and its `E ` lines (not the test's source)."""
    proxy_log: list[str] = field(default_factory=list)
    """What the proxy logged while the test ran: errors of statements (kind and SQLSTATE;
    the log never has their text) and its warnings."""
    flakey: str = ""
    """psycopg's reason, when it marks the test flakey."""
    rerun: str = ""
    """Its outcome when re-run alone with a trace (only failures whose message names no cause)."""
    server_errors: list[str] = field(default_factory=list)
    """SQLSTATE and message of the ErrorResponses the test's own connection got, from the
    libpq trace of a re-run (only for failures whose message names no cause)."""


def read_junit(path: Path) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for tc in ET.parse(path).iter("testcase"):
        nodeid = _nodeid(tc)
        problems = [e for e in tc if e.tag in ("failure", "error")]
        skipped = [e for e in tc if e.tag == "skipped"]
        if problems:
            parts = []
            for e in problems:
                parts.append(e.get("message") or "")
                parts += [ln[1:].strip() for ln in (e.text or "").splitlines()
                          if ln.startswith("E ")]
            results[nodeid] = Result("failed", "\n".join(dict.fromkeys(p for p in parts if p)))
        elif skipped:
            kind = "xfailed" if skipped[0].get("type") == "pytest.xfail" else "skipped"
            results[nodeid] = Result(kind, skipped[0].get("message") or "")
        else:
            results[nodeid] = Result("passed")
    return results


def _nodeid(tc: ET.Element) -> str:
    name, classname, file = tc.get("name", ""), tc.get("classname", ""), tc.get("file")
    if not file:
        return f"{classname}::{name}"
    module = file.removesuffix(".py").replace("/", ".")
    rest = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
    return "::".join([file, *rest.split("."), name] if rest else [file, name])


def attach_proxy_log(results: dict[str, Result], work: Path) -> None:
    """Give each failing test of the proxy pass what dp-proxy logged while it ran (by time:
    the tests run one at a time; a line logged at a test's edge may land in its neighbour)."""
    windows: dict[str, list[float]] = {}
    times = work / "proxy-times.jsonl"
    for line in times.read_text().splitlines() if times.exists() else []:
        what, nodeid, t = json.loads(line)
        if what == "flakey":
            if nodeid in results:
                results[nodeid].flakey = t or "flakey"
            continue
        windows.setdefault(nodeid, [t, t])[0 if what == "start" else 1] = t
    events: list[tuple[float, str]] = []
    log = work / "dp-proxy.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        try:
            rec = json.loads(line)
            t = datetime.strptime(rec["time"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
        except (ValueError, KeyError, TypeError):
            continue
        if rec.get("logger") == "dp_proxy.statement":
            if rec.get("outcome") != "error":
                continue
            text = f"{rec.get('kind')} {rec.get('sqlstate')}"
        elif rec.get("level") in ("WARNING", "ERROR", "CRITICAL"):
            exc = str(rec.get("exception") or "").strip().splitlines()
            text = f"{rec['level']} {rec.get('logger')}: {rec.get('message')}" + \
                (f" [{exc[-1]}]" if exc else "")
        else:
            continue
        events.append((t.timestamp(), text))
    events.sort()
    stamps = [t for t, _ in events]
    for nodeid, res in results.items():
        if res.outcome != "failed" or nodeid not in windows:
            continue
        start, end = windows[nodeid]
        seen = [text for _, text in events[bisect_left(stamps, start - 0.002):
                                          bisect_right(stamps, end + 0.002)]]
        res.proxy_log = [f"{text} (x{n})" if n > 1 else text for text, n in Counter(seen).items()]


def trace_errors(path: Path) -> dict[str, list[str]]:
    """The ErrorResponses of a `--pq-trace` file (psycopg's suite heads each test's part with
    its module::qualname), by that title: "SQLSTATE message"."""
    found: dict[str, list[str]] = defaultdict(list)
    title = ""
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if m := re.fullmatch(r"=* (\S+::\S+) =*", line):
            title = m.group(1)
        elif "\tErrorResponse\t" in line and title:
            # (libpq writes each field as  X "value", quotes inside the value unescaped)
            fields = dict(re.findall(r' ([A-Za-z]) "(.*?)"(?= [A-Za-z] "| \\x00|$)', line))
            error = f"{fields.get('C', '?')}: {fields.get('M', '')}"
            if error not in found[title]:
                found[title].append(error)
    return found


def _trace_title(nodeid: str) -> str:
    """The title psycopg's --pq-trace gives a test's part: module::qualname."""
    file, *names = nodeid.split("::")
    qualname = ".".join(names)
    return file.removesuffix(".py").replace("/", ".") + "::" + qualname.split("[")[0]


def differences(work: Path) -> dict[str, Result]:
    """The proxy pass's results, with what dp-proxy logged during each failing test and, for
    those re-run with a trace, the server's errors."""
    proxy = read_junit(work / "proxy.xml")
    attach_proxy_log(proxy, work)
    errors = trace_errors(work / "trace.txt")
    rerun = read_junit(work / "rerun.xml") if (work / "rerun.xml").exists() else {}
    for nodeid, res in proxy.items():
        if res.outcome == "failed":
            res.server_errors = errors.get(_trace_title(nodeid), [])
            res.rerun = rerun[nodeid].outcome if nodeid in rerun else ""
    return proxy


# ----------------------------------------------------------------------------- the causes


@dataclass(frozen=True)
class Cause:
    group: str
    """The group's name; {0} is filled with the pattern's first group (and `why`'s {1} with
    its second), when it has them."""
    pattern: str
    """How it shows in the test's error (or the server's, from the trace of a re-run)."""
    why: str
    test: str = ""
    """A pattern the test's node id must match too."""


CAUSES = [
    Cause("refused: DO / CALL", r"(?:DO blocks|procedure calls \(CALL\)) are not allowed through "
          r"dp-proxy", "deliberate: the code a DO block or a procedure runs is hidden from the "
          "proxy's checks"),
    Cause("refused: LISTEN / NOTIFY", r"(?:LISTEN|NOTIFY) is not allowed through dp-proxy",
          "deliberate: notification channels are shared by every session of the database"),
    Cause("refused: {0}", r"(\w[^\n:\"]*?)(?:\(\))? (?:is|are) not (?:allowed|available) through dp-proxy: "
          r"([^\n;\"]+)", "deliberate: {1}"),
    Cause("standard_conforming_strings off", r"standard_conforming_strings",
          "deliberate: the proxy must read string literals as Postgres does"),
    Cause("client encoding refused", r"client_encoding \S+ is not supported",
          "deliberate: encodings whose SQL the proxy cannot read as Postgres does"),
    Cause("set_config / client_encoding from a bound parameter",
          r"set_config\(\) with a name that is not a literal|client_encoding can only be set to a "
          r"literal", "pending: set_config() with bound parameters, checked at Bind"),
    Cause("NegotiateProtocolVersion / protocol", r"(?i)protocol version|NegotiateProtocolVersion|"
          r"unsupported frontend protocol|max_protocol_version|min_protocol_version",
          "pending: NegotiateProtocolVersion"),
    Cause("backend pid", r"(?i)backend_pid|pg_backend_pid|\bpids?\b",
          "pending: the real backend pid in BackendKeyData"),
    Cause("COPY early stop", r"TransactionStatus\.INTRANS.*\n?.*TransactionStatus\.INERROR|"
          r"TransactionStatus\.INERROR.*\n?.*TransactionStatus\.INTRANS",
          "a race a relay cannot avoid: the COPY may end before the client's cancel reaches the "
          "backend", test=r"(?i)copy"),
    Cause("timeout (hang)", r"Timeout \(|Failed: Timeout", "a test that hung through the proxy"),
    Cause("collateral: warnings of connections left open",
          r"unraisable exception|PytestUnraisableExceptionWarning|ResourceWarning",
          "garbage collection of connections that earlier failing tests left open"),
    Cause("other dp-proxy refusal", r"dp-proxy", "see the message"),
]
"""The causes, tried in order."""
RERUN_PASSED = Cause("passes when re-run alone", "", "collateral of an earlier failure, or flaky")


def cause_of(nodeid: str, result: Result) -> tuple[str, str | None]:
    """The group of a test that failed through the proxy, and why (None: no cause named)."""
    if result.rerun == "passed":
        return RERUN_PASSED.group, RERUN_PASSED.why
    text = "\n".join([result.message, *result.server_errors])
    for cause in CAUSES:
        if cause.test and not re.search(cause.test, nodeid):
            continue
        if m := re.search(cause.pattern, text):
            # (a repr's escaped newline or closing quote ends the reason)
            found = [g.split("\\n")[0].rstrip("')") for g in m.groups() if g]
            return cause.group.format(*found), cause.why.format(*found)
    if result.flakey:
        return "flaky: psycopg marks it so", f"psycopg: {result.flakey}"
    refused = sorted({e.split()[1] for e in result.proxy_log if e.startswith("refused ")})
    if refused:
        return f"refused by the proxy ({', '.join(refused)}; the test does not show why)", None
    if result.outcome in ("skipped", "missing"):
        return f"{'skipped' if result.outcome == 'skipped' else 'not run'} through the proxy", None
    first = text.splitlines()[0] if text else "(no message)"
    kind = re.match(r"([\w.]+(Error|Exception|Warning|Failed|Exit)\w*)", first)
    return f"other: {kind.group(1) if kind else first[:60]}", None


@dataclass
class Group:
    why: str | None
    tests: list[tuple[str, Result]] = field(default_factory=list)


def compare(direct: dict[str, Result], proxy: dict[str, Result]) -> dict[str, Group]:
    """The tests that pass directly but not through the proxy, by cause, largest group first."""
    groups: dict[str, Group] = {}
    for nodeid, res in sorted(direct.items()):
        through = proxy.get(nodeid, Result("missing"))
        if res.outcome != "passed" or through.outcome == "passed":
            continue
        group, why = cause_of(nodeid, through)
        groups.setdefault(group, Group(why)).tests.append((nodeid, through))
    return dict(sorted(groups.items(), key=lambda kv: (-len(kv[1].tests), kv[0])))


def report(direct: dict[str, Result], proxy: dict[str, Result], groups: dict[str, Group],
           examples: int) -> str:
    def tally(results: dict[str, Result]) -> str:
        counts = Counter(r.outcome for r in results.values())
        return ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))

    lines = [f"direct:        {tally(direct)}", f"through proxy: {tally(proxy)}",
             f"pass directly, not through the proxy: {sum(len(g.tests) for g in groups.values())}"]
    only_proxy = sorted(n for n, r in proxy.items() if r.outcome == "passed"
                        and direct.get(n, Result("missing")).outcome != "passed")
    if only_proxy:
        lines.append(f"(pass through the proxy, not directly: {len(only_proxy)}, e.g. "
                     f"{', '.join(only_proxy[:3])})")
    for name, group in groups.items():
        lines += ["", f"## {name}: {len(group.tests)}" + (f"  ({group.why})" if group.why else "")]
        for nodeid, res in group.tests[:examples]:
            lines += [f"  {nodeid}", f"      {(res.message or res.outcome).splitlines()[0][:200]}"]
            if res.server_errors:
                lines.append(f"      server: {'; '.join(res.server_errors)[:200]}")
            if res.proxy_log:
                lines.append(f"      proxy log: {'; '.join(res.proxy_log)[:200]}")
        if len(group.tests) > examples:
            lines.append(f"  ... and {len(group.tests) - examples} more (differences.json)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the script


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--psycopg-src", type=Path, required=True,
                    help="a psycopg source tree (its tests/), of the version --python has")
    ap.add_argument("--dsn", required=True,
                    help="a superuser's DSN (URI or key=value) of the Postgres server to use")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter that runs psycopg's tests (default: this one)")
    ap.add_argument("--pytest-args", default="", help="more pytest arguments, one string")
    ap.add_argument("--database", help="the scratch database, dropped and made again (default: "
                    "dpcompat_TAG, TAG random, as in the roles' names)")
    ap.add_argument("--work-dir", type=Path, help="where logs, XML and the config go "
                    "(default: a new directory under /tmp)")
    ap.add_argument("--proxy-root", type=Path, default=ROOT,
                    help="the dp-proxy checkout to run (default: this one), e.g. an export of a "
                         "commit (git archive HEAD | tar -x -C DIR)")
    ap.add_argument("--workers", default="auto", help="[listen] workers of the proxy")
    ap.add_argument("--harden", action="store_true", help="init-backend --harden")
    ap.add_argument("--timeout", type=int, default=120,
                    help="seconds per test, with pytest-timeout installed (0: none)")
    ap.add_argument("--examples", type=int, default=8, help="example tests shown per group")
    ap.add_argument("--only", choices=["direct", "proxy", "report"],
                    help="run one pass and compare with the other pass's XML already in "
                         "--work-dir, or run none and only report what is there")
    ap.add_argument("--no-trace-rerun", dest="trace_rerun", action="store_false",
                    help="do not run the unexplained failures again with a libpq trace")
    ap.add_argument("--keep", action="store_true",
                    help="keep the scratch database and roles at the end")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    root = args.proxy_root.resolve()
    sys.path.insert(0, str(root))  # (dp-proxy's modules, from the checkout it runs)
    if not (args.psycopg_src / "tests" / "conftest.py").exists():
        print(f"{args.psycopg_src}: no tests/conftest.py: not a psycopg source tree",
              file=sys.stderr)
        return 2
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="dp-psycopg-compat-"))
    work.mkdir(parents=True, exist_ok=True)
    setup = Setup(args.dsn, args.database or "", work, root, port=free_port(),
                  workers=args.workers, harden=args.harden)
    setup.database = args.database or f"dpcompat_{setup.tag}"
    if args.only != "report" and setup.database == setup._dsn().database:
        print(f"--database {setup.database} is the DSN's own database: the scratch database is "
              "dropped and made again, give another", file=sys.stderr)
        return 2
    version = subprocess.run([args.python, "-c", "import psycopg; print(psycopg.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    print(f"psycopg {version or '?'} ({args.python}); tests from {args.psycopg_src}; "
          f"work dir {work}", flush=True)
    if args.only == "report":
        args.keep = True
    try:
        if args.only not in ("proxy", "report"):
            fresh_database(setup)
            run_suite("direct", setup.direct_dsn(), args, work)
        if args.only not in ("direct", "report"):
            for stale in ("rerun.xml", "trace.txt"):
                (work / stale).unlink(missing_ok=True)
            fresh_database(setup)
            with running_proxy(setup):
                run_suite("proxy", setup.proxy_dsn(), args, work)
                passed = {n for n, r in read_junit(work / "direct.xml").items()
                          if r.outcome == "passed"} if (work / "direct.xml").exists() else None
                unexplained = [n for n, r in differences(work).items()
                               if r.outcome == "failed" and cause_of(n, r)[1] is None
                               and (passed is None or n in passed)]
                if unexplained and args.trace_rerun:
                    print(f"== {len(unexplained)} failures whose message names no cause: run "
                          "again with a libpq trace, for the server's errors", flush=True)
                    run_suite("rerun", setup.proxy_dsn(), args, work, unexplained)
    finally:
        if not args.keep:
            drop_everything(setup)
    groups = compare(read_junit(work / "direct.xml"), differences(work))
    (work / "differences.json").write_text(json.dumps(
        {name: {"why": g.why, "tests": [
            {"test": n, "outcome": r.outcome, "error": r.message, "server_errors": r.server_errors,
             "proxy_log": r.proxy_log, "rerun": r.rerun} for n, r in g.tests]}
         for name, g in groups.items()}, indent=1))
    direct, proxy = read_junit(work / "direct.xml"), read_junit(work / "proxy.xml")
    text = report(direct, proxy, groups, args.examples)
    (work / "report.txt").write_text(text + "\n")
    print()
    print(text)
    print(f"\n(all of it: {work}/differences.json; the proxy's log: {work}/dp-proxy.log)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
