"""A zstd payload decompresses to at most ZSTD_MAX_RATIO (255) times its length plus
ZSTD_RATIO_SLACK (8 KiB) (docs/codecs.md, Entropy stage).

A frame past it is refused (ProtocolError) before anything is read or allocated: without
it a 2 KB frame of RLE blocks made a server decompress 64 MiB on its event loop, about
0.2 s of CPU for each such CHUNK.  kvwire's encoder never makes such a frame: data that
level 1 compresses further (all-zero layers, padding) goes out as one frame with its
tail stored, at 255 times, and round-trips; real KV data is nowhere near the bound.
"""

from __future__ import annotations

import asyncio
import struct
import tracemalloc
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import zstandard

import kvwire
from kvwire.codec import EntropyCodec, TensorKind, get_codec
from kvwire.codec import entropy as e
from kvwire.codec import gpu as g
from kvwire.errors import ProtocolError
from tests.conftest import SECRET

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "minilm_kv.npz"
SHAPE = (4096, 1, 128)
SIZE = 4096 * 128 * 2  # float16 bytes of SHAPE: what a raw+zstd payload decodes to
ZSTD = [f"{q}+zstd" for q in ("raw", "fp8", "int8", "int4")]
ENTROPY = [*ZSTD, *(f"{q}+lz4" for q in ("raw", "fp8", "int8", "int4"))]
KINDS = [TensorKind.K, TensorKind.V]


def _frame(content_size: int, raw: int) -> bytes:
    """A zstd frame of ``content_size`` bytes: a raw block of ``raw`` bytes, then RLE blocks
    (4 bytes each, up to 128 KiB of content) for the rest."""
    out = struct.pack("<I", 0xFD2FB528) + bytes([0x80, (17 - 10) << 3]) + struct.pack("<I", content_size)
    blocks = [(0, raw)] if raw else []
    rest = content_size - raw
    while rest:
        blocks.append((1, min(rest, 128 << 10)))
        rest -= blocks[-1][1]
    for i, (kind, size) in enumerate(blocks):
        last = 1 if i == len(blocks) - 1 else 0
        out += struct.pack("<I", last | (kind << 1) | (size << 3))[:3]
        out += b"\x07" * size if kind == 0 else b"\x07"
    return out


def _decode(name: str, payload: bytes, shape: tuple[int, int, int] = SHAPE) -> Any:
    return get_codec(name).decode(b"\x01", payload, shape=shape, dtype="float16", kind=TensorKind.K)


