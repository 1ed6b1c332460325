"""The CPU emulation of the CUDA kernels: kvquant.cu compiled by the host C++ compiler with
a small emulation of the CUDA built-ins (a warp is 32 threads with a barrier for
``__shfl_xor_sync``), for tests/codec/test_gpu_emulated.py, the fake CuPy of
tests/codec/test_gpu_emulated_cupy.py and the index-width checks; with the inputs and
comparisons those tests share."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvwire.codec import gpu as g
from kvwire.codec import numpy_dtype

CXX = shutil.which("g++") or shutil.which("c++")

SHIM = r"""
#include <algorithm>
#include <atomic>
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
// What a GPU would refuse and a CPU lets pass is counted here (emu_errors): a vector
// access off its alignment (a misaligned-address fault on the device), a shuffle that not
// every lane of the warp reaches at the same call (undefined with a full mask: a lane
// returned early or took another branch), a mask other than the full warp.
static std::atomic<unsigned> emu_error_count{0};
static inline void emu_check_align(const void* p, unsigned n) {
    if ((uintptr_t)p % n) emu_error_count.fetch_add(1);
}
#define KV_ASSERT_ALIGNED(p, n) emu_check_align((const void*)(p), (n))
template <class T> static inline T __ldg(const T* p) { emu_check_align(p, alignof(T)); return *p; }
static inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
using std::max;
using std::min;
// A warp: 32 host threads in lock step at every shuffle (two barrier phases: publish,
// then read), each with the count of shuffles it has made in the current warp body;
// a lane that finishes its body publishes "exited" (-1).
struct EmuWarp { std::barrier<>* bar; unsigned vals[32]; long seq[32]; };
static thread_local EmuWarp* emu_warp;
static thread_local long emu_calls;
static inline unsigned emu_shuffle(unsigned mask, unsigned v, unsigned src, bool bad_src) {
    if (emu_warp == nullptr) {  // a shuffle in a kernel not run as warps
        emu_error_count.fetch_add(1);
        return v;
    }
    const unsigned lane = threadIdx.x & 31u;
    if (mask != 0xFFFFFFFFu || bad_src) emu_error_count.fetch_add(1);
    const long call = ++emu_calls;
    emu_warp->vals[lane] = v;
    emu_warp->seq[lane] = call;
    emu_warp->bar->arrive_and_wait();
    for (int l = 0; l < 32; ++l)
        if (emu_warp->seq[l] != call) { emu_error_count.fetch_add(1); break; }
    const unsigned r = emu_warp->vals[src & 31u];
    emu_warp->bar->arrive_and_wait();
    return r;
}
static inline unsigned __shfl_sync(unsigned mask, unsigned v, int src) {  // src modulo 32, as CUDA
    return emu_shuffle(mask, v, (unsigned)src & 31u, false);
}
static inline unsigned __shfl_xor_sync(unsigned mask, unsigned v, int off) {
    return emu_shuffle(mask, v, (threadIdx.x & 31u) ^ (unsigned)off, off < 0 || off > 31);
}
// threaded: 32 threads run each warp in step (for kernels with warp shuffles); a thread
// that is done drops out of the barrier, so lanes out of step end instead of hanging.
// Otherwise the threads run one after another.
static void emu_run(unsigned grid, unsigned block, int threaded, const std::function<void()>& body) {
    blockDim = dim3{block, 1, 1};
    if (!threaded) {
        for (unsigned b = 0; b < grid; ++b)
            for (unsigned t = 0; t < block; ++t) { blockIdx = dim3{b, 0, 0}; threadIdx = dim3{t, 0, 0}; body(); }
        return;
    }
    if (block % 32) emu_error_count.fetch_add(1);
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
                    emu_calls = 0;
                    body();
                    warp.seq[l] = -1;
                    bar.arrive_and_wait();
                }
            bar.arrive_and_drop();
        });
    for (auto& t : lanes) t.join();
}
extern "C" unsigned emu_errors() { return emu_error_count.exchange(0); }
// controls for the checks above (not kernels of kvwire)
extern "C" __global__ void kv_emu_control_divergent(unsigned* out) {
    if (threadIdx.x % 32 == 5) return;  // one lane leaves before the shuffle
    out[threadIdx.x] = __shfl_xor_sync(0xFFFFFFFFu, threadIdx.x, 1);
}
extern "C" __global__ void kv_emu_control_misaligned(unsigned char* out) {
    KV_ASSERT_ALIGNED(out + 1 + 4 * threadIdx.x, 4);
    out[threadIdx.x] = (unsigned char)__ldg((const uint4*)(out + 8)).x;
}
extern "C" __global__ void kv_emu_control_shuffle(unsigned* out) {
    unsigned v = threadIdx.x;
    for (int off = 16; off > 0; off >>= 1) v = std::max(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
    out[threadIdx.x] = v + 1000 * __shfl_xor_sync(0xFFFFFFFFu, threadIdx.x, 3);
}
"""

def build_emulation(build: Path) -> Any:
    """The kernels and the shim compiled in ``build``: ``emu_<kernel>(grid, block,
    threaded, args...)`` for each kernel, and ``emu_errors()``."""
    if CXX is None:
        pytest.fail("no C++ compiler found to build the kernel emulation")
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


def as_reference(codec: Any) -> Any:
    """``codec`` typed for its numpy reference methods (encode_numpy / decode_numpy, which
    every quantizing codec has and the Codec base does not declare)."""
    return codec


def tricky_values(dtype: str, shape: tuple[int, int, int], seed: int) -> np.ndarray[Any, Any]:
    """Values of ``dtype`` in ``shape`` (at least 6 tokens) with what a kernel gets wrong
    first: magnitudes over a wide range, subnormal tokens and lanes, +0.0 and -0.0."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-6, 4, (shape[0], shape[1], 1)))
    tiny = {"float16": 2.0**-20, "bfloat16": 2.0**-133, "float32": 2.0**-140}[dtype]
    x[1] *= tiny
    x[2, :, ::2] *= tiny
    x[3] = 0.0
    x[4] = -0.0
    x[5, :, 1::2] = -0.0
    return x.astype(numpy_dtype(dtype))


def value_bits(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``x`` compared bit for bit (16-bit floats as their uint16 patterns)."""
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x
