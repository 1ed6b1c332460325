"""The compiled CPU codecs (kernels/kvquant.cuh built for the host) against the numpy reference.

Byte for byte: payloads over every finite float16 and bfloat16 bit pattern, decoded values
over every code, and the same exception (type and message) for every refused input; then
Hypothesis over shapes, dtypes, group sizes and values (NaN, infinity, subnormals, signed
zeros, odd sizes) and over corrupted payloads.  The numpy path (``KVWIRE_NO_EXTENSIONS=1``
or ``encode_numpy``/``decode_numpy``) is exercised here too.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import platform
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvwire._extensions import extensions_disabled
from kvwire.codec import Fp8Codec, Int4Codec, Int8Codec, TensorKind, _host, get_codec, numpy_dtype
from kvwire.errors import KvwireError, ProtocolError, UsageError
from tests.codec.codec_helpers import DTYPES
from tests.conftest import needs_extension, require_extension

Reference = Fp8Codec | Int8Codec | Int4Codec

DISABLED = extensions_disabled()
EXT = "kvwire.codec._hostcodec"
needs_ext = needs_extension(_host.ext is not None, EXT)
# The floating-point modes these tests set (MXCSR's FTZ/DAZ bits, the FE_* rounding values)
# are x86's; CI runs on x86_64, where they never skip.
needs_x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                               reason="MXCSR and the FE_* values are x86's")
KINDS = (TensorKind.K, TensorKind.V)
ALL16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def test_extension_was_built() -> None:
    """CI fails here, with the reason, when the compiled codecs silently failed to build."""
    if DISABLED:
        assert _host.ext is None and _host.isa() is None
        return
    require_extension(_host.ext is not None, EXT)
    assert _host.ext is not None
    isa = _host.isa()
    assert isinstance(isa, str)
    best = _host.simd(_host.SIMD_BEST)
    assert best == max(LEVELS) and best <= _host.ext.SIMD_BUILT
    compiler = str(sysconfig.get_config_var("CC") or "")
    if platform.machine() in ("x86_64", "AMD64") and "gcc" in compiler:  # the SIMD loops are built
        assert _host.ext.SIMD_BUILT == _host.SIMD_AVX512
        flags = _cpu_flags().split()
        if "avx2" in flags and "f16c" in flags:
            if "avx512f" in flags and "avx512bw" in flags:
                assert best == _host.SIMD_AVX512 and isa == "AVX-512 loops (fp8, int8, int4 encode) + F16C"
            else:
                assert best == _host.SIMD_AVX2 and isa == "AVX2 + F16C loops"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _levels() -> list[int]:
    """The SIMD levels of the compiled loops this CPU can run (each one is compared)."""
    if _host.ext is None:
        return [0]
    levels: list[int] = [level for level in range(_host.SIMD_BEST + 1) if _host.simd(level) == level]
    _host.simd(_host.SIMD_BEST)
    return levels


LEVELS = _levels()


@contextlib.contextmanager
def _simd(level: int) -> Iterator[None]:
    """The compiled loops of one SIMD level (generic C, F16C rows, AVX2, AVX-512), then the best again."""
    assert _host.simd(level) == level
    try:
        yield
    finally:
        _host.simd(_host.SIMD_BEST)


def _codec(base: str, group: int = 32) -> Reference:
    codec = Int4Codec(group) if base == "int4" else get_codec(base)
    assert isinstance(codec, Fp8Codec | Int8Codec | Int4Codec)
    return codec


def _outcome(fn: Any) -> tuple[str, Any]:
    """("ok", bytes) or (exception type name, message) of ``fn()``."""
    try:
        result = fn()
    except KvwireError as exc:
        return type(exc).__name__, str(exc)
    if isinstance(result, np.ndarray):
        return "ok", (str(result.dtype), result.shape, result.tobytes())
    if isinstance(result, bool):
        return "ok", result
    return "ok", (result.params, bytes(memoryview(result.payload).cast("B")))


def _same_encode(codec: Reference, x: np.ndarray[Any, Any], kind: TensorKind) -> None:
    got = _outcome(lambda: codec.encode(x, kind))
    want = _outcome(lambda: codec.encode_numpy(x, kind))
    assert got[0] == want[0], (got[0], want[0], got[1] if got[0] != "ok" else "", want[1] if want[0] != "ok" else "")
    assert got == want


def _same_decode(
    codec: Reference, params: bytes, payload: Any, shape: tuple[int, int, int], dtype: str, kind: TensorKind
) -> None:
    got = _outcome(lambda: codec.decode(params, payload, shape=shape, dtype=dtype, kind=kind))
    want = _outcome(lambda: codec.decode_numpy(params, payload, shape=shape, dtype=dtype, kind=kind))
    assert got[0] == want[0], (got, want) if got[0] != "ok" or want[0] != "ok" else got[0]
    assert got == want


def _finite_patterns(dtype: str) -> np.ndarray[Any, Any]:
    limit = 0x7C00 if dtype == "float16" else 0x7F80
    bits = ALL16[limit > (ALL16 & 0x7FFF)]
    return bits.view(numpy_dtype(dtype))


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("base", ["fp8", "int8", "int4"])
def test_every_16_bit_pattern_encodes_and_decodes_like_numpy(dtype: str, base: str, level: int) -> None:
    values = _finite_patterns(dtype)
    n = values.size // 64 * 64
    rng = np.random.default_rng(7)
    # sorted rows (neighbouring values: narrow rows and groups, every code used) and a
    # shuffle (wide rows and groups, tiny values next to huge ones), plus every pattern
    # alone in its row next to a fixed larger value (each pattern quantized at one scale)
    # (rows of 39 patterns and one larger value: the 32- and 8-element SIMD steps and a tail)
    big = np.full(values.size, values.dtype.type(1.5 if dtype == "float16" else 3e38))
    m = values.size // 39 * 39
    chunks = [
        values[:n].reshape(-1, 2, 32),
        rng.permutation(values)[:n].reshape(-1, 4, 16),
        np.stack([values, big], axis=1).reshape(-1, 2, 2),
        np.concatenate([rng.permutation(values)[:m].reshape(-1, 39), big[: m // 39, None]], axis=1).reshape(-1, 1, 40),
    ]
    codec = _codec(base)
    with _simd(level):
        for x in chunks:
            for kind in KINDS:
                _same_encode(codec, x, kind)
                try:
                    chunk = codec.encode_numpy(x, kind)
                except UsageError:  # int4: a shuffled bfloat16 group spans more than float32
                    assert base == "int4" and dtype == "bfloat16"
                    continue
                for out in DTYPES:
                    _same_decode(codec, chunk.params, chunk.payload, x.shape, out, kind)
        if base == "int4":  # value runs of 8: five to a row, scaled four at a time and one alone
            _same_encode(_codec(base, 8), chunks[-1], TensorKind.V)


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("base", ["fp8", "int8"])
def test_every_code_at_many_scales_decodes_like_numpy(base: str, level: int) -> None:
    codes = np.arange(256, dtype=np.uint8)
    codes = codes[(codes & 0x7F) != 0x7F] if base == "fp8" else codes[codes != 0x80]
    scales = np.array([0.0, 2.0**-149, 1e-40, 1e-30, 3e-8, 1.0 / 448, 0.37, 1.0, 146.3, 65504 / 448,
                       65520 / 448, 1e30, 7.5e35], np.float32)
    rows, dim = scales.size, codes.size
    payload = np.concatenate([scales.view(np.uint8), np.tile(codes, rows)])
    codec = _codec(base)
    with _simd(level):
        _decode_each_scale(codec, payload, rows, dim)


def _decode_each_scale(codec: Reference, payload: np.ndarray[Any, Any], rows: int, dim: int) -> None:
    for dtype in DTYPES:
        for r in range(rows):  # one scale per chunk so each row's error (if any) is seen
            one = np.concatenate([payload[4 * r : 4 * r + 4], payload[4 * rows + r * dim : 4 * rows + (r + 1) * dim]])
            _same_decode(codec, b"", one, (1, 1, dim), dtype, TensorKind.K)
        _same_decode(codec, b"", payload, (rows, 1, dim), dtype, TensorKind.K)


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
def test_every_int4_code_decodes_like_numpy(level: int) -> None:
    with _simd(level):
        _every_int4_code()


def _every_int4_code() -> None:
    codes = np.arange(256, dtype=np.uint8)  # every pair of nibbles
    codec = _codec("int4", 4)
    rng = np.random.default_rng(3)
    for dtype in DTYPES:
        for kind in KINDS:
            shape = (8, 2, 32)  # 512 elements, 256 bytes
            groups = 2 * 2 * 32 if kind == TensorKind.K else 8 * 2 * 8
            scales = (rng.standard_normal(groups) ** 2 * 10.0 ** rng.integers(-40, 30, groups)).astype(np.float32)
            mins = (rng.standard_normal(groups) * 10.0 ** rng.integers(-40, 30, groups)).astype(np.float32)
            payload = np.concatenate([scales.view(np.uint8), mins.view(np.uint8), codes])
            _same_decode(codec, bytes([4]), payload, shape, dtype, kind)


def _near(values: np.ndarray[Any, Any], steps: int = 3) -> np.ndarray[Any, Any]:
    """float32 ``values`` and their neighbours up to ``steps`` ulps either side."""
    v = values.astype(np.float32)
    out = [v]
    up, down = v.copy(), v.copy()
    for _ in range(steps):
        up = np.nextafter(up, np.float32(np.inf))
        down = np.nextafter(down, np.float32(-np.inf))
        out += [up, down]
    both: np.ndarray[Any, Any] = np.concatenate(out)
    return both


def _e4m3_midpoints() -> np.ndarray[Any, Any]:
    grid = [m * 2.0**-9 for m in range(8)] + [(1 + m / 8) * 2.0**e for e in range(-6, 9) for m in range(8)]
    grid.append(480.0)
    g = np.array(grid)
    mids: np.ndarray[Any, Any] = (g[:-1] + g[1:]) / 2
    return mids


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("base", ["fp8", "int8", "int4"])
def test_quotients_at_and_beside_rounding_midpoints_like_numpy(base: str, level: int) -> None:
    """x / scale within a few ulps of every rounding midpoint of the code grid (and on it).

    The SIMD loops multiply by the scale's reciprocal and verify that the result is far
    from a midpoint; these inputs are the ones that must take their exact (dividing) path.
    """
    if base == "fp8":
        targets, top = _e4m3_midpoints(), 448.0
    elif base == "int8":
        targets, top = np.arange(-127, 127) + 0.5, 127.0
    else:
        targets, top = np.arange(0, 15) + 0.5, 15.0
    codec = _codec(base, 32)
    for factor in (3.0, 0.1, 7.0 / 3.0, 1e-3, 12345.6, 2.0**-20):
        q = _near(targets * factor)
        q = np.concatenate([q, -q]) if base == "fp8" else q
        q = q[np.abs(q) <= np.float32(top * factor)]  # no row maximum above top * factor
        for width, alone in [(31, False), (40, False), (128, False), (40, True), (128, True)]:
            # each row: its largest value fixes the scale (top * factor); either rows full of
            # such quotients, or one per row among zeros (then its neighbours do not send its
            # vector to the exact path), at every position in turn
            if alone:
                count = q.size
                rows = np.zeros((count, width), np.float32)
                rows[np.arange(count), 1 + np.arange(count) % (width - 1)] = q
                rows[:, 0] = top * factor
            else:
                count = -(-q.size // (width - 1))
                body = np.resize(q, count * (width - 1)).reshape(count, width - 1)
                rows = np.concatenate([np.full((count, 1), top * factor, np.float32), body.astype(np.float32)], axis=1)
            if base == "int4":  # group minimum 0: put a zero in every row, keys grouped per token run
                rows[:, 1] = 0.0
                x = rows.reshape(count, 1, width)
                with _simd(level):
                    _same_encode(codec, x, TensorKind.V)
                    _same_encode(codec, np.ascontiguousarray(rows.T).reshape(width, 1, count), TensorKind.K)
            else:
                with _simd(level):
                    _same_encode(codec, rows.reshape(count, 1, width), TensorKind.K)
                    if top * factor < 6e4:  # the same quotients from float16 inputs
                        _same_encode(codec, rows.astype(np.float16).reshape(count, 1, width), TensorKind.K)


@needs_ext
@pytest.mark.parametrize("base", ["fp8", "int8", "int4"])
def test_non_finite_inputs_refused_like_numpy(base: str) -> None:
    codec = _codec(base)
    specials = {
        "float16": [0x7C00, 0xFC00, 0x7C01, 0x7E00, 0xFFFF],
        "bfloat16": [0x7F80, 0xFF80, 0x7F81, 0x7FC0, 0xFFFF],
        "float32": [0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000, 0xFFFFFFFF],
    }
    rng = np.random.default_rng(11)
    for dtype, patterns in specials.items():
        for bits in patterns:
            for pos in (0, 37, 199):
                x = rng.standard_normal((5, 2, 20)).astype(numpy_dtype(dtype))
                raw = x.reshape(-1).view(np.uint32 if dtype == "float32" else np.uint16)
                raw[pos] = raw.dtype.type(bits)
                for kind in KINDS:
                    _same_encode(codec, x, kind)
                    with pytest.raises(UsageError):
                        codec.encode(x, kind)


@needs_ext
def test_int4_range_overflow_and_signed_zero_groups_like_numpy() -> None:
    codec = _codec("int4", 2)
    x = np.array([3e38, -3e38, 1.0, 2.0, 0.0, -0.0, -0.0, 0.0], np.float32).reshape(4, 1, 2)
    for kind in KINDS:
        _same_encode(codec, x, kind)
    zeros = np.array([0.0, -0.0, -0.0, 0.0, -0.0, -0.0, 0.0, 0.0], np.float32).reshape(4, 1, 2)
    for kind in KINDS:
        _same_encode(codec, zeros, kind)
        payload = np.frombuffer(codec.encode(zeros, kind).payload, np.uint8)
        mins = payload[: payload.size - 4].view("<f4")
        assert not np.any(np.signbit(mins)), "group minimums and scales are canonical +0"
    # the range error wins over nothing, but NaN anywhere wins over the range error
    x2 = np.concatenate([x, np.array([np.nan, 1.0], np.float32).reshape(1, 1, 2)])
    for kind in KINDS:
        _same_encode(codec, x2, kind)


def test_int4_scales_never_need_fitting() -> None:
    """kv_fit_scale steps a scale down where scale x top rounds past the largest float32; a
    finite (hi - lo) / 15 never needs it for int4 (its own rule, kv_int4_fit, is about
    15 x s + lo: test_int4_top_code_near_float32_maximum_like_numpy).  Below the top 2^21
    float32 values, (v / 15) x 15 <= v (1 + 2^-23)^2 stays finite; here are all of those
    (and for int8's 127 the one value that does need it, which its loops keep)."""
    bits = np.arange(0x7F7FFFFF - (1 << 21), 0x7F7FFFFF + 1, dtype=np.uint32)
    v = bits.view(np.float32)
    with np.errstate(over="ignore"):
        assert not np.isinf((v / np.float32(15)) * np.float32(15)).any()
        assert np.isinf((v / np.float32(127)) * np.float32(127)).sum() == 1


def _int4_top_pairs(count: int, seed: int) -> np.ndarray[Any, Any]:
    """``count`` float32 (minimum, maximum) pairs, the maximum float32's largest value or
    an ulp below and the minimum from 2^-22 of it up: for about one in ten 15 x s + lo
    rounds past float32 although 15 x s does not."""
    rng = np.random.default_rng(seed)
    hi = (0x7F7FFFFF - rng.integers(0, 2, count)).astype(np.uint32)
    lo = np.minimum(rng.integers(0x74000000, 0x7F7FFFFF, count), hi).astype(np.uint32)
    return np.stack([lo, hi], axis=1).view(np.float32)


@needs_ext
@pytest.mark.parametrize("level", LEVELS)
def test_int4_top_code_near_float32_maximum_like_numpy(level: int) -> None:
    """Groups whose top code decodes past float32 unless the scale steps down (kv_int4_fit):
    the V loops check four (AVX2) or sixteen (AVX-512) runs' scales at once and redo the
    runs with such a lane through kv_int4_scale; K groups go through it per channel.  Every
    chunk is numpy's bytes and decodes (it used to be refused: "int4 scales overflow
    float32")."""
    pairs = _int4_top_pairs(4099, 5)  # a run count that leaves a tail of runs
    codec = _codec("int4", 2)
    with _simd(level):
        for kind, x in ((TensorKind.V, pairs.reshape(1, 1, -1)), (TensorKind.K, pairs.T.reshape(2, 1, -1)),
                        (TensorKind.V, pairs.reshape(-1, 1, 2)), (TensorKind.V, pairs.reshape(1, -1, 2))):
            _same_encode(codec, x, kind)
            chunk = codec.encode(x, kind)
            _same_decode(codec, chunk.params, chunk.payload, x.shape, "float32", kind)
            y = codec.decode(chunk.params, chunk.payload, shape=x.shape, dtype="float32", kind=kind)
            assert np.all(np.isfinite(y))
    with np.errstate(over="ignore"):  # the pairs are what they claim to be
        s = (pairs[:, 1] - pairs[:, 0]) / np.float32(15)
        assert np.isinf(s * np.float32(15) + pairs[:, 0]).sum() > 150 and not np.isinf(s * np.float32(15)).any()


# ---------------------------------------------------------------------------------------
# Hypothesis

_SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 6e-8, -6e-8, 1e-40, 65504.0, 3e38, -3e38, 448.0, 1.0]


