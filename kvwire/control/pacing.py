"""How much to keep in flight and how fast to release it, from the bandwidth estimate.

Application-level flow sits above TCP: keeping one or two bandwidth-delay products of
chunks outstanding fills the path without building a queue that delays acks (and with
them the estimator) for seconds. The pacer spaces chunk releases when the caller wants
a rate ceiling rather than a window.

:class:`InflightController` is the sender's window. A window of ``2 x estimate x min RTT``
alone pins itself: when acks come late (a receiver starved of CPU acks in bursts), the
flight cannot cover the real round trip, the sender idles, the next samples are lower,
the window shrinks with them and nothing ever looks upward again. The controller
therefore sizes the window from the windowed *maximum* delivery rate, adds the ack
aggregation the estimator measured, never goes below a floor that keeps every stream
busy, and cycles its gain (BBR's probe-bandwidth phases) so that a link which freed up
is found within a few cycles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvwire.control.estimator import DeliveryRateEstimator, check_now, now_error

__all__ = ["PROBE_CYCLE", "PROBE_RTT_AFTER", "InflightController", "InflightTarget", "Pacer"]

_MIB = 1 << 20
_FRAME_SLACK = 4096  # a chunk frame's header and codec parameters, rounded up
#: Longest queue (seconds of the path's bandwidth) the per-stream floor may add beyond two
#: chunks and a bandwidth-delay product: on a slow path two chunks per stream are far more
#: than the path needs (4 streams of 4 MiB chunks: 270 ms queued at 1 Gbit/s). Generous, so
#: that a path slowed by a busy host (loopback under load) keeps its floor.
FLOOR_QUEUE = 0.050


@dataclass(frozen=True, slots=True, kw_only=True)
class InflightTarget:
    """Target bytes in flight = ``gain`` x bandwidth x min RTT, clamped to a range."""

    gain: float = 2.0
    """Multiple of the bandwidth-delay product to keep outstanding; 1 to 2."""
    min_bytes: int = 4 * _MIB
    """Floor, so a few chunks are always outstanding before the first estimate and on
    paths whose RTT is below the ack granularity."""
    max_bytes: int = 256 * _MIB
    """Ceiling on buffered-but-unacknowledged data."""
    initial_bytes: int = 16 * _MIB
    """Used until the estimator has both a bandwidth and an RTT."""

    def __post_init__(self) -> None:
        if not 1.0 <= self.gain <= 2.0:
            raise ValueError("gain must be within [1, 2] bandwidth-delay products")
        if not 0 < self.min_bytes <= self.max_bytes:
            raise ValueError("need 0 < min_bytes <= max_bytes")

    def bytes_for(self, bandwidth_bps: float | None, min_rtt: float | None) -> int:
        """Target in-flight bytes for a bandwidth (bits/s) and a minimum RTT (seconds).

        ``initial_bytes`` without both or with a bandwidth <= 0; a negative RTT counts as
        0. A bandwidth or RTT that is not a finite number is refused with ``ValueError``.
        """
        _check_finite(bandwidth_bps=bandwidth_bps, min_rtt=min_rtt)
        if bandwidth_bps is None or min_rtt is None or bandwidth_bps <= 0:
            return _within(self.initial_bytes, self.min_bytes, self.max_bytes)
        # Bytes/s first: gain x a bandwidth near the float's largest overflows to infinity.
        return _within(bandwidth_bps / 8.0 * self.gain * max(min_rtt, 0.0), self.min_bytes, self.max_bytes)

    def for_estimator(self, estimator: DeliveryRateEstimator) -> int:
        return self.bytes_for(estimator.bandwidth_bps, estimator.min_rtt)

    def may_send(self, estimator: DeliveryRateEstimator, nbytes: int) -> bool:
        """Whether sending ``nbytes`` more keeps the flight within the target.

        An empty flight may always send, so a chunk larger than the target is not stuck.
        """
        in_flight = estimator.bytes_in_flight
        return in_flight == 0 or in_flight + nbytes <= self.for_estimator(estimator)


PROBE_CYCLE: tuple[float, ...] = (1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
"""Gain per phase: probe up by a quarter, drain what the probe queued, cruise six phases."""

#: Age (seconds) of the minimum RTT sample at which the controller checks whether the
#: minimum is about to expire into a queued one (the estimator keeps it 10 s).
PROBE_RTT_AFTER = 8.0
#: Shortest drain (seconds) that refreshes the minimum RTT; see ``InflightController``.
PROBE_RTT_TIME = 0.2
#: A recent minimum RTT more than this many times the current one was queued.
PROBE_RTT_INFLATION = 1.25
#: Seconds of recent RTT samples (at least two minimum RTTs) whose least says what a round
#: trip costs now, queue included.
PROBE_RTT_RECENT = 2.0


class InflightController:
    """The sender's in-flight window: probes upward, covers late acks, never below a floor.

    ``target = phase gain x (gain x BDP + rate x ack lateness + ack aggregation)`` with the
    BDP from the windowed maximum delivery rate and the minimum RTT, the lateness from the
    recent minimum RTT above the all-time one (at most ``max_ack_delay``),
    clamped to ``[floor, max_bytes]`` where the floor is the larger of ``min_bytes`` and
    ``2 x streams x chunk_bytes`` (two chunks queued per stream), that second part no more
    than the path needs (:meth:`floor_for`). Each phase lasts one
    minimum RTT (at least ``min_phase`` seconds); phases advance when the caller asks,
    with ``now``.

    A window of twice the BDP keeps about one BDP queued, so a sender that never runs out
    of data samples no RTT without its own queue once its first samples leave the
    estimator's window: the minimum RTT would then rise to the queued one, the window with
    it, the queue with that, every 10 s (measured: a busy session at 1 Gbit/s, 20 ms,
    from 25 to 100 ms and 8 to 29 MB in flight in 30 s, ``benchmarks/standing_queue.py``).
    So, as BBR's ProbeRTT does, when the minimum is :data:`PROBE_RTT_AFTER` seconds old,
    more than a BDP is in flight and the least RTT of the last :data:`PROBE_RTT_RECENT`
    seconds (at least two minimum RTTs) is more than :data:`PROBE_RTT_INFLATION` times
    the minimum, the target drops to half a BDP (rounded up to whole chunks, framing
    included: at least one) until the queue has drained and one more round trip passed
    (at least :data:`PROBE_RTT_TIME`): what is sent then samples the path's RTT again.

    Recent samples, not the one after the minimum: a window's growth sends many chunks
    at once, acked one chunk's time on the wire apart, so the samples after the minimum
    rise by that much each, stay within 1.25 times it wherever a chunk takes under a
    quarter of the RTT, and expire with it (judged on them, no drain ever came at
    10 Gbit/s, 20 ms, 4 MiB chunks: the minimum stepped from 23 to 215 ms in 60 s, and
    268 MB, the ceiling, stayed in flight). The drain and the round trip after it are
    marked app-limited in the estimator
    (:meth:`~kvwire.control.estimator.DeliveryRateEstimator.mark_app_limited`): their
    rates are the drain's, not the path's.
    """

    def __init__(
        self,
        *,
        gain: float = 2.0,
        streams: int = 1,
        chunk_bytes: int = _MIB,
        min_bytes: int = 4 * _MIB,
        max_bytes: int = 256 * _MIB,
        initial_bytes: int = 16 * _MIB,
        min_phase: float = 0.002,
        max_ack_delay: float = 0.002,
        cycle: tuple[float, ...] = PROBE_CYCLE,
    ) -> None:
        """
        :param gain: bandwidth-delay products kept outstanding in a cruise phase.
        :param streams: streams carrying chunks; see :meth:`set_streams`.
        :param chunk_bytes: wire size of one chunk.
        :param min_bytes: floor independent of the stream count.
        :param max_bytes: ceiling on sent-but-unacknowledged bytes.
        :param initial_bytes: target before the first bandwidth and RTT samples.
        :param min_phase: shortest phase in seconds, so a sub-millisecond loopback RTT does
            not cycle faster than acks arrive.
        :param max_ack_delay: most seconds of late acks (recent RTT above the minimum)
            the window covers with extra bytes. Small by default: on sub-millisecond
            paths the lateness is mostly the sender's own queue, and a window grown by it
            only moves bytes into the transport's buffers (measured: 7-15 % lower goodput
            at 10 ms on loopback and veth). Raise it for receivers known to ack late.
        :param cycle: gain per phase; must average to at most 1 over the cycle and hold at
            least one phase above 1 so the window probes.
        """
        if not 1.0 <= gain < math.inf:
            raise ValueError(f"gain must be a finite number >= 1, got {gain!r}")
        if streams < 1 or chunk_bytes < 1:
            raise ValueError("streams and chunk_bytes must be positive")
        if not 0 < min_bytes <= max_bytes:
            raise ValueError("need 0 < min_bytes <= max_bytes")
        if (not cycle or not all(0 < g < math.inf for g in cycle) or max(cycle) <= 1.0
                or sum(cycle) > len(cycle) + 1e-9):
            raise ValueError("cycle needs a gain above 1, positive finite gains, and a mean of at most 1")
        if not 0 < min_phase < math.inf:
            raise ValueError(f"min_phase must be a finite number > 0, got {min_phase!r}")
        if not 0 <= max_ack_delay < math.inf:
            raise ValueError(f"max_ack_delay must be a finite number >= 0, got {max_ack_delay!r}")
        self._gain = gain
        self._chunk = chunk_bytes
        self._streams = streams
        self._min_bytes = min_bytes
        self._max_bytes = max_bytes
        self._initial = initial_bytes
        self._min_phase = min_phase
        self._max_ack_delay = max_ack_delay
        self._cycle = cycle
        self._phase = 0
        self._phase_start: float | None = None
        self._limited = False
        self._floor_bytes = self._stream_floor()  # floor_bytes, kept: every update() needs it
        self._floor = self._floor_bytes  # until there is an estimate (see floor_for)
        # floor_for of the last estimate, and what it was of (bandwidth, min RTT, floor_bytes)
        self._path_floor_bytes = 0
        self._path_floor_of: tuple[float, float, int] | None = None
        self._target = self._clamp(initial_bytes)
        self._probe_rtt_until: float | None = None  # while draining to refresh the min RTT
        self._probe_rtt_ended = -math.inf
        self._last_now: float | None = None
        self.probe_rtt_count = 0
        """Drains made to refresh the minimum RTT so far."""

    # -- configuration -------------------------------------------------------------------

    def set_streams(self, streams: int) -> None:
        """The number of streams carrying chunks changed."""
        if streams < 1:
            raise ValueError("streams must be >= 1")
        self._streams = streams
        self._floor_bytes = self._stream_floor()

    @property
    def floor_bytes(self) -> int:
        """Lowest target: ``max(min_bytes, 2 x streams x (chunk_bytes + framing))``, within
        ``max_bytes``: two whole frames per stream, headers and parameters included, so no
        stream waits for another's ack while the window has room on paper."""
        return self._floor_bytes

    def _stream_floor(self) -> int:
        per_chunk = self._chunk + _FRAME_SLACK
        return min(self._max_bytes, max(self._min_bytes, 2 * self._streams * per_chunk))

    def floor_for(self, bandwidth_bps: float, min_rtt: float) -> int:
        """The floor on a path of ``bandwidth_bps`` and ``min_rtt``: :attr:`floor_bytes`,
        but no more than two chunks and a bandwidth-delay product, or ``FLOOR_QUEUE``
        seconds of the bandwidth if that is more (and never below ``min_bytes``). Two
        chunks per stream keep every stream busy where acks come slower than the path
        drains (loopback, a fast link); on a slow path they only queue: the path stays
        full with one chunk in transmission, one waiting and a BDP on the way. A
        bandwidth or RTT that is not a finite number is refused with ``ValueError``."""
        _check_finite(bandwidth_bps=bandwidth_bps, min_rtt=min_rtt)
        per_chunk = self._chunk + _FRAME_SLACK
        rate = bandwidth_bps / 8.0
        needed = max(2 * per_chunk + rate * min_rtt, rate * FLOOR_QUEUE)
        return max(self._min_bytes, _within(needed, 0, self._floor_bytes))

    @property
    def phase_gain(self) -> float:
        return self._cycle[self._phase]

    @property
    def target_bytes(self) -> int:
        """The target computed by the last :meth:`update`."""
        return self._target

    # -- decisions -----------------------------------------------------------------------

    def update(self, estimator: DeliveryRateEstimator, now: float) -> int:
        """Advance the gain phase to ``now`` and recompute the target from the estimator.

        A ``now`` that is not a finite number is refused with ``ValueError`` before
        anything changes, as the estimator refuses one. A ``now`` before the last one (a
        clock that stepped back) moves the times kept back by as much: a phase or a drain
        lasts as long as it would have (a 5 s step held them 5 s longer)."""
        if not math.isfinite(now):  # (check_now's test, inlined: per-chunk path)
            raise now_error(now)
        last, self._last_now = self._last_now, now
        if last is not None and now < last:
            self._rebase(last - now)
        bandwidth = estimator.max_filter_bps
        min_rtt = estimator.min_rtt
        if bandwidth is None or min_rtt is None or bandwidth <= 0:
            self._floor = self._floor_bytes
            self._target = self._clamp(self._initial)
            return self._target
        phase_len = max(min_rtt, self._min_phase)
        if self._phase_start is None:
            self._phase_start = now
        elif now - self._phase_start >= phase_len:
            # Several phases may have passed while idle: move by their count, not by one.
            steps = int((now - self._phase_start) / phase_len)
            self._phase = (self._phase + steps) % len(self._cycle)
            self._phase_start += steps * phase_len
            self._limited = False
        # The floor again only when what it is of changed: the max filter and the minimum
        # RTT hold through many acks. (Values refused are never kept, so a NaN never
        # matches: it is refused every time.)
        if (bandwidth, min_rtt, self._floor_bytes) != self._path_floor_of:
            self._path_floor_bytes = self.floor_for(bandwidth, min_rtt)
            self._path_floor_of = (bandwidth, min_rtt, self._floor_bytes)
        self._floor = self._path_floor_bytes
        if self._probing_rtt(estimator, bandwidth, min_rtt, now):
            # Half a BDP in flight (BBR v2's ProbeRTT), or one chunk where that is more:
            # the queue drains, and the RTT of what is sent then is the path's. Half the
            # cost of one chunk where a BDP is many (measured on the link simulator: 1.2
            # instead of 2.1 % of a 25 Gbit/s, 10 ms link). In whole frames, rounded up:
            # may_send lets whole chunks through, and half a BDP of 1.99 frames held one
            # (1 Gbit/s, 100 ms, or 100 Gbit/s, 0.5 ms, 4 MiB chunks: 8.35 MB, 4.2 MB
            # frames), which each ack left with nothing in flight. Less than half a BDP
            # more, and no more than one BDP where a frame is at most half of one.
            per_chunk = self._chunk + _FRAME_SLACK
            frames = bandwidth / 16.0 * min_rtt / per_chunk
            if frames >= self._max_bytes / per_chunk:
                self._target = self._max_bytes
            else:
                self._target = min(self._max_bytes, max(1, math.ceil(frames)) * per_chunk)
            return self._target
        bdp = bandwidth / 8.0 * min_rtt
        # Acks later than the path's minimum (a busy receiver) need bytes to cover the
        # wait, or the flight stalls and the estimate sinks with it; bounded so a queue of
        # our own making cannot feed itself.
        recent = estimator.recent_min_rtt or min_rtt
        late = min(max(recent - min_rtt, 0.0), self._max_ack_delay)
        cover = bandwidth / 8.0 * late
        raw = self._cycle[self._phase] * (self._gain * bdp + cover + estimator.extra_acked_bytes)
        self._target = _within(raw, self._floor, self._max_bytes)
        return self._target

    def _rebase(self, step: float) -> None:
        """The clock stepped back by ``step`` seconds: the times kept move back with it."""
        if self._phase_start is not None:
            self._phase_start -= step
        if self._probe_rtt_until is not None:
            self._probe_rtt_until -= step
        self._probe_rtt_ended -= step

    @property
    def probing_rtt(self) -> bool:
        """Whether the last :meth:`update` held the window down to refresh the min RTT."""
        return self._probe_rtt_until is not None

    def _probing_rtt(self, estimator: DeliveryRateEstimator, bandwidth: float, min_rtt: float,
                     now: float) -> bool:
        if self._probe_rtt_until is not None:
            # The drain's rates are not the path's, nor are those of the first round trip
            # after it (sent into an empty pipe): marked app-limited, they lower neither the
            # max filter nor the goodput. Unmarked, a drain of more than ten round trips
            # (200 ms of a 10 ms path) let the peak expire, and the first flight after it
            # (one chunk per round trip, then more) became the max filter's estimate.
            estimator.mark_app_limited()
            if now < self._probe_rtt_until:
                return True
            self._probe_rtt_until = None
            self._probe_rtt_ended = now
            return False
        if now - self._probe_rtt_ended < PROBE_RTT_AFTER:
            return False  # one drain per period: its sample may take a while to become the minimum
        outlook = estimator.min_rtt_outlook()
        in_flight = estimator.bytes_in_flight
        if outlook is None or in_flight * 8.0 <= bandwidth * min_rtt:
            return False  # no more than a BDP of ours: nothing queued, the samples are the path's
        sampled_at, _ = outlook
        if now - sampled_at < PROBE_RTT_AFTER:
            return False
        # Not the sample after the minimum: that one is of the same flight (each chunk of a
        # window's growth acked one chunk's time on the wire after the one before), within
        # 1.25 times it on any path where a chunk takes under a quarter of the RTT, and
        # gone from the window milliseconds after it. What a round trip costs lately is
        # what the minimum steps up to.
        recent = estimator.min_rtt_since(now - max(PROBE_RTT_RECENT, 2.0 * min_rtt))
        if recent is None or recent <= PROBE_RTT_INFLATION * min_rtt:
            return False  # no recent sample, or one that did not queue: let it take over
        drain = in_flight * 8.0 / bandwidth
        self._probe_rtt_until = now + max(PROBE_RTT_TIME, drain + min_rtt)
        self.probe_rtt_count += 1
        estimator.mark_app_limited()
        return True

    def may_send(self, estimator: DeliveryRateEstimator, nbytes: int, now: float) -> bool:
        """Whether ``nbytes`` more may go now; an empty flight may always send. Updates
        the target first (:meth:`update`: a ``now`` that is not a finite number is
        refused)."""
        target = self.update(estimator, now)
        in_flight = estimator.bytes_in_flight
        if in_flight == 0 or in_flight + nbytes <= target:
            return True
        self._limited = True
        return False

    @property
    def window_limited(self) -> bool:
        """Whether the window held a send back during the current phase."""
        return self._limited

    def _clamp(self, target: float) -> int:
        return _within(target, self._floor, self._max_bytes)


