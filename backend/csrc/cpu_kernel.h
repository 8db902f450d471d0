/* The vectors of our quantized CPU kernels (cpu_kernel.c, cpu_amx.c): LANES weights of a panel decoded from
 * their codes, scales and offsets (the layout cpu_kernel.c describes), with AVX-512, AVX2 or GCC's portable
 * vectors. */
#pragma once
#include "cpu_exports.h" /* TABLE_BITS; and cpu_common.h */

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define INTRINSICS 1
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#define PREFETCH_L2(p) _mm_prefetch((const char *)(p), _MM_HINT_T2)
#else
#define INTRINSICS 0
#define PREFETCH(p) __builtin_prefetch(p)
#define PREFETCH_L2(p) __builtin_prefetch(p, 0, 1)
#endif
/* PREFETCH_L2: weights fetched a tile ahead into L2, not L1 (the T2 hint, officially "L3 and outward", which
 * current x86 cores treat as T1's L2; measured with it): a prefetch into L1 holds one of the core's few L1
 * miss buffers until its line arrives (about two dozen on Zen 4), which capped a core's stream from memory near
 * 15 GB/s on an expert's short panels (measured: int8 MoE decode 1.13-1.24x with the L2 hint, 0.75-0.84x with
 * the non-temporal one) */

/* Whether this build's 8-bit products are VNNI's vpdpbusd: AVX-512's, or, without AVX-512, AVX-VNNI's on 8 lanes
 * (Intel's client cores since Alder Lake: AVX2 and AVX-VNNI, no AVX-512) */
#if (defined(__AVX512VNNI__) && defined(__AVX512F__)) \
    || (defined(__AVXVNNI__) && defined(__AVX2__) && !defined(__AVX512F__))
#define VNNI 1
#else
#define VNNI 0
#endif

/* Whether this build's 8-bit kernel sums q * x for 8-bit codes without -128 as |x| times q * sign(x) (AVX2, no
 * VNNI: cpu_int8.c's SIGNED), so their groups' integer sums start at 0, not -128 sum xq */
#if defined(__AVX2__) && !VNNI
#define SEVEN_SIGNED 1
#else
#define SEVEN_SIGNED 0
#endif

#define INLINE static inline __attribute__((always_inline))
#define PANEL 16

/* The tables of bits TABLE_BITS + t (cpu_exports.h): IQ4_NL's (and IQ4_XS's) and MXFP4's values, as gguf-py's
 * dequantize takes them (the tests compare) */
static const int8_t CODE_TABLES[2][16] __attribute__((aligned(16), unused)) = {
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113},
    {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}};
/* bits each code takes in the codes (bits 7: bytes) */
INLINE int code_bits(int bits) { return tabled(bits) ? 4 : bits == 7 || bits == 5 ? 8 : bits; }

/* Scales and offsets, per panel and group, 16 rows' values, in one of three kinds (scale_kind): 0 fp32, 1 fp16, or
 * S > 1 (8 or 16, a power of two) a K-quant's parts: per panel and superblock of S groups, 32 bytes of the 16 rows'
 * fp16 d, then each group's 16 int8 multipliers n; the value is d * n in fp32, exact (an fp16 times a byte), so the
 * file's own scale (formats.decode) at 4.6 bits a weight for Q4_K where fp32 took 6. index: (panel * groups +
 * group) * 16 + the first row's lane; groups a multiple of S. */
INLINE const uint8_t *param_chunk(const void *base, i64 index, int kind) {
    return (const uint8_t *)base + (index >> (4 + __builtin_ctz((unsigned)kind))) * (32 + 16 * (i64)kind);
}
INLINE i64 param_byte(i64 index, int kind) { return 32 + 16 * ((index >> 4) & (kind - 1)) + (index & 15); }
INLINE float param_at(const void *base, i64 index, int kind) {
    if (!base) return 0.0f;
    if (kind == 0) return ((const float *)base)[index];
    if (kind == 1) return (float)((const _Float16 *)base)[index];
    const uint8_t *c = param_chunk(base, index, kind);
    return (float)((const _Float16 *)c)[index & 15] * (float)(int8_t)c[param_byte(index, kind)];
}