@st.composite
def _arrays(draw: st.DrawFn, shapes: st.SearchStrategy[tuple[int, int, int]] | None = None) -> np.ndarray[Any, Any]:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes if shapes is not None else st.tuples(st.integers(1, 24), st.integers(1, 3), st.integers(1, 40)))
    scale = draw(st.sampled_from([1e-38, 1e-6, 1.0, 1e4, 1e30]))
    base = draw(hnp.arrays(np.float64, shape, elements=st.floats(-1, 1)))
    x = base * scale
    if draw(st.booleans()):
        special = draw(hnp.arrays(np.float64, shape, elements=st.sampled_from(_SPECIAL)))
        mask = draw(hnp.arrays(np.bool_, shape, elements=st.booleans()))
        x = np.where(mask, special, x)
    if draw(st.booleans()):  # a few all-zero or constant rows and channels
        x[: draw(st.integers(0, shape[0]))] = draw(st.sampled_from([0.0, -0.0, 2.5]))
    with np.errstate(over="ignore"):
        arr: np.ndarray[Any, Any] = x.astype(np.float32).astype(numpy_dtype(dtype))
    return arr


@needs_ext
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=_arrays(), base=st.sampled_from(["fp8", "int8", "int4"]), kind=st.sampled_from(KINDS),
       group=st.sampled_from([1, 2, 3, 7, 32, 255]), out_dtype=st.sampled_from(DTYPES), level=st.sampled_from(LEVELS))
