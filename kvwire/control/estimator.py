"""Delivery-rate, RTT and goodput estimation from the protocol's chunk acknowledgements.

The receiver acknowledges every chunk after verifying and storing it, so each ack is a
delivery event at application level. Per sent chunk the estimator keeps the BBR-style
delivery state (bytes delivered so far, when, and when the current flight began); per
ack it produces a :class:`RateSample`: bytes delivered over the interval the chunk was
in flight.

A sample is the lower of two rates over its chunk's flight: the ack rate (bytes
delivered since the chunk was sent, over the time since the ack before its send) and the
send rate (bytes sent from the send of the chunk last acked before it to its own send,
over that time). Chunks are striped over several connections, so acks do not come in
send order: a chunk sent early on a slow stream is acked after later ones, and acks that
arrive bunched count it with them. Each rate therefore counts its own bytes (the send rate
the bytes sent in its interval, not those delivered), so bunched acks cannot make a rate
higher than the sender's; in send order both count the same bytes and this is the
single-connection rule.

Two views of bandwidth come out of the samples:

* ``max_filter_bps``: the windowed maximum over the last ``window_rounds`` round trips.
  It is what the path has shown it can carry, and it is slow to forget a peak.
* ``goodput_bps``: bytes delivered per second over the last ``goodput_window`` seconds
  of samples that were not application-limited. It follows a drop in capacity within
  about that window.

``bandwidth_bps`` publishes the goodput while it is fresh (capped by the max filter), and
falls back to the max filter when the sender has been idle or application-limited, so a
quiet period neither reports zero nor forgets the path's capacity. A hold
(:meth:`DeliveryRateEstimator.mark_app_limited`: the sender's drain) is not such a period:
while its acks come in, the goodput keeps its newest sample.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["QUEUED_DELAY", "DeliveryRateEstimator", "EstimatorSnapshot", "RateSample"]

#: A chunk whose round trip exceeded the minimum RTT by this much, and by the minimum
#: itself, waited behind a backlog on its way: whatever was before it kept the bottleneck
#: busy, so its sample measures the path even when the sender had run out of data.
QUEUED_DELAY = 0.010


@dataclass(frozen=True, slots=True, kw_only=True)
class RateSample:
    """One delivery-rate sample, produced by an acknowledgement."""

    delivered_bytes: int
    """Bytes acknowledged between the acked chunk's send and its ack."""
    interval: float
    """Seconds those bytes took: the longer of the ack interval and the time they take at
    the rate the sender sent at."""
    rtt: float
    """Seconds from the chunk's send to its ack."""
    app_limited: bool
    """The sender had nothing queued while this chunk was in flight, and the chunk did not
    wait behind a backlog (:data:`QUEUED_DELAY`)."""
    round_count: int
    """Round trips completed when the sample was taken."""

    @property
    def rate_bps(self) -> float:
        """Delivery rate in bits per second."""
        return 8.0 * self.delivered_bytes / self.interval


@dataclass(frozen=True, slots=True, kw_only=True)
class EstimatorSnapshot:
    """Every published figure of a :class:`DeliveryRateEstimator` at one instant."""

    bandwidth_bps: float | None
    max_filter_bps: float | None
    goodput_bps: float | None
    min_rtt: float | None
    srtt: float | None
    rttvar: float | None
    bytes_in_flight: int
    chunks_in_flight: int
    delivered_bytes: int
    round_count: int
    samples: int
    app_limited: bool
    extra_acked_bytes: int = 0


@dataclass(slots=True)
class _SentChunk:
    nbytes: int
    sent_time: float
    delivered: int
    delivered_time: float
    first_sent_time: float
    app_limited: bool
    sent_total: int  # bytes sent so far, this chunk's included
    first_sent_total: int  # the same at first_sent_time
    held: bool = False  # sent while the sender held data back (mark_app_limited)


