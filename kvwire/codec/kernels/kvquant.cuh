// Element arithmetic of the quantizing codecs, shared by the CUDA kernels and a host build.
// Every operation rounds once (no FMA contraction: explicit _rn intrinsics on the device,
// -ffp-contract=off on the host) so that codes and scales match the numpy reference bit
// for bit.  Conversions work on bit patterns so that no library rounding mode is involved.
#pragma once

#if defined(__CUDACC__)
#define KV_HD __host__ __device__ __forceinline__
#else
#define KV_HD static inline
#include <math.h>
#include <string.h>
#endif

typedef unsigned int kv_u32;
typedef unsigned short kv_u16;
typedef unsigned char kv_u8;

KV_HD float kv_bits_f32(kv_u32 u) {
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f; memcpy(&f, &u, 4); return f;
#endif
}
KV_HD kv_u32 kv_f32_bits(float f) {
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    kv_u32 u; memcpy(&u, &f, 4); return u;
#endif
}
// On the device every float operation whose result can be subnormal is inline PTX without
// .ftz: CuPy appends -ftz=true to every compile, which would otherwise flush subnormal
// inputs and results to zero (and make comparisons treat them as zero).  Comparisons and
// float-to-int conversions go through PTX too, so the compiled kernels hold no .ftz at all.
KV_HD float kv_div(float a, float b) {
#if defined(__CUDA_ARCH__)
    float r; asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
#else
    return a / b;
#endif
}
KV_HD float kv_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
    float r; asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
#else
    return a * b;
#endif
}
KV_HD float kv_add(float a, float b) {
#if defined(__CUDA_ARCH__)
    float r; asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
#else
    return a + b;
#endif
}
KV_HD float kv_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
    float r; asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b)); return r;
#else
    return a - b;
#endif
}
// Round half to even, like np.rint (rintf in the default rounding mode on the host).
KV_HD float kv_rint(float a) {
#if defined(__CUDA_ARCH__)
    float r; asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(a)); return r;
#else
    return rintf(a);
