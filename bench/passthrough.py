"""Pass-through overhead: pgbench -S against Postgres directly and through dp-proxy, in one run.

    .venv/bin/python bench/passthrough.py [--seconds 10] [--runs 3] [--clients 8]

Starts an embedded Postgres (TCP on loopback) with the demo tables and pgbench's
tables, then dp-proxy as a separate process (uvloop, as `dp-proxy serve` runs; once
as configured by default, `[listen] workers = "auto"`: one worker per core, and once
as one process, `workers = 1`), and a bare byte relay with as many processes as
dp-proxy has workers by default (bench/relay.py: the ceiling of any Python proxy on
this machine), and alternates direct, relayed and proxied pgbench runs in simple and
extended query mode. Prints the median TPS of each and the ratios, and appends
the figures to bench/RESULTS.md with a description of the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import append_results, free_port, machine  # noqa: E402

from config import DEMO_CONFIG, load_config  # noqa: E402
from config.models import usable_cores  # noqa: E402
from server.bootstrap import (  # noqa: E402
    apply_backend_setup,
    demo_config_text,
    embedded_dsns,
    load_demo_data,
)
from server.embedded import EmbeddedPostgres, find_bindir  # noqa: E402

DATABASE = "bench"


async def _prepare(pg: EmbeddedPostgres) -> None:
    admin = await asyncpg.connect(pg.dsn())
    try:
        await admin.execute(f"DROP DATABASE IF EXISTS {DATABASE}")
        await admin.execute(f"CREATE DATABASE {DATABASE}")
    finally:
        await admin.close()
    bindir = find_bindir()
    subprocess.run([str(bindir / "pgbench"), "-i", "-q", "-s", "1", "-h", str(pg.socket_dir),
                    "-p", str(pg.port), "-U", "postgres", DATABASE], check=True,
                   capture_output=True)
    conn = await asyncpg.connect(pg.dsn(database=DATABASE))
    try:
        await load_demo_data(conn)
        config = load_config(DEMO_CONFIG, environ={})
        public = config.public.model_copy(update={"tables": [
            *config.public.tables, "pgbench_accounts", "pgbench_branches", "pgbench_tellers"]})
        await apply_backend_setup(conn, config.model_copy(update={"public": public}), DATABASE,
                                  harden=True)
    finally:
        await conn.close()


def _start_proxy(pg: EmbeddedPostgres, port: int, workdir: Path,
                 workers: str = "auto") -> subprocess.Popen[bytes]:
    text = demo_config_text(embedded_dsns(pg, DATABASE), port)
    cfg = workdir / f"bench{port}.toml"
    cfg.write_text(text)
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "--log-level", "WARNING", "serve",
                             "--config", str(cfg)], cwd=ROOT,
                            env=dict(os.environ, DPPROXY_LISTEN__WORKERS=workers))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("dp-proxy did not start")


def _pgbench(host: str, port: int, user: str, mode: str, seconds: int, clients: int) -> float:
    env = dict(os.environ, PGPASSWORD=user, PGSSLMODE="disable")
    out = subprocess.run(
        [str(find_bindir() / "pgbench"), "-S", "-n", "-M", mode, "-c", str(clients), "-j", "2",
         "-T", str(seconds), "-h", host, "-p", str(port), "-U", user, DATABASE],
        capture_output=True, text=True, env=env, check=False,
    )
    m = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out.stdout)
    if out.returncode != 0 or not m:
        raise SystemExit(f"pgbench failed: {out.stderr[-500:]}")
    return float(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--no-write", action="store_true", help="do not append to bench/RESULTS.md")
    args = ap.parse_args()

    results: dict[tuple[str, str], list[float]] = {}
    with EmbeddedPostgres(tcp=True) as pg, tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_prepare(pg))
        port = free_port()
        proxy = _start_proxy(pg, port, Path(tmp))
        port2 = free_port()
        proxy1 = _start_proxy(pg, port2, Path(tmp), workers="1")
        relay_port = free_port()
        relay = subprocess.Popen([sys.executable, str(Path(__file__).with_name("relay.py")),
                                  str(relay_port), str(pg.socket_dir / f".s.PGSQL.{pg.port}"),
                                  str(usable_cores())], start_new_session=True)
        try:
            for _ in range(args.runs):
                for mode in ("simple", "extended"):
                    for target, (p, user) in {"direct": (pg.port, "postgres"),
                                              "relay": (relay_port, "postgres"),
                                              "proxy": (port, "alice"),
                                              "proxy1": (port2, "alice")}.items():
                        tps = _pgbench("127.0.0.1", p, user, mode, args.seconds, args.clients)
                        results.setdefault((mode, target), []).append(tps)
                        print(f"{mode:8s} {target:6s} {tps:10.0f} tps", flush=True)
        finally:
            os.killpg(relay.pid, signal.SIGTERM)  # (the relay's processes are one group)
            relay.wait(30)
            for proc in (proxy, proxy1):
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)

    cores = usable_cores()
    lines = [f"### Pass-through: pgbench -S, {args.clients} clients, 2 threads, "
             f"{args.runs} × {args.seconds} s (median)", "", f"Machine: {machine()}", "",
             f"dp-proxy as configured by default: `workers = \"auto\"`, {cores} "
             f"worker{'s' if cores > 1 else ''} here; the bare relay runs as many processes",
             "",
             "| mode | direct TPS | bare relay TPS | through dp-proxy TPS | relay / direct "
             "| dp-proxy / direct | dp-proxy / relay | dp-proxy, one process / direct |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in ("simple", "extended"):
        d = statistics.median(results[(mode, "direct")])
        r = statistics.median(results[(mode, "relay")])
        x = statistics.median(results[(mode, "proxy")])
        x1 = statistics.median(results[(mode, "proxy1")])
        lines.append(f"| {mode} | {d:.0f} | {r:.0f} | {x:.0f} | {r / d:.2f}× | {x / d:.2f}× "
                     f"| {x / r:.2f}× | {x1 / d:.2f}× |")
        print(f"{mode}: proxied / direct = {x / d:.2f}× (bare relay {r / d:.2f}×, "
              f"one process {x1 / d:.2f}×)")
    if not args.no_write:
        append_results(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
