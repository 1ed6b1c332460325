"""A client sees its sends that wait to start: the server holds ACCEPT while its buffer
budget has no room for a first layer (docs/protocol.md 7.1), and ``peer.statistics()``
counts those sends in ``transfers_waiting_to_start`` until the server answers."""

from __future__ import annotations

import asyncio
import logging

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
    assert same_cache(got_a, data["a"]) and same_cache(got_b, data["b"])


async def test_the_server_says_once_a_minute_that_transfers_wait_for_room(caplog: pytest.LogCaptureFixture) -> None:
    """The server's log says why transfers wait to start (the budget, what holds it, what
    to change), at most once per ROOM_LOG_INTERVAL: a second wait soon after the first
    adds no line."""
    caplog.set_level(logging.INFO, logger="kvwire")
    data = {rid: make_layers(LAYERS, 1024, 4, 64, seed=seed) for seed, rid in enumerate("abc")}

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if "wait to start" in r.getMessage()]

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_buffer_bytes=BUDGET) as server:

        async def waits(rid: str) -> asyncio.Future[kvwire.Receipt]:
            send = asyncio.ensure_future(peer.send(rid, SPEC, data[rid], timeout=30))
            await _until(lambda: server.statistics()["transfers_waiting_to_start"] == 1, f"{rid} waits")
            return send

        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
            await peer.send("a", SPEC, data["a"], timeout=30)
            held_a = await server.expect("a", timeout=20)  # held unread: no room for b
            assert lines() == []
            send_b = await waits("b")
            async for _layer in held_a:  # room frees: b starts
                pass
            await send_b
            held_b = await server.expect("b", timeout=20)  # held unread in turn: no room for c
            send_c = await waits("c")
            [line] = lines()  # one line for the two waits, within a minute
            assert line.startswith("1 transfer(s) wait to start: max_buffer_bytes (4.75 MiB) has no room")
            assert "4 MiB held in layers not yet taken by the application" in line
            async for _layer in held_b:
                pass
            await send_c
