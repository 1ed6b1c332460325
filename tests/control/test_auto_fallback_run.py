"""``auto_codec="measured"``: a chunk sent raw in place of the chosen quantizer's (values it
refuses: NaN, infinity) is in no run of the chosen codec's measured goodput. Its wire time
(a raw chunk is 2-4 times a quantized one on the wire) counted in the quantizer's run,
its bytes did not: one such chunk in eight of an int8 run at 10 Gbit/s measured int8 at
1.86 GB/s of its 2.42. At that chunk's acknowledgement, matched by the chunk's address
(matched by codec, an earlier raw chunk's acknowledgement took its place), its wire bytes
are charged at the path's estimated rate (at most their share of the sample's wire
bytes) and taken out of the sample's time; the run goes
on (ended there, every next run was a first that cleared the codec's window: one fallback
in four left int8 without a sample). Taken as the time since the acknowledgement before
it, the fallback's wire time was wrong whenever acknowledgements are handled in bunches or
come from several streams: int8 read 71-160 of 100 in bunches of four, 160-200 over four
streams. Shared by wire bytes alone, an encode-bound int8 (2.4 GB/s of KV on a 2.5 GB/s
link) read 2.695 and led raw."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvwire.control import CodecChooser
from kvwire.control.codec_choice import PEAK_OVER_ESTIMATE
from kvwire.control.goodput import GoodputMeter
from kvwire.wire import ChunkAddress
from tests.aio.auto_helpers import (
    FakeDevice,
    fake_device_path,
    nonfinite_cache,
    nonfinite_spec,
    record_choices,
    send_auto,
)


@pytest.fixture
def chooses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """See :func:`record_choices`."""
    return record_choices(monkeypatch)


CHUNK = 4 << 20
LINK = 1.25e9  # wire bytes/s: 10 Gbit/s
INT8 = 0.516  # int8's wire bytes per KV byte


def _int8_run_with_raw_chunks(ch: CodecChooser, *, told: bool) -> None:
    """64 chunks chosen int8, acknowledged as the wire carries them; one in eight held a NaN
    and went raw (``told``: the chooser was told so when it was sent)."""
    ch.meter.chosen("int8")
    t = 0.0
    for i in range(64):
        if i % 8 == 4:
            if told:
                ch.observe_fallback("raw", i)
            t += CHUNK / LINK
            ch.observe_delivered("raw", CHUNK, t, chunk=i, wire_bytes=CHUNK)
        else:
            t += round(INT8 * CHUNK) / LINK
            ch.observe_delivered("int8", CHUNK, t, wire_bytes=round(INT8 * CHUNK))


def test_a_raw_fallback_chunk_is_in_no_run_of_the_quantizer() -> None:
    ch = CodecChooser.from_ratios({"raw": 1.0, "int8": INT8}, measure_goodput=True)
    _int8_run_with_raw_chunks(ch, told=True)
    true = LINK * CHUNK / round(INT8 * CHUNK)  # 2.42 GB/s of KV
    rate = ch.meter.rate("int8")
    assert rate is not None and rate == pytest.approx(true, rel=1e-9)
    assert ch.meter.rate("raw") is None  # nor in raw's: raw is not the chosen codec


def test_the_run_s_time_is_shared_with_the_fallback_by_wire_bytes() -> None:
    meter = GoodputMeter(sample_acks=8, min_acks=2)
    meter.chosen("int8")
    meter.on_ack("int8", 1000, 0.001, wire_bytes=500)  # starts the run's clock
    meter.on_ack("int8", 1000, 0.002, wire_bytes=500)
    meter.on_ack("int8", 1000, 0.003, wire_bytes=500)
    meter.sent_instead("raw", "f")
    # handled in a bunch with the acknowledgement before it: no gap to take out, its
    # wire bytes (2 ms of the link's) are the run's others'
    meter.on_ack("raw", 1000, 0.003, chunk="f", wire_bytes=1000)
    assert meter.samples("int8") == 0  # the run goes on
    for i in range(5):
        meter.on_ack("int8", 1000, 0.006 + 0.001 * i, wire_bytes=500)
    # 8 acknowledged in the run (7 int8's, the fallback): 9 ms, 7 of them int8's
    assert meter.samples("int8") == 1 and meter.rate("int8") == pytest.approx(1e6)
    # an acknowledgement of another codec's chunk that was not sent in place of int8's
    # (the previous codec's, still in flight) neither counts nor ends the run
    meter.on_ack("raw", 1000, 0.0105, wire_bytes=1000)
    for i in range(8):
        meter.on_ack("int8", 1000, 0.011 + 0.001 * i, wire_bytes=500)
    assert meter.samples("int8") == 2 and meter.rate("int8") == pytest.approx(1e6)


def test_an_earlier_raw_chunks_acknowledgement_is_not_the_fallbacks() -> None:
    """A raw chunk sent before the switch to int8, acknowledged after the fallback went
    out, took the fallback's place: the fallback's own acknowledgement was then ignored
    and its 3 s of wire time stayed in int8's run (72.7 B/s of 100)."""
    m = GoodputMeter()
    m.chosen("raw")
    m.chosen("int8")
    m.sent_instead("raw", "fallback")
    t = 0.0
    m.on_ack("raw", 100, t, chunk="old raw", wire_bytes=300)
    for _ in range(5):
        t += 1.0
        m.on_ack("int8", 100, t, wire_bytes=100)
    t += 3.0
    m.on_ack("raw", 100, t, chunk="fallback", wire_bytes=300)
    for _ in range(3):
        t += 1.0
        m.on_ack("int8", 100, t, wire_bytes=100)
    assert m.samples("int8") == 1 and m.rate("int8") == pytest.approx(100.0)


