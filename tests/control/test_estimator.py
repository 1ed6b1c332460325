"""DeliveryRateEstimator on exact send/ack sequences with a fake clock."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.control import DeliveryRateEstimator, InflightTarget, Pacer

MIB = 1 << 20


def test_single_chunk_sample_is_bytes_over_rtt() -> None:
    est = DeliveryRateEstimator()
    est.on_send("a", MIB, 1.0, app_limited=False)
    assert est.bytes_in_flight == MIB
    sample = est.on_ack("a", 1.01)
    assert sample is not None
    assert sample.delivered_bytes == MIB
    assert sample.interval == pytest.approx(0.01)
    assert sample.rtt == pytest.approx(0.01)
    assert sample.rate_bps == pytest.approx(8 * MIB / 0.01)
    assert est.bytes_in_flight == 0
    assert est.min_rtt == pytest.approx(0.01)
    assert est.srtt == pytest.approx(0.01)
    assert est.bandwidth_bps == pytest.approx(8 * MIB / 0.01)


def test_pipelined_samples_measure_ack_spacing() -> None:
    est = DeliveryRateEstimator()
    # Four chunks sent back to back at t=0; acks every 1 ms after a 10 ms RTT.
    for i in range(4):
        est.on_send(i, MIB, 0.0, app_limited=False)
    samples = [est.on_ack(i, 0.010 + 0.001 * i) for i in range(4)]
    assert all(s is not None for s in samples)
    last = samples[-1]
    assert last is not None
    # Each chunk measures everything delivered since it was sent over the longest interval.
    assert last.delivered_bytes == 4 * MIB
    assert last.interval == pytest.approx(0.013)
    assert est.max_filter_bps == pytest.approx(8 * 4 * MIB / 0.013)


def test_unknown_and_duplicate_acks_return_none() -> None:
    est = DeliveryRateEstimator()
    assert est.on_ack("nope", 1.0) is None
    est.on_send("a", 100, 0.0, app_limited=False)
    assert est.on_ack("a", 0.1) is not None
    assert est.on_ack("a", 0.2) is None
    with pytest.raises(ValueError):
        est.on_send("b", 0, 0.3, app_limited=False)


def test_loss_forgets_bytes_in_flight() -> None:
    est = DeliveryRateEstimator()
    est.on_send("a", 100, 0.0, app_limited=False)
    est.on_send("b", 200, 0.0, app_limited=False)
    assert est.on_loss("a") is True
    assert est.on_loss("a") is False
    assert est.bytes_in_flight == 200
    assert est.forget_all() == 1
    assert est.bytes_in_flight == 0
    assert est.on_ack("b", 1.0) is None


def test_idle_time_before_a_flight_is_not_counted() -> None:
    est = DeliveryRateEstimator()
    est.on_send(1, MIB, 0.0, app_limited=False)
    est.on_ack(1, 0.01)
    # Ten seconds idle, then a new flight: its sample covers only its own RTT.
    est.on_send(2, MIB, 10.0, app_limited=False)
    sample = est.on_ack(2, 10.01)
    assert sample is not None
    assert sample.interval == pytest.approx(0.01)


def test_acks_out_of_send_order_cannot_make_a_rate_above_the_send_rate() -> None:
    # Two streams. Stream A's 4 MiB chunk a0 is sent at 0 and held up; stream B sends
    # 1 MiB chunks every 10 ms, each acked 20 ms later, and a0's ack comes between b2's
    # and b3's.
    est = DeliveryRateEstimator()
    est.on_send("a0", 4 * MIB, 0.000, app_limited=False)
    est.on_send("b0", MIB, 0.010, app_limited=False)
    est.on_send("b1", MIB, 0.020, app_limited=False)
    est.on_ack("b0", 0.030)
    est.on_send("b2", MIB, 0.030, app_limited=False)
    est.on_ack("b1", 0.040)
    est.on_send("b3", MIB, 0.040, app_limited=False)
    est.on_ack("b2", 0.050)
    est.on_ack("a0", 0.060)
    sample = est.on_ack("b3", 0.0601)
    assert sample is not None
    # b3 counts b2, a0 and itself: 6 MiB acked within 20.1 ms of b1's ack. From b1's send
    # to b3's the sender sent 2 MiB in 20 ms (100 MiB/s): the sample is that, not 6 MiB
    # in 20.1 ms (the rule for acks in send order, which reads 3x as much).
    assert sample.delivered_bytes == 6 * MIB
    assert sample.interval == pytest.approx(0.060)
    assert sample.rate_bps == pytest.approx(8 * 100 * MIB)


@st.composite
def _constant_rate_flights(draw: st.DrawFn) -> tuple[list[tuple[float, int, int]], float]:
    """Chunks of one size sent at a constant rate, each acked any time after its send, in
    any order: ``[(time, 0 send / 1 ack, chunk)]`` in time order, and the send rate."""
    n = draw(st.integers(2, 30))
    gap = draw(st.floats(1e-4, 0.01))
    delays = draw(st.lists(st.floats(1e-4, 0.1), min_size=n, max_size=n))
    events = [(0.0, 0, 0), (1e-5, 1, 0)]  # the first chunk acked at once: the flight's start
    events.append((gap, 0, n))  # a chunk acked last of all keeps the flight going
    events.append((gap + 1.0, 1, n))
    for k in range(1, n):
        events.append((gap * (k + 1), 0, k))
        events.append((gap * (k + 1) + delays[k], 1, k))
    return sorted(events), MIB / gap


@settings(max_examples=300, deadline=None)
@given(_constant_rate_flights())
def test_no_ack_order_makes_a_sample_above_a_constant_send_rate(
    flights: tuple[list[tuple[float, int, int]], float],
) -> None:
    events, send_rate = flights
    est = DeliveryRateEstimator()
    for t, kind, k in events:
        if kind == 0:
            est.on_send(k, MIB, t, app_limited=False)
            continue
        sample = est.on_ack(k, t)
        assert sample is not None
        assert sample.interval >= sample.rtt - 1e-12
        if k != 0:
            assert sample.delivered_bytes / sample.interval <= send_rate * (1 + 1e-9)
    assert est.bytes_in_flight == 0


def test_app_limited_samples_do_not_lower_the_max_filter() -> None:
    est = DeliveryRateEstimator(window_rounds=10)
    est.on_send(1, MIB, 0.0, app_limited=False)
    est.on_ack(1, 0.01)
    peak = est.max_filter_bps
    assert peak is not None
    # The sender trickles: each chunk sent alone with nothing queued behind it.
    t = 1.0
    for k in range(20):
        est.on_send(("slow", k), 1000, t, app_limited=True)
        sample = est.on_ack(("slow", k), t + 0.01)
        assert sample is not None and sample.app_limited
        t += 0.1
    assert est.max_filter_bps == pytest.approx(peak)
    # Goodput ignores app-limited samples, so the published estimate stays at capacity.
    assert est.goodput_bps is None
    assert est.bandwidth_bps == pytest.approx(peak)


def test_a_link_slower_than_every_transfer_is_measured_after_a_token_bucket_burst() -> None:
    """Transfers of 5 x 52 KB over a 1 Mbit/s link whose token bucket lets its first 64 KiB
    through at once (tbf): the sender hands each whole transfer to the kernel and runs dry,
    so it is app-limited by its own account; but its chunks wait seconds in the queue, so
    their samples measure the link and the burst's 75 Mbit/s does not stand for good."""
    est = DeliveryRateEstimator()
    rate, chunk, base = 1e6, 52_000, 0.005
    t, free = 0.0, 0.0  # when the link is next free
    for transfer in range(12):
        for i in range(5):
            est.on_send((transfer, i), chunk, t, app_limited=i == 4)
        acks = []
        for i in range(5):
            if transfer == 0 and i == 0:
                served = t  # in the bucket's burst
            else:
                served = max(free, t) + chunk * 8 / rate
                free = served
            acks.append(served + base)
        for i, at in enumerate(acks):
            sample = est.on_ack((transfer, i), at)
            assert sample is not None
            if i >= 2:  # it waited behind the ones before it (two chunks' worth: the
                # minimum RTT, once the burst's has expired, is one chunk's serialization)
                assert not sample.app_limited
        t = acks[-1]
    assert est.bandwidth_bps is not None and est.bandwidth_bps < 2 * rate