def test_property_compiled_equals_numpy(
    x: np.ndarray[Any, Any], base: str, kind: TensorKind, group: int, out_dtype: str, level: int
) -> None:
    with _simd(level):
        _compiled_equals_numpy(x, base, kind, group, out_dtype)


@needs_ext
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), kind=st.sampled_from(KINDS), group=st.sampled_from([16, 32, 64]),
       out_dtype=st.sampled_from(DTYPES), level=st.sampled_from(LEVELS))
def test_property_int4_whole_runs_equal_numpy(
    data: st.DataObject, kind: TensorKind, group: int, out_dtype: str, level: int
) -> None:
    """Rows that are whole runs of 16, 32 or 64 over several heads: the AVX-512 V loop
    reduces four such runs at a time, and a head count not a multiple of four leaves some
    runs to the one-run path."""
    shape = data.draw(st.tuples(st.integers(1, 6), st.integers(1, 9), st.sampled_from([group, 2 * group, 128])))
    if data.draw(st.booleans()):
        x = data.draw(_arrays(st.just(shape)))  # Hypothesis's values: specials, constant runs
    else:  # every run its own minimum and maximum
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        scale = data.draw(st.sampled_from([1e-6, 1.0, 1e4]))
        x = (rng.standard_normal(shape) * scale).astype(numpy_dtype(data.draw(st.sampled_from(DTYPES))))
    with _simd(level):
        _compiled_equals_numpy(x, "int4", kind, group, out_dtype)


def _compiled_equals_numpy(x: np.ndarray[Any, Any], base: str, kind: TensorKind, group: int, out_dtype: str) -> None:
    codec = _codec(base, group)
    _same_encode(codec, x, kind)
    try:
        chunk = codec.encode_numpy(x, kind)
    except UsageError:
        return
    _same_decode(codec, chunk.params, chunk.payload, x.shape, out_dtype, kind)
    # round trip through the compiled path alone, into a strided output array
    payload = codec.encode(x, kind).payload
    full = np.zeros((x.shape[0], x.shape[1], 2 * x.shape[2]), numpy_dtype(out_dtype))
    view = full[:, :, ::2]
    got = _outcome(lambda: codec.decode(chunk.params, payload, shape=x.shape, dtype=out_dtype, kind=kind, out=view))
    want = _outcome(lambda: codec.decode_numpy(chunk.params, chunk.payload, shape=x.shape, dtype=out_dtype, kind=kind))
    assert got == want
    if got[0] == "ok":
        assert not np.ascontiguousarray(full[:, :, 1::2]).view(np.uint8).any()


