"""Real client programs against a proxy: psql, from the embedded Postgres's binaries."""

from __future__ import annotations

import os
import subprocess

from server.embedded import find_bindir

from .backend import TEST_DATABASE
from .proxy import Proxy


def psql(proxy: Proxy, *commands: str, user: str = "alice") -> subprocess.CompletedProcess[str]:
    """psql -c each of `commands` as `user` (whose password is the user name), without stopping
    at an error."""
    argv = [str(find_bindir() / "psql"), "-X", "-v", "ON_ERROR_STOP=0",
            "-h", proxy.host, "-p", str(proxy.port), "-U", user, "-d", TEST_DATABASE]
    for c in commands:
        argv += ["-c", c]
    env = dict(os.environ, PGPASSWORD=user, PGSSLMODE="disable")
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
