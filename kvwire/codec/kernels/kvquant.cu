// Quantize / dequantize kernels for fp8, int8 and int4 (layouts in docs/codecs.md).
// Loaded by kvwire/codec/gpu.py through cupy.RawModule (the header is inlined into the
// source string, so CuPy's cache key covers both files); the element arithmetic lives in
// kvquant.cuh so that a host build of the same functions gives the same bits.
//
// Encoding runs over a whole [tokens, heads, head_dim] tensor in one launch and writes the
// payload of every chunk of a chunk plan (chunks of `chunk_tokens` tokens, the last one
// shorter; chunk c's payload starts at c * chunk_bytes); only int4 in geometries the vector
// kernels do not take needs two.  Decoding runs per chunk, straight
// into the destination.  Problems found on the device set bits in *flags (KV_FLAG_*); the
// caller turns them into the same errors as the numpy codecs.
//
// Inputs and outputs are bit patterns: kv_u16 for float16/bfloat16 (DT 0/1), kv_u32 for
// float32 (DT 2).
#include "kvquant.cuh"

typedef long long kv_i64;

// A vector access needs its natural alignment on the device (a misaligned one faults);
// the CPU emulation of the kernels defines this to check it.
#ifndef KV_ASSERT_ALIGNED
#define KV_ASSERT_ALIGNED(p, n) ((void)0)
#endif

#define KV_FLAG_NONFINITE 1u  // encode: NaN or infinity in the input
#define KV_FLAG_RANGE 2u      // encode (int4): a group's range overflows float32
#define KV_FLAG_BADCODE 4u    // decode: fp8 NaN code or int8 -128
#define KV_FLAG_OVERFLOW 8u   // decode: a value overflows float32
#define KV_FLAG_OUTSIDE 16u   // decode: a value does not fit the output dtype

__device__ __forceinline__ kv_u32 kv_umax(kv_u32 a, kv_u32 b) { return a > b ? a : b; }
__device__ __forceinline__ kv_u32 kv_umin(kv_u32 a, kv_u32 b) { return a < b ? a : b; }

template <int DT> __device__ __forceinline__ float kv_widen(kv_u32 b) {
    return DT == 0 ? kv_f16_to_f32((kv_u16)b) : (DT == 1 ? kv_bf16_to_f32((kv_u16)b) : kv_bits_f32(b));
}
template <int DT> __device__ __forceinline__ kv_u32 kv_narrow(float v) {
    return DT == 0 ? (kv_u32)kv_f32_to_f16(v) : (DT == 1 ? (kv_u32)kv_f32_to_bf16(v) : kv_f32_bits(v));
}
template <int DT> __device__ __forceinline__ kv_u32 kv_mag(kv_u32 b) {
    return DT == 2 ? (b & 0x7FFFFFFFu) : (b & 0x7FFFu);
}
// smallest magnitude bit pattern that is not finite
template <int DT> __device__ __forceinline__ kv_u32 kv_nonfinite() {
    return DT == 0 ? 0x7C00u : (DT == 1 ? 0x7F80u : 0x7F800000u);
}
// float32 magnitude bits from which narrowing to the dtype would give infinity
template <int DT> __device__ __forceinline__ kv_u32 kv_outside() {
    return DT == 0 ? 0x477FF000u : (DT == 1 ? 0x7F7F8000u : 0x7F800000u);
}
template <int DT> __device__ __forceinline__ kv_u32 kv_load(const void* p, kv_i64 i) {
    return DT == 2 ? ((const kv_u32*)p)[i] : (kv_u32)((const kv_u16*)p)[i];
}
template <int DT> __device__ __forceinline__ void kv_store(void* p, kv_i64 i, kv_u32 b) {
    if (DT == 2) ((kv_u32*)p)[i] = b;
    else ((kv_u16*)p)[i] = (kv_u16)b;
}
// element j of a 16-byte vector (8 halves or 4 floats)
template <int DT> __device__ __forceinline__ kv_u32 kv_elem(const uint4& v, int j) {
    const kv_u32 w[4] = {v.x, v.y, v.z, v.w};
    return DT == 2 ? w[j] : ((j & 1) ? (w[j >> 1] >> 16) : (w[j >> 1] & 0xFFFFu));
}
__device__ __forceinline__ void kv_store_f32_any(kv_u8* p, float f) {
    kv_u32 b = kv_f32_bits(f);
    if (((unsigned long long)p & 3u) == 0) {
        *(kv_u32*)p = b;
    } else {
        p[0] = (kv_u8)b; p[1] = (kv_u8)(b >> 8); p[2] = (kv_u8)(b >> 16); p[3] = (kv_u8)(b >> 24);
    }
}
__device__ __forceinline__ float kv_load_f32_any(const kv_u8* p) {
    if (((unsigned long long)p & 3u) == 0) return *(const float*)p;
    return kv_bits_f32((kv_u32)p[0] | ((kv_u32)p[1] << 8) | ((kv_u32)p[2] << 16) | ((kv_u32)p[3] << 24));
}
template <int FP8> __device__ __forceinline__ kv_u8 kv_row_code(float v, float s) {
    return FP8 ? kv_fp8_quant(v, s) : (kv_u8)kv_int8_quant(v, s);
}
// Where a row's scale and codes go in the chunk payloads.
struct KvRowPlace {
    kv_u8* scale;
    kv_u8* codes;
};
__device__ __forceinline__ KvRowPlace kv_row_place(kv_i64 row, int heads, int dim, kv_i64 tokens,
                                                   int chunk_tokens, kv_i64 chunk_bytes, kv_u8* out) {
    kv_i64 t = row / heads;
    kv_i64 c = t / chunk_tokens;
    kv_i64 t0 = c * chunk_tokens;
    kv_i64 cnt = tokens - t0 < chunk_tokens ? tokens - t0 : chunk_tokens;
    kv_i64 rr = row - t0 * heads;
    kv_u8* base = out + c * chunk_bytes;
    KvRowPlace p;
    p.scale = base + 4 * rr;
    p.codes = base + 4 * cnt * heads + rr * dim;
    return p;
}