@needs_ext
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=_arrays(), base=st.sampled_from(["fp8", "int8", "int4"]), kind=st.sampled_from(KINDS),
       edits=st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.integers(-3, 3), out_dtype=st.sampled_from(DTYPES))
def test_property_corrupted_payloads_decode_like_numpy(
    x: np.ndarray[Any, Any], base: str, kind: TensorKind, edits: list[tuple[int, int]], cut: int, out_dtype: str
) -> None:
    codec = _codec(base, 5)
    try:
        chunk = codec.encode_numpy(x, kind)
    except UsageError:
        return
    data = bytearray(memoryview(chunk.payload).cast("B"))
    for pos, value in edits:
        data[pos % len(data)] = value
    if cut > 0:
        data += bytes(cut)
    elif cut < 0:
        del data[cut:]
    _same_decode(codec, chunk.params, bytes(data), x.shape, out_dtype, kind)


# ---------------------------------------------------------------------------------------
# Rows where they lie (a paged cache's blocks): encode_ranges / decode_ranges

SENTINEL = 0x5A


@st.composite
def _row_places(draw: st.DrawFn, rows: int) -> tuple[list[tuple[int, int]], int]:
    """``rows`` rows cut into runs, each placed at its own row slot of a larger buffer, in
    a shuffled order with gaps between: the runs' (first slot, row count) in row order, and
    the buffer's size in rows."""
    cuts = sorted(draw(st.sets(st.integers(1, rows - 1), max_size=6))) if rows > 1 else []
    runs = [b - a for a, b in zip([0, *cuts], [*cuts, rows], strict=True)]
    order = draw(st.permutations(range(len(runs))))
    slots: list[tuple[int, int]] = [(0, 0)] * len(runs)
    at = 0
    for i in order:
        at += draw(st.integers(0, 2))  # a gap that must stay untouched
        slots[i] = (at, runs[i])
        at += runs[i]
    return slots, at + draw(st.integers(0, 2))


def _spans(slots: list[tuple[int, int]], row_bytes: int) -> np.ndarray[Any, Any]:
    return np.array([(first * row_bytes, count * row_bytes) for first, count in slots], np.int64)


def _gathered(base: np.ndarray[Any, Any], spans: np.ndarray[Any, Any]) -> bytes:
    return b"".join(base[start : start + size].tobytes() for start, size in spans)


def _ranged_codec(base: str, group: int) -> Any:
    """fp8, int8, int4 of ``group``, or one of them behind an entropy stage."""
    if "+" in base:
        inner = base.partition("+")[0]
        return type(get_codec(base))(_codec(inner, group))
    return _codec(base, group)


@needs_ext
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=_arrays(), base=st.sampled_from(["fp8", "int8", "int4", "fp8+lz4", "int4+zstd"]), kind=st.sampled_from(KINDS),
       group=st.sampled_from([1, 3, 7, 32]), out_dtype=st.sampled_from(DTYPES), level=st.sampled_from(LEVELS),
       data=st.data())
def test_property_rows_where_they_lie_equal_gathered_rows(
    x: np.ndarray[Any, Any], base: str, kind: TensorKind, group: int, out_dtype: str, level: int,
    data: st.DataObject,
) -> None:
    """Encoding rows scattered over a buffer (``encode_ranges``) gives the bytes (or the
    error) of encoding them gathered; decoding into scattered rows (``decode_ranges``)
    writes exactly what ``decode`` gives, there and nowhere else, or raises as it does.
    fp8 and int8 rows are a head's; int4's are whole tokens (a K group runs across
    tokens, so across ranges: those groups go through scratch), with an even number of
    elements, else it says it cannot (None / False, nothing written)."""
    codec = _ranged_codec(base, group)
    tokens, heads, dim = x.shape
    int4 = base.startswith("int4")
    row_elems = heads * dim if int4 else dim
    slots, size = data.draw(_row_places(tokens if int4 else tokens * heads))
    row_bytes = row_elems * x.itemsize
    spans = _spans(slots, row_bytes)
    buf = np.full(size * row_bytes, SENTINEL, np.uint8)
    rows = x.reshape(-1).view(np.uint8)
    at = 0
    for start, n in spans:
        buf[start : start + n] = rows[at : at + n]
        at += n
    gathered = _outcome(lambda: codec.encode(x, kind))
    out_row = row_elems * numpy_dtype(out_dtype).itemsize
    out_spans = _spans(slots, out_row)
    out = np.full(size * out_row, SENTINEL, np.uint8)
    if int4 and row_elems % 2:
        assert codec.encode_ranges(memoryview(buf), spans.data, x.shape, x.dtype.name, kind) is None
        if gathered[0] == "ok":
            params, payload = gathered[1]
            assert not codec.decode_ranges(params, payload, memoryview(out), out_spans.data,
                                           shape=x.shape, dtype=out_dtype, kind=kind)
            assert (out == SENTINEL).all()
        return
    with _simd(level):
        got = _outcome(lambda: codec.encode_ranges(memoryview(buf), spans.data, x.shape, x.dtype.name, kind))
        assert got == gathered
    if got[0] != "ok":
        return
    params, payload = got[1]
    if data.draw(st.booleans()):  # a corrupted payload: the same error, or the same values
        corrupt = bytearray(payload)
        corrupt[data.draw(st.integers(0, len(corrupt) - 1))] = data.draw(st.integers(0, 255))
        payload = bytes(corrupt)
    want = _outcome(lambda: codec.decode(params, payload, shape=x.shape, dtype=out_dtype, kind=kind))
    with _simd(level):
        done = _outcome(lambda: codec.decode_ranges(params, payload, memoryview(out), out_spans.data,
                                                    shape=x.shape, dtype=out_dtype, kind=kind))
    if want[0] != "ok":
        assert done == want
        return
    assert done == ("ok", True)
    assert _gathered(out, out_spans) == want[1][2]
    mask = np.ones(out.size, bool)
    for start, n in out_spans:
        mask[start : start + n] = False
    assert (out[mask] == SENTINEL).all()


@needs_ext
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=_arrays(), base=st.sampled_from(["fp8", "int8", "int4", "int8+zstd", "int4+zstd"]), kind=st.sampled_from(KINDS),
       out_dtype=st.sampled_from(DTYPES), level=st.sampled_from(LEVELS), data=st.data())
