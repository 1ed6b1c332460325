"""Over loopback: an honest client that gives up a gated send while the server's registry
call for it runs, and sends another at once, is no longer refused.  Before, the failed
transfer kept its place in max_transfers until the call ended (a publish is never
cancelled; a check is, but the core heard of it one loop turn later, and a registry may
go on when cancelled), so with max_transfers=1 the next send failed with LIMIT_EXCEEDED
("1 failed awaiting the registry") though nothing of the client was in flight.  Now such
calls have an allowance of their own (a session's in progress and failed-awaiting
transfers together at most 2 x max_transfers)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest

import kvwire
from tests.conftest import SECRET, make_layers
from tests.rawpeer import wait_until

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float16")


class FirstCallHeld:
    """A registry whose first check (``check=True``) or first publish waits until
    :meth:`release`, going on when cancelled (as a registry of the application's may);
    every other call answers at once."""

    def __init__(self, *, check: bool) -> None:
        self.check = check
        self.released = asyncio.Event()
        self.running = asyncio.Event()
        self.held = 0

    def release(self) -> None:
        self.released.set()

    async def _call(self) -> list[Any]:
        self.held += 1
        if self.held == 1:
            self.running.set()
            try:
                await self.released.wait()
            except asyncio.CancelledError:
                await self.released.wait()
        return []

    async def check_many(self, pairs: Iterable[Any]) -> list[Any]:
        return await self._call() if self.check else []

    async def publish(self, pairs: Iterable[Any]) -> list[Any]:
        return [] if self.check else await self._call()


@pytest.mark.parametrize("check", [True, False], ids=["check", "publish"])
async def test_a_send_given_up_while_its_registry_call_runs_lets_the_next_one_in(check: bool) -> None:
    registry = FirstCallHeld(check=check)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=registry, max_sessions=1,
                            max_transfers=1) as server:
        try:
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, spec=SPEC) as peer:
                blocks = [(b"i:1", 1)]
                first = asyncio.ensure_future(peer.send("A", SPEC, make_layers(1, 16, 2, 8), blocks=blocks))
                await asyncio.wait_for(registry.running.wait(), 10)
                first.cancel()  # the application gives up: its RESET fails the transfer
                await asyncio.gather(first, return_exceptions=True)
                assert await wait_until(lambda: server.core.counters["transfers_aborted_by_peer"] == 1, 10)
                assert server.core.registry_calls == 1  # (A's call still runs)
                receiving = asyncio.ensure_future(server.expect("B", timeout=10))
                await asyncio.wait_for(peer.send("B", SPEC, make_layers(1, 16, 2, 8), blocks=blocks), 10)
                await (await receiving).collect(timeout=10)
                st = server.statistics()
                assert st["transfers_refused"] == 0 and server.core.registry_calls == 1
                registry.release()
                assert await wait_until(lambda: server.core.registry_calls == 0 and not server._tasks, 10)
        finally:  # (a call that goes on when cancelled would hold the server's close)
            registry.release()
