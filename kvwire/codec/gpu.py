"""Quantize and dequantize on the GPU (optional ``gpu-cuda12`` / ``gpu-cuda13`` extras: CuPy).

The kernels in ``kernels/kvquant.cu`` produce the same codes and scales as the numpy
codecs, bit for bit, under the options CuPy really compiles with (it appends
``-ftz=true``; the arithmetic is written so that no result is flushed, see
``kernels/kvquant.cuh``), so a chunk encoded on a GPU decodes with :func:`codec_by_id` on a
CPU-only peer and the other way round.  The entropy stage, when the codec has one, runs on
the host.  CuPy is imported only inside these functions.

Encoding takes a whole ``[tokens, heads, head_dim]`` tensor and writes the payloads of
every chunk of a chunk plan in one launch (:func:`encode_tensor`); decoding validates a
chunk's params and scales on the host and decodes its codes in the kernel, straight into
the destination array (:func:`decode_into`).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from kvwire.codec import _numeric as nm
from kvwire.codec.base import Codec, EncodedChunk, TensorKind
from kvwire.codec.entropy import FLAG_COMPRESSED, EntropyCodec, check_sizing_args
from kvwire.codec.int4 import DEFAULT_GROUP, Int4Codec, group_count
from kvwire.errors import ProtocolError, UnrepresentableValuesError, UsageError

#: How to get CuPy, for the errors of paths that need it.
INSTALL_HINT = "pip install kvwire[gpu-cuda12] or kvwire[gpu-cuda13]"

KERNEL_DIR = Path(__file__).with_name("kernels")
#: every file the kernels are built from (all of them go into the source string)
SOURCE_FILES = ("kvquant.cuh", "kvquant.cu")
#: our NVRTC options
COMPILE_OPTIONS = ("--std=c++17", "--fmad=false")
#: what CuPy appends after the caller's options for every RawModule (it cannot be undone)
CUPY_APPENDED_OPTIONS = ("-ftz=true",)

QUANTIZERS = ("fp8", "int8", "int4")
_SUFFIX = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
_THREADS = 256

FLAG_NONFINITE = 1
FLAG_RANGE = 2
FLAG_BADCODE = 4
FLAG_OVERFLOW = 8
FLAG_OUTSIDE = 16


def kernel_source() -> str:
    """The CUDA source handed to NVRTC: kvquant.cu with kvquant.cuh inlined.

    CuPy keys its kernel cache on the source string only (not on included files), so
    everything the kernels are built from is in it, headed by a hash of the files.
    """
    texts = {name: (KERNEL_DIR / name).read_text() for name in SOURCE_FILES}
    digest = hashlib.sha256("".join(texts[n] for n in SOURCE_FILES).encode()).hexdigest()
    body = texts["kvquant.cu"].replace('#include "kvquant.cuh"', texts["kvquant.cuh"], 1)
    return f"// kvquant sources sha256:{digest}\n{body}"


@cache
def _raw_module() -> Any:
    import cupy

    return cupy.RawModule(code=kernel_source(), options=COMPILE_OPTIONS)


_FUNCTIONS: dict[tuple[int, str], Any] = {}


def _function(name: str) -> Any:
    """Kernel ``name`` loaded on the current device."""
    import cupy

    key = (int(cupy.cuda.runtime.getDevice()), name)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        fn = _FUNCTIONS[key] = _raw_module().get_function(name)
    return fn


@cache
def _probe() -> bool:
    try:
        import cupy

        if int(cupy.cuda.runtime.getDeviceCount()) <= 0:
            return False
        with cupy.cuda.Device(0):
            # compiling and loading a kernel proves NVRTC and the driver match CuPy
            _function("kv_fp8_decode_any_f16")
        return True
    except Exception:
        return False


def gpu_available() -> bool:
    """True when CuPy imports, sees a CUDA device, and the kernels compile and load there."""
    return _probe()


def device_count() -> int:
    """CUDA devices CuPy sees (0 without CuPy)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def dtype_name(x: Any, dtype: str | None = None) -> str:
    """The KVSpec dtype of a CuPy array (bfloat16: CuPy's own, or uint16/int16 bits)."""
    name = str(x.dtype)
    if name in ("float16", "float32", "bfloat16"):
        return name
    if name in ("uint16", "int16") and dtype == "bfloat16":
        return "bfloat16"
    raise UsageError(f"codecs take float16, bfloat16 or float32 arrays, got {x.dtype}")


