"""How many TCP streams a session stripes over.

One TCP stream delivers at most window / RTT. When each stream is window-limited (its
receive window or send buffer, as TCP_INFO counts them: :attr:`StreamSample.window_limited`)
and adding a stream raised the total rate, another stream helps; when the last stream added
did not raise the total, or no stream is window-limited and fewer streams would carry
the same rate, the extra streams only add contention and are given up.

The controller is evaluated at most once per ``interval`` (the caller asks
``get_timer()`` when to call ``evaluate``); every decision looks only at the samples it
is given and the ones before.  :class:`StreamSampler` makes those samples from each
stream's running totals (acknowledged bytes, TCP_INFO counters) and the time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from kvwire.control.estimator import check_now

__all__ = [
    "StreamController",
    "StreamDecision",
    "StreamReading",
    "StreamSample",
    "StreamSampler",
    "StreamVerdict",
    "window_limited_from_counters",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamSample:
    """What one stream did since the previous evaluation."""

    delivery_rate_bps: float
    """Bits/s this stream delivered (acked bytes over the period)."""
    window_limited: bool
    """The stream spent more than half its busy time in the period limited by the
    receiver's window or its own send buffer, as the kernel counts them in TCP_INFO
    (``tcpi_rwnd_limited`` and ``tcpi_sndbuf_limited`` over ``tcpi_busy_time``:
    :func:`window_limited_from_counters`, what the client and :class:`StreamSampler`
    use). Nothing else makes a sample window-limited: not the congestion window, not the
    sender's in-flight window, and without those counters (no TCP_INFO, or a kernel
    without them) never."""


class StreamVerdict(Enum):
    HOLD = "hold"
    GROW = "grow"
    SHRINK = "shrink"
    REVERT = "revert"
    """The last added stream did not raise the total rate; it is given back."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamDecision:
    verdict: StreamVerdict
    streams: int
    """Streams to use from now on."""
    total_rate_bps: float


def window_limited_from_counters(
    *,
    busy_us: int | None,
    rwnd_limited_us: int | None,
    sndbuf_limited_us: int | None,
    threshold: float = 0.5,
) -> bool:
    """Whether a stream was window-limited, from TCP_INFO time counters over one period.

    Arguments are deltas of ``tcpi_busy_time``, ``tcpi_rwnd_limited`` and
    ``tcpi_sndbuf_limited`` between two readings. The kernel counts these within busy
    time, so a stream limited more than ``threshold`` of its busy time is window-limited.
    Missing counters (older kernels) read as not limited.
    """
    if not busy_us or busy_us <= 0:
        return False
    limited = (rwnd_limited_us or 0) + (sndbuf_limited_us or 0)
    return limited > threshold * busy_us


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamReading:
    """One open stream's running totals at one instant."""

    acked_bytes: int
    """Bytes acknowledged on this stream so far."""
    busy_time_us: int | None = None
    """``tcpi_busy_time`` (``None``: no TCP_INFO, or a kernel without it)."""
    rwnd_limited_us: int | None = None
    """``tcpi_rwnd_limited``."""
    sndbuf_limited_us: int | None = None
    """``tcpi_sndbuf_limited``."""


@dataclass(frozen=True, slots=True)
class _Baseline:
    reading: StreamReading
    at: float
    in_use: bool
    """The stream has been in use since ``at``."""


class StreamSampler:
    """Turns every open stream's running totals, read once a period, into the
    samples :meth:`StreamController.evaluate` takes.

    Every open stream's baseline (its totals and the time they were read) is renewed each
    period, in use or not, so a stream put in use is judged on the bytes it acknowledged
    since then, not since it was last in use; a rate is the bytes since the baseline over
    the time that actually passed since it (a late period is not read as a fast one).  A
    stream is sampled only if it was in use for the whole span since its baseline: one
    that came into use in between (another stream closed) or opened in between is not
    judged on that span.

    Each period: :meth:`sample`, then :meth:`StreamController.evaluate` with its samples
    and the same ``now``, then, if the count changed, :meth:`use` with the streams in use
    from then on.
    """

    def __init__(self) -> None:
        self._baselines: dict[int, _Baseline] = {}

    def sample(
        self, readings: Mapping[int, StreamReading], in_use: Sequence[int], now: float
    ) -> list[StreamSample]:
        """One sample for each stream in ``in_use`` (in its order) in use since its
        baseline, from ``readings`` (every open stream's totals, read at ``now``); then
        every open stream's baseline becomes its reading at ``now``.  A stream not in
        ``readings`` is forgotten (closed)."""
        using = set(in_use)
        samples = []
        for key in in_use:
            base = self._baselines.get(key)
            reading = readings.get(key)
            if base is None or reading is None or not base.in_use or now <= base.at:
                continue
            before = base.reading
            samples.append(StreamSample(
                delivery_rate_bps=(reading.acked_bytes - before.acked_bytes) * 8 / (now - base.at),
                window_limited=window_limited_from_counters(
                    busy_us=_delta(reading.busy_time_us, before.busy_time_us),
                    rwnd_limited_us=_delta(reading.rwnd_limited_us, before.rwnd_limited_us),
                    sndbuf_limited_us=_delta(reading.sndbuf_limited_us, before.sndbuf_limited_us),
                ),
            ))
        baselines = {}
        for key, reading in readings.items():
            base = self._baselines.get(key)
            if base is not None and now <= base.at:  # no time passed: the span goes on
                baselines[key] = _Baseline(base.reading, base.at, base.in_use and key in using)
            else:
                baselines[key] = _Baseline(reading, now, key in using)
        self._baselines = baselines
        return samples

    def use(self, in_use: Iterable[int]) -> None:
        """The streams in use from now on (right after :meth:`sample`, when the
        controller changed the count): a stream put in use is sampled from its last
        baseline on, one taken out of use is not sampled until it is in use again for a
        whole period."""
        using = set(in_use)
        self._baselines = {
            key: _Baseline(base.reading, base.at, key in using) for key, base in self._baselines.items()
        }


