"""ProbeRTT where a chunk's time on the wire is short next to the RTT (fake time).

A window's growth sends many chunks at once; they are acked one chunk's time on the wire
apart, so the RTT samples after the minimum rise by that little each. Judged on the
sample after the minimum, the drain never came on such paths (10 Gbit/s and more with
the default chunk size), and the minimum, the window and the queue stepped up every
10 s: at 10 Gbit/s, 20 ms, from 23 to 215 ms and 268 MB in flight within 60 s.
"""

from __future__ import annotations

import math

import pytest

from kvwire.control import DeliveryRateEstimator, InflightController
from kvwire.control.pacing import PROBE_RTT_AFTER, PROBE_RTT_TIME
from tests.control.linksim import MIB, simulate

GBPS = 1e9 / 8  # bytes/s in one Gbit/s


@pytest.mark.parametrize(("gbps", "one_way"), [(10.0, 0.010), (25.0, 0.005)])
def test_a_busy_sender_on_a_fast_path_keeps_its_minimum_rtt_and_window(gbps: float, one_way: float) -> None:
    capacity = gbps * GBPS
    chunk = 4 * MIB
    ctl = InflightController(streams=4, chunk_bytes=chunk)
    est = DeliveryRateEstimator()
    log: list[tuple[float, float, int]] = []

    def target_of(e: DeliveryRateEstimator, now: float) -> int:
        assert e.min_rtt is not None
        log.append((now, e.min_rtt, e.bytes_in_flight))
        return ctl.target_bytes

    result = simulate(ctl.may_send, capacity=lambda t: capacity, delay=one_way, chunk=chunk, duration=60.0,
                      target_of=target_of, estimator=est)
    one_chunk = 2 * one_way + chunk / capacity  # a chunk's round trip with nothing ahead of it
    bdp = capacity * one_chunk
    late = [(rtt, flight) for at, rtt, flight in log if at >= 12.0]
    # Before: 10G: 40, 64, 101, 154, 215 ms; 25G: up to 86 ms.
    assert max(rtt for rtt, _ in late) <= 1.25 * one_chunk
    # Twice the BDP, probed up by a quarter, and what acks bunched after a drain add;
    # before: 264 MB (9 and 7.5 BDPs), the ceiling.
    assert max(flight for _, flight in late) <= 3.5 * bdp
    assert sum(flight for _, flight in late) / len(late) <= 2.5 * bdp
    assert ctl.probe_rtt_count >= 5  # one in every 8 to 10 s while the sender is busy
    # Each drain is 200 ms of half a BDP in flight: about 1 % of the link (before, with
    # no drain and the queue growing, the link was full; one chunk in flight cost 2 %).
    assert result.rate(2.0, 60.0) >= 0.985 * capacity


def test_a_drain_lowers_neither_the_max_filter_nor_the_published_estimate() -> None:
    """A drain of 200 ms is many round trips on a short path: its rates let the peak
    expire, and for most of each drain the estimate published (and the window after it)
    was a fraction of the link (5 Gbit/s, 4 ms: 1.5 Gbit/s); so was it in the first
    round trip after a drain, sent into the empty pipe."""
    capacity = 5 * GBPS
    ctl = InflightController(streams=4, chunk_bytes=MIB)
    est = DeliveryRateEstimator()
    log: list[tuple[float, float, float, bool]] = []

    def target_of(e: DeliveryRateEstimator, now: float) -> int:
        assert e.max_filter_bps is not None and e.bandwidth_bps is not None
        log.append((now, e.max_filter_bps, e.bandwidth_bps, ctl.probing_rtt))
        return ctl.target_bytes

    result = simulate(ctl.may_send, capacity=lambda t: capacity, delay=0.002, chunk=MIB, duration=20.0,
                      target_of=target_of, estimator=est)
    assert ctl.probe_rtt_count >= 2
    assert any(probing for *_, probing in log)
    late = [(peak, published) for at, peak, published, _ in log if at >= 2.0]
    assert min(peak for peak, _ in late) >= 0.9 * capacity * 8
    assert min(published for _, published in late) >= 0.9 * capacity * 8
    assert result.rate(2.0, 20.0) >= 0.97 * capacity


def _steady(est: DeliveryRateEstimator, start: float, end: float, rtt: float, key: int, *,
            in_flight: int = 8) -> int:
    """A steady flight of ``in_flight`` 1 MiB chunks, each acked ``rtt`` after its send;
    returns the next key. Leaves ``in_flight`` chunks outstanding."""
    step = rtt / in_flight
    now = start
    while now < end:
        est.on_send(key, MIB, now, app_limited=False)
        if key >= in_flight:
            est.on_ack(key - in_flight, now)
        key += 1
        now += step
    return key


def test_min_rtt_since_is_the_least_sample_taken_since() -> None:
    est = DeliveryRateEstimator()
    assert est.min_rtt_since(0.0) is None
    for i, (sent, rtt) in enumerate([(0.0, 0.010), (1.0, 0.020), (2.0, 0.015), (3.0, 0.030)]):
        est.on_send(i, MIB, sent, app_limited=False)
        est.on_ack(i, sent + rtt)
    assert est.min_rtt == pytest.approx(0.010)
    assert est.min_rtt_since(0.5) == pytest.approx(0.015)  # the 20 ms sample was followed by a lower one
    assert est.min_rtt_since(2.5) == pytest.approx(0.030)
    assert est.min_rtt_since(3.5) is None
    with pytest.raises(ValueError):
        est.min_rtt_since(float("nan"))


def test_no_drain_while_recent_round_trips_are_the_paths() -> None:
    """A flight whose recent samples are within 1.25 times the minimum queues nothing:
    the minimum is left to expire into them, without a drain."""
    end = PROBE_RTT_AFTER + 1.0
    for later, drains in ((0.011, False), (0.020, True)):
        ctl = InflightController(streams=1, chunk_bytes=MIB, min_bytes=MIB)
        est = DeliveryRateEstimator()
        key = _steady(est, 0.0, 0.1, 0.010, 0)
        # Later round trips are 11 ms (jitter, not a queue) or 20 ms (a queue of a BDP),
        # with more than a BDP in flight.
        _steady(est, 0.1, end, later, key, in_flight=16)
        ctl.update(est, end)
        assert ctl.probing_rtt is drains and ctl.probe_rtt_count == int(drains)
        assert est.app_limited is drains  # the drain's samples are not the path's
        if drains:
            assert est.max_filter_bps is not None and est.min_rtt is not None
            half_bdp = est.max_filter_bps / 16.0 * est.min_rtt  # bits/s to bytes/s, halved
            frame = MIB + 4096  # as may_send counts a chunk: whole frames, rounded up
            assert ctl.target_bytes == max(1, math.ceil(half_bdp / frame)) * frame
            ctl.update(est, end + PROBE_RTT_TIME + 1.0)
            assert not ctl.probing_rtt
