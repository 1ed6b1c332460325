"""The compiled codec loops' entry points (``kvwire.codec._hostcodec``) refuse what the
loops cannot take, before any element is read or written: sizes whose products would wrap
(each message states real sizes), buffers not aligned to their elements, outputs
overlapping inputs, and a negative SIMD level.  Spans are read once, so an output written
over the caller's spans does not move the rows.  The codecs' public API copies what the
entry points refuse (a misaligned array, an output over its payload) and gives the numpy
reference's bytes."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest

from kvwire.codec import Fp8Codec, Int4Codec, Int8Codec, TensorKind, _host, get_codec
from tests.conftest import needs_extension

pytestmark = needs_extension(_host.ext is not None, "kvwire.codec._hostcodec")

MAX = (1 << 63) - 1
SENTINEL = 0xA5


def _ext() -> Any:
    assert _host.ext is not None
    return _host.ext


def _misaligned(nbytes: int) -> memoryview:
    """A writable ``nbytes`` at an odd address."""
    raw = np.zeros(nbytes + 8, np.uint8)
    start = 1 if raw.ctypes.data % 2 == 0 else 0
    return raw[start : start + nbytes].data


@pytest.mark.parametrize("call", [
    lambda h: h.encode_rows(0, b"", 0, 1 << 62, 1, bytearray(0), bytearray(0)),
    lambda h: h.encode_rows(1, b"", 2, 1 << 62, 1, bytearray(0), bytearray(0)),
    lambda h: h.encode_rows(0, b"", 0, 1, 1 << 62, bytearray(0), bytearray(0)),
    lambda h: h.decode_rows(0, b"", b"", 1 << 62, 1, 0, bytearray(0)),
    lambda h: h.decode_rows(1, b"", b"", (1 << 61) + 1, 1, 2, bytearray(0)),
    lambda h: h.int4_encode(b"", 0, 1 << 61, 1, 1, 1, False, bytearray(0), bytearray(0), bytearray(0)),
    lambda h: h.int4_decode(b"", b"", b"", 1 << 61, 1, 1, 1, False, 0, bytearray(0)),
    lambda h: h.int4_encode(b"", 0, 1, MAX, 1, 1, False, bytearray(0), bytearray(0), bytearray(0)),
    lambda h: h.int4_decode(b"", b"", b"", 1, 1, MAX, 1, True, 2, bytearray(0)),
])
def test_sizes_whose_products_wrap_are_refused_with_real_sizes(call: Any) -> None:
    with pytest.raises(ValueError) as info:
        call(_ext())
    assert not re.search(r"-\d", str(info.value)), str(info.value)
    # Refused by the size checks (each case's product wraps), not by a buffer's length.
    assert re.fullmatch(r"sizes too large: \d+ \* \d+ is more than a buffer can hold", str(info.value)), str(info.value)


def test_buffers_not_aligned_to_their_elements_are_refused() -> None:
    h = _ext()
    rows, dim = 3, 33
    x = _misaligned(rows * dim * 2)
    np.frombuffer(x, np.uint8)[:] = np.frombuffer(np.full(rows * dim, 1.5, np.float16).tobytes(), np.uint8)
    sc, co = bytearray(4 * rows), bytearray(rows * dim)
    for kind in (0, 1):
        with pytest.raises(ValueError, match="input is not aligned to its 2-byte elements"):
            h.encode_rows(kind, x, 0, rows, dim, sc, co)
    assert sc == bytearray(4 * rows) and co == bytearray(rows * dim)
    out = _misaligned(rows * dim * 4)
    np.frombuffer(out, np.uint8)[:] = SENTINEL
    for kind, dt in ((0, 2), (1, 0), (1, 1)):
        with pytest.raises(ValueError, match="out is not aligned"):
            h.decode_rows(kind, sc, co, rows, dim, dt, out[: rows * dim * (4 if dt == 2 else 2)])
    # int4: 2 tokens of 1 x 16 float32, K group 2 (16 groups)
    x4 = _misaligned(2 * 16 * 4)
    sc4, mn4, pk4 = bytearray(64), bytearray(64), bytearray(16)
    with pytest.raises(ValueError, match="input is not aligned to its 4-byte elements"):
        h.int4_encode(x4, 2, 2, 1, 16, 2, False, sc4, mn4, pk4)
    with pytest.raises(ValueError, match="out is not aligned"):
        h.int4_decode(sc4, mn4, pk4, 2, 1, 16, 2, False, 2, out[: 2 * 16 * 4])
    assert (np.frombuffer(out, np.uint8) == SENTINEL).all()
    # the same calls on aligned buffers are taken
    assert h.encode_rows(0, np.zeros(rows * dim, np.float16).view(np.uint8), 0, rows, dim, sc, co) == 0
    assert h.int4_encode(np.zeros(32, np.float32).view(np.uint8), 2, 2, 1, 16, 2, False, sc4, mn4, pk4) == 0


def test_outputs_overlapping_inputs_are_refused() -> None:
    h = _ext()
    rows, dim = 4, 16
    buf = np.zeros(rows * dim * 2 + rows * 4 + rows * dim, np.uint8)
    x = buf[: rows * dim * 2]
    with pytest.raises(ValueError, match="codes overlaps input"):
        h.encode_rows(0, x, 0, rows, dim, np.zeros(rows * 4, np.uint8), buf[rows * 4 : rows * 4 + rows * dim])
    with pytest.raises(ValueError, match="scales overlaps codes"):
        h.encode_rows(0, x, 0, rows, dim, buf[-rows * dim - 2 : -rows * dim + rows * 4 - 2], buf[-rows * dim :])
    sc, co = np.zeros(rows * 4, np.uint8), np.zeros(rows * dim, np.uint8)
    out = np.zeros(rows * dim * 2 + rows * 4, np.uint8)
    with pytest.raises(ValueError, match="out overlaps scales"):
        h.decode_rows(0, out[rows * dim * 2 - 8 : rows * dim * 2 + 8], co, rows, dim, 0, out[: rows * dim * 2])
    with pytest.raises(ValueError, match="out overlaps codes"):
        h.decode_rows(1, sc, out[: rows * dim], rows, dim, 0, out[: rows * dim * 2])
    # int4: 4 tokens of 1 x 16 float16, V group 16 (4 groups)
    x4 = np.zeros(4 * 16 * 2 + 16 + 32, np.uint8)
    with pytest.raises(ValueError, match="codes overlaps input"):
        h.int4_encode(x4[:128], 0, 4, 1, 16, 16, True, bytearray(16), bytearray(16), x4[96:128])
    with pytest.raises(ValueError, match="minimums overlaps codes"):
        h.int4_encode(x4[:128], 0, 4, 1, 16, 16, True, bytearray(16), x4[128:144], x4[136:168])
    with pytest.raises(ValueError, match="out overlaps minimums"):
        h.int4_decode(bytes(16), x4[120:136], bytes(32), 4, 1, 16, 16, True, 0, x4[:128])
    # inputs may share memory: a decode only reads them
    assert h.decode_rows(0, co[: rows * 4], co, rows, dim, 0, out[: rows * dim * 2]) == 0


def test_spans_written_over_by_the_decode_do_not_move_the_rows() -> None:
    """The ranges are checked and used as they were at the call: an output written over
    the caller's spans (or spans changed by another thread) changes nothing."""
    h = _ext()
    out = np.full(256, SENTINEL, np.uint8)  # 8 rows of 16 float16; the chunk is 4 rows
    spans = out[:32].view(np.int64)  # rows 0-1 go to bytes 0-63 (over the spans), rows 2-3 to 128-191
    spans[:] = [0, 64, 128, 64]
    assert h.decode_rows(0, bytes(16), bytes(64), 4, 16, 0, out, spans.data.cast("B")) == 0
    assert (out[:64] == 0).all() and (out[128:192] == 0).all()
    assert (out[64:128] == SENTINEL).all() and (out[192:] == SENTINEL).all()
    out[:] = SENTINEL
    spans[:] = [0, 64, 128, 64]
    assert h.int4_decode(bytes(128), bytes(128), bytes(32), 4, 1, 16, 2, False, 0, out,
                         spans.data.cast("B")) == 0
    assert (out[:64] == 0).all() and (out[128:192] == 0).all()
    assert (out[64:128] == SENTINEL).all() and (out[192:] == SENTINEL).all()