@pytest.mark.parametrize("every", [4, 8, 3])
def test_frequent_fallbacks_leave_the_quantizer_measured(every: int) -> None:
    """One chunk in ``every`` goes raw (3 s on the wire) among int8 chunks (1 s each): int8
    is measured at its rate, its window averaging several samples. Ended at each fallback,
    with the next run a first that cleared the window, one in four made no sample and one
    in eight left one in the window."""
    m = GoodputMeter()
    m.chosen("int8")
    t = 0.0
    for i in range(400):
        if i % every == every - 1:
            m.sent_instead("raw", i)
            t += 3.0
            m.on_ack("raw", 100, t, chunk=i, wire_bytes=300)
        else:
            t += 1.0
            m.on_ack("int8", 100, t, chunk=i, wire_bytes=100)
    assert m.rate("int8") == pytest.approx(100.0, rel=0.02)
    assert m.samples("int8") >= 20
    assert len(m._recent["int8"]) == 4  # (the window is full: several samples averaged)


def _int8_in_bunches(bunch: int, fallback_at: int, every: int = 8, n: int = 4000,
                     path: float | None = None) -> float | None:
    """One stream: int8 chunks 1 s on the wire (100 KV bytes, 100 wire bytes), the one at
    ``fallback_at`` of every ``every`` sent raw (2 s, 200 wire bytes); the loop handles
    the acknowledgements in bunches of ``bunch`` (the sender task held it), 1 us apart,
    at the time the bunch's last arrived. int8's true rate: 100 KV bytes/s. ``path``: the
    path's rate the meter is told (100 wire bytes/s), or none."""
    m = GoodputMeter()
    m.chosen("int8")
    if path is not None:
        m.path_rate(path)
    t, held = 0.0, []
    for i in range(n):
        raw = i % every == fallback_at
        if raw:
            m.sent_instead("raw", i)
        t += 2.0 if raw else 1.0
        held.append((i, raw))
        if len(held) == bunch:
            for j, (k, was_raw) in enumerate(held):
                m.on_ack("raw" if was_raw else "int8", 100, t + 1e-6 * j, chunk=k,
                         wire_bytes=200 if was_raw else 100)
            held = []
    return m.rate("int8")


@pytest.mark.parametrize("path", [None, 100.0])
@pytest.mark.parametrize("bunch", [1, 2, 4])
def test_acknowledgements_handled_in_bunches(bunch: int, path: float | None) -> None:
    """Cut out as the time since the acknowledgement before it, the fallback's wire time
    was that of a bunch, or none: int8 read 74-114 in bunches of two, 71-160 of four."""
    for at in range(8):
        assert _int8_in_bunches(bunch, at, path=path) == pytest.approx(100.0, rel=0.03), at


def _int8_over_streams(streams: int, every: int, n: int = 2000,
                       path: float | None = None) -> float | None:
    """``streams`` streams share a link of 1 wire byte/s fairly; each takes the next chunk
    when its last is acknowledged; int8 chunks are 1 wire byte (100 KV bytes), one in
    ``every`` goes raw (2 wire bytes). Chunks sent together are acknowledged together,
    their acknowledgements tied. ``path``: the path's rate the meter is told, or none."""
    m = GoodputMeter()
    m.chosen("int8")
    if path is not None:
        m.path_rate(path)
    t, nxt = 0.0, 0
    active: dict[int, list[float]] = {}  # stream -> [chunk, wire bytes left], in the order sent
    while True:
        for s in range(streams):
            if s not in active and nxt < n:
                if nxt % every == every - 1:
                    m.sent_instead("raw", nxt)
                active[s] = [nxt, 2.0 if nxt % every == every - 1 else 1.0]
                nxt += 1
        if not active:
            return m.rate("int8")
        s, (i, left) = min(active.items(), key=lambda a: a[1][1])  # (tied: the first sent)
        dt = left * len(active)
        t += dt
        for v in active.values():
            v[1] -= dt / len(active)
        del active[s]
        raw = int(i) % every == every - 1
        m.on_ack("raw" if raw else "int8", 100, t, chunk=int(i), wire_bytes=2 if raw else 1)


