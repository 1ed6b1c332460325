"""serve(registry=...) takes a registry (the async check_many and publish the server calls)
and refuses anything else at once: a URL, False or a method was accepted, and then every
transfer with blocks failed with RegistryUnavailableError naming an AttributeError, a text
the peer received."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest

import kvwire
from kvwire.consistency import MemoryRegistry
from kvwire.errors import UsageError
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)


class _SyncCalls:
    """check_many and publish that are not async: the server awaits them."""

    def check_many(self, pairs: Iterable[Any]) -> list[Any]:
        return []

    def publish(self, pairs: Iterable[Any]) -> list[Any]:
        return []


class _AsyncCalls:
    """Not a whole Registry, but what the server calls."""

    async def check_many(self, pairs: Iterable[Any]) -> list[Any]:
        return []

    async def publish(self, pairs: Iterable[Any]) -> list[Any]:
        return []


class _OnlyCheck:
    async def check_many(self, pairs: Iterable[Any]) -> list[Any]:
        return []


def test_serve_refuses_what_is_not_a_registry() -> None:
    good = MemoryRegistry()
    for bad in ("redis://127.0.0.1:6379/0", False, 0, good.check_many, MemoryRegistry, _SyncCalls(), _OnlyCheck()):
        with pytest.raises(UsageError, match="registry"):
            kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=bad)


async def test_serve_takes_a_registry_or_its_async_calls() -> None:
    for registry in (MemoryRegistry(), _AsyncCalls()):
        async with kvwire.serve("127.0.0.1", 0, secret=SECRET, registry=registry) as server:
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
                blocks: list[tuple[Any, int]] = []
                if isinstance(registry, MemoryRegistry):
                    blocks = await registry.commit(await registry.begin([b"b0"], owner="a"))
                else:
                    blocks = [(b"b0", 1)]
                receiving = asyncio.ensure_future(server.expect("r", timeout=30))
                await asyncio.wait_for(peer.send("r", SPEC, make_layers(2, 8, 2, 16), blocks=blocks), 30)
                transfer = await asyncio.wait_for(receiving, 30)
                await asyncio.wait_for(transfer.collect(), 30)
