/* Host (CPU) build of the quantizing codecs: the element arithmetic is kernels/kvquant.cuh,
 * the same __host__ __device__ functions the CUDA kernels use, so codes, scales and decoded
 * values are the numpy reference's bits (kvwire/codec/_numeric.py) by construction.
 *
 * The loops are plain C written for the auto-vectorizer (-O3, no FMA contraction, no
 * fast-math).  On x86-64 Linux with GCC every hot loop is compiled several times
 * (target_clones: x86-64-v4 with AVX-512, x86-64-v3 with AVX2, baseline SSE2) and the
 * loader picks the clone for the CPU it runs on, so one build runs on any x86-64; float16
 * rows are converted with F16C where the CPU has it.  Elsewhere the generic code is used.
 *
 * Every entry point takes contiguous buffers and sizes, releases the GIL for the loop and
 * returns a status code (KV_OK or one of KV_E_*); the Python side validates arguments,
 * allocates and raises.  Layouts are those of docs/codecs.md.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kvquant.cuh"

/* The loops run with subnormals kept (MXCSR's FTZ and DAZ clear) and rounding to nearest
 * (MXCSR's RC bits 0), exceptions masked, whatever the calling thread had set: a library
 * built with -ffast-math sets FTZ and DAZ when it is loaded, and fesetround changes the
 * rounding mode; with either the loops (whose arithmetic and conversions follow MXCSR)
 * would give other codes than the GPU kernels (which never flush: no .ftz, and round to
 * nearest: .rn) for the same tensor, and the SIMD levels other codes than each other.  The
 * caller's MXCSR is put back after. */
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#define KV_CSR_KEEP_MASK (~0xE040u) /* FTZ (0x8000), RC (0x6000), DAZ (0x0040) cleared */
#define KV_CSR_MASK_ALL 0x1F80u      /* every exception masked */
#define KV_FP_ENTER const unsigned int kv_saved_csr = _mm_getcsr(); \
    _mm_setcsr((kv_saved_csr & KV_CSR_KEEP_MASK) | KV_CSR_MASK_ALL);
#define KV_FP_LEAVE _mm_setcsr(kv_saved_csr);
#else
#define KV_FP_ENTER
#define KV_FP_LEAVE
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire format is little-endian; big-endian hosts use the numpy codecs"
#endif

#if defined(__x86_64__) && defined(__ELF__) && !defined(KV_NO_CLONES) && !defined(__clang__) && \
    defined(__GNUC__) && __GNUC__ >= 8
#if __GNUC__ >= 11
#define KV_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else /* no x86-64-vN names before GCC 11 */
#define KV_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#define KV_HAVE_CLONES 1
#else
#define KV_CLONES
#define KV_HAVE_CLONES 0
#endif

typedef Py_ssize_t idx;

enum {
    KV_OK = 0,
    KV_E_NONFINITE = 1,    /* encode: NaN or infinity in the input */
    KV_E_RANGE = 2,        /* int4 encode: a group's range overflows float32 */
    KV_E_CODE = 3,         /* decode: fp8 NaN code or int8 -128 */
    KV_E_OVERFLOW = 4,     /* decode: scale * code overflows float32 */
    KV_E_DTYPE = 5,        /* decode: a value outside the target dtype */
    KV_E_SCALE = 6,        /* decode: negative (or -0), NaN or infinite scale */
    KV_E_MIN = 7,          /* int4 decode: NaN or infinite minimum */
    KV_E_PAD = 8,          /* int4 decode: non-zero padding nibble */
    KV_E_NOMEM = 9,
};

#define DT_F16 0
#define DT_BF16 1
#define DT_F32 2

/* Elements per check block of the row-wise codecs: the numpy reference checks its codes
 * and results in blocks of BLOCK_ELEMS elements, so errors are reported in the same order. */
#define KV_BLOCK_ELEMS 65536

static inline float ld_f32(const kv_u8* p, idx i) { float f; memcpy(&f, p + 4 * i, 4); return f; }
static inline void st_f32(kv_u8* p, idx i, float f) { memcpy(p + 4 * i, &f, 4); }

/* float32 magnitude bits from which each output dtype overflows (see _numeric._OVERFLOW_AT) */
static const kv_u32 OVERFLOW_BITS[3] = {0x477FF000u /* 65520 */, 0x7F7F8000u, 0x7F800000u};

/* The verdict on a block of decoded values from their largest magnitude bits: past float32
 * (a forged scale), past the output dtype, or fine. */
static inline int decoded_status(kv_u32 vmax, int dt) {
    return vmax >= 0x7F800000u ? KV_E_OVERFLOW : vmax >= OVERFLOW_BITS[dt] ? KV_E_DTYPE : KV_OK;
}

/* ------------------------------------------------------------------------------------ */
/* Loaders and storers per dtype (the kvquant.cuh conversions).                          */

#define LOAD_F16(p, i) kv_f16_to_f32(((const kv_u16*)(p))[i])
#define LOAD_BF16(p, i) kv_bf16_to_f32(((const kv_u16*)(p))[i])
#define LOAD_F32(p, i) (((const float*)(p))[i])
#define MAG_F16(p, i) ((kv_u32)(((const kv_u16*)(p))[i] & 0x7FFFu))
#define MAG_BF16(p, i) MAG_F16(p, i)
#define MAG_F32(p, i) (kv_f32_bits(((const float*)(p))[i]) & 0x7FFFFFFFu)
#define AMAX_F16(m) kv_f16_to_f32((kv_u16)(m))
#define AMAX_BF16(m) kv_bf16_to_f32((kv_u16)(m))
#define AMAX_F32(m) kv_bits_f32(m)
#define NONFINITE_F16 0x7C00u
#define NONFINITE_BF16 0x7F80u
#define NONFINITE_F32 0x7F800000u
#define STORE_F16(p, i, v) (((kv_u16*)(p))[i] = kv_f32_to_f16(v))
#define STORE_BF16(p, i, v) (((kv_u16*)(p))[i] = kv_f32_to_bf16(v))
#define STORE_F32(p, i, v) (((float*)(p))[i] = (v))

/* Decoders store float16 a row at a time: the values go to a float row buffer and
 * kv_store_f16 converts the row, with F16C (vcvtps2ph, round to nearest even: the same
 * bits as kv_f32_to_f16 for every value a decoder keeps) where the CPU has it. */
#define EL_F16(p, i, t, j, v) ((t)[j] = (v))
#define EL_BF16(p, i, t, j, v) STORE_BF16(p, i, v)
#define EL_F32(p, i, t, j, v) STORE_F32(p, i, v)
#define ROW_F16(p, base, t, n) kv_store_f16((kv_u16*)(p) + (base), (t), (n))
#define ROW_BF16(p, base, t, n) ((void)(t))
#define ROW_F32(p, base, t, n) ((void)(t))

/* Encoders read float16 a row at a time the same way (vcvtph2ps is exact, like
 * kv_f16_to_f32, for every finite value; NaN and infinity are refused before use). */
#define RL_F16(x, base, t, n) kv_load_f16((t), (const kv_u16*)(x) + (base), (n))
#define RL_BF16(x, base, t, n) ((void)(t))
#define RL_F32(x, base, t, n) ((void)(t))
#define LD_F16(x, i, t, j) ((t)[j])
#define LD_BF16(x, i, t, j) LOAD_BF16(x, i)
#define LD_F32(x, i, t, j) LOAD_F32(x, i)

typedef void (*f16_row_fn)(kv_u16* restrict, const float* restrict, idx);
typedef void (*f16_load_fn)(float* restrict, const kv_u16* restrict, idx);

KV_CLONES static void load_f16_generic(float* restrict dst, const kv_u16* restrict src, idx n) {
    for (idx i = 0; i < n; ++i) dst[i] = kv_f16_to_f32(src[i]);
}

KV_CLONES static void store_f16_generic(kv_u16* restrict dst, const float* restrict src, idx n) {
    for (idx i = 0; i < n; ++i) dst[i] = kv_f32_to_f16(src[i]);
}

#if KV_HAVE_CLONES
#include <immintrin.h>
__attribute__((target("avx,f16c"))) static void store_f16_f16c(kv_u16* restrict dst,
                                                               const float* restrict src, idx n) {
    idx i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; ++i) dst[i] = kv_f32_to_f16(src[i]);
}
__attribute__((target("avx,f16c"))) static void load_f16_f16c(float* restrict dst,
                                                              const kv_u16* restrict src, idx n) {
    idx i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + i))));
    for (; i < n; ++i) dst[i] = kv_f16_to_f32(src[i]);
}
static int have_f16c(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}
#endif

static f16_row_fn kv_store_f16 = store_f16_generic;
static f16_load_fn kv_load_f16 = load_f16_generic;

/* ------------------------------------------------------------------------------------ */
/* fp8 / int8: one scale per row of `dim` elements.                                      */

