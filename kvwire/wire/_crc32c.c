/* CRC32C (Castagnoli, reflected polynomial 0x82F63B78) of any C-contiguous buffer: the
 * function of the `crc32c` package, `crc32c(data, value=0)`, continuation included
 * (crc32c(b, crc32c(a)) == crc32c(a + b)), computed by the fastest loop this CPU runs.
 *
 * Levels, chosen at run time (__builtin_cpu_supports; each SIMD function carries its own
 * __attribute__((target)), so the module is built without -m flags and loads on any x86-64):
 *
 *   3 "avx512-vpclmulqdq"  four 512-bit accumulators folded by 256 bytes per iteration with
 *                          VPCLMULQDQ, reduced to 128 bits, finished with the crc32
 *                          instruction over those 16 bytes and the tail (no Barrett step);
 *                          from 4 KiB on, a crc32-instruction chain over 128 more bytes
 *                          per iteration runs beside the multiplies (see "Level 2")
 *   2 "pclmulqdq"          the same with eight 128-bit accumulators (128 bytes/iteration,
 *                          plus 128 crc32 bytes per iteration from 4 KiB on)
 *   1 "sse4.2"             the crc32 instruction on three interleaved streams, combined
 *                          with shift tables
 *   0 "table"              portable slicing-by-8 (the only level off x86-64)
 *
 * The folding constants are x^n mod P, computed at import by xpow() below (GF(2)
 * arithmetic in the reflected convention); the tests compare xpow() with an independent
 * Python computation and every level with the package.
 *
 * Conventions.  A 32-bit CRC register holds a polynomial of degree < 32 bit-reflected: bit
 * 31 is x^0, bit 0 is x^31.  Bytes loaded little-endian into a 128-bit lane give a
 * polynomial whose bit i (bit 0 of the first byte first) is x^(127-i).  The carry-less
 * product of two such 64-bit halves, read as such a 128-bit lane, is their product times x;
 * so folding a lane forward by D bits (lane = lo:hi, lo the earlier 8 bytes) is
 *     clmul(lo, xpow(D + 63)) ^ clmul(hi, xpow(D - 1))
 * with each constant placed in the upper half of its 64-bit operand (register << 32).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(KVCRC_PORTABLE)
#define KVCRC_X86 1
#include <immintrin.h>
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 9)
#define KVCRC_AVX512 1 /* VPCLMULQDQ intrinsics and cpu-feature name */
#else
#define KVCRC_AVX512 0
#endif
#else
#define KVCRC_X86 0
#define KVCRC_AVX512 0
#endif

#define POLY 0x82F63B78u /* reflected 0x1EDC6F41 */

enum { LEVEL_TABLE, LEVEL_SSE42, LEVEL_PCLMUL, LEVEL_AVX512 };
static const char* const LEVEL_NAMES[] = {"table", "sse4.2", "pclmulqdq", "avx512-vpclmulqdq"};
#if KVCRC_AVX512
#define LEVEL_BUILT LEVEL_AVX512
#elif KVCRC_X86
#define LEVEL_BUILT LEVEL_PCLMUL
#else
#define LEVEL_BUILT LEVEL_TABLE
#endif

/* Buffers of at least this many bytes are checksummed without the GIL. */
#define GIL_RELEASE_MIN 8192

/* ------------------------------------------------------------------------------------ */
/* GF(2) arithmetic modulo P, reflected (bit 31 = x^0).                                  */

static uint32_t x2n[64]; /* x2n[k] = x^(2^k) mod P */

static uint32_t gf_mul(uint32_t a, uint32_t b) {
    uint32_t p = 0;
    for (int i = 0; i < 32; i++) {
        if (a & (0x80000000u >> i)) p ^= b;         /* term x^i of a */
        b = (b & 1u) ? (b >> 1) ^ POLY : (b >> 1); /* b *= x */
    }
    return p;
}

/* x^n mod P, reflected. */
static uint32_t xpow(uint64_t n) {
    uint32_t p = 0x80000000u; /* x^0 */
    for (int k = 0; n; k++, n >>= 1)
        if (n & 1u) p = gf_mul(x2n[k], p);
    return p;
}

