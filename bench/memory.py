"""Proxy memory against data size: peak RSS of the dp-proxy processes (summed over its workers) at two scales.

    .venv/bin/python bench/memory.py [--scales 1 10] [--runs 3]

For each scale, generates the bench dataset (scale 1 ≈ 2M visits / 100k users;
scale 10 ten times the users) in a fresh embedded Postgres, starts dp-proxy as its
own process, runs the DP queries below `--runs` times each, and reads the proxy's
peak resident set size (VmHWM). The quantile queries stream one tree per group
and keep only the answer, and every other DP query returns one row per group, so
the peak should not grow with users (target: growth < 10% from the first scale to
the last). Appends a table to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import append_results, dataset_and_proxy, machine, peak_rss_mib

QUERIES = [
    "SELECT WITH ANONYMIZATION country, ANON_MEDIAN(duration, 0, 3600) FROM visits GROUP BY country",
    "SELECT WITH ANONYMIZATION browser, ANON_NTILE(duration, 0.9, 0, 3600), ANON_MIN(duration, 0, 3600), "
    "ANON_MAX(duration, 0, 3600) FROM visits GROUP BY browser",
    "SELECT WITH ANONYMIZATION ANON_MEDIAN(duration) FROM visits",
    "SELECT WITH ANONYMIZATION country, ANON_COUNT(*), ANON_SUM(duration, 0, 3600), "
    "ANON_AVG(duration + 0) FROM visits GROUP BY country",
]


async def measure(scale: float, runs: int) -> tuple[int, int, float, float]:
    """(rows, users, RSS after start-up in MiB, peak RSS after the queries in MiB)."""
    async with dataset_and_proxy(scale) as env:
        start = peak_rss_mib(env.proxy_pid)
        conn = await env.analyst()
        try:
            for _ in range(runs):
                for sql in QUERIES:
                    await conn.fetch(sql)
        finally:
            await conn.close()
        peak = peak_rss_mib(env.proxy_pid)
        print(f"scale {scale:g}: proxy RSS {start:.1f} MiB after start, peak {peak:.1f} MiB", flush=True)
        return env.rows, env.users, start, peak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scales", type=float, nargs="+", default=[1.0, 10.0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    results = [(s, *asyncio.run(measure(s, args.runs))) for s in args.scales]
    base = results[0][4]
    lines = [f"### Proxy memory: peak RSS over {len(QUERIES)} DP queries × {args.runs} "
             "(quantile trees, APPROX_BOUNDS, counts/sums)", "", f"Machine: {machine()}", "",
             "| scale | visits | users | RSS after start MiB | peak RSS MiB | growth vs first |",
             "|---|---|---|---|---|---|"]
    for scale, rows, users, start, peak in results:
        lines.append(f"| {scale:g} | {rows} | {users} | {start:.1f} | {peak:.1f} | "
                     f"{(peak / base - 1):+.1%} |")
    print("\n".join(lines))
    if not args.no_write:
        append_results(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
