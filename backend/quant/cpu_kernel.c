/* Quantized matmul on the CPU: y[m, n] = sum_k x[m, k] * w[n, k], with w decoded inside the loop from
 * the integers and scales of a GGUF block format (backend/quant/cpu_native.py repacks them at load).
 *
 * Layout of one weight row: K / 32 chunks of 32 weights.
 *   codes, bits 4: 16 bytes a chunk, byte j = q[j] | q[16 + j] << 4 (q unsigned, 0..15)
 *   codes, bits 8: 32 signed bytes a chunk
 *   scales, offsets: `groups` per chunk (1: all 32 weights; 2: weights 0-15, then 16-31), fp32 or fp16
 *   (f16 = 1), offsets optional (NULL reads as 0).
 * Each weight is fma(q, scale, offset) in fp32: gguf-py's q * scale (+ offset) exactly, since every format's
 * q * scale is exact in fp32. x, y and the sums are fp32.
 *
 * Needs AVX2, FMA and F16C (x86-64 from 2013 on); compiled at first use with -march=native.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "this CPU lacks AVX2/FMA/F16C"
#endif

typedef int64_t i64;

typedef struct {
    const uint8_t *codes;
    const void *scales;
    const void *offsets;
    i64 K, row_code_bytes, row_groups;
    int bits, groups, f16;
} Weight;

#define INLINE static inline __attribute__((always_inline))
/* Weight rows are read with a software prefetch of the same chunk 16 rows on: without it one core streamed
 * 4 GB/s (measured), with it the two reach 20+ GB/s. Reading past the last row is harmless for a prefetch. */
#define PREFETCH_ROWS 16

INLINE float param(const void *p, i64 i, int f16) {
    if (!p) return 0.0f;
    return f16 ? _cvtsh_ss(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 codes of chunk c of row n as floats, in order. */
INLINE void codes32(const Weight *w, i64 n, i64 c, int bits, __m256 q[4]) {
    if (bits == 4) {
        __m128i b = _mm_loadu_si128((const __m128i *)(w->codes + n * w->row_code_bytes + c * 16));
        __m128i mask = _mm_set1_epi8(0x0F);
        __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        const int8_t *p = (const int8_t *)w->codes + n * w->row_code_bytes + c * 32;
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * i))));
    }
}

/* The 32 weights of chunk c of row n. */
INLINE void chunk32(const Weight *w, i64 n, i64 c, int bits, int groups, int f16, __m256 out[4]) {
    codes32(w, n, c, bits, out);
    i64 g = n * w->row_groups + c * groups;
    __m256 s0 = _mm256_set1_ps(param(w->scales, g, f16)), o0 = _mm256_set1_ps(param(w->offsets, g, f16));
    __m256 s1 = groups == 2 ? _mm256_set1_ps(param(w->scales, g + 1, f16)) : s0;
    __m256 o1 = groups == 2 ? _mm256_set1_ps(param(w->offsets, g + 1, f16)) : o0;
    out[0] = _mm256_fmadd_ps(out[0], s0, o0);
    out[1] = _mm256_fmadd_ps(out[1], s0, o0);
    out[2] = _mm256_fmadd_ps(out[2], s1, o1);
    out[3] = _mm256_fmadd_ps(out[3], s1, o1);
}

/* Rows m0..m0+MR of x against weight rows n0..n0+NR (small M): sum_k (q s + o) x = s sum_k q x + o sum_k x per
 * group, so each code meets x as a float once and the scales once a group. xsum: x's sums per 16 weights. */