def test_property_ranges_starting_at_minus_one_are_written_nowhere(
    x: np.ndarray[Any, Any], base: str, kind: TensorKind, out_dtype: str, level: int, data: st.DataObject,
) -> None:
    """Decoding into ranges some of which start at -1 (the rows of blocks a receiver
    drops): every other range is written exactly as ``decode`` gives it, and nothing
    else.  Where ``decode`` raises, the same is raised, or none when only skipped rows
    held what it refused (they are not decoded), and nothing is written outside the other
    ranges either way.  int4's rows are whole tokens; a K group (of 1, 3, 7 or 32 tokens)
    across a skipped and a written range is decoded and only its written tokens kept; with
    an odd number of elements per token it declines (False), nothing written."""
    codec = _ranged_codec(base, data.draw(st.sampled_from([1, 3, 7, 32]), label="group"))
    tokens, heads, dim = x.shape
    int4 = base.startswith("int4")
    row_elems = heads * dim if int4 else dim
    enc = _outcome(lambda: codec.encode(x, kind))
    if enc[0] != "ok":
        return
    params, payload = enc[1]
    slots, size = data.draw(_row_places(tokens if int4 else tokens * heads))
    skipped = data.draw(st.lists(st.booleans(), min_size=len(slots), max_size=len(slots)))
    out_row = row_elems * numpy_dtype(out_dtype).itemsize
    places = _spans(slots, out_row)
    spans = places.copy()
    spans[np.array(skipped, bool), 0] = -1
    out = np.full(size * out_row, SENTINEL, np.uint8)
    want = _outcome(lambda: codec.decode(params, payload, shape=x.shape, dtype=out_dtype, kind=kind))
    with _simd(level):
        done = _outcome(lambda: codec.decode_ranges(params, payload, memoryview(out), spans.data,
                                                    shape=x.shape, dtype=out_dtype, kind=kind))
    if int4 and row_elems % 2:
        assert done == ("ok", False) and (out == SENTINEL).all()
        return
    untouched = np.ones(out.size, bool)
    for (start, n), skip in zip(places, skipped, strict=True):
        untouched[start : start + n] = skip
    assert (out[untouched] == SENTINEL).all()
    if want[0] != "ok":
        assert done in (want, ("ok", True))
        return
    assert done == ("ok", True)
    decoded, at = want[1][2], 0
    for (start, n), skip in zip(places, skipped, strict=True):
        if not skip:
            assert out[start : start + n].tobytes() == decoded[at : at + n]
        at += n


@needs_ext
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(group=st.integers(2, 8), blocks=st.integers(2, 4), heads=st.integers(1, 2), half_dim=st.integers(1, 3),
       out_dtype=st.sampled_from(DTYPES), level=st.sampled_from(LEVELS), data=st.data())
