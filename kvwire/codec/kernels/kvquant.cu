// Quantize / dequantize kernels for fp8, int8 and int4 (layouts in docs/codecs.md).
// Loaded by kvwire/codec/gpu.py through cupy.RawModule; the arithmetic lives in
// kvquant.cuh so that a host build of the same functions can be checked against numpy.
#include "kvquant.cuh"

struct In16F { static __device__ float load(const kv_u16* p, long i) { return kv_f16_to_f32(p[i]); } };
struct In16B { static __device__ float load(const kv_u16* p, long i) { return kv_bf16_to_f32(p[i]); } };
struct In32 { static __device__ float load(const float* p, long i) { return p[i]; } };
struct Out16F { static __device__ void store(kv_u16* p, long i, float v) { p[i] = kv_f32_to_f16(v); } };
struct Out16B { static __device__ void store(kv_u16* p, long i, float v) { p[i] = kv_f32_to_bf16(v); } };
struct Out32 { static __device__ void store(float* p, long i, float v) { p[i] = v; } };

__device__ __forceinline__ float kv_abs(float x) { return kv_bits_f32(kv_f32_bits(x) & 0x7FFFFFFFu); }

// One warp per (token, head) row.  The maximum is exact, so the reduction order is free.
template <class L, class T, int FP8>
__device__ void rowwise_encode(const T* x, long rows, int dim, float* scales, kv_u8* codes) {
    long row = ((long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (row >= rows) return;
    const long base = row * dim;
    float amax = 0.0f;
    for (int d = lane; d < dim; d += 32) {
        float a = kv_abs(L::load(x, base + d));
        amax = a > amax ? a : amax;
    }
    for (int off = 16; off > 0; off >>= 1) {
        float o = __shfl_xor_sync(0xFFFFFFFFu, amax, off);
        amax = o > amax ? o : amax;
    }
    float s = FP8 ? kv_fp8_scale(amax) : kv_int8_scale(amax);
    if (lane == 0) scales[row] = s;
    for (int d = lane; d < dim; d += 32) {
        float v = L::load(x, base + d);
        codes[base + d] = FP8 ? kv_fp8_quant(v, s) : (kv_u8)kv_int8_quant(v, s);
    }
}

template <class S, class T, int FP8>
__device__ void rowwise_decode(const kv_u8* codes, const float* scales, long n, int dim, T* out) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = scales[i / dim];
    float v = FP8 ? kv_fp8_dequant(codes[i], s) : kv_int8_dequant((signed char)codes[i], s);
    S::store(out, i, v);
}

// int4 groups: K -> one thread per (token block, head*channel); V -> per (token, head, run).
template <class L, class T>
__device__ void int4_encode(const T* x, int tokens, int heads, int dim, int group, int is_v,
                            float* scales, float* mins, kv_u8* codes) {
    long g = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long hd = (long)heads * dim;
    long count, stride, first;
    if (!is_v) {
        long blocks = (tokens + group - 1) / group;
        if (g >= blocks * hd) return;
        long b = g / hd, c = g % hd;
        first = b * group * hd + c;
        stride = hd;
        count = tokens - b * group < group ? tokens - b * group : group;
    } else {
        long runs = (dim + group - 1) / group;
        if (g >= (long)tokens * heads * runs) return;
        long th = g / runs, r = g % runs;
        first = th * dim + r * group;
        stride = 1;
        count = dim - r * group < group ? dim - r * group : group;
    }
    float lo = L::load(x, first), hi = lo;
    for (long k = 1; k < count; ++k) {
        float v = L::load(x, first + k * stride);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    float s = kv_int4_scale(lo, hi);
    scales[g] = s;
    mins[g] = lo;
    for (long k = 0; k < count; ++k) codes[first + k * stride] = kv_int4_quant(L::load(x, first + k * stride), lo, s);
}

template <class S, class T>
__device__ void int4_decode(const kv_u8* packed, const float* scales, const float* mins,
                            int tokens, int heads, int dim, int group, int is_v, T* out) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    long hd = (long)heads * dim;
    if (i >= (long)tokens * hd) return;
    kv_u8 c = (i & 1) ? (packed[i >> 1] >> 4) : (packed[i >> 1] & 15u);
    long g;
    if (!is_v) {
        g = (i / hd / group) * hd + i % hd;
    } else {
        long runs = (dim + group - 1) / group;
        g = (i / dim) * runs + (i % dim) / group;
    }
    S::store(out, i, kv_int4_dequant(c, mins[g], scales[g]));
}

extern "C" __global__ void kv_int4_pack(const kv_u8* codes, long n, kv_u8* packed) {
    long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (2 * i >= n) return;
    kv_u8 hi = (2 * i + 1 < n) ? codes[2 * i + 1] : 0;
    packed[i] = (kv_u8)(codes[2 * i] | (hi << 4));
}

#define KV_INSTANTIATE(SUFFIX, LOADER, STORER, T)                                              \
    extern "C" __global__ void kv_fp8_encode_##SUFFIX(const T* x, long rows, int dim,          \
                                                      float* scales, kv_u8* codes) {           \
        rowwise_encode<LOADER, T, 1>(x, rows, dim, scales, codes);                             \
    }                                                                                          \
    extern "C" __global__ void kv_int8_encode_##SUFFIX(const T* x, long rows, int dim,         \
                                                       float* scales, kv_u8* codes) {          \
        rowwise_encode<LOADER, T, 0>(x, rows, dim, scales, codes);                             \
    }                                                                                          \
    extern "C" __global__ void kv_fp8_decode_##SUFFIX(const kv_u8* codes, const float* scales, \
                                                      long n, int dim, T* out) {               \
        rowwise_decode<STORER, T, 1>(codes, scales, n, dim, out);                              \
    }                                                                                          \
    extern "C" __global__ void kv_int8_decode_##SUFFIX(const kv_u8* codes, const float* scales,\
                                                       long n, int dim, T* out) {              \
        rowwise_decode<STORER, T, 0>(codes, scales, n, dim, out);                              \
    }                                                                                          \
    extern "C" __global__ void kv_int4_encode_##SUFFIX(const T* x, int tokens, int heads,      \
            int dim, int group, int is_v, float* scales, float* mins, kv_u8* codes) {          \
        int4_encode<LOADER, T>(x, tokens, heads, dim, group, is_v, scales, mins, codes);       \
    }                                                                                          \
    extern "C" __global__ void kv_int4_decode_##SUFFIX(const kv_u8* packed, const float* scales,\
            const float* mins, int tokens, int heads, int dim, int group, int is_v, T* out) {  \
        int4_decode<STORER, T>(packed, scales, mins, tokens, heads, dim, group, is_v, out);    \
    }

KV_INSTANTIATE(f16, In16F, Out16F, kv_u16)
KV_INSTANTIATE(bf16, In16B, Out16B, kv_u16)
KV_INSTANTIATE(f32, In32, Out32, float)
