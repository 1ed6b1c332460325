"""A TCP proxy to a Redis server for the registry tests: each client connection is served
by ``_serve`` (which a test's proxy writes), every such task ended on exit; and
:class:`Switchboard`, the one that forwards until a test holds, refuses or cuts."""

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


class Switchboard(RedisProxy):
    """A TCP proxy to Redis that can stop forwarding (``hole``: every connection, new ones
    included, is held open and nothing passes), refuse new connections (``refuse``: closed
    at once) and cut every open one (:meth:`cut`)."""

    def __init__(self, target_port: int) -> None:
        super().__init__(target_port)
        self.hole = False
        self.refuse = False
        self._writers: set[asyncio.StreamWriter] = set()

    def cut(self) -> None:
        for writer in tuple(self._writers):
            writer.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            while self.hole:
                await asyncio.sleep(3600)
            writer.write(data)
            await writer.drain()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(client_w)
        server_w: asyncio.StreamWriter | None = None
        try:
            if self.refuse:
                return
            if self.hole:
                await asyncio.sleep(3600)
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
            pumps = {
                asyncio.ensure_future(self._pump(client_r, server_w)),
                asyncio.ensure_future(self._pump(server_r, client_w)),
            }
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                server_w.close()
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            if server_w is not None:
                server_w.close()
            client_w.close()
            self._writers.discard(client_w)
            self._tasks.discard(task)
