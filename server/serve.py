"""The serving process: its event loop, signals and reload, and a lone proxy or the supervisor
of its worker processes (each of which runs `run_worker`)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from config import Config, ConfigError, load_config
from server.errors import LedgerTooNew
from server.logs import configure as configure_logs
from server.logs import set_format

if TYPE_CHECKING:
    from server.app import ProxyServer
    from server.backend_setup import BackendDSNs

EXIT_CONFIG = 2
"""The exit status of a configuration that cannot be used."""


def load_or_report(path: Path) -> Config | None:
    """The configuration at `path`, or None after printing every problem it has."""
    try:
        return load_config(path)
    except ConfigError as e:
        print(f"{e.source}: configuration is invalid:", file=sys.stderr)
        for problem in e.problems:
            print(f"  {problem}", file=sys.stderr)
        return None


def run(config: Config, data_dir: Path | None, demo: bool, config_path: Path | None = None) -> int:
    """Serve `config` until a signal stops it (see `serve`); the exit status."""
    return _run_loop(serve(config, data_dir, demo, config_path))


def _run_loop(main: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def run_worker(config: Config, dsns: BackendDSNs, index: int, workers: int,
               control: socket.socket, config_path: str | None, log_level: str) -> int:
    """One worker process of a proxy with `[listen] workers` > 1 (see server.workers)."""
    configure_logs(log_level)
    return _run_loop(serve(config, None, False, Path(config_path) if config_path else None,
                            worker=(dsns, index, workers, control)))


async def serve(config: Config, data_dir: Path | None, demo: bool,
                 config_path: Path | None = None,
                 worker: tuple[BackendDSNs, int, int, socket.socket] | None = None) -> int:
    """Serve until SIGTERM (running queries may finish within listen.shutdown_grace) or
    SIGINT (sessions close at once); SIGHUP reloads the analysts from `config_path`.

    With `[listen] workers` > 1 this process supervises that many worker processes
    (server.workers), which run this function with `worker` set: (the backend DSNs, their
    index, the number of workers, the control socket)."""
    set_format(config.log.format)
    from config import reloaded
    from server.embedded import EmbeddedPostgres, EmbeddedPostgresError
    from server.workers import Supervisor, WorkerLink, WorkerStartError

    log = logging.getLogger("dp_proxy")
    stop = asyncio.Event()
    graceful = True
    loop = asyncio.get_running_loop()

    def on_stop(gentle: bool) -> None:
        nonlocal graceful
        graceful = graceful and gentle
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, on_stop, True)
    loop.add_signal_handler(signal.SIGINT, on_stop, False)
    server: ProxyServer | None = None
    supervisor: Supervisor | None = None
    reloading: set[asyncio.Task[None]] = set()

    async def reload() -> None:
        if supervisor is not None:
            supervisor.signal_workers(signal.SIGHUP)  # each worker reloads the file itself
            new = load_or_report(config_path) if config_path is not None else None
            if new is not None:  # (what a worker restarted later starts with)
                supervisor.config = reloaded(supervisor.config, new)
            return
        if server is None or config_path is None:
            return
        new = load_or_report(config_path)
        if new is None:
            log.error("configuration reload failed: the running configuration stays")
            return
        try:
            await server.reload(new)
        except Exception:
            log.exception("configuration reload failed: the running configuration stays")

    def on_hup() -> None:
        task = loop.create_task(reload())
        reloading.add(task)
        task.add_done_callback(reloading.discard)

    loop.add_signal_handler(signal.SIGHUP, on_hup)

    pg: EmbeddedPostgres | None = None
    try:
        if worker is not None:
            dsns = worker[0]
        elif demo:
            from server.bootstrap import prepare_embedded

            try:
                pg = await asyncio.to_thread(EmbeddedPostgres(data_dir=data_dir).start)
            except EmbeddedPostgresError as e:
                print(f"dp-proxy: {e}", file=sys.stderr)
                return 1
            dsns = await prepare_embedded(pg, config)
        else:
            from server.backend_setup import BackendDSNs
            from server.dsn import DSNError

            try:
                dsns = BackendDSNs.of(config)
            except DSNError as e:
                print(f"dp-proxy: backend DSN: {e}", file=sys.stderr)
                return EXIT_CONFIG
        import asyncpg

        try:
            if worker is None and config.listen.workers > 1:
                supervisor = Supervisor(config, dsns,
                                        str(config_path) if config_path else None,
                                        logging.getLevelName(logging.getLogger().level))
                await supervisor.start()
                port = supervisor.port
            else:
                from server.app import ProxyServer

                server = ProxyServer(config, dsns)
                if worker is not None:
                    server.worker = WorkerLink(server, worker[3], worker[1], worker[2])
                await server.start()
                port = server.port
        except (OSError, WorkerStartError, asyncpg.PostgresError, asyncpg.InterfaceError,
                LedgerTooNew) as e:
            # (the backend unreachable or refusing the pushdown role, the port taken, a ledger
            # of a newer dp-proxy...)
            log.debug("start failed", exc_info=True)
            where = f" (backend {dsns.pushdown.host}:{dsns.pushdown.port})" \
                if isinstance(e, ConnectionError) else ""
            print(f"dp-proxy: cannot start: {e}{where}", file=sys.stderr)
            return 1
        host = config.listen.host
        if worker is None and demo:
            print("dp-proxy demo is running: embedded Postgres with the demo data.", flush=True)
            print("Connect as an analyst (password = user name; also bob, and admin):", flush=True)
            print(f'  psql "postgresql://alice:alice@{host}:{port}/demo"', flush=True)
            print("Ctrl-C stops the proxy and Postgres.", flush=True)
        elif worker is None:
            log.info("dp-proxy serving database %s on %s:%s", dsns.database, host, port)
        await stop.wait()
        return 0
    finally:
        if supervisor is not None:
            await supervisor.shutdown(graceful)
        if server is not None:
            await server.shutdown(None if graceful else 0.0)
        if pg is not None:
            await asyncio.to_thread(pg.stop)
            if demo:
                print("dp-proxy demo stopped; Postgres stopped.", flush=True)