def _check_finite(**values: float | None) -> None:
    for name, value in values.items():
        if value is not None and not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")


def _within(value: float, low: int, high: int) -> int:
    """``ceil(value)`` within ``[low, high]``, clamped before it is rounded (an infinite
    product of finite values has no integer)."""
    if value >= high:
        return high
    rounded = math.ceil(value)
    return rounded if rounded > low else low


class Pacer:
    """A token bucket releasing bytes at ``rate_bps`` with bursts up to ``burst_bytes``.

    ``rate_bps=None`` means unpaced: everything may go at once. A ``now`` that is not a
    finite number is refused with ``ValueError`` before anything changes (a NaN taken as
    the bucket's first time stopped its refills for good).
    """

    def __init__(self, rate_bps: float | None = None, *, burst_bytes: int = 2 * _MIB) -> None:
        if burst_bytes <= 0:
            raise ValueError("burst_bytes must be positive")
        if rate_bps is not None and not 0 < rate_bps < math.inf:
            raise ValueError("rate_bps must be a positive finite number, or None")
        self._rate_bps = rate_bps
        self._burst = float(burst_bytes)
        self._tokens = float(burst_bytes)
        self._stamp: float | None = None
        self._waiting_for = 0

    @property
    def rate_bps(self) -> float | None:
        return self._rate_bps

    def set_rate(self, rate_bps: float | None, now: float) -> None:
        if rate_bps is not None and not 0 < rate_bps < math.inf:
            raise ValueError("rate_bps must be a positive finite number, or None")
        self._refill(now)
        self._rate_bps = rate_bps

    def _refill(self, now: float) -> None:
        check_now(now)
        if self._stamp is not None and self._rate_bps is not None and now > self._stamp:
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate_bps / 8)
        if self._stamp is None or now > self._stamp:
            self._stamp = now

    def next_send_time(self, nbytes: int, now: float) -> float:
        """Earliest time ``nbytes`` may be released (``now`` if they may go now)."""
        check_now(now)
        if self._rate_bps is None:
            return now
        self._refill(now)
        # A chunk larger than the burst waits for a full bucket and then overdraws it.
        need = min(float(nbytes), self._burst)
        if self._tokens >= need:
            return now
        return now + (need - self._tokens) * 8.0 / self._rate_bps

    def on_send(self, nbytes: int, now: float) -> None:
        """Account released bytes; the bucket may go negative (the debt delays the next)."""
        self._refill(now)
        if self._rate_bps is not None:
            self._tokens -= nbytes
        self._waiting_for = 0

    def want(self, nbytes: int) -> None:
        """Declare the size of the next release, so ``get_timer`` can say when it may go."""
        self._waiting_for = nbytes

    def get_timer(self) -> float | None:
        """When the declared release may go; ``None`` if nothing is waiting or it may go now."""
        if not self._waiting_for or self._rate_bps is None or self._stamp is None:
            return None
        need = min(float(self._waiting_for), self._burst)
        if self._tokens >= need:
            return None
        return self._stamp + (need - self._tokens) * 8.0 / self._rate_bps

    def handle_timer(self, now: float) -> bool:
        """Refill at ``now``; returns whether the declared release may go."""
        self._refill(now)
        need = min(float(self._waiting_for), self._burst)
        return self._rate_bps is None or self._tokens >= need
