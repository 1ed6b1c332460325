"""A fake-time sender for the codec chooser with the bandwidth estimator in the loop.

Fed as ``kvwire.aio`` feeds them: the next chunk's codec is chosen (with the estimator's
published estimate, its peak, its app-limited flag and the time) once the chunk before it
went on the wire; a compact chunk is encoded then (``encode[codec]`` KV bytes/s), raw is
not; the chunk goes out once the wire bytes in flight leave room for it (``window``); its
app-limited flag is the client's rule (``kvwire.aio.client``); the wire is a FIFO at
``capacity(t)`` bytes/s, ``rtt / 2`` each way; the receiver decodes one chunk at a time
(``decode[codec]``) and acknowledges it. Every acknowledgement that arrived by a choice
goes to the estimator (and, with measured goodput, to the chooser) first. Everything is
exact arithmetic over the event times: no clock, no sockets, no threads.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvwire.control import CodecCandidate, CodecChooser, DeliveryRateEstimator

MIB = 1 << 20
GBIT = 1e9 / 8  # bytes/s of a Gbit/s


@dataclass
class Run:
    acks: list[tuple[float, str, int]] = field(default_factory=list)  # (time, codec, KV bytes)
    choices: list[tuple[float, str, bool]] = field(default_factory=list)  # (time, codec, probe)

    def goodput(self, start: float, end: float) -> float:
        """KV bytes/s acknowledged in ``[start, end)``."""
        return sum(n for t, _, n in self.acks if start <= t < end) / (end - start)

    def sent(self, start: float, end: float) -> list[str]:
        """Codecs chosen in ``[start, end)``, in order."""
        return [c for t, c, _ in self.choices if start <= t < end]


def chooser(ratio: Mapping[str, float], encode: Mapping[str, float], decode: Mapping[str, float],
            **kw: Any) -> CodecChooser:
    """The chooser ``kvwire.aio`` makes (two cores), with the true speeds as priors."""
    return CodecChooser([CodecCandidate(name=c, size_ratio=r, encode_bytes_per_s=encode.get(c),
                                        decode_bytes_per_s=decode.get(c)) for c, r in ratio.items()],
                        cores=2, **kw)


def run(ch: CodecChooser, capacity: Callable[[float], float], *, ratio: Mapping[str, float],
        encode: Mapping[str, float], decode: Mapping[str, float], seconds: float, rtt: float = 0.002,
        chunk: int = 4 * MIB, window: int = 32 * MIB) -> Run:
    est = DeliveryRateEstimator()
    out = Run()
    acks: list[tuple[float, int, str, int]] = []  # heap of (time, key, codec, wire bytes)
    in_flight = 0
    link_free = dec_free = 0.0
    now, last_sent, key = 0.0, -math.inf, 0
    ch.observe_path_rtt(rtt)

    def drain(t: float) -> None:
        nonlocal in_flight
        while acks and acks[0][0] <= t:
            at, k, codec, wire = heapq.heappop(acks)
            in_flight -= wire
            est.on_ack(k, at)
            out.acks.append((at, codec, chunk))
            ch.observe_delivered(codec, chunk, at)

    while now < seconds:
        drain(now)
        if est.min_rtt is not None:
            ch.observe_path_rtt(est.min_rtt)
        choice = ch.choose(est.bandwidth_bps, app_limited=est.app_limited, now=now, peak_bps=est.max_filter_bps)
        codec = choice.codec
        out.choices.append((now, codec, choice.probe))
        if (speed := encode.get(codec)) is not None:
            now += chunk / speed
            ch.observe_encode(codec, chunk, chunk / speed)
        wire = int(chunk * ratio[codec])
        ch.observe_size(codec, chunk, wire)
        ch.observe_transport(wire, wire * 0.02e-9, codec, runnable=0.2)  # 50 GB/s: never the limit
        waited = False
        drain(now)
        while acks and in_flight + wire > window:
            waited = True
            now = acks[0][0]
            drain(now)
        # The client's app-limited rule (kvwire.aio.client).
        peak = est.max_filter_bps or 0.0
        bdp = peak / 8 * (est.min_rtt or 0.0)
        gap, last_sent = now - last_sent, now
        slow = (not waited and gap * peak / 8 > 0.5 * wire
                and (wire > bdp or est.bytes_in_flight < bdp + 2 * wire))
        key += 1
        est.on_send(key, wire, now, app_limited=bdp <= 0 or est.bytes_in_flight < bdp or slow)
        in_flight += wire
        link_free = max(now, link_free) + wire / capacity(max(now, link_free))
        dec = decode.get(codec)
        dec_free = max(link_free + rtt / 2, dec_free) + (chunk / dec if dec else 0.0)
        heapq.heappush(acks, (dec_free + rtt / 2, key, codec, wire))
    return out