#define ROWWISE_ENCODE(NAME, SUF, SCALE, QUANT, CODE_T)                                      \
    KV_CLONES static int NAME##_encode_##SUF(const void* restrict x, idx rows, idx dim,        \
                                             kv_u8* restrict scales, kv_u8* restrict codes_, \
                                             float* restrict rowtmp) {                       \
        CODE_T* restrict codes = (CODE_T*)codes_;                                            \
        for (idx r = 0; r < rows; ++r) {                                                     \
            const idx base = r * dim;                                                        \
            kv_u32 amax = 0;                                                                 \
            for (idx d = 0; d < dim; ++d) {                                                  \
                kv_u32 m = MAG_##SUF(x, base + d);                                           \
                amax = m > amax ? m : amax;                                                  \
            }                                                                                \
            if (amax >= NONFINITE_##SUF) return KV_E_NONFINITE;                              \
            const float s = SCALE(AMAX_##SUF(amax));                                         \
            st_f32(scales, r, s);                                                            \
            RL_##SUF(x, base, rowtmp, dim);                                                  \
            for (idx d = 0; d < dim; ++d)                                                    \
                codes[base + d] = QUANT(LD_##SUF(x, base + d, rowtmp, d), s);                \
        }                                                                                    \
        return KV_OK;                                                                        \
    }

#define FP8_CODE(c) (((c) & 0x7Fu) == 0x7Fu)
#define INT8_CODE(c) ((c) == -128)

#define ROWWISE_DECODE(NAME, SUF, DEQUANT, CODE_T, BADCODE)                                  \
    KV_CLONES static int NAME##_decode_##SUF(const kv_u8* restrict codes_,                    \
                                             const kv_u8* restrict scales, idx rows, idx dim, \
                                             void* restrict out, float* restrict rowtmp) {   \
        const CODE_T* restrict codes = (const CODE_T*)codes_;                                \
        idx step = KV_BLOCK_ELEMS / dim;                                                     \
        if (step < 1) step = 1;                                                              \
        for (idx r0 = 0; r0 < rows; r0 += step) {                                            \
            const idx r1 = r0 + step < rows ? r0 + step : rows;                              \
            int bad = 0;                                                                     \
            kv_u32 vmax = 0;                                                                 \
            for (idx r = r0; r < r1; ++r) {                                                  \
                const float s = ld_f32(scales, r);                                           \
                const idx base = r * dim;                                                    \
                for (idx d = 0; d < dim; ++d) {                                              \
                    CODE_T c = codes[base + d];                                              \
                    bad |= BADCODE(c);                                                       \
                    float v = DEQUANT(c, s);                                                 \
                    kv_u32 m = kv_f32_bits(v) & 0x7FFFFFFFu;                                 \
                    vmax = m > vmax ? m : vmax;                                              \
                    EL_##SUF(out, base + d, rowtmp, d, v);                                   \
                }                                                                            \
                ROW_##SUF(out, base, rowtmp, dim);                                           \
            }                                                                                \
            if (bad) return KV_E_CODE;                                                       \
            { const int st_ = decoded_status(vmax, DT_##SUF); if (st_) return st_; }         \
        }                                                                                    \
        return KV_OK;                                                                        \
    }

#define FP8_ENC(SUF) ROWWISE_ENCODE(fp8, SUF, kv_fp8_scale, kv_fp8_quant, kv_u8)
#define INT8_ENC(SUF) ROWWISE_ENCODE(int8, SUF, kv_int8_scale, kv_int8_quant, signed char)
#define FP8_DEC(SUF) ROWWISE_DECODE(fp8, SUF, kv_fp8_dequant, kv_u8, FP8_CODE)
#define INT8_DEC(SUF) ROWWISE_DECODE(int8, SUF, kv_int8_dequant, signed char, INT8_CODE)
FP8_ENC(F16) FP8_ENC(BF16) FP8_ENC(F32)
INT8_ENC(F16) INT8_ENC(BF16) INT8_ENC(F32)
FP8_DEC(F16) FP8_DEC(BF16) FP8_DEC(F32)
INT8_DEC(F16) INT8_DEC(BF16) INT8_DEC(F32)

/* ------------------------------------------------------------------------------------ */
/* int4: KIVI groups; codes packed two per byte in C order (element 2i low nibble).     */

typedef struct {
    kv_u8* p;
    int odd;
    kv_u8 pend;
} packer;

KV_CLONES static void pack_append(packer* pk, const kv_u8* c, idx n) {
    idx i = 0;
    if (n == 0) return;
    if (pk->odd) {
        *pk->p++ = (kv_u8)(pk->pend | (c[0] << 4));
        pk->odd = 0;
        i = 1;
    }
    const idx m = (n - i) / 2;
    kv_u8* p = pk->p;
    const kv_u8* s = c + i;
    for (idx j = 0; j < m; ++j) p[j] = (kv_u8)(s[2 * j] | (s[2 * j + 1] << 4));
    pk->p += m;
    i += 2 * m;
    if (i < n) {
        pk->pend = c[i];
        pk->odd = 1;
    }
}

static void pack_finish(packer* pk) {
    if (pk->odd) *pk->p++ = pk->pend;
}

/* Group minimum and maximum as in the kernel: unsigned order keys of the values (integer
 * min/max, which vectorize without fast-math), back to floats, -0 stored as +0. */
#define INT4_ENCODE(SUF)                                                                     \
    KV_CLONES static int int4_encode_##SUF(const void* x, idx tokens, idx heads, idx dim,    \
                                           idx group, int is_v, kv_u8* scales, kv_u8* mins,  \
                                           kv_u8* packed, float* lo, float* hi,              \
                                           kv_u32* keys, kv_u8* tmp, float* rowtmp) {        \
        const idx hd = heads * dim;                                                          \
        kv_u32* klo = keys;                                                                  \
        kv_u32* khi = keys + hd;                                                             \
        packer pk = {packed, 0, 0};                                                          \
        kv_u32 mag = 0;                                                                      \
        if (!is_v) {                                                                         \
            for (idx t0 = 0, b = 0; t0 < tokens; t0 += group, ++b) {                         \
                const idx t1 = t0 + group < tokens ? t0 + group : tokens;                    \
                RL_##SUF(x, t0 * hd, rowtmp, hd);                                            \
                for (idx c = 0; c < hd; ++c) {                                               \
                    kv_u32 m = MAG_##SUF(x, t0 * hd + c);                                    \
                    mag = m > mag ? m : mag;                                                 \
                    klo[c] = khi[c] = kv_order_key(LD_##SUF(x, t0 * hd + c, rowtmp, c));     \
                }                                                                            \
                for (idx t = t0 + 1; t < t1; ++t) {                                          \
                    RL_##SUF(x, t * hd, rowtmp, hd);                                         \
                    for (idx c = 0; c < hd; ++c) {                                           \
                        kv_u32 m = MAG_##SUF(x, t * hd + c);                                 \
                        mag = m > mag ? m : mag;                                             \
                        kv_u32 k = kv_order_key(LD_##SUF(x, t * hd + c, rowtmp, c));         \
                        klo[c] = k < klo[c] ? k : klo[c];                                    \
                        khi[c] = k > khi[c] ? k : khi[c];                                    \
                    }                                                                        \
                }                                                                            \
                if (mag >= NONFINITE_##SUF) return KV_E_NONFINITE;                           \
                int range = 0;                                                               \
                for (idx c = 0; c < hd; ++c) {                                               \
                    float l = kv_canonical_zero(kv_from_order_key(klo[c]));                  \
                    float s = kv_int4_scale(l, kv_canonical_zero(kv_from_order_key(khi[c]))); \
                    range |= (kv_f32_bits(s) & 0x7FFFFFFFu) >= 0x7F800000u;                  \
                    lo[c] = l;                                                               \
                    hi[c] = s;                                                               \
                    st_f32(scales, b * hd + c, s);                                           \
                    st_f32(mins, b * hd + c, l);                                             \
                }                                                                            \
                if (range) return KV_E_RANGE;                                                \
                for (idx t = t0; t < t1; ++t) {                                              \
                    RL_##SUF(x, t * hd, rowtmp, hd);                                         \
                    for (idx c = 0; c < hd; ++c)                                             \
                        tmp[c] = kv_int4_quant(LD_##SUF(x, t * hd + c, rowtmp, c), lo[c], hi[c]); \
                    pack_append(&pk, tmp, hd);                                               \
                }                                                                            \
            }                                                                                \
        } else {                                                                             \
            const idx runs = (dim + group - 1) / group;                                      \
            float* row = lo;                                                                 \
            for (idx r = 0; r < tokens * heads; ++r) {                                       \
                const idx base = r * dim;                                                    \
                RL_##SUF(x, base, row, dim);                                                 \
                for (idx d = 0; d < dim; ++d) {                                              \
                    kv_u32 m = MAG_##SUF(x, base + d);                                       \
                    mag = m > mag ? m : mag;                                                 \
                    row[d] = LD_##SUF(x, base + d, row, d);                                  \
                    keys[d] = kv_order_key(row[d]);                                          \
                }                                                                            \
                if (mag >= NONFINITE_##SUF) return KV_E_NONFINITE;                           \
                /* per-element minimum (rowtmp) and scale (hi) of each run, then one pass */ \
                for (idx k = 0; k < runs; ++k) {                                             \
                    const idx d0 = k * group, d1 = d0 + group < dim ? d0 + group : dim;      \
                    kv_u32 kl = keys[d0], kh = kl;                                           \
                    for (idx d = d0 + 1; d < d1; ++d) {                                      \
                        kl = keys[d] < kl ? keys[d] : kl;                                    \
                        kh = keys[d] > kh ? keys[d] : kh;                                    \
                    }                                                                        \
                    const float l = kv_canonical_zero(kv_from_order_key(kl));                \
                    const float s = kv_int4_scale(l, kv_canonical_zero(kv_from_order_key(kh))); \
                    if ((kv_f32_bits(s) & 0x7FFFFFFFu) >= 0x7F800000u) return KV_E_RANGE;    \
                    st_f32(scales, r * runs + k, s);                                         \
                    st_f32(mins, r * runs + k, l);                                           \
                    for (idx d = d0; d < d1; ++d) {                                          \
                        rowtmp[d] = l;                                                       \
                        hi[d] = s;                                                           \
                    }                                                                        \
                }                                                                            \
                for (idx d = 0; d < dim; ++d) tmp[d] = kv_int4_quant(row[d], rowtmp[d], hi[d]); \
                pack_append(&pk, tmp, dim);                                                  \
            }                                                                                \
        }                                                                                    \
        pack_finish(&pk);                                                                    \
        return KV_OK;                                                                        \
    }

INT4_ENCODE(F16) INT4_ENCODE(BF16) INT4_ENCODE(F32)

/* Validation shared by the decoders: scales >= +0 and finite, minimums finite. */
KV_CLONES static int check_scales(const kv_u8* scales, idx n) {
    kv_u32 worst = 0;
    for (idx i = 0; i < n; ++i) {
        kv_u32 b = kv_f32_bits(ld_f32(scales, i));
        /* negative (sign bit) or >= inf bits (inf/NaN): both are >= 0x7F800000 unsigned */
        worst = b > worst ? b : worst;
    }
    return worst >= 0x7F800000u ? KV_E_SCALE : KV_OK;
}

KV_CLONES static int check_mins(const kv_u8* mins, idx n) {
    kv_u32 worst = 0;
    for (idx i = 0; i < n; ++i) {
        kv_u32 b = kv_f32_bits(ld_f32(mins, i)) & 0x7FFFFFFFu;
        worst = b > worst ? b : worst;
    }
    return worst >= 0x7F800000u ? KV_E_MIN : KV_OK;
}

static inline kv_u8 nib(const kv_u8* packed, idx i) {
    kv_u8 b = packed[i >> 1];
    return (i & 1) ? (kv_u8)(b >> 4) : (kv_u8)(b & 15u);
}

#define INT4_DECODE(SUF)                                                                     \
    KV_CLONES static int int4_decode_##SUF(const kv_u8* packed, const kv_u8* scales,         \
                                           const kv_u8* mins, idx tokens, idx heads, idx dim, \
                                           idx group, int is_v, void* out, float* sc,        \
                                           float* mn, float* rowtmp) {                       \
        const idx hd = heads * dim;                                                          \
        kv_u32 vmax = 0;                                                                     \
        if (!is_v) {                                                                         \
            for (idx t = 0; t < tokens; ++t) {                                               \
                const idx b = t / group;                                                     \
                if (t % group == 0) {                                                        \
                    for (idx c = 0; c < hd; ++c) {                                           \
                        sc[c] = ld_f32(scales, b * hd + c);                                  \
                        mn[c] = ld_f32(mins, b * hd + c);                                    \
                    }                                                                        \
                }                                                                            \
                const idx base = t * hd;                                                     \
                if ((base & 1) == 0) {                                                       \
                    const kv_u8* p = packed + (base >> 1);                                   \
                    const idx pairs = hd >> 1;                                               \
                    for (idx j = 0; j < pairs; ++j) {                                        \
                        kv_u8 byte = p[j];                                                   \
                        float v0 = kv_int4_dequant((kv_u8)(byte & 15u), mn[2 * j], sc[2 * j]); \
                        float v1 = kv_int4_dequant((kv_u8)(byte >> 4), mn[2 * j + 1], sc[2 * j + 1]); \
                        kv_u32 m0 = kv_f32_bits(v0) & 0x7FFFFFFFu;                           \
                        kv_u32 m1 = kv_f32_bits(v1) & 0x7FFFFFFFu;                           \
                        vmax = m0 > vmax ? m0 : vmax;                                        \
                        vmax = m1 > vmax ? m1 : vmax;                                        \
                        EL_##SUF(out, base + 2 * j, rowtmp, 2 * j, v0);                      \
                        EL_##SUF(out, base + 2 * j + 1, rowtmp, 2 * j + 1, v1);              \
                    }                                                                        \
                    for (idx c = 2 * pairs; c < hd; ++c) {                                   \
                        float v = kv_int4_dequant(nib(packed, base + c), mn[c], sc[c]);      \
                        kv_u32 m = kv_f32_bits(v) & 0x7FFFFFFFu;                             \
                        vmax = m > vmax ? m : vmax;                                          \
                        EL_##SUF(out, base + c, rowtmp, c, v);                               \
                    }                                                                        \
                } else {                                                                     \
                    for (idx c = 0; c < hd; ++c) {                                           \
                        float v = kv_int4_dequant(nib(packed, base + c), mn[c], sc[c]);      \
                        kv_u32 m = kv_f32_bits(v) & 0x7FFFFFFFu;                             \
                        vmax = m > vmax ? m : vmax;                                          \
                        EL_##SUF(out, base + c, rowtmp, c, v);                               \
                    }                                                                        \
                }                                                                            \
                ROW_##SUF(out, base, rowtmp, hd);                                            \
            }                                                                                \
        } else {                                                                             \
            const idx runs = (dim + group - 1) / group;                                      \
            for (idx r = 0; r < tokens * heads; ++r) {                                       \
                const idx base = r * dim;                                                    \
                for (idx k = 0; k < runs; ++k) {                                             \
                    const float s = ld_f32(scales, r * runs + k);                            \
                    const float l = ld_f32(mins, r * runs + k);                              \
                    const idx d0 = k * group, d1 = d0 + group < dim ? d0 + group : dim;      \
                    if (((base + d0) & 1) == 0) {                                            \
                        const kv_u8* p = packed + ((base + d0) >> 1);                        \
                        const idx pairs = (d1 - d0) >> 1;                                    \
                        for (idx j = 0; j < pairs; ++j) {                                    \
                            kv_u8 byte = p[j];                                               \
                            float v0 = kv_int4_dequant((kv_u8)(byte & 15u), l, s);           \
                            float v1 = kv_int4_dequant((kv_u8)(byte >> 4), l, s);            \
                            kv_u32 m0 = kv_f32_bits(v0) & 0x7FFFFFFFu;                       \
                            kv_u32 m1 = kv_f32_bits(v1) & 0x7FFFFFFFu;                       \
                            vmax = m0 > vmax ? m0 : vmax;                                    \
                            vmax = m1 > vmax ? m1 : vmax;                                    \
                            EL_##SUF(out, base + d0 + 2 * j, rowtmp, d0 + 2 * j, v0);        \
                            EL_##SUF(out, base + d0 + 2 * j + 1, rowtmp, d0 + 2 * j + 1, v1); \
                        }                                                                    \
                        if (d0 + 2 * pairs < d1) {                                           \
                            const idx i = base + d1 - 1;                                     \
                            float v = kv_int4_dequant(nib(packed, i), l, s);                 \
                            kv_u32 m = kv_f32_bits(v) & 0x7FFFFFFFu;                         \
                            vmax = m > vmax ? m : vmax;                                      \
                            EL_##SUF(out, i, rowtmp, d1 - 1, v);                             \
                        }                                                                    \
                    } else {                                                                 \
                        for (idx d = d0; d < d1; ++d) {                                      \
                            float v = kv_int4_dequant(nib(packed, base + d), l, s);          \
                            kv_u32 m = kv_f32_bits(v) & 0x7FFFFFFFu;                         \
                            vmax = m > vmax ? m : vmax;                                      \
                            EL_##SUF(out, base + d, rowtmp, d, v);                           \
                        }                                                                    \
                    }                                                                        \
                }                                                                            \
                ROW_##SUF(out, base, rowtmp, dim);                                           \
            }                                                                                \
        }                                                                                    \
        { const int st_ = decoded_status(vmax, DT_##SUF); if (st_) return st_; }             \
        return KV_OK;                                                                        \
    }

INT4_DECODE(F16) INT4_DECODE(BF16) INT4_DECODE(F32)

/* ------------------------------------------------------------------------------------ */
/* Explicit AVX2 + F16C loops (x86-64 with GCC), chosen at run time.                     */
/*                                                                                      */
/* Eight float lanes at a time, each lane computing exactly what the kvquant.cuh function */
/* computes for one element: the same IEEE operations in the same order (vdivps, vsubps,  */
/* vmulps, vaddps and vroundps round to nearest even, like their scalar forms), the same  */
/* bit arithmetic for E4M3, and comparisons and selects with the kernel's NaN and signed  */
/* zero rules (maxps/minps return their second operand unless the first is greater/less, */
/* which is kv_clamp).  Row tails shorter than a vector use the kvquant.cuh functions.    */
/* Error checks keep the generic loops' order (per row for encode, per block of          */
/* KV_BLOCK_ELEMS elements for decode), so the outcome is the same for every input.      */

#if KV_HAVE_CLONES
#define KV_HAVE_AVX2 1
#define KV_AVX2 __attribute__((target("avx2,f16c")))
#define KV_AVX2_INLINE __attribute__((target("avx2,f16c"), always_inline)) static inline

KV_AVX2_INLINE __m256 v_ld_F16(const void* p, idx i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const kv_u16*)p + i)));
}
KV_AVX2_INLINE __m256 v_ld_BF16(const void* p, idx i) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const kv_u16*)p + i)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
KV_AVX2_INLINE __m256 v_ld_F32(const void* p, idx i) { return _mm256_loadu_ps((const float*)p + i); }

/* vcvtps2ph rounds to nearest even and overflows to infinity: kv_f32_to_f16's bits for
 * every non-NaN value (the decoders refuse NaN codes before their output is used). */
KV_AVX2_INLINE void v_st_F16(void* p, idx i, __m256 v) {
    _mm_storeu_si128((__m128i*)((kv_u16*)p + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
/* kv_f32_to_bf16 in lanes: NaN keeps its top bits and is made quiet, others round to even */
KV_AVX2_INLINE void v_st_BF16(void* p, idx i, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, qnan, _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128((__m128i*)((kv_u16*)p + i), w);
}
KV_AVX2_INLINE void v_st_F32(void* p, idx i, __m256 v) { _mm256_storeu_ps((float*)p + i, v); }

KV_AVX2_INLINE __m256i v_abs_bits(__m256 v) {
    return _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF));
}
KV_AVX2_INLINE kv_u32 v_hmax_u32(__m256i v) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return (kv_u32)_mm_cvtsi128_si32(m);
}
KV_AVX2_INLINE kv_u32 v_hmin_u32(__m256i v) {
    __m128i m = _mm_min_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_min_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_min_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return (kv_u32)_mm_cvtsi128_si32(m);
}
/* minimum / maximum of eight finite lanes (which of -0 and +0 is unspecified) */
KV_AVX2_INLINE float v_hmin_ps(__m256 v) {
    __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_min_ps(m, _mm_movehl_ps(m, m));
    m = _mm_min_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
KV_AVX2_INLINE float v_hmax_ps(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
/* kv_divisor: a zero scale (either sign) divides by 1 */
KV_AVX2_INLINE __m256 v_divisor(__m256 s) {
    __m256i zero = _mm256_cmpeq_epi32(v_abs_bits(s), _mm256_setzero_si256());
    return _mm256_blendv_ps(s, _mm256_set1_ps(1.0f), _mm256_castsi256_ps(zero));
}
/* kv_order_key */
KV_AVX2_INLINE __m256i v_order_key(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i flip = _mm256_or_si256(_mm256_srai_epi32(u, 31), _mm256_set1_epi32((int)0x80000000u));
    return _mm256_xor_si256(u, flip);
}
/* kv_f32_to_e4m3 in lanes (codes in the low byte of each 32-bit lane) */
KV_AVX2_INLINE __m256i v_e4m3(__m256 q) {
    const __m256i u = _mm256_castps_si256(q);
    const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
    __m256i nrm = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(0x7FFFF)), odd);
    nrm = _mm256_sub_epi32(_mm256_srli_epi32(nrm, 20), _mm256_set1_epi32(960));
    const __m256 sub_f = _mm256_add_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(16384.0f));
    const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(sub_f), _mm256_set1_epi32(0x46800000));
    __m256i r = _mm256_blendv_epi8(nrm, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3C800000), a));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7E), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x43DFFFFF)));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7F), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
    return _mm256_or_si256(r, sign);
}
/* kv_clamp(x, lo, hi) for lo < hi: maxps(x, lo) is x > lo ? x : lo, minps(y, hi) y < hi ? y : hi */
KV_AVX2_INLINE __m256 v_clamp(__m256 x, float lo, float hi) {
    return _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(lo)), _mm256_set1_ps(hi));
}
KV_AVX2_INLINE __m256 v_rint(__m256 x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* eight 32-bit lanes holding bytes -> eight bytes at p */
KV_AVX2_INLINE void v_store8_u8(kv_u8* p, __m256i r) {
    __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storel_epi64((__m128i*)p, _mm_packus_epi16(w, w));
}
/* four vectors of eight 32-bit lanes holding bytes -> 32 bytes at p, in order */
KV_AVX2_INLINE void v_store32_u8(kv_u8* p, __m256i r0, __m256i r1, __m256i r2, __m256i r3) {
    __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(r0, r1), _mm256_packus_epi32(r2, r3));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)p, b);
}
/* signed: int8 codes (in [-127, 127]) */
KV_AVX2_INLINE void v_store8_i8(kv_u8* p, __m256i r) {
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storel_epi64((__m128i*)p, _mm_packs_epi16(w, w));
}
KV_AVX2_INLINE void v_store32_i8(kv_u8* p, __m256i r0, __m256i r1, __m256i r2, __m256i r3) {
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(r0, r1), _mm256_packs_epi32(r2, r3));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)p, b);
}

/* Quantizers of eight lanes, each kvquant.cuh's function for one element (exact path). */
KV_AVX2_INLINE __m256i v_fp8_quant(__m256 x, __m256 divisor) { return v_e4m3(_mm256_div_ps(x, divisor)); }
KV_AVX2_INLINE __m256i v_int8_quant(__m256 x, __m256 divisor) {
    return _mm256_cvttps_epi32(v_clamp(v_rint(_mm256_div_ps(x, divisor)), -127.0f, 127.0f));
}
KV_AVX2_INLINE __m256i v_int4_quant(__m256 x, __m256 lo, __m256 divisor) {
    return _mm256_cvttps_epi32(v_clamp(v_rint(_mm256_div_ps(_mm256_sub_ps(x, lo), divisor)), 0.0f, 15.0f));
}

/* Multiply, then verify (fast path).  A quantizer only needs x / d up to its final
 * rounding to an integer grid (E4M3 mantissa, int8, int4), and q' = x * r with r = 1/d
 * rounded is within 3 ulp of q = x / d rounded (|q - q'| <= 3 * 2^-24 * |q|).  Where q'
 * lies farther than that from every rounding midpoint of the grid, q and q' round to the
 * same code, so the code is kvquant.cuh's; a lane closer than a margin of 4x that bound
 * (or NaN: a divisor whose reciprocal could overflow or be inexact gets r = NaN) marks
 * its vectors for the exact path, which divides.  About one vector in ten thousand of
 * Gaussian-like data takes it. */