class DeliveryRateEstimator:
    """Estimates bottleneck bandwidth, RTT and goodput from chunk sends and acks.

    Feed it ``on_send`` for every chunk put on the wire and ``on_ack`` for every chunk the
    peer acknowledged; ``on_loss`` for chunks that will never be acknowledged (the
    connection carrying them died; they are re-sent under a new key). ``now`` is any
    monotonic clock's reading in seconds; one that is not a finite number is refused
    (``ValueError``) before anything changes.
    """

    def __init__(
        self,
        *,
        window_rounds: int = 10,
        goodput_window: float = 0.5,
        min_rtt_window: float = 10.0,
        min_interval: float = 1e-6,
    ) -> None:
        """
        :param window_rounds: round trips the max filter remembers.
        :param goodput_window: seconds of samples averaged into ``goodput_bps``; a drop in
            capacity shows in the published estimate after about this long.
        :param min_rtt_window: seconds the minimum RTT is remembered; a path whose
            propagation delay grew is recognised after this long.
        :param min_interval: floor on a sample's interval, so two acks at the same clock
            reading cannot produce an infinite rate.
        """
        if window_rounds < 1:
            raise ValueError("window_rounds must be >= 1")
        if goodput_window <= 0 or min_rtt_window <= 0 or min_interval <= 0:
            raise ValueError("windows and min_interval must be positive")
        self._window_rounds = window_rounds
        self._goodput_window = goodput_window
        self._min_rtt_window = min_rtt_window
        self._min_interval = min_interval

        self._sent: dict[Hashable, _SentChunk] = {}
        self._bytes_in_flight = 0
        self._delivered = 0
        self._delivered_time = 0.0
        self._first_sent_time = 0.0
        self._sent_total = 0
        self._first_sent_total = 0
        # Delivered-byte mark until which samples are app-limited; 0 means not app-limited.
        self._app_limited_until = 0
        # The same mark, set by mark_app_limited: samples app-limited whatever their wait.
        self._held_until = 0
        # The app-limited mark as the hold left it (mark_app_limited, and the sends during
        # the hold the sender marked app-limited); 0 once delivered (see hold_limited).
        self._hold_mark = 0
        # Bytes sent (``_sent_total``) when each mark was set: a chunk lost later that was
        # sent by then is in the mark, and will never be delivered (see _forget).
        self._app_limited_sent = self._held_sent = self._hold_mark_sent = 0

        self._round_count = 0
        self._next_round_delivered = 0

        # Monotonic deques: the front is the extreme of the window.
        self._max_bw: deque[tuple[int, float]] = deque()
        self._min_rtts: deque[tuple[float, float]] = deque()
        # (ack time, delivered bytes, interval) of non-app-limited samples.
        self._goodput_samples: deque[tuple[float, int, float]] = deque()
        self._goodput_bytes = 0
        self._goodput_interval = 0.0
        # When the last chunk sent during a hold (mark_app_limited) was acked; None once a
        # chunk sent outside one is. While a hold's samples come in, the newest goodput
        # sample is kept (see _expire_goodput).
        self._held_acked_at: float | None = None
        self._last_now = 0.0

        self._srtt: float | None = None
        self._rttvar: float | None = None
        self._samples = 0

        # Ack aggregation (BBR's extra_acked): bytes acked beyond what the bandwidth
        # estimate explains since the epoch began; windowed max by round.
        self._epoch_start: float | None = None
        self._epoch_acked = 0
        self._extra: deque[tuple[int, int]] = deque()
        # Minimum RTT of the last few rounds: what a round trip costs now, late acks included.
        self._recent_rtts: deque[tuple[int, float]] = deque()
        self._recent_rounds = 3

    # -- inputs -----------------------------------------------------------------------

    def on_send(self, chunk_key: Hashable, nbytes: int, now: float, *, app_limited: bool) -> None:
        """Record a chunk put on the wire.

        :param app_limited: after this chunk the sender has nothing queued, so the link
            may idle; samples taken while this data is in flight do not measure capacity.
        """
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        if not math.isfinite(now):  # (check_now's test, inlined: per-chunk path)
            raise now_error(now)
        if chunk_key in self._sent:
            raise ValueError(f"chunk {chunk_key!r} is already in flight")
        if self._bytes_in_flight == 0:
            # A new flight starts now: intervals must not include the idle time before it.
            self._first_sent_time = now
            self._first_sent_total = self._sent_total
            self._delivered_time = now
        self._bytes_in_flight += nbytes
        self._sent_total += nbytes
        if app_limited:
            self._app_limited_until = max(self._delivered + self._bytes_in_flight, 1)
            self._app_limited_sent = self._sent_total
            if self._held_until:
                self._hold_mark = self._app_limited_until
                self._hold_mark_sent = self._sent_total
        self._sent[chunk_key] = _SentChunk(
            nbytes=nbytes,
            sent_time=now,
            delivered=self._delivered,
            delivered_time=self._delivered_time,
            first_sent_time=self._first_sent_time,
            app_limited=self._app_limited_until != 0,
            sent_total=self._sent_total,
            first_sent_total=self._first_sent_total,
            held=self._held_until != 0,
        )
        if now > self._last_now:
            self._last_now = now

    def on_ack(self, chunk_key: Hashable, now: float) -> RateSample | None:
        """Record a chunk acknowledged by the peer; returns the sample it produced.

        An unknown key (already acked, forgotten, or never sent) returns ``None``. So does
        an ack at the clock reading of its chunk's send, or before it (a coarse clock
        stamps both alike): its delivery counts, but a round trip of no time measures
        nothing, and taken as a sample it made an 8.4 Tbit/s estimate and a minimum RTT
        of 0.
        """
        if not math.isfinite(now):  # (check_now's test, inlined: per-chunk path)
            raise now_error(now)
        chunk = self._sent.pop(chunk_key, None)
        if chunk is None:
            return None
        if now > self._last_now:
            self._last_now = now
        self._bytes_in_flight -= chunk.nbytes
        self._delivered += chunk.nbytes
        self._delivered_time = now
        if self._app_limited_until and self._delivered > self._app_limited_until:
            self._app_limited_until = 0
        if self._held_until and self._delivered > self._held_until:
            self._held_until = 0
        if self._hold_mark and self._delivered > self._hold_mark:
            self._hold_mark = 0

        if chunk.delivered >= self._next_round_delivered:
            self._next_round_delivered = self._delivered
            self._round_count += 1

        # Later sends measure their flight from this chunk's send on (from the latest send
        # acked: acks out of send order must not move it back).
        if chunk.sent_time >= self._first_sent_time:
            self._first_sent_time = chunk.sent_time
            self._first_sent_total = chunk.sent_total

        self._held_acked_at = now if chunk.held else None

        if now <= chunk.sent_time:
            self._update_extra_acked(chunk.nbytes, now)
            self._expire_goodput(now)
            return None
        delivered = self._delivered - chunk.delivered
        ack_elapsed = now - chunk.delivered_time
        # The send rate as an interval for the delivered bytes: at the rate the sender sent
        # at, they took this long.
        sent = chunk.sent_total - chunk.first_sent_total
        send_elapsed = (chunk.sent_time - chunk.first_sent_time) * delivered / sent if sent > 0 else 0.0
        interval = max(send_elapsed, ack_elapsed, self._min_interval)
        rtt = now - chunk.sent_time
        # A sender that ran out of data may still have filled the path: a small transfer on
        # a slow link sits in socket buffers and the bottleneck's queue for seconds. Such a
        # chunk's long wait says the link, not the sender, set its pace; without this, a
        # link slower than every transfer would only ever give app-limited samples, and an
        # early burst (a token bucket's) would stand as its estimate for good.
        min_rtt = self.min_rtt
        queued = min_rtt is not None and rtt - min_rtt >= max(min_rtt, QUEUED_DELAY)
        sample = RateSample(
            delivered_bytes=delivered,
            interval=interval,
            rtt=rtt,
            app_limited=chunk.held or (chunk.app_limited and not queued),
            round_count=self._round_count,
        )
        self._samples += 1
        self._update_rtt(rtt, now)
        self._update_max_filter(sample)
        self._update_extra_acked(chunk.nbytes, now)
        if not sample.app_limited:
            self._goodput_samples.append((now, sample.delivered_bytes, sample.interval))
            self._goodput_bytes += sample.delivered_bytes
            self._goodput_interval += sample.interval
        self._expire_goodput(now)
        return sample

    def mark_app_limited(self) -> None:
        """The sender holds data back on purpose (a drain to sample the path's RTT): the
        chunks it sends until everything now in flight is delivered are app-limited, so
        their low rates lower neither the max filter nor the goodput (Linux BBR marks its
        ProbeRTT so). Call it again while the hold lasts. The goodput keeps its newest
        sample until the first ack of a chunk sent after the hold (or a goodput window
        after the hold's last ack): a hold longer than the window (a drain on a slow or
        long path) left it empty, and the estimate published was the max filter's, an old
        peak after a drop in capacity. A round trip of such a chunk that
        waited in a queue (:data:`QUEUED_DELAY`) does not make its sample the path's: the
        queue is the sender's own burst into a pipe the hold emptied, and its rate counts
        the round trip before the first of it came back."""
        mark = max(self._delivered + self._bytes_in_flight, 1)
        self._app_limited_until = self._held_until = self._hold_mark = mark
        self._app_limited_sent = self._held_sent = self._hold_mark_sent = self._sent_total

    def on_loss(self, chunk_key: Hashable) -> bool:
        """Forget a chunk that will never be acknowledged; returns whether it was known.

        An app-limited mark or a hold (:meth:`mark_app_limited`) waits for the bytes in
        flight when it was set to be delivered: a lost chunk among them no longer counts
        (re-sent, it is a chunk sent after the mark), and a mark whose bytes are all
        delivered or lost ends there if nothing sent after it is in flight (else at the
        next acknowledgement, as without a loss). Counted, a hold outlived its round trip
        by the bytes lost: a stream that broke with 8 MiB of a drain in flight kept the
        next transfer's first 8 MiB held, their samples app-limited and ``hold_limited``
        set (``auto`` took no raw probe and measured no goodput while it lasted)."""
        chunk = self._sent.pop(chunk_key, None)
        if chunk is None:
            return False
        self._bytes_in_flight -= chunk.nbytes
        self._forget(chunk)
        self._settle_marks()
        return True

    forget = on_loss

    def forget_all(self) -> int:
        """Forget every chunk in flight (all connections died); returns how many. The
        marks end as :meth:`on_loss` says: nothing is left in flight."""
        count = len(self._sent)
        for chunk in self._sent.values():
            self._forget(chunk)
        self._sent.clear()
        self._bytes_in_flight = 0
        self._settle_marks()
        return count

    def _forget(self, chunk: _SentChunk) -> None:
        """Take a lost chunk's bytes out of the marks it was counted in (a mark stays at
        least 1 until settled: 0 means none)."""
        if self._app_limited_until and chunk.sent_total <= self._app_limited_sent:
            self._app_limited_until = max(self._app_limited_until - chunk.nbytes, 1)
        if self._held_until and chunk.sent_total <= self._held_sent:
            self._held_until = max(self._held_until - chunk.nbytes, 1)
        if self._hold_mark and chunk.sent_total <= self._hold_mark_sent:
            self._hold_mark = max(self._hold_mark - chunk.nbytes, 1)

    def _settle_marks(self) -> None:
        """After a loss: end the marks now behind the delivered bytes, and every mark once
        nothing is in flight (each mark counts bytes that were in flight when it was set:
        all of them are delivered or lost then, and nothing in flight can end it)."""
        delivered, idle = self._delivered, self._bytes_in_flight == 0

        def settled(mark: int) -> int:
            return 0 if idle or delivered > mark else mark

        self._app_limited_until = settled(self._app_limited_until)
        self._held_until = settled(self._held_until)
        self._hold_mark = settled(self._hold_mark)

    def advance(self, now: float) -> None:
        """Let time pass without an ack, so the goodput window can expire old samples."""
        check_now(now)
        self._last_now = max(self._last_now, now)
        self._expire_goodput(now)

    # -- internals --------------------------------------------------------------------

    def _update_rtt(self, rtt: float, now: float) -> None:
        if self._srtt is None or self._rttvar is None:
            self._srtt = rtt
            self._rttvar = rtt / 2
        else:
            # RFC 6298 gains.
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - rtt)
            self._srtt = 0.875 * self._srtt + 0.125 * rtt
        mins = self._min_rtts
        while mins and mins[-1][1] >= rtt:
            mins.pop()
        mins.append((now, rtt))
        while mins[0][0] < now - self._min_rtt_window:
            mins.popleft()
        recent = self._recent_rtts
        while recent and recent[-1][1] >= rtt:
            recent.pop()
        recent.append((self._round_count, rtt))
        while recent[0][0] <= self._round_count - self._recent_rounds:
            recent.popleft()

    def _update_max_filter(self, sample: RateSample) -> None:
        rate = sample.rate_bps
        if sample.app_limited:
            current = self.max_filter_bps
            if current is not None and rate < current:
                return
        maxes = self._max_bw
        while maxes and maxes[-1][1] <= rate:
            maxes.pop()
        maxes.append((self._round_count, rate))
        self._expire_max_filter()

    def _update_extra_acked(self, nbytes: int, now: float) -> None:
        # Acks that arrive in bursts (a receiver whose loop runs late, a stretched ack
        # train) deliver more in an instant than bandwidth x time predicts. The excess is
        # data the flight must hold on top of one BDP, or the sender idles between bursts
        # and measures its own stall as a slower link.
        bandwidth = self.max_filter_bps
        if bandwidth is None:
            return
        if self._epoch_start is None or now < self._epoch_start:
            # A clock that stepped back starts a new epoch: measured from a start in its
            # future, nothing was expected, and every byte acked counted as a burst (a
            # 5 s step raised the window from 5.6 to 16.6 MB, the 100 ms cap).
            self._epoch_start, self._epoch_acked = now, 0
        expected = bandwidth / 8.0 * (now - self._epoch_start)
        if self._epoch_acked <= expected:
            self._epoch_start, self._epoch_acked = now, 0
            expected = 0.0
        self._epoch_acked += nbytes
        # Never more than the estimate carries in 100 ms: a long stall is not a burst.
        extra = int(min(self._epoch_acked - expected, bandwidth / 8.0 * 0.1))
        extras = self._extra
        while extras and extras[-1][1] <= extra:
            extras.pop()
        extras.append((self._round_count, extra))
        oldest = self._round_count - self._window_rounds + 1
        while extras[0][0] < oldest and len(extras) > 1:
            extras.popleft()

    def _expire_max_filter(self) -> None:
        oldest = self._round_count - self._window_rounds + 1
        maxes = self._max_bw
        while maxes[0][0] < oldest and len(maxes) > 1:  # (never empty here: one was just added)
            maxes.popleft()

    def _expire_goodput(self, now: float) -> None:
        horizon = now - self._goodput_window
        samples = self._goodput_samples
        # A hold's samples (a drain and the round trip after it) add nothing: where they
        # outlast the window (a slow or long path), the goodput emptied and the published
        # estimate went back to the max filter, which after a drop in capacity holds the
        # old peak for seconds (0.1 Gbit/s, 20 ms, halved: over 1.5 times the new rate for
        # 6 s of 25). So the newest sample stays until the first ack of a chunk sent after
        # the hold, or a window after the hold's last ack (the sender went idle).
        held = self._held_acked_at
        keep = 1 if held is not None and now - held < self._goodput_window else 0
        while samples and samples[0][0] <= horizon and len(samples) > keep:
            _, nbytes, interval = samples.popleft()
            self._goodput_bytes -= nbytes
            self._goodput_interval -= interval
        if not samples:
            # Reset sums so floating-point drift cannot accumulate across idle periods.
            self._goodput_bytes = 0
            self._goodput_interval = 0.0

    # -- outputs ----------------------------------------------------------------------

    @property
    def max_filter_bps(self) -> float | None:
        """Windowed maximum delivery rate over recent round trips (bits/s)."""
        if not self._max_bw:
            return None
        return self._max_bw[0][1]

    @property
    def goodput_bps(self) -> float | None:
        """Mean delivery rate of recent non-app-limited samples (bits/s); ``None`` if none."""
        if not self._goodput_samples or self._goodput_interval <= 0:
            return None
        return 8.0 * self._goodput_bytes / self._goodput_interval

    @property
    def bandwidth_bps(self) -> float | None:
        """The published bandwidth estimate (bits/s); ``None`` before the first ack."""
        peak = self.max_filter_bps
        goodput = self.goodput_bps
        if goodput is None:
            return peak
        if peak is None:
            return goodput
        return min(goodput, peak)

    @property
    def extra_acked_bytes(self) -> int:
        """Largest recent ack burst beyond what the bandwidth estimate explains (bytes)."""
        if not self._extra:
            return 0
        return max(0, self._extra[0][1])

    @property
    def min_rtt(self) -> float | None:
        """Windowed minimum of ack RTTs (seconds)."""
        if not self._min_rtts:
            return None
        return self._min_rtts[0][1]

    def min_rtt_outlook(self) -> tuple[float, float | None] | None:
        """When the minimum RTT was sampled, and what the minimum falls back to once that
        sample leaves the window (the least RTT sampled after it; None if none).

        That fallback is often a sample of the same flight as the minimum, one chunk's
        time on the wire later (chunks sent together are acked one after another), and
        leaves the window within milliseconds of it: it says nothing about whether later
        samples queue. :meth:`min_rtt_since` with a recent time does."""
        mins = self._min_rtts
        if not mins:
            return None
        return mins[0][0], (mins[1][1] if len(mins) > 1 else None)

    def min_rtt_since(self, since: float) -> float | None:
        """Least RTT sampled at or after ``since`` (a reading of the clock ``now`` comes
        from) that the window still holds; ``None`` if none. Well above :attr:`min_rtt`
        for samples of the last seconds, every round trip lately waited in a queue, and
        the minimum steps up to it when its own sample expires."""
        check_now(since)
        least = None
        # Monotonic: times and RTTs both rise to the back, so the first entry at or after
        # ``since`` is the least RTT sampled since (any sample popped was followed by one
        # no larger).
        for at, rtt in reversed(self._min_rtts):
            if at < since:
                break
            least = rtt
        return least

    @property
    def recent_min_rtt(self) -> float | None:
        """Minimum ack RTT over the last three round trips (seconds): the path's RTT as the
        receiver acks *now*; above ``min_rtt`` when acks are delayed (a busy receiver)."""
        if not self._recent_rtts:
            return None
        return self._recent_rtts[0][1]

    @property
    def srtt(self) -> float | None:
        """Smoothed ack RTT (seconds)."""
        return self._srtt

    @property
    def rttvar(self) -> float | None:
        """Ack RTT variation (seconds)."""
        return self._rttvar

    @property
    def bytes_in_flight(self) -> int:
        return self._bytes_in_flight

    @property
    def chunks_in_flight(self) -> int:
        return len(self._sent)

    @property
    def delivered_bytes(self) -> int:
        return self._delivered

    @property
    def round_count(self) -> int:
        return self._round_count

    @property
    def app_limited(self) -> bool:
        """Whether samples currently being taken are marked application-limited."""
        return self._app_limited_until != 0

    @property
    def hold_limited(self) -> bool:
        """Whether the samples being taken are app-limited only because the sender held
        data back (:meth:`mark_app_limited`: a drain and the round trip after it), not
        because it ran out of data: marked so, or sent during the hold and marked
        app-limited by the sender (the flight the hold kept short found the pipe running
        dry). The estimate is then the path's as measured before the hold, and a chunk
        sent now measures nothing of what feeds the sender."""
        return self._app_limited_until != 0 and self._app_limited_until <= self._hold_mark

    def bdp_bytes(self) -> float | None:
        """Bandwidth-delay product from the published bandwidth and the min RTT (bytes)."""
        bandwidth = self.bandwidth_bps
        min_rtt = self.min_rtt
        if bandwidth is None or min_rtt is None:
            return None
        return bandwidth / 8.0 * min_rtt

    def snapshot(self) -> EstimatorSnapshot:
        return EstimatorSnapshot(
            bandwidth_bps=self.bandwidth_bps,
            max_filter_bps=self.max_filter_bps,
            goodput_bps=self.goodput_bps,
            min_rtt=self.min_rtt,
            srtt=self._srtt,
            rttvar=self._rttvar,
            bytes_in_flight=self._bytes_in_flight,
            chunks_in_flight=len(self._sent),
            delivered_bytes=self._delivered,
            round_count=self._round_count,
            samples=self._samples,
            app_limited=self.app_limited,
            extra_acked_bytes=self.extra_acked_bytes,
        )


def check_now(now: float) -> None:
    """``ValueError`` unless ``now`` is a finite number: every controller of this package
    checks the time it is given with this before anything changes (those called for every
    chunk test ``math.isfinite`` themselves and raise :func:`now_error`)."""
    if not math.isfinite(now):
        raise now_error(now)


def now_error(now: float) -> ValueError:
    """What :func:`check_now` raises for ``now``."""
    return ValueError(f"now must be a finite number, got {now!r}")
