"""DP query cost: the proxied DP query vs the raw GROUP BY vs its own pushdown, on one Postgres.

    .venv/bin/python bench/dp_query.py [--scale 1] [--runs 5]

Generates the bench dataset (≈ 2M rows / 100k users at scale 1) in an embedded
Postgres, starts dp-proxy as a separate process, and times, as medians of
several runs in one process:
  raw       the non-private GROUP BY, run directly as superuser;
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
import tempfile
import time
from pathlib import Path

import asyncpg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import append_results, free_port, machine  # noqa: E402
from dataset import generate  # noqa: E402

from config import DEMO_CONFIG, load_config  # noqa: E402
from server.bootstrap import apply_backend_setup, demo_config_text  # noqa: E402
from server.dsn import DSN  # noqa: E402
from server.embedded import EmbeddedPostgres  # noqa: E402

DATABASE = "bench"
# name: (raw GROUP BY that is timed, DP query, the true answer the DP query estimates).
# ANON_COUNT(*) without bounds counts users (paper §3.3), so its truth is count(DISTINCT uid);
# ANON_SUM clamps each user's total, so heavy users make it lower than the raw sum: the
# error column shows that bias together with the noise.
QUERIES = {
    "count/sum/avg by browser": (
        "SELECT browser, count(*), sum(duration), avg(duration) FROM visits GROUP BY browser",
        "SELECT WITH ANONYMIZATION browser, ANON_COUNT(*), ANON_SUM(duration, 0, 3600), "
        "ANON_AVG(duration, 0, 3600) FROM visits GROUP BY browser",
        "SELECT browser, count(DISTINCT uid), sum(duration), avg(duration) FROM visits GROUP BY browser",
    ),
    "users by country (long tail)": (
        "SELECT country, count(DISTINCT uid) FROM visits GROUP BY country",
        "SELECT WITH ANONYMIZATION country, ANON_COUNT(DISTINCT uid) FROM visits GROUP BY country",
        "SELECT country, count(DISTINCT uid) FROM visits GROUP BY country",
    ),
    "join on uid": (
        "SELECT v.browser, sum(p.amount) FROM visits v JOIN purchases p USING (uid) GROUP BY v.browser",
        "SELECT WITH ANONYMIZATION v.browser, ANON_SUM(p.amount, 0, 500) FROM visits v "
        "JOIN purchases p USING (uid) GROUP BY v.browser",
        "SELECT v.browser, sum(p.amount) FROM visits v JOIN purchases p USING (uid) GROUP BY v.browser",
    ),
    "global average": (
        "SELECT avg(duration) FROM visits",
        "SELECT WITH ANONYMIZATION ANON_AVG(duration, 0, 3600) FROM visits",
        "SELECT avg(duration) FROM visits",
    ),
}


async def _timed(conn: asyncpg.Connection, sql: str, runs: int) -> tuple[float, list[asyncpg.Record]]:
    await conn.fetch(sql)  # warm the cache
    times, rows = [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        rows = await conn.fetch(sql)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), rows


async def run(scale: float, runs: int) -> list[str]:
    with EmbeddedPostgres() as pg, tempfile.TemporaryDirectory() as tmp:
        admin = await asyncpg.connect(pg.dsn())
        await admin.execute(f"CREATE DATABASE {DATABASE}")
        await admin.close()
        conn = await asyncpg.connect(pg.dsn(database=DATABASE))
        seconds = await generate(conn, scale)
        n_rows = await conn.fetchval("SELECT count(*) FROM visits")
        n_users = await conn.fetchval("SELECT count(DISTINCT uid) FROM visits")
        config = load_config(DEMO_CONFIG, environ={})
        await apply_backend_setup(conn, config, DATABASE)
        print(f"dataset: {n_rows} visits, {n_users} users, generated in {seconds:.1f} s", flush=True)

        port = free_port()
        cfg_text = demo_config_text(
            DSN(str(pg.socket_dir), pg.port, "dp_pushdown", DATABASE),
            DSN(str(pg.socket_dir), pg.port, "dp_restricted", DATABASE), port,
        ).replace("epsilon_budget = 10", "epsilon_budget = 1e9")
        cfg = Path(tmp) / "bench.toml"
        cfg.write_text(cfg_text)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "server.cli", "--log-level", "WARNING", "serve", "--config", str(cfg),
            cwd=str(ROOT))
        try:
            for _ in range(100):
                try:
                    proxied = await asyncpg.connect(host="127.0.0.1", port=port, user="alice",
                                                    password="alice", database=DATABASE, ssl=False)
                    break
                except OSError:
                    await asyncio.sleep(0.2)
            else:
                raise SystemExit("dp-proxy did not start")
            pushdown = await asyncpg.connect(pg.dsn(user="dp_pushdown", database=DATABASE))
            lines = [f"### DP query cost, scale {scale:g}: {n_rows} rows, {n_users} users "
                     f"(median of {runs})", "", f"Machine: {machine()}", "",
                     "| query | raw ms | pushdown ms | proxied ms | proxied/raw | proxied/pushdown |"
                     " median rel. error |", "|---|---|---|---|---|---|---|"]
            for name, (raw_sql, dp_sql, truth_sql) in QUERIES.items():
                raw_t, _ = await _timed(conn, raw_sql, runs)
                raw_rows = await conn.fetch(truth_sql)
                plan_rows = await proxied.fetch("EXPLAIN " + dp_sql)
                push_sql = plan_rows[-1][0].strip()
                push_t, _ = await _timed(pushdown, push_sql, runs)
                dp_t, dp_rows = await _timed(proxied, dp_sql, runs)
                err = _median_relative_error(raw_rows, dp_rows)
                lines.append(f"| {name} | {raw_t * 1e3:.0f} | {push_t * 1e3:.0f} | {dp_t * 1e3:.0f} | "
                             f"{dp_t / raw_t:.2f}× | {dp_t / push_t:.2f}× | {err} |")
                print(lines[-1], flush=True)
            await proxied.close()
            await pushdown.close()
        finally:
            proc.terminate()
            await proc.wait()
            await conn.close()
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
