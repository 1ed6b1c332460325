"""``auto_codec="measured"``: a chunk sent raw in place of the chosen quantizer's (values it
refuses: NaN, infinity) is in no run of the chosen codec's measured goodput. Its wire time
(a raw chunk is 2-4 times a quantized one on the wire) counted in the quantizer's run,
its bytes did not: one such chunk in eight of an int8 run at 10 Gbit/s measured int8 at
1.86 GB/s of its 2.42. The run now ends at that chunk's acknowledgement."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from kvwire.aio import _gpu, _send
from kvwire.codec.base import EncodedChunk
from kvwire.control import CodecChooser
from kvwire.control.goodput import GoodputMeter
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
                ch.observe_fallback("raw")
            t += CHUNK / LINK
            ch.observe_delivered("raw", CHUNK, t)
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


def test_the_run_ends_at_the_fallback_chunks_acknowledgement() -> None:
    meter = GoodputMeter(sample_acks=8, min_acks=2)
    meter.chosen("int8")
    meter.on_ack("int8", 1000, 0.001)  # starts the run's clock
    meter.on_ack("int8", 1000, 0.002)
    meter.on_ack("int8", 1000, 0.003)
    meter.sent_instead("raw")
    meter.on_ack("raw", 1000, 0.010)  # its wire time (7 ms) is in no run
    assert meter.samples("int8") == 1 and meter.rate("int8") == pytest.approx(2000 / 0.002)
    for i in range(9):  # the next run starts at the next int8 acknowledgement
        meter.on_ack("int8", 1000, 0.011 + 0.001 * i)
    assert meter.samples("int8") == 2
    assert meter.rate("int8") == pytest.approx(1e6)
    # an acknowledgement of another codec's chunk that was not sent in place of int8's
    # (the previous codec's, still in flight) neither counts nor ends the run
    meter.on_ack("raw", 1000, 0.0195)
    for i in range(8):
        meter.on_ack("int8", 1000, 0.020 + 0.001 * i)
    assert meter.samples("int8") == 3 and meter.rate("int8") == pytest.approx(1e6)


def test_a_fallback_chunk_never_acknowledged_is_forgotten_when_the_pipe_goes_idle() -> None:
    ch = CodecChooser.from_ratios({"raw": 1.0, "int8": INT8}, measure_goodput=True)
    ch.meter.chosen("int8")
    ch.observe_fallback("raw")  # its transfer failed: never acknowledged
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
    meter.sent_instead("raw")
    for i in range(3):
        meter.on_ack("raw", 1000, 0.001 * (i + 1))
    assert meter.samples("raw") == 1


@pytest.fixture
def fallbacks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    told: list[str] = []
    observe = CodecChooser.observe_fallback

    def record(self: CodecChooser, codec: str) -> None:
        told.append(codec)
        observe(self, codec)

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