static inline float kv_recip(float d) {
    const kv_u32 b = kv_f32_bits(d);
    /* d normal and below 2^126: 1/d is finite and normal */
    return (b >= 0x00800000u && b < 0x7E800000u) ? 1.0f / d : kv_bits_f32(0x7FC00000u);
}
KV_AVX2_INLINE __m256 v_off_grid(__m256 t, __m256 rt, float limit) {
    __m256 dist = _mm256_castsi256_ps(v_abs_bits(_mm256_sub_ps(t, rt)));
    return _mm256_cmp_ps(dist, _mm256_set1_ps(limit), _CMP_NLT_UQ); /* !(dist < limit): NaN too */
}
#define KV_FP8_LIMIT (0.5f - 1.52587890625e-05f)  /* 0.5 - 2^-16; |t| <= 16 */
#define KV_INT8_LIMIT (0.5f - 1.220703125e-04f)   /* 0.5 - 2^-13; |q| <= 128 */
#define KV_INT4_LIMIT (0.5f - 1.52587890625e-05f) /* 0.5 - 2^-16; 0 <= q <= 16 */
/* E4M3 of q': t = |q'| scaled by 2^(3 - E) (E the binade, at least -6: the subnormal grid
 * 2^-9 continues the lowest binade's) lies in [0, 16); its nearest integer n (rounded to
 * even) is the mantissa with the implicit bit, code = 8 * (E + 6) + n, which carries into
 * the exponent by itself and saturates at 0x7E (448).  q' is never NaN here. */
KV_AVX2_INLINE __m256i v_fp8_fast(__m256 x, __m256 r, __m256* unsafe) {
    const __m256 q = _mm256_mul_ps(x, r);
    const __m256i u = _mm256_castps_si256(q);
    const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i be = _mm256_max_epi32(_mm256_srli_epi32(a, 23), _mm256_set1_epi32(121));
    const __m256 sc = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(257), be), 23));
    const __m256 t = _mm256_mul_ps(_mm256_castsi256_ps(a), sc);
    const __m256 rt = v_rint(t);
    *unsafe = _mm256_or_ps(*unsafe, v_off_grid(t, rt, KV_FP8_LIMIT));
    __m256i code = _mm256_add_epi32(_mm256_cvttps_epi32(rt), _mm256_slli_epi32(be, 3));
    code = _mm256_min_epu32(_mm256_sub_epi32(code, _mm256_set1_epi32(968)), _mm256_set1_epi32(0x7E));
    return _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80)));
}
KV_AVX2_INLINE __m256i v_int8_fast(__m256 x, __m256 r, __m256* unsafe) {
    const __m256 q = _mm256_mul_ps(x, r);
    const __m256 rq = v_rint(q);
    *unsafe = _mm256_or_ps(*unsafe, v_off_grid(q, rq, KV_INT8_LIMIT));
    return _mm256_cvttps_epi32(v_clamp(rq, -127.0f, 127.0f));
}
KV_AVX2_INLINE __m256i v_int4_fast(__m256 x, __m256 lo, __m256 r, __m256* unsafe) {
    const __m256 q = _mm256_mul_ps(_mm256_sub_ps(x, lo), r);
    const __m256 rq = v_rint(q);
    *unsafe = _mm256_or_ps(*unsafe, v_off_grid(q, rq, KV_INT4_LIMIT));
    return _mm256_cvttps_epi32(v_clamp(rq, 0.0f, 15.0f));
}
KV_AVX2_INLINE int v_any(__m256 m) { return !_mm256_testz_ps(m, m); }

/* x * r of sixteen lanes as float16, rounded to nearest even (mode 0) or toward zero. */
KV_AVX2_INLINE __m256i v_half16(__m256 x0, __m256 x1, __m256 r, int mode) {
    const __m128i h0 = mode ? _mm256_cvtps_ph(_mm256_mul_ps(x0, r), _MM_FROUND_TO_ZERO)
                            : _mm256_cvtps_ph(_mm256_mul_ps(x0, r), _MM_FROUND_TO_NEAREST_INT);
    const __m128i h1 = mode ? _mm256_cvtps_ph(_mm256_mul_ps(x1, r), _MM_FROUND_TO_ZERO)
                            : _mm256_cvtps_ph(_mm256_mul_ps(x1, r), _MM_FROUND_TO_NEAREST_INT);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(h0), h1, 1);
}
/* fp8 of sixteen lanes from two float16 truncations that bracket q: lo = RZ(x * r (1 - 2^-19))
 * and hi = RZ(x * r (1 + 2^-19)) satisfy lo <= q < hi + one float16 ulp in magnitude.  E4M3
 * rounding midpoints from 2^-6 up are float16 values; with half-up rounding of lo and of hi
 * (codes c(lo) and c(hi): the number of midpoints at or below each), c(lo) == c(hi) means
 * no midpoint M has lo < M <= hi, so every M is either <= lo (then q > M) or > hi (then
 * q < M): q's code is c(lo).  They differ when the bracket straddles a midpoint (about one
 * lane in 2^15) and when it reaches into [2^-10, 2^-6) (the E4M3 subnormal grid): exact
 * path.  No tie can remain: q equal to a midpoint has one inside the bracket.  The bracket
 * holds because x * r_lo and x * r_hi are within 5 float32 ulps of q (1 -/+ 2^-19), far
 * inside the 2^-19 nudge.  c(v) = (|v| - 0x1FC0) >> 7, saturating, is 0 under 2^-10; in a
 * fast row |q'| <= 448 (1 + 2^-21), so hi <= 448 and no code passes 0x7E.  Truncation
 * keeps the sign (and -0). */
KV_AVX2_INLINE __m256i v_fp8_code16(__m256i ha) {
    return _mm256_srli_epi16(_mm256_subs_epu16(ha, _mm256_set1_epi16(0x1FC0)), 7);
}
KV_AVX2_INLINE __m256i v_fp8_bracket16(__m256 x0, __m256 x1, __m256 rlo, __m256 rhi, __m256i* unsafe) {
    const __m256i mag = _mm256_set1_epi16(0x7FFF);
    const __m256i lo = v_half16(x0, x1, rlo, 1);
    const __m256i lo_a = _mm256_and_si256(lo, mag);
    const __m256i code = v_fp8_code16(lo_a);
    const __m256i hi_a = _mm256_and_si256(v_half16(x0, x1, rhi, 1), mag);
    const __m256i code_hi = v_fp8_code16(hi_a);
    /* the bracket reaches into [2^-10, 2^-6) */
    const __m256i low = _mm256_and_si256(_mm256_cmpgt_epi16(hi_a, _mm256_set1_epi16(0x13FF)),
                                         _mm256_cmpgt_epi16(_mm256_set1_epi16(0x2400), lo_a));
    *unsafe = _mm256_or_si256(*unsafe, _mm256_or_si256(low, _mm256_xor_si256(_mm256_cmpeq_epi16(code, code_hi),
                                                                              _mm256_set1_epi16(-1))));
    return _mm256_or_si256(code, _mm256_and_si256(_mm256_srli_epi16(lo, 8), _mm256_set1_epi16(0x80)));
}

/* 32 codes of a row at out: fast path where it is safe, else the exact one. */
KV_AVX2_INLINE void fp8_v_quant32(kv_u8* out, __m256 x0, __m256 x1, __m256 x2, __m256 x3, __m256 r, __m256 dv,
                                  int fast) {
    if (fast) {
        __m256i un = _mm256_setzero_si256();
        const __m256 rlo = _mm256_mul_ps(r, _mm256_set1_ps(1.0f - 1.9073486328125e-06f)); /* 1 - 2^-19 */
        const __m256 rhi = _mm256_mul_ps(r, _mm256_set1_ps(1.0f + 1.9073486328125e-06f));
        const __m256i a = v_fp8_bracket16(x0, x1, rlo, rhi, &un), b = v_fp8_bracket16(x2, x3, rlo, rhi, &un);
        if (_mm256_testz_si256(un, un)) {
            _mm256_storeu_si256((__m256i*)out, _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xD8));
            return;
        }
    }
    v_store32_u8(out, v_fp8_quant(x0, dv), v_fp8_quant(x1, dv), v_fp8_quant(x2, dv), v_fp8_quant(x3, dv));
}
KV_AVX2_INLINE void int8_v_quant32(kv_u8* out, __m256 x0, __m256 x1, __m256 x2, __m256 x3, __m256 r, __m256 dv,
                                   int fast) {
    if (fast) {
        __m256 un = _mm256_setzero_ps();
        const __m256i c0 = v_int8_fast(x0, r, &un), c1 = v_int8_fast(x1, r, &un);
        const __m256i c2 = v_int8_fast(x2, r, &un), c3 = v_int8_fast(x3, r, &un);
        if (!v_any(un)) {
            v_store32_i8(out, c0, c1, c2, c3);
            return;
        }
    }
    v_store32_i8(out, v_int8_quant(x0, dv), v_int8_quant(x1, dv), v_int8_quant(x2, dv), v_int8_quant(x3, dv));
}
KV_AVX2_INLINE void fp8_v_quant8(kv_u8* out, __m256 x0, __m256 r, __m256 dv, int fast) {
    __m256 un = _mm256_setzero_ps();
    __m256i c = fast ? v_fp8_fast(x0, r, &un) : _mm256_setzero_si256();
    if (!fast || v_any(un)) c = v_fp8_quant(x0, dv);
    v_store8_u8(out, c);
}
KV_AVX2_INLINE void int8_v_quant8(kv_u8* out, __m256 x0, __m256 r, __m256 dv, int fast) {
    __m256 un = _mm256_setzero_ps();
    __m256i c = fast ? v_int8_fast(x0, r, &un) : _mm256_setzero_si256();
    if (!fast || v_any(un)) c = v_int8_quant(x0, dv);
    v_store8_i8(out, c);
}

/* Magnitude maximum of a row, as float32 bits (>= 0x7F800000: NaN or infinity present). */
KV_AVX2_INLINE kv_u32 v_amax16(const kv_u16* p, idx n) {
    __m256i m = _mm256_setzero_si256();
    idx i = 0;
    for (; i + 16 <= n; i += 16)
        m = _mm256_max_epu16(m, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(p + i)),
                                                 _mm256_set1_epi16(0x7FFF)));
    __m128i h = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    /* the maximum of eight u16 lanes is the complement of the minimum of their complements */
    h = _mm_minpos_epu16(_mm_xor_si128(h, _mm_set1_epi16(-1)));
    kv_u32 best = (kv_u32)(~_mm_cvtsi128_si32(h) & 0xFFFF);
    for (; i < n; ++i) {
        kv_u32 v = (kv_u32)(p[i] & 0x7FFFu);
        best = v > best ? v : best;
    }
    return best;
}
KV_AVX2_INLINE kv_u32 v_amax_F16(const void* x, idx base, idx n) {
    const kv_u32 m = v_amax16((const kv_u16*)x + base, n);
    /* kv_f16_to_f32 is for finite halves: infinity and NaN map to float32 infinity here */
    return m >= NONFINITE_F16 ? 0x7F800000u : kv_f32_bits(kv_f16_to_f32((kv_u16)m));
}
KV_AVX2_INLINE kv_u32 v_amax_BF16(const void* x, idx base, idx n) {
    return v_amax16((const kv_u16*)x + base, n) << 16;
}
KV_AVX2_INLINE kv_u32 v_amax_F32(const void* x, idx base, idx n) {
    const float* p = (const float*)x + base;
    __m256i m = _mm256_setzero_si256();
    idx i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_epu32(m, v_abs_bits(_mm256_loadu_ps(p + i)));
    kv_u32 best = v_hmax_u32(m);
    for (; i < n; ++i) {
        kv_u32 v = kv_f32_bits(p[i]) & 0x7FFFFFFFu;
        best = v > best ? v : best;
    }
    return best;
}

/* Software prefetch ahead of an encode's sequential read of its input.  On a cache read
 * from memory (a 1 GiB cache in 4 MiB chunks) the hardware prefetcher alone left the AVX2
 * and AVX-512 encodes at two thirds of their in-cache speed: fp8 3.2 GB/s against 4.9
 * with these prefetches 4 KiB ahead (1 KiB: 4.4, 8 and 16 KiB: 4.7; docs/benchmarks.md). */
#define KV_PREFETCH_AHEAD 4096
typedef struct {
    const char* next; /* first byte not yet prefetched */
    const char* end;
} kv_prefetcher;
static inline kv_prefetcher kv_prefetch_start(const void* p, idx bytes) {
    kv_prefetcher pf = {(const char*)p, (const char*)p + bytes};
    return pf;
}
/* prefetch up to KV_PREFETCH_AHEAD bytes past `upto` (the end of what is read next) */
static inline void kv_prefetch_to(kv_prefetcher* pf, const void* upto) {
    const char* stop = (const char*)upto + KV_PREFETCH_AHEAD;
    if (stop > pf->end) stop = pf->end;
    for (; pf->next < stop; pf->next += 64) __builtin_prefetch(pf->next, 0, 3);
}
#define ITEMSIZE_F16 2
#define ITEMSIZE_BF16 2
#define ITEMSIZE_F32 4
/* fp8 / int8 encode: per row, the magnitude maximum (scale), then one quantize pass
 * reading the row again (from L1), 32 elements at a time, multiply-then-verify (BLOCK32: the
 * ISA's 32-element step). */
#define SIMD_ROWWISE_ENCODE(NAME, ISA, ATTR, SUF, SCALE, QUANT, CODE_T, BLOCK32)                \
    ATTR static int NAME##_encode_##ISA##_##SUF(const void* restrict x, idx rows, idx dim,     \
                                                kv_u8* restrict scales, kv_u8* restrict codes, \
                                                float* restrict rowtmp) {                      \
        (void)rowtmp;                                                                          \
        kv_prefetcher pf = kv_prefetch_start(x, rows * dim * ITEMSIZE_##SUF);                  \
        for (idx r = 0; r < rows; ++r) {                                                       \
            const idx base = r * dim;                                                          \
            kv_prefetch_to(&pf, (const char*)x + (base + dim) * ITEMSIZE_##SUF);               \
            const kv_u32 amax = v_amax_##SUF(x, base, dim);                                    \
            if (amax >= 0x7F800000u) return KV_E_NONFINITE;                                    \
            const float s = SCALE(kv_bits_f32(amax));                                          \
            st_f32(scales, r, s);                                                              \
            const float rcp = kv_recip(kv_divisor(s));                                         \
            const int fast = rcp == rcp; /* not NaN */                                         \
            const __m256 dv = _mm256_set1_ps(kv_divisor(s)), rv = _mm256_set1_ps(rcp);         \
            kv_u8* restrict out = codes + base;                                                \
            idx d = 0;                                                                         \
            for (; d + 32 <= dim; d += 32) BLOCK32(NAME, SUF);                                 \
            for (; d + 8 <= dim; d += 8) NAME##_v_quant8(out + d, v_ld_##SUF(x, base + d), rv, dv, fast); \
            for (; d < dim; ++d) ((CODE_T*)out)[d] = QUANT(LOAD_##SUF(x, base + d), s);        \
        }                                                                                      \
        return KV_OK;                                                                          \
    }
/* 32 codes at out + d: the fast path where safe (``fast`` a per-vector argument), else exact */
#define V_BLOCK32(NAME, SUF, FAST)                                                             \
    NAME##_v_quant32(out + d, v_ld_##SUF(x, base + d), v_ld_##SUF(x, base + d + 8),            \
                     v_ld_##SUF(x, base + d + 16), v_ld_##SUF(x, base + d + 24), rv, dv, FAST)
#define V_BLOCK32_AVX2(NAME, SUF) V_BLOCK32(NAME, SUF, fast)
#define V_ROWWISE_ENCODE(NAME, SUF, SCALE, QUANT, CODE_T) \
    SIMD_ROWWISE_ENCODE(NAME, avx2, KV_AVX2, SUF, SCALE, QUANT, CODE_T, V_BLOCK32_AVX2)

/* fp8 / int8 decode: eight codes at a time straight into the output row.  Bad codes and
 * the largest result are found per row from the codes: fp8's NaN codes are the largest
 * 7-bit magnitude (0x7F) and int8's -128 the largest absolute value (128), and |code| *
 * scale (one rounding, scale >= +0) grows with |code|, so the row's largest result is
 * its largest code's. */
KV_AVX2_INLINE kv_u32 fp8_v_rowmax(const kv_u8* c, idx n) {
    __m256i m = _mm256_setzero_si256();
    idx i = 0;
    for (; i + 32 <= n; i += 32)
        m = _mm256_max_epu8(m, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(c + i)), _mm256_set1_epi8(0x7F)));
    __m128i h = _mm_max_epu8(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epu8(h, _mm_srli_si128(h, 8));
    h = _mm_max_epu8(h, _mm_srli_si128(h, 4));
    h = _mm_max_epu8(h, _mm_srli_si128(h, 2));
    h = _mm_max_epu8(h, _mm_srli_si128(h, 1));
    kv_u32 best = (kv_u32)(_mm_cvtsi128_si32(h) & 0xFF);
    for (; i < n; ++i) best = (kv_u32)(c[i] & 0x7Fu) > best ? (kv_u32)(c[i] & 0x7Fu) : best;
    return best;
}
KV_AVX2_INLINE kv_u32 int8_v_rowmax(const kv_u8* c, idx n) {
    __m256i m = _mm256_setzero_si256();
    idx i = 0;
    for (; i + 32 <= n; i += 32) m = _mm256_max_epu8(m, _mm256_abs_epi8(_mm256_loadu_si256((const __m256i*)(c + i))));
    __m128i h = _mm_max_epu8(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epu8(h, _mm_srli_si128(h, 8));
    h = _mm_max_epu8(h, _mm_srli_si128(h, 4));
    h = _mm_max_epu8(h, _mm_srli_si128(h, 2));
    h = _mm_max_epu8(h, _mm_srli_si128(h, 1));
    kv_u32 best = (kv_u32)(_mm_cvtsi128_si32(h) & 0xFF);
    for (; i < n; ++i) {
        kv_u32 a = (kv_u32)(c[i] & 0x80u ? 256u - c[i] : c[i]);
        best = a > best ? a : best;
    }
    return best;
}
#define fp8_ROWBAD(m) ((m) == 0x7Fu)
#define int8_ROWBAD(m) ((m) == 128u)
#define fp8_ROWVAL(m, s) kv_fp8_dequant((kv_u8)(m), s)
#define int8_ROWVAL(m, s) kv_mul((float)(m), s)

/* fp8 code bytes (eight, in 32-bit lanes) to values * s: the E4M3 field shifted into the
 * float32 field is the value * 2^-120 exactly (subnormal codes included); the sign is
 * applied after the product (kv_mul(kv_neg(m), s) == -(m * s): rounding is symmetric). */
KV_AVX2_INLINE __m256 fp8_v_scaled(__m256i c, __m256 s) {
    const __m256 mag = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(c, 20), _mm256_set1_epi32(0x07F00000)));
    const __m256 v = _mm256_mul_ps(_mm256_mul_ps(mag, _mm256_set1_ps(1.329227995784916e36f /* 2^120 */)), s);
    return _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(c, 24), _mm256_set1_epi32((int)0x80000000u))));
}
KV_AVX2_INLINE __m256 int8_v_scaled(__m256i c, __m256 s) { return _mm256_mul_ps(_mm256_cvtepi32_ps(c), s); }

