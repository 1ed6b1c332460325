"""StreamSampler: every open stream's running totals, read once a period, into the
samples StreamController judges; fake time throughout."""

from __future__ import annotations

import pytest

from kvwire.control import StreamController, StreamVerdict
from kvwire.control.streams import StreamReading, StreamSampler

GB = 1e9 / 8  # bytes in one gigabit


def acked(**per_stream: float) -> dict[int, StreamReading]:
    """Readings of streams s0, s1, ... with these byte counts and no TCP_INFO."""
    return {int(k[1:]): StreamReading(acked_bytes=round(v)) for k, v in per_stream.items()}


def rates(samples: list) -> list[float]:
    return [s.delivery_rate_bps for s in samples]


def test_a_stream_put_in_use_by_a_grow_is_judged_on_its_bytes_since_the_grow() -> None:
    """The stream a grow puts in use was sampled from the moment it first joined the
    sampled set, a period after the grow: its first sample read 0 bit/s and the grow was
    always reverted.  Its baseline is now renewed each period in use or not, so its first
    sample counts what it carried since the grow."""
    sampler = StreamSampler()
    assert sampler.sample(acked(s0=0, s1=0), [0], 0.0) == []  # the baselines
    assert rates(sampler.sample(acked(s0=GB / 4, s1=0), [0], 0.25)) == [pytest.approx(1e9)]
    sampler.use([0, 1])  # the controller grew to two streams at 0.25
    got = rates(sampler.sample(acked(s0=GB / 2, s1=GB / 4), [0, 1], 0.5))
    assert got == [pytest.approx(1e9), pytest.approx(1e9)]


def test_a_stream_out_of_use_keeps_a_current_baseline() -> None:
    """A stream taken out of use (a revert) still has bytes acknowledged (those in
    flight then); its baseline was left where it was when it was last in use, so a later
    grow judged it on an old count.  A grow counts only what came after it."""
    sampler = StreamSampler()
    sampler.sample(acked(s0=0, s1=0), [0, 1], 0.0)
    sampler.sample(acked(s0=GB / 4, s1=GB / 4), [0, 1], 0.25)
    sampler.use([0])  # reverted at 0.25
    assert rates(sampler.sample(acked(s0=GB / 2, s1=GB / 2), [0], 0.5)) == [pytest.approx(1e9)]
    for i in range(3, 40):  # out of use for a while; one in-flight ack more each period
        sampler.sample(acked(s0=i * GB / 4, s1=GB / 2 + i), [0], i * 0.25)
    sampler.use([0, 1])  # grown again at 39 * 0.25, the stream's count is then GB/2 + 39
    got = rates(sampler.sample(acked(s0=40 * GB / 4, s1=GB / 2 + 39 + GB / 8), [0, 1], 10.0))
    assert got == [pytest.approx(1e9), pytest.approx(0.5e9)]


def test_a_rate_is_over_the_time_that_passed() -> None:
    """A rate was the bytes over the nominal period (0.25 s): a caller waking 0.4 s late
    read about three times the real rate, and the controller kept it as the best rate one
    stream had shown.  It is over the time since the baseline."""
    sampler = StreamSampler()
    sampler.sample(acked(s0=0), [0], 10.0)
    assert rates(sampler.sample(acked(s0=0.65 * GB), [0], 10.65)) == [pytest.approx(1e9)]
    assert rates(sampler.sample(acked(s0=0.65 * GB + GB / 10), [0], 10.75)) == [pytest.approx(1e9)]


@pytest.mark.parametrize("later", [0.0, -0.1])
def test_no_time_passed_gives_no_sample_and_keeps_the_baseline(later: float) -> None:
    sampler = StreamSampler()
    sampler.sample(acked(s0=0, s1=0), [0], 1.0)
    assert sampler.sample(acked(s0=100, s1=0), [0], 1.0 + later) == []
    sampler.use([0, 1])
    assert rates(sampler.sample(acked(s0=GB / 4, s1=GB / 4), [0, 1], 1.25)) == [
        pytest.approx(1e9), pytest.approx(1e9)]


