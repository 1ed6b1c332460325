"""StreamController decisions on exact per-stream samples."""

from __future__ import annotations

import pytest

from kvwire.control import (
    StreamController,
    StreamSample,
    StreamVerdict,
    window_limited_from_counters,
)


def limited(rate: float, n: int) -> list[StreamSample]:
    return [StreamSample(delivery_rate_bps=rate, window_limited=True) for _ in range(n)]


def free(rate: float, n: int) -> list[StreamSample]:
    return [StreamSample(delivery_rate_bps=rate, window_limited=False) for _ in range(n)]


def test_grows_while_window_limited_and_total_rises() -> None:
    ctl = StreamController(max_streams=4, interval=0.25)
    t = 0.0
    # Each stream is capped at 1 Gbit/s by its window; the link carries 10.
    for expected in (2, 3, 4):
        d = ctl.evaluate(limited(1e9, ctl.streams), t)
        assert d.verdict is StreamVerdict.GROW
        assert d.streams == expected
        t += 0.25
    d = ctl.evaluate(limited(1e9, 4), t)
    assert d.verdict is StreamVerdict.HOLD and d.streams == 4


def test_evaluations_before_the_timer_hold() -> None:
    ctl = StreamController(interval=0.25)
    assert ctl.get_timer() is None
    d = ctl.evaluate(limited(1e9, 1), 0.0)
    assert d.verdict is StreamVerdict.GROW
    assert ctl.get_timer() == pytest.approx(0.25)
    d = ctl.evaluate(limited(0.5e9, 2), 0.1)
    assert d.verdict is StreamVerdict.HOLD and d.streams == 2


def test_an_evaluation_a_little_early_still_counts() -> None:
    """A caller sleeping one interval between calls wakes a fraction of a millisecond
    early about as often as late; those calls must not be dropped."""
    ctl = StreamController(max_streams=4, interval=0.25)
    t = 0.0
    for expected in (2, 3, 4):
        d = ctl.evaluate(limited(1e9, ctl.streams), t)
        assert d.verdict is StreamVerdict.GROW and d.streams == expected
        t += 0.25 - 0.0005


def test_reverts_a_stream_that_did_not_raise_the_total() -> None:
    ctl = StreamController(max_streams=8, interval=0.25, backoff=5.0)
    t = 0.0
    ctl.evaluate(limited(1e9, 1), t)  # -> 2 streams
    t += 0.25
    ctl.evaluate(limited(1e9, 2), t)  # total 2 G, up from 1 G -> 3
    t += 0.25
    # The third stream shares a 2 Gbit/s bottleneck: total stays 2 G.
    d = ctl.evaluate(limited(2e9 / 3, 3), t)
    assert d.verdict is StreamVerdict.REVERT and d.streams == 2
    # Within the backoff, window-limited samples do not grow past the ceiling.
    t += 0.25
    d = ctl.evaluate(limited(1e9, 2), t)
    assert d.verdict is StreamVerdict.HOLD and d.streams == 2
    # After the backoff the controller probes again.
    t += 5.0
    d = ctl.evaluate(limited(1e9, 2), t)
    assert d.verdict is StreamVerdict.GROW and d.streams == 3


def test_shrinks_when_link_limited_and_fewer_streams_suffice() -> None:
    ctl = StreamController(max_streams=8, initial_streams=1, interval=0.1, shrink_patience=3)
    t = 0.0
    for _ in range(3):
        ctl.evaluate(limited(2e9, ctl.streams), t)
        t += 0.1
    assert ctl.streams == 4
    # The last grow was judged at the next evaluation; rate rose, so we hold at 4.
    # Now the link drops to 2 Gbit/s total: no stream is window-limited.
    verdicts = []
    for _ in range(6):
        d = ctl.evaluate(free(0.5e9, ctl.streams), t)
        verdicts.append(d.verdict)
        t += 0.1
    assert StreamVerdict.SHRINK in verdicts
    assert ctl.streams < 4


def test_app_limited_periods_hold() -> None:
    ctl = StreamController(interval=0.1)
    d = ctl.evaluate(limited(1e9, 1), 0.0, app_limited=True)
    assert d.verdict is StreamVerdict.HOLD and d.streams == 1


def test_never_below_min_or_above_max() -> None:
    ctl = StreamController(min_streams=2, initial_streams=2, max_streams=3, interval=0.1)
    t = 0.0
    for _ in range(5):
        ctl.evaluate(limited(1e9 * ctl.streams, ctl.streams), t)
        t += 0.1
        assert 2 <= ctl.streams <= 3
    for _ in range(20):
        ctl.evaluate(free(1e6, ctl.streams), t)
        t += 0.1
        assert ctl.streams >= 2


def test_a_lowered_limit_brings_the_count_down_and_caps_every_later_grow() -> None:
    """Streams that can no longer exist (a session's slots given up): the count comes down
    to what is left at once, and window-limited samples grow it no further."""
    ctl = StreamController(max_streams=4, interval=0.1)
    t = 0.0
    for _ in range(2):
        ctl.evaluate(limited(1e9, ctl.streams), t)
        t += 0.1
    assert ctl.streams == 3
    ctl.limit(2)
    assert ctl.streams == 2 and ctl.max_streams == 2
    for _ in range(10):
        d = ctl.evaluate(limited(1e9, ctl.streams), t)
        t += 0.1
        assert d.streams == 2 and d.verdict is StreamVerdict.HOLD  # (no verdict on the grow cut short)
    ctl.limit(3)  # a higher limit changes nothing
    assert ctl.max_streams == 2
    low = StreamController(min_streams=2, initial_streams=2, max_streams=3)
    low.limit(1)
    assert low.streams == 1
    with pytest.raises(ValueError):
        low.limit(0)


def test_window_limited_from_counters() -> None:
    assert window_limited_from_counters(busy_us=1000, rwnd_limited_us=0, sndbuf_limited_us=800)
    assert not window_limited_from_counters(
        busy_us=1000, rwnd_limited_us=100, sndbuf_limited_us=100
    )
    assert not window_limited_from_counters(busy_us=None, rwnd_limited_us=5, sndbuf_limited_us=5)
    assert not window_limited_from_counters(busy_us=0, rwnd_limited_us=0, sndbuf_limited_us=0)