#define SIMD_ROWWISE_DECODE(NAME, ISA, ATTR, SUF, DEQUANT, CODE_T, VLOAD, WIDE)                \
    ATTR static int NAME##_decode_##ISA##_##SUF(const kv_u8* restrict codes_,                 \
                                                const kv_u8* restrict scales, idx rows, idx dim, \
                                                void* restrict out, float* restrict rowtmp) {  \
        const CODE_T* restrict codes = (const CODE_T*)codes_;                                  \
        (void)rowtmp;                                                                          \
        idx step = KV_BLOCK_ELEMS / dim;                                                       \
        if (step < 1) step = 1;                                                                \
        for (idx r0 = 0; r0 < rows; r0 += step) {                                              \
            const idx r1 = r0 + step < rows ? r0 + step : rows;                                \
            int bad = 0;                                                                       \
            kv_u32 vmax = 0;                                                                   \
            for (idx r = r0; r < r1; ++r) {                                                    \
                const float s = ld_f32(scales, r);                                             \
                const __m256 sv = _mm256_set1_ps(s);                                           \
                const idx base = r * dim;                                                      \
                const kv_u32 m = NAME##_v_rowmax(codes_ + base, dim);                          \
                bad |= NAME##_ROWBAD(m);                                                       \
                const kv_u32 vm = kv_f32_bits(NAME##_ROWVAL(m, s)) & 0x7FFFFFFFu;              \
                vmax = vm > vmax ? vm : vmax;                                                  \
                idx d = 0;                                                                     \
                WIDE(NAME, SUF);                                                               \
                for (; d + 8 <= dim; d += 8) {                                                 \
                    __m256i c = VLOAD(_mm_loadl_epi64((const __m128i*)(codes_ + base + d)));   \
                    v_st_##SUF(out, base + d, NAME##_v_scaled(c, sv));                         \
                }                                                                              \
                for (; d < dim; ++d) STORE_##SUF(out, base + d, DEQUANT(codes[base + d], s));  \
            }                                                                                  \
            if (bad) return KV_E_CODE;                                                         \
            { const int st_ = decoded_status(vmax, DT_##SUF); if (st_) return st_; }           \
        }                                                                                      \
        return KV_OK;                                                                          \
    }
#define V_NO_WIDE(NAME, SUF) ((void)0)
#define V_ROWWISE_DECODE(NAME, SUF, DEQUANT, CODE_T, VLOAD) \
    SIMD_ROWWISE_DECODE(NAME, avx2, KV_AVX2, SUF, DEQUANT, CODE_T, VLOAD, V_NO_WIDE)

#define V_FP8_ENC(SUF) V_ROWWISE_ENCODE(fp8, SUF, kv_fp8_scale, kv_fp8_quant, kv_u8)
#define V_INT8_ENC(SUF) V_ROWWISE_ENCODE(int8, SUF, kv_int8_scale, kv_int8_quant, signed char)
#define V_FP8_DEC(SUF) V_ROWWISE_DECODE(fp8, SUF, kv_fp8_dequant, kv_u8, _mm256_cvtepu8_epi32)
#define V_INT8_DEC(SUF) \
    V_ROWWISE_DECODE(int8, SUF, kv_int8_dequant, signed char, _mm256_cvtepi8_epi32)
V_FP8_ENC(F16) V_FP8_ENC(BF16) V_FP8_ENC(F32)
V_INT8_ENC(F16) V_INT8_ENC(BF16) V_INT8_ENC(F32)
V_FP8_DEC(F16) V_FP8_DEC(BF16) V_FP8_DEC(F32)
V_INT8_DEC(F16) V_INT8_DEC(BF16) V_INT8_DEC(F32)

/* int4 codes of 32 / 8 lanes: (x - lo) / d, multiply-then-verify as above.  In a fast lane
 * 0 <= x - lo <= hi - lo (lo, hi the group's minimum and maximum, rounding is monotonic),
 * so q' lies in [0, 15 (1 + 2^-21)] and rounds into [0, 15]: kv_clamp changes nothing and
 * is left out; lanes with a NaN reciprocal are sent to the exact path by the check. */
KV_AVX2_INLINE __m256i v_int4_fast_nc(__m256 x, __m256 lo, __m256 r, __m256* unsafe) {
    const __m256 q = _mm256_mul_ps(_mm256_sub_ps(x, lo), r);
    const __m256 rq = v_rint(q);
    *unsafe = _mm256_or_ps(*unsafe, v_off_grid(q, rq, KV_INT4_LIMIT));
    return _mm256_cvttps_epi32(rq);
}
KV_AVX2_INLINE void int4_v_quant32(kv_u8* out, const __m256* x, const __m256* lo, const __m256* r, const __m256* d) {
    __m256 un = _mm256_setzero_ps();
    __m256i c0 = v_int4_fast_nc(x[0], lo[0], r[0], &un), c1 = v_int4_fast_nc(x[1], lo[1], r[1], &un);
    __m256i c2 = v_int4_fast_nc(x[2], lo[2], r[2], &un), c3 = v_int4_fast_nc(x[3], lo[3], r[3], &un);
    if (v_any(un)) {
        c0 = v_int4_quant(x[0], lo[0], d[0]);
        c1 = v_int4_quant(x[1], lo[1], d[1]);
        c2 = v_int4_quant(x[2], lo[2], d[2]);
        c3 = v_int4_quant(x[3], lo[3], d[3]);
    }
    v_store32_u8(out, c0, c1, c2, c3);
}
KV_AVX2_INLINE void int4_v_quant8(kv_u8* out, __m256 x, __m256 lo, __m256 r, __m256 d) {
    __m256 un = _mm256_setzero_ps();
    __m256i c = v_int4_fast_nc(x, lo, r, &un);
    if (v_any(un)) c = v_int4_quant(x, lo, d);
    v_store8_u8(out, c);
}

/* Runs' minimum (in L) and maximum (in S) to the stored minimum (canonical zero) and scale
 * (kv_int4_scale), with the reciprocal of the divisor in R (kv_recip); four runs at a time
 * (x + 0 is x for every float but -0, which becomes +0: kv_canonical_zero).  Returns
 * nonzero when a scale is not finite (KV_E_RANGE).  kv_int4_fit is left out in the lanes:
 * it only changes a scale whose top code decodes past float32 (15 * s + lo, as the decoder
 * computes it), which the lanes check; four runs with such a lane (a maximum within a few
 * ulps of the float32 maximum and a large positive minimum), or with a scale that is not
 * finite, are done again by kv_int4_scale itself. */
static int int4_run_scales(float* L, float* S, float* R, idx runs) {
    int range = 0;
    for (idx k = 0; k < runs; ++k) {
        const float l = kv_canonical_zero(L[k]);
        const float s = kv_int4_scale(l, kv_canonical_zero(S[k]));
        range |= (kv_f32_bits(s) & 0x7FFFFFFFu) >= 0x7F800000u;
        L[k] = l;
        S[k] = s;
        R[k] = kv_recip(kv_divisor(s));
    }
    return range;
}
KV_AVX2 static int int4_v_run_scales(float* L, float* S, float* R, idx runs) {
    idx k = 0;
    int range = 0;
    for (; k + 4 <= runs; k += 4) {
        const __m128 l = _mm_add_ps(_mm_loadu_ps(L + k), _mm_setzero_ps());
        const __m128 h = _mm_add_ps(_mm_loadu_ps(S + k), _mm_setzero_ps());
        const __m128 s = _mm_div_ps(_mm_sub_ps(h, l), _mm_set1_ps(15.0f));
        const __m128 top = _mm_add_ps(_mm_mul_ps(s, _mm_set1_ps(15.0f)), l);
        const __m128i tb = _mm_and_si128(_mm_castps_si128(top), _mm_set1_epi32(0x7FFFFFFF));
        if (__builtin_expect(!_mm_testz_si128(_mm_cmpgt_epi32(tb, _mm_set1_epi32(0x7F7FFFFF)), _mm_set1_epi32(-1)), 0)) {
            range |= int4_run_scales(L + k, S + k, R + k, 4);
            continue;
        }
        const __m128i sb = _mm_and_si128(_mm_castps_si128(s), _mm_set1_epi32(0x7FFFFFFF));
        const __m128 d = _mm_blendv_ps(s, _mm_set1_ps(1.0f), _mm_castsi128_ps(_mm_cmpeq_epi32(sb, _mm_setzero_si128())));
        const __m128i db = _mm_castps_si128(d);
        const __m128i ok = _mm_and_si128(_mm_cmpgt_epi32(db, _mm_set1_epi32(0x007FFFFF)),
                                         _mm_cmpgt_epi32(_mm_set1_epi32(0x7E800000), db));
        const __m128 r = _mm_blendv_ps(_mm_castsi128_ps(_mm_set1_epi32(0x7FC00000)),
                                       _mm_div_ps(_mm_set1_ps(1.0f), d), _mm_castsi128_ps(ok));
        _mm_storeu_ps(L + k, l);
        _mm_storeu_ps(S + k, s);
        _mm_storeu_ps(R + k, r);
    }
    return range | int4_run_scales(L + k, S + k, R + k, runs - k);
}

/* pack_append with 32 codes to 16 bytes at a time while the output is on a byte boundary */
KV_AVX2 static void pack_append_avx2(packer* pk, const kv_u8* c, idx n) {
    idx i = 0;
    if (!pk->odd) {
        kv_u8* p = pk->p;
        for (; i + 32 <= n; i += 32) {
            __m256i m = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i*)(c + i)), _mm256_set1_epi16(0x1001));
            m = _mm256_permute4x64_epi64(_mm256_packus_epi16(m, m), 0x08);
            _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(m));
            p += 16;
        }
        pk->p = p;
    }
    pack_append(pk, c + i, n - i);
}

/* K: eight channels of a token into the group's running minima and maxima (the token
 * the group's first: they start from it); the magnitude maximum carried on */
KV_AVX2_INLINE __m256i int4_k_minmax8(__m256 v, int first, float* fmin, float* fmax, __m256i vmag) {
    __m256 vl = v, vh = v;
    if (!first) {
        vl = _mm256_min_ps(v, _mm256_loadu_ps(fmin));
        vh = _mm256_max_ps(v, _mm256_loadu_ps(fmax));
    }
    _mm256_storeu_ps(fmin, vl);
    _mm256_storeu_ps(fmax, vh);
    return _mm256_max_epu32(vmag, v_abs_bits(v));
}
/* K: a group's (block b's) channel minima and maxima to its stored minimums and scales,
 * and per channel in lo, hi, rcp the minimum, the scale and the reciprocal of its
 * divisor.  Nonzero when a scale is not finite (KV_E_RANGE). */
static inline int int4_k_group_scales(const float* fmin, const float* fmax, idx hd, idx b, float* lo, float* hi,
                                      float* rcp, kv_u8* scales, kv_u8* mins) {
    int range = 0;
    for (idx c = 0; c < hd; ++c) {
        const float l = kv_canonical_zero(fmin[c]);
        const float s = kv_int4_scale(l, kv_canonical_zero(fmax[c]));
        range |= (kv_f32_bits(s) & 0x7FFFFFFFu) >= 0x7F800000u;
        lo[c] = l;
        hi[c] = s;
        rcp[c] = kv_recip(kv_divisor(s));
        st_f32(scales, b * hd + c, s);
        st_f32(mins, b * hd + c, l);
    }
    return range;
}

/* K: the channels of a token past the last eight, one at a time, as int4_k_minmax8 */
#define INT4_K_MINMAX_TAIL(SUF)                                                              \
    for (; c < hd; ++c) {                                                                    \
        float v = LOAD_##SUF(x, base + c);                                                   \
        kv_u32 m = MAG_##SUF(x, base + c);                                                   \
        mag = m > mag ? m : mag;                                                             \
        fmin[c] = (t == t0 || v < fmin[c]) ? v : fmin[c];                                    \
        fmax[c] = (t == t0 || v > fmax[c]) ? v : fmax[c];                                    \
    }

/* int4 encode: keys (K) per channel over the group's tokens, values (V) per run of a row.
 * Group minimum and maximum with minps/maxps on the (finite) values: they pick the same
 * value as the kernel's order keys except between -0 and +0, which canonical zero merges. */