def split_codec(codec: Codec) -> tuple[str, EntropyCodec | None]:
    """``(base name, entropy stage or None)`` of a codec."""
    if isinstance(codec, EntropyCodec):
        return codec.inner.name, codec
    return codec.name, None


def _int4_group(codec: Codec) -> int:
    inner = codec.inner if isinstance(codec, EntropyCodec) else codec
    return inner.group if isinstance(inner, Int4Codec) else DEFAULT_GROUP


def _check_flags(flags: int, codec: str, dtype: str = "the output dtype") -> None:
    if flags & FLAG_NONFINITE:
        raise UnrepresentableValuesError(f"codec {codec!r} cannot carry NaN or infinity; use 'raw' for such tensors")
    if flags & FLAG_RANGE:
        raise UnrepresentableValuesError("int4: a group's value range exceeds float32; use fp8, int8 or raw")
    if flags & FLAG_BADCODE:
        raise ProtocolError(f"{codec} payload carries a NaN code" if codec == "fp8" else f"{codec} payload carries the code -128")
    if flags & FLAG_OVERFLOW:
        raise ProtocolError(f"{codec} scales overflow float32")
    if flags & FLAG_OUTSIDE:
        raise ProtocolError(f"{codec} scales give values outside {dtype}")


@dataclass
class DeviceChunks:
    """The payloads of every chunk of one tensor, encoded on its device.

    ``buffer`` (CuPy uint8) holds chunk ``i`` at ``offsets[i]``, ``sizes[i]`` bytes;
    ``flags`` (CuPy uint32[1]) is non-zero when the input was refused: call
    :meth:`check` once the stream has reached it.
    """

    codec: str
    codec_id: int
    params: bytes
    buffer: Any
    offsets: list[int]
    sizes: list[int]
    flags: Any

    def check(self, flags: int | None = None) -> None:
        """Raise UsageError if the kernel refused the input (reads the flags: a sync)."""
        value = int(self.flags.get()[0]) if flags is None else flags
        _check_flags(value, self.codec)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: its name, grid (blocks of :data:`THREADS`) and arguments.

    Arguments are numpy scalars or the names of buffers: ``"x"`` (the input tensor),
    ``"out"`` (the payload buffer, or the destination when decoding), ``"payload"``,
    ``"stats"`` (float32 scratch) and ``"flags"`` (uint32[1]).
    """

    kernel: str
    blocks: int
    args: tuple[Any, ...]


@dataclass(frozen=True)
class EncodePlan:
    """Sizes and launches that encode one tensor into the payloads of a chunk plan."""

    sizes: tuple[int, ...]
    stats_floats: int
    launches: tuple[Launch, ...]


THREADS = _THREADS
#: the most blocks a launch's (one-dimensional) grid can have: CUDA's limit on gridDim.x
MAX_BLOCKS = 2**31 - 1
#: the largest count a kernel takes as a 32-bit int (heads, head_dim, chunk tokens)
INT32_MAX = 2**31 - 1


def _int32(value: int, what: str) -> np.int32:
    """``value`` as a kernel's 32-bit int argument; UsageError where it does not fit (numpy
    would raise OverflowError, or an older one wrap it)."""
    if not 0 <= value <= INT32_MAX:
        raise UsageError(f"the GPU kernels take {what} up to {INT32_MAX}, got {value}")
    return np.int32(value)


def _blocks(threads: int, kernel: str) -> int:
    """Blocks of :data:`THREADS` that cover ``threads`` threads (exact integer ceiling);
    UsageError past :data:`MAX_BLOCKS`, which CUDA refuses to launch."""
    blocks = -(-threads // _THREADS)
    if blocks > MAX_BLOCKS:
        raise UsageError(f"{kernel}: {threads} threads need {blocks} blocks of {_THREADS}, "
                         f"more than a launch takes ({MAX_BLOCKS}); encode or decode the tensor in parts")
    return blocks


def plan_encode(
    base: str, group: int, shape: tuple[int, int, int], dtype: str, kind: TensorKind,
    chunk_tokens: int, *, x_aligned: bool,
) -> EncodePlan:
    """The launches that encode a ``shape`` tensor of ``dtype`` as chunks of ``chunk_tokens``
    tokens (the last one shorter); ``x_aligned``: the input starts on 16 bytes.

    Element, byte and group counts go to the kernels as int64 (a tensor may hold 2^31
    elements and more); heads, head_dim, the tokens of a chunk and the int4 group go as
    32-bit ints.  UsageError where one of those passes 2^31 - 1, or a launch would need
    more blocks than a grid takes (:data:`MAX_BLOCKS`)."""
    tokens, heads, dim = shape
    chunk_tokens = max(1, min(int(chunk_tokens), tokens))
    heads32, dim32 = _int32(heads, "heads"), _int32(dim, "head_dim")
    chunk32 = _int32(chunk_tokens, "tokens per chunk")
    nchunks = -(-tokens // chunk_tokens)
    last = tokens - (nchunks - 1) * chunk_tokens
    suffix = _SUFFIX[dtype]
    if base in ("fp8", "int8"):
        full = chunk_tokens * heads * (4 + dim)
        sizes = (full,) * (nchunks - 1) + (last * heads * (4 + dim),)
        rows = tokens * heads
        epv = 4 if dtype == "float32" else 8
        nvec = dim // epv
        vector = (
            dim % epv == 0 and nvec <= 128 and x_aligned and full % epv == 0 and rows < 2**31
            and (4 * heads * chunk_tokens) % epv == 0 and (4 * heads * last) % epv == 0
        )
        args = ("x", np.int64(tokens), heads32, dim32, chunk32, np.int64(full), "out", "flags")
        if vector:
            lpr, vpl = (16, 1) if nvec <= 16 else (32, 1) if nvec <= 32 else (32, 2) if nvec <= 64 else (32, 4)
            name = f"kv_{base}_encode_vec_{suffix}_{lpr}_{vpl}"
            launch = Launch(name, _blocks(rows * lpr, name), args)
        else:
            name = f"kv_{base}_encode_any_{suffix}"
            launch = Launch(name, _blocks(rows * 32, name), args)
        return EncodePlan(sizes, 0, (launch,))
    if base != "int4":
        raise UsageError(f"codec {base!r} has no GPU kernels")
    kind = TensorKind(kind)
    hd = heads * dim
    g_full = group_count((chunk_tokens, heads, dim), kind, group)
    g_last = group_count((last, heads, dim), kind, group)
    b_full = (chunk_tokens * hd + 1) // 2
    b_last = (last * hd + 1) // 2
    full = 8 * g_full + b_full
    sizes = (full,) * (nchunks - 1) + (8 * g_last + b_last,)
    fast = _plan_int4_vec(group, shape, dtype, kind, chunk_tokens, full, x_aligned=x_aligned)
    if fast is not None:
        return EncodePlan(sizes, 0, (fast,))
    total_groups = (nchunks - 1) * g_full + g_last
    total_bytes = (nchunks - 1) * b_full + b_last
    common = ("x", np.int64(tokens), heads32, dim32, _int32(group, "int4 group"),
              np.int32(kind == TensorKind.V), chunk32, np.int64(full))
    stats, pack = f"kv_int4_stats_{suffix}", f"kv_int4_pack_{suffix}"
    return EncodePlan(sizes, 2 * total_groups, (
        Launch(stats, _blocks(total_groups, stats), (*common, np.int64(total_groups), "out", "stats", "flags")),
        Launch(pack, _blocks(total_bytes, pack), (*common, np.int64(total_bytes), "stats", "out")),
    ))


def _plan_int4_vec(
    group: int, shape: tuple[int, int, int], dtype: str, kind: TensorKind, chunk_tokens: int,
    full: int, *, x_aligned: bool,
) -> Launch | None:
    """The one-launch vector kernel that encodes int4 for this geometry, or None (then the
    group-statistics and packing kernels run)."""
    tokens, heads, dim = shape
    epv = 4 if dtype == "float32" else 8
    suffix = _SUFFIX[dtype]
    if not x_aligned or tokens * heads * dim >= 2**31 or full % (epv // 2):
        return None
    args: tuple[Any, ...] = ("x", np.int64(tokens), np.int32(heads), np.int32(dim), np.int32(group),
                             np.int32(chunk_tokens), np.int64(full))
    if kind == TensorKind.V:
        nvec = dim // epv
        gv = group // epv
        # a group of whole vectors: a power of two of them, or any number with one vector
        # a lane (nvec <= 32)
        if dim % epv or nvec > 128 or (group < dim and (group % epv or (gv & (gv - 1) and nvec > 32))):
            return None
        lpr, vpl = (16, 1) if nvec <= 16 else (32, 1) if nvec <= 32 else (32, 2) if nvec <= 64 else (32, 4)
        rows = tokens * heads
        name = f"kv_int4_encode_v_vec_{suffix}_{lpr}_{vpl}"
        return Launch(name, _blocks(rows * lpr, name), (*args, "out", "flags"))
    hd = heads * dim
    if hd % epv:
        return None
    # token lanes x tokens each: fewest registers that hold a block (group <= 255)
    tl, kpt = (4, 2) if group <= 8 else (4, 8) if group <= 32 else (4, 16) if group <= 64 else (
        (8, 16) if group <= 128 else (16, 16))
    blocks_full = -(-chunk_tokens // group)
    nchunks = -(-tokens // chunk_tokens)
    last = tokens - (nchunks - 1) * chunk_tokens
    total_blocks = (nchunks - 1) * blocks_full + -(-last // group)
    slices = -(-(hd // epv) // (32 // tl))
    name = f"kv_int4_encode_k_vec_{suffix}_{tl}_{kpt}"
    return Launch(name, _blocks(total_blocks * slices * 32, name), (*args, np.int64(total_blocks), "out", "flags"))


def alignment(ptr: int) -> int:
    """The largest power of two up to 16 that address ``ptr`` is a multiple of."""
    return min(ptr & -ptr, 16) if ptr else 16


def plan_decode(
    base: str, params: bytes, shape: tuple[int, int, int], dtype: str, kind: TensorKind,
    *, out_aligned: bool, payload_align: int = 16,
) -> Launch:
    """The launch that decodes one chunk's plain payload into a ``shape`` destination
    (``out_aligned``: it starts on 16 bytes; ``payload_align``: a power of two the
    payload's address is a multiple of, :func:`alignment`).

    The vector kernels load the payload in words: int4 needs it on 4 bytes (float32
    scales and minimums, 32-bit code words), fp8 and int8 on 8 for 16-bit outputs (8 codes
    a load, after 4 bytes of scale per row) and on 4 for float32; a payload off that
    alignment takes the any-shape kernel, which reads it byte by byte.  The vector kernels
    index in 32 bits and take chunks under 2^31 elements; the any-shape kernels index in
    64.  UsageError as :func:`plan_encode` gives it for head_dim, the grid, or heads where
    a kernel takes them (int4; fp8 and int8 decode take rows, an int64)."""
    tokens, heads, dim = shape
    suffix = _SUFFIX[dtype]
    dim32 = _int32(dim, "head_dim")
    if base in ("fp8", "int8"):
        rows = tokens * heads
        epv = 4 if dtype == "float32" else 8
        if (dim % epv == 0 and out_aligned and payload_align % epv == 0 and (4 * rows) % epv == 0
                and rows * dim < 2**31):
            name = f"kv_{base}_decode_vec_{suffix}"
            return Launch(name, _blocks(rows * dim // epv, name),
                          ("payload", np.uint32(rows), np.uint32(dim), "out", "flags"))
        name = f"kv_{base}_decode_any_{suffix}"
        return Launch(name, _blocks(rows * dim, name), ("payload", np.int64(rows), dim32, "out", "flags"))
    n = tokens * heads * dim
    epv = 4 if dtype == "float32" else 8
    is_v = np.int32(TensorKind(kind) == TensorKind.V)
    if dim % epv == 0 and out_aligned and payload_align % 4 == 0 and n < 2**31:
        name = f"kv_int4_decode_vec_{suffix}"
        return Launch(name, _blocks(n // epv, name),
                      ("payload", np.uint32(tokens), np.uint32(heads), np.uint32(dim), np.uint32(params[0]),
                       is_v, "out", "flags"))
    name = f"kv_int4_decode_{suffix}"
    return Launch(name, _blocks((n + 1) // 2, name),
                  ("payload", np.int64(tokens), _int32(heads, "heads"), dim32, np.int32(params[0]), is_v, "out", "flags"))


def _run(launch: Launch, buffers: dict[str, Any]) -> None:
    args = tuple(buffers[a] if isinstance(a, str) else a for a in launch.args)
    _function(launch.kernel)((max(1, launch.blocks),), (_THREADS,), args)


def encode_tensor(
    codec: Codec, x: Any, kind: TensorKind, chunk_tokens: int, *, dtype: str | None = None
) -> DeviceChunks:
    """Encode CuPy ``x`` (``[tokens, heads, head_dim]``) as chunks of ``chunk_tokens`` tokens.

    Launches on the current device and stream and returns at once; the entropy stage, if
    any, is left to the caller (it runs on the host bytes).
    """
    import cupy

    base, _entropy = split_codec(codec)
    if base not in QUANTIZERS:
        raise UsageError(f"codec {codec.name!r} has no GPU kernels")
    if x.ndim != 3 or 0 in x.shape:
        raise UsageError(f"a chunk is a non-empty [tokens, heads, head_dim] array, got shape {x.shape}")
    name = dtype_name(x, dtype)
    x = cupy.ascontiguousarray(x)
    shape = (int(x.shape[0]), int(x.shape[1]), int(x.shape[2]))
    group = _int4_group(codec)
    plan = plan_encode(base, group, shape, name, TensorKind(kind), chunk_tokens, x_aligned=x.data.ptr % 16 == 0)
    out = cupy.empty(sum(plan.sizes), cupy.uint8)
    flags = cupy.zeros(1, cupy.uint32)
    stats = cupy.empty(max(1, plan.stats_floats), cupy.float32)
    for launch in plan.launches:
        _run(launch, {"x": x, "out": out, "flags": flags, "stats": stats})
    inner = codec.inner if isinstance(codec, EntropyCodec) else codec
    offsets = [i * plan.sizes[0] for i in range(len(plan.sizes))]
    return DeviceChunks(base, inner.codec_id, bytes([group]) if base == "int4" else b"",
                        out, offsets, list(plan.sizes), flags)


def pinned_empty(nbytes: int) -> np.ndarray[Any, Any]:
    """A numpy uint8 array in page-locked host memory (from CuPy's pinned pool)."""
    import cupy

    mem = cupy.cuda.alloc_pinned_memory(max(nbytes, 1))
    return np.frombuffer(mem, np.uint8, count=nbytes)


def copy_to_host_async(src: Any, offset: int, host: np.ndarray[Any, Any], stream: Any) -> None:
    """Queue a copy of ``host.nbytes`` bytes of CuPy ``src`` from ``offset`` into pinned ``host``."""
    import cupy

    if host.nbytes:
        cupy.cuda.runtime.memcpyAsync(
            host.ctypes.data, src.data.ptr + offset, host.nbytes,
            cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr,
        )


def finish_chunk(codec: Codec, enc: DeviceChunks, payload: Any) -> EncodedChunk:
    """The wire chunk for a host copy of one payload (the entropy stage runs here)."""
    chunk = EncodedChunk(enc.codec_id, enc.params, payload)
    _base, entropy = split_codec(codec)
    if entropy is None:
        return chunk
    packed = entropy.packed(memoryview(payload).cast("B"))
    if packed is not None:
        return EncodedChunk(entropy.codec_id, bytes([FLAG_COMPRESSED]) + chunk.params, packed)
    return EncodedChunk(entropy.codec_id, b"\x00" + chunk.params, chunk.payload)


def encode_on_device(codec: Codec, x: Any, kind: TensorKind, *, dtype: str | None = None) -> EncodedChunk:
    """Encode one CuPy chunk ``[tokens, heads, head_dim]`` with ``codec`` on its device.

    Synchronous; the payload comes back in pinned host memory.  bfloat16 is CuPy's own
    dtype or its uint16 bit patterns with ``dtype="bfloat16"``.
    """
    import cupy

    with x.device:
        stream = cupy.cuda.get_current_stream()
        enc = encode_tensor(codec, x, kind, int(x.shape[0]), dtype=dtype)
        enc.check()
        host = pinned_empty(enc.sizes[0])
        copy_to_host_async(enc.buffer, 0, host, stream)
        stream.synchronize()
    return finish_chunk(codec, enc, host.data)


def _plain(codec: Codec, params: bytes, payload: Any, shape: tuple[int, int, int], dtype: str,
           kind: TensorKind) -> tuple[str, bytes, memoryview]:
    """(base codec name, inner params, plain payload) after the entropy stage's checks
    (the caller's shape, dtype and kind are checked before anything is sized from them)."""
    base, entropy = split_codec(codec)
    params = nm.check_params(params, codec.name)
    shape, kind = check_sizing_args(shape, dtype, kind, codec.name)
    try:
        view = memoryview(payload).cast("B")
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"{codec.name} payload is not a contiguous byte buffer") from exc
    if entropy is None:
        return base, params, view
    inner_params, plain = entropy._unpack(params, view, shape, dtype, kind)
    return base, inner_params, memoryview(plain)


def validate_payload(
    base: str, params: bytes, plain: memoryview, shape: tuple[int, int, int], kind: TensorKind
) -> None:
    """The host's part of a decode: params, length, scales (and int4 minimums, padding).

    The codes are checked by the kernel (NaN codes, -128, values outside the dtype).
    """
    tokens, heads, dim = nm.check_shape(shape, base)
    n = tokens * heads * dim
    if base in ("fp8", "int8"):
        if params:
            raise ProtocolError(f"{base} codec takes no parameters")
        rows = tokens * heads
        scale_buf, _codes = nm.split_payload(plain, [rows * 4, rows * dim], base)
        nm.read_scales(scale_buf, rows, base)
        return
    if len(params) != 1 or params[0] == 0:
        raise ProtocolError("int4 params must be one non-zero byte (the group size)")
    groups = group_count(shape, kind, params[0])
    scale_buf, lo_buf, code_buf = nm.split_payload(plain, [4 * groups, 4 * groups, (n + 1) // 2], base)
    nm.read_scales(scale_buf, groups, base)
    if not np.all(np.isfinite(np.frombuffer(lo_buf, "<f4"))):
        raise ProtocolError("int4 payload carries a NaN or infinite minimum")
    if n & 1 and code_buf[-1] >> 4:
        raise ProtocolError("int4 payload has a non-zero padding nibble")


def check_dtype(dtype: str) -> str:
    """``dtype`` when the kernels have it (float16, bfloat16, float32); UsageError else."""
    if dtype not in _SUFFIX:
        raise UsageError(f"unsupported dtype {dtype!r}; the GPU codecs take float16, bfloat16 or float32")
    return dtype


def check_destination(out: Any, dtype: str) -> tuple[int, int, int]:
    """The ``[tokens, heads, head_dim]`` shape of decode destination ``out`` once it is
    checked against what the kernel of ``dtype`` writes: UsageError unless ``out`` is a
    C-contiguous three-dimensional array of ``dtype`` (bfloat16: CuPy's own or its uint16
    or int16 bits, as :func:`dtype_name` takes them).  A kernel of another element width
    would write past the end of ``out`` or leave part of it unwritten."""
    check_dtype(dtype)
    if getattr(out, "ndim", None) != 3:
        raise UsageError(f"decode_into needs a [tokens, heads, head_dim] destination, got shape {getattr(out, 'shape', None)}")
    try:
        got: str | None = dtype_name(out, dtype)
    except UsageError:
        got = None
    if got != dtype:
        want = "bfloat16 (or its uint16 bits)" if dtype == "bfloat16" else dtype
        raise UsageError(f"decode_into: a {dtype} chunk decodes into a {want} destination, got {out.dtype}")
    if not out.flags.c_contiguous:
        raise UsageError("decode_into needs a C-contiguous destination")
    return (int(out.shape[0]), int(out.shape[1]), int(out.shape[2]))


def _order_after(stream: Any, current: Any) -> None:
    """Make ``stream`` wait for the work queued so far on ``current`` (nothing when they
    are the same stream)."""
    if int(stream.ptr) != int(current.ptr):
        stream.wait_event(current.record())


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[Any]:
    """(``stream``'s device current) ``stream`` current in the block, and the stream that
    was current before it current again when the block ends, however it had been made
    current (``use()`` or a ``with`` block): the stream is made current by ``use()`` and
    the previous one restored by ``use()``, never by CuPy's ``with`` stack, whose end in
    CuPy 13 makes the enclosing ``with``'s stream current (else the null stream),
    forgetting one made current by ``use()`` (cupy/cupy#8377), such as a kvwire.sync loop
    thread's own stream.  Use it instead of ``with stream:``."""
    import cupy

    previous = cupy.cuda.get_current_stream()
    if not (hasattr(stream, "use") and hasattr(previous, "use")):  # (stream-likes, not CuPy's)
        with stream:
            yield stream
        return
    try:
        stream.use()
    except RuntimeError:
        # A CuPy that refuses use() inside a with block keeps a stream made current by
        # use() across the end of a nested one: its with block is then the right tool
        # (and raises again where the refusal was the stream's device).
        with stream:
            yield stream
        return
    try:
        yield stream
    finally:
        previous.use()


def decode_into(
    codec: Codec, params: bytes, payload: Any, out: Any, *, dtype: str, kind: TensorKind,
    stream: Any = None,
) -> None:
    """Decode one chunk into CuPy ``out`` (``[tokens, heads, head_dim]``, C-contiguous, of
    ``dtype``; bfloat16 also as its uint16 bits): UsageError for any other destination.

    Runs on ``out``'s device and on ``stream`` (default: the current one), and waits for
    the kernel (its flags say whether the codes were valid), so ``out`` holds the chunk
    when it returns.  On another stream than the current one, the writes are ordered
    after the work queued so far on the current stream, where ``out`` was allocated or
    last used: CuPy's memory pool hands a block freed there out again at once, ordered
    only in that stream.  ``raw`` chunks are copied in as they are.
    """
    shape = check_destination(out, dtype)
    kind = TensorKind(kind)
    import cupy

    with out.device:
        current = cupy.cuda.get_current_stream()
        stream = stream if stream is not None else current
        base, params, plain = _plain(codec, params, payload, shape, dtype, kind)
        if base == "raw":
            if params:
                raise ProtocolError("raw codec takes no parameters")
            if plain.nbytes != out.nbytes:
                raise ProtocolError(f"raw payload is {plain.nbytes} bytes, expected {out.nbytes}")
            _order_after(stream, current)
            with on_stream(stream):
                out.reshape(-1).view(cupy.uint8).set(np.frombuffer(plain, np.uint8), stream=stream)
            stream.synchronize()
            return
        if base not in QUANTIZERS:
            raise UsageError(f"codec {codec.name!r} has no GPU kernels")
        validate_payload(base, params, plain, shape, kind)
        _order_after(stream, current)
        with on_stream(stream):
            dev = cupy.empty(plain.nbytes, cupy.uint8)
            dev.set(np.frombuffer(plain, np.uint8), stream=stream)
            flags = cupy.zeros(1, cupy.uint32)
            launch_decode(base, params, dev, out, dtype=dtype, kind=kind, flags=flags)
            host_flags = pinned_empty(4)
            copy_to_host_async(flags, 0, host_flags, stream)
        stream.synchronize()
        _check_flags(int(host_flags.view(np.uint32)[0]), base, dtype)


def launch_decode(
    base: str, params: bytes, payload: Any, out: Any, *, dtype: str, kind: TensorKind, flags: Any
) -> None:
    """Queue the decode kernel of a plain payload already on the device (CuPy uint8, at any
    address: a chunk of :attr:`DeviceChunks.buffer` at its offset too) into ``out`` on the
    current stream; problems found in the codes are OR-ed into ``flags``."""
    shape = (int(out.shape[0]), int(out.shape[1]), int(out.shape[2]))
    launch = plan_decode(base, params, shape, dtype, kind, out_aligned=out.data.ptr % 16 == 0,
                         payload_align=alignment(int(payload.data.ptr)))
    _run(launch, {"payload": payload, "out": out, "flags": flags})


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

    For bfloat16 the array holds the uint16 bit patterns.
    """
    check_dtype(dtype)
    shape, kind = check_sizing_args(shape, dtype, kind, codec.name)  # before it sizes an allocation
    import cupy

    out = cupy.empty(shape, cupy.float32 if dtype == "float32" else cupy.float16 if dtype == "float16" else cupy.uint16)
    decode_into(codec, params, payload, out, dtype=dtype, kind=kind)
    return out
