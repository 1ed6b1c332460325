"""The drain (ProbeRTT) holds half a BDP in whole chunks, rounded up (fake time).

``may_send`` lets whole chunks through, so half a BDP of 1.99 frames held one: each ack
left nothing in flight, the link idled for a round trip at a time (1 Gbit/s, 100 ms, and
100 Gbit/s, 0.5 ms, 4 MiB chunks: 8.35 MB, frames of 4.2 MB).
"""

from __future__ import annotations

import math

import pytest

from kvwire.control import DeliveryRateEstimator, InflightController
from tests.control.linksim import MIB, simulate

GBPS = 1e9 / 8  # bytes/s in one Gbit/s
FRAME = 4 * MIB + 4096  # a 4 MiB chunk's frame as the controller counts it


@pytest.mark.parametrize(("gbps", "one_way", "duration", "share"),
                         [(1.0, 0.050, 18.0, 0.97), (100.0, 0.00025, 10.0, 0.985)])
def test_a_drain_of_two_frames_keeps_two_in_flight(gbps: float, one_way: float, duration: float,
                                                   share: float) -> None:
    capacity = gbps * GBPS
    chunk = 4 * MIB
    ctl = InflightController(streams=4, chunk_bytes=chunk)
    est = DeliveryRateEstimator()
    draining: list[tuple[int, int]] = []

    def target_of(e: DeliveryRateEstimator, now: float) -> int:
        if ctl.probing_rtt:
            draining.append((e.bytes_in_flight, ctl.target_bytes))
        return ctl.target_bytes

    result = simulate(ctl.may_send, capacity=lambda t: capacity, delay=one_way, chunk=chunk, duration=duration,
                      target_of=target_of, estimator=est)
    assert ctl.probe_rtt_count >= 1
    assert est.min_rtt is not None
    assert est.min_rtt <= 1.01 * (2 * one_way + chunk / capacity)  # the drain still drains
    half_bdp = capacity / 2 * est.min_rtt
    assert 1 < half_bdp / FRAME < 2
    # Every target is whole frames, half a BDP rounded up; before: 8.35 MB, one chunk.
    assert {target for _, target in draining} == {math.ceil(half_bdp / FRAME) * FRAME}
    # Once drained to it, an ack leaves a chunk in flight (before: none, at 5 and 237 acks).
    drained = [flight for flight, target in draining]
    drained = drained[next(i for i, flight in enumerate(drained) if flight <= 2 * chunk):]
    assert min(drained) >= chunk
    # Before: 96.0 % (two drains; after, 97.3) and 97.6 % (one drain; after, 99.2).
    assert result.rate(5.0, duration) >= share * capacity

