/* Quantized matmul on the CPU: y[m, n] = sum_k x[m, k] * w[n, k], each weight decoded inside the loop from the
 * integer code and the scale (and offset) of a GGUF block format, repacked at load by cpu_native.py:
 *
 *   weight rows in panels of 16 (the last one padded with zero rows); for each panel and each k, the codes of its
 *   16 rows: bits 4: 8 bytes, byte j = q[row j] | q[row j + 8] << 4 (q unsigned, 0..15); bits 8: 16 signed bytes
 *   scales, offsets: per panel and group of `group` k's (16 or 32), the 16 rows' values, fp16 (f16) or fp32;
 *   offsets may be NULL (zero)
 *
 * w = fma(q, scale, offset) is gguf-py's dequantized weight bit for bit (every format's q * scale is exact in
 * fp32), and each output is the sum over k of x * w in k's order, in fp32: the arithmetic of one row does not
 * depend on how many rows are computed with it (a sequence decodes the same alone or in a batch, as a draft's
 * verification row or as a decode row).
 *
 * Needs AVX2, FMA and F16C; compiled at first use with -march=native.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "this CPU lacks AVX2/FMA/F16C"
#endif

typedef int64_t i64;

#define INLINE static inline __attribute__((always_inline))
#define PANEL 16
#ifdef __AVX512VL__
#define ROWS_X 8 /* rows of x per tile: 16 accumulators of AVX-512's 32 vector registers */
#else
#define ROWS_X 4 /* 8 accumulators of AVX2's 16 */
#endif

typedef struct {
    const uint8_t *codes;
    const void *scales, *offsets;
    i64 K, group, panel_code_bytes, panel_groups;
    int bits, f16;
} Weight;

/* The 16 rows' weights at column k of panel p, as two vectors (rows 0-7, 8-15). */
INLINE void codes16(const Weight *w, i64 p, i64 k, int bits, __m256 *q0, __m256 *q1) {
    if (bits == 4) {
        const uint8_t *c = w->codes + p * w->panel_code_bytes + k * 8;
        __m128i b = _mm_loadl_epi64((const __m128i *)c), mask = _mm_set1_epi8(0x0F);
        *q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(b, mask)));
        *q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
    } else {
        const int8_t *c = (const int8_t *)w->codes + p * w->panel_code_bytes + k * 16;
        *q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
        *q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8))));
    }
}

/* 8 rows' scales (or offsets) from index on. */
INLINE __m256 params8(const void *base, i64 index, int f16) {
    if (!base) return _mm256_setzero_ps();
    if (f16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + index)));
    return _mm256_loadu_ps((const float *)base + index);
}

/* y[m, 16p .. 16p + 16) for MR rows of x (MR <= ROWS_X): the accumulators named, one pair a row (GCC stores an
 * array of vectors to the stack on every iteration); rows past MR are compiled out. */
INLINE void tile(const Weight *w, i64 p, const float *x, const int MR, float *y, i64 ldy, i64 nr, int bits, int f16,
                 const float *decoded) {
    const i64 K = w->K;
#define XROW(i) const float *x##i = MR > i ? x + i * K : x;
    XROW(0) XROW(1) XROW(2) XROW(3)
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
#if ROWS_X == 8
    XROW(4) XROW(5) XROW(6) XROW(7)
    __m256 a40 = a00, a41 = a00, a50 = a00, a51 = a00, a60 = a00, a61 = a00, a70 = a00, a71 = a00;
#endif
#undef XROW
    const i64 groups = K / w->group;
    const uint8_t *next = w->codes + (p + 1) * w->panel_code_bytes;
    for (i64 g = 0; g < groups; g++) {
        i64 at = (p * w->panel_groups + g) * PANEL;
        __m256 s0, s1, o0, o1;
        if (!decoded) {
            s0 = params8(w->scales, at, f16), s1 = params8(w->scales, at + 8, f16);
            o0 = params8(w->offsets, at, f16), o1 = params8(w->offsets, at + 8, f16);
            /* the next panel's codes (past the last panel a prefetch is harmless): a core streamed 4 GB/s
             * without it (measured) */
            for (i64 at = 0; at < w->group * bits * 2; at += 64)
                _mm_prefetch((const char *)(next + g * w->group * bits * 2 + at), _MM_HINT_T0);
        }
        for (i64 k = g * w->group; k < (g + 1) * w->group; k++) {
            __m256 w0, w1, b;
            if (decoded) {
                w0 = _mm256_load_ps(decoded + k * PANEL), w1 = _mm256_load_ps(decoded + k * PANEL + 8);
            } else {
                __m256 q0, q1;
                codes16(w, p, k, bits, &q0, &q1);
                w0 = _mm256_fmadd_ps(q0, s0, o0), w1 = _mm256_fmadd_ps(q1, s1, o1);
            }
#define ROW(i) if (MR > i) { b = _mm256_broadcast_ss(x##i + k); a##i##0 = _mm256_fmadd_ps(b, w0, a##i##0); \
                             a##i##1 = _mm256_fmadd_ps(b, w1, a##i##1); }
            ROW(0) ROW(1) ROW(2) ROW(3)
#if ROWS_X == 8
            ROW(4) ROW(5) ROW(6) ROW(7)
#endif
#undef ROW
        }
    }
    float out[ROWS_X][PANEL];
#define OUT(i) _mm256_storeu_ps(out[i], a##i##0); _mm256_storeu_ps(out[i] + 8, a##i##1);
    OUT(0) OUT(1) OUT(2) OUT(3)
#if ROWS_X == 8
    OUT(4) OUT(5) OUT(6) OUT(7)
#endif
#undef OUT
    for (i64 m = 0; m < MR; m++)
        for (i64 j = 0; j < nr; j++) y[m * ldy + p * PANEL + j] = out[m][j];
}

