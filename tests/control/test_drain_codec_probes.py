"""``auto`` (model mode) sends no raw probe for a drain (ProbeRTT) (fake time).

While the in-flight window drains the path's queue, and for the round trip after it, the
estimator's samples are app-limited (held: ``mark_app_limited``), and so are those of
what the sender sent then with the pipe the drain left short. Told app-limited, the
chooser took the encoder for the pace and sent a run of raw probes in every drain, whose
samples the estimator holds: they measure nothing. ``chooser_app_limited`` (what the
sender gives the chooser) leaves the hold out.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import pytest

from kvwire.aio._send import chooser_app_limited
from kvwire.control import CodecCandidate, CodecChooser, DeliveryRateEstimator, InflightController

MIB = 1 << 20
GBPS = 1e9 / 8
RATIO = {"raw": 1.0, "int8": 0.516, "int4": 0.375}
ENCODE = {"int8": 3e9, "int4": 2e9}
DECODE = {"int8": 8e9, "int4": 6e9}


def run(capacity: Callable[[float], float], one_way: float, seconds: float,
        app_limited: Callable[[DeliveryRateEstimator], bool]) -> list[tuple[float, str, bool, bool]]:
    """A sender fed as the client feeds it: each chunk chosen and encoded once the one
    before left, sent when the window allows, marked app-limited by the client's rule;
    a FIFO wire at ``capacity(t)``, the receiver decoding one chunk at a time. Returns
    (time, codec, probe, the window draining) per chunk."""
    chooser = CodecChooser([CodecCandidate(name=c, size_ratio=r, encode_bytes_per_s=ENCODE.get(c),
                                           decode_bytes_per_s=DECODE.get(c)) for c, r in RATIO.items()], cores=2)
    chooser.observe_path_rtt(2 * one_way)
    est = DeliveryRateEstimator()
    window = InflightController(streams=1, chunk_bytes=4 * MIB)
    chunk = 4 * MIB
    acks: list[tuple[float, int]] = []
    link_free = decode_free = 0.0
    now, last_sent, key = 0.0, -math.inf, 0
    out = []

    def acked_by(t: float) -> None:
        while acks and acks[0][0] <= t:
            at, k = heapq.heappop(acks)
            est.on_ack(k, at)

    while now < seconds:
        acked_by(now)
        if est.min_rtt is not None:
            chooser.observe_path_rtt(est.min_rtt)
        choice = chooser.choose(est.bandwidth_bps, app_limited=app_limited(est), now=now,
                                peak_bps=est.max_filter_bps)
        codec = choice.codec
        out.append((now, codec, choice.probe, window.probing_rtt))
        if (speed := ENCODE.get(codec)) is not None:
            now += chunk / speed
            chooser.observe_encode(codec, chunk, chunk / speed)
        wire = int(chunk * RATIO[codec])
        chooser.observe_size(codec, chunk, wire)
        waited = False
        while True:
            acked_by(now)
            if window.may_send(est, wire, now):
                break
            waited = True
            now = acks[0][0]
        peak = est.max_filter_bps or 0.0
        bdp = peak / 8 * (est.min_rtt or 0.0)
        gap, last_sent = now - last_sent, now
        slow = not waited and gap * peak / 8 > 0.5 * wire and (wire > bdp or est.bytes_in_flight < bdp + 2 * wire)
        key += 1
        est.on_send(key, wire, now, app_limited=bdp <= 0 or est.bytes_in_flight < bdp or slow)
        link_free = max(now, link_free) + wire / capacity(max(now, link_free))
        decode = DECODE.get(codec)
        decode_free = max(link_free + one_way, decode_free) + (chunk / decode if decode else 0.0)
        heapq.heappush(acks, (decode_free + one_way, key))
    return out


def raw_runs(log: list[tuple[float, str, bool, bool]], since: float) -> list[float]:
    runs, before = [], False
    for at, codec, probe, _ in log:
        raw_probe = probe and codec == "raw"
        if at >= since and raw_probe and not before:
            runs.append(at)
        before = raw_probe
    return runs


@pytest.mark.parametrize(("gbps", "one_way", "drop"), [(10.0, 0.050, 0.5), (10.0, 0.010, 1.0)])
def test_a_drain_sends_no_raw_probe(gbps: float, one_way: float, drop: float) -> None:
    """10 Gbit/s (halved at 4 s), 100 ms, and 10 Gbit/s, 20 ms; int4 at 2 GB/s outruns
    the path: it is never app-limited but in and just after a drain."""
    capacity = gbps * GBPS

    def link(t: float) -> float:
        return capacity if t < 4.0 else capacity * drop

    before = run(link, one_way, 20.0, lambda est: est.app_limited)
    drains = [at for at, _, _, draining in before if draining]
    assert drains and min(drains) >= 5.0
    # Before: a run of raw probes in each of the two drains (9 and 5 chunks each).
    assert len(raw_runs(before, 5.0)) == 2
    after = run(link, one_way, 20.0, chooser_app_limited)
    assert any(draining for *_, draining in after)
    # Leaving out only the drain moved each run to the round trip after it (longer).
    assert raw_runs(after, 5.0) == []


def test_hold_limited_is_the_hold_and_what_the_sender_marked_during_it() -> None:
    est = DeliveryRateEstimator()
    assert not est.hold_limited
    for i in range(8):
        est.on_send(i, MIB, i * 0.001, app_limited=False)
    for i in range(4):
        est.on_ack(i, 0.010 + i * 0.001)
    est.mark_app_limited()  # 4 MiB delivered, 4 in flight: a hold to 8 MiB
    assert est.app_limited and est.hold_limited
    est.on_send(8, MIB, 0.015, app_limited=True)  # the sender's mark, during the hold: 9 MiB
    for i in range(4, 9):
        est.on_ack(i, 0.020 + i * 0.001)
        assert est.app_limited and est.hold_limited  # the hold ended at 8 MiB, its marks reach 9
    est.on_send(9, MIB, 0.030, app_limited=True)  # after the hold: the sender ran out of data
    assert est.app_limited and not est.hold_limited
    est.on_ack(9, 0.040)
    assert est.app_limited and not est.hold_limited  # its own mark, 10 MiB, not delivered past
