"""Helpers the benchmarks share: a free loopback port, the machine's description, RESULTS.md."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    if names:
        cpu = names[0]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, Python {platform.python_version()}"


def append_results(lines: list[str]) -> None:
    """Append one run's figures to bench/RESULTS.md."""
    with open(RESULTS, "a") as f:
        f.write("\n" + "\n".join(lines) + "\n")