@pytest.mark.parametrize("path", [None, 1.0])
@pytest.mark.parametrize("every", [8, 4])
def test_acknowledgements_of_several_streams(every: int, path: float | None) -> None:
    """Four streams: the fallback's acknowledgement came tied with, or just after, the
    int8 chunks sent beside it, and the time since the one before it was none of its
    wire time or a share of theirs: int8 read 160-200."""
    assert _int8_over_streams(4, every, path=path) == pytest.approx(100.0, rel=0.03)


ENCODE8 = 2.4e9  # int8's encoder, KV bytes/s: slower than the link carries its chunks (2.42)
LINK_E = 2.5e9  # wire bytes/s


def _encode_bound(codec: str, kv: int) -> float:
    """A pipelined sender's seconds for one chunk: the slower of the encoder and the link."""
    return kv / LINK_E if codec == "raw" else max(kv / ENCODE8, INT8 * kv / LINK_E)


def _wire(codec: str) -> int:
    return CHUNK if codec == "raw" else round(INT8 * CHUNK)


def test_an_encode_bound_quantizer_s_fallbacks_are_charged_their_wire_time() -> None:
    """int8 encode-bound at 2.4 GB/s of KV on a 2.5 GB/s link, one chunk in eight raw: a
    raw chunk's time is its wire bytes at the link's rate, less than their share of the
    wire bytes (int8's take longer than theirs at it). Shared by wire bytes, int8 read
    2.695 GB/s, above raw's 2.5: the chooser led int8 and delivered 2.413 GB/s of KV."""
    ch = CodecChooser.from_ratios({"raw": 1.0, "int8": INT8}, measure_goodput=True)
    ch.choose(LINK_E * 8, now=0.0)
    ch.meter.chosen("int8")  # (int8 chosen from here on, the path's rate known)
    t = 0.0
    for i in range(64):
        codec = "raw" if i % 8 == 4 else "int8"
        if codec == "raw":
            ch.observe_fallback("raw", i)
        t += _encode_bound(codec, CHUNK)
        ch.observe_delivered(codec, CHUNK, t, chunk=i, wire_bytes=_wire(codec))
    assert ch.meter.rate("int8") == pytest.approx(ENCODE8, rel=0.03)
    # the whole chooser: raw (2.5) leads int8 (2.4) and delivers as much as raw alone
    ch = CodecChooser.from_ratios({"raw": 1.0, "int8": INT8}, measure_goodput=True)
    t = 0.0
    for i in range(4000):
        chosen = ch.choose(LINK_E * 8, now=t).codec
        sent = "raw" if chosen == "int8" and i % 8 == 4 else chosen
        if sent != chosen:
            ch.observe_fallback(sent, i)
        t += _encode_bound(sent, CHUNK)
        ch.observe_delivered(sent, CHUNK, t, chunk=i, wire_bytes=_wire(sent))
    assert ch.leader == "raw"
    assert 4000 * CHUNK / t == pytest.approx(LINK_E, rel=0.01)


def test_the_fallbacks_cut_is_each_sample_s_own() -> None:
    """A window mixing a sample with no fallback (nor wire sizes) and one with a fallback:
    only the latter's time is cut. Shared by wire bytes over the window, the second
    sample's share (2 s of its 5) was taken of both samples' 9 s: int8 read 129.6 of 100."""
    m = GoodputMeter(sample_acks=4, min_acks=1)
    m.chosen("int8")
    t = 0.0
    m.on_ack("int8", 100, t)
    for _ in range(4):
        t += 1.0
        m.on_ack("int8", 100, t)  # no wire size given
    assert m.rate("int8") == pytest.approx(100.0)
    m.sent_instead("raw", "f")
    for _ in range(3):
        t += 1.0
        m.on_ack("int8", 100, t, wire_bytes=100)
    t += 2.0
    m.on_ack("raw", 100, t, chunk="f", wire_bytes=200)
    assert m.samples("int8") == 2 and m.rate("int8") == pytest.approx(100.0)
    # an encode-bound sample with a fallback beside samples without: the path's rate
    # (100 wire bytes/s) charges the fallback its 2 s of wire time, not 2/5 of the sample
    m.path_rate(100.0)
    m.sent_instead("raw", "g")
    for _ in range(3):
        t += 2.0  # int8 at 50 KV bytes/s: its encoder, not the link
        m.on_ack("int8", 100, t, wire_bytes=100)
    t += 2.0
    m.on_ack("raw", 100, t, chunk="g", wire_bytes=200)
    kv, seconds = m._recent["int8"][-1]
    assert m.samples("int8") == 3 and kv == 300 and seconds == pytest.approx(6.0)


