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
            if (vmax >= 0x7F800000u) return KV_E_OVERFLOW;                                   \
            if (vmax >= OVERFLOW_BITS[DT_##SUF]) return KV_E_DTYPE;                          \
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
        if (vmax >= 0x7F800000u) return KV_E_OVERFLOW;                                       \
        if (vmax >= OVERFLOW_BITS[DT_##SUF]) return KV_E_DTYPE;                              \
        return KV_OK;                                                                        \
    }

INT4_DECODE(F16) INT4_DECODE(BF16) INT4_DECODE(F32)

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

static int check_sizes(idx a, idx b) {
    if (a <= 0 || b <= 0 || a > PY_SSIZE_T_MAX / b) {
        PyErr_SetString(PyExc_ValueError, "sizes must be positive");
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

static PyObject* py_encode_rows(PyObject* self, PyObject* args) {
    int kind, dt, st = KV_OK;
    idx rows, dim;
    Py_buffer x, sc, co;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*innw*w*", &kind, &x, &dt, &rows, &dim, &sc, &co)) return NULL;
    int ok = (kind == 0 || kind == 1) && check_dt(dt) && check_sizes(rows, dim) &&
             need(&x, rows * dim * itemsize(dt), "input") && need(&sc, rows * 4, "scales") &&
             need(&co, rows * dim, "codes");
    if (ok) {
        rw_enc_fn fn = RW_ENC[kind][dt];
        float* rowtmp = (float*)malloc(sizeof(float) * (size_t)(dim + 1));
        if (rowtmp == NULL) {
            st = KV_E_NOMEM;
        } else {
            Py_BEGIN_ALLOW_THREADS
            st = fn(x.buf, rows, dim, (kv_u8*)sc.buf, (kv_u8*)co.buf, rowtmp);
            Py_END_ALLOW_THREADS
        }
        free(rowtmp);
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "kind must be 0 (fp8) or 1 (int8)");
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&sc);
    PyBuffer_Release(&co);
    if (ok && st == KV_E_NOMEM) return PyErr_NoMemory();
    return ok ? PyLong_FromLong(st) : NULL;
}

static PyObject* py_decode_rows(PyObject* self, PyObject* args) {
    int kind, dt, st = KV_OK;
    idx rows, dim;
    Py_buffer sc, co, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "iy*y*nniw*", &kind, &sc, &co, &rows, &dim, &dt, &out)) return NULL;
    int ok = (kind == 0 || kind == 1) && check_dt(dt) && check_sizes(rows, dim) &&
             need(&sc, rows * 4, "scales") && need(&co, rows * dim, "codes") &&
             need(&out, rows * dim * itemsize(dt), "out");
    if (ok) {
        rw_dec_fn fn = RW_DEC[kind][dt];
        float* rowtmp = (float*)malloc(sizeof(float) * (size_t)(dim + 1));
        if (rowtmp == NULL) {
            st = KV_E_NOMEM;
        } else {
            Py_BEGIN_ALLOW_THREADS
            st = check_scales((const kv_u8*)sc.buf, rows);
            if (st == KV_OK)
                st = fn((const kv_u8*)co.buf, (const kv_u8*)sc.buf, rows, dim, out.buf, rowtmp);
            Py_END_ALLOW_THREADS
        }
        free(rowtmp);
    } else if (!PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "kind must be 0 (fp8) or 1 (int8)");
    }
    PyBuffer_Release(&sc);
    PyBuffer_Release(&co);
    PyBuffer_Release(&out);
    if (ok && st == KV_E_NOMEM) return PyErr_NoMemory();
    return ok ? PyLong_FromLong(st) : NULL;
}

static idx int4_groups(idx tokens, idx heads, idx dim, idx group, int is_v) {
    return is_v ? tokens * heads * ((dim + group - 1) / group)
                : ((tokens + group - 1) / group) * heads * dim;
}

typedef int (*i4_enc_fn)(const void*, idx, idx, idx, idx, int, kv_u8*, kv_u8*, kv_u8*, float*,
                         float*, kv_u32*, kv_u8*, float*);
typedef int (*i4_dec_fn)(const kv_u8*, const kv_u8*, const kv_u8*, idx, idx, idx, idx, int, void*,
                         float*, float*, float*);
static const i4_enc_fn I4_ENC[3] = {int4_encode_F16, int4_encode_BF16, int4_encode_F32};
static const i4_dec_fn I4_DEC[3] = {int4_decode_F16, int4_decode_BF16, int4_decode_F32};

/* int4_encode(x, dtype, tokens, heads, dim, group, is_v, scales, mins, packed) -> status */
static PyObject* py_int4_encode(PyObject* self, PyObject* args) {
    int dt, is_v, st = KV_OK;
    idx tokens, heads, dim, group;
    Py_buffer x, sc, mn, pk;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*innnnpw*w*w*", &x, &dt, &tokens, &heads, &dim, &group, &is_v,
                          &sc, &mn, &pk))
        return NULL;
    int ok = check_dt(dt) && check_sizes(tokens, heads) && check_sizes(tokens * heads, dim) &&
             check_sizes(group, 1);
    if (ok) {
        idx n = tokens * heads * dim, g = int4_groups(tokens, heads, dim, group, is_v);
        ok = need(&x, n * itemsize(dt), "input") && need(&sc, 4 * g, "scales") &&
             need(&mn, 4 * g, "minimums") && need(&pk, (n + 1) / 2, "codes");
    }
    if (ok) {
        idx hd = heads * dim;
        float* lo = (float*)malloc(sizeof(float) * (size_t)(3 * hd + 3));
        kv_u32* keys = (kv_u32*)malloc(sizeof(kv_u32) * (size_t)(2 * hd + 2));
        kv_u8* tmp = (kv_u8*)malloc((size_t)hd + 1);
        if (lo == NULL || keys == NULL || tmp == NULL) {
            st = KV_E_NOMEM;
        } else {
            i4_enc_fn fn = I4_ENC[dt];
            Py_BEGIN_ALLOW_THREADS
            st = fn(x.buf, tokens, heads, dim, group, is_v, (kv_u8*)sc.buf, (kv_u8*)mn.buf,
                    (kv_u8*)pk.buf, lo, lo + hd + 1, keys, tmp, lo + 2 * hd + 2);
            Py_END_ALLOW_THREADS
        }
        free(lo);
        free(keys);
        free(tmp);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&sc);
    PyBuffer_Release(&mn);
    PyBuffer_Release(&pk);
    if (ok && st == KV_E_NOMEM) return PyErr_NoMemory();
    return ok ? PyLong_FromLong(st) : NULL;
}

