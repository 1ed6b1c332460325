"""The entropy stage never produces more than the chunk's shape says (protocol.md 7.4).

A compressed payload is checked against ``max_chunk_bytes`` by its header's shape before
it is opened; these tests hold the other half: the decompressor itself stops at that size,
whatever the compressed frame claims or holds.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.codec import EntropyCodec, TensorKind, get_codec
from kvwire.codec.entropy import decompressed_size, zstd_within_ratio
from kvwire.errors import ProtocolError

SHAPE = (4096, 1, 128)
SIZE = 4096 * 128 * 2  # float16 bytes of SHAPE: what a raw+zstd / raw+lz4 payload decodes to
# What one decode may allocate beyond its output (numpy's unshuffle copies it once).
SLACK = 2 * SIZE + (256 << 10)


def _zstd_frame(content_size: int, blocks: list[tuple[int, int]], window_log: int = 17) -> bytes:
    """A zstd frame declaring ``content_size`` whose blocks are ``(kind, size)``: kind 0
    a raw block of ``size`` bytes, kind 1 an RLE block (one byte, ``size`` copies)."""
    out = struct.pack("<I", 0xFD2FB528) + bytes([0x80, (window_log - 10) << 3]) + struct.pack("<I", content_size)
    for i, (kind, size) in enumerate(blocks):
        last = 1 if i == len(blocks) - 1 else 0
        out += struct.pack("<I", last | (kind << 1) | (size << 3))[:3]
        out += b"\x07" * size if kind == 0 else b"\x07"
    return out


def _lz4_block(total: int) -> bytes:
    """An lz4 block that decodes to ``total`` bytes (``total >= 25``): one literal, one
    long match of it, five literals."""
    k, last = divmod(total - 25, 255)
    return bytes([0x1F]) + b"a" + (1).to_bytes(2, "little") + b"\xff" * k + bytes([last]) + bytes([0x50]) + b"bbbbb"


def _peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()``'s result (or the ProtocolError it raised) and the peak of traced memory."""
    tracemalloc.start()
    try:
        try:
            result: Any = fn()
        except ProtocolError as exc:
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _decode(name: str, payload: bytes) -> Callable[[], Any]:
    return lambda: get_codec(name).decode(b"\x01", payload, shape=SHAPE, dtype="float16", kind=TensorKind.K)


def test_zstd_bomb_that_declares_the_expected_size_is_refused_unopened() -> None:
    # 64 RLE blocks of 128 KiB: 8 MiB of output from 270 bytes, behind a header saying 1 MiB.
    bomb = _zstd_frame(SIZE, [(1, 128 << 10)] * 64)
    assert zstandard.get_frame_parameters(bomb).content_size == SIZE
    result, peak = _peak(_decode("raw+zstd", bomb))
    assert isinstance(result, ProtocolError)
    assert peak < SLACK


def test_zstd_frame_that_stops_short_or_runs_on_is_refused() -> None:
    whole = [(0, 128 << 10)] * 8  # exactly SIZE (raw blocks: RLE ones expand past the ratio)
    assert _decode("raw+zstd", _zstd_frame(SIZE, whole))().shape == SHAPE
    for blocks in (whole[:-1], [*whole, (1, 1)]):
        with pytest.raises(ProtocolError):
            _decode("raw+zstd", _zstd_frame(SIZE, blocks))()
    good = zstandard.ZstdCompressor(level=1).compress(bytes(SIZE))
    for payload in (good + b"\0", good + good, good[:-1]):
        with pytest.raises(ProtocolError):
            _decode("raw+zstd", payload)()


def test_lz4_bomb_is_refused_without_producing_it() -> None:
    assert _decode("raw+lz4", _lz4_block(SIZE))().shape == SHAPE
    for total in (SIZE + 1, 64 * SIZE):
        result, peak = _peak(_decode("raw+lz4", _lz4_block(total)))
        assert isinstance(result, ProtocolError)
        assert peak < SLACK
    with pytest.raises(ProtocolError):
        _decode("raw+lz4", _lz4_block(SIZE - 1))()


