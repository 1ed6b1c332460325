"""The ``auto`` codec: pick per chunk the codec that delivers the most KV per second.

A codec that shrinks the cache by ``size_ratio`` (wire bytes / fp16 bytes) lets a link
of ``B`` bytes/s carry ``B / size_ratio`` bytes of fp16 KV per second, but every byte is
also encoded by the sender and decoded by the receiver, and every wire byte costs the
transport CPU too. Per fp16 byte the end-to-end cost has four parts: wire
``size_ratio / B``, encode ``1 / encode speed``, decode ``1 / decode speed`` and
transport ``size_ratio x transport cost`` (the sender's own CPU seconds per wire byte,
measured as it sends: :meth:`CodecChooser.observe_transport`; left out until measured).
How they combine is the ``pipeline`` setting:

* ``"cpu"`` (default): the wire overlaps the CPU work; encode, decode and transport add
  (one CPU budget). On a path whose "wire" is itself CPU (loopback, a host where the
  transport is CPU-bound) the transport term is what keeps quantizing from looking free;
  on a real link the CPU work hides behind the wire.
* ``"serial"``: everything adds, the wire too: the pessimistic bound.
* ``"full"``: every stage overlaps; the slowest bounds the rate (separate, idle hosts).

Delivered KV = 1 / cost. Raw has no encode or decode, so it is chosen whenever it is at
least as fast as the best (within ``tolerance``, precision first): ``auto`` never lowers
KV goodput by the model's measure. On a fast link the raw bytes win; on a slow one a
compact codec does. The one exception is deliberate: given ``now``, one chunk per
``probe_interval`` may be a probe that refreshes a measurement the model rests on (the
path's rate while an encoder paces the sender, a compact codec's encode speed while raw
is chosen, the speeds of a codec not sent for a while; see :meth:`CodecChooser.choose`).

With a deadline the aim changes: keep as much precision as the deadline allows, so the
chooser walks from the most precise codec down and stops at the first that finishes in
time.

Measured goodput decides once there is any. The model's inputs are measured one stage at
a time, and on a loaded host they add up wrongly (a speed measured while the host was
busier keeps a codec out). So the transport also feeds the acknowledgement of every
chunk (:meth:`CodecChooser.observe_delivered`), and a
:class:`~kvwire.control.goodput.GoodputMeter` turns them into each codec's measured KV
goodput, end to end. From the first measurement on, throughput mode sends the most
precise codec within ``tolerance`` of the best *measured* rate (the leader), and now and
then explores another codec for a short stint (``stint_chunks`` chunks) so that its rate
is measured too: a codec never measured first (in the model's order), then each in turn
once its wait has passed. A codec measured behind the leader waits twice as long before
its next stint (``explore_after`` doubling up to ``explore_max``); one within tolerance
waits ``explore_after`` again. A leader whose rate falls below another codec's last
measurement hands over at once, and the new leader is measured all the time it is sent;
so neither a stale high nor a stale low measurement lasts longer than one stint or one
wait. The model still makes the first choice (before any acknowledgement), orders the
codecs never measured, and makes deadline choices (with measured rates in place of its
own where there are any).

Codecs are named by string; the chooser never imports them. Encode speeds are measured
by the transport and fed back through :meth:`CodecChooser.observe_encode`; decode speeds
come from the receiver where it reports them, else from a local measurement, through
:meth:`CodecChooser.observe_decode`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvwire.control.goodput import GoodputMeter

__all__ = ["CodecCandidate", "CodecChoice", "CodecChooser"]

_PIPELINES = ("serial", "cpu", "full")


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecCandidate:
    name: str
    size_ratio: float
    """Wire bytes per fp16 byte (1.0 for raw, about 0.52 for fp8 with per-(token, head)
    scales, about 0.27 for int4 with group scales)."""
    encode_bytes_per_s: float | None = None
    """Prior encode speed in fp16 input bytes/s; ``None`` = not yet measured (treated as
    unlimited, so an unmeasured codec gets tried and measured)."""
    precision: int | None = None
    """Rank for deadline mode, higher is more precise; default: by ``size_ratio``."""
    decode_bytes_per_s: float | None = None
    """Prior decode speed on the receiver in fp16 output bytes/s; ``None`` = free (raw
    lands in place and has nothing to decode)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecChoice:
    codec: str
    delivered_bytes_per_s: float
    """Expected fp16 KV bytes/s delivered with this codec."""
    meets_deadline: bool | None
    """``None`` when no deadline was given."""
    probe: bool = False
    """Sent to measure the path, not because it is the best: see :meth:`CodecChooser.choose`."""


