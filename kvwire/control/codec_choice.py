"""The ``auto`` codec: pick per chunk the codec that delivers the most KV per second.

A codec that shrinks the cache by ``size_ratio`` (wire bytes / fp16 bytes) lets a link
of ``B`` bytes/s carry ``B / size_ratio`` bytes of fp16 KV per second, but every byte is
also encoded by the sender and decoded by the receiver, and every wire byte costs the
transport CPU too. Per fp16 byte the end-to-end cost has four parts: wire
``size_ratio / B``, encode ``1 / encode speed``, decode ``1 / decode speed`` and
transport ``size_ratio x transport cost`` (the sender's own CPU seconds per wire byte,
measured as it sends, for each codec apart: :meth:`CodecChooser.observe_transport`; left
out until measured; a codec not measured yet is charged the cost measured while others
were sent, per wire byte, or on a shared host up to raw's per fp16 byte: see
:meth:`CodecChooser._send_cost`).
How they combine is the ``pipeline`` setting:

* ``"hosts"`` (default): each host's CPU work adds up, the sender's (encode and its
  transport) on its ``cores`` and the receiver's (decode and its transport, reported in
  its REPORTs) on its event loop's thread; with more than one core the sender's encoder
  chain (a worker thread) and its loop are stages of their own too, and a receiver on
  the same host (:meth:`CodecChooser.observe_shared_host`) adds its work to the
  sender's budget, which is then no more than the CPU the path shows the two ends get
  (see :meth:`CodecChooser._budget_cores`). The hosts and the wire overlap, and the
  slowest stage bounds the rate (of a codec that encodes or decodes, stages bend it
  below the slowest when they are close: :data:`STAGE_COUPLING`). On a path whose
  "wire" is itself CPU (loopback, a host where the transport is CPU-bound) the
  transport term is what keeps quantizing from looking free; on a real link the CPU
  work hides behind the wire.
* ``"cpu"``: the wire overlaps the CPU work; encode, decode and the sender's transport
  add (one CPU budget, as if one host did all of it). Over a 10 Gbit/s veth link between
  two processes it charged the receiver's decode to the sender and kept int8 where int4
  delivered 15% more (docs/benchmarks.md).
* ``"serial"``: everything adds, the wire too: the pessimistic bound.
* ``"full"``: every stage overlaps; the slowest bounds the rate (separate, idle hosts).

Delivered KV = 1 / cost. Raw has no encode or decode, so it is chosen whenever it is at
least as fast as the best (within ``tolerance``, precision first): ``auto`` never lowers
KV goodput by the model's measure. On a fast link the raw bytes win; on a slow one a
compact codec does. The one exception is deliberate: given ``now``, once per
``probe_interval`` a chunk may be a probe that refreshes a measurement the model rests on
(the path's rate while an encoder paces the sender: a short run of raw chunks, a round
trip of the path long; a compact codec's encode speed while raw is chosen; the speeds of
a codec not sent for a while; see :meth:`CodecChooser.choose`).

What the wire term rests on is the bandwidth estimate, and an estimate taken while the
sender, not the path, set the pace (app-limited: an encoder, a CPU shared with other
work, a transfer's first round trips) is a floor of the path's rate, not its ceiling.
So the model takes the path's rate as the estimator's peak while the path sets the
pace on a short path (``peak_bps``; the published estimate is a mean over half a second,
which on a long path spans many round trips and is kept; a peak more than
:data:`PEAK_OVER_ESTIMATE` times the estimates of the last :data:`ESTIMATE_MEMORY`
seconds is one the path no longer carries, and counts at that) and, while app-limited,
as at least that rate when the path last set the pace; raw, sent first on
a short path, stays chosen while the sender limits, until the path's rate stops
growing (BBR's full pipe, :data:`FILL_CHUNKS`) and, on a path known to be short, until
the transport's cost is first measured; and a less precise codec must beat the
one sent until now by ``hysteresis``, and a more precise one other than raw be rated at
least as fast as it (within ``tolerance`` of the best is not enough: the codec sent is
measured chunk by chunk, the others keep their last figure, moved as the host moves the
codec sent: see :meth:`CodecChooser.observe_encode`), so that codecs the model rates
within noise of each other do not take turns chunk by chunk (the codec so kept gives way
to the most precise one the model rates at least as fast as it: raw, where the wire
alone rates it so).

With a deadline the aim changes: keep as much precision as the deadline allows, so the
chooser walks from the most precise codec down and stops at the first that finishes in
time.

With ``measure_goodput`` (``ClientOptions.auto_codec="measured"``), measured goodput
decides once there is any. The model's inputs are measured one stage at a time, and on a
loaded host they add up wrongly (a speed measured while the host was busier keeps a codec
out). So the transport also feeds the acknowledgement of every chunk
(:meth:`CodecChooser.observe_delivered`), and a
:class:`~kvwire.control.goodput.GoodputMeter` turns them into each codec's measured KV
goodput, end to end. From the first measurement on, throughput mode sends the most
precise codec within ``tolerance`` of the best *measured* rate (the leader), and now and
then explores another codec for a stint, until the meter has a new sample of it (at most
``stint_max`` chunks or :data:`STINT_ROUND_TRIPS` round trips of the path, whichever is
longer; a stint that ended without a sample drops the codec's old rate, which then
decides nothing until it is measured again): a codec never measured first (in the model's order), then each in
turn once its wait has passed. Waits are counted in chunks, so exploring costs the same
share on every link. A codec measured within tolerance of the leader waits
``explore_after`` chunks; one behind waits twice as long as the last time, and once
measured further behind than a sample's noise (``SAMPLE_NOISE``) twice in a row (once, if
it was measured at its wire bound: the path set that pace, not a moment of the host, or
below ``HOPELESS`` of the leader: no sample's noise explains that), long
enough that its stints cost at most ``explore_cost`` of the chunks in between (a stint of
a codec at half the leader's rate costs its length again), up to ``explore_max``. A
codec never measured that the model, calibrated by the codecs measured, rates below
``explore_floor`` of the leader waits as if so measured, and a codec the path could not
carry as fast as the leader even at ``ESTIMATE_HEADROOM`` times the bandwidth estimate
(``B / size_ratio``: raw on a slow link) is not explored at all while that holds: its
stints would cost the most and cannot win. The estimate bounds the wire there (and in
the model's rate of a codec never measured) only while the path sets the pace: while the
sender does (app-limited: the leader's encoder slower than the path), it is the leader's
own pace, a floor of what the path carries, and raw waits only as any codec behind does
(over a 40 Gbit/s path that fell to 2 for two seconds, int4 led at its encoder's 2 GB/s
once the path was back, the estimate its 6 Gbit/s of wire, and raw, which delivered
5 GB/s, was never explored again). A challenger must beat the
leader by ``hysteresis`` more than the rule says. A leader whose rate falls below another
codec's last measurement (by that much) hands over at once, and the new leader is
measured all the time it is sent; so neither a stale high nor a stale low measurement
lasts longer than one stint or one wait. A wait holds only while the path is no faster
than it has been since the measurement: once the estimate is :data:`PATH_GROWTH` times
the lowest one since (of those taken while the path set the pace), the codec waits
``explore_after`` chunks from then, however long its wait was (raw, measured as a
40 Gbit/s path fell to 2, waited 2,560 chunks, 4.5 s, once it was back). The model still
makes the first choice (before any acknowledgement), orders the codecs never measured, and makes deadline choices (with
measured rates in place of its own where there are any).

Codecs are named by string; the chooser never imports them. Encode speeds are measured
by the transport and fed back through :meth:`CodecChooser.observe_encode`. Decode speeds
are measured by the receiver, which says what decoding costs it in its REPORT frames
(docs/protocol.md 4.10; ``kvwire.aio`` feeds them to :meth:`CodecChooser.observe_decode`,
the first replacing the prior). Until then they are the priors (measured on the sender
at connect), scaled down as the measured encode slows (:meth:`decode_speed`). The
receiver's CPU per wire byte (:meth:`CodecChooser.observe_receiver_transport`, from the
same REPORTs) counts on the receiver's host (``pipeline="hosts"``, and ``"full"``: the
receiver's event loop receives and decodes, so its rate is bounded by both together)
and adds to the total in ``"serial"``; the one CPU budget of ``"cpu"`` leaves it out: it
models the sender's host, and on loopback, where each side has a core of its own,
counting the receiver's transport there made ``auto`` take int8 over raw at half raw's
rate (docs/benchmarks.md).

A measurement that is no number (NaN, an infinity, a negative time or cost) is ignored
by the ``observe_*`` methods: kept in a moving average, it stayed there for good and
made :meth:`CodecChooser.choose` fail. The constructor refuses a size ratio or prior
speed that is not a finite number > 0 with ``ValueError``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvwire.control.goodput import GoodputMeter

__all__ = ["CodecCandidate", "CodecChoice", "CodecChooser"]

_PIPELINES = ("serial", "cpu", "hosts", "full")


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecCandidate:
    name: str
    size_ratio: float
    """Wire bytes per fp16 byte (1.0 for raw, about 0.52 for fp8 with per-(token, head)
    scales, 0.375 for int4 with groups of 32: codes 0.25, scales and minimums 0.125); a
    finite number > 0 (:class:`CodecChooser` refuses another with ``ValueError``)."""
    encode_bytes_per_s: float | None = None
    """Prior encode speed in fp16 input bytes/s, a finite number > 0; ``None`` = not yet
    measured (treated as unlimited, so an unmeasured codec gets tried and measured)."""
    precision: int | None = None
    """Rank for deadline mode, higher is more precise; default: by ``size_ratio``."""
    decode_bytes_per_s: float | None = None
    """Prior decode speed on the receiver in fp16 output bytes/s, a finite number > 0;
    ``None`` = free (raw lands in place and has nothing to decode)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CodecChoice:
    codec: str
    delivered_bytes_per_s: float
    """Expected fp16 KV bytes/s delivered with this codec."""
    meets_deadline: bool | None
    """``None`` when no deadline was given, or nothing is measured yet to judge it by."""
    probe: bool = False
    """Sent to measure the path, not because it is the best: see :meth:`CodecChooser.choose`."""