def test_a_chunk_that_did_not_queue_keeps_its_app_limited_mark() -> None:
    est = DeliveryRateEstimator()
    est.on_send(0, MIB, 0.0, app_limited=False)
    est.on_ack(0, 0.002)  # min RTT 2 ms
    est.on_send(1, 1000, 1.0, app_limited=True)
    slow = est.on_ack(1, 1.0 + 0.002 + 0.0099)  # 9.9 ms more: not yet a backlog
    assert slow is not None and slow.app_limited
    est.on_send(2, 1000, 2.0, app_limited=True)
    queued = est.on_ack(2, 2.0 + 0.002 + 0.0101)
    assert queued is not None and not queued.app_limited


def test_app_limited_mark_clears_once_that_data_is_delivered() -> None:
    est = DeliveryRateEstimator()
    est.on_send(1, 100, 0.0, app_limited=True)
    assert est.app_limited
    est.on_send(2, 100, 0.001, app_limited=False)
    s1 = est.on_ack(1, 0.01)
    assert s1 is not None and s1.app_limited
    assert est.app_limited  # chunk 2 was in flight when the sender ran dry
    s2 = est.on_ack(2, 0.011)
    assert s2 is not None and s2.app_limited
    assert not est.app_limited
    est.on_send(3, 100, 0.02, app_limited=False)
    s3 = est.on_ack(3, 0.03)
    assert s3 is not None and not s3.app_limited


