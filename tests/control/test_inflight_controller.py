"""InflightController on a fake-time link: holds it when acks come late, recovers, keeps its floor."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.control import DeliveryRateEstimator, InflightController, InflightTarget
from kvwire.control.pacing import PROBE_CYCLE
from tests.control.linksim import MIB, simulate

GBPS = 1e9 / 8  # bytes/s in one Gbit/s


def test_floor_keeps_two_chunks_per_stream() -> None:
    ctl = InflightController(streams=4, chunk_bytes=MIB, min_bytes=4 * MIB)
    frame = MIB + 64  # a raw chunk's frame: payload and header
    assert ctl.floor_bytes >= 8 * frame  # all four streams keep two frames each in flight
    ctl.set_streams(16)
    assert ctl.floor_bytes >= 32 * frame
    assert InflightController(streams=64, chunk_bytes=8 * MIB, max_bytes=64 * MIB).floor_bytes == 64 * MIB
    est = DeliveryRateEstimator()
    assert ctl.update(est, 0.0) == ctl.floor_bytes  # the initial 16 MiB is below the floor


def test_on_a_slow_path_the_floor_is_two_chunks_and_a_bdp_not_two_chunks_per_stream() -> None:
    ctl = InflightController(streams=4, chunk_bytes=4 * MIB, min_bytes=4 * MIB)
    frame = 4 * MIB + 4096
    assert ctl.floor_bytes == 8 * frame  # 33.6 MB: 270 ms of a 1 Gbit/s link
    # 1 Gbit/s, 20 ms: one chunk on the wire, one waiting, a BDP (2.5 MB) on the way.
    assert ctl.floor_for(1e9, 0.020) == 2 * frame + 2_500_000
    # A fast path keeps two chunks per stream (they drain within FLOOR_QUEUE)...
    assert ctl.floor_for(25e9, 0.001) == ctl.floor_bytes
    assert ctl.floor_for(10e9, 0.0001) == ctl.floor_bytes
    # ... and a path between keeps what drains in FLOOR_QUEUE (50 ms of 2.5 Gbit/s).
    assert ctl.floor_for(2.5e9, 0.0001) == 15_625_000
    assert ctl.floor_for(1e6, 0.020) == 2 * frame + 2500  # two chunks even on the slowest path
    assert InflightController(chunk_bytes=MIB).floor_for(1e6, 0.020) == 4 * MIB  # never below min_bytes


def test_a_slow_long_path_is_kept_full_without_a_standing_queue_of_the_floor() -> None:
    capacity = 1 * GBPS
    ctl = InflightController(streams=4, chunk_bytes=4 * MIB)
    result = simulate(ctl.may_send, capacity=lambda t: capacity, delay=0.010, chunk=4 * MIB, duration=6.0,
                      target_of=lambda e, now: ctl.target_bytes)
    assert result.rate(2.0, 6.0) >= 0.95 * capacity
    late = [t for at, t in result.targets if at >= 2.0]
    # Twice the BDP of a chunk's round trip (20 ms and its 33 ms on the wire), probed up by
    # a quarter: well below two chunks per stream (33.6 MB, 270 ms queued).
    assert max(late) <= 0.7 * ctl.floor_bytes


def test_an_empty_flight_may_always_send() -> None:
    ctl = InflightController(min_bytes=MIB, max_bytes=MIB, initial_bytes=MIB)
    est = DeliveryRateEstimator()
    assert ctl.may_send(est, 10 * MIB, 0.0)
    est.on_send(1, 10 * MIB, 0.0, app_limited=False)
    assert not ctl.may_send(est, 1, 0.0)
    assert ctl.window_limited


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        InflightController(cycle=(1.0, 1.0))  # never probes
    with pytest.raises(ValueError):
        InflightController(cycle=(1.5, 1.0))  # mean above 1: a standing queue
    with pytest.raises(ValueError):
        InflightController(streams=0)
    with pytest.raises(ValueError):
        InflightController(gain=0.5)


@settings(max_examples=25, deadline=None)
@given(
    gbps=st.sampled_from([1.0, 5.0, 10.0, 20.0]),
    late=st.floats(0.0, 0.010),
    burst=st.sampled_from([0.0, 0.002, 0.005]),
)
def test_late_or_bursty_acks_do_not_pin_the_window(gbps: float, late: float, burst: float) -> None:
    """A receiver that acks late (steadily, or in bursts) must not make the sender idle."""
    capacity = gbps * GBPS
    ctl = InflightController(streams=4, max_ack_delay=0.010)
    result = simulate(
        ctl.may_send, capacity=lambda t: capacity, duration=1.5,
        ack_delay=lambda t: 0.0 if t < 0.2 else late, ack_period=lambda t: burst,
    )
    assert result.rate(0.75, 1.5) >= 0.95 * capacity


def test_the_plain_bdp_window_pins_itself_where_the_controller_holds() -> None:
    capacity = 10 * GBPS
    late = 0.010

    def delay(t: float) -> float:
        return 0.0 if t < 0.3 else late

    old = InflightTarget()
    pinned = simulate(lambda e, n, t: old.may_send(e, n), capacity=lambda t: capacity, ack_delay=delay)
    held = simulate(
        InflightController(streams=4, max_ack_delay=0.010).may_send, capacity=lambda t: capacity, ack_delay=delay,
    )
    assert pinned.rate(1.0, 2.0) < 0.6 * capacity
    assert held.rate(1.0, 2.0) >= 0.95 * capacity


@settings(max_examples=20, deadline=None)
@given(
    high=st.sampled_from([5.0, 10.0, 25.0]),
    low_fraction=st.floats(0.05, 0.5),
    late=st.floats(0.0, 0.008),
)
def test_target_recovers_after_the_estimate_dropped_and_the_link_frees(
    high: float, low_fraction: float, late: float,
) -> None:
    """Contention (less capacity, late acks) for a second, then the link is free again."""
    high_rate = high * GBPS
    low_rate = low_fraction * high_rate

    def capacity(t: float) -> float:
        return low_rate if 0.5 <= t < 1.5 else high_rate

    def ack_delay(t: float) -> float:
        return late if 0.5 <= t < 1.5 else 0.0

    ctl = InflightController(streams=4, max_ack_delay=0.010)
    result = simulate(
        ctl.may_send, capacity=capacity, ack_delay=ack_delay, duration=2.5,
        target_of=lambda e, now: ctl.target_bytes,
    )
    assert result.rate(1.0, 1.5) <= low_rate + 2 * MIB / 0.5  # the estimate really dropped
    assert result.rate(2.0, 2.5) >= 0.95 * high_rate  # and the window found the link again
    assert min(t for _, t in result.targets) >= 4 * MIB  # min_bytes


@settings(max_examples=10, deadline=None)
@given(gbps=st.sampled_from([1.0, 10.0, 25.0]), burst=st.sampled_from([0.0, 0.002, 0.005]))
def test_default_window_holds_the_link_with_bursty_or_slightly_late_acks(gbps: float, burst: float) -> None:
    capacity = gbps * GBPS
    ctl = InflightController(streams=4)
    result = simulate(
        ctl.may_send, capacity=lambda t: capacity, duration=1.5,
        ack_delay=lambda t: 0.0 if t < 0.2 else 0.002, ack_period=lambda t: burst,
    )
    assert result.rate(0.75, 1.5) >= 0.95 * capacity


def test_the_gain_cycles_through_a_probe_and_a_drain() -> None:
    ctl = InflightController(min_bytes=MIB, min_phase=0.001)
    est = DeliveryRateEstimator()
    now = 0.0
    for i in range(2000):  # 1 MiB every 0.1 ms, each acked 1 ms later: 10 GB/s-ish, 1 ms RTT
        est.on_send(i, MIB, now, app_limited=False)
        if i >= 10:
            est.on_ack(i - 10, now)
        now += 0.0001
    gains = set()
    targets = []
    for step in range(len(PROBE_CYCLE)):
        targets.append(ctl.update(est, now + step * 0.00105))
        gains.add(ctl.phase_gain)
    assert gains == set(PROBE_CYCLE)
    assert max(targets) / min(targets) == pytest.approx(1.25 / 0.75, rel=0.01)


_feed = st.lists(
    st.tuples(st.integers(1, 8 * MIB), st.floats(1e-5, 0.05), st.booleans()), min_size=1, max_size=80,
)


@settings(max_examples=100, deadline=None)
@given(feed=_feed, streams=st.integers(1, 16), chunk=st.sampled_from([64 * 1024, MIB, 4 * MIB]))
def test_target_is_never_below_the_floor_nor_above_the_ceiling(
    feed: list[tuple[int, float, bool]], streams: int, chunk: int,
) -> None:
    ctl = InflightController(streams=streams, chunk_bytes=chunk, max_bytes=128 * MIB)
    est = DeliveryRateEstimator()
    now = 0.0
    outstanding: list[int] = []
    for i, (nbytes, step, ack) in enumerate(feed):
        now += step
        if ack and outstanding:
            est.on_ack(outstanding.pop(0), now)
        else:
            est.on_send(i, nbytes, now, app_limited=False)
            outstanding.append(i)
        target = ctl.update(est, now)
        bandwidth, min_rtt = est.max_filter_bps, est.min_rtt
        floor = (ctl.floor_for(bandwidth, min_rtt) if bandwidth and min_rtt is not None else ctl.floor_bytes)
        assert 4 * MIB <= floor <= ctl.floor_bytes
        assert floor <= target <= 128 * MIB
        assert ctl.floor_bytes >= min(128 * MIB, 2 * streams * chunk)


def test_a_sender_that_never_runs_dry_keeps_its_minimum_rtt() -> None:
    """Twice the BDP in flight keeps about a BDP queued, so once the first RTT samples
    leave the estimator's 10 s window every sample has the sender's own queue in it.
    Without a drain now and then the minimum RTT, the window and the queue grew in steps
    every 10 s (20 ms path: 54 ms for a 4 MiB chunk's round trip, then 100 ms and more).
    With it the minimum stays the path's, and the link stays nearly full."""
    capacity = 1 * GBPS
    ctl = InflightController(streams=4, chunk_bytes=4 * MIB)
    est = DeliveryRateEstimator()
    rtts: list[tuple[float, float]] = []

    def target_of(e: DeliveryRateEstimator, now: float) -> int:
        if e.min_rtt is not None:
            rtts.append((now, e.min_rtt))
        return ctl.target_bytes

    result = simulate(ctl.may_send, capacity=lambda t: capacity, delay=0.010, chunk=4 * MIB, duration=45.0,
                      target_of=target_of, estimator=est)
    one_chunk = 0.020 + 4 * MIB / capacity  # a chunk's round trip with nothing ahead of it
    assert max(rtt for at, rtt in rtts if at >= 12.0) <= 1.25 * one_chunk
    assert ctl.probe_rtt_count >= 3  # one in every 8 to 10 s while the sender is busy
    assert result.rate(2.0, 45.0) >= 0.93 * capacity
    late = [t for at, t in result.targets if at >= 12.0]
    assert max(late) <= 0.7 * ctl.floor_bytes  # as on a path that was never queued (above)