#: Share of the leader's measured goodput below which the model's best codec with CPU
#: costs is not explored at once while no such codec is measured (see ``_choose_measured``).
UNCALIBRATED_FLOOR = 0.1
#: A codec that fills the wire has CPU to spare, by how much is not known: the model's
#: CPU rates of the codecs not measured are scaled as if it had this much
#: (``CodecChooser._calibrated``).
WIRE_HEADROOM = 2.0
#: How far the bandwidth estimate may be below what the path carries (it measures what was
#: sent, and an encoder may have set that pace): a codec is not explored while the path
#: could not carry it as fast as the leader even at this many times the estimate.
ESTIMATE_HEADROOM = 2.0
#: A codec waits what its last measurement says only while the bandwidth estimate stays
#: below this many times the lowest one since that measurement (of the calls on which the
#: path set the pace): a path that grew this much since may carry it faster than it was
#: measured (raw, measured as a path fell, on the way down), and its wait is cut to
#: ``explore_after`` chunks from then (see ``CodecChooser._choose_measured``). The
#: estimate is a mean over half a second, far steadier than this; a goodput sample is not:
#: cut each time the leader's rate moved by this much, the waits of the pipelines of
#: tests/control/test_codec_chooser_measured.py cost up to 23% of their goodput in
#: stints (a stint's first sample there read twice the rate of the next).
PATH_GROWTH = 2.0
#: Round trips of the path (:meth:`CodecChooser.observe_path_rtt`) an exploring stint
#: lasts at least, unless its codec has a sample first: its first acknowledgement comes
#: a round trip after it began, behind the chunks the leader left in flight, and a
#: sample takes ``sample_acks`` more (over 100 ms, int4's stints of 64 chunks, 135 ms at
#: its encoder's 2 GB/s, ended before any of their acknowledgements).
STINT_ROUND_TRIPS = 3.0
#: How far behind the leader one goodput sample may put a codec as good as the leader (on
#: two loaded cores a sample of 8 chunks varies by 10-20%, more while a transfer starts).
SAMPLE_NOISE = 0.25
#: A codec measured below this share of the leader's goodput is behind for good, not by a
#: sample's noise: one such stint is enough to wait what its stints cost (a second one
#: of a codec ten times slower cost 12% of 1024 chunks in the fake-time pipeline).
HOPELESS = 0.25

#: A path whose round trip before any data is at least this long (seconds) is another host
#: across a network (a metro or wide-area path), not loopback or a data center: the first
#: window goes out with the most compact codec (see :meth:`CodecChooser.observe_path_rtt`).
#: Well above what a loaded host's loop takes to answer on loopback (its clock may tick in
#: whole milliseconds).
LONG_PATH_RTT = 0.005

#: On a short path the wire is rated at the estimator's peak while the path sets the pace
#: (see :meth:`CodecChooser.choose`), but at no more than this many times the highest
#: estimate published in the last :data:`ESTIMATE_MEMORY` seconds while it set the pace.
#: The peak is what the path carried in its last ten round trips; after a drop in
#: capacity it reads the old rate for as long as those round trips take behind the queue
#: the old rate built, long after the estimate (a mean over half a second) followed the
#: drop: 40 Gbit/s until 1.7 s after a 2 ms path fell to 2, and raw was kept there at
#: 0.27 GB/s of KV where int4 delivered 0.67. A mean below the peak for a reason other
#: than the path's is within this of it (a burst of small transfers, each with its first
#: round trips in it, read 13 Gbit/s of a loopback whose peak was 25).
PEAK_OVER_ESTIMATE = 3.0
#: Seconds of published estimates whose highest bounds the peak (:data:`PEAK_OVER_ESTIMATE`):
#: an estimate that fell for a moment does not, one that stayed down this long does.
ESTIMATE_MEMORY = 0.25

#: Raw, sent first on a short path, stays chosen until the path's rate (measured while the
#: path, not the sender, set the pace) has grown by less than FILL_GROWTH over this many
#: chunks in a row: BBR's test for a full pipe, counted in chunks (about a round trip
#: each where a chunk is larger than the path's bandwidth-delay product).
FILL_CHUNKS = 3
FILL_GROWTH = 1.25

#: How far above 1 a runnable share may read (a thread's run and wait times against the
#: clock, read a moment apart) and still count, as 1.
RUNNABLE_SLACK = 0.05

#: A runnable share at least this high counts as 1: the loop waited for a CPU, not for
#: the path. Two processes on two busy cores wait for each other now and then (raw's loop
#: runnable 0.82-0.96 of the time over a busy loopback), and each such wait, divided out
#: of the budget (:meth:`CodecChooser._budget_cores`), gave the compact codecs a bonus of
#: as much over raw, which delivered 10-30% more than they did. An emulated link on this
#: host holds the loop far longer (runnable 0.16-0.21 of the time at 10 Gbit/s, 0.50-0.64
#: with the host's two cores saturated).
CPU_BOUND_SHARE = 0.8

#: A raw probe of an app-limited path (see ``CodecChooser._probe``) is a run of raw chunks
#: that lasts a round trip of the path, so that its last chunk's sample is measured from a
#: raw chunk's send: one raw chunk among a compact codec's is measured at the rate sent
#: over the round trip before it, mostly the encoder's (14 Gbit/s of a 40 Gbit/s path
#: where int4's encoder sent 6: raw, rated at that, stayed below int4 for good). A run of
#: D seconds is followed by at least D / RAW_RUN_SHARE seconds before the next raw probe,
#: so that on a long path such runs take at most this share of the time (at 0.05, runs of
#: 20 ms over a 10 Gbit/s path cost 3% of int4's goodput in a fake-time pipeline).
RAW_RUN_SHARE = 0.02

#: fp16 bytes of an encode or decode measurement that counts as a whole EWMA sample.
FULL_SAMPLE_BYTES = 1 << 20
#: The most a codec's encode prior may weigh in its figure for a change of the figure to
#: move the codecs not sent (:meth:`CodecChooser.observe_encode`): the prior, measured
#: in cache at connect, is no moment of the host, and a figure still leaving it moves by
#: the prior's error, not the host's load (priors twice the true speeds, int4's first
#: chunks then pulled int8 to 0.69 of its speed and int4 kept a 10% slower codec for 4 s).
PRIOR_LEFT = 0.1
#: A codec rated above the one chosen, or within ``hysteresis`` below it, is refreshed (a probe chunk that
#: measures it again, :meth:`CodecChooser._probe`) after this share of ``refresh_after``:
#: a figure of a codec not sent follows the host with the codec sent
#: (:meth:`CodecChooser.observe_encode`), and only its own measurements correct how it
#: compares with it, which decides the choice only for a codec so close; by the model such
#: a probe costs about the hysteresis of one chunk's time. In a fake-time simulation
#: (benchmarks/codec_choice_sim.py) the true rate of the codecs sent rose in ten of eleven
#: scenarios against refreshing every contender after ``refresh_after`` (most, from 0.979
#: to 0.988 of the best, where the faster codec changed half-way; the eleventh 0.001 lower).
NEAR_REFRESH = 0.5

#: How sharply the rate of a codec that encodes or decodes bends below its slowest stage
#: (``pipeline="hosts"``): ``(sum of rate ** -STAGE_COUPLING) ** (-1 / STAGE_COUPLING)``
#: over its stages. An encoder whose speed swings chunk by chunk, with a
#: few chunks of buffer between it and the wire, leaves the wire idle for part of the
#: time when the two rates are close (a tandem queue's throughput is below its slowest
#: stage's, the most when the stages are equal): over a 10 Gbit/s, 20 ms link the 8-bit
#: codecs, rated by their slowest stage at 19 Gbit/s (the wire) with their sender's CPU at
#: 21, delivered 16.5-16.8, while int4, whose wire is twice as far, delivered what its
#: CPU was rated at (docs/benchmarks.md). At 4, two equal stages deliver 0.84 of either;
#: a stage twice as fast as the slowest costs it 1.5%. Raw has no encoder: the slowest
#: of its stages bounds it (on loopback its "wire" is the same CPU as its transport).
STAGE_COUPLING = 4.0


