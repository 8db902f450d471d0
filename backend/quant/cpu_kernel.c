/* Quantized matmul on the CPU: y[m, n] = sum_k x[m, k] * w[n, k], each weight decoded inside the loop from the
 * integer code and the scale (and offset) of a GGUF block format, repacked at load by cpu_native.py:
 *
 *   weight rows in panels of 16 (padded with zero rows to a multiple of 4 panels); for each panel and each k, the
 *   codes of its 16 rows: bits 4: 8 bytes, byte j = q[row j] | q[row j + 8] << 4 (q unsigned, 0..15); bits 8: 16
 *   signed bytes
 *   scales, offsets: per panel and group of `group` k's (16 or 32), the 16 rows' values, fp16 (f16) or fp32;
 *   offsets may be NULL (zero)
 *
 * w = fma(q, scale, offset) is gguf-py's dequantized weight bit for bit (every format's q * scale is exact in
 * fp32), and each output is the sum over k of x * w in k's order, in fp32: the arithmetic of one row does not
 * depend on how many rows are computed with it (a sequence decodes the same alone or in a batch, as a draft's
 * verification row or as a decode row).
 *
 * A vector holds LANES rows of a panel (16 with AVX-512, 8 otherwise: a panel is then two halves), and a tile
 * meets up to ROWS_X rows of x (16 with AVX-512, 4 otherwise) with an accumulator per row and vector (at most 16
 * of AVX-512's 32 registers, 8 of AVX2's 16), so a decode step, a verification run of up to ROWS_X - 1 drafts
 * and a batch cost one pass over the weights per ROWS_X rows. Past ROWS_X rows each panel is decoded once into
 * L1 and reused by every tile.
 *
 * Compiled at first use with -march=native: AVX-512 or AVX2 (with FMA and F16C) intrinsics on x86, otherwise
 * (ARM, older x86) GCC's portable vectors of 8 floats, which the compiler maps to the CPU's (NEON, SSE).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define INTRINSICS 1
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#define INTRINSICS 0
#define PREFETCH(p) __builtin_prefetch(p)
#endif

typedef int64_t i64;

#define INLINE static inline __attribute__((always_inline))
#define PANEL 16

#if INTRINSICS && defined(__AVX512F__)
#define LANES 16
#define ROWS_X 16
#define ALL_ROWS(F) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15) F(16)
typedef __m512 V;
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vfma _mm512_fmadd_ps
#define vload _mm512_load_ps
#define vstore _mm512_store_ps
#define vstoreu _mm512_storeu_ps
/* codes of lanes [h * LANES, ..) of the panel at k (h is 0) */
INLINE V vcodes(const uint8_t *c, int bits, int h) {
    (void)h;
    if (bits == 4) {
        __m128i b = _mm_loadl_epi64((const __m128i *)c), mask = _mm_set1_epi8(0x0F);
        __m128i q = _mm_unpacklo_epi64(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
}
/* codes at k and k + 1: 4-bit codes of both from one load and one split into low and high nibbles */
INLINE void vcodes2(const uint8_t *c, int bits, int h, V *at_k, V *next) {
    (void)h;
    if (bits == 4) {
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
INLINE V vparams(const void *base, i64 index, int f16) {
    if (!base) return _mm512_setzero_ps();
    if (f16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + index)));
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
#define vstore _mm256_store_ps
#define vstoreu _mm256_storeu_ps
INLINE V vcodes(const uint8_t *c, int bits, int h) {
    if (bits == 4) {
        __m128i b = _mm_loadl_epi64((const __m128i *)c);
        if (h) b = _mm_srli_epi16(b, 4);
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F))));
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8 * h))));
}
INLINE V vparams(const void *base, i64 index, int f16) {
    if (!base) return _mm256_setzero_ps();
    if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + index)));
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
INLINE void vstore(float *p, V v) { memcpy(p, &v, sizeof v); }
#define vstoreu vstore
INLINE V vcodes(const uint8_t *c, int bits, int h) {
    V v;
    for (int i = 0; i < 8; i++)
        v[i] = bits == 4 ? (float)((c[i] >> (4 * h)) & 15) : (float)((const int8_t *)c)[8 * h + i];
    return v;
}
INLINE V vparams(const void *base, i64 index, int f16) {
    V v = {0};
    if (!base) return v;
    for (int i = 0; i < 8; i++)
        v[i] = f16 ? (float)((const _Float16 *)base)[index + i] : ((const float *)base)[index + i];
    return v;
}
#endif
#ifndef PAIRED_CODES
INLINE void vcodes2(const uint8_t *c, int bits, int h, V *at_k, V *next) {
    *at_k = vcodes(c, bits, h);
    *next = vcodes(c + PANEL * bits / 8, bits, h);
}
#endif

typedef struct {
    const uint8_t *codes;
    const void *scales, *offsets;
    i64 K, group, panel_code_bytes, panel_groups;
    int bits, f16;
} Weight;

