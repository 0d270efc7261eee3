"""Every benchmark, one after the other, writing a fresh bench/RESULTS.md.

    .venv/bin/pip install -e '.[bench]'   # matplotlib, for the accuracy plots
    .venv/bin/python bench/run_all.py [--quick]

Runs pass-through (pgbench), DP query cost, memory (scale 1 and 10), concurrency
(50 analysts × 60 s), load (200 connections mixing pass-through and DP, 60 s) and
accuracy (with its PNG plots), then replaces
RESULTS.md with their figures under a description of the machine. Takes about
half an hour here (most of it the scale-10 dataset); `--quick` runs each with
small settings (minutes), for checking that they all work. Nothing else should
run on the machine meanwhile: the timings share its cores.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, machine

HERE = Path(__file__).resolve().parent

FULL = [
    ["passthrough.py"],
    ["dp_query.py"],
    ["memory.py"],
    ["concurrency.py"],
    ["load.py"],
    ["accuracy.py"],
]
QUICK = [
    ["passthrough.py", "--seconds", "3", "--runs", "1"],
    ["dp_query.py", "--scale", "0.1", "--runs", "2"],
    ["memory.py", "--scales", "0.1", "0.2", "--runs", "1"],
    ["concurrency.py", "--analysts", "10", "--seconds", "10"],
    ["load.py", "--connections", "40", "--seconds", "10"],
    ["accuracy.py", "--runs", "2"],
]

HEADER = """# Benchmark results

Written by `bench/run_all.py` on {date} ({mode}). Machine: {machine}.

Targets (issues 3, 4 and 7): pass-through ≥ 0.5× direct (pgbench -S); a DP query ≤ 2.5× its raw
non-private GROUP BY and ≤ 1.1× its own pushdown; proxy peak memory growth < 10% from scale 1 to
10; 50 concurrent analysts with no errors but budget refusals (53400); accuracy against the true
non-private answers. Each section below says what was run; the scripts' docstrings say how.
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small settings: a check, not figures")
    ap.add_argument("--output", type=Path, default=RESULTS)
    args = ap.parse_args()
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        body = Path(tmp) / "body.md"
        body.touch()
        env = dict(os.environ, BENCH_RESULTS_FILE=str(body))
        for script, *params in QUICK if args.quick else FULL:
            t0 = time.monotonic()
            print(f"== {script} {' '.join(params)}", flush=True)
            rc = subprocess.run([sys.executable, str(HERE / script), *params], env=env).returncode
            print(f"== {script}: exit {rc} after {time.monotonic() - t0:.0f} s", flush=True)
            if rc != 0:
                failed.append(script)
        header = HEADER.format(date=datetime.date.today().isoformat(),
                               mode="quick settings" if args.quick else "full settings",
                               machine=machine())
        failures = f"\nFailed: {', '.join(failed)}.\n" if failed else ""
        args.output.write_text(header + failures + body.read_text())
    print(f"wrote {args.output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
