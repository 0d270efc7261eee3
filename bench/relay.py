"""The ceiling for any Python proxy: a bare byte relay (asyncio Protocol + uvloop), no inspection.

    python bench/relay.py PORT BACKEND_UNIX_SOCKET [PROCESSES]

Used by bench/passthrough.py as a third target in the same run, so that the
proxy's ratio can be read against what relaying alone costs on this machine.
With PROCESSES > 1 (as many as dp-proxy has workers) each process listens on the
port with SO_REUSEPORT and the kernel spreads the connections among them.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import cast

import uvloop


class _Upstream(asyncio.Protocol):
    def __init__(self, client: _Client) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.transport.close()


class _Client(asyncio.Protocol):
    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.early: list[bytes] | None = []
        self.upstream: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        upstream, _ = await asyncio.get_running_loop().create_unix_connection(
            lambda: _Upstream(self), self.backend)
        for chunk in self.early or ():
            upstream.write(chunk)
        self.early, self.upstream = None, upstream

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            assert self.early is not None
            self.early.append(data)
        else:
            self.upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


async def _main(port: int, backend: str) -> None:
    server = await asyncio.get_running_loop().create_server(
        lambda: _Client(backend), "127.0.0.1", port, reuse_port=True)
    await server.serve_forever()


if __name__ == "__main__":
    for _ in range(int(sys.argv[3]) - 1 if len(sys.argv) > 3 else 0):
        if os.fork() == 0:
            break  # (a child: it listens too, and forks no more)
    uvloop.run(_main(int(sys.argv[1]), sys.argv[2]))
