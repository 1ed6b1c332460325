"""Connections through a fault proxy during a server's handshake and GOAWAY."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

import kvwire
from kvwire.testing.fault_proxy import FaultProxy
from tests.conftest import SECRET


async def until(what: Callable[[], bool]) -> None:
    async def wait() -> None:
        while not what():
            await asyncio.sleep(0.01)
    await asyncio.wait_for(wait(), 20)


def from_server(proxy: FaultProxy, index: int) -> int:
    """Bytes the server wrote on proxied connection ``index`` so far (held ones too)."""
    if len(proxy.connections) <= index or (pipe := proxy.connections[index].backward) is None:
        return 0
    return pipe.bytes_in


async def refused(port: int, **options: object) -> kvwire.KvwireError:
    with pytest.raises(kvwire.KvwireError) as info:
        await asyncio.wait_for(kvwire.connect("127.0.0.1", port, **{"secret": SECRET, **options}).open(), 20)
    return info.value
