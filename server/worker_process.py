"""A worker process of a proxy with `[listen] workers` > 1: reads its part from the supervisor
(server.workers) on standard input, then serves the clients it is handed."""

from __future__ import annotations

import json
import socket
import sys

from config import Config
from server.backend_setup import BackendDSNs
from server.dsn import DSN
from server.serve import run_worker


def main() -> int:
    spec = json.loads(sys.stdin.buffer.read())
    dsns = spec["dsns"]
    for role in ("restricted", "pushdown", "ledger"):
        dsns[role] = DSN(**dsns[role])
    return run_worker(Config.model_validate(spec["config"]), BackendDSNs(**dsns),
                      spec["index"], spec["workers"],
                      socket.socket(fileno=spec["control_fd"]), spec["config_path"],
                      spec["log_level"])


if __name__ == "__main__":
    sys.exit(main())
