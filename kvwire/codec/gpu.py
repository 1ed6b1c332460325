"""Quantize on the GPU, ship from pinned host memory (optional ``gpu`` extra: CuPy).

The kernels in ``kernels/kvquant.cu`` produce the same codes and scales as the numpy
codecs, bit for bit, so a chunk encoded on a GPU decodes with :func:`codec_by_id` on a
CPU-only peer and the other way round.  The entropy stage, when the codec has one, runs on
the host.  CuPy is imported only inside these functions.
"""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from kvwire.codec.base import Codec, EncodedChunk, TensorKind, numpy_dtype
from kvwire.codec.entropy import EntropyCodec
from kvwire.codec.int4 import DEFAULT_GROUP, Int4Codec, group_count
from kvwire.errors import UsageError

KERNEL_DIR = Path(__file__).with_name("kernels")
_SUFFIX = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
_THREADS = 256


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:
        return False


@cache
def _module() -> Any:
    import cupy

    source = (KERNEL_DIR / "kvquant.cu").read_text()
    return cupy.RawModule(code=source, options=("--std=c++17", f"-I{KERNEL_DIR}", "--fmad=false"))


def _dtype_name(x: Any) -> str:
    for name in _SUFFIX:
        if x.dtype == numpy_dtype(name):
            return name
    raise UsageError(f"codecs take float16, bfloat16 or float32 arrays, got {x.dtype}")


def _split(codec: Codec) -> tuple[str, EntropyCodec | None]:
    if isinstance(codec, EntropyCodec):
        return codec.inner.name, codec
    return codec.name, None


def _pinned(nbytes: int) -> np.ndarray[Any, Any]:
    import cupy

    mem = cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
    return np.frombuffer(mem, np.uint8, count=nbytes)