#define V_INT4_ENCODE(SUF)                                                                   \
    KV_AVX2 static int int4_encode_avx2_##SUF(const void* x, idx tokens, idx heads, idx dim,   \
                                              idx group, int is_v, kv_u8* scales, kv_u8* mins, \
                                              kv_u8* packed, float* lo, float* hi,             \
                                              kv_u32* keys, kv_u8* tmp, float* rowtmp) {       \
        const idx hd = heads * dim;                                                            \
        packer pk = {packed, 0, 0};                                                            \
        kv_prefetcher pf = kv_prefetch_start(x, tokens * hd * ITEMSIZE_##SUF);                 \
        __m256i vmag = _mm256_setzero_si256();                                                 \
        kv_u32 mag = 0;                                                                        \
        if (!is_v) {                                                                           \
            float* fmin = (float*)keys;                                                        \
            float* fmax = (float*)keys + hd;                                                   \
            for (idx t0 = 0, b = 0; t0 < tokens; t0 += group, ++b) {                           \
                const idx t1 = t0 + group < tokens ? t0 + group : tokens;                      \
                for (idx t = t0; t < t1; ++t) {                                                \
                    const idx base = t * hd;                                                   \
                    kv_prefetch_to(&pf, (const char*)x + (base + hd) * ITEMSIZE_##SUF);        \
                    idx c = 0;                                                                 \
                    for (; c + 8 <= hd; c += 8)                                                \
                        vmag = int4_k_minmax8(v_ld_##SUF(x, base + c), t == t0, fmin + c, fmax + c, vmag); \
                    INT4_K_MINMAX_TAIL(SUF);                                                   \
                }                                                                              \
                if (v_hmax_u32(vmag) >= 0x7F800000u || mag >= NONFINITE_##SUF) return KV_E_NONFINITE; \
                if (int4_k_group_scales(fmin, fmax, hd, b, lo, hi, rowtmp, scales, mins)) return KV_E_RANGE; \
                for (idx t = t0; t < t1; ++t) {                                                \
                    const idx base = t * hd;                                                   \
                    idx c = 0;                                                                 \
                    for (; c + 32 <= hd; c += 32) {                                            \
                        __m256 xv[4], lv[4], rv[4], dv[4];                                     \
                        for (int k = 0; k < 4; ++k) {                                          \
                            xv[k] = v_ld_##SUF(x, base + c + 8 * k);                           \
                            lv[k] = _mm256_loadu_ps(lo + c + 8 * k);                           \
                            rv[k] = _mm256_loadu_ps(rowtmp + c + 8 * k);                       \
                            dv[k] = v_divisor(_mm256_loadu_ps(hi + c + 8 * k));                \
                        }                                                                      \
                        int4_v_quant32(tmp + c, xv, lv, rv, dv);                               \
                    }                                                                          \
                    for (; c + 8 <= hd; c += 8)                                                \
                        int4_v_quant8(tmp + c, v_ld_##SUF(x, base + c), _mm256_loadu_ps(lo + c), \
                                      _mm256_loadu_ps(rowtmp + c), v_divisor(_mm256_loadu_ps(hi + c))); \
                    for (; c < hd; ++c) tmp[c] = kv_int4_quant(LOAD_##SUF(x, base + c), lo[c], hi[c]); \
                    pack_append_avx2(&pk, tmp, hd);                                            \
                }                                                                              \
            }                                                                                  \
        } else {                                                                               \
            float* row = lo;                                                                   \
            for (idx r = 0; r < tokens * heads; ++r) {                                         \
                const idx base = r * dim;                                                      \
                kv_prefetch_to(&pf, (const char*)x + (base + dim) * ITEMSIZE_##SUF);           \
                idx d = 0;                                                                     \
                for (; d + 8 <= dim; d += 8) {                                                 \
                    __m256 v = v_ld_##SUF(x, base + d);                                        \
                    _mm256_storeu_ps(row + d, v);                                              \
                    vmag = _mm256_max_epu32(vmag, v_abs_bits(v));                              \
                }                                                                              \
                for (; d < dim; ++d) {                                                         \
                    row[d] = LOAD_##SUF(x, base + d);                                          \
                    kv_u32 m = MAG_##SUF(x, base + d);                                         \
                    mag = m > mag ? m : mag;                                                   \
                }                                                                              \
                if (v_hmax_u32(vmag) >= 0x7F800000u || mag >= NONFINITE_##SUF) return KV_E_NONFINITE; \
                const idx runs = (dim + group - 1) / group;                                    \
                float* L = hi;                                                                 \
                float* S = rowtmp;                                                             \
                float* R = (float*)keys;                                                       \
                for (idx k = 0; k < runs; ++k) { /* each run's minimum (L) and maximum (S) */ \
                    const idx d0 = k * group, d1 = d0 + group < dim ? d0 + group : dim;        \
                    float fl = row[d0], fh = row[d0];                                          \
                    idx e = d0;                                                                \
                    if (d1 - d0 >= 8) {                                                        \
                        __m256 vl = _mm256_loadu_ps(row + d0), vh = vl;                        \
                        for (e = d0 + 8; e + 8 <= d1; e += 8) {                                \
                            const __m256 v = _mm256_loadu_ps(row + e);                         \
                            vl = _mm256_min_ps(vl, v);                                         \
                            vh = _mm256_max_ps(vh, v);                                         \
                        }                                                                      \
                        fl = v_hmin_ps(vl);                                                    \
                        fh = v_hmax_ps(vh);                                                    \
                    }                                                                          \
                    for (; e < d1; ++e) {                                                      \
                        fl = row[e] < fl ? row[e] : fl;                                        \
                        fh = row[e] > fh ? row[e] : fh;                                        \
                    }                                                                          \
                    L[k] = fl;                                                                 \
                    S[k] = fh;                                                                 \
                }                                                                              \
                if (int4_v_run_scales(L, S, R, runs)) return KV_E_RANGE;                       \
                memcpy(scales + 4 * r * runs, S, 4 * (size_t)runs);                            \
                memcpy(mins + 4 * r * runs, L, 4 * (size_t)runs);                              \
                for (idx k = 0; k < runs; ++k) {                                               \
                    const idx d0 = k * group, d1 = d0 + group < dim ? d0 + group : dim;        \
                    const float l = L[k], s = S[k];                                            \
                    const __m256 lv = _mm256_set1_ps(l), dv = _mm256_set1_ps(kv_divisor(s));   \
                    const __m256 rv = _mm256_set1_ps(R[k]);                                    \
                    idx e = d0;                                                                \
                    for (; e + 32 <= d1; e += 32) {                                            \
                        const __m256 xv[4] = {_mm256_loadu_ps(row + e), _mm256_loadu_ps(row + e + 8), \
                                              _mm256_loadu_ps(row + e + 16), _mm256_loadu_ps(row + e + 24)}; \
                        const __m256 lvs[4] = {lv, lv, lv, lv}, rvs[4] = {rv, rv, rv, rv};   \
                        const __m256 dvs[4] = {dv, dv, dv, dv};                                \
                        int4_v_quant32(tmp + e, xv, lvs, rvs, dvs);                            \
                    }                                                                          \
                    for (; e + 8 <= d1; e += 8) int4_v_quant8(tmp + e, _mm256_loadu_ps(row + e), lv, rv, dv); \
                    for (; e < d1; ++e) tmp[e] = kv_int4_quant(row[e], l, s);                  \
                }                                                                              \
                pack_append_avx2(&pk, tmp, dim);                                               \
            }                                                                                  \
        }                                                                                      \
        (void)hi;                                                                              \
        pack_finish(&pk);                                                                      \
        return KV_OK;                                                                          \
    }

V_INT4_ENCODE(F16) V_INT4_ENCODE(BF16) V_INT4_ENCODE(F32)

/* sixteen int4 codes from eight packed bytes, as float32 in two vectors (element order) */
KV_AVX2_INLINE void v_nibbles16(const kv_u8* p, __m256* c0, __m256* c1) {
    __m128i b = _mm_loadl_epi64((const __m128i*)p);
    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
    __m128i il = _mm_unpacklo_epi8(lo, hi);
    *c0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(il));
    *c1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(il, 8)));
}

/* int4 decode: kv_int4_dequant (code * scale, then + minimum: two roundings) in lanes,
 * sixteen elements at a time where the row (K) or run (V) starts on a byte boundary. */
#define V_INT4_DECODE(SUF)                                                                   \
    KV_AVX2 static int int4_decode_avx2_##SUF(const kv_u8* packed, const kv_u8* scales,        \
                                              const kv_u8* mins, idx tokens, idx heads, idx dim, \
                                              idx group, int is_v, void* out, float* sc,       \
                                              float* mn, float* rowtmp) {                      \
        const idx hd = heads * dim;                                                            \
        __m256i vmx = _mm256_setzero_si256();                                                  \
        kv_u32 vmax = 0;                                                                       \
        (void)rowtmp;                                                                          \
        if (!is_v) {                                                                           \
            for (idx t = 0; t < tokens; ++t) {                                                 \
                const idx b = t / group;                                                       \
                if (t % group == 0) {                                                          \
                    memcpy(sc, scales + 4 * b * hd, 4 * (size_t)hd);                           \
                    memcpy(mn, mins + 4 * b * hd, 4 * (size_t)hd);                             \
                }                                                                              \
                const idx base = t * hd;                                                       \
                idx c = 0;                                                                     \
                if ((base & 1) == 0) {                                                         \
                    const kv_u8* p = packed + (base >> 1);                                     \
                    for (; c + 16 <= hd; c += 16) {                                            \
                        __m256 c0, c1;                                                         \
                        v_nibbles16(p + (c >> 1), &c0, &c1);                                   \
                        __m256 v0 = _mm256_add_ps(_mm256_mul_ps(c0, _mm256_loadu_ps(sc + c)),  \
                                                  _mm256_loadu_ps(mn + c));                    \
                        __m256 v1 = _mm256_add_ps(_mm256_mul_ps(c1, _mm256_loadu_ps(sc + c + 8)), \
                                                  _mm256_loadu_ps(mn + c + 8));                \
                        vmx = _mm256_max_epu32(vmx, _mm256_max_epu32(v_abs_bits(v0), v_abs_bits(v1))); \
                        v_st_##SUF(out, base + c, v0);                                         \
                        v_st_##SUF(out, base + c + 8, v1);                                     \
                    }                                                                          \
                }                                                                              \
                for (; c < hd; ++c) {                                                          \
                    float v = kv_int4_dequant(nib(packed, base + c), mn[c], sc[c]);            \
                    kv_u32 m = kv_f32_bits(v) & 0x7FFFFFFFu;                                   \
                    vmax = m > vmax ? m : vmax;                                                \
                    STORE_##SUF(out, base + c, v);                                             \
                }                                                                              \
            }                                                                                  \
        } else {                                                                               \
            const idx runs = (dim + group - 1) / group;                                        \
            for (idx r = 0; r < tokens * heads; ++r) {                                         \
                const idx base = r * dim;                                                      \
                for (idx k = 0; k < runs; ++k) {                                               \
                    const float s = ld_f32(scales, r * runs + k);                              \
                    const float l = ld_f32(mins, r * runs + k);                                \
                    const idx d0 = k * group, d1 = d0 + group < dim ? d0 + group : dim;        \
                    idx d = d0;                                                                \
                    if (((base + d0) & 1) == 0) {                                              \
                        const __m256 sv = _mm256_set1_ps(s), lv = _mm256_set1_ps(l);           \
                        const kv_u8* p = packed + ((base + d0) >> 1);                          \
                        for (; d + 16 <= d1; d += 16) {                                        \
                            __m256 c0, c1;                                                     \
                            v_nibbles16(p + ((d - d0) >> 1), &c0, &c1);                        \
                            __m256 v0 = _mm256_add_ps(_mm256_mul_ps(c0, sv), lv);              \
                            __m256 v1 = _mm256_add_ps(_mm256_mul_ps(c1, sv), lv);              \
                            vmx = _mm256_max_epu32(vmx, _mm256_max_epu32(v_abs_bits(v0), v_abs_bits(v1))); \
                            v_st_##SUF(out, base + d, v0);                                     \
                            v_st_##SUF(out, base + d + 8, v1);                                 \
                        }                                                                      \
                    }                                                                          \
                    for (; d < d1; ++d) {                                                      \
                        float v = kv_int4_dequant(nib(packed, base + d), l, s);                \
                        kv_u32 m = kv_f32_bits(v) & 0x7FFFFFFFu;                               \
                        vmax = m > vmax ? m : vmax;                                            \
                        STORE_##SUF(out, base + d, v);                                         \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        kv_u32 w = v_hmax_u32(vmx);                                                            \
        vmax = w > vmax ? w : vmax;                                                            \
        { const int st_ = decoded_status(vmax, DT_##SUF); if (st_) return st_; }               \
        return KV_OK;                                                                          \
    }

V_INT4_DECODE(F16) V_INT4_DECODE(BF16) V_INT4_DECODE(F32)

/* AVX-512 (F + BW) loops of fp8 and int8: the AVX2 loops' arithmetic lane for lane, on
 * sixteen float32 lanes (thirty-two for fp8's float16 brackets).  The fast path is the
 * same multiply-then-verify; a block with an unsafe lane, or a row without a usable
 * reciprocal, goes through the AVX2 loops' exact path; the per-row maxima (scale, bad
 * codes) are the AVX2 loops'.  int4 encode has loops of its own at this level (below); int4
 * decode keeps its AVX2 loop. */
#define KV_HAVE_AVX512 1
#define KV_AVX512 __attribute__((target("avx512f,avx512bw,avx2,f16c")))
#define KV_AVX512_INLINE __attribute__((target("avx512f,avx512bw,avx2,f16c"), always_inline)) static inline

KV_AVX512_INLINE __m512 w_ld_F16(const void* p, idx i) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const kv_u16*)p + i)));
}
KV_AVX512_INLINE __m512 w_ld_BF16(const void* p, idx i) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const kv_u16*)p + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
KV_AVX512_INLINE __m512 w_ld_F32(const void* p, idx i) { return _mm512_loadu_ps((const float*)p + i); }
KV_AVX512_INLINE __m256 w_lo(__m512 v) { return _mm512_castps512_ps256(v); }
KV_AVX512_INLINE __m256 w_hi(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
/* the stores of v_st_F16 (vcvtps2ph, round to nearest even), v_st_BF16 (on halves), v_st_F32 */
KV_AVX512_INLINE void w_st_F16(void* p, idx i, __m512 v) {
    _mm256_storeu_si256((__m256i*)((kv_u16*)p + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
KV_AVX512_INLINE void w_st_BF16(void* p, idx i, __m512 v) {
    v_st_BF16(p, i, w_lo(v));
    v_st_BF16(p, i + 8, w_hi(v));
}
KV_AVX512_INLINE void w_st_F32(void* p, idx i, __m512 v) { _mm512_storeu_ps((float*)p + i, v); }

/* v_half16 and v_fp8_bracket16 on thirty-two lanes: RZ(x * r) as float16, and the E4M3
 * codes of the bracket [RZ(x * rlo), RZ(x * rhi)] with the lanes it cannot decide. */
KV_AVX512_INLINE __m512i w_half32(__m512 x0, __m512 x1, __m512 r) {
    const __m256i h0 = _mm512_cvtps_ph(_mm512_mul_ps(x0, r), _MM_FROUND_TO_ZERO);
    const __m256i h1 = _mm512_cvtps_ph(_mm512_mul_ps(x1, r), _MM_FROUND_TO_ZERO);
    return _mm512_inserti64x4(_mm512_castsi256_si512(h0), h1, 1);
}
KV_AVX512_INLINE __m512i w_fp8_code32(__m512i ha) {
    return _mm512_srli_epi16(_mm512_subs_epu16(ha, _mm512_set1_epi16(0x1FC0)), 7);
}
KV_AVX512_INLINE __m512i w_fp8_bracket32(__m512 x0, __m512 x1, __m512 rlo, __m512 rhi, __mmask32* unsafe) {
    const __m512i mag = _mm512_set1_epi16(0x7FFF);
    const __m512i lo = w_half32(x0, x1, rlo);
    const __m512i lo_a = _mm512_and_si512(lo, mag);
    const __m512i code = w_fp8_code32(lo_a);
    const __m512i hi_a = _mm512_and_si512(w_half32(x0, x1, rhi), mag);
    const __m512i code_hi = w_fp8_code32(hi_a);
    /* the bracket reaches into [2^-10, 2^-6), or straddles a midpoint */
    const __mmask32 low = _mm512_cmpgt_epi16_mask(hi_a, _mm512_set1_epi16(0x13FF)) &
                          _mm512_cmpgt_epi16_mask(_mm512_set1_epi16(0x2400), lo_a);
    *unsafe |= low | _mm512_cmpneq_epi16_mask(code, code_hi);
    return _mm512_or_si512(code, _mm512_and_si512(_mm512_srli_epi16(lo, 8), _mm512_set1_epi16(0x80)));
}
/* 32 fp8 codes at out by the fast path (rcp: the row's reciprocal); 0 (nothing stored)
 * where a lane is unsafe */
KV_AVX512_INLINE int fp8_w_fast32(kv_u8* out, __m512 x0, __m512 x1, float rcp) {
    const __m512 r = _mm512_set1_ps(rcp);
    const __m512 rlo = _mm512_mul_ps(r, _mm512_set1_ps(1.0f - 1.9073486328125e-06f)); /* 1 - 2^-19 */
    const __m512 rhi = _mm512_mul_ps(r, _mm512_set1_ps(1.0f + 1.9073486328125e-06f));
    __mmask32 un = 0;
    const __m512i c = w_fp8_bracket32(x0, x1, rlo, rhi, &un);
    if (un) return 0;
    _mm256_storeu_si256((__m256i*)out, _mm512_cvtepi16_epi8(c)); /* codes <= 0xFE */
    return 1;
}
/* v_int8_fast on sixteen lanes */
KV_AVX512_INLINE __m512i w_int8_fast(__m512 x, __m512 r, __mmask16* unsafe) {
    const __m512 q = _mm512_mul_ps(x, r);
    const __m512 rq = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 dist = _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(q, rq)), _mm512_set1_epi32(0x7FFFFFFF)));
    *unsafe |= _mm512_cmp_ps_mask(dist, _mm512_set1_ps(KV_INT8_LIMIT), _CMP_NLT_UQ); /* NaN too */
    return _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(rq, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f)));
}
KV_AVX512_INLINE int int8_w_fast32(kv_u8* out, __m512 x0, __m512 x1, float rcp) {
    const __m512 r = _mm512_set1_ps(rcp);
    __mmask16 un = 0;
    const __m512i c0 = w_int8_fast(x0, r, &un), c1 = w_int8_fast(x1, r, &un);
    if (un) return 0;
    _mm_storeu_si128((__m128i*)out, _mm512_cvtsepi32_epi8(c0)); /* codes in [-127, 127] */
    _mm_storeu_si128((__m128i*)(out + 16), _mm512_cvtsepi32_epi8(c1));
    return 1;
}

/* the AVX2 block's 32 codes by the wide fast path, else the AVX2 exact path */
#define W_BLOCK32(NAME, SUF)                                                                   \
    if (!fast || !NAME##_w_fast32(out + d, w_ld_##SUF(x, base + d), w_ld_##SUF(x, base + d + 16), rcp)) \
    V_BLOCK32(NAME, SUF, 0)
#define W_ROWWISE_ENCODE(NAME, SUF, SCALE, QUANT, CODE_T) \
    SIMD_ROWWISE_ENCODE(NAME, avx512, KV_AVX512, SUF, SCALE, QUANT, CODE_T, W_BLOCK32)

/* fp8_v_scaled / int8_v_scaled on sixteen lanes */
KV_AVX512_INLINE __m512 fp8_w_scaled(__m512i c, __m512 s) {
    const __m512 mag = _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(c, 20), _mm512_set1_epi32(0x07F00000)));
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(mag, _mm512_set1_ps(1.329227995784916e36f /* 2^120 */)), s);
    return _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(v), _mm512_and_si512(_mm512_slli_epi32(c, 24), _mm512_set1_epi32((int)0x80000000u))));
}
KV_AVX512_INLINE __m512 int8_w_scaled(__m512i c, __m512 s) { return _mm512_mul_ps(_mm512_cvtepi32_ps(c), s); }