INLINE void tile_direct(const Weight *w, const float *x, i64 ldx, const float *xsum, float *y, i64 ldy, i64 n0,
                        int MR, int NR, int bits, int groups, int f16) {
    __m256 acc[4][4];
    float oacc[4][4];
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) acc[m][n] = _mm256_setzero_ps(), oacc[m][n] = 0.0f;
    i64 chunks = w->K / 32, ldsum = w->K / 16;
    for (i64 c = 0; c < chunks; c++) {
#pragma GCC unroll 4
        for (int n = 0; n < NR; n++) {
            __m256 q[4];
            codes32(w, n0 + n, c, bits, q);
            i64 g = (n0 + n) * w->row_groups + c * groups;
            float s0 = param(w->scales, g, f16), s1 = groups == 2 ? param(w->scales, g + 1, f16) : s0;
            float o0 = param(w->offsets, g, f16), o1 = groups == 2 ? param(w->offsets, g + 1, f16) : o0;
#pragma GCC unroll 4
            for (int m = 0; m < MR; m++) {
                const float *xm = x + m * ldx + c * 32;
                __m256 a = _mm256_mul_ps(q[0], _mm256_loadu_ps(xm));
                a = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xm + 8), a);
                __m256 b = _mm256_mul_ps(q[2], _mm256_loadu_ps(xm + 16));
                b = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xm + 24), b);
                const float *xs = xsum + m * ldsum + 2 * c;
                if (groups == 1) {
                    acc[m][n] = _mm256_fmadd_ps(_mm256_add_ps(a, b), _mm256_set1_ps(s0), acc[m][n]);
                    if (w->offsets) oacc[m][n] += o0 * (xs[0] + xs[1]);
                } else {
                    acc[m][n] = _mm256_fmadd_ps(a, _mm256_set1_ps(s0), acc[m][n]);
                    acc[m][n] = _mm256_fmadd_ps(b, _mm256_set1_ps(s1), acc[m][n]);
                    if (w->offsets) oacc[m][n] += o0 * xs[0] + o1 * xs[1];
                }
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int n = 0; n < NR; n++) y[m * ldy + n0 + n] = hsum(acc[m][n]) + oacc[m][n];
}

INLINE void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        u[4 * i + 0] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

#define PANEL_N 16
#ifdef __AVX512VL__
#define PANEL_M 8 /* 16 accumulators: AVX-512 has 32 vector registers */
#else
#define PANEL_M 6 /* 12 accumulators of AVX2's 16 registers */
#endif

/* Weight rows n0..n0+nr decoded and transposed, panel[k * 16 + j] = w[n0 + j, k] (rows past nr are 0), so
 * that the product below is a register-blocked outer product with no horizontal sums. */
INLINE void decode_panel(const Weight *w, i64 n0, i64 nr, float *panel, int bits, int groups, int f16) {
    __m256 rows[PANEL_N][4], r[8];
    for (i64 c = 0; c < w->K / 32; c++) {
        for (int j = 0; j < PANEL_N; j++) {
            _mm_prefetch((const char *)(w->codes + (n0 + j + PANEL_N) * w->row_code_bytes + c * bits * 4), _MM_HINT_T0);
            if (j < nr) chunk32(w, n0 + j, c, bits, groups, f16, rows[j]);
            else rows[j][0] = rows[j][1] = rows[j][2] = rows[j][3] = _mm256_setzero_ps();
        }
        for (int i = 0; i < 4; i++)
            for (int half = 0; half < 2; half++) {
                for (int j = 0; j < 8; j++) r[j] = rows[half * 8 + j][i];
                transpose8(r);
                for (int k = 0; k < 8; k++) _mm256_storeu_ps(panel + (c * 32 + i * 8 + k) * PANEL_N + half * 8, r[k]);
            }
    }
}

/* y[m, n0..n0+nr] for mr (<= PANEL_M) rows of x against a decoded panel: the accumulators held in registers
 * (named: GCC spills an array of them to the stack on every iteration). Missing rows repeat row 0. */
