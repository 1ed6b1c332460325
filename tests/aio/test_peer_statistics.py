"""What ``Peer.statistics()`` and a receipt say a rate or a time is: ``goodput_gbps`` is
KV bytes per second everywhere (the wire's rate is ``wire_gbps``), every ``*_gbps`` is in
gigabits, and the time to first layer is the time to layer 0 of the spec."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import kvwire
from kvwire.aio._send import SendState
from kvwire.aio.client import Peer
from kvwire.codec import get_codec
from kvwire.session.options import ClientOptions
from kvwire.session.sender import ChunkDelivered, ReceiverCosts
from kvwire.testing import FaultPlan, FaultProxy, Faults
from kvwire.units import parse_rate
from kvwire.wire.frames import ChunkAddress
from tests.conftest import SECRET

pytestmark = pytest.mark.timeout(120)


def _peer() -> Peer:
    return Peer("127.0.0.1", 9, secret=SECRET, streams=1, codec="raw", ssl=None, options=ClientOptions())


@pytest.mark.parametrize(("codec", "least"), [("raw", 0.95), ("fp8", 1.8), ("int4", 2.5)])
async def test_statistics_goodput_is_kv_bytes_and_wire_gbps_the_wire(codec: str, least: float) -> None:
    """statistics()["goodput_gbps"] was the wire bytes' delivery rate (fp8 on a 400 Mbit/s
    path: 0.37 against the receipt's 0.75 of KV). It is now that rate in KV bytes, as the
    receipt's goodput_gbps, and the wire's rate is wire_gbps."""
    spec = kvwire.KVSpec(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16")
    rng = np.random.default_rng(0)
    layers = [(rng.standard_normal((1024, 8, 128)).astype(np.float16),
               rng.standard_normal((1024, 8, 128)).astype(np.float16)) for _ in range(8)]
    plan = FaultPlan(forward=Faults(rate_bps=parse_rate("400mbps")))
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server, \
            FaultProxy("127.0.0.1", server.port, plan=plan) as proxy, \
            kvwire.connect("127.0.0.1", proxy.port, secret=SECRET, streams=1, codec=codec) as peer:
        for i in range(2):
            taking = asyncio.create_task(server.expect(f"r{i}", timeout=60))
            receipt = await peer.send(f"r{i}", spec, layers, timeout=60)
            await asyncio.wait_for((await taking).collect(), 60)
        stats = peer.statistics()
    assert stats["wire_gbps"] is not None and stats["goodput_gbps"] is not None, stats
    # The same delivery rate, counted in KV bytes: times the KV each wire byte carries.
    per_wire_byte = receipt.kv_bytes / receipt.wire_bytes
    assert per_wire_byte >= least, receipt
    assert stats["goodput_gbps"] / stats["wire_gbps"] == pytest.approx(per_wire_byte, rel=0.02), stats


def test_decode_gbps_is_gigabits_of_fp16() -> None:
    """statistics()["receiver"]["decode_gbps"] was GB/s (2 bytes an element) where every
    other *_gbps figure, and kvwire.units, read gigabits: it is now Gbit/s of fp16 out."""
    peer = _peer()
    fp8 = get_codec("fp8")
    seconds = 2e-10  # per element: 5e9 elements/s, 10 GB/s of fp16, 80 Gbit/s
    peer._receiver_costs(ReceiverCosts(transport_s_per_byte=1e-9, decode_s_per_element={fp8.codec_id: seconds}))
    receiver = peer.statistics()["receiver"]
    assert receiver["decode_gbps"] == {"fp8": pytest.approx(16 / seconds / 1e9)}
    assert receiver["decode_gbps"]["fp8"] == pytest.approx(parse_rate("80gbps") / 1e9)
    assert receiver["transport_s_per_gb"] == pytest.approx(1.0)


def test_time_to_first_layer_is_layer_zeros() -> None:
    """Layers complete out of order over several streams: a later layer completing first
    set the receipt's time to first layer (0.02 s where layer 0 took 1 s). It is now
    taken when every chunk of layer 0 was acknowledged, as documented."""
    peer = _peer()
    st = SendState(changed=asyncio.Event())
    peer.sends[1] = st

    def delivered(layer: int, done: bool) -> ChunkDelivered:
        return ChunkDelivered(address=ChunkAddress(transfer_id=1, layer=layer, kind=0, token_start=0), stream=0,
                              wire_size=100, kv_bytes=100, codec_id=0, layer_done=done)

    peer._on_event(delivered(3, True))
    peer._on_event(delivered(0, False))
    peer._on_event(delivered(5, True))
    assert st.first_layer_at is None
    peer._on_event(delivered(0, True))
    first = st.first_layer_at
    assert first is not None
    peer._on_event(delivered(1, True))
    assert st.first_layer_at == first