/* ------------------------------------------------------------------------------------ */
/* Level 0: slicing-by-8, portable (endian-neutral loads).                               */

static uint32_t table8[8][256];

static void init_tables(void) {
    uint32_t p = 0x40000000u; /* x^1 */
    x2n[0] = p;
    for (int k = 1; k < 64; k++) x2n[k] = p = gf_mul(p, p);
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = (c & 1u) ? (c >> 1) ^ POLY : (c >> 1);
        table8[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++)
            table8[k][n] = (table8[k - 1][n] >> 8) ^ table8[0][table8[k - 1][n] & 0xffu];
}

static inline uint32_t load32le(const uint8_t* p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* All crc_* functions take and return the raw register (the caller inverts). */
static uint32_t crc_table(uint32_t crc, const uint8_t* p, size_t n) {
    while (n >= 8) {
        uint32_t a = load32le(p) ^ crc, b = load32le(p + 4);
        crc = table8[7][a & 0xffu] ^ table8[6][(a >> 8) & 0xffu] ^ table8[5][(a >> 16) & 0xffu] ^
              table8[4][a >> 24] ^ table8[3][b & 0xffu] ^ table8[2][(b >> 8) & 0xffu] ^
              table8[1][(b >> 16) & 0xffu] ^ table8[0][b >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) crc = (crc >> 8) ^ table8[0][(crc ^ *p++) & 0xffu];
    return crc;
}

#if KVCRC_X86
/* ------------------------------------------------------------------------------------ */
/* Level 1: the SSE4.2 crc32 instruction, three streams.                                 */

#define SSE42 __attribute__((target("sse4.2")))
#define SSE42_INLINE __attribute__((target("sse4.2"), always_inline)) static inline

/* Stream lengths of the 3-way rounds, longest first; shift[t] multiplies a register by
 * x^(8 * STREAM[t]) (the register is linear, so one table per byte of it). */
static const size_t STREAM[3] = {4096, 512, 64};
static uint32_t shift[3][4][256];

static void init_shift_tables(void) {
    for (int t = 0; t < 3; t++) {
        uint32_t k = xpow(8 * (uint64_t)STREAM[t]);
        for (int b = 0; b < 4; b++)
            for (uint32_t n = 0; n < 256; n++) shift[t][b][n] = gf_mul(n << (8 * b), k);
    }
}

static inline uint64_t load64(const uint8_t* p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline uint32_t shift_by(int t, uint32_t c) {
    return shift[t][0][c & 0xffu] ^ shift[t][1][(c >> 8) & 0xffu] ^
           shift[t][2][(c >> 16) & 0xffu] ^ shift[t][3][c >> 24];
}

/* One stream, for short pieces (and tails). */
SSE42_INLINE uint32_t crc_sse42_1(uint32_t crc, const uint8_t* p, size_t n) {
    uint64_t c = crc;
    for (; n >= 8; p += 8, n -= 8) c = _mm_crc32_u64(c, load64(p));
    crc = (uint32_t)c;
    if (n & 4) {
        uint32_t v;
        memcpy(&v, p, 4);
        crc = _mm_crc32_u32(crc, v);
        p += 4;
    }
    if (n & 2) {
        uint16_t v;
        memcpy(&v, p, 2);
        crc = _mm_crc32_u16(crc, v);
        p += 2;
    }
    if (n & 1) crc = _mm_crc32_u8(crc, *p);
    return crc;
}

SSE42 static uint32_t crc_sse42(uint32_t crc, const uint8_t* p, size_t n) {
    for (int t = 0; t < 3; t++) {
        const size_t s = STREAM[t];
        while (n >= 3 * s) {
            uint64_t c0 = crc, c1 = 0, c2 = 0;
            for (const uint8_t* end = p + s; p < end; p += 8) {
                c0 = _mm_crc32_u64(c0, load64(p));
                c1 = _mm_crc32_u64(c1, load64(p + s));
                c2 = _mm_crc32_u64(c2, load64(p + 2 * s));
            }
            crc = shift_by(t, shift_by(t, (uint32_t)c0) ^ (uint32_t)c1) ^ (uint32_t)c2;
            p += 2 * s;
            n -= 3 * s;
        }
    }
    return crc_sse42_1(crc, p, n);
}

/* ------------------------------------------------------------------------------------ */
/* Level 2: PCLMULQDQ folding, 128-bit.                                                  */
/*
 * Levels 2 and 3 run the crc32 instruction beside the carry-less multiplies (different
 * execution ports) on long buffers: the buffer is cut into windows of F fold bytes then C
 * crc bytes.  The accumulators fold over each window's crc bytes (a fold distance of
 * F + C bytes); the crc bytes get a crc32 chain of their own from a zero register, and
 * since a register is what xoring it into the next four bytes does, that chain's result is
 * xored into the first four bytes of the next window's fold bytes.  The chains of
 * successive windows are independent, so their latency overlaps.
 */

#define PCLMUL __attribute__((target("sse4.2,pclmul")))
#define PCLMUL_INLINE __attribute__((target("sse4.2,pclmul"), always_inline)) static inline

#define PCLMUL_MIN 256  /* shorter buffers take the crc32 instruction alone */
#define PCLMUL_CRC 128  /* crc bytes per 128 fold bytes in level 2's windows */
#define AVX512_CRC 128  /* crc bytes per 256 fold bytes in level 3's windows */
#define MIXED_MIN 4096  /* buffers this long (after level 3's alignment) use the windows */
#define PREFETCH 4096   /* level 3 prefetches this many bytes ahead */

/* fold constants {lo: xpow(D + 63) << 32, hi: xpow(D - 1) << 32} for D bits */
typedef struct {
    uint64_t lo, hi;
} fold_k;
static fold_k K128, K256, K384, K512, K1024, K2048, K_MIXED2, K_MIXED3;

static fold_k fold_constants(uint64_t bits) {
    fold_k k = {(uint64_t)xpow(bits + 63) << 32, (uint64_t)xpow(bits - 1) << 32};
    return k;
}

static void init_fold_constants(void) {
    K128 = fold_constants(128);
    K256 = fold_constants(256);
    K384 = fold_constants(384);
    K512 = fold_constants(512);
    K1024 = fold_constants(1024);
    K2048 = fold_constants(2048);
    K_MIXED2 = fold_constants(8 * (128 + PCLMUL_CRC));
    K_MIXED3 = fold_constants(8 * (256 + AVX512_CRC));
}

PCLMUL_INLINE __m128i kvec(fold_k k) { return _mm_set_epi64x((long long)k.hi, (long long)k.lo); }

/* x folded forward by the distance of k, xor y */
PCLMUL_INLINE __m128i fold16(__m128i x, __m128i k, __m128i y) {
    return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00),
                                       _mm_clmulepi64_si128(x, k, 0x11)),
                         y);
}

