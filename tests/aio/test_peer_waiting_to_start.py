"""A client sees its sends that wait to start: the server holds ACCEPT while its buffer
budget has no room for a first layer (docs/protocol.md 7.1), and ``peer.statistics()``
counts those sends in ``transfers_waiting_to_start`` until the server answers."""

from __future__ import annotations

import asyncio

import pytest

import kvwire
from tests.conftest import SECRET, make_layers, same_cache

pytestmark = pytest.mark.timeout(60)

LAYERS = 4
SPEC = kvwire.KVSpec(num_layers=LAYERS, num_kv_heads=4, head_dim=64, dtype="float16")
MIB = 1 << 20
#: Room for "a" whole (its first layer, then a window of three in the room less an eighth)
#: and not for one more first layer.
BUDGET = 4 * MIB + 3 * MIB // 4


async def _until(predicate: object, what: str) -> None:
    for _ in range(2000):
        if predicate():  # type: ignore[operator]
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never: {what}")


async def test_a_send_held_for_room_is_counted_until_its_accept() -> None:
    """1 MiB layers (1024 tokens), a budget of 4.75 MiB: transfer "a" arrives whole and is
    held unread, so the budget has no room for "b"'s first layer and its ACCEPT waits.
    Meanwhile the client counts one send waiting to start; once "a" is read, "b" starts,
    both complete, and the count is back at 0."""
    data = {rid: make_layers(LAYERS, 1024, 4, 64, seed=seed) for seed, rid in enumerate(("a", "b"))}
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_buffer_bytes=BUDGET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await peer.send("a", SPEC, data["a"], timeout=30)
            assert peer.statistics()["transfers_waiting_to_start"] == 0
            held = await server.expect("a", timeout=20)
            send_b = asyncio.ensure_future(peer.send("b", SPEC, data["b"], timeout=30))
            await _until(lambda: server.statistics()["transfers_waiting_to_start"] == 1, "b waits on the server")
            await _until(lambda: peer.statistics()["transfers_waiting_to_start"] == 1, "b counted on the client")
            assert peer.statistics()["transfers_in_flight"] == 1 and not send_b.done()
            got_a = [(layer.k, layer.v) async for layer in held]
            await send_b
            assert peer.statistics()["transfers_waiting_to_start"] == 0
            got_b = [(layer.k, layer.v) async for layer in await server.expect("b", timeout=20)]
    assert same_cache(got_a, data["a"]) and same_cache(got_b, data["b"])  # type: ignore[arg-type]
