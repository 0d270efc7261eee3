"""DP query cost: the proxied DP query vs the raw GROUP BY vs its own pushdown, on one Postgres.

    .venv/bin/python bench/dp_query.py [--scale 1] [--runs 5]

Generates the bench dataset (≈ 2M rows / 100k users at scale 1) in an embedded
Postgres, starts dp-proxy as a separate process, and times, as medians of
several runs in one process taken in turn (raw, per-user, pushdown, proxied, raw, ...):
  raw       the non-private GROUP BY, run directly as superuser;
  per-user  the per-user GROUP BY (uid, keys) alone, with the partials, reduced to one row:
            the step the paper's method cannot skip, so its time / raw is a floor for
            proxied / raw on this Postgres;
  pushdown  the SQL dp-proxy generates, run directly as the pushdown role;
  proxied   the DP query through dp-proxy (parse, plan, charge, pushdown, noise, result).
Prints proxied/raw (target ≤ 2.5×) and proxied/pushdown (target ≤ 1.1×), the
error of the DP answer against the true non-private one, and appends the
figures to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import append_results, dataset_and_proxy, machine, pushdown_statements

# name: (raw GROUP BY that is timed, DP query, the true answer the DP query estimates, and
# the per-user GROUP BY alone: (uid, keys) with the partials, the step the paper's method
# cannot skip; its time over raw's is a floor for proxied/raw on this Postgres).
# ANON_COUNT(*) without bounds counts users (paper §3.3), so its truth is count(DISTINCT uid);
# ANON_SUM clamps each user's total, so heavy users make it lower than the raw sum: the
# error column shows that bias together with the noise.
QUERIES = {
    "count/sum/avg by browser": (
        "SELECT browser, count(*), sum(duration), avg(duration) FROM visits GROUP BY browser",
        "SELECT WITH ANONYMIZATION browser, ANON_COUNT(*), ANON_SUM(duration, 0, 3600), "
        "ANON_AVG(duration, 0, 3600) FROM visits GROUP BY browser",
        "SELECT browser, count(DISTINCT uid), sum(duration), avg(duration) FROM visits GROUP BY browser",
        "SELECT count(*), sum(s), sum(n) FROM (SELECT uid, browser, sum(duration) AS s, "
        "count(duration) AS n FROM visits GROUP BY uid, browser) AS per_user",
    ),
    "users by country (long tail)": (
        "SELECT country, count(DISTINCT uid) FROM visits GROUP BY country",
        "SELECT WITH ANONYMIZATION country, ANON_COUNT(DISTINCT uid) FROM visits GROUP BY country",
        "SELECT country, count(DISTINCT uid) FROM visits GROUP BY country",
        "SELECT count(*) FROM (SELECT uid, country FROM visits GROUP BY uid, country) AS per_user",
    ),
    "join on uid": (
        "SELECT v.browser, sum(p.amount) FROM visits v JOIN purchases p USING (uid) GROUP BY v.browser",
        "SELECT WITH ANONYMIZATION v.browser, ANON_SUM(p.amount, 0, 500) FROM visits v "
        "JOIN purchases p USING (uid) GROUP BY v.browser",
        "SELECT v.browser, sum(p.amount) FROM visits v JOIN purchases p USING (uid) GROUP BY v.browser",
        "SELECT count(*), sum(s) FROM (SELECT uid, v.browser, sum(p.amount) AS s FROM visits v "
        "JOIN purchases p USING (uid) GROUP BY uid, v.browser) AS per_user",
    ),
    "median by country (quantile tree)": (
        "SELECT country, percentile_cont(0.5) WITHIN GROUP (ORDER BY duration) FROM visits GROUP BY country",
        "SELECT WITH ANONYMIZATION country, ANON_MEDIAN(duration, 0, 3600) FROM visits GROUP BY country",
        # the DP median is the median over users of each user's own median
        "SELECT country, percentile_cont(0.5) WITHIN GROUP (ORDER BY m) FROM (SELECT country, uid, "
        "percentile_cont(0.5) WITHIN GROUP (ORDER BY duration) AS m FROM visits GROUP BY 1, 2) s "
        "GROUP BY country",
        "SELECT count(*), sum(n) FROM (SELECT uid, country, count(duration) AS n FROM visits "
        "GROUP BY uid, country) AS per_user",
    ),
    "global average": (
        "SELECT avg(duration) FROM visits",
        "SELECT WITH ANONYMIZATION ANON_AVG(duration, 0, 3600) FROM visits",
        "SELECT avg(duration) FROM visits",
        "SELECT count(*), sum(s), sum(n) FROM (SELECT uid, sum(duration) AS s, count(duration) AS n "
        "FROM visits GROUP BY uid) AS per_user",
    ),
}


async def _run(conn: asyncpg.Connection, statements: list[str]) -> tuple[float, list[asyncpg.Record]]:
    """Seconds to run the statements one after the other (one DP answer's pushdown), and the
    last one's rows."""
    t0 = time.perf_counter()
    rows: list[asyncpg.Record] = []
    for sql in statements:
        rows = await conn.fetch(sql)
    return time.perf_counter() - t0, rows


async def _interleaved(targets: list[tuple[asyncpg.Connection, list[str]]],
                       runs: int) -> tuple[list[float], list[list[asyncpg.Record]]]:
    """Median seconds of each target, run in turn (raw, pushdown, proxied, raw, ...) so that
    the machine's drift, which reaches 2× for seconds at a time here, falls on all alike."""
    for conn, statements in targets:
        await _run(conn, statements)  # warm the cache
    times: list[list[float]] = [[] for _ in targets]
    rows: list[list[asyncpg.Record]] = [[] for _ in targets]
    for _ in range(runs):
        for i, (conn, statements) in enumerate(targets):
            t, rows[i] = await _run(conn, statements)
            times[i].append(t)
    return [statistics.median(t) for t in times], rows


async def run(scale: float, runs: int) -> list[str]:
    async with dataset_and_proxy(scale) as env:
        conn = env.admin
        proxied = await env.analyst()
        pushdown = await asyncpg.connect(env.pushdown_dsn)
        lines = [f"### DP query cost, scale {scale:g}: {env.rows} rows, {env.users} users "
                 f"(median of {runs})", "", f"Machine: {machine()}", "",
                 "| query | raw ms | per-user GROUP BY ms | pushdown ms | proxied ms | proxied/raw "
                 "| per-user GROUP BY/raw | proxied/pushdown | median rel. error |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for name, (raw_sql, dp_sql, truth_sql, per_user_sql) in QUERIES.items():
            (raw_t, user_t, push_t, dp_t), (*_, dp_rows) = await _interleaved([
                (conn, [raw_sql]),
                (conn, [per_user_sql]),
                (pushdown, pushdown_statements(await proxied.fetch("EXPLAIN " + dp_sql))),
                (proxied, [dp_sql]),
            ], runs)
            raw_rows = await conn.fetch(truth_sql)
            err = _median_relative_error(raw_rows, dp_rows)
            lines.append(f"| {name} | {raw_t * 1e3:.0f} | {user_t * 1e3:.0f} | {push_t * 1e3:.0f} | "
                         f"{dp_t * 1e3:.0f} | {dp_t / raw_t:.2f}× | {user_t / raw_t:.2f}× | "
                         f"{dp_t / push_t:.2f}× | {err} |")
            print(lines[-1], flush=True)
        await proxied.close()
        await pushdown.close()
    return lines


def _median_relative_error(raw: list[asyncpg.Record], dp: list[asyncpg.Record]) -> str:
    """Median over released groups and aggregates of |dp − true| / |true|."""
    truth = {(next(iter(r)) if len(r) > 1 else None): (tuple(r)[1:] if len(r) > 1 else tuple(r))
             for r in raw}
    errs = []
    for row in dp:
        key = next(iter(row)) if len(row) > 1 else None
        vals = tuple(row)[1:] if len(row) > 1 else tuple(row)
        if key not in truth:
            continue
        for t, v in zip(truth[key], vals, strict=False):
            if t is not None and float(t) != 0:
                errs.append(abs(float(v) - float(t)) / abs(float(t)))
    return f"{statistics.median(errs):.2%}" if errs else "n/a"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    lines = asyncio.run(run(args.scale, args.runs))
    if not args.no_write:
        append_results(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