/* The 16 bytes x followed by the n bytes at p, from a zero register. */
PCLMUL_INLINE uint32_t finish16(__m128i x, const uint8_t* p, size_t n) {
    uint64_t c = _mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(x));
    c = _mm_crc32_u64(c, (uint64_t)_mm_extract_epi64(x, 1));
    return crc_sse42_1((uint32_t)c, p, n);
}

/* crc32 chain over n (a multiple of 8) bytes from a zero register */
PCLMUL_INLINE uint32_t chain(const uint8_t* p, size_t n) {
    uint64_t c = 0;
    for (size_t i = 0; i < n; i += 8) c = _mm_crc32_u64(c, load64(p + i));
    return (uint32_t)c;
}

#define LD(q) _mm_loadu_si128((const __m128i*)(const void*)(q))
#define LDX(q, c) _mm_xor_si128(LD(q), _mm_cvtsi32_si128((int)(c))) /* c into bytes 0..3 */

#define FOLD8(k)                        \
    do {                                \
        x0 = fold16(x0, k, LDX(p, c));  \
        x1 = fold16(x1, k, LD(p + 16)); \
        x2 = fold16(x2, k, LD(p + 32)); \
        x3 = fold16(x3, k, LD(p + 48)); \
        x4 = fold16(x4, k, LD(p + 64)); \
        x5 = fold16(x5, k, LD(p + 80)); \
        x6 = fold16(x6, k, LD(p + 96)); \
        x7 = fold16(x7, k, LD(p + 112));\
    } while (0)

