"""Accuracy of plain BI SQL on the heavy-tailed dataset: error, bias and noise against the truth.

    .venv/bin/python bench/accuracy_bi.py [--scale 1] [--runs 10] [--epsilon 1] [--cap 5]
                                          [--tuned GROUPS]

The questions a BI tool asks, in plain SQL (no DP clause; the session sets ε, δ = 1e-6
and C_u): COUNT(*), SUM and AVG of duration by browser and by country, VAR_POP and
STDDEV_POP of duration by browser, on bench/dataset.py's `heavy` shape (issue 30's
targets: median relative error ≤ 10% for COUNT(*) and SUM, ≤ 5% for AVG, ≤ 10% for
VAR/STDDEV). Each query runs `--runs` times. Per aggregate it reports, over the groups
released (median over groups): the relative error of one answer against the true
non-private answer; the bias, |mean of the answers − truth| / truth (what the
contribution bounds cost: the noise averages out); the noise, the answers' standard
deviation / truth. Also the share of true groups released, and the DP query's time
against the raw query's, and its per-(user, group) rows' alone (the floor of any pushdown
that bounds users' contributions). `--tuned GROUPS`: an admin tunes visits' bounds first
(`dp_tune_bounds('visits', 0.1, GROUPS)`, its noise weighed over GROUPS groups), and every
query uses them (no tuning share of its own).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import append_results, dataset_and_proxy, machine

DELTA = 1e-6
QUERIES = {
    "by browser": ("browser", "SELECT browser, COUNT(*) AS count, SUM(duration) AS sum, "
                              "AVG(duration) AS avg FROM visits GROUP BY browser"),
    "by country": ("country", "SELECT country, COUNT(*) AS count, SUM(duration) AS sum, "
                              "AVG(duration) AS avg FROM visits GROUP BY country"),
    "spread by browser": ("browser", "SELECT browser, VAR_POP(duration) AS var_pop, "
                                     "STDDEV_POP(duration) AS stddev_pop FROM visits "
                                     "GROUP BY browser"),
}
TARGETS = {"count": 0.10, "sum": 0.10, "avg": 0.05, "var_pop": 0.10, "stddev_pop": 0.10}


def summarise(truth: dict[Any, dict[str, float]], answers: dict[Any, list[dict[str, float]]],
              runs: int) -> dict[str, dict[str, float]]:
    """Per aggregate: median over groups of the error, bias and noise (relative to the truth),
    and the share of true groups released (in how many of the runs, on average)."""
    out: dict[str, dict[str, float]] = {}
    columns = next(iter(truth.values())).keys()
    for col in columns:
        errors, biases, noises = [], [], []
        for key, rows in answers.items():
            t = truth[key].get(col)
            values = [r[col] for r in rows if r[col] is not None]
            if not values or not t:
                continue
            errors += [abs(v - t) / abs(t) for v in values]
            biases.append(abs(statistics.fmean(values) - t) / abs(t))
            if len(values) > 1:
                noises.append(statistics.stdev(values) / abs(t))
        out[col] = {"error": statistics.median(errors) if errors else float("nan"),
                    "bias": statistics.median(biases) if biases else float("nan"),
                    "noise": statistics.median(noises) if noises else float("nan")}
    released = sum(len(rows) for rows in answers.values()) / (runs * len(truth))
    for col in out:
        out[col]["released"] = released
    return out


async def measure(conn: asyncpg.Connection, admin: asyncpg.Connection, runs: int,
                  epsilon: float, cap: int) -> dict[str, Any]:
    await conn.execute(f"SET dp.epsilon = {epsilon}")
    await conn.execute(f"SET dp.delta = {DELTA}")
    await conn.execute(f"SET dp.max_groups_contributed = {cap}")
    result: dict[str, Any] = {}
    for name, (key, sql) in QUERIES.items():
        raw_times = []
        for _ in range(3):
            t0 = time.perf_counter()
            raw = await admin.fetch(sql)
            raw_times.append(time.perf_counter() - t0)
        raw_seconds = statistics.median(raw_times)
        # the floor: the per-(user, group) rows alone, which every DP answer's pushdown
        # aggregates (and no choice of bounds or noise can skip), with Postgres's own plan
        per_user_times = []
        for _ in range(3):
            t0 = time.perf_counter()
            await admin.fetchval(f"SELECT count(*) FROM (SELECT uid, {key}, count(*) "
                                 f"FROM visits GROUP BY uid, {key}) AS per_user")
            per_user_times.append(time.perf_counter() - t0)
        floor = statistics.median(per_user_times) / raw_seconds
        truth = {r[key]: {c: float(v) for c, v in dict(r).items() if c != key and v is not None}
                 for r in raw}
        answers: dict[Any, list[dict[str, float]]] = defaultdict(list)
        dp_seconds = []
        for _ in range(runs):
            t0 = time.perf_counter()
            rows = await conn.fetch(sql)
            dp_seconds.append(time.perf_counter() - t0)
            for r in rows:
                answers[r[key]].append({c: None if v is None else float(v)
                                        for c, v in dict(r).items() if c != key})
        result[name] = {"aggregates": summarise(truth, answers, runs),
                        "time_ratio": statistics.median(dp_seconds) / raw_seconds,
                        "floor": floor}
        for col, s in result[name]["aggregates"].items():
            print(f"{name:18} {col:10} error {s['error']:7.2%}  bias {s['bias']:7.2%}  "
                  f"noise {s['noise']:7.2%}  released {s['released']:.0%}", flush=True)
        print(f"{name:18} time {result[name]['time_ratio']:.2f}x the raw query (its per-user "
              f"rows alone: {floor:.2f}x)", flush=True)
    return result


async def run(args: argparse.Namespace) -> int:
    async with dataset_and_proxy(args.scale, shape="heavy") as s:
        if args.tuned is not None:
            admin = await s.analyst("admin")
            try:
                row = await admin.fetchrow("SELECT * FROM dp_tune_bounds('visits', 0.1, $1)",
                                           str(args.tuned))
            finally:
                await admin.close()
            print(f"tuned: {dict(row or {})}", flush=True)
        conn = await s.analyst()
        try:
            result = await measure(conn, s.admin, args.runs, args.epsilon, args.cap)
        finally:
            await conn.close()
        rows, users = s.rows, s.users
    tuned = "" if args.tuned is None else f", bounds tuned per table ({args.tuned} groups)"
    lines = [f"### Accuracy of plain BI SQL: heavy-tailed dataset, scale {args.scale} ({rows} visits, "
             f"{users} users), ε = {args.epsilon:g}, δ = {DELTA:g}, C_u = {args.cap}, "
             f"{args.runs} runs{tuned}", "", f"Machine: {machine()}", "",
             "Median over the released groups of the relative error of one answer, of the bias "
             "(|mean of the answers − truth| / truth) and of the noise (standard deviation / truth); "
             "the share of true groups released; the DP query's time over the raw query's "
             "(issue 30's targets in brackets), and the time of its per-(user, group) rows "
             "alone over the raw query's (`GROUP BY uid, key`, Postgres's own plan: what no "
             "DP answer's pushdown can skip).", "",
             "| query | aggregate | error | bias | noise | released | time | per-user rows |",
             "|---|---|---|---|---|---|---|---|"]
    for name, r in result.items():
        for col, s in r["aggregates"].items():
            lines.append(f"| {name} | {col} | {s['error']:.1%} (≤ {TARGETS[col]:.0%}) | "
                         f"{s['bias']:.1%} | {s['noise']:.2%} | {s['released']:.0%} | "
                         f"{r['time_ratio']:.2f}× (≤ 2.5×) | {r['floor']:.2f}× |")
    if not args.no_write:
        append_results(lines)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--cap", type=int, default=5, help="max_groups_contributed (C_u)")
    ap.add_argument("--no-write", action="store_true", help="do not append to bench/RESULTS.md")
    ap.add_argument("--tuned", type=int, default=None, metavar="GROUPS",
                    help="tune visits' bounds once first (dp_tune_bounds), for GROUPS groups")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