def test_larger_app_limited_sample_raises_the_max_filter() -> None:
    est = DeliveryRateEstimator()
    est.on_send(1, 1000, 0.0, app_limited=False)
    est.on_ack(1, 0.01)
    est.on_send(2, MIB, 0.02, app_limited=True)
    est.on_ack(2, 0.03)
    assert est.max_filter_bps == pytest.approx(8 * MIB / 0.01)


def test_max_filter_forgets_after_window_rounds() -> None:
    est = DeliveryRateEstimator(window_rounds=3, goodput_window=100.0)
    t = 0.0
    est.on_send(0, 10 * MIB, t, app_limited=False)
    est.on_ack(0, t + 0.01)
    high = est.max_filter_bps
    t = 1.0
    for k in range(1, 3):
        est.on_send(k, MIB, t, app_limited=False)
        est.on_ack(k, t + 0.01)
        t += 1.0
        assert est.max_filter_bps == pytest.approx(high)
    est.on_send(9, MIB, t, app_limited=False)
    est.on_ack(9, t + 0.01)
    assert est.max_filter_bps == pytest.approx(8 * MIB / 0.01)


def test_min_rtt_is_windowed_and_srtt_smooths() -> None:
    est = DeliveryRateEstimator(min_rtt_window=1.0)
    est.on_send(0, 100, 0.0, app_limited=False)
    est.on_ack(0, 0.010)
    assert est.min_rtt == pytest.approx(0.010)
    # The path lengthens to 30 ms.
    t = 0.1
    for k in range(1, 30):
        est.on_send(k, 100, t, app_limited=False)
        est.on_ack(k, t + 0.030)
        t += 0.1
    assert est.min_rtt == pytest.approx(0.030)
    assert est.srtt is not None and est.srtt == pytest.approx(0.030, rel=0.03)
    # A shorter RTT is adopted at once.
    est.on_send("short", 100, t, app_limited=False)
    est.on_ack("short", t + 0.005)
    assert est.min_rtt == pytest.approx(0.005)