def test_simd_refuses_a_negative_level() -> None:
    h = _ext()
    level = h.simd(_host.SIMD_BEST)
    for bad in (-1, -7, -(1 << 31)):
        with pytest.raises(ValueError, match="level >= 0"):
            h.simd(bad)
        assert h.simd(_host.SIMD_BEST) == level
    assert h.simd(_host.SIMD_GENERIC) == _host.SIMD_GENERIC
    assert h.simd(_host.SIMD_BEST) == level


@pytest.mark.parametrize("base", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_codecs_take_misaligned_arrays_and_outputs(base: str, dtype: str) -> None:
    """The public API copies a misaligned input and decodes a misaligned output through an
    aligned one: the numpy reference's bytes."""
    codec = Int4Codec(32) if base == "int4" else get_codec(base)
    assert isinstance(codec, Fp8Codec | Int8Codec | Int4Codec)
    x = np.random.default_rng(9).standard_normal((7, 3, 24)).astype(dtype)
    shifted = np.frombuffer(_misaligned(x.nbytes), x.dtype).reshape(x.shape)
    shifted[...] = x
    assert not shifted.flags.aligned
    for kind in (TensorKind.K, TensorKind.V):
        chunk = codec.encode(shifted, kind)
        ref = codec.encode_numpy(x, kind)
        payload = bytes(memoryview(chunk.payload).cast("B"))
        assert (chunk.params, payload) == (ref.params, bytes(memoryview(ref.payload).cast("B")))
        want = codec.decode_numpy(chunk.params, payload, shape=x.shape, dtype=dtype, kind=kind)
        out = np.frombuffer(_misaligned(x.nbytes), x.dtype).reshape(x.shape)
        assert not out.flags.aligned
        got = codec.decode(chunk.params, payload, shape=x.shape, dtype=dtype, kind=kind, out=out)
        assert got is out and out.tobytes() == want.tobytes()