def test_a_stream_that_came_into_use_during_the_period_is_not_judged_on_it() -> None:
    """Stream 0 closed mid-period and stream 2 took its place among the streams in use:
    its sample would start before it was in use, so it is left out this period and sampled
    from the next on."""
    sampler = StreamSampler()
    sampler.sample(acked(s0=0, s1=0, s2=0), [0, 1], 0.0)
    assert rates(sampler.sample(acked(s1=GB / 4, s2=GB / 8), [1, 2], 0.25)) == [pytest.approx(1e9)]
    got = rates(sampler.sample(acked(s1=GB / 2, s2=GB / 8 + GB / 4), [1, 2], 0.5))
    assert got == [pytest.approx(1e9), pytest.approx(1e9)]


def test_a_stream_that_opened_during_the_period_is_sampled_from_the_next() -> None:
    sampler = StreamSampler()
    sampler.sample(acked(s0=0), [0], 0.0)
    assert rates(sampler.sample(acked(s0=GB / 4, s1=GB), [0, 1], 0.25)) == [pytest.approx(1e9)]
    got = rates(sampler.sample(acked(s0=GB / 2, s1=GB + GB / 4), [0, 1], 0.5))
    assert got == [pytest.approx(1e9), pytest.approx(1e9)]


def test_a_stream_that_closed_is_forgotten() -> None:
    """A stream closed at a reading starts over when it opens again (its count may have
    moved while it was closed)."""
    sampler = StreamSampler()
    sampler.sample(acked(s0=0, s1=0), [0, 1], 0.0)
    assert rates(sampler.sample(acked(s0=GB / 4), [0], 0.25)) == [pytest.approx(1e9)]
    got = sampler.sample(acked(s0=GB / 2, s1=5 * GB), [0, 1], 0.5)
    assert rates(got) == [pytest.approx(1e9)]


def test_window_limited_from_the_counters_since_the_baseline() -> None:
    sampler = StreamSampler()

    def reading(n: int, busy: int | None, rwnd: int | None, sndbuf: int | None) -> StreamReading:
        return StreamReading(acked_bytes=n, busy_time_us=busy, rwnd_limited_us=rwnd, sndbuf_limited_us=sndbuf)

    sampler.sample({0: reading(0, 1000, 500, 0), 1: reading(0, 1000, 0, 0), 2: reading(0, None, None, None)},
                   [0, 1, 2], 0.0)
    got = sampler.sample({0: reading(10, 2000, 1100, 0), 1: reading(10, 2000, 100, 300),
                          2: reading(10, None, None, None)}, [0, 1, 2], 0.25)
    assert [s.window_limited for s in got] == [True, False, False]


def test_with_the_controller_a_grow_that_doubles_the_rate_is_kept() -> None:
    """Each stream window-limited at 1 Gbit/s on a link of 10: every grow raises the
    total and is kept, also when the caller wakes late."""
    ctl = StreamController(max_streams=4, interval=0.25)
    sampler = StreamSampler()
    keys = [0, 1, 2, 3]
    sent = dict.fromkeys(keys, 0.0)
    busy = dict.fromkeys(keys, 0)

    def readings() -> dict[int, StreamReading]:
        return {k: StreamReading(acked_bytes=round(sent[k]), busy_time_us=busy[k], rwnd_limited_us=busy[k],
                                 sndbuf_limited_us=0) for k in keys}

    now = 0.0
    sampler.sample(readings(), keys[: ctl.streams], now)
    verdicts = []
    for step in (0.25, 0.4, 0.25, 0.3, 0.25):
        for k in keys[: ctl.streams]:
            sent[k] += GB * step
            busy[k] += round(step * 1e6)
        now += step
        in_use = ctl.streams
        d = ctl.evaluate(sampler.sample(readings(), keys[:in_use], now), now)
        assert d.total_rate_bps == pytest.approx(1e9 * in_use)
        verdicts.append(d.verdict)
        sampler.use(keys[: ctl.streams])
    assert verdicts == [StreamVerdict.GROW] * 3 + [StreamVerdict.HOLD] * 2
    assert ctl.streams == 4