_BLOCK = st.tuples(st.integers(0, 1), st.integers(1, 128 << 10))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pattern=st.lists(_BLOCK, min_size=1, max_size=8),
    repeat=st.integers(1, 64),
    window_log=st.integers(10, 17),
)
def test_property_zstd_output_never_exceeds_the_shape(
    pattern: list[tuple[int, int]], repeat: int, window_log: int,
) -> None:
    """Whatever blocks a frame declaring the expected size holds (up to 64 times that
    size), decoding gives exactly that size or a ProtocolError, and never holds much more
    than that size; exactly that size only from a frame within the ratio."""
    blocks = [(kind, min(size, 1 << window_log)) for kind, size in pattern] * repeat
    frame = _zstd_frame(SIZE, blocks, window_log)
    result, peak = _peak(_decode("raw+zstd", frame))
    if sum(size for _, size in blocks) == SIZE and zstd_within_ratio(len(frame), SIZE):
        assert not isinstance(result, ProtocolError) and result.shape == SHAPE
    else:
        assert isinstance(result, ProtocolError)
    assert peak < SLACK


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["raw+zstd", "raw+lz4", "int8+zstd", "fp8+lz4", "int4+zstd"]),
    shape=st.tuples(st.integers(1, 64), st.integers(1, 3), st.integers(1, 48)),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    zeros=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_valid_entropy_frames_round_trip(
    name: str, shape: tuple[int, int, int], dtype: str, zeros: float, seed: int,
) -> None:
    """Payloads the encoder made, compressed or not, decode exactly as the inner codec's."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x[rng.random(shape) < zeros] = 0.0  # compressible runs, so the compressed form is used too
    x = x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
    codec = get_codec(name)
    chunk = codec.encode(x, TensorKind.V)
    y = codec.decode(chunk.params, bytes(memoryview(chunk.payload).cast("B")), shape=shape, dtype=dtype, kind=TensorKind.V)
    inner = codec.inner  # type: ignore[attr-defined]
    plain = inner.encode(x, TensorKind.V)
    z = inner.decode(plain.params, plain.payload, shape=shape, dtype=dtype, kind=TensorKind.V)
    assert np.array_equal(np.asarray(y).view(np.uint8), np.asarray(z).view(np.uint8))


@pytest.mark.parametrize("name", ["raw+zstd", "int8+lz4", "int4+zstd", "int4+lz4", "int4", "raw"])
@pytest.mark.parametrize("kind", [TensorKind.K, TensorKind.V])
def test_decompressed_size_is_what_a_decode_decompresses_to(
    name: str, kind: TensorKind, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a receiver bounds before decoding is the size the decode then decompresses to:
    the inner payload (int4: 8 bytes a group more than its codes), 0 where nothing is."""
    shape = (40, 2, 16)
    x = np.tile(np.arange(-8, 8, dtype=np.float16), (40, 2, 1))  # compresses in every stage
    codec = get_codec(name)
    enc = codec.encode(x, kind)
    payload = bytes(memoryview(enc.payload).cast("B"))
    sizes: list[int] = []
    if isinstance(codec, EntropyCodec):
        original = type(codec)._decompress

        def spy(self: Any, data: Any, size: int) -> bytes:
            sizes.append(size)
            return original(self, data, size)

        monkeypatch.setattr(type(codec), "_decompress", spy)
        codec.decode(enc.params, payload, shape=shape, dtype="float16", kind=kind)
        assert enc.params[0] == 1 and sizes == [decompressed_size(codec, enc.params, shape, "float16", kind)]
        assert decompressed_size(codec, b"\x00" + enc.params[1:], shape, "float16", kind) == 0
        with pytest.raises(ProtocolError):
            decompressed_size(codec, b"\x03" + enc.params[1:], shape, "float16", kind)
        if codec.inner.name == "int4":  # groups of 1: every element's scale and minimum
            assert decompressed_size(codec, b"\x01\x01", shape, "float16", kind) == 8 * 1280 + 640
    else:
        assert decompressed_size(codec, enc.params, shape, "float16", kind) == 0
