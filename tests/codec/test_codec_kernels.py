"""The CUDA arithmetic against the numpy reference, bit for bit.

Without a GPU: the kernel source compiles to PTX for sm_90 with the options CuPy really
uses (ours, then its ``-ftz=true``) and that PTX holds no flush-to-zero instruction, and
kvquant.cuh compiled into a host shared library (the same __host__ __device__ functions)
matches numpy over every float16 and bfloat16 bit pattern and over random blocks.  With
CuPy and a device (the ``gpu`` mark): the kernels, over chunk plans, against numpy.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from kvwire.codec import TensorKind, get_codec, numpy_dtype
from kvwire.codec import _numeric as nm
from kvwire.codec.gpu import (
    COMPILE_OPTIONS,
    CUPY_APPENDED_OPTIONS,
    KERNEL_DIR,
    gpu_available,
    kernel_source,
)
from kvwire.codec.int4 import group_count
from kvwire.errors import ProtocolError, UsageError
from tests.codec.codec_helpers import DTYPES
from tests.codec.ptx import nvcc_ptx
from tests.environment import NVCC, needs_nvcc

WRAPPER = r"""
#include "kvquant.cuh"
#define EACH(i) for (long i = 0; i < n; ++i)
extern "C" {
void h_f16_to_f32(const kv_u16* a, float* o, long n) { EACH(i) o[i] = kv_f16_to_f32(a[i]); }
void h_bf16_to_f32(const kv_u16* a, float* o, long n) { EACH(i) o[i] = kv_bf16_to_f32(a[i]); }
void h_f32_to_f16(const float* a, kv_u16* o, long n) { EACH(i) o[i] = kv_f32_to_f16(a[i]); }
void h_f32_to_bf16(const float* a, kv_u16* o, long n) { EACH(i) o[i] = kv_f32_to_bf16(a[i]); }
void h_f32_to_e4m3(const float* a, kv_u8* o, long n) { EACH(i) o[i] = kv_f32_to_e4m3(a[i]); }
void h_e4m3_to_f32(const kv_u8* a, float* o, long n) { EACH(i) o[i] = kv_e4m3_to_f32(a[i]); }
void h_fp8_scale(const float* a, float* o, long n) { EACH(i) o[i] = kv_fp8_scale(a[i]); }
void h_int8_scale(const float* a, float* o, long n) { EACH(i) o[i] = kv_int8_scale(a[i]); }
void h_int4_scale(const float* lo, const float* hi, float* o, long n) { EACH(i) o[i] = kv_int4_scale(lo[i], hi[i]); }
void h_fp8_quant(const float* x, const float* s, kv_u8* o, long n) { EACH(i) o[i] = kv_fp8_quant(x[i], s[i]); }
void h_int8_quant(const float* x, const float* s, signed char* o, long n) { EACH(i) o[i] = kv_int8_quant(x[i], s[i]); }
void h_int4_quant(const float* x, const float* lo, const float* s, kv_u8* o, long n) { EACH(i) o[i] = kv_int4_quant(x[i], lo[i], s[i]); }
void h_fp8_dequant(const kv_u8* c, const float* s, float* o, long n) { EACH(i) o[i] = kv_fp8_dequant(c[i], s[i]); }
void h_int8_dequant(const signed char* c, const float* s, float* o, long n) { EACH(i) o[i] = kv_int8_dequant(c[i], s[i]); }
void h_int4_dequant(const kv_u8* c, const float* lo, const float* s, float* o, long n) { EACH(i) o[i] = kv_int4_dequant(c[i], lo[i], s[i]); }
void h_order_key(const float* a, kv_u32* o, long n) { EACH(i) o[i] = kv_order_key(a[i]); }
void h_from_order_key(const kv_u32* a, float* o, long n) { EACH(i) o[i] = kv_from_order_key(a[i]); }
void h_canonical_zero(const float* a, float* o, long n) { EACH(i) o[i] = kv_canonical_zero(a[i]); }
}
"""


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Any:
    build = tmp_path_factory.mktemp("kvquant_host")
    src = build / "host.cu"
    src.write_text(WRAPPER)
    lib = build / "libkvquant_host.so"
    if NVCC:
        cmd = [NVCC, "-shared", "-Xcompiler", "-fPIC,-ffp-contract=off,-O2", f"-I{KERNEL_DIR}", str(src), "-o", str(lib)]
    else:
        gxx = shutil.which("g++")
        if gxx is None:
            pytest.fail("neither nvcc nor g++ found to build the host check library")
        cpp = build / "host.cpp"
        cpp.write_text(WRAPPER)
        cmd = [gxx, "-shared", "-fPIC", "-O2", "-ffp-contract=off", f"-I{KERNEL_DIR}", str(cpp), "-o", str(lib)]
    subprocess.run(cmd, check=True, capture_output=True, cwd=build)
    return ctypes.CDLL(str(lib))


def _call(lib: Any, fn: str, out_dtype: Any, *args: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    arrays = [np.ascontiguousarray(a) for a in args]
    out = np.empty(arrays[0].size, out_dtype)
    ptrs = [a.ctypes.data_as(ctypes.c_void_p) for a in arrays]
    getattr(lib, fn)(*ptrs, out.ctypes.data_as(ctypes.c_void_p), ctypes.c_long(out.size))
    return out


ALL16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)


def _finite(bits: np.ndarray[Any, Any], name: str) -> np.ndarray[Any, Any]:
    limit = 0x7C00 if name == "float16" else 0x7F80
    return bits[(bits & 0x7FFF) < limit]


def _random_f32(n: int, seed: int) -> np.ndarray[Any, Any]:
    bits = np.random.default_rng(seed).integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    return x[np.isfinite(x)]


@needs_nvcc
def test_kernels_under_cupys_options_hold_no_flush_to_zero(tmp_path: Path) -> None:
    # The same options make plain float arithmetic flush: the check below would see it.
    control = nvcc_ptx(tmp_path, 'extern "C" __global__ void f(float* x) { x[0] = x[0] * x[1] + (x[2] < x[3] ? 1.0f : x[4] / x[5]); }', "control")
    assert re.search(r"\b(mul|add|div|setp)\.[a-z.]*ftz", control)
    text = nvcc_ptx(tmp_path, kernel_source(), "kvquant")
    entries = set(re.findall(r"\.entry (\w+)", text))
    for base in ("fp8", "int8"):
        for suffix in ("f16", "bf16", "f32"):
            assert f"kv_{base}_encode_vec_{suffix}_16_1" in entries
            assert f"kv_{base}_encode_any_{suffix}" in entries
            assert f"kv_{base}_decode_vec_{suffix}" in entries
    assert {"kv_int4_stats_bf16", "kv_int4_pack_f32", "kv_int4_decode_f16"} <= entries
    for suffix in ("f16", "bf16", "f32"):  # int4: one-launch vector encode, vector decode
        assert {f"kv_int4_encode_v_vec_{suffix}_{lanes}" for lanes in ("16_1", "32_1", "32_2", "32_4")} <= entries
        assert {f"kv_int4_encode_k_vec_{suffix}_{v}" for v in ("4_2", "4_8", "4_16", "8_16", "16_16")} <= entries
        assert f"kv_int4_decode_vec_{suffix}" in entries
    # every encode entry reduces with warp shuffles on integer keys, never on floats
    assert "shfl.sync.bfly.b32" in text
    assert ".ftz" not in text
    assert "fma." not in text
    # float arithmetic is there, all of it round-to-nearest without flushing
    assert re.search(r"\bdiv\.rn\.f32\b", text) and re.search(r"\bmul\.rn\.f32\b", text)
    # where NVRTC itself is installed (CuPy's compiler), the same through it
    nvrtc = _nvrtc_ptx(kernel_source())
    if nvrtc is not None:
        assert ".entry kv_fp8_encode_vec_f16_16_1" in nvrtc
        assert ".entry kv_int4_encode_k_vec_bf16_4_8" in nvrtc and ".entry kv_int4_decode_vec_f32" in nvrtc
        assert ".ftz" not in nvrtc and "fma." not in nvrtc


def _nvrtc_ptx(source: str) -> str | None:
    """PTX from NVRTC with CuPy's option list for an sm_90 device (None without NVRTC)."""
    import glob
    import site

    libs = sorted(p for d in site.getsitepackages() for p in glob.glob(f"{d}/nvidia/*/lib/libnvrtc.so*")
                  if "builtins" not in p and "alt" not in p)
    if not libs:
        return None
    folder = str(Path(libs[0]).parent)
    for builtins in sorted(glob.glob(f"{folder}/libnvrtc-builtins.so*")):
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(libs[0])
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kern.cu", 0, None, None) == 0
    opts = [o.encode() for o in (*COMPILE_OPTIONS, *CUPY_APPENDED_OPTIONS, "-arch=compute_90")]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    if rc != 0:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise AssertionError(f"NVRTC failed: {log.value.decode()[:2000]}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def test_kernel_source_covers_every_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvwire.codec.gpu as gpu_mod

    src = gpu_mod.kernel_source()
    assert '#include "kvquant.cuh"' not in src
    assert "kv_f32_to_e4m3" in src and "rowwise_encode_vec" in src
    for name in gpu_mod.SOURCE_FILES:
        (tmp_path / name).write_text((KERNEL_DIR / name).read_text())
    monkeypatch.setattr(gpu_mod, "KERNEL_DIR", tmp_path)
    assert gpu_mod.kernel_source() == src
    # a change in the header alone changes the string CuPy keys its cache on
    (tmp_path / "kvquant.cuh").write_text((KERNEL_DIR / "kvquant.cuh").read_text() + "\n// edited\n")
    assert gpu_mod.kernel_source() != src


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_widening_every_bit_pattern(host: Any, name: str) -> None:
    bits = ALL16
    got = _call(host, "h_f16_to_f32" if name == "float16" else "h_bf16_to_f32", np.float32, bits)
    ref = nm.to_f32(bits.view(numpy_dtype(name)), name)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    finite = _finite(bits, name)
    assert np.array_equal(ref.view(np.uint32)[finite], bits.view(numpy_dtype(name)).astype(np.float32).view(np.uint32)[finite])


def _e4m3_numpy(q: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    mag = np.abs(q).astype(np.float32)
    codes = nm.f32_mag_to_e4m3(mag, np.empty_like(mag), np.empty(mag.size, np.int32), np.empty(mag.size, np.uint8))
    return codes | np.where(np.signbit(q), np.uint8(0x80), np.uint8(0))


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float32"])
def test_e4m3_conversion_every_pattern(host: Any, name: str) -> None:
    if name == "float32":
        q = _random_f32(1 << 20, 3)
    else:
        q = nm.to_f32(_finite(ALL16, name).view(numpy_dtype(name)), name)
    got = _call(host, "h_f32_to_e4m3", np.uint8, q)
    assert np.array_equal(got, _e4m3_numpy(q))
    ref = np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(got, ref)


def test_e4m3_decode_table(host: Any) -> None:
    got = _call(host, "h_e4m3_to_f32", np.float32, np.arange(256, dtype=np.uint8))
    assert np.array_equal(got, nm.E4M3_TO_F32, equal_nan=True)
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(got, ref, equal_nan=True)


def test_narrowing_matches_numpy(host: Any) -> None:
    f16 = nm.to_f32(ALL16.view(np.float16), "float16")
    bf = nm.to_f32(ALL16.view(ml_dtypes.bfloat16), "bfloat16")
    mids = (f16[:-1].astype(np.float64) + f16[1:]) / 2
    q = np.concatenate([f16, bf, _random_f32(1 << 19, 5), mids.astype(np.float32)])
    q = q[np.isfinite(q)]
    with np.errstate(over="ignore"):
        ref16 = q.astype(np.float16).view(np.uint16)
    assert np.array_equal(_call(host, "h_f32_to_f16", np.uint16, q), ref16)
    assert np.array_equal(_call(host, "h_f32_to_bf16", np.uint16, q), q.astype(ml_dtypes.bfloat16).view(np.uint16))


def _blocks(dtype: str, seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((96, 4, 40)) * np.exp2(rng.integers(-20, 12, (96, 4, 1)))
    x[0] = 0
    x[1, :, 5] = 1e-7
    x[2, 1] = -3.0
    return x.astype(numpy_dtype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("base", ["fp8", "int8"])
def test_rowwise_scales_codes_and_decode(host: Any, dtype: str, base: str) -> None:
    x = _blocks(dtype, 11)
    chunk = get_codec(base).encode(x, TensorKind.K)
    raw = np.frombuffer(memoryview(chunk.payload).cast("B"), np.uint8)
    rows = x.shape[0] * x.shape[1]
    scales = raw[: 4 * rows].view("<f4")
    xf = nm.to_f32(x, dtype).reshape(rows, -1)
    amax = np.abs(xf).max(axis=1)
    assert np.array_equal(_call(host, f"h_{base}_scale", np.float32, amax).view(np.uint32), scales.view(np.uint32))
    per = np.repeat(scales, x.shape[2])
    code_t = np.uint8 if base == "fp8" else np.int8
    codes = _call(host, f"h_{base}_quant", code_t, xf.reshape(-1), per)
    assert np.array_equal(codes.view(np.uint8), raw[4 * rows :])
    dec = _call(host, f"h_{base}_dequant", np.float32, codes, per)
    y = get_codec(base).decode(chunk.params, chunk.payload, shape=x.shape, dtype="float32", kind=TensorKind.K)
    assert np.array_equal(dec.view(np.uint32), y.reshape(-1).view(np.uint32))
    if dtype != "float32":
        conv = "h_f32_to_f16" if dtype == "float16" else "h_f32_to_bf16"
        y16 = get_codec(base).decode(chunk.params, chunk.payload, shape=x.shape, dtype=dtype, kind=TensorKind.K)
        assert np.array_equal(_call(host, conv, np.uint16, dec), y16.reshape(-1).view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", [TensorKind.K, TensorKind.V])
def test_int4_scales_codes_and_decode(host: Any, dtype: str, kind: TensorKind) -> None:
    from kvwire.codec.int4 import _expand, group_count

    x = _blocks(dtype, 13)
    chunk = get_codec("int4").encode(x, kind)
    g = group_count(x.shape, kind, chunk.params[0])
    raw = np.frombuffer(memoryview(chunk.payload).cast("B"), np.uint8)
    scales, los = raw[: 4 * g].view("<f4"), raw[4 * g : 8 * g].view("<f4")
    xf = nm.to_f32(x, dtype)
    axis = 0 if kind == TensorKind.K else 2
    starts = np.arange(0, x.shape[axis], chunk.params[0])
    lo = np.minimum.reduceat(xf, starts, axis=axis).reshape(-1) + np.float32(0)
    hi = np.maximum.reduceat(xf, starts, axis=axis).reshape(-1) + np.float32(0)
    assert np.array_equal(lo.view(np.uint32), los.view(np.uint32))
    assert np.array_equal(_call(host, "h_int4_scale", np.float32, lo, hi).view(np.uint32), scales.view(np.uint32))
    s_el = _expand(scales.astype(np.float32), kind, x.shape, chunk.params[0]).reshape(-1)
    lo_el = _expand(los.astype(np.float32), kind, x.shape, chunk.params[0]).reshape(-1)
    codes = _call(host, "h_int4_quant", np.uint8, xf.reshape(-1), lo_el, s_el)
    packed = raw[8 * g :]
    unpacked = np.stack([packed & 15, packed >> 4], axis=1).reshape(-1)[: codes.size]
    assert np.array_equal(codes, unpacked)
    dec = _call(host, "h_int4_dequant", np.float32, codes, lo_el, s_el)
    y = get_codec("int4").decode(chunk.params, chunk.payload, shape=x.shape, dtype="float32", kind=kind)
    assert np.array_equal(dec.view(np.uint32), y.reshape(-1).view(np.uint32))


def test_order_keys_sort_like_the_floats(host: Any) -> None:
    x = np.concatenate([_random_f32(1 << 16, 7), np.array([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38], np.float32)])
    keys = _call(host, "h_order_key", np.uint32, x)
    order = np.argsort(keys, kind="stable")
    assert np.all(np.diff(x[order].astype(np.float64)) >= 0)
    assert keys[-5] < keys[-6]  # -0 before +0
    back = _call(host, "h_from_order_key", np.float32, keys)
    assert np.array_equal(back.view(np.uint32), x.view(np.uint32))
    canon = _call(host, "h_canonical_zero", np.float32, x)
    assert np.array_equal(canon.view(np.uint32), (x + np.float32(0)).view(np.uint32))


@pytest.mark.parametrize("kind", [TensorKind.K, TensorKind.V])
def test_int4_group_bounds_are_canonical_zero(kind: TensorKind) -> None:
    x = np.zeros((64, 2, 64), np.float32)
    x[1::2] = -0.0  # every group sees both zeros
    x[:, 1] = np.where(np.arange(64) % 3 == 0, -0.0, 2.0)[:, None]
    codec = get_codec("int4")
    chunk = codec.encode(x, kind)
    g = group_count(x.shape, kind, chunk.params[0])
    raw = np.frombuffer(memoryview(chunk.payload).cast("B"), np.uint8)
    assert not np.any(raw[: 8 * g].view("<u4") == 0x80000000)  # no stored -0
    reference = getattr(codec, "encode_numpy", codec.encode)(x, kind)
    assert bytes(memoryview(reference.payload).cast("B")) == raw.tobytes()


GPU = gpu_available()


gpu_only = pytest.mark.skipif(not GPU, reason="needs CuPy and a CUDA device")
#: shapes that take the vector kernels (16 and 32 lanes, 1 and 2 vectors a lane) and the
#: any-shape ones (odd head_dim, unaligned chunk payloads)
GPU_SHAPES = [(200, 8, 128), (50, 2, 512), (37, 3, 40), (33, 2, 6)]
GPU_CODECS = ["fp8", "int8", "int4", "fp8+zstd", "int4+lz4"]


def _tricky(dtype: str, shape: tuple[int, int, int], seed: int) -> np.ndarray[Any, Any]:
    """Real-looking data plus what flush-to-zero would break: subnormal inputs and scales,
    zero rows, -0 next to +0."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-6, 4, (shape[0], shape[1], 1)))
    tiny = {"float16": 2.0**-20, "bfloat16": 2.0**-133, "float32": 2.0**-140}[dtype]
    x[1] *= tiny  # subnormal values (and, for bfloat16/float32, subnormal scales)
    x[2, :, ::2] *= tiny
    x[3] = 0.0
    x[4] = -0.0
    x[5, :, 1::2] = -0.0
    return x.astype(numpy_dtype(dtype))


def _dev(x: np.ndarray[Any, Any], dtype: str) -> Any:
    import cupy

    return cupy.asarray(x.view(np.uint16) if dtype == "bfloat16" else x)


def _payload(chunk: Any) -> bytes:
    return bytes(memoryview(chunk.payload).cast("B"))


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", GPU_CODECS)
@pytest.mark.parametrize("kind", [TensorKind.K, TensorKind.V])
def test_gpu_tensor_encode_and_decode_match_numpy(shape: tuple[int, int, int], dtype: str, name: str, kind: TensorKind) -> None:
    import cupy

    from kvwire.codec import gpu

    x = _tricky(dtype, shape, 17)
    codec = get_codec(name)
    step = 16
    plan = [(s, min(step, shape[0] - s)) for s in range(0, shape[0], step)]
    enc = gpu.encode_tensor(codec, _dev(x, dtype), kind, step, dtype=dtype)
    enc.check()
    buf = cupy.asnumpy(enc.buffer)
    assert len(enc.sizes) == len(plan)
    dest = cupy.full(shape, 0xFFFF if dtype != "float32" else 0xFFFFFFFF,
                     cupy.uint32 if dtype == "float32" else cupy.uint16)
    # the destination of the dtype (bfloat16: its uint16 bits), every bit set to start with
    dest = dest.view(cupy.float32) if dtype == "float32" else dest.view(cupy.float16) if dtype == "float16" else dest
    for i, (s, c) in enumerate(plan):
        ref = codec.encode(x[s : s + c], kind)
        got = gpu.finish_chunk(codec, enc, buf[enc.offsets[i] : enc.offsets[i] + enc.sizes[i]].data)
        assert got.codec_id == ref.codec_id and got.params == ref.params
        assert _payload(got) == _payload(ref), (i, s, c)
        gpu.decode_into(codec, ref.params, ref.payload, dest[s : s + c], dtype=dtype, kind=kind)
    host = np.concatenate([
        codec.decode(*(lambda e: (e.params, e.payload))(codec.encode(x[s : s + c], kind)),
                     shape=(c, *shape[1:]), dtype=dtype, kind=kind)
        for s, c in plan
    ])
    assert cupy.asnumpy(dest).tobytes() == host.tobytes()


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_gpu_single_chunk_api_matches_numpy(dtype: str, name: str) -> None:
    import cupy

    from kvwire.codec.gpu import decode_on_device, encode_on_device

    x = _blocks(dtype, 19)
    ref = get_codec(name).encode(x, TensorKind.V)
    got = encode_on_device(get_codec(name), _dev(x, dtype), TensorKind.V, dtype=dtype)
    assert got.params == ref.params and _payload(got) == _payload(ref)
    y = decode_on_device(get_codec(name), ref.params, ref.payload, shape=x.shape, dtype=dtype, kind=TensorKind.V)
    host = get_codec(name).decode(ref.params, ref.payload, shape=x.shape, dtype=dtype, kind=TensorKind.V)
    assert cupy.asnumpy(y).tobytes() == host.tobytes()


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("shape", [(64, 8, 128), (33, 2, 6)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_gpu_refusals_match_numpy(shape: tuple[int, int, int], dtype: str, name: str) -> None:
    import cupy

    from kvwire.codec import gpu

    codec = get_codec(name)
    for bad in (np.nan, np.inf):
        x = _tricky(dtype, shape, 23)
        x.reshape(-1)[x.size // 2 + 3] = bad
        with pytest.raises(UsageError):
            codec.encode(x, TensorKind.K)
        with pytest.raises(UsageError, match="NaN or infinity"):
            gpu.encode_tensor(codec, _dev(x, dtype), TensorKind.K, 16, dtype=dtype).check()
    x = _tricky(dtype, shape, 29)
    ref = codec.encode(x, TensorKind.K)
    raw = bytearray(_payload(ref))
    out = cupy.empty(x.shape, cupy.float32 if dtype == "float32" else cupy.float16 if dtype == "float16" else cupy.uint16)
    if name != "int4":
        rows = shape[0] * shape[1]
        bad_code = bytearray(raw)
        bad_code[4 * rows + 7] = 0x7F if name == "fp8" else 0x80
        with pytest.raises(ProtocolError):
            codec.decode(b"", bytes(bad_code), shape=x.shape, dtype=dtype, kind=TensorKind.K)
        with pytest.raises(ProtocolError):
            gpu.decode_into(codec, b"", bytes(bad_code), out, dtype=dtype, kind=TensorKind.K)
    bad_scale = bytearray(raw)
    bad_scale[3] |= 0x80  # a negative first scale
    with pytest.raises(ProtocolError):
        gpu.decode_into(codec, ref.params, bytes(bad_scale), out, dtype=dtype, kind=TensorKind.K)
    with pytest.raises(ProtocolError):
        gpu.decode_into(codec, ref.params, bytes(raw[:-1]), out, dtype=dtype, kind=TensorKind.K)
    # a scale large enough that decoded values leave float32
    big = bytearray(raw)
    big[0:4] = np.float32(3e38).tobytes()
    with pytest.raises(ProtocolError):
        codec.decode(ref.params, bytes(big), shape=x.shape, dtype=dtype, kind=TensorKind.K)
    with pytest.raises(ProtocolError):
        gpu.decode_into(codec, ref.params, bytes(big), out, dtype=dtype, kind=TensorKind.K)
    if dtype != "float32":
        # one that leaves the 16-bit dtype only
        near = bytearray(raw)
        near[0:4] = np.float32(1e38 if dtype == "bfloat16" else 1e4).tobytes()
        with pytest.raises(ProtocolError):
            codec.decode(ref.params, bytes(near), shape=x.shape, dtype=dtype, kind=TensorKind.K)
        with pytest.raises(ProtocolError):
            gpu.decode_into(codec, ref.params, bytes(near), out, dtype=dtype, kind=TensorKind.K)


@pytest.mark.gpu
@gpu_only
def test_gpu_int4_range_beyond_float32_is_refused() -> None:
    from kvwire.codec import gpu

    x = np.ones((32, 1, 8), np.float32)
    x[0, 0, 0], x[1, 0, 0] = 3e38, -3e38
    with pytest.raises(UsageError, match="range"):
        get_codec("int4").encode(x, TensorKind.K)
    with pytest.raises(UsageError, match="range"):
        gpu.encode_tensor(get_codec("int4"), _dev(x, "float32"), TensorKind.K, 32).check()


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
@pytest.mark.parametrize(("shape", "step"), [((5, 1, 8), 3), ((40, 2, 64), 6), ((9, 3, 8), 4)])
def test_gpu_launch_decode_of_each_chunk_where_it_lies_in_the_buffer(
    shape: tuple[int, int, int], step: int, dtype: str, name: str,
) -> None:
    """launch_decode straight from each chunk's offset in encode_tensor's buffer (chunk 1
    of a (5, 1, 8) fp8 tensor lies 4 bytes past an 8-byte boundary, where the vector
    kernel's 8-byte loads fault): numpy's values, no flag, the device still usable."""
    import cupy

    from kvwire.codec import gpu

    codec = get_codec(name)
    x = _tricky(dtype, (max(shape[0], 6), *shape[1:]), 31)[: shape[0]]
    enc = gpu.encode_tensor(codec, _dev(x, dtype), TensorKind.K, step, dtype=dtype)
    enc.check()
    out = cupy.empty(shape, cupy.float32 if dtype == "float32" else cupy.float16 if dtype == "float16" else cupy.uint16)
    flags = cupy.zeros(1, cupy.uint32)
    for off, size, s in zip(enc.offsets, enc.sizes, range(0, shape[0], step), strict=True):
        c = min(step, shape[0] - s)
        gpu.launch_decode(name, enc.params, enc.buffer[off : off + size], out[s : s + c], dtype=dtype,
                          kind=TensorKind.K, flags=flags)
    cupy.cuda.get_current_stream().synchronize()
    assert int(flags.get()[0]) == 0
    host = np.concatenate([
        codec.decode(*(lambda e: (e.params, e.payload))(codec.encode(x[s : s + step], TensorKind.K)),
                     shape=x[s : s + step].shape, dtype=dtype, kind=TensorKind.K)
        for s in range(0, shape[0], step)
    ])
    assert cupy.asnumpy(out).tobytes() == host.tobytes()