/* int4_decode(scales, mins, packed, tokens, heads, dim, group, is_v, dtype, out) -> status */
static PyObject* py_int4_decode(PyObject* self, PyObject* args) {
    int dt, is_v, st = KV_OK;
    idx tokens, heads, dim, group;
    Py_buffer sc, mn, pk, out;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*nnnnpiw*", &sc, &mn, &pk, &tokens, &heads, &dim, &group,
                          &is_v, &dt, &out))
        return NULL;
    int ok = check_dt(dt) && check_sizes(tokens, heads) && check_sizes(tokens * heads, dim) &&
             check_sizes(group, 1);
    idx n = 0, g = 0;
    if (ok) {
        n = tokens * heads * dim;
        g = int4_groups(tokens, heads, dim, group, is_v);
        ok = need(&sc, 4 * g, "scales") && need(&mn, 4 * g, "minimums") &&
             need(&pk, (n + 1) / 2, "codes") && need(&out, n * itemsize(dt), "out");
    }
    if (ok) {
        idx hd = heads * dim;
        float* buf = (float*)malloc(sizeof(float) * (size_t)(3 * hd + 3));
        if (buf == NULL) {
            st = KV_E_NOMEM;
        } else {
            i4_dec_fn fn = I4_DEC[dt];
            const kv_u8* p = (const kv_u8*)pk.buf;
            Py_BEGIN_ALLOW_THREADS
            st = check_scales((const kv_u8*)sc.buf, g);
            if (st == KV_OK) st = check_mins((const kv_u8*)mn.buf, g);
            if (st == KV_OK && (n & 1) && (p[n >> 1] >> 4)) st = KV_E_PAD;
            if (st == KV_OK)
                st = fn(p, (const kv_u8*)sc.buf, (const kv_u8*)mn.buf, tokens, heads, dim, group,
                        is_v, out.buf, buf, buf + hd + 1, buf + 2 * hd + 2);
            Py_END_ALLOW_THREADS
        }
        free(buf);
    }
    PyBuffer_Release(&sc);
    PyBuffer_Release(&mn);
    PyBuffer_Release(&pk);
    PyBuffer_Release(&out);
    if (ok && st == KV_E_NOMEM) return PyErr_NoMemory();
    return ok ? PyLong_FromLong(st) : NULL;
}

/* The instruction set the loops run with on this CPU (the clone the loader picked). */
static PyObject* py_isa(PyObject* self, PyObject* args) {
    (void)self;
    (void)args;
#if KV_HAVE_CLONES
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512cd"))
        return PyUnicode_FromString("x86-64-v4 (AVX-512)");
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("bmi2"))
        return PyUnicode_FromString("x86-64-v3 (AVX2, F16C)");
    return PyUnicode_FromString("x86-64 (SSE2)");
#else
    return PyUnicode_FromString("generic");
#endif
}

/* f16c(enable) -> bool: use F16C for float16 loads and stores (when the CPU has it); returns whether
 * it is in use.  The test-suite runs the decoders both ways. */
static PyObject* py_f16c(PyObject* self, PyObject* args) {
    int enable;
    (void)self;
    if (!PyArg_ParseTuple(args, "p", &enable)) return NULL;
#if KV_HAVE_CLONES
    int use = enable && have_f16c();
    kv_store_f16 = use ? store_f16_f16c : store_f16_generic;
    kv_load_f16 = use ? load_f16_f16c : load_f16_generic;
    return PyBool_FromLong(use);
#else
    return PyBool_FromLong(0);
#endif
}

static PyMethodDef methods[] = {
    {"f16c", py_f16c, METH_VARARGS, "f16c(enable) -> whether float16 stores use F16C"},
    {"encode_rows", py_encode_rows, METH_VARARGS,
     "encode_rows(kind, x, dtype, rows, dim, scales, codes) -> status (kind 0 fp8, 1 int8)"},
    {"decode_rows", py_decode_rows, METH_VARARGS,
     "decode_rows(kind, scales, codes, rows, dim, dtype, out) -> status"},
    {"int4_encode", py_int4_encode, METH_VARARGS,
     "int4_encode(x, dtype, tokens, heads, dim, group, is_v, scales, mins, packed) -> status"},
    {"int4_decode", py_int4_decode, METH_VARARGS,
     "int4_decode(scales, mins, packed, tokens, heads, dim, group, is_v, dtype, out) -> status"},
    {"isa", py_isa, METH_NOARGS, "isa() -> the instruction set the codec loops use here"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.codec._hostcodec",
    "Host build of kernels/kvquant.cuh: the fp8, int8 and int4 codec loops.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hostcodec(void) {
#if KV_HAVE_CLONES
    if (have_f16c()) {
        kv_store_f16 = store_f16_f16c;
        kv_load_f16 = load_f16_f16c;
    }
#endif
    return PyModule_Create(&module);
}