def _positive(value: float) -> bool:
    """A finite number > 0 (NaN is not)."""
    return 0 < value < math.inf


def _speed(nbytes: int, seconds: float) -> float | None:
    """Bytes/s of ``nbytes`` in ``seconds`` (under a nanosecond counts as one); ``None``
    when that is no speed: ``nbytes`` not > 0, ``seconds`` negative or not finite."""
    if not (nbytes > 0 and 0 <= seconds < math.inf):
        return None
    speed = nbytes / max(seconds, 1e-9)
    return speed if _positive(speed) else None


def coupled(rates: Iterable[float]) -> float:
    """The rate of stages of ``rates`` in a pipeline with little buffering between them
    (:data:`STAGE_COUPLING`); an infinite rate (a stage with no cost) drops out, a stage
    that moves nothing stops the pipeline."""
    rates = list(rates)
    slowest = min(rates)
    if slowest <= 0:
        return 0.0
    if slowest == math.inf:
        return math.inf
    # Relative to the slowest stage, so that a rate far below 1 (a stage whose cost was
    # measured absurdly high) does not overflow its power: each term is in (0, 1].
    total = math.fsum((r / slowest) ** -STAGE_COUPLING for r in rates)
    return float(slowest * total ** (-1.0 / STAGE_COUPLING))


