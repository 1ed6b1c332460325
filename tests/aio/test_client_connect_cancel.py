"""A stream's connect task cancelled in the loop iteration its TCP connection is made
ends cancelled: ``asyncio.wait_for`` on Python 3.11 returned the connection there and the
task went on as if never cancelled."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import kvwire
from kvwire.aio.client import Peer
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(60)


async def test_connect_cancelled_as_its_connection_is_made_ends_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    connecting: list[asyncio.Task[Any]] = []
    connect = Peer._connect

    async def recorded(self: Peer, index: int) -> None:
        task = asyncio.current_task()
        assert task is not None
        connecting.append(task)
        await connect(self, index)

    loop = asyncio.get_running_loop()
    create_connection = loop.create_connection

    async def made_then_cancelled(*args: Any, **kwargs: Any) -> Any:
        made = await create_connection(*args, **kwargs)
        connecting[-1].cancel()  # in the iteration the connection is made (the peer's teardown)
        return made

    monkeypatch.setattr(Peer, "_connect", recorded)
    monkeypatch.setattr(loop, "create_connection", made_then_cancelled)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        # The stream goes on with its handshake (the connection is made): the peer opens.
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, streams=1):
            assert len(connecting) == 1
            await asyncio.wait({connecting[0]}, timeout=10)
            assert connecting[0].cancelled()
