"""What Peer.send() documents of the server's ``max_transfers``: a send past it fails at once
with LimitExceededError, complete transfers not yet claimed count, and the send can be
retried once one was claimed.  Real loopback sockets."""

from __future__ import annotations

import asyncio

import pytest

import kvwire
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)

SPEC = kvwire.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16)


async def test_a_send_past_max_transfers_fails_and_can_be_retried_once_one_is_claimed() -> None:
    data = make_layers(2, 8, 2, 16)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET, max_transfers=1) as server, \
            kvwire.connect("127.0.0.1", server.port, secret=SECRET) as peer:
        assert peer.max_transfers == 1
        await peer.send("a", SPEC, data, timeout=20)  # complete, not claimed yet
        with pytest.raises(kvwire.LimitExceededError) as refused:
            await peer.send("b", SPEC, data, timeout=20)
        # (it says what holds the slot: a transfer complete and not claimed, none in flight)
        assert str(refused.value).endswith(
            "1 transfers of the session held (max_transfers=1), 1 complete and not claimed by the "
            "receiver's application: retry once one ends or is claimed")
        first = await server.expect("a", timeout=20)
        await first.collect(timeout=20)
        rx = asyncio.create_task(server.expect("b", timeout=20))
        await peer.send("b", SPEC, data, timeout=20)
        second = await rx
        await second.collect(timeout=20)