PCLMUL static uint32_t crc_pclmul(uint32_t crc, const uint8_t* p, size_t n) {
    if (n < PCLMUL_MIN) return crc_sse42(crc, p, n);
    __m128i x0 = LDX(p, crc), x1 = LD(p + 16), x2 = LD(p + 32), x3 = LD(p + 48),
            x4 = LD(p + 64), x5 = LD(p + 80), x6 = LD(p + 96), x7 = LD(p + 112);
    p += 128;
    n -= 128;
    uint32_t c = 0; /* pending: xored into the next fold bytes */
    if (n >= MIXED_MIN) {
        const __m128i km = kvec(K_MIXED2);
        c = chain(p, PCLMUL_CRC);
        p += PCLMUL_CRC;
        n -= PCLMUL_CRC;
        for (; n >= 2 * 128 + PCLMUL_CRC; p += 128 + PCLMUL_CRC, n -= 128 + PCLMUL_CRC) {
            FOLD8(km);
            c = chain(p + 128, PCLMUL_CRC);
        }
        FOLD8(km); /* the last window without crc bytes */
        p += 128;
        n -= 128;
        c = 0;
    }
    const __m128i k = kvec(K1024);
    for (; n >= 128; p += 128, n -= 128) FOLD8(k);
    const __m128i k1 = kvec(K128);
    __m128i x = fold16(x0, k1, x1);
    x = fold16(x, k1, x2);
    x = fold16(x, k1, x3);
    x = fold16(x, k1, x4);
    x = fold16(x, k1, x5);
    x = fold16(x, k1, x6);
    x = fold16(x, k1, x7);
    for (; n >= 16; p += 16, n -= 16) x = fold16(x, k1, LD(p));
    return finish16(x, p, n);
}

#if KVCRC_AVX512
/* ------------------------------------------------------------------------------------ */
/* Level 3: VPCLMULQDQ folding on 512-bit registers.                                     */

#define AVX512 __attribute__((target("avx512f,vpclmulqdq,sse4.2,pclmul")))
#define AVX512_INLINE \
    __attribute__((target("avx512f,vpclmulqdq,sse4.2,pclmul"), always_inline)) static inline

#define AVX512_MIN 512 /* shorter buffers take the 128-bit loop */

AVX512_INLINE __m512i kvec4(fold_k k) {
    return _mm512_broadcast_i32x4(_mm_set_epi64x((long long)k.hi, (long long)k.lo));
}

/* each lane of x folded forward by the distance of k, xor y */
AVX512_INLINE __m512i fold64(__m512i x, __m512i k, __m512i y) {
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, k, 0x00),
                                     _mm512_clmulepi64_epi128(x, k, 0x11), y, 0x96);
}

#define LDZ(q) _mm512_loadu_si512((const void*)(q))
#define LDZX(q, c) \
    _mm512_xor_si512(LDZ(q), _mm512_inserti32x4(_mm512_setzero_si512(), _mm_cvtsi32_si128((int)(c)), 0))

#define PREFETCH4(q)                                                     \
    do {                                                                 \
        _mm_prefetch((const char*)(q) + PREFETCH, _MM_HINT_T0);          \
        _mm_prefetch((const char*)(q) + PREFETCH + 64, _MM_HINT_T0);     \
        _mm_prefetch((const char*)(q) + PREFETCH + 128, _MM_HINT_T0);    \
        _mm_prefetch((const char*)(q) + PREFETCH + 192, _MM_HINT_T0);    \
    } while (0)

#define FOLD4(k)                         \
    do {                                 \
        x0 = fold64(x0, k, LDZX(p, c));  \
        x1 = fold64(x1, k, LDZ(p + 64)); \
        x2 = fold64(x2, k, LDZ(p + 128));\
        x3 = fold64(x3, k, LDZ(p + 192));\
    } while (0)

