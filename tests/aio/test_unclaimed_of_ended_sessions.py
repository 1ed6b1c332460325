"""Over loopback: complete transfers nobody claimed, of sessions that ended cleanly, count
against max_sessions x max_transfers; a client closing its session and opening another
cannot make the server hold more of them, and none is dropped to make room."""

from __future__ import annotations

import asyncio

import pytest

import kvwire
from kvwire.errors import LimitExceededError
from tests.conftest import SECRET, make_layers
from tests.rawpeer import wait_until

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype="float16")


async def test_sessions_closing_and_reopening_hold_at_most_the_bound_and_lose_nothing() -> None:
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_sessions=1, max_transfers=2,
                            claim_timeout=None) as server:
        for n in range(3):
            async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
                for i in range(2):
                    if n == 0:
                        await asyncio.wait_for(peer.send(f"s{n}-{i}", SPEC, make_layers(1, 4, 2, 8)), 10)
                    else:
                        with pytest.raises(LimitExceededError, match="complete from ended sessions"):
                            await asyncio.wait_for(peer.send(f"s{n}-{i}", SPEC, make_layers(1, 4, 2, 8)), 10)
            assert await wait_until(lambda: server.statistics()["sessions"] == 0, 10)
        assert server.unclaimed_request_ids() == ["s0-0", "s0-1"]
        assert server.core.held_transfers == 2
        # Claimed and taken: room again.
        first = await server.accept(timeout=5)
        await first.collect(timeout=5)
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await asyncio.wait_for(peer.send("after", SPEC, make_layers(1, 4, 2, 8)), 10)
        assert server.unclaimed_request_ids() == ["s0-1", "after"]