/* Panel p's weights, [K][16] fp32: decoded once when more than one tile of x rows meets them (the same values
 * tile would decode, so the result is the same bits either way; decoding inside the tile is twice as fast for
 * a decode step's one row, measured). */
INLINE void decode_panel(const Weight *w, i64 p, float *out, int bits, int f16) {
    const uint8_t *next = w->codes + (p + 1) * w->panel_code_bytes;
    for (i64 g = 0; g < w->K / w->group; g++) {
        i64 at = (p * w->panel_groups + g) * PANEL;
        __m256 s0 = params8(w->scales, at, f16), s1 = params8(w->scales, at + 8, f16);
        __m256 o0 = params8(w->offsets, at, f16), o1 = params8(w->offsets, at + 8, f16);
        for (i64 at = 0; at < w->group * bits * 2; at += 64)
            _mm_prefetch((const char *)(next + g * w->group * bits * 2 + at), _MM_HINT_T0);
        for (i64 k = g * w->group; k < (g + 1) * w->group; k++) {
            __m256 q0, q1;
            codes16(w, p, k, bits, &q0, &q1);
            _mm256_store_ps(out + k * PANEL, _mm256_fmadd_ps(q0, s0, o0));
            _mm256_store_ps(out + k * PANEL + 8, _mm256_fmadd_ps(q1, s1, o1));
        }
    }
}

/* OpenMP outlines a parallel loop's body into a function of its own, where the format's constants would be
 * runtime values again: each panel's work goes through here, specialised per format (a branch per panel). */
static void panel_rows(const Weight *w, i64 p, const float *x, i64 M, float *y, i64 N, float *scratch) {
    i64 nr = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
    const float *decoded = NULL;
    if (M > ROWS_X) {
        if (w->bits == 4 && w->f16) decode_panel(w, p, scratch, 4, 1);
        else if (w->bits == 4) decode_panel(w, p, scratch, 4, 0);
        else if (w->f16) decode_panel(w, p, scratch, 8, 1);
        else decode_panel(w, p, scratch, 8, 0);
        decoded = scratch;
    }
    for (i64 m0 = 0; m0 < M; m0 += ROWS_X) {
        i64 mr = M - m0 < ROWS_X ? M - m0 : ROWS_X;
        const float *xm = x + m0 * w->K;
        float *ym = y + m0 * N;
#define FORMATS(MR)                                                                 \
        if (decoded) tile(w, p, xm, MR, ym, N, nr, 4, 1, decoded);                      \
        else if (w->bits == 4 && w->f16) tile(w, p, xm, MR, ym, N, nr, 4, 1, NULL);     \
        else if (w->bits == 4) tile(w, p, xm, MR, ym, N, nr, 4, 0, NULL);               \
        else if (w->f16) tile(w, p, xm, MR, ym, N, nr, 8, 1, NULL);                     \
        else tile(w, p, xm, MR, ym, N, nr, 8, 0, NULL);
        switch (mr) {
        case 1: FORMATS(1) break;
        case 2: FORMATS(2) break;
        case 3: FORMATS(3) break;
#if ROWS_X == 8
        case 4: FORMATS(4) break;
        case 5: FORMATS(5) break;
        case 6: FORMATS(6) break;
        case 7: FORMATS(7) break;
#endif
        default: FORMATS(ROWS_X)
        }
#undef FORMATS
    }
}

/* y [M, N] = x [M, K] @ w.T */
void qmm(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
         int bits, i64 group, int f16, float *y, int threads) {
    Weight w = {codes, scales, offsets, K, group, K * PANEL * bits / 8, K / group, bits, f16};
    i64 panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = M > ROWS_X ? aligned_alloc(64, (size_t)K * PANEL * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (i64 p = 0; p < panels; p++) panel_rows(&w, p, x, M, y, N, scratch);
        free(scratch);
    }
}