#endif
}
// a > b and a < b as IEEE comparisons (false when either is NaN; subnormals kept).
KV_HD int kv_gt(float a, float b) {
#if defined(__CUDA_ARCH__)
    unsigned r;
    asm("{ .reg .pred p; setp.gt.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }" : "=r"(r) : "f"(a), "f"(b));
    return (int)r;
#else
    return a > b;
#endif
}
KV_HD int kv_lt(float a, float b) { return kv_gt(b, a); }
// Truncation of an integer-valued float (|x| < 2^31) to int.
KV_HD int kv_f32_to_int(float a) {
#if defined(__CUDA_ARCH__)
    int r; asm("cvt.rzi.s32.f32 %0, %1;" : "=r"(r) : "f"(a)); return r;
#else
    return (int)a;
#endif
}
// NaN compares false, so a NaN is clamped to lo instead of being passed through.
KV_HD float kv_clamp(float x, float lo, float hi) { return kv_gt(x, lo) ? (kv_lt(x, hi) ? x : hi) : lo; }
// Sign change and zero test on the bits (a float negate or == 0.0f could be flushed).
KV_HD float kv_neg(float a) { return kv_bits_f32(kv_f32_bits(a) ^ 0x80000000u); }
KV_HD int kv_is_zero(float a) { return (kv_f32_bits(a) & 0x7FFFFFFFu) == 0u; }
// Unsigned key with the order of the float values (-0 before +0; finite inputs).
KV_HD kv_u32 kv_order_key(float a) {
    kv_u32 u = kv_f32_bits(a);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
KV_HD float kv_from_order_key(kv_u32 k) { return kv_bits_f32((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k); }
// -0 becomes +0 (the int4 group minimum and maximum are stored canonical).
KV_HD float kv_canonical_zero(float a) { return kv_is_zero(a) ? 0.0f : a; }

KV_HD float kv_f16_to_f32(kv_u16 h) {
    // half fields shifted into float place are x * 2^-112 exactly for finite x (subnormals
    // included); inf and NaN widen to finite 65536..98304, so callers flag them first
    // (kv_nonfinite on the magnitude bits) and never widen one
    float mag = kv_mul(kv_bits_f32((kv_u32)(h & 0x7FFFu) << 13), 5.192296858534828e33f);
    return kv_bits_f32(kv_f32_bits(mag) | ((kv_u32)(h & 0x8000u) << 16));
}
KV_HD float kv_bf16_to_f32(kv_u16 h) { return kv_bits_f32((kv_u32)h << 16); }

KV_HD kv_u16 kv_f32_to_f16(float f) {  // round half to even, overflow to inf, NaN kept
    kv_u32 u = kv_f32_bits(f);
    kv_u16 sign = (kv_u16)((u >> 16) & 0x8000u);
    kv_u32 a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (kv_u16)(sign | 0x7E00u);
    if (a >= 0x477FF000u) return (kv_u16)(sign | 0x7C00u);  // >= 65520 rounds to inf
    if (a < 0x38800000u) {  // below 2^-14: half subnormal, grid 2^-24
        // adding 0.5 (ulp 2^-24) rounds to the subnormal grid in one step
        float r = kv_add(kv_bits_f32(a), 0.5f);
        return (kv_u16)(sign | (kv_u16)(kv_f32_bits(r) - 0x3F000000u));
    }
    kv_u32 r = a + 0xFFFu + ((a >> 13) & 1u) - (112u << 23);
    return (kv_u16)(sign | (kv_u16)(r >> 13));
}
KV_HD kv_u16 kv_f32_to_bf16(float f) {
    kv_u32 u = kv_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (kv_u16)((u >> 16) | 0x40u);
    return (kv_u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// E4M3 "fn": max 448, no infinity, NaN 0x7F/0xFF; RNE, saturating.
KV_HD kv_u8 kv_f32_to_e4m3(float q) {
    kv_u32 u = kv_f32_bits(q);
    kv_u8 sign = (kv_u8)((u >> 24) & 0x80u);
    kv_u32 a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (kv_u8)(sign | 0x7Fu);
    if (a >= 0x43E00000u) return (kv_u8)(sign | 0x7Eu);
    if (a < 0x3C800000u) {  // below 2^-6: subnormal grid 2^-9
        float r = kv_add(kv_bits_f32(a), 16384.0f);
        return (kv_u8)(sign | (kv_u8)(kv_f32_bits(r) - 0x46800000u));
    }
    kv_u32 r = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
    return (kv_u8)(sign | (kv_u8)(r - 960u));
}
KV_HD float kv_e4m3_to_f32(kv_u8 c) {
    kv_u32 e = (c >> 3) & 0xFu, m = c & 7u;
    float mag;
    if ((c & 0x7Fu) == 0x7Fu) mag = kv_bits_f32(0x7FC00000u);
    else if (e == 0) mag = kv_mul((float)m, 0.001953125f);
    else mag = kv_bits_f32(((e + 120u) << 23) | (m << 20));
    return (c & 0x80u) ? kv_neg(mag) : mag;
}

// Scales: one division form everywhere (x / s); a zero scale divides by 1.  A scale whose
// largest code would decode past float32 (a float32 input within an ulp or two of its
// maximum) steps down one ulp: the codes saturate and every decoded value stays finite.
KV_HD float kv_fit_scale(float s, float top) {  // s itself not finite: left for the range check
    const kv_u32 inf = 0x7F800000u;
    return (kv_f32_bits(s) & inf) != inf && (kv_f32_bits(kv_mul(s, top)) & 0x7FFFFFFFu) == inf
        ? kv_bits_f32(kv_f32_bits(s) - 1u) : s;
}
KV_HD float kv_fp8_scale(float absmax) { return kv_fit_scale(kv_div(absmax, 448.0f), 448.0f); }
KV_HD float kv_int8_scale(float absmax) { return kv_fit_scale(kv_div(absmax, 127.0f), 127.0f); }
// int4 decodes code * s + lo: its top code's value 15 * s + lo (both roundings, as the
// decoder computes it) must stay finite, not only 15 * s.  With a large positive minimum and
// a maximum within a few ulps of the float32 maximum it can round past it; s then steps down
// one ulp at a time until it does not (a step or two; the codes saturate at 15).  This
// includes kv_fit_scale's rule (15 * s + lo is infinite when 15 * s is), and then no code
// decodes past float32: c * s + lo <= 15 * s + lo for lo >= 0 (rounding is monotonic), and
// |c * s + lo| <= max(15 * s, |lo|) for lo < 0.
KV_HD float kv_int4_fit(float s, float lo) {  // s itself not finite: left for the range check
    const kv_u32 inf = 0x7F800000u;
    while ((kv_f32_bits(s) & inf) != inf && (kv_f32_bits(kv_add(kv_mul(s, 15.0f), lo)) & 0x7FFFFFFFu) == inf)
        s = kv_bits_f32(kv_f32_bits(s) - 1u);
    return s;
}
KV_HD float kv_int4_scale(float lo, float hi) { return kv_int4_fit(kv_div(kv_sub(hi, lo), 15.0f), lo); }
KV_HD float kv_divisor(float s) { return kv_is_zero(s) ? 1.0f : s; }

KV_HD kv_u8 kv_fp8_quant(float x, float s) { return kv_f32_to_e4m3(kv_div(x, kv_divisor(s))); }
KV_HD signed char kv_int8_quant(float x, float s) {
    return (signed char)kv_f32_to_int(kv_clamp(kv_rint(kv_div(x, kv_divisor(s))), -127.0f, 127.0f));
}
KV_HD kv_u8 kv_int4_quant(float x, float lo, float s) {
    return (kv_u8)kv_f32_to_int(kv_clamp(kv_rint(kv_div(kv_sub(x, lo), kv_divisor(s))), 0.0f, 15.0f));
}
KV_HD float kv_fp8_dequant(kv_u8 c, float s) { return kv_mul(kv_e4m3_to_f32(c), s); }
KV_HD float kv_int8_dequant(signed char c, float s) { return kv_mul((float)c, s); }
KV_HD float kv_int4_dequant(kv_u8 c, float lo, float s) { return kv_add(kv_mul((float)c, s), lo); }
