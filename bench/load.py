"""Load: many client connections mixing pass-through and DP queries through one dp-proxy.

    .venv/bin/python bench/load.py [--connections 200] [--seconds 60] [--dp-share 0.1]

Generates the bench dataset (scale 0.1), starts dp-proxy as its own process, and
opens that many connections (spread over 50 analysts), each running queries
back to back: with probability --dp-share a DP query, else a pass-through one
(an unprotected lookup, a catalog query). Reports per kind the answers/s and
p50/p99 latency, errors by SQLSTATE (only 53400 is allowed), and the proxy's RSS
after warm-up and at the end (it should stay flat); appends them to RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    DATABASE,
    append_results,
    dataset_and_proxy,
    format_errors,
    latency_ms,
    machine,
    only_budget_refusals,
    rss_mib,
)
from concurrency import QUERIES, analysts_config

PASS_THROUGH = [
    "SELECT name, region FROM countries WHERE code = $1",
    "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = 'public' AND c.relkind = 'r'",
    "SELECT current_setting('server_version_num')",
]
CODES = ["FR", "DE", "US", "JP", "BR", "IN"]


async def client(port: int, name: str, deadline: float, share: float, seed: int,
                 latencies: dict[str, list[float]], errors: Counter[str]) -> None:
    rng = random.Random(seed)
    conn = await asyncpg.connect(host="127.0.0.1", port=port, user=name, password="bench",
                                 database=DATABASE, ssl=False)
    try:
        while time.monotonic() < deadline:
            dp = rng.random() < share
            sql = rng.choice(QUERIES).format(e=0.01) if dp else rng.choice(PASS_THROUGH)
            args = [rng.choice(CODES)] if "$1" in sql else []
            t0 = time.perf_counter()
            try:
                await conn.fetch(sql, *args)
                latencies["dp" if dp else "pass-through"].append(time.perf_counter() - t0)
            except asyncpg.PostgresError as e:
                errors[e.sqlstate or "?"] += 1
    finally:
        await conn.close()


async def run(args: argparse.Namespace) -> int:
    async with dataset_and_proxy(args.scale, analysts_config(50, 0.01 * 3),
                                 {"listen.max_connections": str(args.connections + 20)}) as s:
        latencies: dict[str, list[float]] = {"dp": [], "pass-through": []}
        errors: Counter[str] = Counter()
        t0 = time.monotonic()
        deadline = t0 + args.seconds
        rss: list[tuple[float, float]] = []

        async def sample() -> None:
            while time.monotonic() < deadline:
                rss.append((time.monotonic() - t0, rss_mib(s.proxy_pid)))
                await asyncio.sleep(2)

        await asyncio.gather(sample(), *(
            client(s.port, f"analyst{i % 50:03d}", deadline, args.dp_share, i, latencies, errors)
            for i in range(args.connections)))
        elapsed = time.monotonic() - t0
        rows, users = s.rows, s.users
    warm = [m for t, m in rss if t >= min(10.0, args.seconds / 3)]
    lines = [f"### Load: {args.connections} connections × {args.seconds} s, {args.dp_share:.0%} DP "
             f"queries, scale {args.scale} ({rows} visits, {users} users)", "",
             f"Machine: {machine()}", "",
             "| kind | answers | per s | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    for kind, lat in latencies.items():
        p50, p99 = latency_ms(lat)
        lines.append(f"| {kind} | {len(lat)} | {len(lat) / elapsed:.0f} | {p50:.0f} | {p99:.0f} |")
    lines += ["", f"Errors by SQLSTATE: {format_errors(errors)}"
              f" (53400: the analysts' small budgets running out). Proxy RSS after warm-up "
              f"{warm[0]:.0f} MiB, at the end {warm[-1]:.0f} MiB, peak {max(m for _, m in rss):.0f} MiB."]
    print("\n".join(lines))
    if not args.no_write:
        append_results(lines)
    return only_budget_refusals(errors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--dp-share", type=float, default=0.1)
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--no-write", action="store_true", help="do not append to bench/RESULTS.md")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
