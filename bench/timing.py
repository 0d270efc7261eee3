"""The timing residual (DESIGN §3.11): how much longer a DP answer takes when one user is in it.

    .venv/bin/python bench/timing.py [--scale 0.1] [--runs 15] [--quanta 0,50]

Generates the bench dataset, starts dp-proxy (once per release quantum), finds the user with
the most visits among those with purchases, and times each DP query shape through the proxy as
an attacker would aim it: restricted to that user (`WHERE uid = heavy`) against a uid no row
has (`WHERE uid = absent`), run in turn, medians of `--runs`. Prints per shape and quantum the
two medians, their difference, the run-to-run spread (median absolute deviation of the absent
runs) and the share of runs of the heavy user slower than every absent run: that share is how
often one query tells the two apart by its time alone. With a release quantum every answer is
sent on a multiple of it after the query arrived, which hides differences smaller than a
quantum unless they straddle a boundary. Appends the figures to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import append_results, dataset_and_proxy, machine

SHAPES = {
    "count": "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits WHERE uid = {u}",
    "sum/avg by browser": "SELECT WITH ANONYMIZATION browser, ANON_SUM(duration, 0, 3600), "
                          "ANON_AVG(duration, 0, 3600) FROM visits WHERE uid = {u} GROUP BY browser",
    "join on uid": "SELECT WITH ANONYMIZATION v.browser, ANON_SUM(p.amount, 0, 500) FROM visits v "
                   "JOIN purchases p USING (uid) WHERE v.uid = {u} GROUP BY v.browser",
    "join, filter on one side": "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM purchases p JOIN "
                                "visits v USING (uid) WHERE p.uid + 0 = {u}",
    "join via a subquery of the user": "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM (SELECT uid "
                                       "FROM visits WHERE uid + 0 = {u} GROUP BY uid) s JOIN "
                                       "purchases p USING (uid)",
    "median": "SELECT WITH ANONYMIZATION ANON_MEDIAN(duration, 0, 3600) FROM visits WHERE uid = {u}",
    "largest allowed expression": "SELECT WITH ANONYMIZATION ANON_COUNT(*) FROM visits WHERE "
                                  "uid = {u} AND length(lpad(browser, 100, 'C')) > 0",
    # (numeric operators at the arithmetic bound, ±1e38 with 30 decimals: 68 digits each)
    "numeric at its bounds": "SELECT WITH ANONYMIZATION ANON_SUM(x, 0, 1) FROM (SELECT uid, "
                             "b * b / 3 / b AS x FROM (SELECT uid, duration * 1e37 / 7 AS b "
                             "FROM visits WHERE uid = {u}) t) s",
}


async def _time(conn: object, sql: str) -> float:
    t0 = time.perf_counter()
    await conn.fetch(sql)  # type: ignore[attr-defined]
    return time.perf_counter() - t0


async def run(scale: float, runs: int, quanta: list[float]) -> list[str]:
    lines: list[str] = []
    for quantum in quanta:
        settings = {"defaults.release_quantum_ms": f"{quantum:g}",
                    "defaults.min_epsilon": "1e-3"}
        async with dataset_and_proxy(scale, settings=settings) as env:
            heavy, rows = await env.admin.fetchrow(
                "SELECT uid, count(*) FROM visits WHERE uid IN (SELECT uid FROM purchases) "
                "GROUP BY uid ORDER BY 2 DESC LIMIT 1")  # (with purchases: the join shapes)
            absent = await env.admin.fetchval("SELECT max(uid) + 1 FROM visits")
            if not lines:
                lines += [f"### Timing residual, scale {scale:g}: {env.rows} visits, "
                          f"{env.users} users; the heaviest user has {rows} visits "
                          f"(median of {runs})", "", f"Machine: {machine()}", "",
                          "| shape | quantum ms | absent ms | heavy ms | difference ms | spread ms "
                          "| heavy runs slower than every absent run |",
                          "|---|---|---|---|---|---|---|"]
            analyst = await env.analyst()
            await analyst.execute("SET dp.epsilon = 0.001")
            for name, template in SHAPES.items():
                times: dict[str, list[float]] = {"absent": [], "heavy": []}
                for who in times:  # warm the caches
                    await _time(analyst, template.format(u=heavy if who == "heavy" else absent))
                for _ in range(runs):
                    for who in times:
                        uid = heavy if who == "heavy" else absent
                        times[who].append(await _time(analyst, template.format(u=uid)))
                a, h = statistics.median(times["absent"]), statistics.median(times["heavy"])
                spread = statistics.median(abs(t - a) for t in times["absent"])
                slower = sum(t > max(times["absent"]) for t in times["heavy"]) / runs
                lines.append(f"| {name} | {quantum:g} | {a * 1e3:.1f} | {h * 1e3:.1f} | "
                             f"{(h - a) * 1e3:+.1f} | {spread * 1e3:.1f} | {slower:.0%} |")
                print(lines[-1], flush=True)
            await analyst.close()
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--quanta", default="0,50", help="release quanta to compare, in ms")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    lines = asyncio.run(run(args.scale, args.runs, [float(q) for q in args.quanta.split(",")]))
    if not args.no_write:
        append_results(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
