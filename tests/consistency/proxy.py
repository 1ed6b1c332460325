"""A TCP proxy to a Redis server for the registry tests: each client connection is served
by ``_serve`` (which a test's proxy writes), every such task ended on exit."""

from __future__ import annotations

import asyncio
from typing import Self


class RedisProxy:
    """Listens on 127.0.0.1 (``port``) and forwards to Redis at ``target_port`` as
    ``_serve`` does; ``async with`` starts it and, on exit, stops listening and ends
    every connection's task."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.port = 0

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in tuple(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        raise NotImplementedError