def test_a_fallback_without_a_wire_size_is_cut_out_as_the_gap_before_it() -> None:
    """The caller tells the fallbacks but gives no wire sizes: the time since the
    acknowledgement before the fallback's is taken out, as before the wire sizes were
    given (shared by wire bytes, none, int8 read 77.8 of 100)."""
    m = GoodputMeter()
    m.chosen("int8")
    t = 0.0
    for i in range(64):
        fallback = i % 8 == 4
        if fallback:
            m.sent_instead("raw", i)
        t += 2.0 if fallback else 1.0
        m.on_ack("raw" if fallback else "int8", 100, t, chunk=i)
    assert m.rate("int8") == pytest.approx(100.0)


def test_a_sample_needs_min_acks_of_its_codec_whichever_acknowledgement_ends_it() -> None:
    """Fallbacks first, then the codec's own: a sample of one int8 acknowledgement and
    seven fallbacks ended at the next int8 one, below ``min_acks`` (3), as one ended by a
    fallback would not."""
    m = GoodputMeter(sample_acks=8, min_acks=3)
    m.chosen("int8")
    t = 0.0
    m.on_ack("int8", 100, t, wire_bytes=100)  # starts the run's clock
    for i in range(7):
        m.sent_instead("raw", i)
        t += 2.0
        m.on_ack("raw", 100, t, chunk=i, wire_bytes=200)
    t += 1.0
    m.on_ack("int8", 100, t, wire_bytes=100)
    assert m.samples("int8") == 0
    for _ in range(2):
        t += 1.0
        m.on_ack("int8", 100, t, wire_bytes=100)
    assert m.samples("int8") == 1 and m.rate("int8") == pytest.approx(100.0)


def test_a_run_s_first_sample_skipped_leaves_the_next_one_first() -> None:
    """A new run's first sample acknowledged all at once (no time: no sample) left the
    previous run's window in place, and the next sample was averaged with it: 57.1 of the
    new run's 25."""
    m = GoodputMeter()
    m.chosen("int8")
    t = 0.0
    for _ in range(33):  # a run at 100/s: 4 samples in the window
        m.on_ack("int8", 100, t)
        t += 1.0
    m.pause()  # the run ends; the link is 4 times slower now
    for _ in range(9):  # the new run's first 8, in one bunch
        m.on_ack("int8", 100, t)
    for _ in range(8):
        t += 4.0
        m.on_ack("int8", 100, t)
    assert m.rate("int8") == pytest.approx(25.0) and len(m._recent["int8"]) == 1


def test_a_fallback_sent_again_keeps_its_mark() -> None:
    """Its stream broke (ChunkLost) and it goes again under the same address: the resend's
    acknowledgement takes its time out of the run."""
    ch = CodecChooser.from_ratios({"raw": 1.0, "int8": INT8}, measure_goodput=True)
    ch.meter.chosen("int8")
    ch.observe_fallback("raw", "a", transfer=1)
    t = 0.0
    for _ in range(4):
        t += 1.0
        ch.observe_delivered("int8", 100, t, chunk="x", wire_bytes=100)
    t += 5.0
    ch.observe_delivered("raw", 100, t, chunk="a", wire_bytes=500)  # (the resend's)
    for _ in range(4):
        t += 1.0
        ch.observe_delivered("int8", 100, t, wire_bytes=100)
    assert ch.meter.rate("int8") == pytest.approx(100.0)


def test_the_marks_of_a_failed_transfer_are_forgotten() -> None:
    meter = GoodputMeter()
    meter.chosen("int8")
    meter.sent_instead("raw", "a", transfer=1)
    meter.sent_instead("raw", "b", transfer=2)
    meter.forget_transfer(1)
    assert list(meter._instead) == ["b"]
    meter.idle()
    assert not meter._instead


