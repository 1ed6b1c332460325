"""The compiled CPU codec loops (``kvwire.codec._hostcodec``) and their dispatch.

The extension is ``kernels/kvquant.cuh`` (the arithmetic the CUDA kernels use) compiled for
the host by ``pip install``; it gives the numpy reference's bytes, which stays the
reference.  ``fp8``, ``int8`` and ``int4`` call :func:`encode_rows` and friends when
:data:`ext` is set, otherwise their numpy code.  ``ext`` is None when the extension was not
built (no compiler at install time) or when ``KVWIRE_NO_EXTENSIONS=1`` is set at import.
The loops release the GIL, so encodes and decodes on executor threads run in parallel.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

from kvwire._extensions import load_extension
from kvwire.codec import _numeric as nm
from kvwire.codec.base import numpy_dtype
from kvwire.errors import ProtocolError, UnrepresentableValuesError, UsageError

#: the compiled module, or None (then the numpy code runs)
ext: ModuleType | None = load_extension("kvwire.codec._hostcodec")

FP8 = 0
INT8 = 1
_DTYPE_CODE = {"float16": 0, "bfloat16": 1, "float32": 2}

# status codes returned by the C loops (KV_E_* in _hostcodec.c)
_NONFINITE, _RANGE, _CODE, _OVERFLOW, _DTYPE, _SCALE, _MIN, _PAD = range(1, 9)
_BAD_CODE = {"fp8": "fp8 payload carries a NaN code", "int8": "int8 payload carries the code -128"}


#: SIMD levels of the compiled loops: the generic C loops (kvquant.cuh's conversions), the
#: same with float16 rows through F16C, the explicit AVX2 + F16C loops, and AVX-512 (F, BW)
#: loops for fp8 and int8 (int4 stays on AVX2 there)
SIMD_GENERIC, SIMD_F16C, SIMD_AVX2, SIMD_AVX512 = 0, 1, 2, 3
#: the highest level: ``simd(SIMD_BEST)`` selects the best this CPU has
SIMD_BEST = SIMD_AVX512


def isa() -> str | None:
    """The compiled loops in use on this CPU, in words, or None without them."""
    if ext is None:
        return None
    name: str = ext.isa()
    return name


def simd(level: int) -> int | None:
    """Use the compiled loops of ``level`` (capped at the best this CPU has); returns the
    level now in use, or None without the extension.  Every level gives the same bytes;
    the tests and ``benchmarks/codecs.py`` compare them."""
    if ext is None:
        return None
    used: int = ext.simd(level)
    return used


def _bytes_of(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """A flat uint8 view of a C-contiguous array (any dtype, bfloat16 included)."""
    return arr.reshape(-1).view(np.uint8)


def _input(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    # the loops read elements with plain loads; a misaligned view gets an aligned copy
    return _bytes_of(arr if arr.flags.aligned else arr.copy())


def _target(result: np.ndarray[Any, Any], shape: tuple[int, int, int], *inputs: memoryview) -> np.ndarray[Any, Any]:
    """``result`` when the loops can write it directly, else a fresh array to copy from.

    The loops need a C-contiguous, aligned output that does not overlap the payload they
    read (a caller decoding in place into the receive buffer gets one copy instead).
    """
    direct = result.flags.c_contiguous and result.flags.aligned
    if direct and not any(np.may_share_memory(result, np.frombuffer(b, np.uint8)) for b in inputs):
        return result
    return np.empty(shape, result.dtype)


def _apart(base: memoryview, *inputs: memoryview) -> list[memoryview]:
    """The payload buffers a ``*_at`` decode reads: each as it is, or a copy where it
    overlaps ``base`` (a payload received into the buffer it is decoded into: the loops
    would overwrite codes and scales they have not read yet)."""
    dest = np.frombuffer(base, np.uint8)
    return [memoryview(bytes(b)) if np.may_share_memory(dest, np.frombuffer(b, np.uint8)) else b for b in inputs]


#: the formats of 8-byte integers in this machine's order, which spans may have besides
#: raw bytes (``l`` and ``L`` where they are 8 bytes: the item size is checked too)
_INT64_FORMATS = frozenset({"q", "Q", "l", "L", "@q", "@Q", "@l", "@L", "=q", "=Q"}
                           | ({"<q", "<Q"} if sys.byteorder == "little" else {">q", ">Q"}))


def check_span_items(spans: Any, codec: str) -> None:
    """UsageError unless the elements of ``spans`` (checked by
    :func:`~kvwire.codec._numeric.check_spans`) are read as they are meant: raw bytes or
    8-byte integers (int32 pairs of the right length were read as int64 ones)."""
    view = memoryview(spans)
    if view.itemsize != 1 and not (view.itemsize == 8 and view.format in _INT64_FORMATS):
        raise UsageError(f"{codec}: spans must be int64 (start, size) pairs, got elements of format {view.format!r}")


def check_encode_ranges(
    base: Any, spans: Any, shape: Any, dtype: str, codec: str
) -> tuple[int, int, int]:
    """The arguments of ``encode_ranges`` checked as ``decode_ranges`` checks its own,
    with UsageError: ``base`` a C-contiguous bytes-like object (read-only allowed),
    ``spans`` one or more int64 ``(start, size)`` pairs (raw bytes or 8-byte integers) of
    whole rows inside it holding the chunk's rows, ``shape`` and ``dtype`` what the codecs
    take.  Checked with or without the compiled loops (which would raise ValueError or
    BufferError, or misread the spans).  The checked shape."""
    nm.check_base(base, codec, writable=False)
    view = memoryview(base)
    nm.check_spans(spans, codec)
    check_span_items(spans, codec)
    checked = nm.check_shape(shape, codec)
    item = numpy_dtype(dtype).itemsize
    row = checked[2] * item
    want = checked[0] * checked[1] * row
    pairs = np.frombuffer(memoryview(spans).cast("B"), np.int64).reshape(-1, 2).tolist()
    total = 0
    for i, (start, size) in enumerate(pairs):
        if start < 0 or size <= 0 or start > view.nbytes - size or size % row or start % item:
            raise UsageError(f"{codec}: range {i} ({start}, {size}) is not whole rows of {row} bytes "
                             f"inside the {view.nbytes}-byte base")
        total += size
    if total != want:
        raise UsageError(f"{codec}: ranges of {total} bytes in all, for a chunk of {want}")
    return checked


def _raise(status: int, codec: str, dtype: str = "") -> None:
    if status == _NONFINITE:
        raise UnrepresentableValuesError(f"codec {codec!r} cannot carry NaN or infinity; use 'raw' for such tensors")
    if status == _RANGE:
        raise UnrepresentableValuesError("int4: a group's value range exceeds float32; use fp8, int8 or raw")
    if status == _CODE:
        raise ProtocolError(_BAD_CODE[codec])
    if status == _OVERFLOW:
        raise ProtocolError(f"{codec} scales overflow float32")
    if status == _DTYPE:
        raise ProtocolError(f"{codec} scales give values outside {dtype}")
    if status == _SCALE:
        raise ProtocolError(f"{codec} payload carries a negative, NaN or infinite scale")
    if status == _MIN:
        raise ProtocolError("int4 payload carries a NaN or infinite minimum")
    if status == _PAD:
        raise ProtocolError("int4 payload has a non-zero padding nibble")
    raise RuntimeError(f"compiled {codec} codec returned status {status}")  # pragma: no cover


def encode_rows(which: int, arr: np.ndarray[Any, Any], name: str, codec: str) -> np.ndarray[Any, Any]:
    """fp8 (``which=FP8``) or int8 payload of a contiguous ``[tokens, heads, dim]`` chunk."""
    assert ext is not None
    tokens, heads, dim = arr.shape
    rows = tokens * heads
    payload = np.empty(rows * 4 + rows * dim, np.uint8)
    status = ext.encode_rows(
        which, _input(arr), _DTYPE_CODE[name], rows, dim, payload[: rows * 4], payload[rows * 4 :]
    )
    if status:
        _raise(status, codec)
    return payload


def decode_rows(
    which: int,
    scale_buf: memoryview,
    code_buf: memoryview,
    shape: tuple[int, int, int],
    dtype: str,
    result: np.ndarray[Any, Any],
    codec: str,
) -> None:
    """Decode fp8/int8 codes into ``result`` (any strides)."""
    assert ext is not None
    target = _target(result, shape, scale_buf, code_buf)
    rows, dim = shape[0] * shape[1], shape[2]
    status = ext.decode_rows(which, scale_buf, code_buf, rows, dim, _DTYPE_CODE[dtype], _bytes_of(target))
    if status:
        _raise(status, codec, dtype)
    if target is not result:
        result[...] = target


def _aligned(base: memoryview, itemsize: int) -> bool:
    return int(np.frombuffer(base, np.uint8).ctypes.data) % itemsize == 0


def encode_rows_at(
    which: int, base: memoryview, spans: Any, shape: tuple[int, int, int], name: str, codec: str
) -> np.ndarray[Any, Any] | None:
    """fp8 or int8 payload of the rows of a ``[tokens, heads, dim]`` chunk that lie at byte
    ranges of ``base`` (``spans``: int64 ``(start, size)`` pairs, in order, whole rows),
    read where they lie; None when ``base`` is not aligned to the element size (the
    caller gathers the rows instead)."""
    assert ext is not None
    if not _aligned(base, numpy_dtype(name).itemsize):
        return None
    rows, dim = shape[0] * shape[1], shape[2]
    payload = np.empty(rows * 4 + rows * dim, np.uint8)
    status = ext.encode_rows(
        which, base, _DTYPE_CODE[name], rows, dim, payload[: rows * 4], payload[rows * 4 :], spans
    )
    if status:
        _raise(status, codec)
    return payload


def decode_rows_at(
    which: int, scale_buf: memoryview, code_buf: memoryview, shape: tuple[int, int, int], dtype: str,
    base: memoryview, spans: Any, codec: str,
) -> bool:
    """Decode fp8/int8 codes straight into the byte ranges of ``base`` where the rows go
    (``spans`` as for :func:`encode_rows_at`; a range starting at -1 is rows written
    nowhere, a block the receiver drops); False, with nothing written, when ``base`` is
    not aligned to the element size.  A payload that lies in ``base`` is read from a copy."""
    assert ext is not None
    if not _aligned(base, numpy_dtype(dtype).itemsize):
        return False
    scale_buf, code_buf = _apart(base, scale_buf, code_buf)
    rows, dim = shape[0] * shape[1], shape[2]
    status = ext.decode_rows(which, scale_buf, code_buf, rows, dim, _DTYPE_CODE[dtype], base, spans)
    if status:
        _raise(status, codec, dtype)
    return True


def int4_encode(
    arr: np.ndarray[Any, Any], name: str, group: int, is_v: bool, ngroups: int
) -> np.ndarray[Any, Any]:
    """int4 payload (scales, minimums, packed codes) of a contiguous chunk."""
    assert ext is not None
    tokens, heads, dim = arr.shape
    n = arr.size
    payload = np.empty(8 * ngroups + (n + 1) // 2, np.uint8)
    status = ext.int4_encode(
        _input(arr),
        _DTYPE_CODE[name],
        tokens,
        heads,
        dim,
        group,
        is_v,
        payload[: 4 * ngroups],
        payload[4 * ngroups : 8 * ngroups],
        payload[8 * ngroups :],
    )
    if status == _RANGE:
        # the reference refuses NaN/inf anywhere before it looks at any group's range
        nm.check_finite_magnitudes(nm.magnitude_bits(arr, name).reshape(-1), name, "int4")
    if status:
        _raise(status, "int4")
    return payload


def _int4_ranges_fit(base: memoryview, spans: Any, shape: tuple[int, int, int], name: str) -> bool:
    """Whether the int4 loops can run over ``spans`` of ``base``: an even number of
    elements per token (every piece's codes start on a byte), whole tokens per range, and a
    base aligned to the element size."""
    item = numpy_dtype(name).itemsize
    hd = shape[1] * shape[2]
    sizes = np.frombuffer(spans, np.int64)[1::2]
    return hd % 2 == 0 and _aligned(base, item) and not np.any(sizes % (hd * item))


def int4_encode_at(
    base: memoryview, spans: Any, shape: tuple[int, int, int], name: str, group: int, is_v: bool, ngroups: int
) -> np.ndarray[Any, Any] | None:
    """int4 payload of the tokens of a ``[tokens, heads, dim]`` chunk that lie at byte
    ranges of ``base`` (``spans``: int64 ``(start, size)`` pairs, in order), read where
    they lie; None when the loops cannot (:func:`_int4_ranges_fit`; the caller gathers)."""
    assert ext is not None
    if not _int4_ranges_fit(base, spans, shape, name):
        return None
    n = shape[0] * shape[1] * shape[2]
    payload = np.empty(8 * ngroups + n // 2, np.uint8)
    status = ext.int4_encode(
        base, _DTYPE_CODE[name], *shape, group, is_v,
        payload[: 4 * ngroups], payload[4 * ngroups : 8 * ngroups], payload[8 * ngroups :], spans,
    )
    if status == _RANGE:
        # as int4_encode: NaN/inf anywhere is refused before any group's range
        pairs = np.frombuffer(spans, np.int64).reshape(-1, 2).tolist()
        rows = np.concatenate([np.frombuffer(base[s : s + k], np.uint8) for s, k in pairs])
        nm.check_finite_magnitudes(nm.magnitude_bits(rows.view(numpy_dtype(name)), name), name, "int4")
    if status:
        _raise(status, "int4")
    return payload


def int4_decode_at(
    bufs: list[memoryview], shape: tuple[int, int, int], group: int, is_v: bool, dtype: str,
    base: memoryview, spans: Any,
) -> bool:
    """Decode int4 ``[scales, minimums, codes]`` straight into the byte ranges of ``base``
    where the tokens go (``spans`` as for :func:`int4_encode_at`; a range starting at -1
    is tokens written nowhere, decoded only where a K group runs into a written range);
    False, with nothing written, when the loops cannot.  A payload that lies in ``base``
    is read from a copy."""
    assert ext is not None
    if not _int4_ranges_fit(base, spans, shape, dtype):
        return False
    bufs = _apart(base, *bufs)
    status = ext.int4_decode(bufs[0], bufs[1], bufs[2], *shape, group, is_v, _DTYPE_CODE[dtype], base, spans)
    if status:
        _raise(status, "int4", dtype)
    return True


def int4_decode(
    bufs: list[memoryview],
    shape: tuple[int, int, int],
    group: int,
    is_v: bool,
    dtype: str,
    result: np.ndarray[Any, Any],
) -> None:
    """Decode int4 ``[scales, minimums, codes]`` into ``result`` (any strides)."""
    assert ext is not None
    target = _target(result, shape, *bufs)
    status = ext.int4_decode(
        bufs[0], bufs[1], bufs[2], *shape, group, is_v, _DTYPE_CODE[dtype], _bytes_of(target)
    )
    if status:
        _raise(status, "int4", dtype)
    if target is not result:
        result[...] = target
