"""Element arithmetic shared by the quantizing codecs (numpy reference).

Everything here is defined so that the CUDA kernels in ``kernels/kvquant.cuh`` give the
same bits: float32 math with one rounding per operation, round half to even, clamping
before every narrowing conversion.  numpy's float16 casts are scalar loops on most
builds, so conversions are done with integer operations on the bit patterns instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from kvwire.codec.base import numpy_dtype
from kvwire.errors import ProtocolError, UnrepresentableValuesError, UsageError

U8 = npt.NDArray[np.uint8]
U16 = npt.NDArray[np.uint16]
U32 = npt.NDArray[np.uint32]
I32 = npt.NDArray[np.int32]
F32 = npt.NDArray[np.float32]

#: elements per working block: small enough that the temporaries stay in the L2 cache
BLOCK_ELEMS = 65536

FP8_MAX = np.float32(448.0)
_FP8_MAX_BITS = 0x43E00000  # float32 bits of 448.0
_FP8_MIN_NORMAL_BITS = 0x3C800000  # float32 bits of 2**-6, the smallest normal E4M3
# Adding 2**14 rounds a float32 below 2**-6 to the E4M3 subnormal grid (2**-9) in one step.
_SUBNORMAL_MAGIC = np.float32(16384.0)
_SUBNORMAL_MAGIC_BITS = 0x46800000
# (x + 0x7FFFF + lsb) >> 20 rounds a float32 to 3 mantissa bits, half to even; the
# exponent rebias (127 - 7) << 3 is folded into the same addition.
_NORMAL_ROUND_BIAS = 0x7FFFF - (960 << 20)

_NONFINITE_16 = {"float16": 0x7C00, "bfloat16": 0x7F80}
_NONFINITE_32 = 0x7F800000

DTYPE_NAMES = ("float16", "bfloat16", "float32")


def dtype_name(arr: np.ndarray[Any, Any]) -> str:
    """The KVSpec dtype name of ``arr``; UsageError for anything else."""
    for name in DTYPE_NAMES:
        if arr.dtype == numpy_dtype(name):
            return name
    raise UsageError(f"codecs take float16, bfloat16 or float32 arrays, got {arr.dtype}")


def as_chunk(x: Any) -> tuple[np.ndarray[Any, Any], str]:
    """``x`` as a C-contiguous ``[tokens, heads, head_dim]`` array and its dtype name."""
    arr = np.asarray(x)
    if arr.ndim != 3 or 0 in arr.shape:
        raise UsageError(f"a chunk is a non-empty [tokens, heads, head_dim] array, got shape {arr.shape}")
    name = dtype_name(arr)
    return np.ascontiguousarray(arr), name


def magnitude_bits(arr: np.ndarray[Any, Any], name: str) -> npt.NDArray[Any]:
    """Bit patterns of ``|arr|`` in the array's own width (monotonic in the value)."""
    if name == "float32":
        return arr.view(np.uint32) & np.uint32(0x7FFFFFFF)
    return arr.view(np.uint16) & np.uint16(0x7FFF)


def check_finite_magnitudes(mag_max: npt.NDArray[Any], name: str, codec: str) -> None:
    """Reject NaN/inf given the largest magnitude bit pattern(s) of the input."""
    limit = _NONFINITE_32 if name == "float32" else _NONFINITE_16[name]
    if mag_max.size and int(np.max(mag_max)) >= limit:
        raise UnrepresentableValuesError(
            f"codec {codec!r} cannot carry NaN or infinity; use 'raw' for such tensors"
        )


def fit_scale(scale: F32, top: np.float32) -> F32:
    """Step down one ulp every scale whose largest code (``top``) would decode past float32
    (float32 inputs within an ulp or two of its maximum), as the kernels do; in place."""
    with np.errstate(over="ignore"):
        over = np.isinf(scale * top) & np.isfinite(scale)
    if over.any():
        scale[over] = np.nextafter(scale[over], np.float32(0))
    return scale


def fit_int4_scale(scale: F32, lo: F32) -> F32:
    """Step down one ulp, until it is finite, every finite scale whose top code decodes
    past float32 (``15 * scale + lo``, rounded twice, as the decoder computes it), as the
    kernels do (``kv_int4_fit``); in place.  ``lo`` has ``scale``'s shape."""
    with np.errstate(over="ignore"):
        while True:
            over = np.isinf(scale * np.float32(15.0) + lo) & np.isfinite(scale)
            if not over.any():
                return scale
            scale[over] = np.nextafter(scale[over], np.float32(0))