def test_a_fallback_chunk_never_acknowledged_is_forgotten_when_the_pipe_goes_idle() -> None:
    ch = CodecChooser.from_ratios({"raw": 1.0, "int8": INT8}, measure_goodput=True)
    ch.meter.chosen("int8")
    ch.observe_fallback("raw", "lost")  # its transfer failed: never acknowledged
    ch.observe_idle()
    ch.meter.chosen("int8")
    for i in range(9):
        ch.observe_delivered("int8", 1000, 0.001 * (i + 1))
    assert ch.meter.samples("int8") == 1  # (the run goes on from 0.009)
    ch.observe_delivered("raw", 1000, 0.0095)  # another codec's chunk, not int8's run's: nothing ends
    for i in range(8):
        ch.observe_delivered("int8", 1000, 0.010 + 0.001 * i)
    assert ch.meter.samples("int8") == 2


def test_the_chosen_codec_itself_is_no_fallback() -> None:
    meter = GoodputMeter(sample_acks=2, min_acks=2)
    meter.chosen("raw")
    meter.sent_instead("raw", 1)
    for i in range(3):
        meter.on_ack("raw", 1000, 0.001 * (i + 1), chunk=i)
    assert meter.samples("raw") == 1


@pytest.fixture
def fallbacks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    told: list[str] = []
    observe = CodecChooser.observe_fallback

    def record(self: CodecChooser, codec: str, chunk: Any, **kwargs: Any) -> None:
        assert isinstance(chunk, ChunkAddress)
        told.append(codec)
        observe(self, codec, chunk, **kwargs)

    monkeypatch.setattr(CodecChooser, "observe_fallback", record)
    return told


@pytest.mark.timeout(60)
async def test_the_sender_tells_the_chooser_of_each_chunk_it_sends_raw_instead(
        chooses: list[str], fallbacks: list[str]) -> None:
    chooses.append("int8")
    receipt, _ = await send_auto(nonfinite_cache(np.nan), nonfinite_spec())
    assert receipt.extra["chunks_by_codec"] == {"int8": 4, "raw": 2}
    assert fallbacks == ["raw", "raw"]


@pytest.mark.timeout(60)
async def test_the_sender_tells_the_chooser_of_a_device_part_sent_raw_instead(
        monkeypatch: pytest.MonkeyPatch, chooses: list[str], fallbacks: list[str]) -> None:
    fake_device_path(monkeypatch)
    chooses.append("int4")
    on_device = [(FakeDevice(k), FakeDevice(v)) for k, v in nonfinite_cache(np.inf)]
    receipt, _ = await send_auto(on_device, nonfinite_spec())  # type: ignore[arg-type]
    assert receipt.extra["chunks_by_codec"] == {"int4": 4, "raw": 2}
    assert fallbacks == ["raw", "raw"]


async def test_a_failed_transfer_with_nothing_left_ends_the_run_and_forgets_its_fallbacks() -> None:
    """The client told the chooser the pipe went idle when a transfer was done, never when
    it failed: the run went on across the gap to the next transfer's acknowledgements."""
    from kvwire.aio._send import make_chooser
    from kvwire.aio.client import ClientOptions, Peer
    from kvwire.errors import ConnectionLostError
    from kvwire.session.sender import TransferFailed
    from tests.conftest import SECRET

    peer = Peer("127.0.0.1", 1, secret=SECRET, streams=1, codec="auto", ssl=None,
                options=ClientOptions(auto_codec="measured"))
    ch = peer.chooser = make_chooser(("raw", "int8"), "measured")
    ch.meter.chosen("int8")
    for i in range(4):
        ch.observe_delivered("int8", 100, 1.0 + i)  # a run: 3 counted
    ch.observe_fallback("raw", ChunkAddress(transfer_id=7, layer=1, kind=0, token_start=0), transfer=7)
    peer._on_event(TransferFailed(transfer_id=7, error=ConnectionLostError("gone")))
    assert ch.meter.samples("int8") == 1 and ch.meter.rate("int8") == pytest.approx(100.0)
    assert not ch.meter._instead


def test_the_path_rate_a_fallback_is_charged_at_caps_a_stale_peak() -> None:
    """While the sender sets the pace, a fallback is charged at the larger of the estimate
    and the peak; a peak ten times the estimate (one that outlived a drop in capacity)
    counts at no more than PEAK_OVER_ESTIMATE times the recent estimate, as the model
    caps it, so the fallback's cut is not made too small."""
    ch = CodecChooser.from_ratios({"raw": 1.0, "int8": INT8}, measure_goodput=True)
    estimate = LINK_E * 8 / 2
    ch.choose(estimate, app_limited=True, peak_bps=10 * estimate, now=0.0)
    assert ch.meter._path == pytest.approx(PEAK_OVER_ESTIMATE * estimate / 8)
