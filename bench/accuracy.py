"""Accuracy: DP answers through the proxy against the true non-private answers, with plots.

    .venv/bin/python bench/accuracy.py [--scale 0.1] [--runs 10]

For ε ∈ {0.1, 1, 10}, δ = 1e-6 and max_groups_contributed (C_u) ∈ {1, 5}, runs
through dp-proxy, `--runs` times each:
  COUNT(*) (users), SUM(duration, 0, 3600) and AVG(duration, 0, 3600) by browser;
  COUNT(DISTINCT uid) by country (a long tail of small groups);
  SUM(duration) by country with τ-thresholding and with truncated-geometric
  partition selection (a query that does not release its user count).
Reports per aggregate the median relative error against the true non-private
answer, beside the error the noise alone would give (the noise scales from the
query's EXPLAIN: b·ln 2 for a Laplace sum or count; the delta method for AVG);
the difference is the bias bounding buys (clamping heavy users, C_u). Also the
fraction of true groups released. Writes bench/accuracy_error.png (error vs ε)
and bench/accuracy_released.png (release rate vs group size), and appends a
table linking them to RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DATABASE, append_results, dataset_and_proxy, machine

HERE = Path(__file__).resolve().parent
EPSILONS = (0.1, 1.0, 10.0)
CAPS = (1, 5)
DELTA = 1e-6
LOW, HIGH = 0, 3600

BROWSER = ("SELECT WITH ANONYMIZATION OPTIONS(epsilon={e}, delta={d}, max_groups_contributed={c}) "
           f"browser, ANON_COUNT(*) AS n, ANON_SUM(duration, {LOW}, {HIGH}) AS s, "
           f"ANON_AVG(duration, {LOW}, {HIGH}) AS a FROM visits GROUP BY browser")
BROWSER_TRUTH = ("SELECT browser, count(DISTINCT uid) AS n, sum(duration) AS s, avg(duration) AS a "
                 "FROM visits GROUP BY browser")
COUNTRY = ("SELECT WITH ANONYMIZATION OPTIONS(epsilon={e}, delta={d}, max_groups_contributed={c}) "
           "country, ANON_COUNT(DISTINCT uid) AS n FROM visits GROUP BY country")
COUNTRY_TRUTH = "SELECT country, count(DISTINCT uid) AS n FROM visits GROUP BY country"
COUNTRY_SUM = ("SELECT WITH ANONYMIZATION OPTIONS(epsilon={e}, delta={d}, max_groups_contributed={c}, "
               f"partition_selection='{{p}}') country, ANON_SUM(duration, {LOW}, {HIGH}) AS s "
               "FROM visits GROUP BY country")
"""A query that does not release its user count: the two partition selections compared."""
SELECTIONS = ("laplace", "truncated_geometric")

_SCALE = re.compile(r"^\s*(\S+): (\w+), .*laplace scale ([0-9.e+-]+)")


def noise_scales(explain: list[str]) -> dict[tuple[str, str], float]:
    """(column, quantity) → Laplace scale, from a DP EXPLAIN; ("", "users") is the user count."""
    out: dict[tuple[str, str], float] = {}
    for line in explain:
        if line.strip().startswith("Partition selection"):
            m = re.search(r"laplace scale ([0-9.e+-]+)", line)
            if m:
                out[("", "users")] = float(m.group(1))
        m = _SCALE.match(line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def noise_only_error(agg: str, true: dict[str, float], scales: dict[tuple[str, str], float]) -> float:
    """The median relative error the Laplace noise alone gives (no clamping, no C_u)."""
    ln2 = math.log(2)
    n = true["n"]
    if agg == "n":
        return scales[("", "users")] * ln2 / n
    if agg == "s":
        return scales[("s", "sum")] * ln2 / abs(true["s"])
    # AVG = mid + (csum + X)/(n + Y): variance by the delta method, Laplace variance 2b²;
    # the median of |normal| is 0.6745 σ
    mid = (LOW + HIGH) / 2
    b_c, b_n = scales[("a", "csum")], scales[("a", "n")]
    sd = math.sqrt(2 * b_c ** 2 + (true["a"] - mid) ** 2 * 2 * b_n ** 2) / n
    return 0.6745 * sd / abs(true["a"])


async def measure(conn: asyncpg.Connection, admin: asyncpg.Connection, runs: int,
                  reset: asyncpg.Connection) -> dict[str, Any]:
    truth = {r["browser"]: {"n": float(r["n"]), "s": float(r["s"]), "a": float(r["a"])}
             for r in await admin.fetch(BROWSER_TRUTH)}
    sizes = {r["country"]: int(r["n"]) for r in await admin.fetch(COUNTRY_TRUTH)}
    out: dict[str, Any] = {"truth": truth, "sizes": sizes, "cells": {}}
    for c in CAPS:
        for e in EPSILONS:
            await reset.fetch("SELECT dp_reset_budget('alice')")  # δ: 1e-4 lasts ~8 runs of a cell
            sql = BROWSER.format(e=e, d=DELTA, c=c)
            scales = noise_scales([r[0] for r in await conn.fetch("EXPLAIN " + sql)])
            errors: dict[str, list[float]] = defaultdict(list)
            theory = {agg: statistics.median(noise_only_error(agg, t, scales) for t in truth.values())
                      for agg in ("n", "s", "a")}
            released_browsers = 0
            released: dict[str, int] = defaultdict(int)
            released_sum = dict.fromkeys(SELECTIONS, 0)
            for _ in range(runs):
                rows = await conn.fetch(sql)
                released_browsers += len(rows)
                for r in rows:
                    t = truth[r["browser"]]
                    for agg in ("n", "s", "a"):
                        if r[agg] is not None:
                            errors[agg].append(abs(float(r[agg]) - t[agg]) / abs(t[agg]))
                for r in await conn.fetch(COUNTRY.format(e=e, d=DELTA, c=c)):
                    released[r["country"]] += 1
                for p in SELECTIONS:
                    released_sum[p] += len(await conn.fetch(COUNTRY_SUM.format(e=e, d=DELTA, c=c, p=p)))
            out["cells"][(e, c)] = {
                "error": {agg: statistics.median(v) if v else float("nan") for agg, v in errors.items()},
                "theory": theory,
                "browsers_released": released_browsers / (runs * len(truth)),
                "countries_released": sum(released.values()) / (runs * len(sizes)),
                "release_rate": {k: released.get(k, 0) / runs for k in sizes},
                "sum_released": {p: n / (runs * len(sizes)) for p, n in released_sum.items()},
            }
            cell = out["cells"][(e, c)]
            print(f"ε={e:<4} C_u={c}: median rel. error count {cell['error'].get('n', float('nan')):.2%} "
                  f"(noise alone {theory['n']:.2%}), sum {cell['error'].get('s', float('nan')):.2%} "
                  f"({theory['s']:.2%}), avg {cell['error'].get('a', float('nan')):.2%} "
                  f"({theory['a']:.2%}); countries released {cell['countries_released']:.0%}; "
                  f"SUM by country released, τ {cell['sum_released']['laplace']:.0%}, truncated "
                  f"geometric {cell['sum_released']['truncated_geometric']:.0%}", flush=True)
    return out


def plot(result: dict[str, Any], error_png: Path, released_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {"n": "COUNT (users)", "s": "SUM(duration)", "a": "AVG(duration)"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    for ax, agg in zip(axes, ("n", "s", "a"), strict=True):
        for c, style in zip(CAPS, ("o-", "s-"), strict=True):
            ys = [result["cells"][(e, c)]["error"].get(agg, float("nan")) for e in EPSILONS]
            th = [result["cells"][(e, c)]["theory"][agg] for e in EPSILONS]
            line, = ax.plot(EPSILONS, ys, style, label=f"measured, C_u={c}")
            ax.plot(EPSILONS, th, "--", color=line.get_color(), label=f"noise alone, C_u={c}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(names[agg] + " by browser")
        ax.set_xlabel("ε")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median relative error vs the true answer")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"dp-proxy accuracy, δ = {DELTA:g}")
    fig.tight_layout()
    fig.savefig(error_png, dpi=100)
    plt.close(fig)

    sizes = result["sizes"]
    order = sorted(sizes, key=lambda k: sizes[k])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c, style in zip(CAPS, ("-", ":"), strict=True):
        for e in EPSILONS:
            rate = result["cells"][(e, c)]["release_rate"]
            ax.plot([sizes[k] for k in order], [rate[k] for k in order], style, marker=".",
                    label=f"ε={e:g}, C_u={c}")
    ax.set_xscale("log")
    ax.set_xlabel("users in the group (country)")
    ax.set_ylabel("fraction of runs the group was released")
    ax.set_title("Partition selection: released groups vs group size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(released_png, dpi=100)
    plt.close(fig)


async def run(args: argparse.Namespace) -> int:
    async with dataset_and_proxy(args.scale) as s:
        conn = await s.analyst()
        admin = await asyncpg.connect(host="127.0.0.1", port=s.port, user="admin", password="admin",
                                      database=DATABASE, ssl=False)
        try:
            result = await measure(conn, s.admin, args.runs, admin)
        finally:
            await conn.close()
            await admin.close()
        rows, users = s.rows, s.users
    error_png, released_png = HERE / "accuracy_error.png", HERE / "accuracy_released.png"
    plot(result, error_png, released_png)
    lines = [f"### Accuracy: scale {args.scale} ({rows} visits, {users} users), δ = {DELTA:g}, "
             f"{args.runs} runs per cell", "", f"Machine: {machine()}", "",
             "Median relative error against the true non-private answer, by browser (in brackets: "
             "what the noise alone gives), and the share of true groups released.", "",
             "| ε | C_u | COUNT | SUM | AVG | browsers released | countries released "
             "| SUM by country released: τ / truncated geometric |",
             "|---|---|---|---|---|---|---|---|"]
    for c in CAPS:
        for e in EPSILONS:
            cell = result["cells"][(e, c)]
            err, th = cell["error"], cell["theory"]
            lines.append(
                f"| {e:g} | {c} | " + " | ".join(
                    f"{err.get(a, float('nan')):.2%} ({th[a]:.2%})" for a in ("n", "s", "a"))
                + f" | {cell['browsers_released']:.0%} | {cell['countries_released']:.0%} | "
                f"{cell['sum_released']['laplace']:.1%} / "
                f"{cell['sum_released']['truncated_geometric']:.1%} |")
    lines += ["", f"![error vs ε]({error_png.name}) ![released vs group size]({released_png.name})", "",
              "COUNT's and SUM's measured errors stay far above their noise at large ε: users visit "
              "with several browsers and C_u caps how many groups each user counts in (C_u = 1: one "
              "browser per user, so each browser loses the users counted elsewhere), and [0, 3600] "
              "clamps heavy users' totals. That bias is the price of bounded contribution (paper "
              "§3), not noise, and shrinks as C_u grows while the noise grows with C_u. AVG, a "
              "ratio, is much less affected.", "",
              "The last column: a SUM by country, which does not release its user count, with "
              "τ-thresholding and with truncated-geometric selection "
              "(`partition_selection='truncated_geometric'`) at the same ε and δ: the share of "
              "true countries each released."]
    if not args.no_write:
        append_results(lines)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.1)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--no-write", action="store_true", help="do not append to bench/RESULTS.md")
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