def test_rounds_count_flights() -> None:
    est = DeliveryRateEstimator()
    for i in range(3):
        est.on_send(i, 100, 0.0, app_limited=False)
    est.on_ack(0, 0.01)
    est.on_ack(1, 0.011)
    est.on_ack(2, 0.012)
    assert est.round_count == 1
    est.on_send(3, 100, 0.012, app_limited=False)
    est.on_ack(3, 0.022)
    assert est.round_count == 2


def test_snapshot_is_frozen_and_consistent() -> None:
    est = DeliveryRateEstimator()
    est.on_send(1, 500, 0.0, app_limited=False)
    snap = est.snapshot()
    assert snap.bytes_in_flight == 500 and snap.chunks_in_flight == 1
    assert snap.bandwidth_bps is None
    with pytest.raises(AttributeError):
        snap.bytes_in_flight = 0  # type: ignore[misc]


def _simulate(
    rate_at: Callable[[float], float],
    *,
    duration: float,
    rtt: float = 0.010,
    chunk: int = MIB,
    target: InflightTarget | None = None,
    probe_times: tuple[float, ...] = (),
) -> dict[float, float | None]:
    """A sender keeping a window of chunks on a FIFO bottleneck; returns estimates at probes."""
    est = DeliveryRateEstimator()
    target = target or InflightTarget(gain=2.0, min_bytes=4 * MIB)
    acks: list[tuple[float, int]] = []
    link_free = 0.0
    keys = itertools.count()
    probes = sorted(probe_times)
    seen: dict[float, float | None] = {}
    now = 0.0

    def send_what_fits() -> None:
        nonlocal link_free
        while target.may_send(est, chunk):
            key = next(keys)
            est.on_send(key, chunk, now, app_limited=False)
            start = max(now, link_free)
            link_free = start + chunk * 8 / rate_at(start)
            heapq.heappush(acks, (link_free + rtt, key))

    send_what_fits()
    while acks and now < duration:
        now, key = heapq.heappop(acks)
        while probes and probes[0] <= now:
            seen[probes.pop(0)] = est.bandwidth_bps
        est.on_ack(key, now)
        send_what_fits()
    return seen


def test_steady_link_estimate_matches_rate() -> None:
    seen = _simulate(lambda t: 10e9, duration=1.5, probe_times=(1.0, 1.5))
    for value in seen.values():
        assert value == pytest.approx(10e9, rel=0.05)


def test_step_down_is_tracked_within_one_second() -> None:
    def rate(t: float) -> float:
        return 10e9 if t < 3.0 else 2.5e9

    seen = _simulate(rate, duration=4.1, probe_times=(2.9, 4.0))
    assert seen[2.9] == pytest.approx(10e9, rel=0.05)
    assert seen[4.0] == pytest.approx(2.5e9, rel=0.15)


def test_step_up_is_tracked() -> None:
    def rate(t: float) -> float:
        return 2.5e9 if t < 1.0 else 10e9

    seen = _simulate(rate, duration=2.1, probe_times=(0.9, 2.0))
    assert seen[0.9] == pytest.approx(2.5e9, rel=0.05)
    assert seen[2.0] == pytest.approx(10e9, rel=0.10)


def test_goodput_window_expires_with_advance() -> None:
    est = DeliveryRateEstimator(goodput_window=0.5)
    est.on_send(1, MIB, 0.0, app_limited=False)
    est.on_ack(1, 0.01)
    assert est.goodput_bps is not None
    est.advance(1.0)
    assert est.goodput_bps is None
    assert est.bandwidth_bps == est.max_filter_bps


