"""Server.unclaimed_request_ids(): the request ids of the arrived transfers accept() and
expect() would hand out now, oldest first, one per transfer, failed ones included, over
real loopback sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.errors import TransferAbortedError
from tests.conftest import SECRET, make_layers
from tests.rawpeer import wait_until

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16")


def failing() -> Iterator[tuple[np.ndarray, np.ndarray]]:
    yield make_layers(1, 4, 2, 8)[0]
    raise RuntimeError("producer failed")


async def send_whole(peer: Any, request_id: str) -> None:
    await asyncio.wait_for(peer.send(request_id, SPEC, make_layers(2, 4, 2, 8)), 10)


async def test_lists_arrivals_oldest_first_failed_ones_included_and_claims_nothing() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        assert server.unclaimed_request_ids() == []
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            waiting = asyncio.create_task(server.expect("claimed-on-arrival", timeout=10))
            await asyncio.sleep(0)
            await send_whole(peer, "claimed-on-arrival")
            await send_whole(peer, "a")
            await send_whole(peer, "b")
            await send_whole(peer, "a")  # one id, two transfers: listed twice
            with pytest.raises(TransferAbortedError):
                await asyncio.wait_for(peer.send("failed", SPEC, failing()), 10)
            assert await wait_until(lambda: server.statistics()["failed_arrivals"] == 1, 10)
            await (await waiting).collect(timeout=5)
            ids = server.unclaimed_request_ids()
            assert ids == ["a", "b", "a", "failed"]
            assert server.unclaimed_request_ids() == ids  # (a snapshot: nothing was claimed)
            assert len(ids) == server.statistics()["pending_arrivals"]
            first = await server.expect("a", timeout=5)  # the oldest of "a"
            assert server.unclaimed_request_ids() == ["b", "a", "failed"]
            assert (await server.accept(timeout=5)).request_id == "b"
            assert server.unclaimed_request_ids() == ["a", "failed"]
            failed = await server.expect("failed", timeout=5)
            with pytest.raises(TransferAbortedError):
                await failed.collect(timeout=5)
            assert server.unclaimed_request_ids() == ["a"]
            await first.collect(timeout=5)
    assert server.unclaimed_request_ids() == []  # closed: what arrived was dropped


async def test_a_closed_server_lists_none() -> None:
    server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
    await server.start()
    try:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await send_whole(peer, "left")
            assert server.unclaimed_request_ids() == ["left"]
    finally:
        await server.close()
    assert server.unclaimed_request_ids() == []


async def test_a_server_closing_lists_none_before_it_dropped_what_arrived() -> None:
    """close() under way (here: as it stops listening, before it fails and drops the
    transfers that arrived) lists none: nothing hands them out any more."""
    server = kvwire.serve("127.0.0.1", 0, secret=SECRET)
    await server.start()
    seen: list[list[str]] = []
    try:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await send_whole(peer, "left")
            assert server.unclaimed_request_ids() == ["left"]
            listener = server._servers[0]
            real_close = listener.close

            def close() -> None:
                seen.append(server.unclaimed_request_ids())
                real_close()

            listener.close = close  # type: ignore[method-assign]
            await server.close()
    finally:
        await server.close()
    assert seen == [[]]
    assert server.unclaimed_request_ids() == []