def _delta(now: int | None, before: int | None) -> int | None:
    return None if now is None or before is None else now - before


#: Share of an interval an evaluation may come early and still count.
_EARLY = 0.1


class StreamController:
    """Chooses the number of streams in use from per-stream delivery samples.

    The shrink test rates one stream at the best a window-limited stream delivered in the
    last ``best_window`` seconds (the last such best where none did since), not the best
    ever: a stream's rate falls with its path (a longer RTT, a smaller window). A shrink whose next evaluation finds the streams
    left window-limited failed: the stream comes back at once, the best is what one
    stream carries now, and no shrink goes below that count for ``backoff`` seconds.
    Before, a best of 5 Gbit/s kept from the first seconds, on streams carrying 2 of a
    7 Gbit/s link, shrank 4 streams to 3 and grew them back every 1.25 s for good.
    """

    def __init__(
        self,
        *,
        min_streams: int = 1,
        max_streams: int = 8,
        initial_streams: int = 1,
        min_gain: float = 0.1,
        interval: float = 0.25,
        limited_fraction: float = 0.5,
        shrink_headroom: float = 0.25,
        shrink_patience: int = 4,
        backoff: float = 5.0,
        best_window: float = 10.0,
    ) -> None:
        """
        :param min_gain: relative rise in total rate that justifies the last added stream.
        :param interval: minimum seconds between evaluations; the caller may lengthen it
            to a few RTTs on long paths.
        :param limited_fraction: share of streams that must be window-limited to grow.
        :param shrink_headroom: shrink only if one stream fewer, each at the best rate one
            stream has shown, would still carry the total with this much to spare.
        :param shrink_patience: consecutive link-limited evaluations before shrinking.
        :param backoff: seconds after a revert before growing past that count again, and
            after a failed shrink before shrinking below that count again.
        :param best_window: seconds a window-limited stream's rate counts as the best one
            stream has shown (the shrink test's rate per stream), unless no window-limited
            stream showed a rate since: the newest best counts until one does.
        """
        if not 1 <= min_streams <= initial_streams <= max_streams:
            raise ValueError("need 1 <= min_streams <= initial_streams <= max_streams")
        if not 0 < interval < math.inf:
            raise ValueError(f"interval must be a finite number > 0, got {interval!r}")
        for name, value in (("min_gain", min_gain), ("shrink_headroom", shrink_headroom), ("backoff", backoff),
                            ("best_window", best_window)):
            if not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not 0 <= limited_fraction <= 1:
            raise ValueError(f"limited_fraction must be a number from 0 to 1, got {limited_fraction!r}")
        if isinstance(shrink_patience, bool) or not isinstance(shrink_patience, int) or shrink_patience < 1:
            raise ValueError(f"shrink_patience must be an int >= 1, got {shrink_patience!r}")
        self._min = min_streams
        self._max = max_streams
        self._streams = initial_streams
        self._min_gain = min_gain
        self._interval = interval
        self._limited_fraction = limited_fraction
        self._shrink_headroom = shrink_headroom
        self._shrink_patience = shrink_patience
        self._backoff = backoff
        self._best_window = best_window

        self._next_eval: float | None = None
        # Total rate measured just before the last grow, to judge whether the grow helped.
        self._rate_before_grow: float | None = None
        self._ceiling: int | None = None
        self._ceiling_until = 0.0
        # (time, rate): the best window-limited per-stream rate of each evaluation, those
        # of the last best_window seconds and the newest, falling from the front (the best).
        self._bests: deque[tuple[float, float]] = deque()
        self._link_limited_runs = 0
        # A shrink waiting for its verdict (the next evaluation), and the count no shrink
        # goes below until _floor_until after one that failed.
        self._shrunk = False
        self._floor: int | None = None
        self._floor_until = 0.0

    @property
    def streams(self) -> int:
        return self._streams

    @property
    def max_streams(self) -> int:
        """The most streams it may choose."""
        return self._max

    def limit(self, max_streams: int) -> None:
        """Lower :attr:`max_streams` to ``max_streams`` (streams that can no longer exist,
        such as a session's slots given up); a higher value changes nothing.  A count above
        it comes down at once, and a grow still waiting for its verdict is then not judged
        (its rate was measured with streams no longer in use)."""
        if max_streams < 1:
            raise ValueError("max_streams must be >= 1")
        if max_streams >= self._max:
            return
        self._max = max_streams
        self._min = min(self._min, max_streams)
        if self._streams > max_streams:
            self._streams = max_streams
            self._rate_before_grow = None
            self._shrunk = False
            self._link_limited_runs = 0

    def get_timer(self) -> float | None:
        """When the next evaluation is due; ``None`` before the first one."""
        return self._next_eval

    def evaluate(
        self, samples: Sequence[StreamSample], now: float, *, app_limited: bool = False
    ) -> StreamDecision:
        """Decide the stream count from one sample per stream in use.

        :param app_limited: the sender ran out of data during the period; no conclusion
            about the path can be drawn, so the count is held.

        A ``now`` that is not a finite number, or a sample's rate that is not a finite
        number >= 0, is refused with ``ValueError`` before anything changes (an infinite ``now`` put the next
        evaluation at infinity, and every one after it held).
        """
        check_now(now)
        for s in samples:
            if not 0 <= s.delivery_rate_bps < math.inf:
                raise ValueError(f"a stream's delivery_rate_bps must be a finite number >= 0, got {s.delivery_rate_bps!r}")
        total = sum(s.delivery_rate_bps for s in samples)
        # A caller sleeping one interval between calls wakes a little early or late (an
        # event loop's timer ticks in milliseconds): early by a tenth of an interval still
        # counts, or every other period would be skipped and its samples lost.
        if self._next_eval is not None and now < self._next_eval - _EARLY * self._interval:
            return self._decide(StreamVerdict.HOLD, total)
        self._next_eval = now + self._interval
        if app_limited or not samples:
            self._rate_before_grow = None
            self._shrunk = False
            return self._decide(StreamVerdict.HOLD, total)
        if self._ceiling is not None and now >= self._ceiling_until:
            self._ceiling = None
        if self._floor is not None and now >= self._floor_until:
            self._floor = None

        limited = [s for s in samples if s.window_limited]
        window_limited = len(limited) >= self._limited_fraction * len(samples)
        shrunk, self._shrunk = self._shrunk, False
        bests = self._bests
        if shrunk and window_limited:
            bests.clear()  # what one stream carries now, not what it carried before
        if limited:
            rate = max(s.delivery_rate_bps for s in limited)
            while bests and bests[-1][1] <= rate:
                bests.pop()
            bests.append((now, rate))
        # The newest best stays whatever its age: with none, no shrink could pass, and
        # streams added on a fast link stayed after it slowed (5 Gbit/s per stream, a
        # 12 Gbit/s link falling to 6 thirty seconds later: 3 streams for good). A stale
        # best is corrected by the shrink it allows, if that fails.
        while len(bests) > 1 and bests[0][0] < now - self._best_window:
            bests.popleft()

        if self._rate_before_grow is not None:
            before = self._rate_before_grow
            self._rate_before_grow = None
            if total < before * (1.0 + self._min_gain) and self._streams > self._min:
                self._ceiling = self._streams - 1
                self._ceiling_until = now + self._backoff
                self._streams -= 1
                self._link_limited_runs = 0
                return self._decide(StreamVerdict.REVERT, total)

        if window_limited:
            self._link_limited_runs = 0
            limit = self._max if self._ceiling is None else min(self._max, self._ceiling)
            if self._streams < limit:
                if shrunk:
                    # The streams left are window-limited: the shrink failed (as a grow
                    # that did not raise the total does), and is backed off from.
                    self._floor = self._streams + 1
                    self._floor_until = now + self._backoff
                self._rate_before_grow = total
                self._streams += 1
                return self._decide(StreamVerdict.GROW, total)
            return self._decide(StreamVerdict.HOLD, total)

        self._link_limited_runs += 1
        fewer = self._streams - 1
        best = bests[0][1] if bests else 0.0
        if (
            fewer >= self._min
            and (self._floor is None or fewer >= self._floor)
            and best > 0
            and self._link_limited_runs >= self._shrink_patience
            and fewer * best >= total * (1.0 + self._shrink_headroom)
        ):
            self._streams = fewer
            self._link_limited_runs = 0
            self._shrunk = True
            return self._decide(StreamVerdict.SHRINK, total)
        return self._decide(StreamVerdict.HOLD, total)

    def _decide(self, verdict: StreamVerdict, total: float) -> StreamDecision:
        return StreamDecision(verdict=verdict, streams=self._streams, total_rate_bps=total)
