"""``auto_codec="measured"``: a chunk sent raw in place of the chosen quantizer's (values it
refuses: NaN, infinity) is in no run of the chosen codec's measured goodput. Its wire time
(a raw chunk is 2-4 times a quantized one on the wire) counted in the quantizer's run,
its bytes did not: one such chunk in eight of an int8 run at 10 Gbit/s measured int8 at
1.86 GB/s of its 2.42. Its wire time is now taken out of the run at that chunk's
acknowledgement, matched by the chunk's address (matched by codec, an earlier raw chunk's
acknowledgement took its place), and the run goes on (ended there, every next run was a
first that cleared the codec's window: one fallback in four left int8 without a sample)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from kvwire.aio import _gpu, _send
from kvwire.codec.base import EncodedChunk
from kvwire.control import CodecChooser
from kvwire.control.goodput import GoodputMeter
from kvwire.wire import ChunkAddress
from tests.aio.test_auto_nonfinite import FakeDevice, _cache, _send_auto, _spec, chooses

__all__ = ["chooses"]  # (the fixture, used by name)

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
            ch.observe_delivered("raw", CHUNK, t, chunk=i)
        else:
            t += INT8 * CHUNK / LINK
            ch.observe_delivered("int8", CHUNK, t)


def test_a_raw_fallback_chunk_is_in_no_run_of_the_quantizer() -> None:
    ch = CodecChooser.from_ratios({"raw": 1.0, "int8": INT8}, measure_goodput=True)
    _int8_run_with_raw_chunks(ch, told=True)
    true = LINK / INT8  # 2.42 GB/s of KV
    rate = ch.meter.rate("int8")
    assert rate is not None and rate == pytest.approx(true, rel=1e-9)
    assert ch.meter.rate("raw") is None  # nor in raw's: raw is not the chosen codec


def test_the_fallback_chunks_wire_time_is_taken_out_of_the_run() -> None:
    meter = GoodputMeter(sample_acks=8, min_acks=2)
    meter.chosen("int8")
    meter.on_ack("int8", 1000, 0.001)  # starts the run's clock
    meter.on_ack("int8", 1000, 0.002)
    meter.on_ack("int8", 1000, 0.003)
    meter.sent_instead("raw", "f")
    meter.on_ack("raw", 1000, 0.010, chunk="f")  # its wire time (7 ms) is in no run
    assert meter.samples("int8") == 0  # the run goes on
    for i in range(6):
        meter.on_ack("int8", 1000, 0.011 + 0.001 * i)
    assert meter.samples("int8") == 1 and meter.rate("int8") == pytest.approx(1e6)
    # an acknowledgement of another codec's chunk that was not sent in place of int8's
    # (the previous codec's, still in flight) neither counts nor ends the run
    meter.on_ack("raw", 1000, 0.0165)
    for i in range(8):
        meter.on_ack("int8", 1000, 0.017 + 0.001 * i)
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
    m.on_ack("raw", 100, t, chunk="old raw")
    for _ in range(5):
        t += 1.0
        m.on_ack("int8", 100, t)
    t += 3.0
    m.on_ack("raw", 100, t, chunk="fallback")
    for _ in range(4):
        t += 1.0
        m.on_ack("int8", 100, t)
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
            m.on_ack("raw", 100, t, chunk=i)
        else:
            t += 1.0
            m.on_ack("int8", 100, t, chunk=i)
    assert m.rate("int8") == pytest.approx(100.0, rel=0.02)
    assert m.samples("int8") >= 20
    assert len(m._recent["int8"]) == 4  # (the window is full: several samples averaged)


def test_a_fallback_sent_again_keeps_its_mark() -> None:
    """Its stream broke (ChunkLost) and it goes again under the same address: the resend's
    acknowledgement takes its time out of the run."""
    ch = CodecChooser.from_ratios({"raw": 1.0, "int8": INT8}, measure_goodput=True)
    ch.meter.chosen("int8")
    ch.observe_fallback("raw", "a", transfer=1)
    t = 0.0
    for _ in range(4):
        t += 1.0
        ch.observe_delivered("int8", 100, t, chunk="x")
    t += 5.0
    ch.observe_delivered("raw", 100, t, chunk="a")  # (the resend's)
    for _ in range(5):
        t += 1.0
        ch.observe_delivered("int8", 100, t)
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
    receipt, _ = await _send_auto(_cache(np.nan), _spec())
    assert receipt.extra["chunks_by_codec"] == {"int8": 4, "raw": 2}
    assert fallbacks == ["raw", "raw"]


@pytest.mark.timeout(60)
async def test_the_sender_tells_the_chooser_of_a_device_part_sent_raw_instead(
        monkeypatch: pytest.MonkeyPatch, chooses: list[str], fallbacks: list[str]) -> None:
    async def copy_raw_chunks(x: FakeDevice, plan: list[tuple[int, int]]) -> AsyncIterator[tuple[int, int, Any]]:
        for start, count in plan:
            yield start, count, np.array(x.host[start : start + count])

    async def encode_chunks(codec: Any, x: FakeDevice, kind: Any, plan: list[tuple[int, int]],
                            dtype: str) -> AsyncIterator[tuple[int, int, EncodedChunk]]:
        encoded = [codec.encode(x.host[start : start + count], kind) for start, count in plan]
        for (start, count), enc in zip(plan, encoded, strict=True):
            payload = np.frombuffer(bytes(enc.payload), dtype=np.uint8).copy().data
            yield start, count, EncodedChunk(codec_id=enc.codec_id, params=enc.params, payload=payload)

    monkeypatch.setattr(_send, "is_device_array", lambda x: isinstance(x, FakeDevice))
    monkeypatch.setattr(_send, "as_device_array", lambda x, spec, what: x)
    monkeypatch.setattr(_gpu, "copy_raw_chunks", copy_raw_chunks)
    monkeypatch.setattr(_gpu, "encode_chunks", encode_chunks)
    chooses.append("int4")
    on_device = [(FakeDevice(k), FakeDevice(v)) for k, v in _cache(np.inf)]
    receipt, _ = await _send_auto(on_device, _spec())  # type: ignore[arg-type]
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
