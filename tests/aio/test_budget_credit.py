"""Transfers that together want more than the server's ``max_buffer_bytes`` are slowed,
not killed, over real sockets: the layers granted past each transfer's first are reserved
in the budget, so a sender whose window does not fit waits for credit until the
application takes layers (docs/protocol.md 8.2)."""

from __future__ import annotations

import asyncio

import pytest

import kvwire
from tests.conftest import SECRET, make_layers, same_cache

pytestmark = pytest.mark.timeout(60)

LAYERS = 12
SPEC = kvwire.KVSpec(num_layers=LAYERS, num_kv_heads=4, head_dim=64, dtype="float16")
MIB = 1 << 20


async def test_two_iterated_transfers_over_a_small_budget_both_complete() -> None:
    """1 MiB layers, a budget of 8 and a window of 6 each: both windows do not fit at once.
    Both transfers complete on both sides, the application iterating them with a pause
    between layers (the one short of room waits for credit rather than fail)."""
    data = {rid: make_layers(LAYERS, 1024, 4, 64, seed=seed) for seed, rid in enumerate(("a", "b"))}
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_buffer_bytes=8 * MIB,
                            transfer_buffer_bytes=6 * MIB) as server:

        async def receive(rid: str) -> list[tuple[object, object]]:
            t = await server.expect(rid, timeout=20)
            got = []
            async for layer in t:
                got.append((layer.index, layer.k, layer.v))
                await asyncio.sleep(0.02)  # the application is slower than the wire
            return [(k, v) for _, k, v in sorted(got, key=lambda x: x[0])]

        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            received = asyncio.gather(receive("a"), receive("b"))
            await asyncio.gather(*(peer.send(rid, SPEC, layers, timeout=30) for rid, layers in data.items()))
            got_a, got_b = await received
        stats = server.statistics()
    assert same_cache(got_a, data["a"]) and same_cache(got_b, data["b"])  # type: ignore[arg-type]
    assert stats["buffer_budget_refusals"] == 0 and stats["transfers_aborted_by_peer"] == 0
    assert stats["credit_waits"] >= 1  # one of them waited for room
    assert stats["buffered_bytes"] == 0 and stats["reserved_bytes"] == 0
    assert stats["transfers_waiting_for_room"] == 0 and stats["transfers_waiting_to_start"] == 0