AVX512 static uint32_t crc_avx512(uint32_t crc, const uint8_t* p, size_t n) {
    if (n < AVX512_MIN) return crc_pclmul(crc, p, n);
    size_t head = (size_t)(-(uintptr_t)p & 63u); /* to a 64-byte boundary: aligned loads */
    crc = crc_sse42_1(crc, p, head);
    p += head;
    n -= head;
    __m512i x0 = LDZX(p, crc), x1 = LDZ(p + 64), x2 = LDZ(p + 128), x3 = LDZ(p + 192);
    p += 256;
    n -= 256;
    uint32_t c = 0; /* pending: xored into the next fold bytes */
    if (n >= MIXED_MIN) {
        const __m512i km = kvec4(K_MIXED3);
        c = chain(p, AVX512_CRC);
        p += AVX512_CRC;
        n -= AVX512_CRC;
        for (; n >= 2 * 256 + AVX512_CRC; p += 256 + AVX512_CRC, n -= 256 + AVX512_CRC) {
            PREFETCH4(p);
            _mm_prefetch((const char*)p + PREFETCH + 256, _MM_HINT_T0);
            FOLD4(km);
            c = chain(p + 256, AVX512_CRC);
        }
        FOLD4(km); /* the last window without crc bytes */
        p += 256;
        n -= 256;
        c = 0;
    }
    const __m512i k = kvec4(K2048);
    for (; n >= 256; p += 256, n -= 256) {
        PREFETCH4(p);
        FOLD4(k);
    }
    const __m512i k1 = kvec4(K512);
    __m512i x = fold64(x0, k1, x1);
    x = fold64(x, k1, x2);
    x = fold64(x, k1, x3);
    for (; n >= 64; p += 64, n -= 64) x = fold64(x, k1, LDZ(p));
    /* 512 -> 128 bits: lanes 0, 1, 2 folded by 384, 256, 128 bits onto lane 3 */
    __m512i k4 = _mm512_inserti32x4(_mm512_setzero_si512(), kvec(K384), 0);
    k4 = _mm512_inserti32x4(_mm512_inserti32x4(k4, kvec(K256), 1), kvec(K128), 2);
    __m512i y = _mm512_xor_si512(_mm512_clmulepi64_epi128(x, k4, 0x00),
                                 _mm512_clmulepi64_epi128(x, k4, 0x11));
    __m128i r = _mm_xor_si128(_mm512_castsi512_si128(y), _mm512_extracti32x4_epi32(y, 1));
    r = _mm_xor_si128(r, _mm512_extracti32x4_epi32(y, 2));
    r = _mm_xor_si128(r, _mm512_extracti32x4_epi32(x, 3));
    const __m128i k2 = kvec(K128);
    for (; n >= 16; p += 16, n -= 16) r = fold16(r, k2, LD(p));
    return finish16(r, p, n);
}
#endif /* KVCRC_AVX512 */
#endif /* KVCRC_X86 */

/* ------------------------------------------------------------------------------------ */
/* Dispatch.                                                                             */

typedef uint32_t (*crc_fn)(uint32_t, const uint8_t*, size_t);

static int best_level(void) {
#if KVCRC_X86
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("sse4.2")) return LEVEL_TABLE;
    if (!__builtin_cpu_supports("pclmul")) return LEVEL_SSE42;
#if KVCRC_AVX512
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq"))
        return LEVEL_AVX512;
#endif
    return LEVEL_PCLMUL;
#else
    return LEVEL_TABLE;
#endif
}

static int kv_best;
static int kv_level;
static crc_fn kv_fn = crc_table;

static void set_level(int level) {
    kv_level = level < kv_best ? level : kv_best;
    switch (kv_level) {
#if KVCRC_X86
#if KVCRC_AVX512
        case LEVEL_AVX512:
            kv_fn = crc_avx512;
            break;
#endif
        case LEVEL_PCLMUL:
            kv_fn = crc_pclmul;
            break;
        case LEVEL_SSE42:
            kv_fn = crc_sse42;
            break;
#endif
        default:
            kv_fn = crc_table;
    }
}

/* ------------------------------------------------------------------------------------ */
/* Python interface.                                                                     */

PyDoc_STRVAR(crc32c_doc,
             "crc32c($module, data, value=0, /)\n--\n\n"
             "CRC32C of a C-contiguous buffer, continuing from the CRC ``value`` (an int,\n"
             "taken modulo 2**32 like the crc32c package): crc32c(b, crc32c(a)) ==\n"
             "crc32c(a + b).  The GIL is released for buffers of 8 KiB and more.");