// fp8 / int8 encode, fast path: LPR lanes per row, each holding VPL 16-byte vectors in
// registers (one read of the input); the row maximum is taken on magnitude bits (exact,
// order-free, no float compare).  Needs head_dim*itemsize % 16 == 0, a 16-byte aligned
// input, 4-byte aligned chunk payloads and 8-byte (16-bit input) / 4-byte (float32)
// aligned code rows: gpu.py checks this and otherwise uses rowwise_encode_any.
template <int DT, int FP8, int LPR, int VPL>
__device__ void rowwise_encode_vec(const uint4* x, kv_i64 tokens, int heads, int dim,
                                   int chunk_tokens, kv_i64 chunk_bytes, kv_u8* out, unsigned* flags) {
    constexpr int EPV = DT == 2 ? 4 : 8;
    const int nvec = dim / EPV;
    const kv_i64 rows = tokens * heads;
    const kv_i64 row = ((kv_i64)blockIdx.x * blockDim.x + threadIdx.x) / LPR;
    const int lane = threadIdx.x & (LPR - 1);
    const bool active = row < rows;
    uint4 v[VPL];
    kv_u32 amax = 0;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
        const int vi = lane + j * LPR;
        if (active && vi < nvec) {
            v[j] = __ldg(x + row * nvec + vi);
#pragma unroll
            for (int e = 0; e < EPV; ++e) amax = kv_umax(amax, kv_mag<DT>(kv_elem<DT>(v[j], e)));
        } else {
            v[j] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
#pragma unroll
    for (int off = LPR / 2; off > 0; off >>= 1) amax = kv_umax(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    if (!active) return;
    const float s = FP8 ? kv_fp8_scale(kv_widen<DT>(amax)) : kv_int8_scale(kv_widen<DT>(amax));
    const KvRowPlace place = kv_row_place(row, heads, dim, tokens, chunk_tokens, chunk_bytes, out);
    if (lane == 0) {
        KV_ASSERT_ALIGNED(place.scale, 4);
        *(float*)place.scale = s;
        if (amax >= kv_nonfinite<DT>()) atomicOr(flags, KV_FLAG_NONFINITE);
    }
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
        const int vi = lane + j * LPR;
        if (vi < nvec) {
            kv_u32 lo = 0, hi = 0;
#pragma unroll
            for (int e = 0; e < EPV; ++e) {
                const kv_u32 code = kv_row_code<FP8>(kv_widen<DT>(kv_elem<DT>(v[j], e)), s);
                if (e < 4) lo |= code << (8 * e);
                else hi |= code << (8 * (e - 4));
            }
            KV_ASSERT_ALIGNED(place.codes + vi * EPV, EPV);
            if (EPV == 8) *(uint2*)(place.codes + vi * 8) = make_uint2(lo, hi);
            else *(kv_u32*)(place.codes + vi * 4) = lo;
        }
    }
}

// fp8 / int8 encode, any shape and alignment: one warp per row, two reads of the row.
template <int DT, int FP8>
__device__ void rowwise_encode_any(const void* x, kv_i64 tokens, int heads, int dim,
                                   int chunk_tokens, kv_i64 chunk_bytes, kv_u8* out, unsigned* flags) {
    const kv_i64 rows = tokens * heads;
    const kv_i64 row = ((kv_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    const bool active = row < rows;
    kv_u32 amax = 0;
    // d unsigned: for a head_dim past 2^31 - 32 an int d + 32 would overflow; below 2^32 it cannot
    if (active)
        for (unsigned d = lane; d < (unsigned)dim; d += 32) amax = kv_umax(amax, kv_mag<DT>(kv_load<DT>(x, row * dim + d)));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = kv_umax(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    if (!active) return;
    const float s = FP8 ? kv_fp8_scale(kv_widen<DT>(amax)) : kv_int8_scale(kv_widen<DT>(amax));
    const KvRowPlace place = kv_row_place(row, heads, dim, tokens, chunk_tokens, chunk_bytes, out);
    if (lane == 0) {
        kv_store_f32_any(place.scale, s);
        if (amax >= kv_nonfinite<DT>()) atomicOr(flags, KV_FLAG_NONFINITE);
    }
    for (unsigned d = lane; d < (unsigned)dim; d += 32)
        place.codes[d] = kv_row_code<FP8>(kv_widen<DT>(kv_load<DT>(x, row * dim + d)), s);
}

template <int DT, int FP8> __device__ __forceinline__ float kv_row_value(kv_u32 code, float s, unsigned& bad) {
    if (FP8) {
        if ((code & 0x7Fu) == 0x7Fu) bad |= KV_FLAG_BADCODE;
        return kv_fp8_dequant((kv_u8)code, s);
    }
    if (code == 0x80u) bad |= KV_FLAG_BADCODE;
    return kv_int8_dequant((signed char)(kv_u8)code, s);
}
template <int DT> __device__ __forceinline__ void kv_check_value(float v, unsigned& bad) {
    const kv_u32 m = kv_f32_bits(v) & 0x7FFFFFFFu;
    if (m >= 0x7F800000u) bad |= KV_FLAG_OVERFLOW;
    else if (m >= kv_outside<DT>()) bad |= KV_FLAG_OUTSIDE;
}

// fp8 / int8 decode of one chunk payload (scales, then codes), fast path: one thread per
// 16 bytes of output.  Needs head_dim*itemsize % 16 == 0, a 16-byte aligned destination
// and 8-byte (16-bit) / 4-byte (float32) aligned codes; rows * head_dim < 2^31.
template <int DT, int FP8>
__device__ void rowwise_decode_vec(const kv_u8* payload, unsigned rows, unsigned dim, uint4* out, unsigned* flags) {
    constexpr unsigned EPV = DT == 2 ? 4 : 8;
    const unsigned nvec = dim / EPV;
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * nvec) return;
    const unsigned row = i / nvec;
    KV_ASSERT_ALIGNED(payload, 4);
    const float s = ((const float*)payload)[row];
    const kv_u8* codes = payload + 4ull * rows + (unsigned long long)i * EPV;
    KV_ASSERT_ALIGNED(codes, EPV);
    kv_u32 c[2];
    if (EPV == 8) {
        const uint2 w = *(const uint2*)codes;
        c[0] = w.x; c[1] = w.y;
    } else {
        c[0] = *(const kv_u32*)codes; c[1] = 0;
    }
    unsigned bad = 0;
    kv_u32 o[4];
#pragma unroll
    for (unsigned e = 0; e < EPV; ++e) {
        const float v = kv_row_value<DT, FP8>((c[e >> 2] >> (8 * (e & 3))) & 0xFFu, s, bad);
        kv_check_value<DT>(v, bad);
        const kv_u32 b = kv_narrow<DT>(v);
        if (DT == 2) o[e] = b;
        else if (e & 1) o[e >> 1] |= b << 16;
        else o[e >> 1] = b;
    }
    KV_ASSERT_ALIGNED(out + i, 16);
    out[i] = make_uint4(o[0], o[1], o[2], o[3]);
    if (bad) atomicOr(flags, bad);
}

// fp8 / int8 decode, any shape: one thread per element.
template <int DT, int FP8>
__device__ void rowwise_decode_any(const kv_u8* payload, kv_i64 rows, int dim, void* out, unsigned* flags) {
    const kv_i64 i = (kv_i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * dim) return;
    const float s = kv_load_f32_any(payload + 4 * (i / dim));
    unsigned bad = 0;
    const float v = kv_row_value<DT, FP8>(payload[4 * rows + i], s, bad);
    kv_check_value<DT>(v, bad);
    kv_store<DT>(out, i, kv_narrow<DT>(v));
    if (bad) atomicOr(flags, bad);
}

// int4 group geometry inside one chunk of `cnt` tokens.  K: group gg = (block, column)
// over `group` tokens; V: group gg = (token, head, run) over `group` channels.
struct KvGroup {
    kv_i64 first;   // element index of the group's first element, chunk-relative
    kv_i64 stride;  // between its elements
    int count;      // its elements
};
__device__ __forceinline__ KvGroup kv_int4_group(kv_i64 gg, kv_i64 cnt, int heads, int dim, int group, int is_v) {
    const kv_i64 hd = (kv_i64)heads * dim;
    KvGroup g;
    if (!is_v) {
        const kv_i64 b = gg / hd, col = gg - b * hd;
        g.first = b * group * hd + col;
        g.stride = hd;
        g.count = (int)(cnt - b * group < group ? cnt - b * group : group);
    } else {
        const int runs = (dim - 1) / group + 1;
        const kv_i64 row = gg / runs;
        const int r = (int)(gg - row * runs);
        g.first = row * dim + (kv_i64)r * group;
        g.stride = 1;
        g.count = dim - r * group < group ? dim - r * group : group;
    }
    return g;
}
__device__ __forceinline__ kv_i64 kv_int4_groups(kv_i64 cnt, int heads, int dim, int group, int is_v) {
    if (!is_v) return (cnt + group - 1) / group * heads * dim;
    return cnt * heads * ((dim - 1) / group + 1);
}
// chunk-relative group of chunk-relative element e
__device__ __forceinline__ kv_i64 kv_int4_group_of(kv_i64 e, int heads, int dim, int group, int is_v) {
    const kv_i64 hd = (kv_i64)heads * dim;
    const kv_i64 t = e / hd, col = e - t * hd;
    if (!is_v) return (t / group) * hd + col;
    const int runs = (dim - 1) / group + 1;
    const kv_i64 h = col / dim;
    const int d = (int)(col - h * dim);
    return (t * heads + h) * runs + d / group;
}

// int4 encode of the geometries the vector kernels below do not take (odd head_dim, value
// groups that are not a power-of-two number of 16-byte vectors, an unaligned input), in
// two launches.  Step 1: one thread per group of the whole tensor: minimum and maximum on
// order keys (exact, -0 and +0 then made canonical +0), the NaN/inf check, scale and
// minimum into the chunk payload and into stats[2*g], stats[2*g+1] for step 2.
template <int DT>
__device__ void int4_stats(const void* x, kv_i64 tokens, int heads, int dim, int group, int is_v,
                           int chunk_tokens, kv_i64 chunk_bytes, kv_i64 total_groups, kv_u8* out,
                           float* stats, unsigned* flags) {
    const kv_i64 g = (kv_i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= total_groups) return;
    const kv_i64 full = kv_int4_groups(chunk_tokens, heads, dim, group, is_v);
    const kv_i64 c = g / full, gg = g - c * full;
    const kv_i64 t0 = c * chunk_tokens;
    const kv_i64 cnt = tokens - t0 < chunk_tokens ? tokens - t0 : chunk_tokens;
    const KvGroup grp = kv_int4_group(gg, cnt, heads, dim, group, is_v);
    const kv_i64 base = t0 * heads * dim + grp.first;
    kv_u32 lo = 0xFFFFFFFFu, hi = 0, amax = 0;
    for (int k = 0; k < grp.count; ++k) {
        const kv_u32 b = kv_load<DT>(x, base + k * grp.stride);
        amax = kv_umax(amax, kv_mag<DT>(b));
        const kv_u32 key = kv_order_key(kv_widen<DT>(b));
        lo = kv_umin(lo, key);
        hi = kv_umax(hi, key);
    }
    const float flo = kv_canonical_zero(kv_from_order_key(lo));
    const float fhi = kv_canonical_zero(kv_from_order_key(hi));
    const float s = kv_int4_scale(flo, fhi);
    unsigned bad = amax >= kv_nonfinite<DT>() ? KV_FLAG_NONFINITE : 0u;
    if ((kv_f32_bits(s) & 0x7FFFFFFFu) >= 0x7F800000u) bad |= KV_FLAG_RANGE;
    if (bad) atomicOr(flags, bad);
    const kv_i64 groups_c = kv_int4_groups(cnt, heads, dim, group, is_v);
    kv_u8* p = out + c * chunk_bytes;
    kv_store_f32_any(p + 4 * gg, s);
    kv_store_f32_any(p + 4 * (groups_c + gg), flo);
    stats[2 * g] = s;
    stats[2 * g + 1] = flo;
}

// int4 encode, step 2: one thread per payload byte (two elements), codes packed in place.
template <int DT>
__device__ void int4_pack(const void* x, kv_i64 tokens, int heads, int dim, int group, int is_v,
                          int chunk_tokens, kv_i64 chunk_bytes, kv_i64 total_bytes, const float* stats,
                          kv_u8* out) {
    const kv_i64 p = (kv_i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= total_bytes) return;
    const kv_i64 hd = (kv_i64)heads * dim;
    const kv_i64 full_bytes = ((kv_i64)chunk_tokens * hd + 1) / 2;
    const kv_i64 c = p / full_bytes, pb = p - c * full_bytes;
    const kv_i64 t0 = c * chunk_tokens;
    const kv_i64 cnt = tokens - t0 < chunk_tokens ? tokens - t0 : chunk_tokens;
    const kv_i64 n = cnt * hd;
    const kv_i64 groups_full = kv_int4_groups(chunk_tokens, heads, dim, group, is_v);
    const kv_i64 groups_c = kv_int4_groups(cnt, heads, dim, group, is_v);
    kv_u32 byte = 0;
    for (int k = 0; k < 2; ++k) {
        const kv_i64 e = 2 * pb + k;
        if (e >= n) break;
        const kv_i64 g = c * groups_full + kv_int4_group_of(e, heads, dim, group, is_v);
        const float v = kv_widen<DT>(kv_load<DT>(x, t0 * hd + e));
        byte |= (kv_u32)kv_int4_quant(v, stats[2 * g + 1], stats[2 * g]) << (4 * k);
    }
    out[c * chunk_bytes + 8 * groups_c + pb] = (kv_u8)byte;
}

// int4 decode of one chunk payload: one thread per payload byte.
template <int DT>
__device__ void int4_decode(const kv_u8* payload, kv_i64 tokens, int heads, int dim, int group, int is_v,
                            void* out, unsigned* flags) {
    const kv_i64 p = (kv_i64)blockIdx.x * blockDim.x + threadIdx.x;
    const kv_i64 n = tokens * heads * dim;
    if (2 * p >= n) return;
    const kv_i64 groups = kv_int4_groups(tokens, heads, dim, group, is_v);
    const kv_u32 byte = payload[8 * groups + p];
    unsigned bad = 0;
    for (int k = 0; k < 2; ++k) {
        const kv_i64 e = 2 * p + k;
        if (e >= n) break;
        const kv_i64 g = kv_int4_group_of(e, heads, dim, group, is_v);
        const float s = kv_load_f32_any(payload + 4 * g);
        const float lo = kv_load_f32_any(payload + 4 * (groups + g));
        const float v = kv_int4_dequant((kv_u8)((byte >> (4 * k)) & 15u), lo, s);
        kv_check_value<DT>(v, bad);
        kv_store<DT>(out, e, kv_narrow<DT>(v));
    }
    if (bad) atomicOr(flags, bad);
}

// int4 encode, values (groups of `group` channels inside each (token, head) row), fast
// path: LPR lanes per row, each holding VPL 16-byte vectors in registers (one read of the
// input).  A group is `gv` whole vectors (a group that covers the row counts as LPR * VPL
// vectors, lanes past the row holding the identity); gv a power of two, or any gv with
// one vector per lane (the plan checks it).  Minimum and maximum on order keys, first over
// a lane's slots of the same group, then over its lanes with warp shuffles; -0/+0 made
// canonical +0.  The first lane of a group writes its scale and minimum, every lane packs
// its codes (8 codes: 4 bytes, float32: 4 codes, 2 bytes).  Needs head_dim*itemsize % 16
// == 0 and a 16-byte aligned input.
template <int DT, int LPR, int VPL>
__device__ void int4_encode_v_vec(const uint4* x, kv_i64 tokens, int heads, int dim, int group,
                                  int chunk_tokens, kv_i64 chunk_bytes, kv_u8* out, unsigned* flags) {
    constexpr int EPV = DT == 2 ? 4 : 8;
    const int nvec = dim / EPV;
    const kv_i64 rows = tokens * heads;
    const kv_i64 row = ((kv_i64)blockIdx.x * blockDim.x + threadIdx.x) / LPR;
    const int lane = threadIdx.x & (LPR - 1);
    const bool active = row < rows;
    const bool whole = group >= dim;  // one group per row
    const int gv = whole ? LPR * VPL : group / EPV;
    uint4 v[VPL];
    kv_u32 lo[VPL], hi[VPL];
    kv_u32 amax = 0;
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
        const int vi = lane + j * LPR;
        lo[j] = 0xFFFFFFFFu;
        hi[j] = 0u;
        if (active && vi < nvec) {
            v[j] = __ldg(x + row * nvec + vi);
#pragma unroll
            for (int e = 0; e < EPV; ++e) {
                const kv_u32 b = kv_elem<DT>(v[j], e);
                amax = kv_umax(amax, kv_mag<DT>(b));
                const kv_u32 key = kv_order_key(kv_widen<DT>(b));
                lo[j] = kv_umin(lo[j], key);
                hi[j] = kv_umax(hi[j], key);
            }
        } else {
            v[j] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
    // a group wider than the lanes spans gv / LPR consecutive slots of every lane
#pragma unroll
    for (int span = 1; span < VPL; span <<= 1) {
        if (span * LPR < gv) {
#pragma unroll
            for (int j = 0; j < VPL; ++j) {
                if ((j & span) == 0) {
                    const kv_u32 l = kv_umin(lo[j], lo[j | span]), h = kv_umax(hi[j], hi[j | span]);
                    lo[j] = lo[j | span] = l;
                    hi[j] = hi[j | span] = h;
                }
            }
        }
    }
    if ((gv & (gv - 1)) == 0) {
        const int width = gv < LPR ? gv : LPR;  // lanes a group spans (a power of two)
        for (int off = width >> 1; off > 0; off >>= 1) {
#pragma unroll
            for (int j = 0; j < VPL; ++j) {
                lo[j] = kv_umin(lo[j], __shfl_xor_sync(0xFFFFFFFFu, lo[j], off));
                hi[j] = kv_umax(hi[j], __shfl_xor_sync(0xFFFFFFFFu, hi[j], off));
            }
        }
    } else {
        // any other number of vectors per group (VPL is 1 here: the plan checks it): every
        // lane reads its group's gv lanes one by one, within its row's LPR lanes
        const int base = (int)(threadIdx.x & 31) - lane;
        const int first = base + lane / gv * gv, last = base + LPR - 1;
        kv_u32 l = lo[0], h = hi[0];
        for (int k = 0; k < gv; ++k) {
            const int src = first + k < last ? first + k : last;
            const kv_u32 ol = __shfl_sync(0xFFFFFFFFu, lo[0], src);
            const kv_u32 oh = __shfl_sync(0xFFFFFFFFu, hi[0], src);
            if (first + k <= last) {
                l = kv_umin(l, ol);
                h = kv_umax(h, oh);
            }
        }
        lo[0] = l;
        hi[0] = h;
    }
    if (!active) return;
    if (amax >= kv_nonfinite<DT>()) atomicOr(flags, KV_FLAG_NONFINITE);
    const kv_i64 t = row / heads;
    const kv_i64 c = t / chunk_tokens;
    const kv_i64 t0 = c * chunk_tokens;
    const kv_i64 cnt = tokens - t0 < chunk_tokens ? tokens - t0 : chunk_tokens;
    const kv_i64 rr = row - t0 * heads;
    const int runs = whole ? 1 : (dim - 1) / group + 1;
    const kv_i64 groups_c = cnt * heads * runs;
    kv_u8* base = out + c * chunk_bytes;
    kv_u8* codes = base + 8 * groups_c + rr * (dim / 2);
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
        const int vi = lane + j * LPR;
        if (vi < nvec) {
            const float flo = kv_canonical_zero(kv_from_order_key(lo[j]));
            const float fhi = kv_canonical_zero(kv_from_order_key(hi[j]));
            const float s = kv_int4_scale(flo, fhi);
            const int r = whole ? 0 : vi / gv;
            if (vi == r * gv) {  // the group's first vector
                const kv_i64 gg = rr * runs + r;
                kv_store_f32_any(base + 4 * gg, s);
                kv_store_f32_any(base + 4 * (groups_c + gg), flo);
                if ((kv_f32_bits(s) & 0x7FFFFFFFu) >= 0x7F800000u) atomicOr(flags, KV_FLAG_RANGE);
            }
            kv_u32 packed = 0;
#pragma unroll
            for (int e = 0; e < EPV; ++e)
                packed |= (kv_u32)kv_int4_quant(kv_widen<DT>(kv_elem<DT>(v[j], e)), flo, s) << (4 * e);
            KV_ASSERT_ALIGNED(codes + vi * (EPV / 2), EPV / 2);
            if (EPV == 8) *(kv_u32*)(codes + vi * 4) = packed;
            else *(kv_u16*)(codes + vi * 2) = (kv_u16)packed;
        }
    }
}

// int4 encode, keys (groups of `group` tokens per channel), fast path: a warp per (token
// block of a chunk, CL = 32 / TL vectors of channels): lane = CL * tl + cl, where the TL
// token lanes tl take tokens tl, tl + TL, ... of the block (KPT vectors in registers: one
// read of the input) and cl is the channel vector; every token row of the warp is 16 * CL
// contiguous bytes (whole 32-byte sectors).  Per channel, minimum and maximum on order
// keys over the lane's tokens, then over the TL token lanes with warp shuffles; token lane
// 0 writes the scales and minimums, every lane packs the codes of its tokens.  Needs
// heads*head_dim*itemsize % 16 == 0, a 16-byte aligned input and group <= TL * KPT.
template <int DT, int TL, int KPT>
__device__ void int4_encode_k_vec(const uint4* x, kv_i64 tokens, int heads, int dim, int group,
                                  int chunk_tokens, kv_i64 chunk_bytes, kv_i64 total_blocks, kv_u8* out,
                                  unsigned* flags) {
    constexpr int EPV = DT == 2 ? 4 : 8;
    constexpr int CL = 32 / TL;
    const kv_i64 hd = (kv_i64)heads * dim;
    const int ncv = (int)(hd / EPV);
    const int slices = (ncv + CL - 1) / CL;
    const kv_i64 warp = ((kv_i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31, tl = lane / CL, cl = lane & (CL - 1);
    const kv_i64 gb = warp / slices;
    const int cv = (int)(warp - gb * slices) * CL + cl;
    const bool active = gb < total_blocks && cv < ncv;
    // token blocks of a full chunk, a 32-bit division (in 64 bits kv_int4_encode_k_vec_f32_4_2
    // took 56 registers instead of 48 on sm_90: 4 resident blocks of 256 threads, not 5).
    // In range: the plan clamps 1 <= chunk_tokens <= tokens, group <= TL * KPT <= 256, and
    // _plan_int4_vec (gpu.py) picks this kernel only under 2^31 elements with
    // heads * head_dim >= 4, so chunk_tokens < 2^29 and chunk_tokens + group fits in an
    // int; (chunk_tokens - 1) / group + 1 would not overflow even without that bound.
    const int blocks_full = (chunk_tokens - 1) / group + 1;
    const kv_i64 c = gb / blocks_full, b = gb - c * blocks_full;
    const kv_i64 t0 = c * chunk_tokens;
    const kv_i64 cnt = tokens - t0 < chunk_tokens ? tokens - t0 : chunk_tokens;
    const kv_i64 first = b * group;
    const int count = (int)(cnt - first < group ? cnt - first : group);
    uint4 v[KPT];
    kv_u32 lo[EPV], hi[EPV];
    kv_u32 amax = 0;
#pragma unroll
    for (int e = 0; e < EPV; ++e) {
        lo[e] = 0xFFFFFFFFu;
        hi[e] = 0u;
    }
#pragma unroll
    for (int j = 0; j < KPT; ++j) {
        const int k = tl + TL * j;
        if (active && k < count) {
            v[j] = __ldg(x + (t0 + first + k) * ncv + cv);
#pragma unroll
            for (int e = 0; e < EPV; ++e) {
                const kv_u32 bits = kv_elem<DT>(v[j], e);
                amax = kv_umax(amax, kv_mag<DT>(bits));
                const kv_u32 key = kv_order_key(kv_widen<DT>(bits));
                lo[e] = kv_umin(lo[e], key);
                hi[e] = kv_umax(hi[e], key);
            }
        } else {
            v[j] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
#pragma unroll
    for (int off = CL; off < 32; off <<= 1) {
#pragma unroll
        for (int e = 0; e < EPV; ++e) {
            lo[e] = kv_umin(lo[e], __shfl_xor_sync(0xFFFFFFFFu, lo[e], off));
            hi[e] = kv_umax(hi[e], __shfl_xor_sync(0xFFFFFFFFu, hi[e], off));
        }
    }
    if (!active) return;
    if (amax >= kv_nonfinite<DT>()) atomicOr(flags, KV_FLAG_NONFINITE);
    const kv_i64 groups_c = (cnt + group - 1) / group * hd;
    kv_u8* base = out + c * chunk_bytes;
    const kv_i64 gg = b * hd + (kv_i64)cv * EPV;
    float flo[EPV], s[EPV];
    unsigned bad = 0;
#pragma unroll
    for (int e = 0; e < EPV; ++e) {
        flo[e] = kv_canonical_zero(kv_from_order_key(lo[e]));
        s[e] = kv_int4_scale(flo[e], kv_canonical_zero(kv_from_order_key(hi[e])));
        if (tl == 0) {
            kv_store_f32_any(base + 4 * (gg + e), s[e]);
            kv_store_f32_any(base + 4 * (groups_c + gg + e), flo[e]);
            if ((kv_f32_bits(s[e]) & 0x7FFFFFFFu) >= 0x7F800000u) bad = KV_FLAG_RANGE;
        }
    }
    if (bad) atomicOr(flags, bad);
    kv_u8* codes = base + 8 * groups_c + (first * hd + (kv_i64)cv * EPV) / 2;
#pragma unroll
    for (int j = 0; j < KPT; ++j) {
        const int k = tl + TL * j;
        if (k < count) {
            kv_u32 packed = 0;
#pragma unroll
            for (int e = 0; e < EPV; ++e)
                packed |= (kv_u32)kv_int4_quant(kv_widen<DT>(kv_elem<DT>(v[j], e)), flo[e], s[e]) << (4 * e);
            kv_u8* p = codes + (kv_i64)k * (hd / 2);
            KV_ASSERT_ALIGNED(p, EPV / 2);
            if (EPV == 8) *(kv_u32*)p = packed;
            else *(kv_u16*)p = (kv_u16)packed;
        }
    }
}

// int4 decode of one chunk payload, fast path: one thread per 16 bytes of output, 32-bit
// index arithmetic (one division per thread; a value run's group advances by counting).
// Needs head_dim*itemsize % 16 == 0, a 16-byte aligned destination, a 4-byte aligned
// payload and tokens*heads*head_dim < 2^31.
template <int DT>
__device__ void int4_decode_vec(const kv_u8* payload, unsigned tokens, unsigned heads, unsigned dim, unsigned group,
                                int is_v, uint4* out, unsigned* flags) {
    constexpr unsigned EPV = DT == 2 ? 4 : 8;
    const unsigned hd = heads * dim;
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tokens * (hd / EPV)) return;
    const unsigned runs = (dim - 1) / group + 1;
    const unsigned groups = is_v ? tokens * heads * runs : (tokens + group - 1) / group * hd;
    const float* scales = (const float*)payload;
    const float* mins = scales + groups;
    const kv_u8* cp = payload + 8ull * groups + (unsigned long long)i * (EPV / 2);
    KV_ASSERT_ALIGNED(payload, 4);
    KV_ASSERT_ALIGNED(cp, EPV / 2);
    const kv_u32 packed = EPV == 8 ? *(const kv_u32*)cp : (kv_u32)*(const kv_u16*)cp;
    unsigned g, q = 0, rem = 0;
    if (!is_v) {
        const unsigned t = i / (hd / EPV);
        g = t / group * hd + (i - t * (hd / EPV)) * EPV;
    } else {
        const unsigned row = i / (dim / EPV);
        const unsigned d = (i - row * (dim / EPV)) * EPV;
        q = d / group;
        rem = d - q * group;
        g = row * runs;
    }
    unsigned bad = 0;
    kv_u32 o[4];
#pragma unroll
    for (unsigned e = 0; e < EPV; ++e) {
        const unsigned ge = is_v ? g + q : g + e;
        const float v = kv_int4_dequant((kv_u8)((packed >> (4 * e)) & 15u), mins[ge], scales[ge]);
        kv_check_value<DT>(v, bad);
        const kv_u32 bits = kv_narrow<DT>(v);
        if (DT == 2) o[e] = bits;
        else if (e & 1) o[e >> 1] |= bits << 16;
        else o[e >> 1] = bits;
        if (++rem == group) {
            rem = 0;
            ++q;
        }
    }
    KV_ASSERT_ALIGNED(out + i, 16);
    out[i] = make_uint4(o[0], o[1], o[2], o[3]);
    if (bad) atomicOr(flags, bad);
}

#define KV_ROWWISE_VEC(SUF, DT, FP8, NAME, LPR, VPL)                                                   \
    extern "C" __global__ void kv_##NAME##_encode_vec_##SUF##_##LPR##_##VPL(                           \
        const uint4* x, kv_i64 tokens, int heads, int dim, int chunk_tokens, kv_i64 chunk_bytes,       \
        kv_u8* out, unsigned* flags) {                                                                 \
        rowwise_encode_vec<DT, FP8, LPR, VPL>(x, tokens, heads, dim, chunk_tokens, chunk_bytes, out, flags); \
    }

#define KV_ROWWISE(SUF, DT, FP8, NAME)                                                                 \
    KV_ROWWISE_VEC(SUF, DT, FP8, NAME, 16, 1)                                                          \
    KV_ROWWISE_VEC(SUF, DT, FP8, NAME, 32, 1)                                                          \
    KV_ROWWISE_VEC(SUF, DT, FP8, NAME, 32, 2)                                                          \
    KV_ROWWISE_VEC(SUF, DT, FP8, NAME, 32, 4)                                                          \
    extern "C" __global__ void kv_##NAME##_encode_any_##SUF(                                           \
        const void* x, kv_i64 tokens, int heads, int dim, int chunk_tokens, kv_i64 chunk_bytes,        \
        kv_u8* out, unsigned* flags) {                                                                 \
        rowwise_encode_any<DT, FP8>(x, tokens, heads, dim, chunk_tokens, chunk_bytes, out, flags);     \
    }                                                                                                  \
    extern "C" __global__ void kv_##NAME##_decode_vec_##SUF(                                           \
        const kv_u8* payload, unsigned rows, unsigned dim, uint4* out, unsigned* flags) {              \
        rowwise_decode_vec<DT, FP8>(payload, rows, dim, out, flags);                                   \
    }                                                                                                  \
    extern "C" __global__ void kv_##NAME##_decode_any_##SUF(                                           \
        const kv_u8* payload, kv_i64 rows, int dim, void* out, unsigned* flags) {                      \
        rowwise_decode_any<DT, FP8>(payload, rows, dim, out, flags);                                   \
    }

#define KV_INT4(SUF, DT)                                                                               \
    extern "C" __global__ void kv_int4_stats_##SUF(                                                    \
        const void* x, kv_i64 tokens, int heads, int dim, int group, int is_v, int chunk_tokens,       \
        kv_i64 chunk_bytes, kv_i64 total_groups, kv_u8* out, float* stats, unsigned* flags) {          \
        int4_stats<DT>(x, tokens, heads, dim, group, is_v, chunk_tokens, chunk_bytes, total_groups,    \
                       out, stats, flags);                                                             \
    }                                                                                                  \
    extern "C" __global__ void kv_int4_pack_##SUF(                                                     \
        const void* x, kv_i64 tokens, int heads, int dim, int group, int is_v, int chunk_tokens,       \
        kv_i64 chunk_bytes, kv_i64 total_bytes, const float* stats, kv_u8* out) {                      \
        int4_pack<DT>(x, tokens, heads, dim, group, is_v, chunk_tokens, chunk_bytes, total_bytes,      \
                      stats, out);                                                                     \
    }                                                                                                  \
    extern "C" __global__ void kv_int4_decode_##SUF(                                                   \
        const kv_u8* payload, kv_i64 tokens, int heads, int dim, int group, int is_v, void* out,       \
        unsigned* flags) {                                                                             \
        int4_decode<DT>(payload, tokens, heads, dim, group, is_v, out, flags);                         \
    }