def magnitude_to_f32(mag: npt.NDArray[Any], name: str, out: F32) -> F32:
    """float32 values of magnitude bit patterns (exact for every finite input)."""
    bits = out.view(np.uint32)
    if name == "float32":
        np.copyto(bits, mag)
    elif name == "bfloat16":
        np.left_shift(mag, 16, out=bits, dtype=np.uint32)
    else:
        # float16 fields shifted into float32 place give x * 2**-112 exactly (subnormal
        # halves become subnormal floats); multiplying by 2**112 is exact.
        np.left_shift(mag, 13, out=bits, dtype=np.uint32)
        np.multiply(out, np.float32(2.0**112), out=out)
    return out


def to_f32(arr: np.ndarray[Any, Any], name: str) -> F32:
    """``arr`` (any supported dtype) as float32, exactly."""
    if name == "float32":
        return np.array(arr, dtype=np.float32, copy=True)
    h = arr.view(np.uint16)
    out = np.empty(arr.shape, np.float32)
    magnitude_to_f32(h & np.uint16(0x7FFF), name, out)
    bits = out.view(np.uint32)
    sign = np.left_shift(h >> np.uint16(15), 31, dtype=np.uint32)
    np.bitwise_or(bits, sign, out=bits)
    return out


def f32_mag_to_e4m3(q: F32, work: F32, work2: I32, out: U8) -> U8:
    """E4M3 codes (sign bit clear) of non-negative float32 ``q``: RNE, saturating at 448.

    ``q`` is overwritten; ``work`` and ``work2`` are scratch of the same size (passed in
    because fresh temporaries of this size are page-faulted in on every call).
    """
    n = q.size
    # numpy's minimum/maximum against a scalar is not vectorised; against arrays it is
    max_bits, eight = _constants(n)
    qb = q.view(np.int32)
    np.minimum(qb, max_bits, out=qb)
    # subnormal E4M3 candidates: rint(q * 512) for q < 2**-6, capped at 8 (= 2**-6)
    np.add(q, _SUBNORMAL_MAGIC, out=work)
    sub = work.view(np.int32)
    np.subtract(sub, np.int32(_SUBNORMAL_MAGIC_BITS), out=sub)
    np.minimum(sub, eight, out=sub)
    # normal candidates (negative for q < 2**-6, so max() picks the subnormal one there)
    lsb = np.right_shift(qb, 20, out=work2)
    np.bitwise_and(lsb, np.int32(1), out=lsb)
    np.add(qb, np.int32(_NORMAL_ROUND_BIAS), out=qb)
    np.add(qb, lsb, out=qb)
    np.right_shift(qb, 20, out=qb)
    np.maximum(qb, sub, out=qb)
    np.copyto(out, qb, casting="unsafe")
    return out


_CONSTANTS: dict[int, tuple[I32, I32]] = {}


def _constants(n: int) -> tuple[I32, I32]:
    size = max(n, BLOCK_ELEMS)
    cached = _CONSTANTS.get(size)
    if cached is None:
        cached = (np.full(size, _FP8_MAX_BITS, np.int32), np.full(size, 8, np.int32))
        _CONSTANTS.clear()
        _CONSTANTS[size] = cached
    return cached[0][:n], cached[1][:n]


def _e4m3_table() -> F32:
    codes = np.arange(256, dtype=np.uint32)
    exp = (codes >> 3) & 0xF
    man = (codes & 7).astype(np.float32)
    normal = (1.0 + man / 8.0) * np.exp2(exp.astype(np.float32) - 7.0)
    sub = man / 8.0 * np.float32(2.0**-6)
    mag = np.where(exp == 0, sub, normal).astype(np.float32)
    mag[(codes & 0x7F) == 0x7F] = np.nan
    return np.where(codes & 0x80, -mag, mag).astype(np.float32)


#: float32 value of every E4M3 code (0x7F and 0xFF are NaN)
E4M3_TO_F32: F32 = _e4m3_table()


def f32_to_dtype(values: F32, name: str, out: np.ndarray[Any, Any]) -> None:
    """Round float32 ``values`` into ``out`` (of dtype ``name``), half to even."""
    np.copyto(out, values.reshape(out.shape), casting="unsafe")


