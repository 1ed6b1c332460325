"""A clock that steps back (fake time): the window must not grow, nor a phase or a drain last longer."""

from __future__ import annotations

from kvwire.control import DeliveryRateEstimator, InflightController
from kvwire.control.pacing import PROBE_CYCLE, PROBE_RTT_AFTER, PROBE_RTT_TIME
from tests.control.linksim import MIB

STEP = 5.0  # seconds the clock steps back


def _one_at_a_time(est: DeliveryRateEstimator, now: float, count: int) -> float:
    """1 MiB chunks, one at a time over a 1 Gbit/s, 1 ms path; returns the time after."""
    for i in range(count):
        est.on_send(("steady", i), MIB, now, app_limited=False)
        now += MIB * 8 / 1e9 + 0.001
        est.on_ack(("steady", i), now)
    return now


def test_a_backward_step_is_not_taken_for_an_ack_burst() -> None:
    """Measured from an epoch start in the clock's future, nothing was expected and every
    acked byte counted as aggregation, up to its 100 ms cap: the window went from 5.6 to
    16.6 MB."""
    est = DeliveryRateEstimator()
    ctl = InflightController(streams=4, chunk_bytes=MIB)
    now = _one_at_a_time(est, 10.0, 20)
    extra = est.extra_acked_bytes
    target = ctl.update(est, now)
    est.on_send("back", MIB, now - STEP, app_limited=False)
    est.on_ack("back", now - STEP + 0.01)
    assert est.extra_acked_bytes <= max(extra, MIB)  # one chunk: an epoch's first ack
    assert ctl.update(est, now - STEP + 0.01) == target


def _drain_due(est: DeliveryRateEstimator, end: float) -> None:
    """A 10 ms path whose round trips took 20 ms since 0.1 s: a drain is due at ``end``."""
    key, now = 0, 0.0
    for rtt, until, in_flight in ((0.010, 0.1, 8), (0.020, end, 16)):
        while now < until:
            est.on_send(key, MIB, now, app_limited=False)
            if key >= in_flight:
                est.on_ack(key - in_flight, now)
            key += 1
            now += rtt / in_flight


def test_a_backward_step_does_not_lengthen_a_drain() -> None:
    est = DeliveryRateEstimator()
    ctl = InflightController(streams=1, chunk_bytes=MIB, min_bytes=MIB)
    start = PROBE_RTT_AFTER + 1.0
    _drain_due(est, start)
    ctl.update(est, start)
    assert ctl.probing_rtt
    ctl.update(est, start - STEP)  # the clock stepped back 5 s
    assert ctl.probing_rtt
    # Before: the drain lasted until the clock came back to where it would have ended.
    ctl.update(est, start - STEP + PROBE_RTT_TIME + 0.1)
    assert not ctl.probing_rtt
    assert ctl.probe_rtt_count == 1


def test_a_backward_step_does_not_hold_the_gain_phase() -> None:
    est = DeliveryRateEstimator()
    ctl = InflightController(streams=1, chunk_bytes=MIB, min_bytes=MIB, min_phase=0.001)
    now = _one_at_a_time(est, 10.0, 20)
    assert est.min_rtt is not None
    phase = est.min_rtt
    ctl.update(est, now)  # the cycle starts
    now -= STEP
    gains = []
    for _ in PROBE_CYCLE:
        now += 1.01 * phase
        ctl.update(est, now)
        gains.append(ctl.phase_gain)
    # Each phase after the step moves the cycle on, as one before it would have. Before,
    # the phase stayed put until the clock came back: every gain the same.
    assert sorted(gains) == sorted(PROBE_CYCLE)