KV_ROWWISE(f16, 0, 1, fp8)
KV_ROWWISE(bf16, 1, 1, fp8)
KV_ROWWISE(f32, 2, 1, fp8)
KV_ROWWISE(f16, 0, 0, int8)
KV_ROWWISE(bf16, 1, 0, int8)
KV_ROWWISE(f32, 2, 0, int8)
#define KV_INT4_V_VEC(SUF, DT, LPR, VPL)                                                               \
    extern "C" __global__ void kv_int4_encode_v_vec_##SUF##_##LPR##_##VPL(                             \
        const uint4* x, kv_i64 tokens, int heads, int dim, int group, int chunk_tokens,                \
        kv_i64 chunk_bytes, kv_u8* out, unsigned* flags) {                                             \
        int4_encode_v_vec<DT, LPR, VPL>(x, tokens, heads, dim, group, chunk_tokens, chunk_bytes, out, flags); \
    }
#define KV_INT4_K_VEC(SUF, DT, TL, KPT)                                                                \
    extern "C" __global__ void kv_int4_encode_k_vec_##SUF##_##TL##_##KPT(                              \
        const uint4* x, kv_i64 tokens, int heads, int dim, int group, int chunk_tokens,                \
        kv_i64 chunk_bytes, kv_i64 total_blocks, kv_u8* out, unsigned* flags) {                        \
        int4_encode_k_vec<DT, TL, KPT>(x, tokens, heads, dim, group, chunk_tokens, chunk_bytes,        \
                                       total_blocks, out, flags);                                      \
    }
