"""Helpers the benchmarks share: the dataset with a proxy in front, the machine, RESULTS.md."""

from __future__ import annotations

import asyncio
import os
import platform
import re
import socket
import statistics
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
DATABASE = "bench"


@dataclass
class BenchSetup:
    admin: asyncpg.Connection
    """Superuser, on the bench database."""
    pushdown_dsn: str
    port: int
    proxy_pid: int
    rows: int
    users: int
    generated_in: float

    async def analyst(self, name: str = "alice") -> asyncpg.Connection:
        """A session through the proxy as the demo's analyst `name` (its password is its name)."""
        return await asyncpg.connect(host="127.0.0.1", port=self.port, user=name,
                                     password=name, database=DATABASE, ssl=False)


@asynccontextmanager
async def dataset_and_proxy(scale: float, extra_config: str = "",
                            settings: dict[str, str] | None = None,
                            shape: str = "demo") -> AsyncIterator[BenchSetup]:
    """An embedded Postgres with the bench dataset at `scale` (of the `shape` bench/dataset.py
    names), and dp-proxy as its own process.

    `extra_config` is appended to the proxy's TOML (more analysts, say); `settings`
    replace or add `key = value` lines ({"pushdown_pool_size": "20"}: [backend] when no
    section is named; {"listen.max_connections": "300"}). Answer reuse is off unless
    `settings` turn it on: each query asked again is answered afresh.
    """
    sys.path.insert(0, str(ROOT))
    from dataset import generate

    from config import DEMO_CONFIG, load_config
    from server.bootstrap import apply_backend_setup, demo_config_text, embedded_dsns
    from server.embedded import EmbeddedPostgres

    with EmbeddedPostgres() as pg, tempfile.TemporaryDirectory() as tmp:
        admin = await asyncpg.connect(pg.dsn())
        await admin.execute(f"CREATE DATABASE {DATABASE}")
        await admin.close()
        conn = await asyncpg.connect(pg.dsn(database=DATABASE))
        seconds = await generate(conn, scale, shape)
        n_rows = await conn.fetchval("SELECT count(*) FROM visits")
        n_users = await conn.fetchval("SELECT count(DISTINCT uid) FROM visits")
        config = load_config(DEMO_CONFIG, environ={})
        await apply_backend_setup(conn, config, DATABASE, harden=True)
        print(f"dataset: {n_rows} visits, {n_users} users, generated in {seconds:.1f} s", flush=True)
        port = free_port()
        cfg_text = demo_config_text(embedded_dsns(pg, DATABASE), port).replace(
            "epsilon_budget = 10", "epsilon_budget = 1e9")
        # every query is run afresh: a question asked again would get the answer already
        # released (answer_reuse), at no cost and none of the time or noise measured here
        for key, value in {"defaults.answer_reuse": '"off"', **(settings or {})}.items():
            section, _, key = key.rpartition(".")
            cfg_text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", cfg_text)
            if not n:
                head = f"[{section or 'backend'}]\n"
                cfg_text = cfg_text.replace(head, f"{head}{key} = {value}\n", 1)
        cfg_text += extra_config
        cfg = Path(tmp) / "bench.toml"
        cfg.write_text(cfg_text)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "server.cli", "--log-level", "WARNING", "serve", "--config",
            str(cfg), cwd=str(ROOT), preexec_fn=_terminate_with_parent)
        setup = BenchSetup(conn, pg.dsn(user="dp_pushdown", database=DATABASE), port, proc.pid,
                           int(n_rows), int(n_users), seconds)
        try:
            for _ in range(100):
                try:
                    await (await setup.analyst()).close()
                    break
                except OSError:
                    await asyncio.sleep(0.2)
            else:
                raise SystemExit("dp-proxy did not start")
            yield setup
        finally:
            if proc.returncode is None:
                proc.terminate()
            await proc.wait()
            await conn.close()


def _terminate_with_parent() -> None:
    """In the forked proxy: SIGTERM when the benchmark dies (killed, it runs no `finally`)."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


def pushdown_statements(explain_rows: list[asyncpg.Record]) -> list[str]:
    """The (unsplit) pushdown statements a DP EXPLAIN lists under "Pushdown SQL", each
    pretty-printed over several rows: its first row indented by two spaces, the rest by four."""
    lines = [r[0] for r in explain_rows]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("Pushdown SQL"))
    out: list[list[str]] = []
    for ln in lines[start + 1:]:
        if not ln.startswith("  "):
            break
        if not ln.startswith("   ") or not out:
            out.append([])
        out[-1].append(ln[2:] if not out[-1] else ln[4:])
    return ["\n".join(statement) for statement in out]


def _status_mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field}")


def peak_rss_mib(pid: int) -> float:
    """The proxy's peak resident set size (VmHWM), in MiB: of the process and, with
    `[listen] workers` above 1, its worker processes, summed (their peaks may not have
    been at the same moment, so an upper bound)."""
    return sum(_status_mib(p, "VmHWM") for p in _process_tree(pid))


def rss_mib(pid: int) -> float:
    """The proxy's resident set size now (VmRSS), in MiB: the process and its workers."""
    return sum(_status_mib(p, "VmRSS") for p in _process_tree(pid))


def _process_tree(pid: int) -> list[int]:
    """`pid` and its child processes (a supervisor's workers), as Linux lists them."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [pid, *(int(c) for c in f.read().split())]
    except FileNotFoundError:
        return [pid]


def latency_ms(latencies: list[float]) -> tuple[float, float]:
    """(p50, p99) in milliseconds of latencies in seconds (NaN when there are none)."""
    if not latencies:
        return float("nan"), float("nan")
    ordered = sorted(latencies)
    return statistics.median(ordered) * 1000, ordered[int(0.99 * (len(ordered) - 1))] * 1000


def format_errors(errors: Counter[str]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(errors.items())) or "none"


def only_budget_refusals(errors: Counter[str]) -> int:
    """Exit status of a load run: 1 (with a message) when any error but 53400 occurred."""
    unexpected = {k: v for k, v in errors.items() if k != "53400"}
    if unexpected:
        print(f"errors other than 53400: {unexpected}", file=sys.stderr)
        return 1
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    if names:
        cpu = names[0]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Python {platform.python_version()}"


def append_results(lines: list[str]) -> None:
    """Append one run's figures to bench/RESULTS.md (or to $BENCH_RESULTS_FILE: run_all.py)."""
    with open(os.environ.get("BENCH_RESULTS_FILE", RESULTS), "a") as f:
        f.write("\n" + "\n".join(lines) + "\n")
