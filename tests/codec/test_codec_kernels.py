"""The CUDA arithmetic against the numpy reference, bit for bit.

Without a GPU: every .cu compiles to PTX for sm_90, and kvquant.cuh compiled into a host
shared library (the same __host__ __device__ functions) matches numpy over every float16
and bfloat16 bit pattern and over random blocks.  With CuPy and a device: the kernels.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from kvwire.codec import TensorKind, get_codec, numpy_dtype
from kvwire.codec import _numeric as nm
from kvwire.codec.gpu import KERNEL_DIR, gpu_available
from kvwire.errors import UsageError
from tests.codec.codec_helpers import DTYPES

NVCC = shutil.which("nvcc") or ("/usr/local/bin/nvcc" if Path("/usr/local/bin/nvcc").exists() else None)

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


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_every_cu_file_compiles_to_ptx_for_sm90(tmp_path: Path) -> None:
    sources = sorted(KERNEL_DIR.glob("*.cu"))
    assert sources
    for src in sources:
        ptx = tmp_path / (src.stem + ".ptx")
        subprocess.run([NVCC, "-ptx", "-arch=sm_90", "--fmad=false", f"-I{KERNEL_DIR}", str(src), "-o", str(ptx)], check=True, capture_output=True)
        text = ptx.read_text()
        assert ".entry kv_fp8_encode_f16" in text and ".entry kv_int4_decode_bf16" in text
        assert "fma." not in text


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
    g = group_count(x.shape, kind, chunk.params[0])  # type: ignore[arg-type]
    raw = np.frombuffer(memoryview(chunk.payload).cast("B"), np.uint8)
    scales, los = raw[: 4 * g].view("<f4"), raw[4 * g : 8 * g].view("<f4")
    xf = nm.to_f32(x, dtype)
    axis = 0 if kind == TensorKind.K else 2
    starts = np.arange(0, x.shape[axis], chunk.params[0])
    lo = np.minimum.reduceat(xf, starts, axis=axis).reshape(-1)
    hi = np.maximum.reduceat(xf, starts, axis=axis).reshape(-1)
    assert np.array_equal(lo.view(np.uint32), los.view(np.uint32))
    assert np.array_equal(_call(host, "h_int4_scale", np.float32, lo, hi).view(np.uint32), scales.view(np.uint32))
    s_el = _expand(scales.astype(np.float32), kind, x.shape, chunk.params[0]).reshape(-1)  # type: ignore[arg-type]
    lo_el = _expand(los.astype(np.float32), kind, x.shape, chunk.params[0]).reshape(-1)  # type: ignore[arg-type]
    codes = _call(host, "h_int4_quant", np.uint8, xf.reshape(-1), lo_el, s_el)
    packed = raw[8 * g :]
    unpacked = np.stack([packed & 15, packed >> 4], axis=1).reshape(-1)[: codes.size]
    assert np.array_equal(codes, unpacked)
    dec = _call(host, "h_int4_dequant", np.float32, codes, lo_el, s_el)
    y = get_codec("int4").decode(chunk.params, chunk.payload, shape=x.shape, dtype="float32", kind=kind)
    assert np.array_equal(dec.view(np.uint32), y.reshape(-1).view(np.uint32))


GPU = gpu_available()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CuPy and a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["fp8", "int8", "int4", "fp8+zstd", "int4+lz4"])
@pytest.mark.parametrize("kind", [TensorKind.K, TensorKind.V])
def test_gpu_matches_numpy(dtype: str, name: str, kind: TensorKind) -> None:
    import cupy

    from kvwire.codec.gpu import decode_on_device, encode_on_device

    x = _blocks(dtype, 17)
    dev = cupy.asarray(x.view(np.uint16) if dtype == "bfloat16" else x)
    ref = get_codec(name).encode(x, kind)
    got = encode_on_device(get_codec(name), dev, kind, dtype=dtype)
    assert got.codec_id == ref.codec_id and got.params == ref.params
    assert bytes(memoryview(got.payload).cast("B")) == bytes(memoryview(ref.payload).cast("B"))
    y = decode_on_device(get_codec(name), ref.params, ref.payload, shape=x.shape, dtype=dtype, kind=kind)
    host = get_codec(name).decode(ref.params, ref.payload, shape=x.shape, dtype=dtype, kind=kind)
    assert cupy.asnumpy(y).tobytes() == host.tobytes()
    if not name.startswith("int4"):
        bad = x.copy()
        bad.reshape(-1)[5] = np.nan
        with pytest.raises(UsageError):
            encode_on_device(get_codec(name), cupy.asarray(bad.view(np.uint16) if dtype == "bfloat16" else bad), kind, dtype=dtype)