def test_property_int4_key_groups_written_nowhere_are_not_decoded(
    group: int, blocks: int, heads: int, half_dim: int, out_dtype: str, level: int, data: st.DataObject,
) -> None:
    """K groups whose tokens all lie in skipped ranges (start -1) are not decoded, however
    many ranges they are cut into (paged blocks smaller than a group): a forged scale there
    raises nothing, and every written range is what ``decode`` gives for it.  (A group cut
    into two skipped ranges used to be decoded into scratch and raise.)"""
    tokens, dim = blocks * group, 2 * half_dim
    x = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed")).standard_normal(
        (tokens, heads, dim)).astype(np.float16)
    codec = _codec("int4", group)
    chunk = codec.encode(x, TensorKind.K)
    forged = data.draw(st.sets(st.integers(0, blocks - 1), min_size=1, max_size=blocks - 1), label="forged blocks")
    # a group boundary is a range boundary around each forged group; any token may be one
    cuts = {b * group for b in forged} | {(b + 1) * group for b in forged}
    cuts |= data.draw(st.sets(st.integers(1, tokens - 1), max_size=8), label="cuts")
    edges = sorted(cuts - {0, tokens})
    runs = list(itertools.pairwise([0, *edges, tokens]))
    skip = [a // group in forged or data.draw(st.booleans(), label="skip a written run") for a, _ in runs]
    scales = np.frombuffer(bytearray(memoryview(chunk.payload).cast("B")), np.uint8)
    groups = blocks * heads * dim
    s = scales[: 4 * groups].view("<f4").reshape(blocks, heads * dim)
    for b in forged:
        s[b] = np.float32(1e38)  # code 15 (each channel's largest) decodes past float32
    forged_payload = scales.tobytes()
    with pytest.raises(ProtocolError):
        codec.decode(chunk.params, forged_payload, shape=x.shape, dtype=out_dtype, kind=TensorKind.K)
    want = codec.decode(chunk.params, chunk.payload, shape=x.shape, dtype=out_dtype, kind=TensorKind.K)
    row = heads * dim * numpy_dtype(out_dtype).itemsize
    slots, at = [], 0
    for a, b in runs:
        slots.append((at, b - a))
        at += b - a + 1  # a gap that must stay untouched
    spans = _spans(slots, row)
    spans[np.array(skip, bool), 0] = -1
    out = np.full(at * row, SENTINEL, np.uint8)
    with _simd(level):
        assert codec.decode_ranges(chunk.params, forged_payload, memoryview(out), spans.data,
                                   shape=x.shape, dtype=out_dtype, kind=TensorKind.K)
    untouched = np.ones(out.size, bool)
    for (a, b), (first, _n), skipped in zip(runs, slots, skip, strict=True):
        if not skipped:
            assert out[first * row : (first + b - a) * row].tobytes() == want[a:b].tobytes()
            untouched[first * row : (first + b - a) * row] = False
    assert (out[untouched] == SENTINEL).all()


@needs_ext
def test_compiled_row_loops_refuse_bad_ranges() -> None:
    """Ranges outside the buffer, not whole rows, not aligned to the element, or not adding
    up to the chunk are refused before any row is read or written."""
    ext = _host.ext
    assert ext is not None
    x = np.zeros(128, np.uint16)  # 8 rows of 16 float16
    sc, co = np.empty(16, np.uint8), np.empty(64, np.uint8)  # 4 rows

    def enc(*pairs: tuple[int, int]) -> int:
        spans = np.array(pairs, np.int64).reshape(-1, 2)
        return int(ext.encode_rows(0, x.view(np.uint8), 0, 4, 16, sc, co, spans))

    assert enc((0, 64), (128, 64)) == 0  # rows 0-1 and 4-5
    for pairs, match in [
        (((0, 64), (224, 64)), "not in the 256-byte input"),
        (((-32, 64), (0, 64)), "not in"),
        (((0, 0), (0, 128)), "not in"),
        (((0, 48), (64, 80)), "not whole aligned rows"),
        (((1, 64), (128, 64)), "not whole aligned rows"),
        (((0, 64),), "ranges hold 64 bytes, expected 128"),
    ]:
        with pytest.raises(ValueError, match=match):
            enc(*pairs)
    with pytest.raises(ValueError, match="int64 pairs"):
        ext.encode_rows(0, x.view(np.uint8), 0, 4, 16, sc, co, b"\0" * 24)
    # int4: ranges of whole tokens (heads * dim elements), an even number of them
    sc4, mn4, pk4 = np.empty(4 * 32, np.uint8), np.empty(4 * 32, np.uint8), np.empty(32, np.uint8)
    tokens_of = np.array([[0, 64], [128, 64]], np.int64)  # 2 tokens of 2 x 16, group 2, K
    assert ext.int4_encode(x.view(np.uint8), 0, 2, 2, 16, 2, False, sc4, mn4, pk4, tokens_of) == 0
    with pytest.raises(ValueError, match="not whole aligned rows of 64 bytes"):
        ext.int4_encode(x.view(np.uint8), 0, 2, 2, 16, 2, False, sc4, mn4, pk4,
                        np.array([[0, 96], [128, 32]], np.int64))
    with pytest.raises(ValueError, match="even number of elements"):
        ext.int4_encode(x.view(np.uint8), 0, 2, 1, 15, 2, False, sc4, mn4, pk4, np.array([[0, 60]], np.int64))
    out4 = np.full(256, SENTINEL, np.uint8)
    with pytest.raises(ValueError, match="ranges hold 64 bytes, expected 128"):
        ext.int4_decode(sc4, mn4, pk4, 2, 2, 16, 2, False, 0, out4, np.array([[0, 64]], np.int64))
    assert (out4 == SENTINEL).all()
    out = np.full(256, SENTINEL, np.uint8)
    with pytest.raises(ValueError, match="not in the 256-byte out"):
        ext.decode_rows(0, np.zeros(16, np.uint8), np.zeros(64, np.uint8), 4, 16, 0, out,
                        np.array([[0, 64], [256, 64]], np.int64))
    assert (out == SENTINEL).all()
    # A decode's range may start at -1 (rows written nowhere), but whole rows; an encode's
    # may not, nor may any other negative start (int4 alike).
    for pairs, match in [(((-1, 48), (0, 80)), "not in"), (((-2, 64), (0, 64)), "not in")]:
        with pytest.raises(ValueError, match=match):
            ext.decode_rows(0, np.zeros(16, np.uint8), np.zeros(64, np.uint8), 4, 16, 0, out,
                            np.array(pairs, np.int64))
    assert (out == SENTINEL).all()
    with pytest.raises(ValueError, match="not in"):
        enc((-1, 64), (0, 64))
    assert ext.decode_rows(0, np.zeros(16, np.uint8), np.zeros(64, np.uint8), 4, 16, 0, out,
                           np.array([[-1, 64], [64, 64]], np.int64)) == 0
    assert (out[64:128] == 0).all() and (out[:64] == SENTINEL).all() and (out[128:] == SENTINEL).all()
    with pytest.raises(ValueError, match="not in"):
        ext.int4_encode(x.view(np.uint8), 0, 2, 2, 16, 2, False, sc4, mn4, pk4, np.array([[-1, 64], [0, 64]], np.int64))
    with pytest.raises(ValueError, match="not in"):  # a skipped range of part of a token
        ext.int4_decode(sc4, mn4, pk4, 2, 2, 16, 2, False, 0, out4, np.array([[-1, 32], [0, 96]], np.int64))
    assert (out4 == SENTINEL).all()
    # Skipped ranges are not in the buffer, so their sizes are bounded by the chunk's rows
    # alone: sizes whose sum wraps around to the chunk's bytes are refused, not walked.
    wrapping = np.array([[0, 64], [-1, 1 << 62], [-1, 1 << 62], [-1, 1 << 62], [-1, (1 << 62) + 64]], np.int64)
    assert int(wrapping[:, 1].astype(object).sum()) % (1 << 64) == 128
    out[:] = SENTINEL
    with pytest.raises(ValueError, match="ranges hold more than the expected 128 bytes"):
        ext.decode_rows(0, np.zeros(16, np.uint8), np.zeros(64, np.uint8), 4, 16, 0, out, wrapping)
    with pytest.raises(ValueError, match="ranges hold more than the expected 128 bytes"):
        ext.int4_decode(sc4, mn4, pk4, 2, 2, 16, 2, False, 0, out4, wrapping)
    assert (out == SENTINEL).all() and (out4 == SENTINEL).all()


@needs_ext
def test_int4_k_group_larger_than_the_chunk_over_ranges() -> None:
    """A K group larger than the chunk (any group up to the wire's 255, or a caller's
    larger one) is one group of the chunk's tokens: across two ranges it is copied
    whole into scratch of that many tokens, and encodes and decodes as the gathered chunk."""
    ext = _host.ext
    assert ext is not None
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 1, 2)).astype(np.float16)  # 3 tokens of 4 bytes
    spread = np.zeros(16, np.float16)  # token 0 at bytes 0-3, tokens 1-2 at bytes 8-15
    spread[0:2], spread[4:8] = x[0].ravel(), x[1:].ravel()
    spans = np.array([[0, 4], [8, 8]], np.int64)
    for group in (4, 255, 1 << 62):  # group * 4 bytes wraps a 64-bit size at 2**62
        plain = [np.zeros(8, np.uint8), np.zeros(8, np.uint8), np.zeros(3, np.uint8)]
        where = [np.zeros(8, np.uint8), np.zeros(8, np.uint8), np.zeros(3, np.uint8)]
        assert ext.int4_encode(x.view(np.uint8).ravel(), 0, 3, 1, 2, group, False, *plain) == 0
        assert ext.int4_encode(spread.view(np.uint8), 0, 3, 1, 2, group, False, *where, spans) == 0
        assert all(a.tobytes() == b.tobytes() for a, b in zip(plain, where, strict=True))
        out = np.full(16, SENTINEL, np.uint8)
        assert ext.int4_decode(*plain, 3, 1, 2, group, False, 0, out, spans) == 0
        flat = np.zeros(12, np.uint8)
        assert ext.int4_decode(*plain, 3, 1, 2, group, False, 0, flat) == 0
        assert out[:4].tobytes() == flat[:4].tobytes() and out[8:].tobytes() == flat[4:].tobytes()
        assert (out[4:8] == SENTINEL).all()


@needs_ext
def test_int4_where_they_lie_refuses_nan_before_a_groups_range() -> None:
    """As for a gathered chunk, a NaN anywhere wins over a group whose range overflows
    float32, though the loops meet the overflowing group (in the first range) first."""
    x = np.ones((64, 1, 16), np.float32)
    x[0, 0, 0], x[1, 0, 0] = -3e38, 3e38
    x[60, 0, 3] = np.nan
    buf = np.zeros(x.nbytes + 64, np.uint8)
    buf[: 32 * 64] = x[:32].reshape(-1).view(np.uint8)
    buf[32 * 64 + 64 :] = x[32:].reshape(-1).view(np.uint8)
    spans = np.array([[0, 32 * 64], [32 * 64 + 64, 32 * 64]], np.int64)
    codec = Int4Codec(32)
    want = _outcome(lambda: codec.encode(x, TensorKind.K))
    assert want[0] == "UnrepresentableValuesError" and "NaN" in want[1]
    assert _outcome(lambda: codec.encode_ranges(memoryview(buf), spans.data, x.shape, "float32", TensorKind.K)) == want
    x[60, 0, 3] = 1.0
    buf[32 * 64 + 64 :] = x[32:].reshape(-1).view(np.uint8)
    want = _outcome(lambda: codec.encode(x, TensorKind.K))
    assert want[0] == "UnrepresentableValuesError" and "range exceeds float32" in want[1]
    assert _outcome(lambda: codec.encode_ranges(memoryview(buf), spans.data, x.shape, "float32", TensorKind.K)) == want