/* H vectors make a panel; a tile's NC column vectors cover panels p, p + 1, .. (vector c: panel p + c / H, rows
 * (c % H) * LANES ..). Several column vectors for few rows of x: each output's sum is one chain of dependent
 * fma's, so a decode step's single row needs several chains in flight to keep the FMA units busy. */
#define H (PANEL / LANES)
#define R16(F, c) F(0, c) F(1, c) F(2, c) F(3, c) F(4, c) F(5, c) F(6, c) F(7, c) \
                  F(8, c) F(9, c) F(10, c) F(11, c) F(12, c) F(13, c) F(14, c) F(15, c)
#define RC(F) R16(F, 0) R16(F, 1) R16(F, 2) R16(F, 3)
#define C4(F) F(0) F(1) F(2) F(3)

/* y[m, ..] for MR rows of x (MR <= ROWS_X) and NC column vectors, x transposed: xt[k * xs + m]. The weights come
 * from the codes, or from `decoded` ([K][16] fp32, the same values, NC == H) when the panel meets several tiles.
 * The accumulators are named, one per row and column vector (GCC stores an array of vectors to the stack on
 * every iteration); those past MR and NC are compiled out. */
INLINE void tile(const Weight *w, i64 p, const float *xt, i64 xs, const int MR, const int NC, float *y, i64 ldy,
                 i64 N, int bits, const float *decoded) {
#define ACC(r, c) V a_##r##_##c = vzero();
    RC(ACC)
#undef ACC
#define FMA(r, c) if (MR > r && NC > c) a_##r##_##c = vfma(vset1(xk[r]), w##c, a_##r##_##c);
    if (decoded) {
        for (i64 k = 0; k < w->K; k++) {
#define LOAD(c) V w##c = NC > c ? vload(decoded + k * PANEL + (c % H) * LANES) : vzero();
            C4(LOAD)
#undef LOAD
            const float *xk = xt + k * xs;
            RC(FMA)
        }
    } else {
        const i64 step = PANEL * bits / 8;
        const uint8_t *next = w->codes + (p + (NC + H - 1) / H) * w->panel_code_bytes;
#define CODES(c) const uint8_t *codes##c = w->codes + (p + c / H) * w->panel_code_bytes;
        C4(CODES)
#undef CODES
        for (i64 g = 0; g < w->K / w->group; g++) {
#define PARAMS(c) i64 at##c = ((p + c / H) * w->panel_groups + g) * PANEL + (c % H) * LANES;        \
                  V s##c = NC > c ? vparams(w->scales, at##c, w->f16) : vzero();                  \
                  V o##c = NC > c ? vparams(w->offsets, at##c, w->f16) : vzero();
            C4(PARAMS)
#undef PARAMS
            /* the next panels' codes (past the last panel a prefetch is harmless): a core streamed 4 GB/s
             * without it (measured) */
            for (i64 b = 0; b < (NC + H - 1) / H * w->group * step; b += 64)
                PREFETCH(next + g * w->group * step + b);
            /* two k at a time (groups are 16 or 32 long): one load and nibble split serve both */
            for (i64 k = g * w->group; k < (g + 1) * w->group; k += 2) {
#define DECODE(c) V w##c = vzero(), u##c = vzero();                                  \
                  if (NC > c) {                                                       \
                      vcodes2(codes##c + k * step, bits, c % H, &w##c, &u##c);        \
                      w##c = vfma(w##c, s##c, o##c);                                  \
                      u##c = vfma(u##c, s##c, o##c);                                  \
                  }
                C4(DECODE)
#undef DECODE
                const float *xk = xt + k * xs;
                RC(FMA)
#define NEXT(c) w##c = u##c;
                C4(NEXT)
#undef NEXT
                xk += xs;
                RC(FMA)
            }
        }
    }
#undef FMA
    float out[LANES] __attribute__((aligned(64)));
#define OUT(r, c)                                                                                          \
    if (MR > r && NC > c) {                                                                                \
        i64 col = (p + c / H) * PANEL + (c % H) * LANES, n = N - col < LANES ? N - col : LANES;              \
        float *yo = y + r * ldy + col;                                                                     \
        if (n == LANES) vstoreu(yo, a_##r##_##c);                                                          \
        else if (n > 0) { vstore(out, a_##r##_##c); memcpy(yo, out, n * sizeof(float)); }                  \
    }
    RC(OUT)
#undef OUT
}

/* Panel p's weights, [K][16] fp32: decoded once when more than one tile of x rows meets them (the same values
 * tile would decode, so the result is the same bits either way; decoding inside the tile is twice as fast for
 * a decode step's one row, measured). */
INLINE void decode_panel(const Weight *w, i64 p, float *out, int bits) {
    const uint8_t *codes = w->codes + p * w->panel_code_bytes, *next = codes + w->panel_code_bytes;
    const i64 step = PANEL * bits / 8;
    for (i64 g = 0; g < w->K / w->group; g++) {
        for (i64 b = 0; b < w->group * step; b += 64)
            PREFETCH(next + g * w->group * step + b);
        for (int h = 0; h < PANEL / LANES; h++) {
            i64 at = (p * w->panel_groups + g) * PANEL + h * LANES;
            V s = vparams(w->scales, at, w->f16), o = vparams(w->offsets, at, w->f16);
            for (i64 k = g * w->group; k < (g + 1) * w->group; k++)
                vstore(out + k * PANEL + h * LANES, vfma(vcodes(codes + k * step, bits, h), s, o));
        }
    }
}

/* Column vectors per tile for MR rows of x: every accumulator of 16 (AVX-512) or 8 (AVX2) registers. */
#define COLUMNS(MR) (MR <= 4 / H ? 4 : MR <= 8 / H ? 2 : 1)
#define PANELS_PER_TILE(MR) ((COLUMNS(MR) + H - 1) / H)

/* Panels [p, p + PANELS_PER_TILE(M)) for M <= ROWS_X rows of x (weights are packed in whole groups of 4 panels,
 * so a tile never runs past them; what it computes past the last row is not stored). OpenMP outlines a parallel
 * loop's body into a function of its own, where the code width would be a runtime value again: each tile goes
 * through here, specialised per width (a branch per tile). */
static void few_rows(const Weight *w, i64 p, const float *x, i64 xs, i64 M, float *y, i64 N, i64 ldy) {
    switch (M) {
#define CASE(MR) case MR: {                                                      \
        if (w->bits == 4) tile(w, p, x, xs, MR, COLUMNS(MR), y, ldy, N, 4, NULL); \
        else tile(w, p, x, xs, MR, COLUMNS(MR), y, ldy, N, 8, NULL);              \
        break;                                                                   \
    }
    ALL_ROWS(CASE)
#undef CASE
    }
}

/* Panel p for M > ROWS_X rows of x: decoded once, then tiles of ROWS_X rows (the last one shorter). */
static void many_rows(const Weight *w, i64 p, const float *xt, i64 M, float *y, i64 N, i64 ldy, float *decoded) {
    if (w->bits == 4) decode_panel(w, p, decoded, 4);
    else decode_panel(w, p, decoded, 8);
    const i64 xs = ROWS_X;
    for (i64 m0 = 0; m0 < M; m0 += ROWS_X) {
        const float *xm = xt + m0 * w->K;
        float *ym = y + m0 * ldy;
        switch (M - m0 < ROWS_X ? M - m0 : ROWS_X) {
#define CASE(MR) case MR: { tile(w, p, xm, xs, MR, H, ym, ldy, N, 8, decoded); break; }
        ALL_ROWS(CASE)
#undef CASE
        }
    }
}

/* Grown on demand and kept: an allocation of this size per call would be an mmap and its page faults. */
static float *buffer(float **buf, size_t *size, size_t floats) {
    if (*size < floats) {
        free(*buf);
        *buf = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        *size = *buf ? floats : 0;
    }
    return *buf;
}

/* y [M, N] = x [M, K] @ w.T, y's rows ldy apart (a part of a fused layer's output writes its own columns) */
void qmm(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
         int bits, i64 group, int f16, float *y, i64 ldy, int threads) {
    Weight w = {codes, scales, offsets, K, group, K * PANEL * bits / 8, K / group, bits, f16};
    i64 panels = (N + PANEL - 1) / PANEL, tiles = (M + ROWS_X - 1) / ROWS_X;
#pragma omp parallel num_threads(threads)
    {
        /* x transposed per tile of ROWS_X rows, [tiles][K][ROWS_X], by each thread for itself (no barrier): a
         * tile's broadcasts then read one pointer at fixed offsets (a pointer per row would not fit the general
         * registers); one row is its own transpose */
        static __thread float *xt_buf, *decoded_buf;
        static __thread size_t xt_size, decoded_size;
        float *xt = M > 1 ? buffer(&xt_buf, &xt_size, (size_t)(tiles * K * ROWS_X)) : NULL;
        for (i64 t = 0; xt && t < tiles; t++)
            for (i64 i = 0; i < ROWS_X && t * ROWS_X + i < M; i++)
                for (i64 k = 0; k < K; k++) xt[(t * K + k) * ROWS_X + i] = x[(t * ROWS_X + i) * K + k];
        if (M > ROWS_X) {
            float *decoded = buffer(&decoded_buf, &decoded_size, (size_t)K * PANEL);
#pragma omp for schedule(static)
            for (i64 p = 0; p < panels; p++) many_rows(&w, p, xt, M, y, N, ldy, decoded);
        } else {
            i64 per = PANELS_PER_TILE(M), groups = (panels + per - 1) / per;
#pragma omp for schedule(static)
            for (i64 g = 0; g < groups; g++) few_rows(&w, g * per, xt ? xt : x, xt ? ROWS_X : 1, M, y, N, ldy);
        }
    }
}