/* A CRC ``value`` argument: any int (or __index__), reduced modulo 2**32, as the
 * package's "K" format does.  0, or -1 with an exception set. */
static int crc_value(PyObject* arg, uint32_t* value) {
    unsigned long long v = PyLong_AsUnsignedLongLongMask(arg);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *value = (uint32_t)v;
    return 0;
}

static PyObject* py_crc32c(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "crc32c() takes 1 or 2 positional arguments (%zd given)",
                     nargs);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    if (!PyBuffer_IsContiguous(&view, 'C')) { /* a PyBUF_SIMPLE exporter may not, but check */
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_BufferError, "crc32c() needs a C-contiguous buffer");
        return NULL;
    }
    uint32_t value = 0;
    if (nargs == 2 && crc_value(args[1], &value) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const uint8_t* data = (const uint8_t*)view.buf;
    const size_t len = (size_t)view.len;
    const crc_fn fn = kv_fn;
    uint32_t crc;
    if (len >= GIL_RELEASE_MIN) {
        Py_BEGIN_ALLOW_THREADS
        crc = fn(~value, data, len);
        Py_END_ALLOW_THREADS
    } else {
        crc = len ? fn(~value, data, len) : ~value;
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong((unsigned long)(uint32_t)~crc);
}

PyDoc_STRVAR(crc32c_scatter_doc,
             "crc32c_scatter($module, buffers, nbytes, value=0, /)\n--\n\n"
             "CRC32C of the first ``nbytes`` of the buffers of the sequence ``buffers``, one\n"
             "after the other, continuing from ``value``; returns ``(crc, index, offset)``:\n"
             "where the byte after them is (``buffers[index]``, ``offset`` into it; a buffer\n"
             "taken whole moves ``index`` past it).  ValueError if they hold fewer bytes.\n"
             "The GIL is released while the CRC runs over 8 KiB and more.");

/* The buffers of crc32c_scatter() as a tuple of their own: getting a buffer may run Python
 * code (a __buffer__ method, Python 3.12+) that changes the caller's list, and so frees
 * the item array a PySequence_Fast() of it would be read through.  A tuple copy (of any
 * iterable, as PySequence_Fast() took) holds every item whatever the list becomes. */
static PyObject* buffers_tuple(PyObject* obj) {
    if (PyList_Check(obj) || PyTuple_Check(obj)) return PySequence_Tuple(obj);
    PyObject* it = PyObject_GetIter(obj);
    if (it == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError))
            PyErr_SetString(PyExc_TypeError, "crc32c_scatter(): buffers must be a sequence");
        return NULL;
    }
    PyObject* seq = PySequence_Tuple(it);
    Py_DECREF(it);
    return seq;
}