@pytest.fixture
def unopened(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fails the test if a zstd frame is looked at or decompressed."""
    def opened(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the frame was opened")

    monkeypatch.setattr(zstandard, "ZstdDecompressor", opened)
    monkeypatch.setattr(zstandard, "get_frame_parameters", opened)


@pytest.mark.usefixtures("unopened")
def test_a_frame_past_the_ratio_is_refused_before_it_is_opened() -> None:
    # what the reproducer sent: all-zero float16 KV of 32768 tokens x 8 x 128 (64 MiB),
    # zstd level 19: about 2 KB behind a header declaring the 64 MiB the shape needs
    big = (32768, 8, 128)
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(2 * 32768 * 8 * 128))
    assert len(bomb) < 4096
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match=r"cannot decompress to 67108864 bytes \(kvwire's zstd frames"):
            _decode("raw+zstd", bomb, big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 << 10  # nothing of the 64 MiB output (nor its unshuffle) allocated
    for name in ("fp8+zstd", "int8+zstd", "int4+zstd"):  # each inner codec's payload alike
        with pytest.raises(ProtocolError, match="cannot decompress"):
            get_codec(name).decode(b"\x01" + (b"\x20" if name == "int4+zstd" else b""), bomb,
                                   shape=big, dtype="float16", kind=TensorKind.V)


def test_the_bound_is_255_times_the_length_plus_8_kib(unopened: None, monkeypatch: pytest.MonkeyPatch) -> None:
    shortest = -(-(SIZE - e.ZSTD_RATIO_SLACK) // e.ZSTD_MAX_RATIO)  # 4081 bytes for 1 MiB
    overhead = len(_frame(SIZE, 0))  # header and the RLE blocks' headers
    at_bound = _frame(SIZE, shortest - overhead - 3)
    assert len(at_bound) == shortest and e.zstd_within_ratio(shortest, SIZE)
    assert not e.zstd_within_ratio(shortest - 1, SIZE)
    with pytest.raises(ProtocolError, match="cannot decompress"):
        _decode("raw+zstd", _frame(SIZE, shortest - overhead - 4))  # one byte shorter
    monkeypatch.undo()  # opened from here on
    assert _decode("raw+zstd", at_bound).shape == SHAPE
    # up to 8 KiB, any payload: a 1-token chunk of zeros is never held to the ratio
    small = zstandard.ZstdCompressor(level=19).compress(bytes(8192))
    assert len(small) * e.ZSTD_MAX_RATIO < 8192
    assert _decode("raw+zstd", small, (32, 1, 128)).shape == (32, 1, 128)


@pytest.mark.parametrize("name", ENTROPY)
@pytest.mark.parametrize("tokens", [1, 4, 32, 33, 1000, 4096])
@pytest.mark.parametrize("kind", KINDS)
def test_all_zero_chunks_are_sent_compressed_within_the_ratio_and_round_trip(
    name: str, tokens: int, kind: TensorKind,
) -> None:
    codec = get_codec(name)
    assert isinstance(codec, EntropyCodec)
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32):
        x = np.zeros((tokens, 8, 128), dtype)
        enc = codec.encode(x, kind)
        inner = codec.inner.encode(x, kind)
        size = memoryview(inner.payload).nbytes
        payload = bytes(memoryview(enc.payload).cast("B"))
        assert enc.params[0] == 1 and len(payload) < size  # compressed, and smaller
        assert size <= e.ZSTD_MAX_RATIO * len(payload) + e.ZSTD_RATIO_SLACK
        y = codec.decode(enc.params, payload, shape=x.shape, dtype=np.dtype(dtype).name, kind=kind)
        assert y.tobytes() == x.tobytes()


def test_an_all_zero_64_mib_chunk_goes_at_255_times_and_round_trips() -> None:
    x = np.zeros((32768, 8, 128), np.float16)  # max_chunk_bytes: the largest a server takes
    codec = get_codec("raw+zstd")
    enc = codec.encode(x, TensorKind.K)
    payload = bytes(memoryview(enc.payload).cast("B"))
    assert enc.params == b"\x01" and x.nbytes // 255 <= len(payload) < x.nbytes // 250
    y = codec.decode(enc.params, payload, shape=x.shape, dtype="float16", kind=TensorKind.K)
    assert not y.any() and y.shape == x.shape


@pytest.mark.parametrize("name", ["fp8+zstd", "int8+zstd", "int4+zstd"])
def test_the_gpu_paths_entropy_stage_keeps_the_ratio(name: str) -> None:
    """``finish_chunk`` (the entropy stage of a payload quantized on a GPU) packs as the
    host encoder does."""
    codec = get_codec(name)
    assert isinstance(codec, EntropyCodec)
    x = np.zeros((4096, 8, 128), np.float16)
    inner = codec.inner.encode(x, TensorKind.K)
    enc = SimpleNamespace(codec_id=inner.codec_id, params=inner.params)
    chunk = g.finish_chunk(codec, enc, memoryview(inner.payload))  # type: ignore[arg-type]
    assert chunk == codec.encode(x, TensorKind.K)
    payload = bytes(memoryview(chunk.payload).cast("B"))
    assert e.zstd_within_ratio(len(payload), memoryview(inner.payload).nbytes)
    assert not codec.decode(chunk.params, payload, shape=x.shape, dtype="float16", kind=TensorKind.K).any()


def test_bounded_frames_are_standard_zstd() -> None:
    """What the encoder sends past level 1's ratio is one frame any zstd decoder takes, of
    the data's exact size, no larger than it needs to be."""
    rng = np.random.default_rng(5)
    for n in (8193, 100_000, 1 << 20, (3 << 20) + 7):
        data = np.zeros(n, np.uint8)
        data[rng.integers(0, n, n // 5000)] = 9
        frame = e.bounded_zstd_frame(data.tobytes())
        assert n // 255 <= len(frame) <= n // 255 + 64 + 24 * (1 + n // (255 << 10)) + len(
            zstandard.ZstdCompressor(level=1).compress(data.tobytes()))
        assert zstandard.get_frame_parameters(frame).content_size == n
        assert zstandard.ZstdDecompressor().decompress(frame) == data.tobytes()
        assert zstandard.ZstdDecompressor().decompressobj().decompress(frame) == data.tobytes()  # streaming


def _sample() -> dict[str, np.ndarray]:
    assert SAMPLE.exists(), f"real KV sample missing: {SAMPLE}"
    with np.load(SAMPLE) as data:
        return {"k": data["k"], "v": data["v"]}


@pytest.mark.parametrize("name", ZSTD)
def test_real_kv_data_is_far_from_the_bound_and_round_trips(name: str) -> None:
    """MiniLM's cache (tests/data): level 1 takes every inner codec's payload down at most
    1.3 times, and every chunk decodes as the inner codec's; half of it zero-padded too."""
    codec = get_codec(name)
    assert isinstance(codec, EntropyCodec)
    sample = _sample()
    worst = 0.0
    for key, kind in (("k", TensorKind.K), ("v", TensorKind.V)):
        for layer in range(6):
            x = np.ascontiguousarray(sample[key][layer, 0])
            padded = np.concatenate([x, np.zeros_like(x)])
            for chunk in (x, padded):
                enc = codec.encode(chunk, kind)
                payload = bytes(memoryview(enc.payload).cast("B"))
                inner = codec.inner.encode(chunk, kind)
                y = codec.decode(enc.params, payload, shape=chunk.shape, dtype="float16", kind=kind)
                z = codec.inner.decode(inner.params, inner.payload, shape=chunk.shape, dtype="float16", kind=kind)
                assert y.tobytes() == z.tobytes()
                if chunk is x and enc.params[0]:
                    worst = max(worst, memoryview(inner.payload).nbytes / len(payload))
    assert worst < 1.5


async def test_a_server_refuses_a_frame_past_the_ratio_and_takes_zero_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: an all-zero cache goes raw+zstd and arrives; a sender whose frames pass
    the ratio (as the encoder made them before) fails with the server's PROTOCOL_ERROR."""
    spec = kvwire.KVSpec(num_layers=2, num_kv_heads=8, head_dim=128)
    zeros = np.zeros((4096, 8, 128), np.float16)  # 8 MiB a K or V: 4 MiB chunks
    layers = [(zeros, zeros), (zeros, zeros)]
    async with kvwire.serve("127.0.0.1", 0, secret=SECRET) as server:
        async with kvwire.connect("127.0.0.1", server.port, secret=SECRET, codec="raw+zstd") as peer:
            recv = asyncio.create_task(server.accept())
            receipt = await peer.send("zeros", spec, layers, timeout=30)
            cache = await (await recv).collect(timeout=30)
            assert receipt.wire_bytes < zeros.nbytes * 4 // 200
            assert all(not k.any() and not v.any() and k.shape == zeros.shape for k, v in cache.layers)
            codec = type(get_codec("raw+zstd"))
            monkeypatch.setattr(codec, "_compress", lambda self, data: zstandard.ZstdCompressor(level=1).compress(data))
            monkeypatch.setattr(codec, "_within_ratio", lambda self, compressed, size: True, raising=False)
            with pytest.raises(ProtocolError, match="cannot decompress"):
                await peer.send("bomb", spec, layers, timeout=30)
