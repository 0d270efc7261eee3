"""Concurrency: many analysts issuing DP queries at once through one dp-proxy.

    .venv/bin/python bench/concurrency.py [--analysts 50] [--seconds 60] [--scale 0.1]

Generates the bench dataset (scale 0.1 ≈ 210k rows / 10k users by default, so
that the proxy, not one long pushdown, is what is measured), starts dp-proxy as
its own process with that many analysts, and has each analyst run DP queries
back to back over its own connection for the given time: counts, sums and
averages by key, a global average, a median by country, a join on uid. One
analyst in ten has a budget of only a few queries, so budget refusals (53400,
the only error allowed) are exercised too. Prints answers/s, p50/p99 latency of answers, the
errors by SQLSTATE and the proxy's peak RSS, and appends them to RESULTS.md.
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import (
    DATABASE,
    append_results,
    dataset_and_proxy,
    format_errors,
    latency_ms,
    machine,
    only_budget_refusals,
    peak_rss_mib,
)

from server.scram import make_verifier

EPSILON = 0.05
QUERIES = [
    "SELECT WITH ANONYMIZATION OPTIONS(epsilon={e}) browser, ANON_COUNT(*), "
    "ANON_SUM(duration, 0, 3600) FROM visits GROUP BY browser",
    "SELECT WITH ANONYMIZATION OPTIONS(epsilon={e}) country, ANON_AVG(duration, 0, 3600) "
    "FROM visits GROUP BY country",
    "SELECT WITH ANONYMIZATION OPTIONS(epsilon={e}) ANON_AVG(duration, 0, 3600) FROM visits",
    "SELECT WITH ANONYMIZATION OPTIONS(epsilon={e}) country, ANON_MEDIAN(duration, 0, 3600) "
    "FROM visits GROUP BY country",
    "SELECT WITH ANONYMIZATION OPTIONS(epsilon={e}) v.browser, ANON_SUM(p.amount, 0, 500) "
    "FROM visits v JOIN purchases p USING (uid) GROUP BY v.browser",
]


def analysts_config(n: int, small_budget: float) -> str:
    verifier = str(make_verifier("bench"))
    return "".join(f'\n[analysts.analyst{i:03d}]\nscram_verifier = "{verifier}"\n'
                   f"epsilon_budget = {small_budget if i % 10 == 9 else 1e9}\ndelta_budget = 0.5\n"
                   for i in range(n))


async def analyst(port: int, name: str, deadline: float, latencies: list[float],
                  errors: Counter[str], seed: int) -> None:
    rng = random.Random(seed)
    conn = await asyncpg.connect(host="127.0.0.1", port=port, user=name, password="bench",
                                 database=DATABASE, ssl=False)
    try:
        while time.monotonic() < deadline:
            sql = rng.choice(QUERIES).format(e=EPSILON)
            t0 = time.perf_counter()
            try:
                await conn.fetch(sql)
                latencies.append(time.perf_counter() - t0)
            except asyncpg.PostgresError as e:
                errors[e.sqlstate or "?"] += 1
                if e.sqlstate == "53400":
                    await asyncio.sleep(1.0)  # out of budget: keep the session, ask less often
    finally:
        await conn.close()


async def run(args: argparse.Namespace) -> int:
    async with dataset_and_proxy(args.scale,
                                 analysts_config(args.analysts, EPSILON * args.budget_queries),
                                 {"pushdown_pool_size": str(args.pool)}) as s:
        latencies: list[float] = []
        errors: Counter[str] = Counter()
        rss_before = peak_rss_mib(s.proxy_pid)
        t0 = time.monotonic()
        deadline = t0 + args.seconds
        await asyncio.gather(*(analyst(s.port, f"analyst{i:03d}", deadline, latencies, errors, i)
                               for i in range(args.analysts)))
        elapsed = time.monotonic() - t0
        rss = peak_rss_mib(s.proxy_pid)
        rows, users = s.rows, s.users
    p50, p99 = latency_ms(latencies)
    rate = len(latencies) / elapsed
    print(f"{args.analysts} analysts, {elapsed:.0f} s: {len(latencies)} answers ({rate:.1f}/s), "
          f"p50 {p50:.0f} ms, p99 {p99:.0f} ms, errors {dict(errors) or 'none'}, "
          f"proxy peak RSS {rss:.0f} MiB")
    lines = [f"### Concurrency: {args.analysts} analysts × {args.seconds} s of DP queries, "
             f"scale {args.scale} ({rows} visits, {users} users), pushdown pool {args.pool}", "",
             f"Machine: {machine()}", "",
             "| answers | answers/s | p50 ms | p99 ms | errors by SQLSTATE "
             "| proxy RSS after start → peak MiB |",
             "|---|---|---|---|---|---|",
             f"| {len(latencies)} | {rate:.1f} | {p50:.0f} | {p99:.0f} | "
             f"{format_errors(errors)} | "
             f"{rss_before:.0f} → {rss:.0f} |"]
    if not args.no_write:
        append_results(lines)
    return only_budget_refusals(errors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--analysts", type=int, default=50)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--pool", type=int, default=10, help="pushdown_pool_size of the proxy")
    ap.add_argument("--budget-queries", type=int, default=3,
                    help="the budget of one analyst in ten, in queries of ε = 0.05")
    ap.add_argument("--no-write", action="store_true", help="do not append to bench/RESULTS.md")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
