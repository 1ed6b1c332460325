"""What a receipt counts after a resume, as Receipt's docstrings say: ``chunks`` and
``wire_bytes`` count every CHUNK frame put on the wire, a chunk sent again included;
``extra["chunks_by_codec"]`` counts the cache's chunks, each once."""

from __future__ import annotations

import asyncio

import pytest

import kvwire
from kvwire.testing import CLEAN, FaultPlan, FaultProxy, Faults
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("codec", ["raw", "fp8"])
async def test_chunks_count_resends_and_chunks_by_codec_does_not(codec: str) -> None:
    spec = kvwire.KVSpec(num_layers=4, num_kv_heads=8, head_dim=128, dtype="float16")
    layers = make_layers(4, 4096, 8, 128)

    def plan(i: int) -> FaultPlan:  # the first connection drops mid-transfer
        return FaultPlan(forward=Faults(drop_at=20_000_000)) if i == 0 else CLEAN

    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            FaultProxy("127.0.0.1", server.port, plan=plan) as proxy, \
            kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, streams=1, codec=codec) as peer:
        taking = asyncio.create_task(server.expect("r", timeout=60))
        receipt = await peer.send("r", spec, layers, timeout=60)
        transfer = await taking
        await asyncio.wait_for(transfer.collect(), 60)
        resent = peer.chunks_resent
    assert peer.resumes >= 1 and resent > 0
    by_codec = receipt.extra["chunks_by_codec"]
    assert set(by_codec) == {codec}
    assert receipt.chunks == sum(by_codec.values()) + resent
    assert receipt.wire_bytes > transfer.wire_bytes  # the frames sent again, on the wire twice