#if INTRINSICS && defined(__AVX512F__)
#define LANES 16
#define ROWS_X 16
#define ALL_ROWS(F) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15) F(16)
typedef __m512 V;
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vfma _mm512_fmadd_ps
#define vload _mm512_load_ps
#define vloadu _mm512_loadu_ps
#define vstore _mm512_store_ps
#define vstoreu _mm512_storeu_ps
/* codes of lanes [h * LANES, ..) of the panel at k (h is 0) */
INLINE V vcodes(const uint8_t *c, int bits, int h) {
    (void)h;
    if (code_bits(bits) == 4) {
        __m128i b = _mm_loadl_epi64((const __m128i *)c), mask = _mm_set1_epi8(0x0F);
        __m128i q = _mm_unpacklo_epi64(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
        if (tabled(bits))
            return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_shuffle_epi8(_mm_load_si128((const __m128i *)CODE_TABLES[bits - TABLE_BITS]), q)));
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
}
/* codes at k and k + 1: 4-bit codes of both from one load and one split into low and high nibbles */
INLINE void vcodes2(const uint8_t *c, int bits, int h, V *at_k, V *next) {
    (void)h;
    if (tabled(bits)) {
        *at_k = vcodes(c, bits, 0);
        *next = vcodes(c + PANEL / 2, bits, 0);
    } else if (bits == 4) {
        __m128i b = _mm_loadu_si128((const __m128i *)c), mask = _mm_set1_epi8(0x0F);
        __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        *at_k = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)));
        *next = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi64(lo, hi)));
    } else {
        *at_k = vcodes(c, bits, 0);
        *next = vcodes(c + PANEL, bits, 0);
    }
}
#define PAIRED_CODES 1
INLINE V vparams(const void *base, i64 index, int scale_kind) {
    if (!base) return _mm512_setzero_ps();
    if (scale_kind > 1) {
        const uint8_t *c = param_chunk(base, index, scale_kind);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(c + 2 * (index & 15))));
        const __m128i n = _mm_loadu_si128((const __m128i *)(c + param_byte(index, scale_kind)));
        return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(n)));
    }
    if (scale_kind) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index)));
    return _mm512_loadu_ps((const float *)base + index);
}
#elif INTRINSICS
#define LANES 8
#define ROWS_X 4
#define ALL_ROWS(F) F(1) F(2) F(3) F(4)
typedef __m256 V;
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vfma _mm256_fmadd_ps
#define vload _mm256_load_ps
#define vloadu _mm256_loadu_ps
#define vstore _mm256_store_ps
#define vstoreu _mm256_storeu_ps
INLINE V vcodes(const uint8_t *c, int bits, int h) {
    if (code_bits(bits) == 4) {
        __m128i b = _mm_loadl_epi64((const __m128i *)c);
        if (h) b = _mm_srli_epi16(b, 4);
        b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
        if (tabled(bits))
            return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_shuffle_epi8(_mm_load_si128((const __m128i *)CODE_TABLES[bits - TABLE_BITS]), b)));
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * h))));
}
INLINE V vparams(const void *base, i64 index, int scale_kind) {
    if (!base) return _mm256_setzero_ps();
    if (scale_kind > 1) {
        const uint8_t *c = param_chunk(base, index, scale_kind);
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c + 2 * (index & 15))));
        const __m128i n = _mm_loadl_epi64((const __m128i *)(c + param_byte(index, scale_kind)));
        return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(n)));
    }
    if (scale_kind) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + index)));
    return _mm256_loadu_ps((const float *)base + index);
}
#else
#define LANES 8
#define ROWS_X 4
#define ALL_ROWS(F) F(1) F(2) F(3) F(4)
typedef float V __attribute__((vector_size(32)));
/* a * b + c in two roundings here (-ffp-contract=off); every build is consistent with itself, and the decode's
 * q * scale is exact, so the weights are still gguf-py's bit for bit */
#define vfma(a, b, c) ((a) * (b) + (c))
INLINE V vzero(void) { return (V){0}; }
INLINE V vset1(float x) { return (V){x, x, x, x, x, x, x, x}; }
INLINE V vload(const float *p) { V v; memcpy(&v, p, sizeof v); return v; }
#define vloadu vload
INLINE void vstore(float *p, V v) { memcpy(p, &v, sizeof v); }
#define vstoreu vstore
INLINE V vcodes(const uint8_t *c, int bits, int h) {
    V v;
    for (int i = 0; i < 8; i++)
        v[i] = tabled(bits)  ? (float)CODE_TABLES[bits - TABLE_BITS][(c[i] >> (4 * h)) & 15]
               : bits == 4 ? (float)((c[i] >> (4 * h)) & 15)
                           : (float)((const int8_t *)c)[8 * h + i];
    return v;
}
INLINE V vparams(const void *base, i64 index, int scale_kind) {
    V v = {0};
    for (int i = 0; i < 8; i++) v[i] = param_at(base, index + i, scale_kind);
    return v;
}
#endif
/* AVX2: the 4-bit codes of a panel's two halves (rows 0-7 in the low nibbles, 8-15 in the high) at k and k + 1,
 * from one 16-byte load widened twice: lo/hi at k (lo_k, hi_k) and at k + 1 (lo_n, hi_n); a table's codes looked
 * up first (two byte shuffles), then widened as signed bytes */