static PyObject* py_crc32c_scatter(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)self;
    if (nargs < 2 || nargs > 3) {
        PyErr_Format(PyExc_TypeError,
                     "crc32c_scatter() takes 2 or 3 positional arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t nbytes = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (nbytes == -1 && PyErr_Occurred()) return NULL;
    if (nbytes < 0) {
        PyErr_SetString(PyExc_ValueError, "crc32c_scatter(): nbytes must not be negative");
        return NULL;
    }
    uint32_t value = 0;
    if (nargs == 3 && crc_value(args[2], &value) < 0) return NULL;
    PyObject* seq = buffers_tuple(args[0]);
    if (seq == NULL) return NULL;
    const Py_ssize_t count = PyTuple_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq); /* a tuple's: fixed while it is held */
    Py_buffer* views = PyMem_Malloc(sizeof(Py_buffer) * (size_t)(count ? count : 1));
    if (views == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    /* the buffers the bytes lie in: whole ones, then the one they end in */
    Py_ssize_t held = 0, left = nbytes, index = 0, offset = 0;
    while (left > 0 && index < count) {
        Py_buffer* v = &views[held];
        if (PyObject_GetBuffer(items[index], v, PyBUF_SIMPLE) < 0) goto fail;
        held++;
        if (!PyBuffer_IsContiguous(v, 'C')) {
            PyErr_SetString(PyExc_BufferError, "crc32c_scatter() needs C-contiguous buffers");
            goto fail;
        }
        if (v->len > left) {
            offset = left;
            left = 0;
            break;
        }
        left -= v->len;
        index++;
    }
    if (left > 0) {
        PyErr_Format(PyExc_ValueError, "crc32c_scatter(): the buffers hold fewer than %zd bytes", nbytes);
        goto fail;
    }
    const crc_fn fn = kv_fn;
    uint32_t crc = ~value;
    int release = nbytes >= GIL_RELEASE_MIN;
    PyThreadState* ts = release ? PyEval_SaveThread() : NULL;
    Py_ssize_t rest = nbytes;
    for (Py_ssize_t i = 0; i < held; i++) {
        size_t n = (size_t)(views[i].len < rest ? views[i].len : rest);
        if (n) crc = fn(crc, (const uint8_t*)views[i].buf, n);
        rest -= (Py_ssize_t)n;
    }
    if (release) PyEval_RestoreThread(ts);
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_DECREF(seq);
    return Py_BuildValue("(knn)", (unsigned long)(uint32_t)~crc, index, offset);
fail:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_DECREF(seq);
    return NULL;
}

static PyObject* py_isa(PyObject* self, PyObject* args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(LEVEL_NAMES[kv_level]);
}

static PyObject* py_levels(PyObject* self, PyObject* args) {
    (void)self;
    (void)args;
    PyObject* out = PyList_New(kv_best + 1);
    if (out == NULL) return NULL;
    for (int i = 0; i <= kv_best; i++) {
        PyObject* s = PyUnicode_FromString(LEVEL_NAMES[i]);
        if (s == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, s);
    }
    return out;
}

static PyObject* py_set_level(PyObject* self, PyObject* arg) {
    (void)self;
    long level = PyLong_AsLong(arg);
    if (level == -1 && PyErr_Occurred()) return NULL;
    if (level < 0) {
        PyErr_SetString(PyExc_ValueError, "_set_level() needs a level >= 0");
        return NULL;
    }
    set_level(level > LEVEL_AVX512 ? LEVEL_AVX512 : (int)level);
    return PyLong_FromLong(kv_level);
}

static PyObject* py_xpow(PyObject* self, PyObject* arg) {
    (void)self;
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLong(xpow(n));
}

static PyMethodDef methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_FASTCALL, crc32c_doc},
    {"crc32c_scatter", (PyCFunction)(void (*)(void))py_crc32c_scatter, METH_FASTCALL,
     crc32c_scatter_doc},
    {"isa", py_isa, METH_NOARGS, "isa() -> the name of the loop in use"},
    {"levels", py_levels, METH_NOARGS,
     "levels() -> names of the levels this CPU runs, index = level (0 table, 1 sse4.2,\n"
     "2 pclmulqdq, 3 avx512-vpclmulqdq)"},
    {"_set_level", py_set_level, METH_O,
     "_set_level(n) -> the level now in use (n capped at the best this CPU runs)"},
    {"_xpow", py_xpow, METH_O,
     "_xpow(n) -> x**n mod P as a bit-reflected 32-bit register (bit 31 is x**0)"},
    {NULL, NULL, 0, NULL},
};

/* For other extensions (kvwire.aio._sendq), through the capsule _crc_update: the CRC32C
 * value of `crc` continued over p[0..n), as crc32c(data, crc) computes it, GIL not needed. */
static uint32_t crc_update(uint32_t crc, const uint8_t* p, size_t n) {
    return n ? ~kv_fn(~crc, p, n) : crc;
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.wire._crc32c",
    "CRC32C (Castagnoli) with run-time dispatch: VPCLMULQDQ/AVX-512, PCLMULQDQ, SSE4.2, table.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__crc32c(void) {
    init_tables();
#if KVCRC_X86
    init_shift_tables();
    init_fold_constants();
#endif
    kv_best = best_level();
    set_level(kv_best);
    PyObject* m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    /* the highest level this build holds (the CPU may allow less) */
    if (PyModule_AddIntConstant(m, "LEVEL_BUILT", LEVEL_BUILT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    PyObject* api = PyCapsule_New((void*)crc_update, "kvwire.wire._crc32c._crc_update", NULL);
    if (api == NULL || PyModule_AddObject(m, "_crc_update", api) < 0) {
        Py_XDECREF(api);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
