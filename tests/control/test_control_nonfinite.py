"""The in-flight window, its fixed target, the pacer and the stream controller refuse a
``now``, rate or RTT that is not a finite number (ValueError, as the estimator does)
before anything changes, and finite extremes never overflow."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.control import (
    DeliveryRateEstimator,
    InflightController,
    InflightTarget,
    Pacer,
    StreamController,
    StreamSample,
)

MIB = 1 << 20
NO_NUMBER = (math.nan, math.inf, -math.inf)


def primed() -> tuple[DeliveryRateEstimator, float]:
    """An estimator with a bandwidth and an RTT, and the time of its last ack."""
    e = DeliveryRateEstimator()
    t = 0.0
    for i in range(50):
        e.on_send(i, MIB, t, app_limited=False)
        t += 0.001
        e.on_ack(i, t)
    return e, t


def state(c: InflightController) -> tuple[Any, ...]:
    return (c.target_bytes, c.phase_gain, c.probing_rtt, c.window_limited, c.probe_rtt_count)


@pytest.mark.parametrize("now", NO_NUMBER)
def test_inflight_update_refuses_a_now_that_is_no_number(now: float) -> None:
    # Infinity raised OverflowError from int(); NaN was taken in.
    e, t = primed()
    c = InflightController()
    c.update(e, t)
    before = state(c)
    with pytest.raises(ValueError, match="now must be a finite number"):
        c.update(e, now)
    with pytest.raises(ValueError, match="now must be a finite number"):
        c.may_send(e, MIB, now)
    assert state(c) == before


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.floats(min_value=0.0, max_value=30.0), st.sampled_from(NO_NUMBER)),
                max_size=60))
def test_inflight_refused_readings_leave_it_as_if_never_made(offsets: list[float]) -> None:
    e, t = primed()
    fed, twin = InflightController(), InflightController()
    for dt in offsets:
        if math.isfinite(dt):
            assert fed.update(e, t + dt) == twin.update(e, t + dt)
        else:
            with pytest.raises(ValueError):
                fed.update(e, dt)
        assert state(fed) == state(twin)


@pytest.mark.parametrize("args", [(math.nan, 0.01), (1e9, math.nan), (math.inf, 0.01), (1e9, math.inf),
                                  (-math.inf, 0.01), (None, math.nan)])
def test_fixed_target_refuses_a_rate_or_rtt_that_is_no_number(args: tuple[float | None, float]) -> None:
    with pytest.raises(ValueError, match="must be a finite number"):
        InflightTarget().bytes_for(*args)


@pytest.mark.parametrize("args", [(math.nan, 0.01), (1e9, math.nan), (math.inf, 0.01), (1e9, -math.inf)])
def test_floor_refuses_a_rate_or_rtt_that_is_no_number(args: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="must be a finite number"):
        InflightController().floor_for(*args)


def test_finite_extremes_are_clamped_not_overflowed() -> None:
    target = InflightTarget()
    assert target.bytes_for(1.7e308, 0.0) == target.min_bytes  # gain x 1.7e308 is infinite
    assert target.bytes_for(1e300, 1e300) == target.max_bytes
    assert target.bytes_for(None, None) == target.initial_bytes
    assert target.bytes_for(-1.0, 0.01) == target.initial_bytes
    c = InflightController()
    assert c.floor_for(1e308, 1e308) == c.floor_bytes
    assert c.floor_for(-1e308, 1e308) == 4 * MIB  # min_bytes


@pytest.mark.parametrize("kw", [{"gain": math.nan}, {"gain": math.inf}, {"min_phase": math.nan},
                                {"min_phase": math.inf}, {"max_ack_delay": math.nan},
                                {"max_ack_delay": -1.0}, {"cycle": (1.25, math.nan)},
                                {"cycle": (math.nan, 1.25, 0.5)}])
def test_inflight_constructor_refuses_a_setting_that_is_no_number(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        InflightController(**kw)


@pytest.mark.parametrize("now", NO_NUMBER)
def test_pacer_refuses_a_now_that_is_no_number(now: float) -> None:
    # A NaN taken as the bucket's first time stopped its refills for good.
    p = Pacer(8e6, burst_bytes=1000)  # 1 MB/s
    p.on_send(1000, 0.0)
    for call in (lambda: p.on_send(1, now), lambda: p.next_send_time(1000, now),
                 lambda: p.handle_timer(now), lambda: p.set_rate(8e6, now)):
        with pytest.raises(ValueError, match="now must be a finite number"):
            call()
    assert p.next_send_time(1000, 0.0) == pytest.approx(0.001)
    assert p.next_send_time(1000, 0.001) == 0.001  # refilled
    fresh = Pacer(8e6, burst_bytes=1000)
    with pytest.raises(ValueError, match="now must be a finite number"):
        fresh.on_send(1000, now)
    fresh.on_send(1000, 0.0)
    assert fresh.next_send_time(1000, 0.001) == 0.001


def limited(n: int) -> list[StreamSample]:
    return [StreamSample(delivery_rate_bps=1e9, window_limited=True) for _ in range(n)]


@pytest.mark.parametrize("now", NO_NUMBER)
def test_stream_controller_refuses_a_now_that_is_no_number(now: float) -> None:
    # now=inf put the next evaluation at infinity: every later one held.
    s = StreamController(max_streams=4)
    with pytest.raises(ValueError, match="now must be a finite number"):
        s.evaluate(limited(1), now)
    assert s.get_timer() is None
    assert s.evaluate(limited(1), 10.0).verdict.value == "grow"


@pytest.mark.parametrize("rate", NO_NUMBER)
def test_stream_controller_refuses_a_rate_that_is_no_number(rate: float) -> None:
    s = StreamController(max_streams=4)
    with pytest.raises(ValueError, match="delivery_rate_bps"):
        s.evaluate([StreamSample(delivery_rate_bps=rate, window_limited=True)], 1.0)
    assert s.get_timer() is None


@pytest.mark.parametrize("interval", [math.nan, math.inf, 0.0])
def test_stream_controller_refuses_an_interval_that_is_no_number(interval: float) -> None:
    with pytest.raises(ValueError, match="interval"):
        StreamController(interval=interval)


@pytest.mark.parametrize("rate", [-1.0, -1e9, -math.inf])
def test_stream_controller_refuses_a_negative_rate(rate: float) -> None:
    # A negative rate read as a grow that lowered the total: a revert for no reason.
    s = StreamController(max_streams=4)
    with pytest.raises(ValueError, match="delivery_rate_bps must be a finite number >= 0"):
        s.evaluate([StreamSample(delivery_rate_bps=rate, window_limited=True)], 1.0)
    assert s.get_timer() is None


@pytest.mark.parametrize("kw", [{"min_gain": math.nan}, {"min_gain": -0.1}, {"min_gain": math.inf},
                                {"shrink_headroom": math.nan}, {"shrink_headroom": -1.0},
                                {"backoff": math.nan}, {"backoff": math.inf}, {"backoff": -5.0},
                                {"limited_fraction": math.nan}, {"limited_fraction": 1.5},
                                {"limited_fraction": -0.5}, {"shrink_patience": 0},
                                {"shrink_patience": 2.5}, {"shrink_patience": True}])
def test_stream_controller_refuses_a_setting_out_of_range(kw: dict[str, Any]) -> None:
    # A NaN backoff put the ceiling's end at NaN: never passed, so no grow past a revert
    # ever again; with a NaN min_gain no grow was ever judged a failure.
    with pytest.raises(ValueError, match=next(iter(kw))):
        StreamController(**kw)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.floats(min_value=0.0, max_value=1e4), st.sampled_from(NO_NUMBER)),
                          st.booleans(), st.floats(min_value=0.0, max_value=1e12)), max_size=40))
def test_stream_controller_refused_evaluations_leave_it_as_if_never_made(
    steps: list[tuple[float, bool, float]]
) -> None:
    fed, twin = StreamController(max_streams=8), StreamController(max_streams=8)
    for now, window_limited, rate in steps:
        samples = [StreamSample(delivery_rate_bps=rate, window_limited=window_limited)] * fed.streams
        if math.isfinite(now):
            assert fed.evaluate(samples, now) == twin.evaluate(samples, now)
        else:
            with pytest.raises(ValueError):
                fed.evaluate(samples, now)
        assert (fed.streams, fed.get_timer()) == (twin.streams, twin.get_timer())