class CodecChooser:
    """Chooses a codec per chunk from the bandwidth estimate and measured encode speeds."""

    def __init__(
        self,
        candidates: Iterable[CodecCandidate],
        *,
        tolerance: float = 0.02,
        speed_gain: float = 0.25,
        deadline_margin: float = 0.1,
        pipeline: str = "hosts",
        probe_interval: float = 0.1,
        refresh_after: float = 1.0,
        refresh_share: float = 0.5,
        stint_max: int = 64,
        explore_after: int = 80,
        explore_max: int = 2560,
        explore_cost: float = 0.01,
        hysteresis: float = 0.05,
        explore_floor: float = 0.5,
        measure_goodput: bool = False,
        meter: GoodputMeter | None = None,
        cores: int = 1,
    ) -> None:
        """
        :param tolerance: in throughput mode, a more precise codec within this fraction
            of the best delivered rate is preferred (once a codec is sent, only raw
            takes over from it so; see ``hysteresis``).
        :param speed_gain: EWMA gain for encode-speed and size-ratio measurements, in (0, 1].
        :param deadline_margin: in deadline mode, a codec must finish this fraction ahead
            of the deadline to count as meeting it, absorbing estimate noise.
        :param pipeline: how wire, encode, decode and transport costs combine:
            ``"hosts"``, ``"cpu"``, ``"serial"`` or ``"full"`` (see the module docstring).
        :param probe_interval: seconds between probes (see :meth:`choose`).
        :param refresh_after: seconds after which a codec not sent since, and held back
            by its CPU costs rather than the wire, is a contender for a probe chunk that
            measures it again (see :meth:`choose`; :data:`NEAR_REFRESH` of it for one
            rated above the chosen codec or within ``hysteresis`` below it) ...
        :param refresh_share: ... if its delivered rate, by the model, is at least this
            share of the chosen codec's (one far behind is not worth a chunk).
        :param stint_max: most chunks of one exploring stint (measured goodput, see the
            module docstring), which otherwise lasts until the meter has a new sample of
            its codec; on a long path it lasts :data:`STINT_ROUND_TRIPS` round trips
            at least, unless the sample comes first.
        :param explore_after: chunks a codec waits for its next stint after one that
            measured it within ``tolerance`` of the leader ...
        :param explore_max: ... doubling after each stint that measured it behind, up to
            this; once measured far behind twice in a row, at least as long as makes its
            stints cost ``explore_cost`` of the chunks in between (a codec far behind
            costs more per stint). Counted in chunks, not seconds, the share spent
            exploring is the same on every link.
        :param explore_cost: see ``explore_max``.
        :param hysteresis: the model changes to a less precise codec only for one it
            rates faster than the codec sent until now by more than this fraction
            (to a more precise one only for one it rates at least as fast as the
            codec sent until now, within ``tolerance`` of the best not being enough,
            except raw, which takes over within ``tolerance`` of the best);
            measured goodput changes the leader only once the leader
            loses by this fraction more than the rule says (samples vary).
        :param explore_floor: a codec never measured, rated by the model (calibrated by the
            codecs measured, see :meth:`_model_scale`) below this share of the leader's
            measured goodput, is not explored at once but after the wait a stint of it
            would cost (``explore_cost``).
        :param measure_goodput: choose on measured goodput once there is any (the caller
            feeds :meth:`observe_delivered`); until the first measurement the model's
            choice goes unprobed, so that its first run is measured. ``False`` (the
            default): the model alone, with its probes (see :meth:`choose`);
            :meth:`observe_delivered` is then ignored.
        :param meter: the goodput meter fed by :meth:`observe_delivered` (default: a
            :class:`~kvwire.control.goodput.GoodputMeter` with its defaults).
        :param cores: CPUs the sender's work may use (``pipeline="hosts"``). With one,
            its encodes and its transport add up on one budget; with more, the encodes
            (a chain on a worker thread) and the transport (the event loop's thread) each
            bound the rate apart, and together ``cores`` times one budget; see
            :meth:`observe_shared_host` for a receiver on the same host.
        """
        ordered = list(candidates)
        if not ordered:
            raise ValueError("at least one codec candidate is needed")
        names = [c.name for c in ordered]
        if len(set(names)) != len(names):
            raise ValueError("codec names must be unique")
        for c in ordered:
            # NaN passes ``<= 0``: kept, it made every rate NaN and choose() fail for good.
            if not _positive(c.size_ratio):
                raise ValueError(f"{c.name}: size_ratio must be a finite number > 0, got {c.size_ratio!r}")
            for prior, field in ((c.encode_bytes_per_s, "encode_bytes_per_s"),
                                 (c.decode_bytes_per_s, "decode_bytes_per_s")):
                if prior is not None and not _positive(prior):
                    raise ValueError(f"{c.name}: {field} must be a finite number > 0 or None, got {prior!r}")
        self._ratio = {c.name: c.size_ratio for c in ordered}
        self._speed: dict[str, float | None] = {c.name: c.encode_bytes_per_s for c in ordered}
        self._decode: dict[str, float | None] = {c.name: c.decode_bytes_per_s for c in ordered}
        # Priors measured together (same host, same moment): while a decode prior has not
        # been replaced by a measurement, it slows down as the measured encode does, so a
        # host that got busier since the priors were taken does not keep an idle decoder.
        self._encode_prior: dict[str, float | None] = {c.name: c.encode_bytes_per_s for c in ordered}
        self._decode_observed: set[str] = set()
        # The input count (_inputs, below) at each codec's latest encode measurement; the
        # codecs whose figure another's moved since their latest; each figure's share of
        # its prior (observe_encode)
        self._encoded_at: dict[str, int] = {}
        self._moved: set[str] = set()
        self._prior_left = {c.name: 1.0 if c.encode_bytes_per_s is not None else 0.0 for c in ordered}
        self._transport: float | None = None  # sender CPU seconds per wire byte
        self._transport_by: dict[str, float] = {}  # the same, measured while each codec was sent
        self._raw_runnable: float | None = None  # the sender loop's runnable share while raw was sent
        self._path_rtt: float | None = None  # the shortest round trip seen (observe_path_rtt)
        self._receiver_transport: float | None = None  # receiver CPU seconds per wire byte
        # The model's inputs change only through the observe_* methods; each counts here,
        # and rates() answers again from its last result while neither they nor the
        # bandwidth asked about changed (with raw sent, most chunks: a choice's four rates
        # cost about a sixth of the sender's Python per chunk).
        self._inputs = 0
        self._rates_for: tuple[int, float] | None = None
        self._rates: dict[str, float] = {}
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
        if not probe_interval > 0:
            raise ValueError(f"probe_interval must be positive, got {probe_interval!r}")
        if not 0 < speed_gain <= 1:
            raise ValueError(f"speed_gain must be in (0, 1], got {speed_gain!r}")
        for value, name in ((tolerance, "tolerance"), (hysteresis, "hysteresis"), (explore_cost, "explore_cost")):
            if not 0 <= value < 1:
                raise ValueError(f"{name} must be in [0, 1), got {value!r}")
        if not 0 <= deadline_margin < 1:
            raise ValueError(f"deadline_margin must be in [0, 1), got {deadline_margin!r}")
        self._probe_interval = probe_interval
        self._last_probe: float | None = None
        # A raw probe run of an app-limited path: (when it began, when its latest chunk was chosen)
        self._raw_run: tuple[float, float] | None = None
        self._raw_probe_after = -math.inf  # no raw probe of the path before this time
        if not refresh_after > 0 or not 0 < refresh_share <= 1:
            raise ValueError("refresh_after must be positive and refresh_share in (0, 1]")
        self._refresh_after = refresh_after
        self._refresh_share = refresh_share
        self._sent_at: dict[str, float] = {}  # when choose() last returned each codec
        self._tolerance = tolerance
        self._gain = speed_gain
        self._deadline_margin = deadline_margin
        if stint_max < 1 or explore_after < 1 or explore_max < explore_after or explore_cost <= 0:
            raise ValueError("need stint_max >= 1, 1 <= explore_after <= explore_max and explore_cost > 0")
        self._explore_cost = explore_cost
        self._stint_max = stint_max
        self._explore_after, self._explore_max = explore_after, explore_max
        self.meter = meter if meter is not None else GoodputMeter()
        # The codec being explored: (name, the meter's samples of it then, the chunk count
        # and the time then)
        self._stint: tuple[str, int, int, float] | None = None
        self._chosen = 0  # chunks chosen on measured goodput
        self._wait: dict[str, int] = {}  # each codec's wait between stints now, in chunks
        self._due: dict[str, int] = {}  # the chunk count from which its next stint may start
        self._leader: str | None = None
        self._stint_len: int | None = None  # chunks the last stint with a sample took
        self._far: dict[str, int] = {}  # stints in a row that measured a codec far behind
        self._model_due: dict[str, int] = {}  # never measured, far behind by the model: when due
        self._low_since: dict[str, float] = {}  # the lowest estimate since each codec was measured
        self._hysteresis = hysteresis
        if not 0 <= explore_floor <= 1:
            raise ValueError("explore_floor must be in [0, 1]")
        self._explore_floor = explore_floor
        self._measure = measure_goodput
        if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
            raise ValueError("cores must be an int >= 1")
        self._cores = cores
        self._shared_host = False  # the receiver runs on this host (observe_shared_host)
        self._held: str | None = None  # the last choice in throughput mode, probes aside
        self._path_bps: float | None = None  # the path's rate when it last set the pace
        self._filling = False  # raw went first, the path's rate still grows (FILL_CHUNKS)
        self._fill_bps, self._fill_count = 0.0, 0
        # (since, estimate) of the calls on which the path set the pace on a short path,
        # each higher than those after it; since: the time of the first call after the one
        # before it (the calls between, lower, were dropped) (_recent_estimate)
        self._estimates: deque[tuple[float, float]] = deque()

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
        """Feed one measured encode: ``nbytes`` of fp16 input took ``seconds`` (under a
        nanosecond counts as one). A measurement that is no speed is ignored: ``nbytes``
        not > 0, ``seconds`` negative or not a finite number (a NaN kept in the moving
        average stayed there for good, and a negative time read as 1 ns).

        In the model (not with ``measure_goodput``), the change of a codec's figure also
        scales the figures of the codecs measured before its previous measurement and not
        since: the speeds of codecs encoding on one core move together with the host's
        load (int4 and int8 chunk by chunk on two loaded cores: correlated 0.7-0.8 over
        16-64 chunks, their ratio varying a third less than either speed), so a codec not
        sent follows the host as the codec sent shows it, rather than keep a figure from
        another moment of the host. Only a change that is the host's moves others: not a
        codec's first measurement, nor one while its prior (measured at connect, in cache)
        still weighs more than :data:`PRIOR_LEFT` in its figure, nor the measurement of a
        codec whose figure was itself moved since its previous one (a probe's correction
        of how it compares). A codec never measured keeps its prior."""
        speed = _speed(nbytes, seconds)
        if codec not in self._speed or speed is None:
            return
        old = self._speed[codec]
        new = self._blend(old, speed, nbytes)
        self._speed[codec] = new
        self._inputs += 1
        since = self._encoded_at.get(codec, 0)  # this codec's previous measurement (0: none)
        self._encoded_at[codec] = self._inputs
        own = codec not in self._moved  # its figure moved by nothing but its measurements
        self._moved.discard(codec)
        prior_left = self._prior_left[codec]  # the prior's share in ``old``
        self._prior_left[codec] = prior_left * (1.0 - self._weight(old, nbytes))
        if self._measure or not since or not own or prior_left > PRIOR_LEFT or old is None or not old > 0:
            return
        factor = new / old
        if not _positive(factor):
            return
        for other, at in self._encoded_at.items():
            figure = self._speed[other]
            if other != codec and at <= since and figure is not None:
                moved = figure * factor
                if _positive(moved):
                    self._speed[other] = moved
                    self._moved.add(other)

    def observe_decode(self, codec: str, nbytes: int, seconds: float) -> None:
        """Feed one measured decode: ``nbytes`` of fp16 output took ``seconds``; ignored,
        as :meth:`observe_encode` ignores one, if it is no speed."""
        speed = _speed(nbytes, seconds)
        if codec not in self._decode or speed is None:
            return
        prior = self._decode[codec]
        if codec not in self._decode_observed and nbytes >= FULL_SAMPLE_BYTES:
            prior = None  # a real measurement replaces the prior
        self._decode[codec] = self._blend(prior, speed, nbytes)
        self._decode_observed.add(codec)
        self._inputs += 1

    def observe_transport(self, wire_bytes: int, cpu_seconds: float, codec: str | None = None, *,
                          runnable: float | None = None) -> None:
        """Feed one measurement of the transport's own CPU: ``cpu_seconds`` spent sending
        ``wire_bytes`` (framing, checksums, the kernel's copy; not encoding), all or
        nearly all of them of ``codec`` when given; ``runnable``: the share of the
        measurement's time the sender's loop was running or waiting for a CPU, not for
        the path (kept from raw's measurements: see :meth:`_budget_cores`).

        What a wire byte costs depends on the codec: measured while int8 was sent, the
        sender's loop spent twice as much per wire byte as while raw was (a chunk's work
        is per fp16 byte as much as per wire byte: chunks hold the same tokens), and that
        figure, charged to raw, made raw look CPU-bound and kept int8 chosen at 0.7 of
        raw's rate. A codec's own measurement is used for it; one not yet measured takes
        the latest of any codec.

        A measurement with ``wire_bytes`` not > 0 or ``cpu_seconds`` negative or not a
        finite number is ignored; so is a ``runnable`` not in (0, 1] (a little above 1
        counts as 1: :data:`RUNNABLE_SLACK`)."""
        if not (wire_bytes > 0 and 0 <= cpu_seconds < math.inf):
            return
        cost = cpu_seconds / wire_bytes
        self._inputs += 1
        self._transport = self._blend(self._transport, cost, wire_bytes)
        if codec in self._ratio:
            self._transport_by[codec] = self._blend(self._transport_by.get(codec), cost, wire_bytes)
            free = codec == self._by_precision[0]
            if free and runnable is not None and 0.0 < runnable <= 1.0 + RUNNABLE_SLACK:
                share = 1.0 if runnable >= CPU_BOUND_SHARE else runnable
                self._raw_runnable = self._blend(self._raw_runnable, share, wire_bytes)

    def observe_shared_host(self) -> None:
        """The receiver runs on this host (loopback, or this host's own address): in
        ``pipeline="hosts"`` the two ends' CPU work shares the sender's ``cores``, its
        encodes and transport and the receiver's decode and transport on one budget of
        ``cores``, or of the CPU the path shows the two ends get, if less (see
        :meth:`_budget_cores`). (Rated as if each end had its host, the compact codecs'
        encoders beat raw over loopback, where raw delivered 40% more.)"""
        self._shared_host = True
        self._inputs += 1

    @property
    def cores(self) -> int:
        """CPUs the sender's work may use (the ``cores`` argument)."""
        return self._cores

    @property
    def shared_host(self) -> bool:
        """The receiver runs on this host (:meth:`observe_shared_host`)."""
        return self._shared_host

    def observe_path_rtt(self, seconds: float) -> None:
        """A round trip of the path: the connection's handshake (before any data, so with
        nothing queued), then the estimator's minimum as data flows; the shortest counts.
        On a path of at least :data:`LONG_PATH_RTT`, the choice before the first
        bandwidth estimate is the most compact codec instead of the most precise: see
        :meth:`choose`. A path found short after a long first round trip (a busy host's
        handshake over loopback took longer than that, and int4 went first and stayed)
        opens again as a short one, if raw's transport cost is not measured yet: raw,
        held until it is, and until the path's rate stops growing. (Not "any codec's
        cost": int4's, measured first on two busy cores while the data's round trips
        still read above the mark, kept raw from ever being sent, its cost then charged at
        int4's per wire byte, twice raw's.)"""
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        was_long = self._long_path()
        self._path_rtt = seconds if self._path_rtt is None else min(self._path_rtt, seconds)
        if was_long and not self._long_path() and not self._free_measured() and self._held is not None:
            self._held = self._by_precision[0]
            self._filling = self._fill_count < FILL_CHUNKS

    def observe_receiver_transport(self, seconds_per_byte: float) -> None:
        """Feed the receiver's reported CPU seconds per wire byte received, decoding
        excluded (each report is a measurement over an interval: one full EWMA sample)."""
        if seconds_per_byte > 0 and math.isfinite(seconds_per_byte):
            self._receiver_transport = self._blend(self._receiver_transport, seconds_per_byte, FULL_SAMPLE_BYTES)
            self._inputs += 1

    @property
    def receiver_transport_cost(self) -> float | None:
        """The receiver's reported CPU seconds per wire byte, ``None`` before a report."""
        return self._receiver_transport

    def observe_delivered(self, codec: str, kv_bytes: int, now: float, *, first_layer: bool = False,
                          held: bool = False, chunk: Hashable = None, wire_bytes: int = 0) -> None:
        """Feed one acknowledged chunk: ``kv_bytes`` of fp16 KV sent with ``codec``
        (``wire_bytes`` on the wire: a chunk sent in place of the chosen codec's is
        charged its wire bytes at the path's estimate, see :meth:`GoodputMeter.on_ack`)
        arrived (checked and decoded) at ``now``; ``first_layer``: a chunk of its
        transfer's first layer (paced by the receiver's first grant, see
        :meth:`GoodputMeter.on_ack`); ``held``: the sender holds data back now (the
        estimator's ``hold_limited``: a ProbeRTT drain and the round trip after it), so
        the acknowledgement measures no codec and ends the meter's run; ``chunk``: the
        chunk's key, as given to :meth:`observe_fallback` (its address). Ignored with ``now`` not a finite number or
        ``kv_bytes`` negative (a NaN time made the codec's measured rate NaN, and
        :meth:`choose` then failed)."""
        if self._measure and codec in self._ratio and kv_bytes >= 0 and math.isfinite(now):
            self.meter.on_ack(codec, kv_bytes, now, starts_run=not first_layer, held=held, chunk=chunk,
                              wire_bytes=wire_bytes)

    def observe_fallback(self, codec: str, chunk: Hashable, *, transfer: Hashable = None) -> None:
        """Chunk ``chunk`` (its address: the key its acknowledgement gives
        :meth:`observe_delivered`) goes out with ``codec`` in place of the codec chosen
        for it (raw for values the chosen quantizer refuses): with measured goodput its
        wire time at the path's estimate (:meth:`choose`'s) is taken out of the meter's
        run at its acknowledgement (:meth:`GoodputMeter.sent_instead`), which would
        otherwise count it as the chosen codec's. ``transfer``: its transfer
        (:meth:`observe_failed`)."""
        if self._measure and codec in self._ratio:
            self.meter.sent_instead(codec, chunk, transfer=transfer)

    def observe_failed(self, transfer: Hashable) -> None:
        """``transfer`` failed: its chunks told to :meth:`observe_fallback` are never
        acknowledged."""
        self.meter.forget_transfer(transfer)

    def observe_idle(self) -> None:
        """Nothing is left in flight or queued (the last transfer is done, or failed): the
        time until the next acknowledgement is no codec's."""
        self.meter.idle()

    @property
    def transport_cost(self) -> float | None:
        """Measured transport CPU seconds per wire byte, ``None`` before the first."""
        return self._transport

    def transport_cost_of(self, codec: str) -> float | None:
        """Transport CPU seconds per wire byte of ``codec``: its own measurement, else
        :attr:`transport_cost`."""
        return self._transport_by.get(codec, self._transport)

    def _send_cost(self, codec: str) -> float:
        """The sender's transport CPU seconds per fp16 byte of ``codec`` (0: not measured).

        Its own measurement per wire byte times its size ratio; else the transport's
        measured cost per wire byte times the ratio, the least it can cost: its chunks
        are the same chunks with fewer wire bytes, and much of a chunk's work (its
        frames, writes, acknowledgement, the loop's turns) does not shrink with them. On
        a shared host (:meth:`observe_shared_host`), where that work is the same CPU as
        the path's, a codec not yet measured is charged up to the most it can cost
        instead, raw's cost per byte (its size ratio 1), as far as the CPU, not the
        path, held raw back: in proportion to the share of the time raw's loop was
        runnable (``runnable`` of :meth:`observe_transport`; near all of it over
        loopback, 73-96% on two busy cores, where 80% or more counts as all of it,
        :data:`CPU_BOUND_SHARE`; over an emulated 10 Gbit/s link on this host
        16-21%, 50-64% while that host's two cores were saturated, 12% at 1 Gbit/s).
        Over loopback int4 cost the sender's loop 0.15-0.19 ns per fp16 byte sent alone,
        0.56-0.69 ns per wire byte against raw's 0.25-0.30 (docs/benchmarks.md); rated at
        its ratio times raw's, it looked faster than raw by the model and was chosen
        where raw delivered more. Over an emulated link (a proxy on this host, which the
        sender waits for) charged all of raw's per byte, int4 lost chunks to fp8 and int8
        that delivered less."""
        ratio = self._ratio[codec]
        own = self._transport_by.get(codec)
        if own is not None:
            return ratio * own
        raw, runnable = self._transport_by.get(self._by_precision[0]), self._raw_runnable
        if self._shared_host and raw is not None and runnable is not None:
            return raw * (ratio + (1.0 - ratio) * runnable)
        return ratio * self._transport if self._transport is not None else 0.0

    def _free_measured(self) -> bool:
        """Whether raw's own transport cost is measured (:meth:`observe_transport` with
        ``codec`` raw): until it is, raw is charged what other codecs cost per wire byte."""
        return self._by_precision[0] in self._transport_by

    def _blend(self, old: float | None, value: float, nbytes: int) -> float:
        """EWMA step of a speed or a cost, measured over ``nbytes``; a sample smaller than
        FULL_SAMPLE_BYTES (a transfer's small first chunk, timed mostly on call overhead)
        moves the estimate in proportion."""
        if old is None:
            return value
        weight = self._weight(old, nbytes)
        return (1.0 - weight) * old + weight * value  # between the two: never 0 from two speeds

    def _weight(self, old: float | None, nbytes: int) -> float:
        """The weight :meth:`_blend` gives a sample of ``nbytes`` against ``old``."""
        return 1.0 if old is None else self._gain * min(1.0, nbytes / FULL_SAMPLE_BYTES)

    def observe_size(self, codec: str, fp16_bytes: int, wire_bytes: int) -> None:
        """Feed one measured size ratio (entropy stages vary with the data), weighed by
        its size as the speeds are: int4 packs tokens in groups, and a chunk of one token
        measured 4.25 wire bytes per fp16 byte (0.375 in whole chunks); at a full
        sample's weight it made int4 look three times its size over a 1 Gbit/s link, where
        fp8 then took over, and a codec no longer sent is not measured again. Ignored
        unless both sizes are > 0 and their ratio a finite number."""
        if codec not in self._ratio or not (fp16_bytes > 0 and wire_bytes > 0):
            return
        ratio = wire_bytes / fp16_bytes
        if not _positive(ratio):
            return
        self._ratio[codec] = self._blend(self._ratio[codec], ratio, fp16_bytes)
        self._inputs += 1

    def delivered_rate(self, codec: str, bandwidth_bps: float) -> float:
        """Expected fp16 KV bytes/s delivered with ``codec`` over ``bandwidth_bps``."""
        ratio = self._ratio[codec]
        link = bandwidth_bps / 8.0 / ratio
        if not link > 0.0:
            return 0.0  # a positive bandwidth so small that its byte rate underflows carries nothing
        # CPU seconds per fp16 byte of each stage (0: free or not measured)
        encode, decode = self._speed[codec], self.decode_speed(codec)
        enc = 1.0 / encode if encode else 0.0
        dec = 1.0 / decode if decode else 0.0
        send = self._send_cost(codec)
        recv = ratio * self._receiver_transport if self._receiver_transport else 0.0
        if not (enc or dec or send or recv):
            return link  # exact: nothing but the wire
        if self._pipeline == "hosts":
            # Each host's CPU work adds up on its cores; the hosts and the wire overlap.
            return self._hosts_rate(link, enc, send, dec + recv, coded=bool(enc or dec),
                                    cores=self._budget_cores(bandwidth_bps))
        if self._pipeline == "full":
            # Every stage apart; the receiver's loop receives and decodes: one stage.
            stages = (encode, 1.0 / send if send else None, 1.0 / (dec + recv) if recv else decode)
            return min([link, *(v for v in stages if v)])
        cpu = enc + dec + send
        if self._pipeline == "cpu":
            return min(link, 1.0 / cpu) if cpu else link
        return 1.0 / (1.0 / link + cpu + recv)

    def _budget_cores(self, bandwidth_bps: float) -> float:
        """CPUs the sender's budget has (``pipeline="hosts"``): ``cores``; on a shared host
        (:meth:`observe_shared_host`) no more than the path at ``bandwidth_bps`` shows the
        two ends get.

        Between two processes on one host over loopback the "wire" is the same CPUs as
        everything else: carrying ``bandwidth_bps`` costs that many wire bytes a second
        times raw's transport cost per wire byte at both ends, and that is the CPU the
        two ends were seen to get, if the sender never waited for the path meanwhile. On
        an idle host the two processes had both cores, on a busy one about one core's
        worth between them; rated with both, int8 and int4 looked up to 70% faster than
        raw over a busy loopback, where raw delivered 30-40% more (docs/benchmarks.md).
        Rated with the CPU the path shows, a compact codec beats raw there only if its
        encode, decode and transport of its smaller wire bytes cost less CPU per fp16
        byte than raw's transport. Where the path is a link of its own (a shaped one, an
        emulator's proxy on this host) the sender waits for it much of the time, and the
        CPU it shows is a floor: so that CPU is divided by the share of the time raw's
        loop was runnable (``runnable`` of :meth:`observe_transport`). Capped at the CPU
        alone, ``auto`` sent raw over an emulated 10 Gbit/s link (its proxy on
        127.0.0.1) at 0.59 of int4's goodput. With a loop runnable half the time or more
        taken as held back by the CPU alone, it still did in 3 of 8 runs: there the
        emulator, sender and receiver saturated the two cores, raw's loop was runnable
        50-64% of the time, and the emulator's work, which a compact codec saves too, is
        not in the model. Over a busy loopback raw's loop was runnable 82-96% of the
        time, the two ends waiting for each other's CPU now and then: a share of
        :data:`CPU_BOUND_SHARE` or more counts as all of it, so the budget is what raw
        used (divided by such a share, it was up to a fifth more, and int8 and int4
        took most of the chunks in 7 of 12 runs, against 3 of 12 with the rule, where
        raw alone delivered 10-30% more). ``cores`` until raw's transport cost and that
        share are measured."""
        cores = float(self._cores)
        runnable, send = self._raw_runnable, self._transport_by.get(self._by_precision[0])
        if not self._shared_host or not math.isfinite(bandwidth_bps) or runnable is None or send is None:
            return cores
        used = bandwidth_bps / 8.0 * (send + (self._receiver_transport or 0.0))
        return min(cores, used / runnable)

    def _hosts_rate(self, link: float, enc: float, send: float, receiver: float, *, coded: bool,
                    cores: float) -> float:
        """``pipeline="hosts"``: the wire, the receiver's loop (its decode and transport:
        one thread) and the sender's budget of ``cores`` CPUs (the receiver's work on it
        too on a shared host); with more than one core (``self.cores``), the sender's
        encoder chain and its loop apart as well. Per fp16 byte: ``enc``, ``send`` and
        ``receiver`` seconds; ``coded``: the codec encodes or decodes (its stages are
        coupled)."""
        def rate(seconds: float, work: float = 1.0) -> float:
            return work / seconds if seconds else math.inf

        budget = enc + send + (receiver if self._shared_host else 0.0)
        stages = [link, rate(receiver), rate(budget, cores)]
        if self._cores > 1:
            stages += [rate(enc), rate(send)]
        return coupled(stages) if coded else min(stages)

    def rates(self, bandwidth_bps: float) -> dict[str, float]:
        """Delivered KV bytes/s per codec, most precise first."""
        key = (self._inputs, bandwidth_bps)
        if key != self._rates_for:
            self._rates = {c: self.delivered_rate(c, bandwidth_bps) for c in self._by_precision}
            self._rates_for = key
        return dict(self._rates)

    def choose(
        self,
        bandwidth_bps: float | None,
        *,
        remaining_bytes: int | None = None,
        time_left: float | None = None,
        app_limited: bool = False,
        now: float | None = None,
        peak_bps: float | None = None,
    ) -> CodecChoice:
        """Choose the codec for the next chunk.

        :param bandwidth_bps: the published bandwidth estimate; ``None`` (no estimate
            yet), like any value that is not a positive number (0, negative, NaN),
            picks the most precise codec, or the most compact on a long path
            (:meth:`observe_path_rtt`).
        :param remaining_bytes: fp16 bytes of the transfer still to send, this chunk
            included; with ``time_left`` it selects deadline mode.
        :param time_left: seconds to the deadline.
        :param app_limited: the sender's samples are app-limited now (the encoder, not the
            path, sets the pace), so the estimate may be far below what the path carries.
            In throughput mode the model then takes the path's rate as at least what it
            was when the path last set the pace (of the last call that was not
            app-limited: on a short path the larger of ``peak_bps`` and the estimate, on
            a long one the estimate), and a raw choice stays
            raw: with the sender, not the path, the bottleneck, a codec that spends CPU to
            save wire bytes cannot deliver more. On measured goodput, such an estimate
            neither keeps a codec from being explored nor rates one never measured (see
            the module docstring).
        :param now: with it, once per ``probe_interval`` a chunk is a probe: while
            app-limited, a compact choice becomes raw (sent without encoding, it shows
            what the path delivers, so a path faster than the encoder stops being taken
            for a slow one; a link slower than the encoder keeps chunks queued, is never
            app-limited and never probed this way), and the choices after it too, until
            one made a round trip of the path after the first (see :meth:`_probe`); a raw choice becomes the best compact
            codec, whose encode speed is measured again; before either, any choice may
            become another codec held back by its CPU costs and not sent for
            ``refresh_after`` seconds (:data:`NEAR_REFRESH` of them for one rated above
            the chosen codec or within ``hysteresis`` below it), so that its speeds are
            measured again too.
            Throughput mode, and only with ``measure_goodput=False``. With measured
            goodput and ``now``, throughput mode makes the model's choice
            without probes until the first measurement, then chooses on measured goodput
            (the leader or an exploring stint, see the module docstring; a stint's chunks
            are the probes then), with or without a bandwidth estimate.
        :param peak_bps: the estimator's windowed peak (its max filter): what the path
            has shown it carries. In throughput mode, on a call that is not app-limited
            and on a short path, the model rates the wire at the larger of it and
            ``bandwidth_bps``, and remembers that for the app-limited calls after it (on
            a long path it is not used); with ``now``, the peak counts at no more than
            :data:`PEAK_OVER_ESTIMATE` times the highest estimate of such calls in the
            last :data:`ESTIMATE_MEMORY` seconds (a peak that outlived a drop in capacity).
        """
        choice = self._choose(bandwidth_bps, remaining_bytes, time_left, app_limited, now, peak_bps)
        if self._measure:
            self.meter.chosen(choice.codec)  # the goodput meter measures what is sent now
            # The path's rate, at which the meter charges a chunk sent in place of the
            # chosen codec's its wire time: the estimate, or while the sender sets the
            # pace (an encode-bound codec: the estimate is what it sent) the larger of it
            # and the peak, what the path has shown it carries, the peak capped as the
            # model caps it (a peak that outlived a drop in capacity).
            path = bandwidth_bps if bandwidth_bps is not None and bandwidth_bps > 0 else None
            if path is not None and app_limited and peak_bps is not None and peak_bps > path:
                path = self._capped_peak_rate(path, peak_bps, now)
            self.meter.path_rate(None if path is None else path / 8.0)
        return choice

    def _choose(self, bandwidth_bps: float | None, remaining_bytes: int | None, time_left: float | None,
                app_limited: bool, now: float | None, peak_bps: float | None) -> CodecChoice:
        deadline = remaining_bytes is not None and time_left is not None
        if now is not None and not deadline and self._measure:
            if self.meter.measured:
                bw = bandwidth_bps if bandwidth_bps is not None and bandwidth_bps > 0 else None
                return self._choose_measured(self.rates(math.inf if bw is None else bw), bw, app_limited, now)
            now = None  # the model's choice, unprobed: its first run is measured
        if bandwidth_bps is None or not bandwidth_bps > 0:
            # Nothing measured yet (no estimate, or one that is not a positive number:
            # 0, negative, NaN). On a short path (loopback, a rack) the most precise
            # (raw): its samples measure the path; a compact first window's samples
            # measure the encoder there, and the model then kept choosing the compact
            # codec from them. On a long path (its handshake round trip at least
            # LONG_PATH_RTT) the window, not the encoder, paces the first round trips, and
            # the most compact codec carries the most KV in them (raw's first window was
            # 2% of a 6 s run at 1 Gbit/s, 20 ms, and cost 2% of its goodput).
            if self._long_path():
                first = min(self._by_precision, key=lambda c: self._ratio[c])
            else:
                first = self._by_precision[0]
            if not deadline:
                self._held = first
                self._filling = self._fill_count < FILL_CHUNKS  # once per chooser
            return CodecChoice(codec=first, delivered_bytes_per_s=math.nan, meets_deadline=None)
        if deadline:
            rates = self.rates(bandwidth_bps)
            assert remaining_bytes is not None and time_left is not None
            rates.update((c, r) for c, r in self.meter.measured.items() if c in rates)
            return self._choose_for_deadline(rates, remaining_bytes, time_left)
        if not app_limited:
            # The path set the pace: its rate, remembered for the app-limited calls after
            # it, is on a short path its peak (BBR's bottleneck bandwidth): the published
            # estimate is a mean over half a second, and in a burst of small transfers,
            # each with its first round trips in it, it read 13 Gbit/s of a loopback whose
            # peak was 25 (raw, rated on it, lost to int8, which delivered a third less).
            # On a long path the mean spans many round trips and follows the link, while
            # acknowledgements released in bunches lift the peak above it (11-12 Gbit/s
            # of a 10 Gbit/s, 20 ms link: rated at it, the 8-bit codecs tied int4 there
            # and were kept at 0.90 of its rate).
            if self._long_path():
                path = self._path_bps = bandwidth_bps
            else:
                path = self._path_bps = bandwidth_bps = self._capped_peak_rate(bandwidth_bps, peak_bps, now)
            if self._filling:
                # BBR's full pipe: the path's rate stopped growing by a quarter.
                if path >= FILL_GROWTH * self._fill_bps:
                    self._fill_bps, self._fill_count = path, 0
                else:
                    self._fill_count += 1
                    self._filling = self._fill_count < FILL_CHUNKS
        elif self._path_bps is not None:
            # The sender set the pace (an encoder, its CPU): the estimate is what it sent,
            # a floor of the path's rate, not its ceiling. Taken as the ceiling, whatever
            # codec is CPU-bound makes raw look slower than it: on two busy cores the
            # compact codecs' encoders then paced the estimate down to 3 Gbit/s of a
            # loopback that carried 12-16 raw, and the model kept them for good.
            bandwidth_bps = max(bandwidth_bps, self._path_bps)
        rates = self.rates(bandwidth_bps)
        best = max(rates.values())
        for codec in self._by_precision:
            if rates[codec] >= best * (1.0 - self._tolerance):
                break
        else:
            raise AssertionError("unreachable: the best codec is within tolerance of itself")
        held = self._held
        order = self._by_precision
        if held is not None and held != codec and (
                rates[held] * (1.0 + self._hysteresis) >= rates[codec] if order.index(held) < order.index(codec)
                else rates[held] > rates[codec] and not self._is_free(codec)):
            # A less precise codec must be faster than the one sent until now by more
            # than the rates' noise, and a more precise one that costs CPU at least as
            # fast as it (within ``tolerance`` of the best is not enough: between the
            # two the choice stays put). Codecs within 10% of each other (fp8, int8 and
            # int4 on a loaded host) took turns chunk by chunk as their measurements
            # moved; with chunks encoded only when asked for, that delivered less than
            # any of them sent alone. And the codec sent is measured chunk by chunk
            # while the others keep their last figure (moved with the host, see
            # observe_encode, but no sample of theirs averaged since): over an
            # emulated 10 Gbit/s link, where int4 delivered 9% more than int8, a dip of
            # int4's encode speed that left it within tolerance, but still ahead, of
            # int8 sent int8, and int8 kept 12-22% of the chunks (four runs) until its
            # own speed dipped further than int4's last measurement. Raw is the
            # exception: its rate is the live estimate, not a figure left from when it
            # was last sent, so it takes over within ``tolerance`` of the best as ever
            # (held to the stricter rule, steady rates kept int4 for good where raw was
            # rated 1.5% behind it). Kept, the held codec gives way to the most precise
            # codec rated at least as fast as it (raw, if the wire alone rates it so):
            # the hysteresis never keeps a choice below a more precise one's rate.
            codec = next(c for c in order if rates[c] >= rates[held])
        free = self._by_precision[0]
        unmeasured = not self._free_measured() and self._path_rtt is not None and not self._long_path()
        if held == free and self._is_free(free) and (app_limited or self._filling or unmeasured):
            # Raw held back by the sender, not the path (its first round trips, a CPU
            # shared with other work): a codec that costs CPU to save wire bytes can only
            # be slower. Nor is the path known while its rate still grows: the estimate of
            # a transfer's first chunks was half what raw carried over loopback a moment
            # later, and a compact codec chosen on it kept the transfer. Nor, on a short
            # path, before raw's transport cost is measured: with their encode priors
            # alone the compact codecs looked free, int4 took a burst's first transfer
            # at 18 Gbit/s of a loopback that carried 30 raw, and kept the burst.
            codec = free
        self._held = codec
        probe = self._probe(codec, rates, bandwidth_bps, app_limited, now)
        if now is not None:
            self._sent_at[probe or codec] = now
        if probe is not None:
            return CodecChoice(codec=probe, delivered_bytes_per_s=rates[probe], meets_deadline=None, probe=True)
        return CodecChoice(codec=codec, delivered_bytes_per_s=rates[codec], meets_deadline=None)

    def _choose_measured(self, rates: Mapping[str, float], bandwidth_bps: float | None,
                         app_limited: bool, now: float) -> CodecChoice:
        """Throughput mode on measured goodput: the leader, or a stint of another codec
        (see the module docstring); ``app_limited``: the estimate is the sender's pace,
        not the path's."""
        self._chosen += 1
        count = self._chosen
        if self._stint is not None:
            codec, samples, began, began_at = self._stint
            # A stint lasts until its codec has a sample: at least ``stint_max`` chunks, and
            # at least STINT_ROUND_TRIPS round trips of the path (its first acknowledgement
            # comes a round trip after it began, behind what the leader left in flight).
            rtts = STINT_ROUND_TRIPS * (self._path_rtt or 0.0)
            if self.meter.samples(codec) == samples and (count - began < self._stint_max or now - began_at < rtts):
                return self._measured_choice(codec, rates, probe=True)
            self._stint = None
            measured_now = self.meter.samples(codec) > samples
            if not measured_now:
                # Ended without a sample: what the meter had of the codec is stale, and
                # is not to decide the lead (int4's one sample read 0.511 GB/s of 2.0 and
                # kept raw leading over 100 ms, 64-chunk stints ending before their acks).
                self.meter.forget(codec)
                self._due[codec] = max(self._due.get(codec, 0), count + self._wait.get(codec, self._explore_after))
        else:
            codec, began, measured_now = "", count, False
        measured = self.meter.measured
        if self._leader in measured:  # a challenger must beat the leader by more than noise
            measured[self._leader] *= 1.0 + self._hysteresis
        best = max(measured.values())
        leader = next(c for c in self._by_precision if measured.get(c, -1.0) >= best * (1.0 - self._tolerance))
        lead = self.meter.rate(leader)
        assert lead is not None
        if measured_now:
            self._stint_len = count - began
        # A codec just measured, by a stint or as the leader it was until now, waits for
        # its next stint: the longer, the further behind it is.
        done = [c for c in (codec if measured_now else None, self._leader) if c is not None and c != leader]
        self._leader = leader
        for c in done:
            rate = self.meter.rate(c)
            assert rate is not None
            far = rate < (1.0 - SAMPLE_NOISE) * lead
            self._far[c] = self._far.get(c, 0) + 1 if far else 0
            if rate >= lead * (1.0 - self._tolerance):
                wait = self._explore_after
            else:
                # Behind: twice the last wait; further behind than one noisy sample
                # explains, twice in a row (one sample can be a moment of the host, a
                # transfer's start), at least what its stints cost. Once is enough for a
                # codec measured at its wire bound: the path, not a moment of the host,
                # set its pace (raw on a slow link); and for one so far behind that no
                # sample's noise explains it.
                wait = 2 * self._wait.get(c, self._explore_after)
                at_wire = far and rate >= (1.0 - SAMPLE_NOISE) * self._wire_bound(c, bandwidth_bps)
                if self._far[c] >= 2 or at_wire or rate < HOPELESS * lead:
                    wait = max(wait, self._cost_wait(lead, rate, self._stint_len or 2 * self.meter.sample_acks))
            self._wait[c] = wait = min(wait, self._explore_max)
            self._due[c] = count + wait
            self._low_since[c] = math.inf
        if bandwidth_bps:
            low = self._low_since
            for c in list(low):
                if not app_limited:  # an app-limited estimate is the sender's pace
                    low[c] = min(low[c], bandwidth_bps)
                if bandwidth_bps >= PATH_GROWTH * low[c]:
                    # The path grew since the codec was measured (it slowed down for a while,
                    # and is back): its wait counts from now as if it had been measured
                    # level with the leader.
                    del low[c]
                    self._far[c] = 0
                    self._wait[c] = self._explore_after
                    self._due[c] = min(self._due.get(c, 0), count + self._explore_after)
        # Until a codec with CPU costs is measured, the model has nothing to be calibrated
        # with: the best of them by the model is explored even if it looks far behind
        # (the model's speeds can be a few times off), unless it looks ten times behind.
        uncalibrated = [c for c in self._by_precision if not self._is_free(c)]
        first = (max(uncalibrated, key=lambda c: rates[c])
                 if uncalibrated and not any(c in measured for c in uncalibrated) else None)
        scale = self._model_scale(bandwidth_bps)
        if first is not None and self._calibrated(first, bandwidth_bps, scale) < UNCALIBRATED_FLOOR * lead:
            first = None
        # The path's rate, as far as the estimate says what it is: an app-limited estimate
        # is the sender's pace (the leader's encoder), a floor of it, and bounds nothing.
        path_bps = None if app_limited else bandwidth_bps
        for c in self._by_precision:
            if c in measured or c in self._due or c == first:
                continue
            model = self._calibrated(c, path_bps, scale)
            if model < self._explore_floor * lead:
                # Never measured and far behind by the (calibrated) model: it waits as if
                # measured so, unless the model comes closer meanwhile.
                stint = self._stint_len or 2 * self.meter.sample_acks
                self._model_due.setdefault(c, count + self._cost_wait(lead, model, stint))
            else:
                self._model_due.pop(c, None)
        # A codec the path cannot carry fast enough to catch the leader, even at twice the
        # estimate, is not explored while that holds (raw on a slow link).
        due = [c for c in self._by_precision if c != leader
               and count >= self._due.get(c, 0) and count >= self._model_due.get(c, 0)
               and ESTIMATE_HEADROOM * self._wire_bound(c, path_bps) >= lead]
        if not due:
            return self._measured_choice(leader, rates, probe=False)
        # Never measured first, in the model's order; then the one waiting longest.
        unmeasured = [c for c in due if c not in measured]
        codec = max(unmeasured, key=lambda c: rates[c]) if unmeasured else min(due, key=lambda c: self._due[c])
        self._stint = (codec, self.meter.samples(codec), count, now)
        # Due again after its wait even if the stint ends without a sample.
        self._due[codec] = count + self._stint_max + self._wait.setdefault(codec, self._explore_after)
        return self._measured_choice(codec, rates, probe=True)

    def _model_scale(self, bandwidth_bps: float | None) -> float:
        """How far the model is off for the codecs with CPU costs that were measured:
        their measured goodput over the model's CPU rate (geometric mean). The model's
        speeds were measured one at a time, often on a host busier or idler than now; the
        error is much the same for every codec, so it carries over to those not measured.
        A codec measured at its wire bound, or closer to it than a sample's noise (the
        link may have set its pace, not the CPU), says how far off the model is at least:
        with no other measurement, the largest such bound times ``WIRE_HEADROOM`` (if
        that is above 1)."""
        exact: list[float] = []
        at_least = 0.0
        for c, rate in self.meter.measured.items():
            cpu = self.delivered_rate(c, math.inf)
            if self._is_free(c) or not 0 < cpu < math.inf or rate <= 0:
                continue
            if rate < (1.0 - SAMPLE_NOISE) * self._wire_bound(c, bandwidth_bps):
                exact.append(math.log(rate / cpu))
            else:
                at_least = max(at_least, rate / cpu)
        return math.exp(sum(exact) / len(exact)) if exact else max(1.0, WIRE_HEADROOM * at_least)

    def _calibrated(self, codec: str, bandwidth_bps: float | None, scale: float) -> float:
        """The model's rate for ``codec``, its CPU part times ``scale`` (:meth:`_model_scale`)."""
        cpu = self.delivered_rate(codec, math.inf)
        return min(self._wire_bound(codec, bandwidth_bps), cpu if self._is_free(codec) else cpu * scale)

    def _wire_bound(self, codec: str, bandwidth_bps: float | None) -> float:
        """KV bytes/s the path carries with ``codec`` at the estimate (unbounded without one)."""
        return math.inf if not bandwidth_bps else bandwidth_bps / 8.0 / self._ratio[codec]

    def _cost_wait(self, lead: float, rate: float, stint: int) -> int:
        """Chunks to wait so that a stint of ``stint`` chunks of a codec delivering ``rate``
        (it costs ``stint x (lead / rate - 1)`` of the leader's chunks) is at most
        ``explore_cost`` of the chunks until the next."""
        cost = stint * (lead / max(rate, 1e-9) - 1.0)
        return min(self._explore_max, max(self._explore_after, math.ceil(cost / self._explore_cost)))

    def _measured_choice(self, codec: str, rates: Mapping[str, float], *, probe: bool) -> CodecChoice:
        rate = self.meter.rate(codec)
        return CodecChoice(codec=codec, delivered_bytes_per_s=rates[codec] if rate is None else rate,
                           meets_deadline=None, probe=probe)

    @property
    def measures_goodput(self) -> bool:
        """Chooses on measured goodput (``measure_goodput``)."""
        return self._measure

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
          app-limited only briefly, when a transfer starts, and is not probed). Raw goes
          on for the choices after it until one made a round trip of the path
          (:meth:`observe_path_rtt`) after the first, while a compact codec is chosen:
          the estimator bounds a sample by the rate sent over the round trip before its
          chunk, and only there is that raw's (:data:`RAW_RUN_SHARE`, which also spaces
          such runs);
        * raw chosen: the best compact codec, so that its encode speed is measured again
          (a speed measured on a busy host would otherwise keep it out forever);
        * before either, another codec held back by its CPU costs (not by the wire), not
          sent for ``refresh_after`` seconds (:data:`NEAR_REFRESH` of them for one rated
          above the chosen codec or within ``hysteresis`` below it), whose rate by the
          model is at least
          ``refresh_share`` of the chosen one's (the one sent longest ago first): its speeds
          were measured in another moment of the host, and a chooser that never sends it
          again would keep a slow measurement for good.
        """
        if now is None or len(rates) < 2:
            return None
        free = self._by_precision[0]
        if self._raw_run is not None:
            began, last = self._raw_run
            if chosen != free and began <= last <= now and last < began + (self._path_rtt or 0.0):
                self._raw_run = (began, now)  # a round trip of raw not sent yet: raw again
                return free
            self._raw_run = None
            self._raw_probe_after = began + max(self._probe_interval, (last - began) / RAW_RUN_SHARE)
        if self._last_probe is not None and now - self._last_probe < self._probe_interval:
            return None
        # A stale contender first: it comes up once per refresh_after (or NEAR_REFRESH of
        # it), the others may take every interval.
        probe = self._stale_contender(chosen, rates, bandwidth_bps, now)
        if probe is None and self._is_free(free):
            if chosen == free:
                probe = max((c for c in rates if c != free), key=lambda c: rates[c])
            elif app_limited and now >= self._raw_probe_after:
                cpu_wire = self.delivered_rate(chosen, math.inf) * self._ratio[chosen]  # wire bytes/s
                if cpu_wire <= 1.5 * bandwidth_bps / 8.0:
                    probe = free
                    self._raw_run = (now, now)
        if probe is not None:
            self._last_probe = now
        return probe

    def _stale_contender(
        self, chosen: str, rates: Mapping[str, float], bandwidth_bps: float, now: float,
    ) -> str | None:
        """The codec sent longest ago (never sent first; precision breaks ties) among those
        not sent for ``refresh_after`` seconds (:data:`NEAR_REFRESH` of it for one rated
        above ``chosen`` or within ``hysteresis`` below it), rated at least ``refresh_share`` of
        ``chosen`` and held back by their CPU costs rather than the wire (only a CPU speed
        measured again can change their rate)."""
        floor = self._refresh_share * rates[chosen]
        near = (1.0 - self._hysteresis) * rates[chosen]
        stale = [
            c for c in self._by_precision
            if c != chosen and not self._is_free(c) and rates[c] >= floor
            and rates[c] < (1.0 - self._tolerance) * bandwidth_bps / 8.0 / self._ratio[c]
            and now - self._sent_at.get(c, -math.inf)
            >= self._refresh_after * (NEAR_REFRESH if rates[c] >= near else 1.0)
        ]
        return min(stale, key=lambda c: self._sent_at.get(c, -math.inf)) if stale else None

    def _capped_peak_rate(self, bandwidth_bps: float, peak_bps: float | None, now: float | None) -> float:
        """The larger of the estimate ``bandwidth_bps`` and its peak, the peak capped at
        :data:`PEAK_OVER_ESTIMATE` times the highest estimate of the last
        :data:`ESTIMATE_MEMORY` seconds (with ``now``, and the estimate recorded then;
        without it, the peak as given).  The path's rate on a short path while it sets
        the pace, and the meter's path rate on any path while the sender does."""
        peak = peak_bps if peak_bps is not None and peak_bps > 0 else 0.0
        if now is not None:
            peak = min(peak, PEAK_OVER_ESTIMATE * self._recent_estimate(bandwidth_bps, now))
        return max(bandwidth_bps, peak)

    def _recent_estimate(self, bandwidth_bps: float, now: float) -> float:
        """Records ``bandwidth_bps`` at ``now``; returns the highest estimate recorded
        since the latest one at least :data:`ESTIMATE_MEMORY` seconds old, that one
        included (after a pause between transfers the estimate from before it counts
        until the new ones span that long)."""
        estimates = self._estimates
        since = now
        while estimates and estimates[-1][1] <= bandwidth_bps:
            since = estimates.pop()[0]
        estimates.append((since, bandwidth_bps))
        # The highest is no longer needed once a call after it is that old.
        while len(estimates) > 1 and estimates[1][0] <= now - ESTIMATE_MEMORY:
            estimates.popleft()
        return estimates[0][1]

    def _long_path(self) -> bool:
        """The shortest round trip seen (:meth:`observe_path_rtt`) was at least
        :data:`LONG_PATH_RTT`."""
        return self._path_rtt is not None and self._path_rtt >= LONG_PATH_RTT

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