/* sixteen codes at a time before the AVX2 loop's eight */
#define W_WIDE(NAME, SUF)                                                                      \
    do {                                                                                       \
        const __m512 sw = _mm512_set1_ps(s);                                                   \
        for (; d + 16 <= dim; d += 16) {                                                       \
            __m512i c = NAME##_W_LOAD(_mm_loadu_si128((const __m128i*)(codes_ + base + d)));   \
            w_st_##SUF(out, base + d, NAME##_w_scaled(c, sw));                                 \
        }                                                                                      \
    } while (0)
#define fp8_W_LOAD _mm512_cvtepu8_epi32
#define int8_W_LOAD _mm512_cvtepi8_epi32
#define W_ROWWISE_DECODE(NAME, SUF, DEQUANT, CODE_T, VLOAD) \
    SIMD_ROWWISE_DECODE(NAME, avx512, KV_AVX512, SUF, DEQUANT, CODE_T, VLOAD, W_WIDE)

#define W_FP8_ENC(SUF) W_ROWWISE_ENCODE(fp8, SUF, kv_fp8_scale, kv_fp8_quant, kv_u8)
#define W_INT8_ENC(SUF) W_ROWWISE_ENCODE(int8, SUF, kv_int8_scale, kv_int8_quant, signed char)
#define W_FP8_DEC(SUF) W_ROWWISE_DECODE(fp8, SUF, kv_fp8_dequant, kv_u8, _mm256_cvtepu8_epi32)
#define W_INT8_DEC(SUF) W_ROWWISE_DECODE(int8, SUF, kv_int8_dequant, signed char, _mm256_cvtepi8_epi32)
W_FP8_ENC(F16) W_FP8_ENC(BF16) W_FP8_ENC(F32)
W_INT8_ENC(F16) W_INT8_ENC(BF16) W_INT8_ENC(F32)
W_FP8_DEC(F16) W_FP8_DEC(BF16) W_FP8_DEC(F32)
W_INT8_DEC(F16) W_INT8_DEC(BF16) W_INT8_DEC(F32)

/* int4 encode on sixteen lanes: the AVX2 loop's steps, codes by v_int4_fast_nc's
 * multiply-then-verify on sixteen lanes (a block of 32 or 16 with an unsafe lane takes the
 * AVX2 exact path, which divides), minima and maxima over sixteen lanes, and the codes
 * packed 64 at a time.  Same codes, scales and minimums as the AVX2 loop by construction:
 * the quantizer's arithmetic is lane for lane the same, and a minimum or maximum is exact
 * in any order of reduction (no NaN reaches it; -0 and +0 are merged afterwards). */
KV_AVX512_INLINE __m512i w_abs_bits(__m512 v) {
    return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF));
}
KV_AVX512_INLINE __m512i w_int4_fast_nc(__m512 x, __m512 lo, __m512 r, __mmask16* unsafe) {
    const __m512 q = _mm512_mul_ps(_mm512_sub_ps(x, lo), r);
    const __m512 rq = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 dist = _mm512_castsi512_ps(w_abs_bits(_mm512_sub_ps(q, rq)));
    *unsafe |= _mm512_cmp_ps_mask(dist, _mm512_set1_ps(KV_INT4_LIMIT), _CMP_NLT_UQ); /* NaN too */
    return _mm512_cvttps_epi32(rq);
}
/* n (16 or 32) codes of one run from row at out */
KV_AVX512_INLINE void int4_w_quant(kv_u8* out, const float* row, int n, __m512 lo, __m512 r, __m256 lo8, __m256 d8) {
    __mmask16 un = 0;
    const __m512i c0 = w_int4_fast_nc(_mm512_loadu_ps(row), lo, r, &un);
    const __m512i c1 = n == 32 ? w_int4_fast_nc(_mm512_loadu_ps(row + 16), lo, r, &un) : c0;
    if (!un) {
        _mm_storeu_si128((__m128i*)out, _mm512_cvtepi32_epi8(c0)); /* codes in [0, 15] */
        if (n == 32) _mm_storeu_si128((__m128i*)(out + 16), _mm512_cvtepi32_epi8(c1));
        return;
    }
    for (int k = 0; k < n; k += 8) v_store8_u8(out + k, v_int4_quant(_mm256_loadu_ps(row + k), lo8, d8));
}
/* 32 K codes of one token's channels: x0, x1 their values, lo, r and hi the channels'
 * minima, reciprocals and scales (the exact path divides by kv_divisor of the scale) */
KV_AVX512_INLINE void int4_w_quant_k(kv_u8* out, __m512 x0, __m512 x1, const float* lo, const float* r,
                                     const float* hi) {
    __mmask16 un = 0;
    const __m512i c0 = w_int4_fast_nc(x0, _mm512_loadu_ps(lo), _mm512_loadu_ps(r), &un);
    const __m512i c1 = w_int4_fast_nc(x1, _mm512_loadu_ps(lo + 16), _mm512_loadu_ps(r + 16), &un);
    if (!un) {
        _mm_storeu_si128((__m128i*)out, _mm512_cvtepi32_epi8(c0));
        _mm_storeu_si128((__m128i*)(out + 16), _mm512_cvtepi32_epi8(c1));
        return;
    }
    const __m256 xs[4] = {w_lo(x0), w_hi(x0), w_lo(x1), w_hi(x1)};
    for (int k = 0; k < 4; ++k)
        v_store8_u8(out + 8 * k, v_int4_quant(xs[k], _mm256_loadu_ps(lo + 8 * k), v_divisor(_mm256_loadu_ps(hi + 8 * k))));
}
/* int4_k_minmax8 on sixteen channels */
KV_AVX512_INLINE __m512i int4_k_minmax16(__m512 v, int first, float* fmin, float* fmax, __m512i wmag) {
    __m512 vl = v, vh = v;
    if (!first) {
        vl = _mm512_min_ps(v, _mm512_loadu_ps(fmin));
        vh = _mm512_max_ps(v, _mm512_loadu_ps(fmax));
    }
    _mm512_storeu_ps(fmin, vl);
    _mm512_storeu_ps(fmax, vh);
    return _mm512_max_epu32(wmag, w_abs_bits(v));
}
/* pack_append with 64 codes to 32 bytes at a time while the output is on a byte boundary */
KV_AVX512 static void pack_append_avx512(packer* pk, const kv_u8* c, idx n) {
    idx i = 0;
    if (!pk->odd) {
        kv_u8* p = pk->p;
        for (; i + 64 <= n; i += 64) {
            const __m512i m = _mm512_maddubs_epi16(_mm512_loadu_si512((const void*)(c + i)), _mm512_set1_epi16(0x1001));
            _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi16_epi8(m));
            p += 32;
        }
        pk->p = p;
    }
    pack_append_avx2(pk, c + i, n - i);
}
/* int4_v_run_scales on sixteen runs at a time */
KV_AVX512 static int int4_w_run_scales(float* L, float* S, float* R, idx runs) {
    idx k = 0;
    int range = 0;
    for (; k + 16 <= runs; k += 16) {
        const __m512 l = _mm512_add_ps(_mm512_loadu_ps(L + k), _mm512_setzero_ps());
        const __m512 h = _mm512_add_ps(_mm512_loadu_ps(S + k), _mm512_setzero_ps());
        const __m512 s = _mm512_div_ps(_mm512_sub_ps(h, l), _mm512_set1_ps(15.0f));
        const __m512 top = _mm512_add_ps(_mm512_mul_ps(s, _mm512_set1_ps(15.0f)), l);
        const __m512i tb = _mm512_and_si512(_mm512_castps_si512(top), _mm512_set1_epi32(0x7FFFFFFF));
        if (__builtin_expect(_mm512_cmpgt_epi32_mask(tb, _mm512_set1_epi32(0x7F7FFFFF)) != 0, 0)) {
            range |= int4_run_scales(L + k, S + k, R + k, 16);
            continue;
        }
        const __m512i sb = _mm512_and_si512(_mm512_castps_si512(s), _mm512_set1_epi32(0x7FFFFFFF));
        const __m512 d = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(sb, _mm512_setzero_si512()), s, _mm512_set1_ps(1.0f));
        const __m512i db = _mm512_castps_si512(d);
        const __mmask16 ok = _mm512_cmpgt_epi32_mask(db, _mm512_set1_epi32(0x007FFFFF)) &
                             _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(0x7E800000), db);
        const __m512 r = _mm512_mask_blend_ps(ok, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)),
                                              _mm512_div_ps(_mm512_set1_ps(1.0f), d));
        _mm512_storeu_ps(L + k, l);
        _mm512_storeu_ps(S + k, s);
        _mm512_storeu_ps(R + k, r);
    }
    return range | int4_v_run_scales(L + k, S + k, R + k, runs - k);
}
/* minima (maxima) of four sixteen-lane vectors as four floats, in order: halves, then
 * quarters of two vectors at once, then within each 128-bit lane (finite lanes; which of
 * -0 and +0 is unspecified) */
#define W_REDUCE4(NAME, OP)                                                                    \
    KV_AVX512_INLINE __m128 NAME(__m512 a, __m512 b, __m512 c, __m512 d) {                      \
        const __m512 ab = OP(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE)); \
        const __m512 cd = OP(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE)); \
        __m512 m = OP(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));  \
        m = OP(m, _mm512_permute_ps(m, 0x4E));                                                 \
        m = OP(m, _mm512_permute_ps(m, 0xB1));                                                 \
        return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), m)); \
    }
W_REDUCE4(w_min4, _mm512_min_ps)
W_REDUCE4(w_max4, _mm512_max_ps)
/* minimum and maximum of the n (a multiple of 16) values at p, as sixteen lanes each */
KV_AVX512_INLINE void w_minmax(const float* p, idx n, __m512* lo, __m512* hi) {
    __m512 vl = _mm512_loadu_ps(p), vh = vl;
    for (idx e = 16; e < n; e += 16) {
        const __m512 v = _mm512_loadu_ps(p + e);
        vl = _mm512_min_ps(vl, v);
        vh = _mm512_max_ps(vh, v);
    }
    *lo = vl;
    *hi = vh;
}
/* K as the AVX2 loop, sixteen channels at a time.  V a token (heads rows) at a time, not a
 * row: the token's rows to float32, every run's minimum and maximum (four whole runs at
 * once where every run is whole and a multiple of sixteen long), all their scales in one
 * pass, then the codes of the whole token packed at once. */
