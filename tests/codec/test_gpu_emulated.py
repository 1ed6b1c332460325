"""The CUDA kernels run on the CPU: kvquant.cu compiled by the host C++ compiler with a
small emulation of the CUDA built-ins (a warp is 32 threads with a barrier for
``__shfl_xor_sync``), launched with the grids and arguments kvwire.codec.gpu computes.

This checks what the arithmetic tests cannot: the kernels' indexing, vector loads, the
warp reductions, int4 packing and the chunk-plan payload layout, against the numpy codecs
byte for byte, without a GPU.  (The arithmetic runs in its host form here; that the device
form keeps the same bits under CuPy's -ftz=true is checked on the PTX in
test_codec_kernels.py.)
"""

from __future__ import annotations

import ctypes
import itertools
import re
import shutil
import subprocess
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvwire.codec import TensorKind, get_codec, numpy_dtype
from kvwire.codec import gpu as g
from kvwire.errors import ProtocolError, UsageError

CXX = shutil.which("g++") or shutil.which("c++")

SHIM = r"""
#include <algorithm>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
struct dim3 { unsigned x = 0, y = 0, z = 0; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
static inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
template <class T> static inline T __ldg(const T* p) { return *p; }
static inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
using std::max;
using std::min;
struct EmuWarp { std::barrier<>* bar; unsigned vals[32]; };
static thread_local EmuWarp* emu_warp;
static inline unsigned __shfl_xor_sync(unsigned, unsigned v, int off) {
    const unsigned lane = threadIdx.x & 31u;
    emu_warp->vals[lane] = v;
    emu_warp->bar->arrive_and_wait();
    const unsigned r = emu_warp->vals[lane ^ (unsigned)off];
    emu_warp->bar->arrive_and_wait();
    return r;
}
// threaded: 32 threads run each warp in step (for kernels with warp shuffles);
// otherwise the threads run one after another.
static void emu_run(unsigned grid, unsigned block, int threaded, const std::function<void()>& body) {
    blockDim = dim3{block, 1, 1};
    if (!threaded) {
        for (unsigned b = 0; b < grid; ++b)
            for (unsigned t = 0; t < block; ++t) { blockIdx = dim3{b, 0, 0}; threadIdx = dim3{t, 0, 0}; body(); }
        return;
    }
    std::barrier<> bar(32);
    EmuWarp warp;
    warp.bar = &bar;
    std::vector<std::thread> lanes;
    for (unsigned l = 0; l < 32; ++l)
        lanes.emplace_back([&, l] {
            emu_warp = &warp;
            for (unsigned b = 0; b < grid; ++b)
                for (unsigned w = 0; w < block; w += 32) {
                    blockIdx = dim3{b, 0, 0};
                    threadIdx = dim3{w + l, 0, 0};
                    body();
                    bar.arrive_and_wait();
                }
        });
    for (auto& t : lanes) t.join();
}
"""

_CTYPES = {np.int64: ctypes.c_longlong, np.int32: ctypes.c_int, np.uint32: ctypes.c_uint}


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if CXX is None:
        pytest.fail("no C++ compiler found to build the kernel emulation")
    build = tmp_path_factory.mktemp("kvquant_emu")
    source = SHIM + g.kernel_source()
    (build / "kernels.cpp").write_text(source)
    pre = subprocess.run([CXX, "-std=c++20", "-E", "-P", str(build / "kernels.cpp")], check=True,
                         capture_output=True, text=True).stdout
    wrappers = []
    for name, params in re.findall(r'extern "C" void (kv_\w+)\s*\(([^)]*)\)', pre):
        names = [re.findall(r"\w+", p)[-1] for p in params.split(",")]
        wrappers.append(
            f'extern "C" void emu_{name}(unsigned grid, unsigned block, int threaded, {params}) '
            f"{{ emu_run(grid, block, threaded, [&] {{ {name}({', '.join(names)}); }}); }}"
        )
    assert len(wrappers) > 40
    (build / "emu.cpp").write_text(source + "\n" + "\n".join(wrappers) + "\n")
    lib = build / "libkvemu.so"
    subprocess.run([CXX, "-std=c++20", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-pthread",
                    str(build / "emu.cpp"), "-o", str(lib)], check=True, capture_output=True)
    return ctypes.CDLL(str(lib))


def _launch(lib: Any, launch: g.Launch, buffers: dict[str, np.ndarray[Any, Any]]) -> None:
    args: list[Any] = []
    for a in launch.args:
        if isinstance(a, str):
            args.append(ctypes.c_void_p(buffers[a].ctypes.data))
        else:
            args.append(_CTYPES[type(a)](int(a)))
    threaded = int("_encode_" in launch.kernel)
    getattr(lib, "emu_" + launch.kernel)(ctypes.c_uint(max(1, launch.blocks)), ctypes.c_uint(g.THREADS),
                                         ctypes.c_int(threaded), *args)