static void tile_panel(const float *panel, i64 K, const float *x, i64 ldx, float *y, i64 ldy, i64 n0, i64 nr,
                       int mr) {
    const float *x0 = x, *x1 = mr > 1 ? x + ldx : x, *x2 = mr > 2 ? x + 2 * ldx : x, *x3 = mr > 3 ? x + 3 * ldx : x,
                *x4 = mr > 4 ? x + 4 * ldx : x, *x5 = mr > 5 ? x + 5 * ldx : x;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
           a40 = a00, a41 = a00, a50 = a00, a51 = a00;
#if PANEL_M == 8
    const float *x6 = mr > 6 ? x + 6 * ldx : x, *x7 = mr > 7 ? x + 7 * ldx : x;
    __m256 a60 = a00, a61 = a00, a70 = a00, a71 = a00;
#endif
    for (i64 k = 0; k < K; k++) {
        __m256 w0 = _mm256_loadu_ps(panel + k * PANEL_N), w1 = _mm256_loadu_ps(panel + k * PANEL_N + 8), b;
#define ROW(i) b = _mm256_broadcast_ss(x##i + k); a##i##0 = _mm256_fmadd_ps(b, w0, a##i##0); \
               a##i##1 = _mm256_fmadd_ps(b, w1, a##i##1);
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#if PANEL_M == 8
        ROW(6) ROW(7)
#endif
#undef ROW
    }
    float out[PANEL_M][PANEL_N];
#define OUT(i) _mm256_storeu_ps(out[i], a##i##0); _mm256_storeu_ps(out[i] + 8, a##i##1);
    OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5)
#if PANEL_M == 8
    OUT(6) OUT(7)
#endif
#undef OUT
    for (int m = 0; m < mr; m++)
        for (i64 j = 0; j < nr; j++) y[m * ldy + n0 + j] = out[m][j];
}

#define PANEL_MIN_ROWS 5 /* from here decoded panels beat decoding inside the dot products (measured) */

/* One row of x (decode) against weight rows n0..n0+NR: tile_direct with named accumulators (GCC stores an
 * array of them to the stack on every chunk). */
INLINE void tile_row(const Weight *w, const float *x, const float *xsum, float *y, i64 n0, int NR, int bits,
                     int groups, int f16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    float o0 = 0.0f, o1 = 0.0f, o2 = 0.0f, o3 = 0.0f;
    const int off = w->offsets != NULL;
    for (i64 c = 0; c < w->K / 32; c++) {
        __m256 x0 = _mm256_loadu_ps(x + c * 32), x1 = _mm256_loadu_ps(x + c * 32 + 8);
        __m256 x2 = _mm256_loadu_ps(x + c * 32 + 16), x3 = _mm256_loadu_ps(x + c * 32 + 24);
        float xs0 = xsum[2 * c], xs1 = xsum[2 * c + 1];
#define ROW(j, acc, oacc)                                                                                 \
        if (j < NR) {                                                                                     \
            __m256 q[4];                                                                                  \
            codes32(w, n0 + j, c, bits, q);                                                               \
            i64 g = (n0 + j) * w->row_groups + c * groups;                                                \
            _mm_prefetch((const char *)(w->codes + (n0 + j + PREFETCH_ROWS) * w->row_code_bytes + c * bits * 4), \
                         _MM_HINT_T0);                                                                    \
            __m256 lo = _mm256_fmadd_ps(q[1], x1, _mm256_mul_ps(q[0], x0));                               \
            __m256 hi = _mm256_fmadd_ps(q[3], x3, _mm256_mul_ps(q[2], x2));                               \
            if (groups == 1) {                                                                            \
                acc = _mm256_fmadd_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(param(w->scales, g, f16)), acc); \
                if (off) oacc += param(w->offsets, g, f16) * (xs0 + xs1);                                 \
            } else {                                                                                      \
                acc = _mm256_fmadd_ps(lo, _mm256_set1_ps(param(w->scales, g, f16)), acc);                 \
                acc = _mm256_fmadd_ps(hi, _mm256_set1_ps(param(w->scales, g + 1, f16)), acc);             \
                if (off) oacc += param(w->offsets, g, f16) * xs0 + param(w->offsets, g + 1, f16) * xs1;    \
            }                                                                                             \
        }
        ROW(0, a0, o0) ROW(1, a1, o1) ROW(2, a2, o2) ROW(3, a3, o3)
#undef ROW
    }
    y[n0] = hsum(a0) + o0;
    if (NR > 1) y[n0 + 1] = hsum(a1) + o1;
    if (NR > 2) y[n0 + 2] = hsum(a2) + o2;
    if (NR > 3) y[n0 + 3] = hsum(a3) + o3;
}