def test_inflight_target_is_clamped_bdp() -> None:
    target = InflightTarget(gain=1.5, min_bytes=MIB, max_bytes=64 * MIB, initial_bytes=8 * MIB)
    assert target.bytes_for(None, None) == 8 * MIB
    assert target.bytes_for(10e9, 0.010) == int(1.5 * 10e9 / 8 * 0.010)
    assert target.bytes_for(100e9, 0.100) == 64 * MIB
    assert target.bytes_for(1e6, 0.001) == MIB
    with pytest.raises(ValueError):
        InflightTarget(gain=3.0)


def test_inflight_target_always_lets_an_empty_flight_send() -> None:
    est = DeliveryRateEstimator()
    target = InflightTarget(min_bytes=MIB, max_bytes=MIB, initial_bytes=MIB)
    assert target.may_send(est, 10 * MIB)
    est.on_send(1, 10 * MIB, 0.0, app_limited=False)
    assert not target.may_send(est, 1)


def test_pacer_spaces_releases_at_rate() -> None:
    pacer = Pacer(8e6, burst_bytes=1000)  # 1 MB/s
    now = 0.0
    assert pacer.next_send_time(1000, now) == now
    pacer.on_send(1000, now)
    assert pacer.next_send_time(1000, now) == pytest.approx(0.001)
    pacer.want(1000)
    assert pacer.get_timer() == pytest.approx(0.001)
    assert not pacer.handle_timer(0.0005)
    assert pacer.handle_timer(0.001)
    pacer.on_send(1000, 0.001)
    pacer.set_rate(None, 0.001)
    assert pacer.next_send_time(10**9, 0.001) == 0.001


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan, math.inf])
def test_a_pacer_refuses_a_rate_that_is_not_a_positive_finite_number(rate: float) -> None:
    with pytest.raises(ValueError, match="rate_bps"):
        Pacer(rate)
    with pytest.raises(ValueError, match="rate_bps"):
        Pacer(8e6).set_rate(rate, now=0.0)


@pytest.mark.parametrize("ack_at", [1.0, 0.5])
def test_an_ack_at_or_before_its_sends_clock_reading_counts_but_gives_no_sample(ack_at: float) -> None:
    """A send and its ack stamped alike (a coarse clock) made an 8.4 Tbit/s sample that
    became the estimate, and a minimum RTT of 0; an ack "before" its send the same."""
    est = DeliveryRateEstimator()
    est.on_send("a", MIB, 1.0, app_limited=False)
    est.on_send("b", MIB, 1.0, app_limited=False)
    assert est.on_ack("a", ack_at) is None
    assert est.bytes_in_flight == MIB and est.delivered_bytes == MIB  # the delivery counts
    assert est.bandwidth_bps is None and est.min_rtt is None and est.srtt is None
    assert est.snapshot().samples == 0
    sample = est.on_ack("b", 1.01)  # a later ack is measured as before
    assert sample is not None and sample.rtt == pytest.approx(0.01)
    assert est.min_rtt == pytest.approx(0.01)
    assert est.bandwidth_bps is not None and est.bandwidth_bps < 1e12


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_now_that_is_not_a_finite_number_is_refused_before_anything_changes(bad: float) -> None:
    """on_send(now=nan) was taken, and a later ack raised a ValueError from deep inside
    (cannot convert float NaN to integer)."""
    est = DeliveryRateEstimator()
    with pytest.raises(ValueError, match="now must be a finite number"):
        est.on_send("a", MIB, bad, app_limited=False)
    assert est.chunks_in_flight == 0 and est.bytes_in_flight == 0
    est.on_send("a", MIB, 1.0, app_limited=False)
    with pytest.raises(ValueError, match="now must be a finite number"):
        est.on_ack("a", bad)
    assert est.chunks_in_flight == 1
    with pytest.raises(ValueError, match="now must be a finite number"):
        est.advance(bad)
    assert est.on_ack("a", 1.01) is not None
