"""``codec="auto"`` sends raw a chunk whose values the quantizer it chose refuses (NaN,
infinity, an int4 group's range past float32): the send succeeds, that chunk arrives bit for
bit, and the receipt and the chooser count it as raw (docs/codecs.md, Input rules).  With
one NaN or inf in a cache, the whole send failed with "codec 'int4' cannot carry NaN or
infinity", a codec the caller never named.  A codec the caller names still refuses them."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire.codec import Int4Codec
from kvwire.control import CodecChooser
from tests.aio.auto_helpers import (
    BAD_AT,
    TOKENS,
    FakeDevice,
    fake_device_path,
    nonfinite_cache,
    nonfinite_spec,
    record_choices,
    send_auto,
)
from tests.conftest import SECRET, make_layers

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def chooses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """See :func:`record_choices`."""
    return record_choices(monkeypatch)


def _check_arrived(sent: list[tuple[np.ndarray, np.ndarray]], got: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """The tensors holding a bad value arrived bit for bit; every other one quantized."""
    raw = {(layer, half) for layer, half, *_ in BAD_AT}
    for layer, (pair, pair2) in enumerate(zip(sent, got, strict=True)):
        for half, (a, b) in enumerate(zip(pair, pair2, strict=True)):
            assert b.dtype == a.dtype and b.shape == a.shape
            if (layer, half) in raw:
                assert b.tobytes() == a.tobytes(), (layer, half)
            else:
                a32, b32 = a.astype(np.float32), b.astype(np.float32)
                assert b.tobytes() != a.tobytes() and np.isfinite(b32).all(), (layer, half)
                assert float(np.linalg.norm(a32 - b32) / np.linalg.norm(a32)) < 0.15


@pytest.mark.parametrize(("codec", "value"), [("int4", np.inf), ("fp8", np.nan), ("int8", -np.inf),
                                               ("int4+zstd", np.nan)])
async def test_auto_sends_raw_the_chunks_its_quantizer_refuses(codec: str, value: float, chooses: list[str]) -> None:
    chooses.append(codec)
    layers = nonfinite_cache(value)
    receipt, got = await send_auto(layers, nonfinite_spec())
    _check_arrived(layers, got)
    for layer, half, *where in BAD_AT:
        assert np.array_equal(got[layer][half][tuple(where)], value, equal_nan=True)
    assert receipt.chunks == 6
    assert receipt.extra["chunks_by_codec"] == {codec: 4, "raw": 2}
    assert receipt.codec == "auto"  # (more than one codec went out)
    assert chooses == [codec] * 5  # the choice, then the sizes of its 4 chunks: none of raw's


async def test_auto_sends_raw_an_int4_group_whose_range_exceeds_float32(chooses: list[str]) -> None:
    # finite float32 values, but max - min of their group overflows: int4 refuses them
    chooses.append("int4")
    layers = nonfinite_cache(3e38, "float32")
    for layer, half, token, head, dim in BAD_AT:
        layers[layer][half][token, head, dim ^ 1] = -3e38  # in the same group (K: a channel's tokens)
        layers[layer][half][token ^ 1, head, dim] = -3e38  # (V: a token's channels)
    receipt, got = await send_auto(layers, nonfinite_spec("float32"))
    _check_arrived(layers, got)
    assert receipt.extra["chunks_by_codec"] == {"int4": 4, "raw": 2}


async def test_a_codec_the_caller_names_still_refuses_nan_and_infinity(chooses: list[str]) -> None:
    chooses.append("int4")
    layers = nonfinite_cache(np.inf)
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="int4") as peer:
            with pytest.raises(kvwire.UsageError, match="codec 'int4' cannot carry NaN or infinity"):
                await peer.send("named", nonfinite_spec(), layers, timeout=20)
        # named for one send of a session whose codec is auto (its chooser made already)
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="auto") as peer:
            assert peer.chooser is not None
            with pytest.raises(kvwire.UsageError, match="codec 'fp8' cannot carry NaN or infinity"):
                await peer.send("override", nonfinite_spec(), layers, codec="fp8", timeout=20)


async def test_auto_sends_raw_a_device_tensor_its_kernel_refuses(monkeypatch: pytest.MonkeyPatch,
                                                                 chooses: list[str]) -> None:
    calls: list[str] = []
    fake_device_path(monkeypatch, calls)
    chooses.append("int4")
    layers = nonfinite_cache(np.nan)
    on_device = [(FakeDevice(k), FakeDevice(v)) for k, v in layers]
    receipt, got = await send_auto(on_device, nonfinite_spec())  # type: ignore[arg-type]
    _check_arrived(layers, got)
    assert receipt.extra["chunks_by_codec"] == {"int4": 4, "raw": 2}
    # layer 1's K and layer 2's V: the kernel refused the tensor, its chunks copied raw
    e, c = "encode:int4", "copy"
    assert calls == [e, e, e, c, e, e, e, c]


async def test_auto_sends_raw_on_the_error_class_not_its_text(monkeypatch: pytest.MonkeyPatch,
                                                              chooses: list[str]) -> None:
    """What goes raw is a chunk whose encode raised ``UnrepresentableValuesError``, whatever
    it says; any other UsageError (the same words included) fails the send as before."""
    chooses.append("int4")
    encode = Int4Codec.encode

    def refusing(error: type[kvwire.UsageError]) -> Any:
        def refuse(self: Int4Codec, x: Any, kind: Any) -> Any:
            if np.asarray(x).dtype == np.float16 and float(np.asarray(x, np.float32).flat[0]) == 7.0:
                raise error("codec 'int4' cannot carry NaN or infinity; use 'raw' for such tensors")
            return encode(self, x, kind)
        return refuse

    layers = make_layers(3, TOKENS, 2, 16, seed=11)
    layers[1][0][0, 0, 0] = 7.0  # layer 1's K is refused
    monkeypatch.setattr(Int4Codec, "encode", refusing(kvwire.UnrepresentableValuesError))
    receipt, got = await send_auto(layers, nonfinite_spec())
    assert got[1][0].tobytes() == layers[1][0].tobytes()
    assert receipt.extra["chunks_by_codec"] == {"int4": 5, "raw": 1}
    monkeypatch.setattr(Int4Codec, "encode", refusing(kvwire.UsageError))
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="auto") as peer:
            with pytest.raises(kvwire.UsageError, match="cannot carry NaN") as info:
                await peer.send("plain", nonfinite_spec(), layers, timeout=20)
    assert type(info.value) is kvwire.UsageError


async def test_the_acknowledgement_of_a_chunk_sent_raw_instead_takes_its_mark(
        monkeypatch: pytest.MonkeyPatch, chooses: list[str]) -> None:
    """With measured goodput the sender marks each chunk it sends raw in place of the
    quantizer's by its address, and the client hands the meter that address with the
    chunk's acknowledgement, which takes the mark: handed none, the marks stayed until the
    pipe went idle and the fallbacks' wire bytes were left out of the run."""
    from kvwire.control.goodput import GoodputMeter

    monkeypatch.setattr(CodecChooser, "observe_idle", lambda self: None)  # (it forgets every mark)
    made: list[Any] = []
    sent_instead = GoodputMeter.sent_instead

    def mark(self: GoodputMeter, codec: str, chunk: Any, **kwargs: Any) -> None:
        made.append(chunk)
        sent_instead(self, codec, chunk, **kwargs)

    monkeypatch.setattr(GoodputMeter, "sent_instead", mark)
    chooses.append("int8")
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="auto",
                                  auto_codec="measured") as peer:
            recv = asyncio.create_task(server.accept())
            receipt = await peer.send("bad", nonfinite_spec(), nonfinite_cache(np.nan), timeout=20)
            await (await recv).collect(timeout=20)
            assert peer.chooser is not None and peer.chooser.measures_goodput
            left = dict(peer.chooser.meter._instead)
    assert receipt.extra["chunks_by_codec"] == {"int8": 4, "raw": 2}
    assert len(made) == 2 and left == {}