#if INTRINSICS && !defined(__AVX512F__)
#define PAIRED_HALVES 1
INLINE void vcodes_halves(const uint8_t *c, int bits, V *lo_k, V *lo_n, V *hi_k, V *hi_n) {
    const __m128i b = _mm_loadu_si128((const __m128i *)c);
    if (tabled(bits)) {
        const __m128i table = _mm_load_si128((const __m128i *)CODE_TABLES[bits - TABLE_BITS]);
        const __m128i mask = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(b, mask));
        const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), mask));
        *lo_k = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        *lo_n = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        *hi_k = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        *hi_n = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
        return;
    }
    const __m256i at_k = _mm256_cvtepu8_epi32(b), at_n = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i low = _mm256_set1_epi32(0x0F);
    *lo_k = _mm256_cvtepi32_ps(_mm256_and_si256(at_k, low));
    *hi_k = _mm256_cvtepi32_ps(_mm256_srli_epi32(at_k, 4));
    *lo_n = _mm256_cvtepi32_ps(_mm256_and_si256(at_n, low));
    *hi_n = _mm256_cvtepi32_ps(_mm256_srli_epi32(at_n, 4));
}
#else
#define PAIRED_HALVES 0
INLINE void vcodes_halves(const uint8_t *c, int bits, V *lo_k, V *lo_n, V *hi_k, V *hi_n) { /* never called */
    (void)c, (void)bits, (void)lo_k, (void)lo_n, (void)hi_k, (void)hi_n;
}
#endif
#ifndef PAIRED_CODES
INLINE void vcodes2(const uint8_t *c, int bits, int h, V *at_k, V *next) {
    *at_k = vcodes(c, bits, h);
    *next = vcodes(c + PANEL * code_bits(bits) / 8, bits, h);
}
#endif

typedef struct Weight {
    const uint8_t *codes;
    const void *scales, *offsets;
    i64 K, group, panel_code_bytes, panel_groups;
    int bits, scale_kind;
    i64 codes_from; /* the panel `codes` starts at (0; a call's panels laid out again: cpu_int8.c's looked_up) */
} Weight;

/* A [rows, K] weight in the packed layout: its codes, scales and offsets (NULL: none), K's group of one scale.
 * bits 7: bytes of codes in AMX tiles' pair order that fit 7 bits (cpu_amx_codes.c), or quads' bytes with no -128;
 * bits 5: quads' bytes (q + 128, as 7's) every q of which fits -64 .. 63 (IQ3_XXS's and IQ2's grids);
 * TABLE_BITS + t: 4-bit codes into table t (cpu_exports.h). */
INLINE Weight weight_of(const uint8_t *codes, const void *scales, const void *offsets, i64 K, i64 group, int bits,
                        int scale_kind) {
    Weight w = {codes, scales, offsets, K, group, K * PANEL * code_bits(bits) / 8, K / group, bits, scale_kind};
    return w;
}


/* tile t of x [M, K]'s rows into xt [tiles][K / 2][ROWS_X][2], as the kernel's tiles read x: per pair of k's, each
 * row's x at k and k + 1 side by side (one 64-bit broadcast for cpu_nibbles.c; one row is its own layout) */
INLINE void transpose_tile(const float *x, i64 t, i64 M, i64 K, float *xt) {
    for (i64 i = 0; i < ROWS_X && t * ROWS_X + i < M; i++)
        for (i64 k = 0; k < K; k++)
            xt[t * K * ROWS_X + ((k >> 1) * ROWS_X + i) * 2 + (k & 1)] = x[(t * ROWS_X + i) * K + k];
}

/* A thread's scratch, grown on demand and kept: an allocation of this size per call would be an mmap and its page
 * faults. NULL where memory ran out. */
INLINE void *grown(void **buf, size_t *size, size_t bytes) {
    if (*size < bytes) {
        free(*buf);
        *buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
        *size = *buf ? bytes : 0;
    }
    return *buf;
}