def row_blocks(rows: int, row_len: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` row ranges of about :data:`BLOCK_ELEMS` elements each."""
    step = max(1, BLOCK_ELEMS // max(1, row_len))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def split_payload(payload: Any, sizes: list[int], codec: str) -> list[memoryview]:
    """Cut ``payload`` into consecutive parts of ``sizes`` bytes (exact total required)."""
    try:
        mv = memoryview(payload).cast("B")
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{codec} payload is not a contiguous byte buffer") from exc
    total = sum(sizes)
    if mv.nbytes != total:
        raise ProtocolError(f"{codec} payload is {mv.nbytes} bytes, expected {total}")
    parts = []
    pos = 0
    for size in sizes:
        parts.append(mv[pos : pos + size])
        pos += size
    return parts


def check_params(params: Any, codec: str) -> bytes:
    """A decode ``params`` argument as bytes; UsageError unless it is bytes-like."""
    try:
        return memoryview(params).tobytes()
    except TypeError:
        raise UsageError(f"{codec}: params must be a bytes-like object, got {type(params).__name__}") from None


def check_base(base: Any, codec: str, *, writable: bool = True) -> None:
    """UsageError unless a ``decode_ranges`` destination is a writable (an
    ``encode_ranges`` source: with ``writable`` false, any), C-contiguous bytes-like
    object (its spans are byte offsets into it)."""
    try:
        view = memoryview(base)
    except TypeError:
        what = "a writable" if writable else "a"
        raise UsageError(f"{codec}: base must be {what} bytes-like object, got {type(base).__name__}") from None
    if writable and view.readonly:
        raise UsageError(f"{codec}: base is read-only")
    if not view.c_contiguous:
        raise UsageError(f"{codec}: base must be C-contiguous")


def check_spans(spans: Any, codec: str) -> None:
    """UsageError unless ``spans`` of ``encode_ranges``/``decode_ranges`` is a contiguous
    bytes-like object holding one or more int64 ``(start, size)`` pairs."""
    try:
        view = memoryview(spans)
    except TypeError:
        raise UsageError(
            f"{codec}: spans must be a bytes-like object of int64 (start, size) pairs, got {type(spans).__name__}"
        ) from None
    if not view.c_contiguous or not view.nbytes or view.nbytes % 16:
        raise UsageError(f"{codec}: spans must be a contiguous buffer of one or more int64 (start, size) pairs")


def check_shape(shape: Any, codec: str) -> tuple[int, int, int]:
    """Validate a decode ``shape`` argument."""
    if (
        not isinstance(shape, tuple)
        or len(shape) != 3
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
    ):
        raise UsageError(f"{codec}: shape must be three positive ints, got {shape!r}")
    return shape


def output_array(
    out: np.ndarray[Any, Any] | None, shape: tuple[int, int, int], dtype: str
) -> np.ndarray[Any, Any]:
    """``out`` checked against ``shape``/``dtype`` and writable (the one check of every
    decode path, compiled and numpy alike), or a new array."""
    dt = numpy_dtype(dtype)
    if out is None:
        return np.empty(shape, dt)
    if not isinstance(out, np.ndarray):
        raise UsageError(f"out must be a numpy array, got {type(out).__name__}")
    if out.shape != shape or out.dtype != dt:
        raise UsageError(f"out must be {dtype} {shape}, got {out.dtype} {out.shape}")
    if not out.flags.writeable:
        raise UsageError("out is read-only")
    return out


def read_scales(buf: memoryview, count: int, codec: str) -> F32:
    """Little-endian float32 scales; ProtocolError when any is negative, NaN or infinite."""
    scales = np.frombuffer(buf, dtype="<f4", count=count).astype(np.float32)
    if not np.all(np.isfinite(scales)) or np.any(scales < 0) or np.any(np.signbit(scales)):
        raise ProtocolError(f"{codec} payload carries a negative, NaN or infinite scale")
    return scales


#: float32 magnitudes from which a cast to each dtype would give infinity
_OVERFLOW_AT = {
    "float16": 65520.0,
    "bfloat16": float(np.float32(2.0**128 * (1 - 2.0**-9))),
}


def scale_and_store(
    vals: F32,
    scale: F32,
    offset: F32 | None,
    out: np.ndarray[Any, Any],
    dtype: str,
    codec: str,
) -> None:
    """``out = dtype(vals * scale [+ offset])`` in float32, one rounding per step.

    A decoded value that does not fit ``dtype`` can only come from a forged scale, so it
    is a ProtocolError rather than a silent infinity.
    """
    try:
        with np.errstate(over="raise", invalid="raise"):
            np.multiply(vals, scale, out=vals)
            if offset is not None:
                np.add(vals, offset, out=vals)
    except FloatingPointError:
        raise ProtocolError(f"{codec} scales overflow float32") from None
    limit = _OVERFLOW_AT.get(dtype)
    if limit is not None and vals.size and float(np.max(np.abs(vals))) >= limit:
        raise ProtocolError(f"{codec} scales give values outside {dtype}")
    f32_to_dtype(vals, dtype, out)
