"""The goodput through a drain (ProbeRTT) on a slow or long path (fake time).

A drain and the round trip after it are held (``mark_app_limited``): their samples add
no goodput. Where they outlast the goodput window, the goodput emptied and the published
estimate went back to the max filter, which after a drop in capacity still held the old
peak: at 0.1 Gbit/s, 20 ms, a link halved at 4 s read over 1.5 times its new rate for 6 s
of the next 25. The newest goodput sample now stays while the hold's samples come in.
"""

from __future__ import annotations

import pytest

from kvwire.control import DeliveryRateEstimator, InflightController
from tests.control.linksim import MIB, simulate

GBPS = 1e9 / 8  # bytes/s in one Gbit/s


@pytest.mark.parametrize(("gbps", "one_way", "worst"), [(0.1, 0.010, 1.25), (0.2, 0.050, 1.15), (1.0, 0.050, 1.1)])
def test_the_published_estimate_follows_a_drop_through_drains(gbps: float, one_way: float, worst: float) -> None:
    capacity = gbps * GBPS
    ctl = InflightController(streams=4, chunk_bytes=4 * MIB)
    est = DeliveryRateEstimator()
    log: list[tuple[float, float | None, float | None]] = []

    def target_of(e: DeliveryRateEstimator, now: float) -> int:
        log.append((now, e.bandwidth_bps, e.goodput_bps))
        return ctl.target_bytes

    simulate(ctl.may_send, capacity=lambda t: capacity if t < 4.0 else capacity / 2, delay=one_way,
             chunk=4 * MIB, duration=30.0, target_of=target_of, estimator=est)
    assert ctl.probe_rtt_count >= 2
    new_bps = capacity / 2 * 8
    late = [(at, published, goodput) for at, published, goodput in log if at >= 5.0]
    # Before: 0.1 Gbit/s: the goodput empty and the estimate twice the link's rate for
    # 6.0 s in all; 0.2 Gbit/s, 100 ms: 2.7 and 0.7 s; 1 Gbit/s, 100 ms: 0.9 and 0.3 s.
    assert all(goodput is not None for _, _, goodput in late)
    assert max(published or 0.0 for _, published, _ in late) <= worst * new_bps


def _ack_in_order(est: DeliveryRateEstimator, sends: list[float], rtt: float, first: int) -> None:
    for i, sent in enumerate(sends):
        est.on_send(first + i, MIB, sent, app_limited=False)
    for i, sent in enumerate(sends):
        est.on_ack(first + i, sent + rtt)


def test_a_hold_longer_than_the_goodput_window_keeps_the_newest_sample() -> None:
    est = DeliveryRateEstimator(goodput_window=0.5)
    # A steady flight: one 1 MiB chunk every 10 ms, each acked 50 ms after its send.
    for i in range(100):
        est.on_send(i, MIB, i * 0.01, app_limited=False)
        if i >= 5:
            est.on_ack(i - 5, i * 0.01)
    for i in range(95, 100):
        est.on_ack(i, i * 0.01 + 0.05)
    before = est.goodput_bps
    assert before is not None
    # A hold of 2 s: one chunk at a time, each acked 0.4 s later.
    est.mark_app_limited()
    for k in range(5):
        est.on_send(1000 + k, MIB, 1.1 + 0.4 * k, app_limited=False)
        est.on_ack(1000 + k, 1.5 + 0.4 * k)
        est.mark_app_limited()
        assert est.goodput_bps == pytest.approx(before)  # before: None from 1.5 s on
    # Let go: the first chunk sent after it is the path's again, and replaces it.
    est.on_send(2000, MIB, 3.5, app_limited=False)
    est.on_ack(2000, 3.55)
    est.on_send(2001, MIB, 3.5, app_limited=False)
    est.on_ack(2001, 3.6)
    sample = est.goodput_bps
    assert sample is not None and sample != pytest.approx(before)
    est.advance(4.2)
    assert est.goodput_bps is None


def test_a_sender_idle_after_a_hold_falls_back_to_the_max_filter() -> None:
    est = DeliveryRateEstimator(goodput_window=0.5)
    _ack_in_order(est, [i * 0.01 for i in range(20)], 0.05, 0)
    est.mark_app_limited()
    est.on_send(100, MIB, 0.3, app_limited=False)
    est.on_ack(100, 0.5)
    assert est.goodput_bps is not None
    est.advance(0.9)
    assert est.goodput_bps is not None  # within a window of the hold's last ack
    est.advance(1.0)
    assert est.goodput_bps is None
    assert est.bandwidth_bps == est.max_filter_bps


def test_an_app_limited_sender_after_a_hold_keeps_no_sample() -> None:
    """A chunk sent after the hold, app-limited (the sender ran out of data), ends the
    hold's keep: the goodput empties as it would have without the hold."""
    est = DeliveryRateEstimator(goodput_window=0.5)
    _ack_in_order(est, [i * 0.01 for i in range(20)], 0.05, 0)
    est.mark_app_limited()
    est.on_send(100, MIB, 0.3, app_limited=False)
    est.on_ack(100, 0.35)
    est.on_send(101, MIB, 1.5, app_limited=True)
    est.on_ack(101, 1.55)
    assert est.goodput_bps is None