@pytest.mark.parametrize("base", ["fp8", "int8", "int4"])
def test_rows_where_they_lie_fall_back_to_gathering(base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the extension, or on a buffer not aligned to the element size, the codec
    (and its entropy stage) says it cannot (None / False, nothing written) and the caller
    gathers; so does int4 for ranges that cut a token or an odd number of elements per
    token, and raw behind an entropy stage (its bytes are shuffled whole) always."""
    codec = _codec(base)
    staged = get_codec(f"{base}+lz4")
    x = np.random.default_rng(3).standard_normal((4, 2, 16)).astype(np.float16)
    spans = np.array([[0, x.nbytes]], np.int64)
    chunk = codec.encode_numpy(x, TensorKind.K)
    staged_chunk = staged.encode(x, TensorKind.K)
    shifted = np.zeros(x.nbytes + 1, np.uint8)[1:]
    shifted[:] = x.reshape(-1).view(np.uint8)
    if _host.ext is not None:
        for c, ch in ((codec, chunk), (staged, staged_chunk)):
            assert c.encode_ranges(memoryview(shifted), spans.data, x.shape, "float16", TensorKind.K) is None
            assert not c.decode_ranges(ch.params, ch.payload, memoryview(shifted), spans.data,
                                       shape=x.shape, dtype="float16", kind=TensorKind.K)
            assert shifted.tobytes() == x.tobytes()
    flat = memoryview(x.reshape(-1).view(np.uint8))
    for other in ("raw", "raw+lz4"):
        assert get_codec(other).encode_ranges(flat, spans.data, x.shape, "float16", TensorKind.K) is None
    raw_lz4 = get_codec("raw+lz4").encode(x, TensorKind.K)
    assert not get_codec("raw+lz4").decode_ranges(raw_lz4.params, raw_lz4.payload, memoryview(shifted), spans.data,
                                                  shape=x.shape, dtype="float16", kind=TensorKind.K)
    if base == "int4" and _host.ext is not None:
        halves = np.array([[0, 32], [32, x.nbytes - 32]], np.int64)  # a token cut in two
        assert codec.encode_ranges(flat, halves.data, x.shape, "float16", TensorKind.K) is None
        odd = x[:, :1, :15].copy()  # 15 elements a token
        odd_spans = np.array([[0, odd.nbytes]], np.int64)
        odd_flat = memoryview(odd.reshape(-1).view(np.uint8))
        assert codec.encode_ranges(odd_flat, odd_spans.data, odd.shape, "float16", TensorKind.V) is None
        odd_chunk = codec.encode(odd, TensorKind.V)
        assert not codec.decode_ranges(odd_chunk.params, odd_chunk.payload, odd_flat, odd_spans.data,
                                       shape=odd.shape, dtype="float16", kind=TensorKind.V)
    monkeypatch.setattr(_host, "ext", None)
    for c, ch in ((codec, chunk), (staged, staged_chunk)):
        assert c.encode_ranges(flat, spans.data, x.shape, "float16", TensorKind.K) is None
        out = np.zeros_like(x)
        assert not c.decode_ranges(ch.params, ch.payload, memoryview(out.reshape(-1).view(np.uint8)),
                                   spans.data, shape=x.shape, dtype="float16", kind=TensorKind.K)
        assert not out.any()


# ---------------------------------------------------------------------------------------
# Buffers, fallback, threads


@needs_ext
@pytest.mark.parametrize("base", ["fp8", "int8", "int4"])
def test_misaligned_and_non_contiguous_input(base: str) -> None:
    codec = _codec(base)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((9, 3, 24)).astype(np.float16)
    buf = bytearray(x.nbytes + 1)
    shifted = np.frombuffer(buf, np.uint8, count=x.nbytes, offset=1).view(np.float16).reshape(x.shape)
    shifted[...] = x
    assert not shifted.flags.aligned
    wide = np.zeros((9, 3, 48), np.float16)
    wide[:, :, ::2] = x
    for kind in KINDS:
        want = _outcome(lambda k=kind: codec.encode_numpy(x, k))
        assert _outcome(lambda k=kind: codec.encode(shifted, k)) == want
        assert _outcome(lambda k=kind: codec.encode(wide[:, :, ::2], k)) == want


@needs_ext
@pytest.mark.parametrize("base", ["fp8", "int8", "int4"])
def test_decode_into_memory_overlapping_the_payload(base: str) -> None:
    """Decoding in place over the received bytes gives the same values as from a copy."""
    codec = _codec(base)
    x = np.random.default_rng(2).standard_normal((16, 2, 32)).astype(np.float32)
    for kind in KINDS:
        chunk = codec.encode(x, kind)
        payload = bytes(memoryview(chunk.payload).cast("B"))
        want = codec.decode_numpy(chunk.params, payload, shape=x.shape, dtype="float32", kind=kind)
        shared = bytearray(max(len(payload), x.nbytes))
        shared[: len(payload)] = payload
        out = np.frombuffer(shared, np.float32, count=x.size).reshape(x.shape)
        got = codec.decode(chunk.params, memoryview(shared)[: len(payload)], shape=x.shape, dtype="float32",
                           kind=kind, out=out)
        assert got is out and out.tobytes() == want.tobytes()


@pytest.mark.parametrize("base", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("numpy_path", ["decode_numpy", "decode without the extension"])
def test_numpy_decode_into_memory_overlapping_a_payload_of_many_blocks(
    base: str, dtype: str, numpy_path: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The numpy path decodes a chunk of several working blocks in place over the received
    bytes (``out`` starting where the payload starts) to the values of a decode from a copy:
    the codes of later blocks are not overwritten before they are read."""
    if numpy_path != "decode_numpy":
        monkeypatch.setattr(_host, "ext", None)
    codec = _codec(base)
    shape = (4096, 2, 32)  # 4 blocks of BLOCK_ELEMS
    x = np.random.default_rng(3).standard_normal(shape).astype(np.float16)
    for kind in KINDS:
        chunk = codec.encode_numpy(x, kind)
        payload = bytes(memoryview(chunk.payload).cast("B"))
        want = codec.decode_numpy(chunk.params, payload, shape=shape, dtype=dtype, kind=kind)
        size = x.size * numpy_dtype(dtype).itemsize
        shared = np.zeros(max(len(payload), size), np.uint8)
        shared[: len(payload)] = np.frombuffer(payload, np.uint8)
        out = shared[:size].view(numpy_dtype(dtype)).reshape(shape)
        decode = codec.decode_numpy if numpy_path == "decode_numpy" else codec.decode
        got = decode(chunk.params, shared.data[: len(payload)], shape=shape, dtype=dtype, kind=kind, out=out)
        assert got is out and out.tobytes() == want.tobytes()


@needs_ext
def test_compiled_entry_points_check_buffer_sizes() -> None:
    ext = _host.ext
    assert ext is not None
    x = np.zeros(64, np.uint16)
    with pytest.raises(ValueError, match="scales"):
        ext.encode_rows(0, x.view(np.uint8), 0, 4, 16, np.empty(15, np.uint8), np.empty(64, np.uint8))
    with pytest.raises(ValueError, match="dtype"):
        ext.encode_rows(0, x.view(np.uint8), 7, 4, 16, np.empty(16, np.uint8), np.empty(64, np.uint8))
    with pytest.raises(ValueError, match="out"):
        ext.decode_rows(1, np.zeros(16, np.uint8), np.zeros(64, np.uint8), 4, 16, 2, np.empty(8, np.uint8))
    with pytest.raises(TypeError):
        ext.decode_rows(1, np.zeros(16, np.uint8), np.zeros(64, np.uint8), 4, 16, 2, b"read-only")
    with pytest.raises(ValueError, match="codes"):
        ext.int4_encode(x.view(np.uint8), 0, 4, 1, 16, 32, False, np.empty(64, np.uint8), np.empty(64, np.uint8),
                        np.empty(31, np.uint8))


@pytest.mark.parametrize("base", ["fp8", "int8", "int4"])
def test_numpy_path_when_extension_is_off(base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the extension switched off, encode/decode are the numpy reference (the fallback)."""
    monkeypatch.setattr(_host, "ext", None)
    codec = _codec(base)
    x = np.random.default_rng(1).standard_normal((33, 2, 40)).astype(numpy_dtype("bfloat16"))
    for kind in KINDS:
        chunk = codec.encode(x, kind)
        assert _outcome(lambda c=chunk: c) == _outcome(lambda k=kind: codec.encode_numpy(x, k))
        y = codec.decode(chunk.params, chunk.payload, shape=x.shape, dtype="float32", kind=kind)
        z = codec.decode_numpy(chunk.params, chunk.payload, shape=x.shape, dtype="float32", kind=kind)
        assert y.tobytes() == z.tobytes()
        with pytest.raises(ProtocolError):
            codec.decode(chunk.params, bytes(memoryview(chunk.payload).cast("B"))[:-1], shape=x.shape,
                         dtype="float32", kind=kind)


def test_kvwire_no_extensions_env_selects_numpy_path() -> None:
    code = (
        "import numpy as np\n"
        "from kvwire.codec import _host, get_codec, TensorKind\n"
        "assert _host.ext is None and _host.isa() is None\n"
        "x = np.linspace(-3, 3, 2*4*16, dtype=np.float16).reshape(2, 4, 16)\n"
        "for name in ('fp8', 'int8', 'int4'):\n"
        "    c = get_codec(name)\n"
        "    a = bytes(memoryview(c.encode(x, TensorKind.V).payload).cast('B'))\n"
        "    assert a == bytes(memoryview(c.encode_numpy(x, TensorKind.V).payload).cast('B'))\n"
        "print('numpy path')\n"
    )
    env = dict(os.environ, KVWIRE_NO_EXTENSIONS="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "numpy path"


@needs_ext
def test_concurrent_threads_give_the_same_bytes() -> None:
    """The loops run without the GIL; threads sharing a codec still get exact, separate results."""
    rng = np.random.default_rng(9)
    xs = [rng.standard_normal((256, 4, 64)).astype(np.float16) for _ in range(4)]
    names = ["fp8", "int8", "int4", "fp8"]
    want = [_outcome(lambda n=n, x=x: _codec(n).encode_numpy(x, TensorKind.K)) for n, x in zip(names, xs, strict=True)]
    got: list[Any] = [None] * 4

    def work(i: int) -> None:
        for _ in range(5):
            got[i] = _outcome(lambda: _codec(names[i]).encode(xs[i], TensorKind.K))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert got == want


@needs_ext
@needs_x86
def test_compiled_codes_ignore_a_flush_to_zero_mode_the_caller_set(tmp_path: Any) -> None:
    """A library built with -ffast-math sets FTZ and DAZ when it is loaded: the compiled
    loops then flushed subnormals and sent other codes than the GPU kernels (which never
    flush) for the same tensor. They run with both clear, and leave the caller's mode as it
    was."""
    import ctypes

    src = tmp_path / "csr.c"
    src.write_text("#include <xmmintrin.h>\nunsigned get_csr(void) { return _mm_getcsr(); }\n"
                   "void set_csr(unsigned v) { _mm_setcsr(v); }\n")
    lib_path = tmp_path / "libcsr.so"
    cc = str(sysconfig.get_config_var("CC") or "cc").split()
    subprocess.run([*cc, "-shared", "-fPIC", "-O1", str(src), "-o", str(lib_path)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.get_csr.restype = ctypes.c_uint
    lib.set_csr.argtypes = [ctypes.c_uint]
    rng = np.random.default_rng(7)
    tiny = (rng.standard_normal((8, 2, 64)) * 1e-6).astype(np.float16)  # subnormal float16s
    tiny32 = (rng.standard_normal((8, 2, 64)) * 1e-39).astype(np.float32)  # subnormal float32s

    def run() -> list[bytes]:
        out = []
        for codec in (Fp8Codec(), Int8Codec(), Int4Codec(32)):
            for x in (tiny, tiny32):
                for kind in KINDS:
                    enc = codec.encode(x, kind)
                    out.append(bytes(enc.params) + bytes(enc.payload))
                    dtype = str(x.dtype)
                    out.append(codec.decode(enc.params, enc.payload, shape=x.shape, dtype=dtype, kind=kind).tobytes())
        return out

    expected = run()
    saved = lib.get_csr()
    lib.set_csr(saved | 0x8040)
    try:
        got = run()
        mode = lib.get_csr()
    finally:
        lib.set_csr(saved)
    assert mode == saved | 0x8040  # the caller's mode, as it set it
    assert got == expected


@needs_ext
@needs_x86
@pytest.mark.parametrize("mode", [0xC00, 0x400, 0x800], ids=["towardzero", "downward", "upward"])
def test_compiled_codes_ignore_a_rounding_mode_the_caller_set(mode: int) -> None:
    """The loops kept the calling thread's rounding mode (fesetround): every SIMD level then
    gave other codes than round-to-nearest (the GPU kernels' .rn), and the levels other codes
    than each other. They round to nearest, and leave the caller's mode as it was."""
    import ctypes
    import ctypes.util

    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal((64, 4, 128)).astype(np.float16),
          (rng.standard_normal((33, 2, 40)) * 1e3).astype(numpy_dtype("bfloat16")),
          rng.standard_normal((16, 2, 24)).astype(np.float32)]

    def run() -> list[bytes]:
        out = []
        for codec in (Fp8Codec(), Int8Codec(), Int4Codec(32), Int4Codec(7)):
            for x in xs:
                for kind in KINDS:
                    enc = codec.encode(x, kind)
                    out.append(bytes(enc.params) + bytes(memoryview(enc.payload).cast("B")))
                    for dtype in DTYPES:
                        out.append(codec.decode(enc.params, enc.payload, shape=x.shape, dtype=dtype, kind=kind).tobytes())
        return out

    expected: dict[int, list[bytes]] = {}
    for level in LEVELS:
        with _simd(level):
            expected[level] = run()
    assert all(v == expected[LEVELS[0]] for v in expected.values())
    got: dict[int, list[bytes]] = {}
    assert libm.fegetround() == 0
    assert libm.fesetround(mode) == 0
    try:
        for level in LEVELS:
            with _simd(level):
                got[level] = run()
        now = libm.fegetround()
    finally:
        libm.fesetround(0)
    assert now == mode  # the caller's mode, as it set it
    for level in LEVELS:
        assert got[level] == expected[level], level