def encode_on_device(codec: Codec, x: Any, kind: TensorKind, *, dtype: str | None = None) -> EncodedChunk:
    """Encode a CuPy ``[tokens, heads, head_dim]`` array with ``codec`` on its device.

    CuPy has no bfloat16: pass bfloat16 data as its uint16 bit patterns with
    ``dtype="bfloat16"``.
    """
    import cupy

    base, entropy = _split(codec)
    if base not in ("fp8", "int8", "int4"):
        raise UsageError(f"codec {codec.name!r} has no GPU kernels")
    if x.ndim != 3 or 0 in x.shape:
        raise UsageError(f"a chunk is a non-empty [tokens, heads, head_dim] array, got shape {x.shape}")
    name = "bfloat16" if dtype == "bfloat16" and x.dtype == cupy.uint16 else _dtype_name(x)
    x = cupy.ascontiguousarray(x)
    finite = ((x & 0x7FFF) < 0x7F80).all() if name == "bfloat16" else cupy.isfinite(x).all()
    if not bool(finite):
        raise UsageError(f"codec {codec.name!r} cannot carry NaN or infinity; use 'raw' for such tensors")
    tokens, heads, dim = (int(n) for n in x.shape)
    n = tokens * heads * dim
    mod = _module()
    src = x.view(cupy.uint16) if name != "float32" else x
    params = b""
    if base in ("fp8", "int8"):
        rows = tokens * heads
        dev = cupy.empty(rows * 4 + n, cupy.uint8)
        scales = dev[: rows * 4].view(cupy.float32)
        codes = dev[rows * 4 :]
        kernel = mod.get_function(f"kv_{base}_encode_{_SUFFIX[name]}")
        blocks = math.ceil(rows * 32 / _THREADS)
        kernel((blocks,), (_THREADS,), (src, np.int64(rows), np.int32(dim), scales, codes))
    else:
        inner = codec.inner if isinstance(codec, EntropyCodec) else codec
        group = inner.group if isinstance(inner, Int4Codec) else DEFAULT_GROUP
        is_v = int(TensorKind(kind) == TensorKind.V)
        ngroups = group_count((tokens, heads, dim), TensorKind(kind), group)
        dev = cupy.empty(8 * ngroups + (n + 1) // 2, cupy.uint8)
        scales = dev[: 4 * ngroups].view(cupy.float32)
        mins = dev[4 * ngroups : 8 * ngroups].view(cupy.float32)
        codes = cupy.empty(n, cupy.uint8)
        kernel = mod.get_function(f"kv_int4_encode_{_SUFFIX[name]}")
        kernel(
            (math.ceil(ngroups / _THREADS),),
            (_THREADS,),
            (src, np.int32(tokens), np.int32(heads), np.int32(dim), np.int32(group),
             np.int32(is_v), scales, mins, codes),
        )
        if not bool(cupy.isfinite(scales).all()):
            raise UsageError("int4: a group's value range exceeds float32; use fp8, int8 or raw")
        packed = dev[8 * ngroups :]
        mod.get_function("kv_int4_pack")(
            (math.ceil(packed.size / _THREADS),), (_THREADS,), (codes, np.int64(n), packed)
        )
        params = bytes([group])
    host = _pinned(dev.nbytes)
    dev.get(out=host)
    chunk = EncodedChunk(getattr(codec, "inner", codec).codec_id, params, host.data)
    if entropy is None:
        return chunk
    # the entropy stage is host work: reuse its encode on the already-quantized bytes
    return _wrap_entropy(entropy, chunk)


def _wrap_entropy(entropy: EntropyCodec, chunk: EncodedChunk) -> EncodedChunk:
    data = memoryview(chunk.payload).cast("B")
    packed = entropy._compress(data)
    if len(packed) < data.nbytes:
        return EncodedChunk(entropy.codec_id, b"\x01" + chunk.params, packed)
    return EncodedChunk(entropy.codec_id, b"\x00" + chunk.params, chunk.payload)


def decode_on_device(
    codec: Codec,
    params: bytes,
    payload: Any,
    *,
    shape: tuple[int, int, int],
    dtype: str,
    kind: TensorKind,
) -> Any:
    """Decode a chunk into a new CuPy array of ``shape`` and ``dtype`` on the current device.

    For bfloat16 the array holds the uint16 bit patterns (CuPy has no bfloat16).
    """
    import cupy

    base, _entropy = _split(codec)
    if base not in ("fp8", "int8", "int4"):
        raise UsageError(f"codec {codec.name!r} has no GPU kernels")
    host = np.zeros(shape, numpy_dtype(dtype))
    # Validation (lengths, flags, scales, decompression) is the host codec's; it also
    # yields the plain payload, which is what the kernels read.
    plain_params, plain = _plain_payload(codec, params, payload, shape, dtype, kind, host)
    tokens, heads, dim = shape
    n = tokens * heads * dim
    dev = cupy.asarray(np.frombuffer(plain, np.uint8))
    out = cupy.empty(shape, cupy.uint16 if dtype == "bfloat16" else numpy_dtype(dtype))
    dst = out if dtype == "float32" else out.view(cupy.uint16)
    mod = _module()
    if base in ("fp8", "int8"):
        rows = tokens * heads
        scales = dev[: rows * 4].view(cupy.float32)
        codes = dev[rows * 4 :]
        kernel = mod.get_function(f"kv_{base}_decode_{_SUFFIX[dtype]}")
        kernel((math.ceil(n / _THREADS),), (_THREADS,), (codes, scales, np.int64(n), np.int32(dim), dst))
    else:
        group = plain_params[0]
        ngroups = group_count(shape, TensorKind(kind), group)
        kernel = mod.get_function(f"kv_int4_decode_{_SUFFIX[dtype]}")
        kernel(
            (math.ceil(n / _THREADS),),
            (_THREADS,),
            (dev[8 * ngroups :], dev[: 4 * ngroups].view(cupy.float32),
             dev[4 * ngroups : 8 * ngroups].view(cupy.float32), np.int32(tokens), np.int32(heads),
             np.int32(dim), np.int32(group), np.int32(TensorKind(kind) == TensorKind.V), dst),
        )
    return out


def _plain_payload(
    codec: Codec,
    params: bytes,
    payload: Any,
    shape: tuple[int, int, int],
    dtype: str,
    kind: TensorKind,
    scratch: np.ndarray[Any, Any],
) -> tuple[bytes, bytes]:
    """Check the chunk with the host codec and return (inner params, plain payload)."""
    codec.decode(params, payload, shape=shape, dtype=dtype, kind=kind, out=scratch)
    if isinstance(codec, EntropyCodec):
        inner_params = bytes(params[1:])
        if params[0] & 1:
            from kvwire.codec.entropy import inner_payload_size

            size = inner_payload_size(codec.inner, inner_params, shape, dtype, kind)
            return inner_params, codec._decompress(memoryview(payload).cast("B"), size)
        return inner_params, bytes(memoryview(payload).cast("B"))
    return bytes(params), bytes(memoryview(payload).cast("B"))