def _placed(x: np.ndarray[Any, Any], aligned: bool) -> np.ndarray[Any, Any]:
    """A copy of ``x`` starting on 16 bytes, or 2 bytes past it."""
    raw = np.empty(x.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 16 + (0 if aligned else 2)
    out: np.ndarray[Any, Any] = raw[start : start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


def emu_encode(lib: Any, codec: Any, x: np.ndarray[Any, Any], kind: TensorKind, chunk_tokens: int,
               dtype: str) -> tuple[list[bytes], int, str]:
    """Chunk payloads, flags and the first kernel's name, as the GPU would produce them."""
    base, _ = g.split_codec(codec)
    plan = g.plan_encode(base, g._int4_group(codec), x.shape, dtype, kind, chunk_tokens,
                         x_aligned=x.ctypes.data % 16 == 0)
    out = np.full(sum(plan.sizes), 0xAB, np.uint8)
    buffers = {"x": x, "out": out, "flags": np.zeros(1, np.uint32),
               "stats": np.empty(max(1, plan.stats_floats), np.float32)}
    for launch in plan.launches:
        _launch(lib, launch, buffers)
    offs = np.cumsum((0, *plan.sizes))
    return ([out[a:b].tobytes() for a, b in itertools.pairwise(offs)],
            int(buffers["flags"][0]), plan.launches[0].kernel)


def emu_decode(lib: Any, base: str, params: bytes, payload: bytes, out: np.ndarray[Any, Any],
               dtype: str, kind: TensorKind) -> int:
    launch = g.plan_decode(base, params, out.shape, dtype, kind, out_aligned=out.ctypes.data % 16 == 0)
    buffers = {"payload": np.frombuffer(payload, np.uint8).copy(), "out": out, "flags": np.zeros(1, np.uint32)}
    _launch(lib, launch, buffers)
    return int(buffers["flags"][0])


def _tricky(dtype: str, shape: tuple[int, int, int], seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-6, 4, (shape[0], shape[1], 1)))
    tiny = {"float16": 2.0**-20, "bfloat16": 2.0**-133, "float32": 2.0**-140}[dtype]
    x[1] *= tiny
    x[2, :, ::2] *= tiny
    x[3] = 0.0
    x[4] = -0.0
    x[5, :, 1::2] = -0.0
    return x.astype(numpy_dtype(dtype))


def _bits(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x


# (shape, chunk tokens): vector kernels with 16 lanes (half used and all used), 32 lanes
# with 1 and 2 vectors a lane; odd shapes and payloads the any-shape kernels take
CASES = [((40, 4, 64), 16), ((24, 2, 128), 8), ((12, 2, 256), 8), ((9, 2, 512), 4),
         ((13, 3, 40), 6), ((11, 2, 6), 4), ((7, 1, 3), 7)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}/{c[1]}")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("kind", [TensorKind.K, TensorKind.V])
def test_emulated_kernels_match_numpy(emu: Any, case: Any, dtype: str, name: str, kind: TensorKind) -> None:
    shape, step = case
    codec = get_codec(name)
    x = _tricky(dtype, shape, 5)
    for aligned in (True, False):
        xin = _placed(_bits(x), aligned)
        payloads, flags, _kernel = emu_encode(emu, codec, xin, kind, step, dtype)
        assert flags == 0
        starts = range(0, shape[0], step)
        assert len(payloads) == len(starts)
        out = _placed(np.full(shape, 0xFF, _bits(x).dtype), aligned)
        for i, s in enumerate(starts):
            part = x[s : s + step]
            ref = codec.encode(part, kind)
            assert payloads[i] == bytes(memoryview(ref.payload).cast("B")), (aligned, i)
            sub = out[s : s + part.shape[0]]
            assert emu_decode(emu, name, ref.params, payloads[i], sub, dtype, kind) == 0
            want = codec.decode(ref.params, ref.payload, shape=part.shape, dtype=dtype, kind=kind)
            assert sub.tobytes() == _bits(want).tobytes(), (aligned, i)


def test_the_vector_kernels_are_the_ones_exercised(emu: Any) -> None:
    seen = set()
    for (shape, step) in CASES:
        for dtype in ("float16", "float32"):
            x = _placed(_bits(_tricky(dtype, shape, 1)), True)
            seen.add(emu_encode(emu, get_codec("fp8"), x, TensorKind.K, step, dtype)[2])
    assert {"kv_fp8_encode_vec_f16_16_1", "kv_fp8_encode_vec_f16_32_1", "kv_fp8_encode_vec_f16_32_2",
            "kv_fp8_encode_vec_f32_32_1", "kv_fp8_encode_vec_f32_32_4", "kv_fp8_encode_any_f16"} <= seen


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.integers(1, 20), heads=st.integers(1, 3), dim=st.sampled_from([1, 5, 8, 16, 24, 64]),
    step=st.integers(1, 20), group=st.integers(1, 9), seed=st.integers(0, 2**16),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]), kind=st.sampled_from([TensorKind.K, TensorKind.V]),
)
def test_emulated_int4_any_geometry(emu: Any, tokens: int, heads: int, dim: int, step: int, group: int,
                                    seed: int, dtype: str, kind: TensorKind) -> None:
    from kvwire.codec.int4 import Int4Codec

    codec = Int4Codec(group)
    x = _tricky(dtype, (max(tokens, 6), heads, dim), seed)[:tokens]
    payloads, flags, _ = emu_encode(emu, codec, _placed(_bits(x), True), kind, step, dtype)
    assert flags == 0
    for i, s in enumerate(range(0, tokens, max(1, min(step, tokens)))):
        ref = codec.encode(x[s : s + step], kind)
        assert payloads[i] == bytes(memoryview(ref.payload).cast("B"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", ["fp8", "int8", "int4"])
def test_emulated_flags_match_the_numpy_refusals(emu: Any, dtype: str, name: str) -> None:
    shape = (16, 2, 64)
    codec = get_codec(name)
    x = _tricky(dtype, shape, 9)
    x[7, 1, 33] = np.nan
    with pytest.raises(UsageError):
        codec.encode(x, TensorKind.K)
    _, flags, _ = emu_encode(emu, codec, _placed(_bits(x), True), TensorKind.K, 8, dtype)
    with pytest.raises(UsageError, match="NaN or infinity"):
        g._check_flags(flags, name)
    x = _tricky(dtype, shape, 9)
    ref = codec.encode(x, TensorKind.K)
    raw = bytearray(memoryview(ref.payload).cast("B"))
    out = _placed(np.empty(shape, _bits(x).dtype), True)
    if name != "int4":
        bad = bytearray(raw)
        bad[4 * 32 + 5] = 0x7F if name == "fp8" else 0x80
        with pytest.raises(ProtocolError):
            codec.decode(b"", bytes(bad), shape=shape, dtype=dtype, kind=TensorKind.K)
        with pytest.raises(ProtocolError):
            g._check_flags(emu_decode(emu, name, b"", bytes(bad), out, dtype, TensorKind.K), name)
    big = bytearray(raw)
    big[0:4] = np.float32(3e38).tobytes()
    with pytest.raises(ProtocolError):
        codec.decode(ref.params, bytes(big), shape=shape, dtype=dtype, kind=TensorKind.K)
    with pytest.raises(ProtocolError):
        g._check_flags(emu_decode(emu, name, ref.params, bytes(big), out, dtype, TensorKind.K), name)
    with pytest.raises(ProtocolError):
        g.validate_payload(name, ref.params, memoryview(bytes(raw[:-1])), shape, TensorKind.K)
    neg = bytearray(raw)
    neg[3] |= 0x80
    with pytest.raises(ProtocolError):
        g.validate_payload(name, ref.params, memoryview(bytes(neg)), shape, TensorKind.K)


def test_int4_range_beyond_float32_is_flagged(emu: Any) -> None:
    x = np.ones((32, 1, 8), np.float32)
    x[0, 0, 0], x[1, 0, 0] = 3e38, -3e38
    with pytest.raises(UsageError, match="range"):
        get_codec("int4").encode(x, TensorKind.K)
    _, flags, _ = emu_encode(emu, get_codec("int4"), _placed(x, True), TensorKind.K, 32, "float32")
    with pytest.raises(UsageError, match="range"):
        g._check_flags(flags, "int4")


def _near_boundaries(base: str, rows: int, seed: int) -> np.ndarray[Any, Any]:
    """float32 rows whose quotients x / scale fall within a few ulp of the points where the
    code changes (E4M3 midpoints, int8 half-integers): where any shortcut for the division
    (a reciprocal, a fused multiply-add) would round the other way."""
    rng = np.random.default_rng(seed)
    limit = 448.0 if base == "fp8" else 127.0
    if base == "fp8":
        mids = np.array([(1 + (2 * k + 1) / 16) * 2.0**e for e in range(-6, 9) for k in range(8)])
    else:
        mids = np.arange(127) + 0.5
    mids = mids[mids < limit * 0.98]
    out = np.empty((rows, 1, 128), np.float32)
    for r in range(rows):
        a0 = np.float32(rng.uniform(0.5, 2.0) * 2.0 ** rng.integers(-30, 30))
        scale = a0 / np.float32(limit)
        m = rng.choice(mids, 127)
        x = (m * np.float64(scale)).astype(np.float32)
        x = np.nextafter(x, np.float32(np.inf) * rng.choice([-1, 1], 127), dtype=np.float32) if r % 3 else x
        steps = rng.integers(-24, 25, 127)
        bits = x.view(np.int32) + steps.astype(np.int32)
        x = np.minimum(np.abs(bits.view(np.float32)), a0) * rng.choice([-1, 1], 127).astype(np.float32)
        out[r, 0, 0] = a0
        out[r, 0, 1:] = x
    return out


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_emulated_codes_near_rounding_points(emu: Any, name: str) -> None:
    x = _near_boundaries(name, 64, 3)
    codec = get_codec(name)
    payloads, flags, kernel = emu_encode(emu, codec, _placed(x, True), TensorKind.K, 64, "float32")
    assert flags == 0 and "_encode_vec_" in kernel
    assert payloads[0] == bytes(memoryview(codec.encode(x, TensorKind.K).payload).cast("B"))