#define KV_INT4_VEC(SUF, DT)                                                                           \
    KV_INT4_V_VEC(SUF, DT, 16, 1)                                                                      \
    KV_INT4_V_VEC(SUF, DT, 32, 1)                                                                      \
    KV_INT4_V_VEC(SUF, DT, 32, 2)                                                                      \
    KV_INT4_V_VEC(SUF, DT, 32, 4)                                                                      \
    KV_INT4_K_VEC(SUF, DT, 4, 2)                                                                       \
    KV_INT4_K_VEC(SUF, DT, 4, 8)                                                                       \
    KV_INT4_K_VEC(SUF, DT, 4, 16)                                                                      \
    KV_INT4_K_VEC(SUF, DT, 8, 16)                                                                      \
    KV_INT4_K_VEC(SUF, DT, 16, 16)                                                                     \
    extern "C" __global__ void kv_int4_decode_vec_##SUF(                                               \
        const kv_u8* payload, unsigned tokens, unsigned heads, unsigned dim, unsigned group, int is_v,  \
        uint4* out, unsigned* flags) {                                                                 \
        int4_decode_vec<DT>(payload, tokens, heads, dim, group, is_v, out, flags);                     \
    }

KV_INT4(f16, 0)
KV_INT4(bf16, 1)
KV_INT4(f32, 2)
KV_INT4_VEC(f16, 0)
KV_INT4_VEC(bf16, 1)
KV_INT4_VEC(f32, 2)
