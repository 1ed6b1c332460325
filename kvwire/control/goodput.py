"""KV goodput per codec, measured from the acknowledgements of its chunks (sans-IO).

What ``auto`` wants to know of a codec is the fp16 KV it delivers per second, end to
end: encode, the sender's transport, the wire and the receiver's decode together, on this
host and this path, now. A model of those stages (:class:`~kvwire.control.CodecChooser`)
rests on speeds measured one at a time, and on two loaded cores they add up wrongly; the
acknowledgements of the chunks measure the whole pipeline at once, since a chunk is
acknowledged only once it was received, checked and decoded, and the sender's window
keeps no more in flight than the slowest stage drains.

Only the codec the sender is choosing now (:meth:`GoodputMeter.chosen`) is measured. A
*run* is a sequence of acknowledgements of its chunks while it is chosen. The run's first
acknowledgement starts the clock (the chunks in flight before it were another codec's);
every ``sample_acks`` after it make a sample, KV bytes acknowledged over the time they
took; a codec's rate is that of its latest run: the KV bytes of the run's last ``window``
samples over their time together (a short sample weighs in proportion; an earlier run's
samples, measured in another moment of the host, no longer count). The run ends when the
sender chooses another codec (the acknowledgements of the chunks still in flight then do
not count: the next codec's encodes share the host with them), or when the caller says
the pipe went idle (:meth:`GoodputMeter.pause`: nothing left to send, so the gap to the next
acknowledgement is no codec's doing) or that the sender holds data back (``held``: a
ProbeRTT drain; acknowledgements during it start no run); a run that ends with at least ``min_acks`` counted
is a (shorter) sample too. After a pause the next transfer's first layer does not start a
run (``starts_run=False``): until the receiver's first credit comes back, a round trip
after the transfer began, only that layer may be sent, so its acknowledgements come at
the pace of that wait. Acknowledgements of another codec (the previous one's, still
in flight when the run began) neither count nor end it.

A chunk the sender sent in place of the chosen codec's (:meth:`GoodputMeter.sent_instead`:
``auto`` sends raw a chunk whose values the chosen quantizer refuses) is marked by its
address. At the acknowledgement of that chunk (not of another of its codec: a chunk of
the previous codec, still in flight, acknowledged after it went out, is no fallback) the
run goes on, and the fallback counts among the ``sample_acks`` of a sample, so a sample
spans as many chunks whatever their codec (at least ``min_acks`` of them the codec's own). Each sample's seconds lose the fallbacks'
wire time at the path's estimated rate (:meth:`GoodputMeter.path_rate`), at most their
share of the sample's wire bytes (the share alone with the rate unknown); a fallback
acknowledged without a wire size loses the time since the acknowledgement before it. A
marked chunk sent again (its stream broke) keeps its mark; the marks of a failed transfer
are forgotten (:meth:`GoodputMeter.forget_transfer`), and all of them when the pipe goes
idle. Ignored, one raw chunk in eight of an int8 run at 10 Gbit/s made int8's measured
rate 1.86 GB/s of its 2.42.

On two loaded cores one sample of 8 chunks (about 20 ms at 14 Gbit/s) varies by 10-20%
from the next: the window averages the samples of a codec sent for long (the ``auto``
leader); a codec sent for a short stint has the one sample of it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["GoodputMeter"]


@dataclass(slots=True)
class _Run:
    codec: str
    start: float
    last: float
    kv_bytes: int = 0
    acks: int = 0
    own_wire: int = 0  # wire bytes of the counted acknowledgements
    other_wire: int = 0  # wire bytes of the chunks sent in place of the codec's, acknowledged in it
    others: int = 0  # their acknowledgements (those without a wire size too)
    cut: float = 0.0  # their wire time at the path's rate (inf: a rate unknown at one's ack)
    gap: float = 0.0  # the time before those acknowledged without a wire size
    first: bool = True  # no sample of this run folded yet


class GoodputMeter:
    """Measured fp16 KV bytes/s per codec; time is the caller's ``now`` (seconds)."""

    def __init__(self, *, sample_acks: int = 8, min_acks: int = 3, window: int = 4) -> None:
        """
        :param sample_acks: acknowledgements (after a run's first) that make one sample.
        :param min_acks: fewest counted acknowledgements of a run that still make a
            (shorter) sample when the run ends.
        :param window: samples of a codec its rate averages.
        """
        if sample_acks < 1 or not 1 <= min_acks <= sample_acks or window < 1:
            raise ValueError("need sample_acks >= 1, 1 <= min_acks <= sample_acks and window >= 1")
        self._sample_acks, self._min_acks, self._window = sample_acks, min_acks, window
        # (KV bytes, seconds: the codec's, the fallbacks' cut out) per sample
        self._recent: dict[str, deque[tuple[int, float]]] = {}
        self._path: float | None = None  # the path's rate, wire bytes/s (path_rate)
        self._rate: dict[str, float] = {}
        self._samples: dict[str, int] = {}
        self._run: _Run | None = None
        self._chosen: str | None = None
        # Chunks sent in place of the chosen codec's, not yet acknowledged: chunk -> its
        # transfer.
        self._instead: dict[Hashable, Hashable] = {}

    def chosen(self, codec: str) -> None:
        """The sender chooses ``codec`` for its next chunk (and, until told otherwise, for
        those after it)."""
        if codec != self._chosen:
            self.pause()
            self._chosen = codec

    def sent_instead(self, codec: str, chunk: Hashable, *, transfer: Hashable = None) -> None:
        """Chunk ``chunk`` (any key its acknowledgement will name again) goes out with
        ``codec`` in place of one of the chosen codec (``auto`` sends raw a chunk whose
        values the chosen quantizer refuses): at its acknowledgement its wire time at
        the path's rate is taken out of the run's. ``transfer``: the transfer it belongs to
        (:meth:`forget_transfer`)."""
        if codec != self._chosen:
            self._instead[chunk] = transfer

    def path_rate(self, bytes_per_s: float | None) -> None:
        """The path's estimated rate now, wire bytes/s (``None``, or a value that is not a
        positive finite number: unknown): a chunk sent in place of the chosen codec's is
        charged its wire bytes at it (:meth:`on_ack`)."""
        ok = bytes_per_s is not None and 0 < bytes_per_s < math.inf
        self._path = bytes_per_s if ok else None

    def forget_transfer(self, transfer: Hashable) -> None:
        """``transfer`` failed: its chunks sent in place of another's are acknowledged
        never."""
        self._instead = {c: t for c, t in self._instead.items() if t != transfer}

    def on_ack(self, codec: str, kv_bytes: int, now: float, *, starts_run: bool = True, held: bool = False,
               chunk: Hashable = None, wire_bytes: int = 0) -> None:
        """One chunk of ``codec`` carrying ``kv_bytes`` of fp16 KV, ``wire_bytes`` on the
        wire, was acknowledged.

        ``starts_run=False``: its pace was not the codec's (a chunk of a transfer's first
        layer, sent while the receiver grants that layer only): it counts in a run under
        way but does not start one.

        ``held``: the sender holds data back on purpose now (a ProbeRTT drain and the
        round trip after it: the estimator's ``hold_limited``), so acknowledgements come at
        the drain's pace, no codec's: the run under way ends there, as at a :meth:`pause`
        (what it counted before the hold makes a sample), and none starts until the hold
        is over. Counted in raw's run, a drain of a 40 Gbit/s, 20 ms path read raw at
        2.37 GB/s of its 5.0, and int8 (3.0) took the lead.

        ``chunk``: the chunk's key as given to :meth:`sent_instead`, if it was sent in
        place of the chosen codec's: the run goes on, the fallback counts among its
        ``sample_acks``, and the sample's seconds lose its ``wire_bytes`` at the path's
        rate (:meth:`path_rate`), the fallbacks' all together at most their share of the
        sample's wire bytes (the share itself with the rate unknown; nothing without the
        wire sizes of the codec's own chunks: the share is unknown); without its own wire
        size (``wire_bytes`` not > 0), the time since the run's last acknowledgement.
        A sample ends with ``sample_acks`` acknowledgements, the fallbacks' among them,
        of which at least ``min_acks`` of the codec, whichever acknowledgement ends it.
        """
        marked = chunk is not None and chunk in self._instead
        if marked:
            del self._instead[chunk]
        if held:
            self.pause()
            return
        if marked and codec != self._chosen:
            run = self._run
            if run is not None and now >= run.last:
                if wire_bytes > 0:
                    run.other_wire += wire_bytes
                    run.cut += wire_bytes / self._path if self._path is not None else math.inf
                else:  # no size: its time is the gap since the acknowledgement before it
                    run.gap += now - run.last
                run.others += 1
                run.last = now
                self._sample_done(run, now)
            return
        if codec != self._chosen:
            return
        run = self._run
        if run is None or now < run.last:
            self.pause()
            if starts_run:
                self._run = _Run(codec, start=now, last=now)
            return
        run.kv_bytes += kv_bytes
        run.acks += 1
        run.own_wire += max(wire_bytes, 0)
        run.last = now
        self._sample_done(run, now)

    def _sample_done(self, run: _Run, now: float) -> None:
        """Fold ``run`` into a sample if it spans ``sample_acks`` acknowledgements (the
        fallbacks' among them) with at least ``min_acks`` of its codec, and go on with
        the next sample (still a first while none was folded)."""
        if run.acks + run.others >= self._sample_acks and run.acks >= self._min_acks:
            folded = self._fold(run)
            self._run = _Run(run.codec, start=now, last=now, first=run.first and not folded)

    def pause(self) -> None:
        """Nothing is in flight or queued: end the run (the next acknowledgement, whenever
        it comes, starts a new one)."""
        run, self._run = self._run, None
        if run is not None and run.acks >= self._min_acks:
            self._fold(run)

    def idle(self) -> None:
        """Nothing is in flight or queued any more (or the transfers in flight failed): a
        :meth:`pause`, and no chunk sent in place of another is waited for."""
        self.pause()
        self._instead.clear()

    def _fold(self, run: _Run) -> bool:
        """Fold ``run`` into its codec's samples; whether it made one."""
        seconds = run.last - run.start
        if seconds <= 0:
            return False  # acknowledged all at once: no measure of a rate
        if run.gap:
            seconds -= run.gap  # the fallbacks without a wire size: the gaps before them
        if run.other_wire and run.own_wire:
            # The fallbacks' wire time at the path's rate (an encode-bound codec's chunks
            # take longer than their wire bytes do at it, a raw one no longer), at most
            # their share of the sample's wire bytes: the link, carrying both, was the
            # most it could have held them (and the share alone, the path's rate unknown).
            seconds -= min(run.cut, seconds * run.other_wire / (run.own_wire + run.other_wire))
        if seconds <= 0:
            return False
        recent = self._recent.setdefault(run.codec, deque(maxlen=self._window))
        if run.first:
            recent.clear()  # a new run: the codec's rate is this run's
        recent.append((run.kv_bytes, seconds))
        self._rate[run.codec] = sum(b for b, _ in recent) / sum(t for _, t in recent)
        self._samples[run.codec] = self._samples.get(run.codec, 0) + 1
        return True

    def forget(self, codec: str) -> None:
        """Drop ``codec``'s rate (its samples count on): it is stale, measured in another
        moment than the one it is to be compared with (``auto``: a stint of it that ended
        without a sample). A run of it under way is not ended."""
        self._rate.pop(codec, None)
        self._recent.pop(codec, None)

    @property
    def sample_acks(self) -> int:
        return self._sample_acks

    def rate(self, codec: str) -> float | None:
        """Measured KV bytes/s of ``codec``; ``None`` before its first sample."""
        return self._rate.get(codec)

    def samples(self, codec: str) -> int:
        """Samples folded into ``codec``'s rate so far."""
        return self._samples.get(codec, 0)

    @property
    def measured(self) -> dict[str, float]:
        """Every measured codec's rate."""
        return dict(self._rate)