#define W_INT4_ENCODE(SUF)                                                                   \
    KV_AVX512 static int int4_encode_avx512_##SUF(const void* x, idx tokens, idx heads, idx dim, \
                                                  idx group, int is_v, kv_u8* scales, kv_u8* mins, \
                                                  kv_u8* packed, float* lo, float* hi,         \
                                                  kv_u32* keys, kv_u8* tmp, float* rowtmp) {   \
        const idx hd = heads * dim;                                                            \
        packer pk = {packed, 0, 0};                                                            \
        kv_prefetcher pf = kv_prefetch_start(x, tokens * hd * ITEMSIZE_##SUF);                 \
        __m512i wmag = _mm512_setzero_si512();                                                 \
        kv_u32 mag = 0;                                                                        \
        if (!is_v) {                                                                           \
            float* fmin = (float*)keys;                                                        \
            float* fmax = (float*)keys + hd;                                                   \
            __m256i vmag = _mm256_setzero_si256();                                             \
            for (idx t0 = 0, b = 0; t0 < tokens; t0 += group, ++b) {                           \
                const idx t1 = t0 + group < tokens ? t0 + group : tokens;                      \
                for (idx t = t0; t < t1; ++t) {                                                \
                    const idx base = t * hd;                                                   \
                    kv_prefetch_to(&pf, (const char*)x + (base + hd) * ITEMSIZE_##SUF);        \
                    idx c = 0;                                                                 \
                    for (; c + 16 <= hd; c += 16)                                              \
                        wmag = int4_k_minmax16(w_ld_##SUF(x, base + c), t == t0, fmin + c, fmax + c, wmag); \
                    for (; c + 8 <= hd; c += 8)                                                \
                        vmag = int4_k_minmax8(v_ld_##SUF(x, base + c), t == t0, fmin + c, fmax + c, vmag); \
                    INT4_K_MINMAX_TAIL(SUF);                                                   \
                }                                                                              \
                if (_mm512_cmpge_epu32_mask(wmag, _mm512_set1_epi32(0x7F800000)) ||            \
                    v_hmax_u32(vmag) >= 0x7F800000u || mag >= NONFINITE_##SUF)                 \
                    return KV_E_NONFINITE;                                                     \
                if (int4_k_group_scales(fmin, fmax, hd, b, lo, hi, rowtmp, scales, mins)) return KV_E_RANGE; \
                for (idx t = t0; t < t1; ++t) {                                                \
                    const idx base = t * hd;                                                   \
                    idx c = 0;                                                                 \
                    for (; c + 32 <= hd; c += 32)                                              \
                        int4_w_quant_k(tmp + c, w_ld_##SUF(x, base + c), w_ld_##SUF(x, base + c + 16), \
                                       lo + c, rowtmp + c, hi + c);                            \
                    for (; c + 8 <= hd; c += 8)                                                \
                        int4_v_quant8(tmp + c, v_ld_##SUF(x, base + c), _mm256_loadu_ps(lo + c), \
                                      _mm256_loadu_ps(rowtmp + c), v_divisor(_mm256_loadu_ps(hi + c))); \
                    for (; c < hd; ++c) tmp[c] = kv_int4_quant(LOAD_##SUF(x, base + c), lo[c], hi[c]); \
                    pack_append_avx512(&pk, tmp, hd);                                          \
                }                                                                              \
            }                                                                                  \
            pack_finish(&pk);                                                                  \
            return KV_OK;                                                                      \
        }                                                                                      \
        float* row = lo;                                                                       \
        const idx runs = (dim + group - 1) / group, truns = heads * runs;                      \
        float* L = hi;                                                                         \
        float* S = rowtmp;                                                                     \
        float* R = (float*)keys;                                                               \
        for (idx t = 0; t < tokens; ++t) {                                                     \
            const idx base = t * hd;                                                           \
            kv_prefetch_to(&pf, (const char*)x + (base + hd) * ITEMSIZE_##SUF);                \
            idx d = 0;                                                                         \
            for (; d + 16 <= hd; d += 16) {                                                    \
                const __m512 v = w_ld_##SUF(x, base + d);                                      \
                _mm512_storeu_ps(row + d, v);                                                  \
                wmag = _mm512_max_epu32(wmag, w_abs_bits(v)); \
            }                                                                                  \
            for (; d < hd; ++d) {                                                              \
                row[d] = LOAD_##SUF(x, base + d);                                              \
                kv_u32 m = MAG_##SUF(x, base + d);                                             \
                mag = m > mag ? m : mag;                                                       \
            }                                                                                  \
            if (_mm512_cmpge_epu32_mask(wmag, _mm512_set1_epi32(0x7F800000)) || mag >= NONFINITE_##SUF) \
                return KV_E_NONFINITE;                                                         \
            idx j = 0;                                                                         \
            if (group % 16 == 0 && dim % group == 0) /* every run full: four runs at a time */ \
                for (; j + 4 <= truns; j += 4) {                                               \
                    __m512 l0, h0, l1, h1, l2, h2, l3, h3;                                     \
                    w_minmax(row + j * group, group, &l0, &h0);                                \
                    w_minmax(row + (j + 1) * group, group, &l1, &h1);                          \
                    w_minmax(row + (j + 2) * group, group, &l2, &h2);                          \
                    w_minmax(row + (j + 3) * group, group, &l3, &h3);                          \
                    _mm_storeu_ps(L + j, w_min4(l0, l1, l2, l3));                              \
                    _mm_storeu_ps(S + j, w_max4(h0, h1, h2, h3));                              \
                }                                                                              \
            for (; j < truns; ++j) { /* each run's minimum (L) and maximum (S) */             \
                const idx k = j % runs, r0 = (j / runs) * dim;                                 \
                const idx d0 = r0 + k * group, d1 = k * group + group < dim ? d0 + group : r0 + dim; \
                float fl = row[d0], fh = row[d0];                                              \
                idx e = d0;                                                                    \
                if (d1 - d0 >= 16) {                                                           \
                    __m512 vl, vh;                                                             \
                    w_minmax(row + d0, (d1 - d0) & ~(idx)15, &vl, &vh);                        \
                    e = d0 + ((d1 - d0) & ~(idx)15);                                           \
                    fl = _mm512_reduce_min_ps(vl);                                             \
                    fh = _mm512_reduce_max_ps(vh);                                             \
                } else if (d1 - d0 >= 8) {                                                     \
                    fl = v_hmin_ps(_mm256_loadu_ps(row + d0));                                 \
                    fh = v_hmax_ps(_mm256_loadu_ps(row + d0));                                 \
                    e = d0 + 8;                                                                \
                }                                                                              \
                for (; e < d1; ++e) {                                                          \
                    fl = row[e] < fl ? row[e] : fl;                                            \
                    fh = row[e] > fh ? row[e] : fh;                                            \
                }                                                                              \
                L[j] = fl;                                                                     \
                S[j] = fh;                                                                     \
            }                                                                                  \
            if (int4_w_run_scales(L, S, R, truns)) return KV_E_RANGE;                          \
            memcpy(scales + 4 * t * truns, S, 4 * (size_t)truns);                              \
            memcpy(mins + 4 * t * truns, L, 4 * (size_t)truns);                                \
            for (idx j = 0; j < truns; ++j) {                                                  \
                const idx k = j % runs, r0 = (j / runs) * dim;                                 \
                const idx d0 = r0 + k * group, d1 = k * group + group < dim ? d0 + group : r0 + dim; \
                const float l = L[j], s = S[j];                                                \
                const __m512 lw = _mm512_set1_ps(l), rw = _mm512_set1_ps(R[j]);                \
                const __m256 lv = _mm256_set1_ps(l), dv = _mm256_set1_ps(kv_divisor(s));       \
                idx e = d0;                                                                    \
                for (; e + 32 <= d1; e += 32) int4_w_quant(tmp + e, row + e, 32, lw, rw, lv, dv); \
                if (e + 16 <= d1) {                                                            \
                    int4_w_quant(tmp + e, row + e, 16, lw, rw, lv, dv);                        \
                    e += 16;                                                                   \
                }                                                                              \
                if (e + 8 <= d1) {                                                             \
                    int4_v_quant8(tmp + e, _mm256_loadu_ps(row + e), lv, _mm256_set1_ps(R[j]), dv); \
                    e += 8;                                                                    \
                }                                                                              \
                for (; e < d1; ++e) tmp[e] = kv_int4_quant(row[e], l, s);                      \
            }                                                                                  \
            pack_append_avx512(&pk, tmp, hd);                                                  \
        }                                                                                      \
        pack_finish(&pk);                                                                      \
        return KV_OK;                                                                          \
    }
W_INT4_ENCODE(F16) W_INT4_ENCODE(BF16) W_INT4_ENCODE(F32)

static int have_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

static int have_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
#else
#define KV_HAVE_AVX2 0
#define KV_HAVE_AVX512 0
#endif

/* ------------------------------------------------------------------------------------ */
/* Python bindings.                                                                      */

static int need(Py_buffer* b, idx bytes, const char* what) {
    if (b->len != bytes) {
        PyErr_Format(PyExc_ValueError, "%s is %zd bytes, expected %zd", what, b->len, bytes);
        return 0;
    }
    return 1;
}

static idx itemsize(int dt) { return dt == DT_F32 ? 4 : 2; }

static int check_dt(int dt) {
    if (dt < 0 || dt > 2) {
        PyErr_SetString(PyExc_ValueError, "dtype code must be 0 (float16), 1 (bfloat16) or 2 (float32)");
        return 0;
    }
    return 1;
}

/* a and b positive, and a * b a size (no larger than PY_SSIZE_T_MAX): checked before
 * any product of sizes is formed, so no check or message sees a wrapped one */
static int check_sizes(idx a, idx b) {
    if (a <= 0 || b <= 0) {
        PyErr_SetString(PyExc_ValueError, "sizes must be positive");
        return 0;
    }
    if (a > PY_SSIZE_T_MAX / b) {
        PyErr_Format(PyExc_ValueError, "sizes too large: %zd * %zd is more than a buffer can hold", a, b);
        return 0;
    }
    return 1;
}

/* The loops read and write elements through typed pointers (restrict ones): an output
 * must not share a byte with an input or another output. */
static int apart(const Py_buffer* out, const char* out_what, const Py_buffer* other, const char* other_what) {
    const uintptr_t a = (uintptr_t)out->buf, b = (uintptr_t)other->buf;
    if (out->len > 0 && other->len > 0 && a < b + (uintptr_t)other->len && b < a + (uintptr_t)out->len) {
        PyErr_Format(PyExc_ValueError, "%s overlaps %s", out_what, other_what);
        return 0;
    }
    return 1;
}

typedef int (*rw_enc_fn)(const void*, idx, idx, kv_u8*, kv_u8*, float*);
typedef int (*rw_dec_fn)(const kv_u8*, const kv_u8*, idx, idx, void*, float*);
static const rw_enc_fn RW_ENC[2][3] = {{fp8_encode_F16, fp8_encode_BF16, fp8_encode_F32},
                                       {int8_encode_F16, int8_encode_BF16, int8_encode_F32}};
static const rw_dec_fn RW_DEC[2][3] = {{fp8_decode_F16, fp8_decode_BF16, fp8_decode_F32},
                                       {int8_decode_F16, int8_decode_BF16, int8_decode_F32}};
#if KV_HAVE_AVX2
static const rw_enc_fn RW_ENC_AVX2[2][3] = {
    {fp8_encode_avx2_F16, fp8_encode_avx2_BF16, fp8_encode_avx2_F32},
    {int8_encode_avx2_F16, int8_encode_avx2_BF16, int8_encode_avx2_F32}};
static const rw_dec_fn RW_DEC_AVX2[2][3] = {
    {fp8_decode_avx2_F16, fp8_decode_avx2_BF16, fp8_decode_avx2_F32},
    {int8_decode_avx2_F16, int8_decode_avx2_BF16, int8_decode_avx2_F32}};
static const rw_enc_fn RW_ENC_AVX512[2][3] = {
    {fp8_encode_avx512_F16, fp8_encode_avx512_BF16, fp8_encode_avx512_F32},
    {int8_encode_avx512_F16, int8_encode_avx512_BF16, int8_encode_avx512_F32}};
static const rw_dec_fn RW_DEC_AVX512[2][3] = {
    {fp8_decode_avx512_F16, fp8_decode_avx512_BF16, fp8_decode_avx512_F32},
    {int8_decode_avx512_F16, int8_decode_avx512_BF16, int8_decode_avx512_F32}};
#endif

/* Loops in use: SIMD_GENERIC (the C loops with kvquant.cuh's conversions, compiled as
 * function clones), SIMD_F16C (the same loops reading and writing float16 rows through
 * F16C), SIMD_AVX2 (the explicit AVX2 + F16C loops above) or SIMD_AVX512 (the AVX-512
 * loops of fp8 and int8, and of int4 encode).  Set at import to the best
 * the CPU has; simd(level) lowers it so that the tests compare every path. */
enum { SIMD_GENERIC = 0, SIMD_F16C = 1, SIMD_AVX2 = 2, SIMD_AVX512 = 3 };
static int kv_simd = SIMD_GENERIC;

/* Where a chunk's rows lie: the whole buffer in order, or (with spans) int64 (start, size)
 * byte ranges of it, in order, each a whole number of rows (the rows of a paged cache's
 * blocks).  Checks every range against the buffer, the row size and the element size.
 * With `skips` (a decode), a range may start at SKIP_RANGE: its rows are written nowhere
 * (a block the receiver drops). */
#define SKIP_RANGE (-1LL)
/* A K group copied whole into scratch holds at most the chunk's tokens (a group may be larger). */
#define MIN_IDX(a, b) ((a) < (b) ? (a) : (b))
typedef struct {
    long long* pairs; /* NULL: the buffer itself, from its start; else a copy of the spans */
    idx n;            /* ranges */
} row_ranges;

/* The loops read the ranges without the GIL, so they read a copy, checked as it is: the
 * caller's spans may change meanwhile (another thread, or spans lying in the output). */
static void ranges_free(row_ranges* rr) {
    free(rr->pairs);
    rr->pairs = NULL;
}

static int parse_ranges(Py_buffer* spans, Py_buffer* base, const char* what, idx rows, idx row_bytes, idx item,
                        int skips, row_ranges* rr) {
    rr->pairs = NULL;
    rr->n = 1;
    if (spans->obj == NULL) {
        if (!need(base, rows * row_bytes, what)) return 0;
        if ((uintptr_t)base->buf % (uintptr_t)item != 0) {
            PyErr_Format(PyExc_ValueError, "%s is not aligned to its %zd-byte elements", what, item);
            return 0;
        }
        return 1;
    }
    if (spans->len == 0 || spans->len % 16 != 0) {
        PyErr_SetString(PyExc_ValueError, "spans must be (start, size) int64 pairs");
        return 0;
    }
    rr->pairs = (long long*)malloc((size_t)spans->len);
    if (rr->pairs == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    memcpy(rr->pairs, spans->buf, (size_t)spans->len);
    rr->n = spans->len / 16;
    const idx want = rows * row_bytes;
    idx total = 0;
    for (idx i = 0; i < rr->n; i++) {
        const long long start = rr->pairs[2 * i], size = rr->pairs[2 * i + 1];
        if (size > 0 && (idx)size > want - total) { /* before the sum could wrap (a skipped range's size is unbounded) */
            PyErr_Format(PyExc_ValueError, "ranges hold more than the expected %zd bytes", want);
            return 0;
        }
        if (skips && start == SKIP_RANGE && size > 0 && size % row_bytes == 0) {
            total += (idx)size;
            continue;
        }
        if (start < 0 || size <= 0 || start > base->len || size > base->len - start) {
            PyErr_Format(PyExc_ValueError, "range %zd (%lld, %lld) is not in the %zd-byte %s", i, start,
                         size, base->len, what);
            return 0;
        }
        if (size % row_bytes != 0 || ((uintptr_t)base->buf + (uintptr_t)start) % (uintptr_t)item != 0) {
            PyErr_Format(PyExc_ValueError, "range %zd (%lld, %lld) is not whole aligned rows of %zd bytes", i, start,
                         size, row_bytes);
            return 0;
        }
        total += (idx)size;
    }
    if (total != want) {
        PyErr_Format(PyExc_ValueError, "ranges hold %zd bytes, expected %zd", total, want);
        return 0;
    }
    return 1;
}

/* The i-th range: its byte offset in the buffer and its rows. */
static void range_at(const row_ranges* rr, idx i, idx rows, idx row_bytes, idx* offset, idx* nrows) {
    if (rr->pairs == NULL) {
        *offset = 0;
        *nrows = rows;
        return;
    }
    *offset = (idx)rr->pairs[2 * i];
    *nrows = (idx)rr->pairs[2 * i + 1] / row_bytes;
}

static PyObject* py_encode_rows(PyObject* self, PyObject* args) {
    int kind, dt, st = KV_OK;
    idx rows, dim;
    Py_buffer x, sc, co, spans = {0};
    row_ranges rr = {NULL, 1};
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*innw*w*|y*", &kind, &x, &dt, &rows, &dim, &sc, &co, &spans)) return NULL;
    int ok = (kind == 0 || kind == 1) && check_dt(dt) && check_sizes(rows, dim) &&
             check_sizes(rows * dim, itemsize(dt)) && check_sizes(rows, 4) && need(&sc, rows * 4, "scales") &&
             need(&co, rows * dim, "codes") &&
             parse_ranges(&spans, &x, "input", rows, dim * itemsize(dt), itemsize(dt), 0, &rr) &&
             apart(&sc, "scales", &x, "input") && apart(&co, "codes", &x, "input") &&
             apart(&sc, "scales", &co, "codes");
    if (ok) {
        rw_enc_fn fn = RW_ENC[kind][dt];
#if KV_HAVE_AVX2
        if (kv_simd >= SIMD_AVX2) fn = RW_ENC_AVX2[kind][dt];
        if (kv_simd >= SIMD_AVX512) fn = RW_ENC_AVX512[kind][dt];
#endif
        float* rowtmp = (float*)malloc(sizeof(float) * (size_t)(dim + 1));
        if (rowtmp == NULL) {
            st = KV_E_NOMEM;
        } else {
            Py_BEGIN_ALLOW_THREADS
            KV_FP_ENTER
            idx done = 0;
            for (idx i = 0; i < rr.n && st == KV_OK; i++) {
                idx offset, n;
                range_at(&rr, i, rows, dim * itemsize(dt), &offset, &n);
                st = fn((const char*)x.buf + offset, n, dim, (kv_u8*)sc.buf + 4 * done,
                        (kv_u8*)co.buf + done * dim, rowtmp);
                done += n;
            }
            KV_FP_LEAVE
            Py_END_ALLOW_THREADS
        }
        free(rowtmp);
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "kind must be 0 (fp8) or 1 (int8)");
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&sc);
    PyBuffer_Release(&co);
    if (spans.obj != NULL) PyBuffer_Release(&spans);
    ranges_free(&rr);
    if (ok && st == KV_E_NOMEM) return PyErr_NoMemory();
    return ok ? PyLong_FromLong(st) : NULL;
}

static PyObject* py_decode_rows(PyObject* self, PyObject* args) {
    int kind, dt, st = KV_OK;
    idx rows, dim;
    Py_buffer sc, co, out, spans = {0};
    row_ranges rr = {NULL, 1};
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*y*nniw*|y*", &kind, &sc, &co, &rows, &dim, &dt, &out, &spans)) return NULL;
    int ok = (kind == 0 || kind == 1) && check_dt(dt) && check_sizes(rows, dim) &&
             check_sizes(rows * dim, itemsize(dt)) && check_sizes(rows, 4) && need(&sc, rows * 4, "scales") &&
             need(&co, rows * dim, "codes") &&
             parse_ranges(&spans, &out, "out", rows, dim * itemsize(dt), itemsize(dt), 1, &rr) &&
             apart(&out, "out", &sc, "scales") && apart(&out, "out", &co, "codes");
    if (ok) {
        rw_dec_fn fn = RW_DEC[kind][dt];
#if KV_HAVE_AVX2
        if (kv_simd >= SIMD_AVX2) fn = RW_DEC_AVX2[kind][dt];
        if (kv_simd >= SIMD_AVX512) fn = RW_DEC_AVX512[kind][dt];
#endif
        float* rowtmp = (float*)malloc(sizeof(float) * (size_t)(dim + 1));
        if (rowtmp == NULL) {
            st = KV_E_NOMEM;
        } else {
            Py_BEGIN_ALLOW_THREADS
            KV_FP_ENTER
            st = check_scales((const kv_u8*)sc.buf, rows);
            idx done = 0;
            for (idx i = 0; i < rr.n && st == KV_OK; i++) {
                idx offset, n;
                range_at(&rr, i, rows, dim * itemsize(dt), &offset, &n);
                if (offset != SKIP_RANGE)
                    st = fn((const kv_u8*)co.buf + done * dim, (const kv_u8*)sc.buf + 4 * done, n, dim,
                            (char*)out.buf + offset, rowtmp);
                done += n;
            }
            KV_FP_LEAVE
            Py_END_ALLOW_THREADS
        }
        free(rowtmp);
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "kind must be 0 (fp8) or 1 (int8)");
    }
    PyBuffer_Release(&sc);
    PyBuffer_Release(&co);
    PyBuffer_Release(&out);
    if (spans.obj != NULL) PyBuffer_Release(&spans);
    ranges_free(&rr);
    if (ok && st == KV_E_NOMEM) return PyErr_NoMemory();
    return ok ? PyLong_FromLong(st) : NULL;
}

/* int4 over ranges needs an even number of elements per token, so that every piece's
 * codes start on a byte. */
static int int4_spans_fit(Py_buffer* spans, idx hd) {
    if (spans->obj == NULL || hd % 2 == 0) return 1;
    PyErr_SetString(PyExc_ValueError, "int4 over ranges needs an even number of elements per token");
    return 0;
}

/* ceil(n / group) for n >= 1 without forming n + group - 1, which overflows for a group
 * near PY_SSIZE_T_MAX (a caller's group may be any positive size; the wire's is 1..255) */
static idx int4_ceil(idx n, idx group) { return 1 + (n - 1) / group; }

/* A group larger than what it groups (a K group than the chunk's tokens, a V group than a
 * head's channels) is one group of them: the group that size, which gives the same bytes
 * and keeps the loops' group arithmetic (t0 + group, k * group + group) far from
 * PY_SSIZE_T_MAX whatever size a caller passes. */
static idx int4_group_used(idx tokens, idx dim, idx group, int is_v) {
    const idx most = is_v ? dim : tokens;
    return group > most ? most : group;
}

static idx int4_groups(idx tokens, idx heads, idx dim, idx group, int is_v) {
    return is_v ? tokens * heads * int4_ceil(dim, group) : int4_ceil(tokens, group) * heads * dim;
}

typedef int (*i4_enc_fn)(const void*, idx, idx, idx, idx, int, kv_u8*, kv_u8*, kv_u8*, float*,
                         float*, kv_u32*, kv_u8*, float*);
typedef int (*i4_dec_fn)(const kv_u8*, const kv_u8*, const kv_u8*, idx, idx, idx, idx, int, void*,
                         float*, float*, float*);
static const i4_enc_fn I4_ENC[3] = {int4_encode_F16, int4_encode_BF16, int4_encode_F32};
static const i4_dec_fn I4_DEC[3] = {int4_decode_F16, int4_decode_BF16, int4_decode_F32};
#if KV_HAVE_AVX2
static const i4_enc_fn I4_ENC_AVX2[3] = {int4_encode_avx2_F16, int4_encode_avx2_BF16, int4_encode_avx2_F32};
static const i4_dec_fn I4_DEC_AVX2[3] = {int4_decode_avx2_F16, int4_decode_avx2_BF16, int4_decode_avx2_F32};
static const i4_enc_fn I4_ENC_AVX512[3] = {int4_encode_avx512_F16, int4_encode_avx512_BF16, int4_encode_avx512_F32};
#endif

/* int4 over ranges: the chunk's tokens lie at byte ranges of a buffer (whole tokens, in
 * order; the rows of a paged cache's blocks).  The loops above run piece by piece where
 * the tokens lie: a V row, and a K group inside one range, is read (or written) in place;
 * only a K group across two ranges goes through a scratch group of tokens.  Every piece
 * starts on a K group and, with heads * dim even, on a byte of codes, so its scales,
 * minimums and codes are the payload's from that point on. */
typedef struct {
    const row_ranges* rr;
    idx rows, row_bytes; /* the chunk's tokens, bytes of one */
    idx i;               /* the range the next token lies in */
    idx off, left;       /* its byte offset, and the tokens left in the range from it */
    int skip;            /* the range starts at SKIP_RANGE: its tokens are written nowhere */
} token_cursor;

static void cursor_range(token_cursor* c) {
    range_at(c->rr, c->i, c->rows, c->row_bytes, &c->off, &c->left);
    c->skip = c->off == SKIP_RANGE;
}

static void cursor_start(token_cursor* c, const row_ranges* rr, idx rows, idx row_bytes) {
    c->rr = rr;
    c->rows = rows;
    c->row_bytes = row_bytes;
    c->i = 0;
    cursor_range(c);
}

/* Move past n tokens; with buf, copy them from the buffer into buf (gather) or, with
 * scatter, from buf into the buffer (the tokens of a skipped range nowhere). */
static void cursor_move(token_cursor* c, char* base, char* buf, idx n, int scatter) {
    while (n > 0) {
        const idx k = n < c->left ? n : c->left;
        const size_t bytes = (size_t)(k * c->row_bytes);
        if (buf != NULL) {
            if (!c->skip) {
                if (scatter) memcpy(base + c->off, buf, bytes);
                else memcpy(buf, base + c->off, bytes);
            }
            buf += bytes;
        }
        c->off += k * c->row_bytes;
        c->left -= k;
        n -= k;
        if (c->left == 0 && ++c->i < c->rr->n) cursor_range(c);
    }
}

/* Whether the next n tokens all lie in skipped ranges (written nowhere); a piece across
 * ranges (a K group) may span several. */
static int cursor_skips(const token_cursor* c, idx n) {
    if (!c->skip) return 0;
    idx left = c->left;
    for (idx i = c->i + 1; left < n && i < c->rr->n; ++i) {
        idx off, rows;
        range_at(c->rr, i, c->rows, c->row_bytes, &off, &rows);
        if (off != SKIP_RANGE) return 0;
        left += rows;
    }
    return 1;
}

/* The next piece of the rest of the chunk: its tokens, and whether they lie in one range. */
static idx next_piece(const token_cursor* c, idx rest, idx group, int is_v, int* in_place) {
    *in_place = 1;
    if (is_v || c->left >= rest) return c->left < rest ? c->left : rest;
    if (c->left >= group) return c->left / group * group;
    *in_place = 0;
    return group < rest ? group : rest;
}

/* The payload's offsets where a piece starting at token t begins: groups and code bytes. */
static idx int4_groups_before(idx t, idx heads, idx dim, idx group, int is_v) {
    return is_v ? t * heads * int4_ceil(dim, group) : t / group * heads * dim;
}

/* int4_encode(x, dtype, tokens, heads, dim, group, is_v, scales, mins, packed[, spans])
 * -> status; with spans (whole tokens, heads * dim even) x is the buffer they lie in */
static PyObject* py_int4_encode(PyObject* self, PyObject* args) {
    int dt, is_v, st = KV_OK;
    idx tokens, heads, dim, group;
    Py_buffer x, sc, mn, pk, spans = {0};
    row_ranges rr = {NULL, 1};
    (void)self;
    if (!PyArg_ParseTuple(args, "y*innnnpw*w*w*|y*", &x, &dt, &tokens, &heads, &dim, &group, &is_v,
                          &sc, &mn, &pk, &spans))
        return NULL;
    int ok = check_dt(dt) && check_sizes(tokens, heads) && check_sizes(tokens * heads, dim) &&
             check_sizes(tokens * heads * dim, itemsize(dt)) && check_sizes(group, 1) &&
             int4_spans_fit(&spans, heads * dim);
    if (ok) {
        group = int4_group_used(tokens, dim, group, is_v);
        idx n = tokens * heads * dim, g = int4_groups(tokens, heads, dim, group, is_v);
        ok = check_sizes(g, 4) && need(&sc, 4 * g, "scales") && need(&mn, 4 * g, "minimums") &&
             need(&pk, (n + 1) / 2, "codes") &&
             parse_ranges(&spans, &x, "input", tokens, heads * dim * itemsize(dt), itemsize(dt), 0, &rr) &&
             apart(&sc, "scales", &x, "input") && apart(&mn, "minimums", &x, "input") &&
             apart(&pk, "codes", &x, "input") && apart(&sc, "scales", &mn, "minimums") &&
             apart(&sc, "scales", &pk, "codes") && apart(&mn, "minimums", &pk, "codes");
    }
    if (ok) {
        const idx hd = heads * dim, tb = hd * itemsize(dt);
        float* lo = (float*)malloc(sizeof(float) * (size_t)(3 * hd + 3));
        kv_u32* keys = (kv_u32*)malloc(sizeof(kv_u32) * (size_t)(2 * hd + 2));
        kv_u8* tmp = (kv_u8*)malloc((size_t)hd + 1);
        char* group_buf = spans.obj != NULL && !is_v ? (char*)malloc((size_t)(MIN_IDX(group, tokens) * tb)) : NULL;
        if (lo == NULL || keys == NULL || tmp == NULL || (spans.obj != NULL && !is_v && group_buf == NULL)) {
            st = KV_E_NOMEM;
        } else {
            i4_enc_fn fn = I4_ENC[dt];
#if KV_HAVE_AVX2
            if (kv_simd >= SIMD_AVX2) fn = I4_ENC_AVX2[dt];
            if (kv_simd >= SIMD_AVX512) fn = I4_ENC_AVX512[dt];
#endif
            Py_BEGIN_ALLOW_THREADS
            KV_FP_ENTER
            token_cursor c;
            cursor_start(&c, &rr, tokens, tb);
            for (idx t = 0; t < tokens && st == KV_OK;) {
                int in_place;
                const idx n = next_piece(&c, tokens - t, group, is_v, &in_place);
                const char* src = (const char*)x.buf + c.off;
                cursor_move(&c, (char*)x.buf, in_place ? NULL : group_buf, n, 0);
                if (!in_place) src = group_buf;
                const idx g0 = int4_groups_before(t, heads, dim, group, is_v);
                st = fn(src, n, heads, dim, group, is_v, (kv_u8*)sc.buf + 4 * g0, (kv_u8*)mn.buf + 4 * g0,
                        (kv_u8*)pk.buf + t * hd / 2, lo, lo + hd + 1, keys, tmp, lo + 2 * hd + 2);
                t += n;
            }
            KV_FP_LEAVE
            Py_END_ALLOW_THREADS
        }
        free(lo);
        free(keys);
        free(tmp);
        free(group_buf);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&sc);
    PyBuffer_Release(&mn);
    PyBuffer_Release(&pk);
    if (spans.obj != NULL) PyBuffer_Release(&spans);
    ranges_free(&rr);
    if (ok && st == KV_E_NOMEM) return PyErr_NoMemory();
    return ok ? PyLong_FromLong(st) : NULL;
}

/* int4_decode(scales, mins, packed, tokens, heads, dim, group, is_v, dtype, out[, spans])
 * -> status; with spans (as for int4_encode) out is the buffer the tokens go to; a range
 * starting at SKIP_RANGE is tokens written nowhere (decoded only where a K group runs
 * into a written range) */
static PyObject* py_int4_decode(PyObject* self, PyObject* args) {
    int dt, is_v, st = KV_OK;
    idx tokens, heads, dim, group;
    Py_buffer sc, mn, pk, out, spans = {0};
    row_ranges rr = {NULL, 1};
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*nnnnpiw*|y*", &sc, &mn, &pk, &tokens, &heads, &dim, &group,
                          &is_v, &dt, &out, &spans))
        return NULL;
    int ok = check_dt(dt) && check_sizes(tokens, heads) && check_sizes(tokens * heads, dim) &&
             check_sizes(tokens * heads * dim, itemsize(dt)) && check_sizes(group, 1) &&
             int4_spans_fit(&spans, heads * dim);
    idx n = 0, g = 0;
    if (ok) {
        group = int4_group_used(tokens, dim, group, is_v);
        n = tokens * heads * dim;
        g = int4_groups(tokens, heads, dim, group, is_v);
        ok = check_sizes(g, 4) && need(&sc, 4 * g, "scales") && need(&mn, 4 * g, "minimums") &&
             need(&pk, (n + 1) / 2, "codes") &&
             parse_ranges(&spans, &out, "out", tokens, heads * dim * itemsize(dt), itemsize(dt), 1, &rr) &&
             apart(&out, "out", &sc, "scales") && apart(&out, "out", &mn, "minimums") &&
             apart(&out, "out", &pk, "codes");
    }
    if (ok) {
        const idx hd = heads * dim, tb = hd * itemsize(dt);
        float* buf = (float*)malloc(sizeof(float) * (size_t)(3 * hd + 3));
        char* group_buf = spans.obj != NULL && !is_v ? (char*)malloc((size_t)(MIN_IDX(group, tokens) * tb)) : NULL;
        if (buf == NULL || (spans.obj != NULL && !is_v && group_buf == NULL)) {
            st = KV_E_NOMEM;
        } else {
            i4_dec_fn fn = I4_DEC[dt];
#if KV_HAVE_AVX2
            if (kv_simd >= SIMD_AVX2) fn = I4_DEC_AVX2[dt];
#endif
            const kv_u8* p = (const kv_u8*)pk.buf;
            Py_BEGIN_ALLOW_THREADS
            KV_FP_ENTER
            st = check_scales((const kv_u8*)sc.buf, g);
            if (st == KV_OK) st = check_mins((const kv_u8*)mn.buf, g);
            if (st == KV_OK && (n & 1) && (p[n >> 1] >> 4)) st = KV_E_PAD;
            token_cursor c;
            cursor_start(&c, &rr, tokens, tb);
            for (idx t = 0; t < tokens && st == KV_OK;) {
                int in_place;
                const idx m = next_piece(&c, tokens - t, group, is_v, &in_place);
                const idx g0 = int4_groups_before(t, heads, dim, group, is_v);
                if (cursor_skips(&c, m)) { /* tokens written nowhere (in one range or several): not decoded */
                    cursor_move(&c, (char*)out.buf, NULL, m, 1);
                    t += m;
                    continue;
                }
                st = fn(p + t * hd / 2, (const kv_u8*)sc.buf + 4 * g0, (const kv_u8*)mn.buf + 4 * g0, m, heads,
                        dim, group, is_v, in_place ? (char*)out.buf + c.off : group_buf, buf, buf + hd + 1,
                        buf + 2 * hd + 2);
                if (st == KV_OK) cursor_move(&c, (char*)out.buf, in_place ? NULL : group_buf, m, 1);
                t += m;
            }
            KV_FP_LEAVE
            Py_END_ALLOW_THREADS
        }
        free(buf);
        free(group_buf);
    }
    PyBuffer_Release(&sc);
    PyBuffer_Release(&mn);
    PyBuffer_Release(&pk);
    PyBuffer_Release(&out);
    if (spans.obj != NULL) PyBuffer_Release(&spans);
    ranges_free(&rr);
    if (ok && st == KV_E_NOMEM) return PyErr_NoMemory();
    return ok ? PyLong_FromLong(st) : NULL;
}

/* The clone of the generic loops the loader picked for this CPU. */
static const char* clone_name(void) {
#if KV_HAVE_CLONES
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512cd"))
        return "x86-64-v4";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("bmi2"))
        return "x86-64-v3";
    return "x86-64";
#else
    return "generic";
#endif
}

static int best_simd(void) {
#if KV_HAVE_AVX2
    if (have_avx2() && have_avx512()) return SIMD_AVX512;
    if (have_avx2()) return SIMD_AVX2;
#endif
#if KV_HAVE_CLONES
    if (have_f16c()) return SIMD_F16C;
#endif
    return SIMD_GENERIC;
}

static void set_simd(int level) {
    int best = best_simd();
    kv_simd = level < best ? level : best;
#if KV_HAVE_CLONES
    kv_store_f16 = kv_simd >= SIMD_F16C ? store_f16_f16c : store_f16_generic;
    kv_load_f16 = kv_simd >= SIMD_F16C ? load_f16_f16c : load_f16_generic;
#endif
}

/* The loops in use on this CPU, in words. */
static PyObject* py_isa(PyObject* self, PyObject* args) {
    (void)self;
    (void)args;
    if (kv_simd >= SIMD_AVX512) return PyUnicode_FromString("AVX-512 loops (fp8, int8, int4 encode) + F16C");
    if (kv_simd >= SIMD_AVX2) return PyUnicode_FromString("AVX2 + F16C loops");
    return PyUnicode_FromFormat(kv_simd >= SIMD_F16C ? "generic loops (%s clone), F16C rows"
                                                     : "generic loops (%s clone)",
                                clone_name());
}

/* simd(level) -> level in use: 0 the generic loops with kvquant.cuh's conversions, 1 the
 * generic loops with float16 rows through F16C, 2 the AVX2 + F16C loops, 3 the AVX-512 loops
 * of fp8, int8 and int4 encode (int4 decode on AVX2); a level above
 * what the CPU has gives its best, a negative one is refused.  The test-suite runs every
 * level it can. */
static PyObject* py_simd(PyObject* self, PyObject* args) {
    int level;
    (void)self;
    if (!PyArg_ParseTuple(args, "i", &level)) return NULL;
    if (level < 0) {
        PyErr_SetString(PyExc_ValueError, "simd() needs a level >= 0");
        return NULL;
    }
    set_simd(level);
    return PyLong_FromLong(kv_simd);
}

static PyMethodDef methods[] = {
    {"simd", py_simd, METH_VARARGS,
     "simd(level) -> level in use (0 generic, 1 generic with F16C rows, 2 AVX2 + F16C, 3 AVX-512)"},
    {"encode_rows", py_encode_rows, METH_VARARGS,
     "encode_rows(kind, x, dtype, rows, dim, scales, codes[, spans]) -> status (kind 0 fp8, 1 int8); "
     "with spans (int64 start, size pairs), the rows are those byte ranges of x"},
    {"decode_rows", py_decode_rows, METH_VARARGS,
     "decode_rows(kind, scales, codes, rows, dim, dtype, out[, spans]) -> status; "
     "with spans (int64 start, size pairs), the rows go to those byte ranges of out (a start of -1:\n"
     "those rows are written nowhere, and not decoded: a value there out dtype cannot hold raises nothing)"},
    {"int4_encode", py_int4_encode, METH_VARARGS,
     "int4_encode(x, dtype, tokens, heads, dim, group, is_v, scales, mins, packed[, spans]) -> status"},
    {"int4_decode", py_int4_decode, METH_VARARGS,
     "int4_decode(scales, mins, packed, tokens, heads, dim, group, is_v, dtype, out[, spans]) -> status; "
     "a range starting at -1: tokens written nowhere"},
    {"isa", py_isa, METH_NOARGS, "isa() -> the codec loops in use on this CPU, in words"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.codec._hostcodec",
    "Host build of kernels/kvquant.cuh: the fp8, int8 and int4 codec loops.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hostcodec(void) {
    set_simd(SIMD_AVX512);
    PyObject* m = PyModule_Create(&module);
    /* the highest level this build holds (the CPU may allow less): x86-64 with GCC has all */
    if (m != NULL && PyModule_AddIntConstant(m, "SIMD_BUILT", KV_HAVE_AVX2 ? SIMD_AVX512 : KV_HAVE_CLONES ? SIMD_F16C : SIMD_GENERIC) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
