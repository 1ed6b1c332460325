"""``Server.accept(timeout=...)`` and ``Server.expect(timeout=...)`` cancelled in the loop
iteration their transfer is handed to them raise CancelledError, as without a timeout,
and the transfer handed over is aborted (its sender told): ``asyncio.wait_for`` on
Python 3.11 returned the transfer there, to a task that went on as if never cancelled."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import kvwire
from kvwire.aio._transfer import Transfer
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("timeout", [None, 10.0])
@pytest.mark.parametrize("call", ["accept", "expect"])
async def test_wait_cancelled_as_its_transfer_arrives_raises_and_aborts_it(call: str, timeout: float | None) -> None:
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=1, head_dim=8)
    after: list[str] = []
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async def waiter() -> Transfer:
            wait = server.accept(timeout=timeout) if call == "accept" else server.expect("x", timeout=timeout)
            transfer = await wait
            after.append("returned")  # (the cancel was lost)
            return transfer

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)  # (waiting now)
        deliver = server._deliver

        def deliver_then_cancel(transfer: Transfer) -> None:
            deliver(transfer)
            task.cancel()  # in the iteration that hands the transfer over (a TaskGroup's sibling failing)

        server._deliver = deliver_then_cancel  # type: ignore[method-assign]
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            with pytest.raises(kvwire.TransferAbortedError):
                await peer.send("x", spec, make_layers(2, 64, 1, 8), timeout=10)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), 10)
        assert task.cancelled()
        assert after == []


@pytest.mark.parametrize("call", ["accept", "expect"])
async def test_wait_timeout_still_raises_transfer_timeout(call: str) -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        wait: Any = server.accept(timeout=0.05) if call == "accept" else server.expect("x", timeout=0.05)
        with pytest.raises(kvwire.TransferTimeoutError, match=r"timed out after 0\.05 s"):
            await wait
        assert not server._accept_waiters and not server._expect_waiters