INLINE void direct_rows(const Weight *w, const float *x, const float *xsum, float *y, i64 ldy, i64 n0, i64 nr,
                        int mr, int bits, int groups, int f16) {
#define CASE(MR_, NR_) \
    if (mr == MR_ && nr == NR_) { tile_direct(w, x, w->K, xsum, y, ldy, n0, MR_, NR_, bits, groups, f16); return; }
#define ROW1(NR_) \
    if (mr == 1 && nr == NR_) { tile_row(w, x, xsum, y, n0, NR_, bits, groups, f16); return; }
    ROW1(4) ROW1(3) ROW1(2) ROW1(1)
    CASE(2, 2) CASE(2, 1) CASE(3, 2) CASE(3, 1) CASE(4, 2) CASE(4, 1)
#undef CASE
#undef ROW1
}

/* OpenMP outlines a parallel loop's body into a function of its own, where the format's constants would be
 * runtime values again: each tile's work goes through one of these, which dispatch to code specialised for
 * its format (branches per tile, not per weight). */
#define DISPATCH(CALL)                                                  \
    if (w->bits == 4 && w->groups == 1 && w->f16) CALL(4, 1, 1);        \
    else if (w->bits == 4 && w->groups == 1) CALL(4, 1, 0);             \
    else if (w->bits == 4 && w->f16) CALL(4, 2, 1);                     \
    else if (w->bits == 4) CALL(4, 2, 0);                               \
    else if (w->groups == 1 && w->f16) CALL(8, 1, 1);                   \
    else if (w->groups == 1) CALL(8, 1, 0);                             \
    else if (w->f16) CALL(8, 2, 1);                                     \
    else CALL(8, 2, 0);

static void direct_any(const Weight *w, const float *x, const float *xsum, float *y, i64 ldy, i64 n0, i64 nr, int M) {
#define CALL(B, G, F) direct_rows(w, x, xsum, y, ldy, n0, nr, M, B, G, F)
    DISPATCH(CALL)
#undef CALL
}

static void panel_any(const Weight *w, i64 n0, i64 nr, float *panel) {
#define CALL(B, G, F) decode_panel(w, n0, nr, panel, B, G, F)
    DISPATCH(CALL)
#undef CALL
}

/* y [M, N] = x [M, K] @ w.T */
void qmm(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
         int bits, int groups, int f16, float *y, int threads) {
    Weight wt = {codes, scales, offsets, K, K * bits / 8, K / 32 * groups, bits, groups, f16}, *w = &wt;
    if (M == 0) return;
    if (M < PANEL_MIN_ROWS) {
        float xsum[M * K / 16];
        for (i64 i = 0; i < M * K / 16; i++) {
            float t = 0.0f;
            for (int k = 0; k < 16; k++) t += x[i * 16 + k];
            xsum[i] = t;
        }
        int tile_n = M == 1 ? 4 : 2;
        i64 tiles = (N + tile_n - 1) / tile_n;
#pragma omp parallel for schedule(static) num_threads(threads)
        for (i64 t = 0; t < tiles; t++) {
            i64 n0 = t * tile_n, nr = N - n0 < tile_n ? N - n0 : tile_n;
            for (i64 m0 = 0; m0 < M; m0 += 4)
                direct_any(w, x + m0 * K, xsum + m0 * K / 16, y + m0 * N, N, n0, nr, M - m0 < 4 ? (int)(M - m0) : 4);
        }
        return;
    }
    i64 tiles = (N + PANEL_N - 1) / PANEL_N;
#pragma omp parallel num_threads(threads)
    {
        float *panel = aligned_alloc(64, (size_t)K * PANEL_N * sizeof(float));
#pragma omp for schedule(static)
        for (i64 t = 0; t < tiles; t++) {
            i64 n0 = t * PANEL_N, nr = N - n0 < PANEL_N ? N - n0 : PANEL_N;
            panel_any(w, n0, nr, panel);
            for (i64 m0 = 0; m0 < M; m0 += PANEL_M)
                tile_panel(panel, K, x + m0 * K, K, y + m0 * N, N, n0, nr, M - m0 < PANEL_M ? (int)(M - m0) : PANEL_M);
        }
        free(panel);
    }
}