#: fp16 bytes of an encode or decode measurement that counts as a whole EWMA sample.
FULL_SAMPLE_BYTES = 1 << 20


class CodecChooser:
    """Chooses a codec per chunk from the bandwidth estimate and measured encode speeds."""

    def __init__(
        self,
        candidates: Iterable[CodecCandidate],
        *,
        tolerance: float = 0.05,
        speed_gain: float = 0.25,
        deadline_margin: float = 0.1,
        pipeline: str = "cpu",
        probe_interval: float = 0.1,
        refresh_after: float = 1.0,
        refresh_share: float = 0.5,
        stint_chunks: int = 10,
        explore_after: float = 0.5,
        explore_max: float = 4.0,
        hysteresis: float = 0.03,
        meter: GoodputMeter | None = None,
    ) -> None:
        """
        :param tolerance: in throughput mode, a more precise codec within this fraction
            of the best delivered rate is preferred.
        :param speed_gain: EWMA gain for encode-speed and size-ratio measurements.
        :param deadline_margin: in deadline mode, a codec must finish this fraction ahead
            of the deadline to count as meeting it, absorbing estimate noise.
        :param pipeline: how wire, encode, decode and transport costs combine:
            ``"cpu"``, ``"serial"`` or ``"full"`` (see the module docstring).
        :param probe_interval: seconds between probes (see :meth:`choose`).
        :param refresh_after: seconds after which a codec not sent since, and held back
            by its CPU costs rather than the wire, is a contender for a probe chunk that
            measures it again (see :meth:`choose`) ...
        :param refresh_share: ... if its delivered rate, by the model, is at least this
            share of the chosen codec's (one far behind is not worth a chunk).
        :param stint_chunks: chunks of one exploring stint (measured goodput, see the
            module docstring): enough for one sample of the meter after the first
            acknowledgement, plus a spare.
        :param explore_after: seconds a codec waits for its next stint after one that
            measured it within ``tolerance`` of the leader ...
        :param explore_max: ... doubling after each stint that measured it behind, up to
            this.
        :param hysteresis: measured goodput changes the leader only once the leader
            loses by this fraction more than the rule says (samples vary).
        :param meter: the goodput meter fed by :meth:`observe_delivered` (default: a
            :class:`~kvwire.control.goodput.GoodputMeter` with its defaults).
        """
        ordered = list(candidates)
        if not ordered:
            raise ValueError("at least one codec candidate is needed")
        names = [c.name for c in ordered]
        if len(set(names)) != len(names):
            raise ValueError("codec names must be unique")
        for c in ordered:
            if c.size_ratio <= 0:
                raise ValueError(f"{c.name}: size_ratio must be positive")
        self._ratio = {c.name: c.size_ratio for c in ordered}
        self._speed: dict[str, float | None] = {c.name: c.encode_bytes_per_s for c in ordered}
        self._decode: dict[str, float | None] = {c.name: c.decode_bytes_per_s for c in ordered}
        # Priors measured together (same host, same moment): while a decode prior has not
        # been replaced by a measurement, it slows down as the measured encode does, so a
        # host that got busier since the priors were taken does not keep an idle decoder.
        self._encode_prior: dict[str, float | None] = {c.name: c.encode_bytes_per_s for c in ordered}
        self._decode_observed: set[str] = set()
        self._transport: float | None = None  # sender CPU seconds per wire byte
        if pipeline not in _PIPELINES:
            raise ValueError(f"pipeline must be one of {', '.join(_PIPELINES)}")
        self._pipeline = pipeline
        # Most precise first; ties keep the caller's order.
        self._by_precision = [
            c.name
            for c in sorted(
                ordered,
                key=lambda c: -(c.precision if c.precision is not None else c.size_ratio),
            )
        ]
        if probe_interval <= 0:
            raise ValueError("probe_interval must be positive")
        self._probe_interval = probe_interval
        self._last_probe: float | None = None
        if refresh_after <= 0 or not 0 < refresh_share <= 1:
            raise ValueError("refresh_after must be positive and refresh_share in (0, 1]")
        self._refresh_after = refresh_after
        self._refresh_share = refresh_share
        self._sent_at: dict[str, float] = {}  # when choose() last returned each codec
        self._tolerance = tolerance
        self._gain = speed_gain
        self._deadline_margin = deadline_margin
        if stint_chunks < 1 or explore_after <= 0 or explore_max < explore_after:
            raise ValueError("need stint_chunks >= 1 and 0 < explore_after <= explore_max")
        self._stint_chunks = stint_chunks
        self._explore_after, self._explore_max = explore_after, explore_max
        self.meter = meter if meter is not None else GoodputMeter()
        self._stint: str | None = None  # the codec being explored
        self._stint_left = 0  # chunks of the stint still to choose
        self._wait: dict[str, float] = {}  # each codec's wait between stints now
        self._due: dict[str, float] = {}  # when each codec's next stint may start
        self._explored: dict[str, int] = {}  # the meter's samples of a codec when its stint began
        self._leader: str | None = None
        self._hysteresis = hysteresis

    @classmethod
    def from_ratios(cls, ratios: Mapping[str, float], **kwargs: Any) -> CodecChooser:
        """Candidates from ``{name: size_ratio}``, precision ordered by ratio."""
        return cls((CodecCandidate(name=n, size_ratio=r) for n, r in ratios.items()), **kwargs)

    @property
    def codecs(self) -> list[str]:
        """Codec names, most precise first."""
        return list(self._by_precision)

    def encode_speed(self, codec: str) -> float | None:
        return self._speed[codec]

    def decode_speed(self, codec: str) -> float | None:
        """Decode speed used for ``codec``: measured, or the prior scaled like encode."""
        decode = self._decode[codec]
        if decode is None or codec in self._decode_observed:
            return decode
        prior, now = self._encode_prior[codec], self._speed[codec]
        if prior is None or now is None or prior <= 0:
            return decode
        return decode * min(1.0, now / prior)

    def size_ratio(self, codec: str) -> float:
        return self._ratio[codec]

    def observe_encode(self, codec: str, nbytes: int, seconds: float) -> None:
        """Feed one measured encode: ``nbytes`` of fp16 input took ``seconds``."""
        if codec not in self._speed or nbytes <= 0:
            return
        self._speed[codec] = self._blend(self._speed[codec], nbytes / max(seconds, 1e-9), nbytes)

    def observe_decode(self, codec: str, nbytes: int, seconds: float) -> None:
        """Feed one measured decode: ``nbytes`` of fp16 output took ``seconds``."""
        if codec not in self._decode or nbytes <= 0:
            return
        speed = nbytes / max(seconds, 1e-9)
        prior = self._decode[codec]
        if codec not in self._decode_observed and nbytes >= FULL_SAMPLE_BYTES:
            prior = None  # a real measurement replaces the prior
        self._decode[codec] = self._blend(prior, speed, nbytes)
        self._decode_observed.add(codec)

    def observe_transport(self, wire_bytes: int, cpu_seconds: float) -> None:
        """Feed one measurement of the transport's own CPU: ``cpu_seconds`` spent sending
        ``wire_bytes`` (framing, checksums, the kernel's copy; not encoding)."""
        if wire_bytes <= 0 or cpu_seconds < 0:
            return
        self._transport = self._blend(self._transport, cpu_seconds / wire_bytes, wire_bytes)

    def observe_delivered(self, codec: str, kv_bytes: int, now: float) -> None:
        """Feed one acknowledged chunk: ``kv_bytes`` of fp16 KV sent with ``codec``
        arrived (checked and decoded) at ``now``."""
        if codec in self._ratio:
            self.meter.on_ack(codec, kv_bytes, now)

    def observe_idle(self) -> None:
        """Nothing is left in flight or queued (the last transfer is done): the time until
        the next acknowledgement is no codec's."""
        self.meter.pause()

    def goodput(self, codec: str) -> float | None:
        """Measured fp16 KV bytes/s delivered with ``codec``; ``None`` before its first sample."""
        return self.meter.rate(codec)

    @property
    def transport_cost(self) -> float | None:
        """Measured transport CPU seconds per wire byte, ``None`` before the first."""
        return self._transport

    def _blend(self, old: float | None, value: float, nbytes: int) -> float:
        """EWMA step of a speed or a cost, measured over ``nbytes``; a sample smaller than
        FULL_SAMPLE_BYTES (a transfer's small first chunk, timed mostly on call overhead)
        moves the estimate in proportion."""
        if old is None:
            return value
        return old + self._gain * min(1.0, nbytes / FULL_SAMPLE_BYTES) * (value - old)

    def observe_size(self, codec: str, fp16_bytes: int, wire_bytes: int) -> None:
        """Feed one measured size ratio (entropy stages vary with the data)."""
        if codec not in self._ratio or fp16_bytes <= 0 or wire_bytes <= 0:
            return
        ratio = wire_bytes / fp16_bytes
        self._ratio[codec] += self._gain * (ratio - self._ratio[codec])

    def delivered_rate(self, codec: str, bandwidth_bps: float) -> float:
        """Expected fp16 KV bytes/s delivered with ``codec`` over ``bandwidth_bps``."""
        ratio = self._ratio[codec]
        link = bandwidth_bps / 8.0 / ratio
        speeds = [v for v in (self._speed[codec], self.decode_speed(codec)) if v is not None]
        if self._transport:
            speeds.append(1.0 / (ratio * self._transport))
        if not speeds:
            return link  # exact: nothing but the wire
        if self._pipeline == "full":
            return min(link, *speeds)
        cpu_cost = sum(1.0 / v for v in speeds)
        if self._pipeline == "cpu":
            return min(link, 1.0 / cpu_cost)
        return 1.0 / (1.0 / link + cpu_cost)

    def rates(self, bandwidth_bps: float) -> dict[str, float]:
        """Delivered KV bytes/s per codec, most precise first."""
        return {c: self.delivered_rate(c, bandwidth_bps) for c in self._by_precision}

    def choose(
        self,
        bandwidth_bps: float | None,
        *,
        remaining_bytes: int | None = None,
        time_left: float | None = None,
        app_limited: bool = False,
        now: float | None = None,
    ) -> CodecChoice:
        """Choose the codec for the next chunk.

        :param bandwidth_bps: the published bandwidth estimate; ``None`` (no estimate
            yet) picks the most precise codec.
        :param remaining_bytes: fp16 bytes of the transfer still to send, this chunk
            included; with ``time_left`` it selects deadline mode.
        :param time_left: seconds to the deadline.
        :param app_limited: the sender's samples are app-limited now (the encoder, not the
            path, sets the pace), so the estimate may be far below what the path carries.
        :param now: with it, once per ``probe_interval`` a chunk is a probe: while
            app-limited, a compact choice becomes raw (sent without encoding, it shows
            what the path delivers, so a path faster than the encoder stops being taken
            for a slow one; a link slower than the encoder keeps chunks queued, is never
            app-limited and never probed this way); a raw choice becomes the best compact
            codec, whose encode speed is measured again; before either, any choice may
            become another codec held back by its CPU costs and not sent for
            ``refresh_after`` seconds, so that its speeds are measured again too.
            Throughput mode only. Once :meth:`observe_delivered` has measured a codec's
            goodput, throughput mode with ``now`` chooses on measured goodput instead
            (the leader or an exploring stint, see the module docstring; such a stint's
            chunks are the probes then), with or without a bandwidth estimate.
        """
        deadline = remaining_bytes is not None and time_left is not None
        if now is not None and not deadline and self.meter.measured:
            known = bandwidth_bps is not None and bandwidth_bps > 0
            return self._choose_measured(self.rates(bandwidth_bps if known else math.inf), now)
        if bandwidth_bps is None or bandwidth_bps <= 0:
            first = self._by_precision[0]
            return CodecChoice(codec=first, delivered_bytes_per_s=math.nan, meets_deadline=None)
        rates = self.rates(bandwidth_bps)
        if deadline:
            assert remaining_bytes is not None and time_left is not None
            rates.update((c, r) for c, r in self.meter.measured.items() if c in rates)
            return self._choose_for_deadline(rates, remaining_bytes, time_left)
        best = max(rates.values())
        for codec in self._by_precision:
            if rates[codec] >= best * (1.0 - self._tolerance):
                break
        else:
            raise AssertionError("unreachable: the best codec is within tolerance of itself")
        probe = self._probe(codec, rates, bandwidth_bps, app_limited, now)
        if now is not None:
            self._sent_at[probe or codec] = now
        if probe is not None:
            return CodecChoice(codec=probe, delivered_bytes_per_s=rates[probe], meets_deadline=None, probe=True)
        return CodecChoice(codec=codec, delivered_bytes_per_s=rates[codec], meets_deadline=None)

    def _choose_measured(self, rates: Mapping[str, float], now: float) -> CodecChoice:
        """Throughput mode on measured goodput: the leader, or a stint of another codec
        (see the module docstring)."""
        if self._stint is not None and self._stint_left > 0:
            self._stint_left -= 1
            return self._measured_choice(self._stint, rates, probe=True)
        self._stint = None
        measured = self.meter.measured
        if self._leader in measured:  # a challenger must beat the leader by more than noise
            measured[self._leader] *= 1.0 + self._hysteresis
        best = max(measured.values())
        leader = next(c for c in self._by_precision if measured.get(c, -1.0) >= best * (1.0 - self._tolerance))
        if leader != self._leader:
            if self._leader is not None:  # it was fine until now: measured again soon
                self._wait[self._leader] = self._explore_after
                self._due[self._leader] = now + self._explore_after
            self._leader = leader
        # A stint whose sample has come in since: a codec behind the leader waits longer.
        for codec, samples in list(self._explored.items()):
            if self.meter.samples(codec) > samples:
                del self._explored[codec]
                rate, lead = self.meter.measured[codec], self.meter.measured[leader]
                wait = self._wait.get(codec, self._explore_after)
                ahead = codec == leader or rate >= lead * (1.0 - self._tolerance)
                wait = self._explore_after if ahead else min(2.0 * wait, self._explore_max)
                self._wait[codec], self._due[codec] = wait, now + wait
        due = [c for c in self._by_precision if c != leader and now >= self._due.get(c, -math.inf)]
        if due:
            # Never measured first, in the model's order; then the one waiting longest.
            unmeasured = [c for c in due if c not in measured]
            if unmeasured:
                codec = max(unmeasured, key=lambda c: rates[c])
            else:
                codec = min(due, key=lambda c: self._due[c])
            self._stint, self._stint_left = codec, self._stint_chunks - 1
            self._explored[codec] = self.meter.samples(codec)
            wait = self._wait.setdefault(codec, self._explore_after)
            self._due[codec] = now + wait  # again after a wait even if no sample comes
            return self._measured_choice(codec, rates, probe=True)
        return self._measured_choice(leader, rates, probe=False)

    def _measured_choice(self, codec: str, rates: Mapping[str, float], *, probe: bool) -> CodecChoice:
        rate = self.meter.rate(codec)
        return CodecChoice(codec=codec, delivered_bytes_per_s=rates[codec] if rate is None else rate,
                           meets_deadline=None, probe=probe)

    @property
    def leader(self) -> str | None:
        """The codec measured goodput favours now (``None`` before the first measurement)."""
        return self._leader

    def _probe(
        self, chosen: str, rates: Mapping[str, float], bandwidth_bps: float, app_limited: bool, now: float | None,
    ) -> str | None:
        """A codec to send one chunk with instead of ``chosen``, to refresh what the
        choice rests on, at most once per ``probe_interval``:

        * a compact codec chosen while app-limited, whose CPU work cannot put wire bytes
          out much faster than the estimate: raw, to see what the path carries (the
          estimate may be only the encoder's pace; a link the encoder easily outruns is
          app-limited only briefly, when a transfer starts, and is not probed);
        * raw chosen: the best compact codec, so that its encode speed is measured again
          (a speed measured on a busy host would otherwise keep it out forever);
        * before either, another codec held back by its CPU costs (not by the wire), not
          sent for ``refresh_after`` seconds, whose rate by the model is at least
          ``refresh_share`` of the chosen one's (the one sent longest ago first): its speeds
          were measured in another moment of the host, and a chooser that never sends it
          again would keep a slow measurement for good.
        """
        if now is None or len(rates) < 2:
            return None
        if self._last_probe is not None and now - self._last_probe < self._probe_interval:
            return None
        free = self._by_precision[0]
        # A stale contender first: it comes up once per refresh_after, the others may
        # take every interval.
        probe = self._stale_contender(chosen, rates, bandwidth_bps, now)
        if probe is None and self._is_free(free):
            if chosen == free:
                probe = max((c for c in rates if c != free), key=lambda c: rates[c])
            elif app_limited:
                cpu_wire = self.delivered_rate(chosen, math.inf) * self._ratio[chosen]  # wire bytes/s
                if cpu_wire <= 1.5 * bandwidth_bps / 8.0:
                    probe = free
        if probe is not None:
            self._last_probe = now
        return probe

    def _stale_contender(
        self, chosen: str, rates: Mapping[str, float], bandwidth_bps: float, now: float,
    ) -> str | None:
        """The codec sent longest ago (never sent first; precision breaks ties) among those
        not sent for ``refresh_after`` seconds, rated at least ``refresh_share`` of
        ``chosen`` and held back by their CPU costs rather than the wire (only a CPU speed
        measured again can change their rate)."""
        floor = self._refresh_share * rates[chosen]
        stale = [
            c for c in self._by_precision
            if c != chosen and not self._is_free(c) and rates[c] >= floor
            and rates[c] < (1.0 - self._tolerance) * bandwidth_bps / 8.0 / self._ratio[c]
            and now - self._sent_at.get(c, -math.inf) >= self._refresh_after
        ]
        return min(stale, key=lambda c: self._sent_at.get(c, -math.inf)) if stale else None

    def _is_free(self, codec: str) -> bool:
        """No encode or decode cost and nothing saved on the wire: raw."""
        return self._speed[codec] is None and self._decode[codec] is None and self._ratio[codec] >= 1.0

    def _choose_for_deadline(
        self, rates: Mapping[str, float], remaining_bytes: int, time_left: float
    ) -> CodecChoice:
        budget = time_left / (1.0 + self._deadline_margin)
        if budget > 0:
            for codec in self._by_precision:
                if remaining_bytes <= rates[codec] * budget:
                    return CodecChoice(
                        codec=codec, delivered_bytes_per_s=rates[codec], meets_deadline=True
                    )
        # No codec makes it: the fastest one misses by the least.
        fastest = max(self._by_precision, key=lambda c: rates[c])
        return CodecChoice(
            codec=fastest, delivered_bytes_per_s=rates[fastest], meets_deadline=False
        )
