/* Quantized matmul against 8-bit activations, for an engine with activations="int8" (llama.cpp's arithmetic on the
 * CPU, where it is always on). Each row of x is quantized per group of the weights' `group` k's (16 or 32) with one
 * fp32 scale, d = max |x| / 127 and xq = round(x * 127 / max |x|) (to nearest even), and y = (xq d) @ w.T: per group
 *
 *   y += float(sum q xq) * (s * d) + o * (d * float(sum xq))      (the sums in int32, exact)
 *
 * with s and o the weights' scale and offset (cpu_kernel.c's layout and values). The integer sums are exact and a
 * row's float steps are fixed, so its bits do not depend on the rows beside it: a sequence decodes the same alone,
 * in a batch, or as a verification row at any draft length. Every build (AVX-512 or portable) does the same float
 * operations in the same order, so gives the same bits.
 *
 * Codes in quad order (cpu_layout.quad_order): per panel of 16 weight rows, 64 bytes for each 4 k's (8-bit: byte
 * 4r + i is row r's q at k + i, plus 128; "bits 7" where no q is -128, cpu_layout.quad_bits) or each 8 k's (4-bit:
 * byte 4r + i holds row r's q at k + i in its low nibble and at k + 4 + i in its high one), or 192 bytes for each
 * 16 k's (6-bit, where every q fits -32 .. 31: Q6_K and the Q5's, as u = q + 32: two 4-bit units of the low bits,
 * then a plane of the high 2, composed into bytes in registers). One AVX-512 VNNI
 * instruction (vpdpbusd) then multiplies 16 rows' 4 codes by 4 of xq and adds them into the 16 rows' sums: 64
 * multiply-adds where an fp32 fma does 16, at the same rate (measured on Zen 4); AVX2 has vpmaddubsw and vpmaddwd,
 * two instructions for 32 (see dot4). vpdpbusd's codes are unsigned: 8-bit codes are stored plus 128 (6-bit plus 32),
 * and a group's sum starts at -128 (-32) sum xq to take it back out (AVX2 multiplies bits 7's q itself, from 0).
 */
#include <omp.h>

#include "cpu_exports.h"
#include "cpu_kernel.h"

/* Integer and float vectors of IL lanes: a panel's 16 rows in one AVX-512 register, or in two halves of 8 (AVX2 and
 * the portable build: GCC splits a 64-byte vector into 16-byte pieces through the stack there, 2x slower, measured) */
#if defined(__AVX512F__)
#define IL 16
#else
#define IL 8
#endif
#define HV (PANEL / IL) /* vectors per panel */
typedef int32_t VI __attribute__((vector_size(IL * 4)));
typedef float VF __attribute__((vector_size(IL * 4)));

/* What a dot4 is handed: 4 or 6-bit codes (every byte of u below 64), 8-bit codes (u = q + 128), or 8-bit codes
 * none of which is -128 (bits 7 in quad order: u = q + 128 >= 1) */
enum { BYTES, NIBBLES, SIGNED };
/* Whether this build sums q * x for 8-bit codes without -128 (AVX2), so their groups start at 0, not -128 sum xq */
#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512F__))
#define SEVEN_SIGNED 1
#else
#define SEVEN_SIGNED 0
#endif

/* acc + the dot products of u's 4 unsigned bytes and x's 4 signed ones per 32-bit lane (SIGNED where SEVEN_SIGNED:
 * of u - 128) */
INLINE VI dot4(VI acc, VI u, int32_t x, const int kind) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    (void)kind;
    return (VI)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, _mm512_set1_epi32(x));
#elif defined(__AVX2__)
    /* vpmaddubsw sums two products of unsigned and signed bytes into an int16, which saturates past 32767: 4 and
     * 6-bit codes times |x| <= 127 stay under it (2 * 63 * 127); 8-bit codes go in as their two nibbles (u = 16 hi +
     * lo), the high one's sums scaled by 16 in int32 by vpmaddwd; and codes without -128 as |x| times q * sign(x)
     * (2 * 127 * 127). Exact integers every way, the same as vpdpbusd's and the portable loop's. */
    const __m256i xb = _mm256_set1_epi32(x), ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    __m256i half[IL / 8], sum[IL / 8];
    memcpy(half, &u, sizeof half);
    memcpy(sum, &acc, sizeof sum);
    for (int i = 0; i < IL / 8; i++) {
        if (kind == NIBBLES) {
            sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(half[i], xb), ones));
        } else if (kind == SIGNED) {
            __m256i q = _mm256_xor_si256(half[i], _mm256_set1_epi8((char)0x80));
            __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(q, xb));
            sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(p, ones));
        } else {
            __m256i lo = _mm256_and_si256(half[i], low), hi = _mm256_and_si256(_mm256_srli_epi16(half[i], 4), low);
            sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xb), ones));
            sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xb), _mm256_set1_epi16(16)));
        }
    }
    memcpy(&acc, sum, sizeof acc);
    return acc;
#else
    (void)kind;
    for (int i = 0; i < 4; i++) acc += ((u >> (8 * i)) & 0xFF) * (int32_t)(int8_t)(x >> (8 * i));
    return acc;
#endif
}

/* a group of x's row: its codes, their sum, and max |x|, or NaN where x holds a NaN or an infinity (the same values
 * either way: a max, products and integer sums do not depend on the order they are taken in) */
/* Groups whose max |x| is below 2^-64 are scaled up by 2^64 before 127 / max |x| (which would overflow below
 * 127 / FLT_MAX): exact, and the same codes the unscaled arithmetic gives wherever it does not overflow. */
#define UP(amax) ((amax) < 0x1p-64f ? 0x1p64f : 1.0f)

INLINE float group_codes(const float *xg, i64 group, int8_t *q, int32_t *total) {
    float amax = 0.0f;
    int32_t sum = 0, bad = 0;
#if defined(__AVX512F__)
    __m512 m = _mm512_setzero_ps();
    for (i64 k = 0; k < group; k += 16) {
        __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xg + k));
        bad |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.4028235e38f), _CMP_NLE_UQ); /* NaN or infinite */
        m = _mm512_max_ps(m, a);
    }
    amax = _mm512_reduce_max_ps(m);
    const float up = UP(amax), inv = amax > 0.0f && !bad ? 127.0f / (amax * up) : 0.0f;
    __m512i t = _mm512_setzero_si512();
    for (i64 k = 0; k < group; k += 16) {
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xg + k), _mm512_set1_ps(up)), _mm512_set1_ps(inv));
        __m512i c = _mm512_cvtps_epi32(v); /* to nearest even; NaN -> INT_MIN: zeroed */
        c = _mm512_mask_mov_epi32(_mm512_setzero_si512(), _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), c);
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(c));
        t = _mm512_add_epi32(t, c);
    }
    sum = _mm512_reduce_add_epi32(t);
#else
    for (i64 k = 0; k < group; k++) {
        bad |= !(fabsf(xg[k]) <= 3.4028235e38f);
        amax = fabsf(xg[k]) > amax ? fabsf(xg[k]) : amax;
    }
    const float up = UP(amax), inv = amax > 0.0f && !bad ? 127.0f / (amax * up) : 0.0f;
    for (i64 k = 0; k < group; k++) {
        float v = xg[k] * up * inv;
        int c = v == v ? (int)nearbyintf(v) : 0;
        q[k] = (int8_t)c;
        sum += c;
    }
#endif
    *total = sum;
    return bad ? __builtin_nanf("") : amax;
}

void int8_quantize_row(const float *x, i64 m, i64 group, int bits, const Rows *r) {
    for (i64 g = 0; g < r->groups; g++) {
        const float *xg = x + m * r->K + g * group;
        int32_t total;
        const float amax = group_codes(xg, group, r->q + m * r->K + g * group, &total);
        const i64 at = m * r->groups + g;
        r->d[at] = amax / 127.0f; /* NaN where x holds a NaN or an infinity: the row's y, as in the fp32 kernel */
        r->dsum[at] = r->d[at] * (float)total;
        r->bias[at] = bits == 8 || (bits == 7 && !SEVEN_SIGNED) ? -128 * total : bits == 6 ? -32 * total : 0;
    }
}

#define R8(F, c) F(0, c) F(1, c) F(2, c) F(3, c) F(4, c) F(5, c) F(6, c) F(7, c)
#define RC(F) R8(F, 0) R8(F, 1) R8(F, 2) R8(F, 3)
#define C4(F) F(0) F(1) F(2) F(3)
/* rows of x a tile meets: its int32 and fp32 accumulators fill the registers (2 per row and vector) */
#if IL == 16
#define MAX_ROWS 8
#else
#define MAX_ROWS 4
#endif

/* rows [m0, m0 + MR) of x against NC column vectors from panel p on (vector c: panel p + c / HV, rows (c % HV) * IL
 * ..): y's columns p * 16 ... Accumulators named, one int32 and one fp32 per row and vector (those past MR and NC
 * compiled out). */
INLINE void tile(const Weight *w, const Rows *x, i64 p, i64 m0, const int MR, const int NC, const int bits,
                 float *y, i64 ldy, i64 N, const uint8_t *ahead) {
    /* k's and bytes a step of the loop below reads: 8 in 64 bytes (4-bit), 16 in 192 (6-bit), 4 in 64 (8-bit) */
    const i64 unit = bits == 4 ? 8 : bits == 6 ? 16 : 4, step = bits == 6 ? 192 : 64;
    const i64 group_bytes = w->group / unit * step, panels = (NC + HV - 1) / HV;
    const int kind = bits == 4 || bits == 6 ? NIBBLES : bits == 7 && SEVEN_SIGNED ? SIGNED : BYTES;
#define ACC(r, c) VF f_##r##_##c = {0}; VI a_##r##_##c;
    RC(ACC)
#undef ACC
    for (i64 g = 0; g < w->panel_groups; g++) {
#define START(r, c) if (MR > r && NC > c) a_##r##_##c = (VI){0} + x->bias[(m0 + r) * x->groups + g];
        RC(START)
#undef START
#define CODES(c) const uint8_t *codes##c = w->codes + (p + c / HV) * w->panel_code_bytes + g * group_bytes \
                                           + (c % HV) * IL * 4;
        C4(CODES)
#undef CODES
        /* the panels the thread reads next, taken as laid out like this tile's (another expert's may differ in
         * bits or width: then the fetch is approximate, never wrong; past the last panel it is harmless) */
        for (i64 c = 0; c < panels; c++)
            for (i64 b = 0; b < group_bytes; b += 64)
                PREFETCH_L2(ahead + c * w->panel_code_bytes + g * group_bytes + b);
        const int8_t *xq = x->q + m0 * x->K + g * w->group;
        for (i64 u = 0; u < group_bytes; u += step, xq += unit) {
            int32_t x0[MAX_ROWS], x1[MAX_ROWS], x2[MAX_ROWS], x3[MAX_ROWS]; /* xq at k + 0, 4, 8, 12 */
            for (int r = 0; r < MR; r++) {
                memcpy(x0 + r, xq + r * x->K, 4);
                if (bits == 4 || bits == 6) memcpy(x1 + r, xq + r * x->K + 4, 4);
                if (bits == 6) { memcpy(x2 + r, xq + r * x->K + 8, 4); memcpy(x3 + r, xq + r * x->K + 12, 4); }
            }
#define DOT4(r, c) if (MR > r) { a_##r##_##c = dot4(a_##r##_##c, u0, x0[r], kind);                       \
                                 if (bits == 4 || bits == 6) a_##r##_##c = dot4(a_##r##_##c, u1, x1[r], kind); \
                                 if (bits == 6) { a_##r##_##c = dot4(a_##r##_##c, u2, x2[r], kind);          \
                                                  a_##r##_##c = dot4(a_##r##_##c, u3, x3[r], kind); } }
            /* 6-bit: each byte's low 4 bits from the two nibble units, its high 2 from the plane after them */
#define VECTOR_DOTS(c) if (NC > c) {                                                          \
                VI u0, u1, u2 = {0}, u3 = {0};                                                \
                memcpy(&u0, codes##c + u, sizeof u0);                                         \
                if (bits == 4 || bits == 6) { u1 = (u0 >> 4) & 0x0F0F0F0F; u0 &= 0x0F0F0F0F; } \
                if (bits == 6) {                                                              \
                    VI plane;                                                                 \
                    memcpy(&u2, codes##c + u + 64, sizeof u2);                                \
                    memcpy(&plane, codes##c + u + 128, sizeof plane);                         \
                    u3 = ((u2 >> 4) & 0x0F0F0F0F) | ((plane >> 2) & 0x30303030);              \
                    u2 = (u2 & 0x0F0F0F0F) | (plane & 0x30303030);                            \
                    u1 |= (plane << 2) & 0x30303030;                                          \
                    u0 |= (plane << 4) & 0x30303030;                                          \
                }                                                                             \
                R8(DOT4, c)                                                                   \
            }
            C4(VECTOR_DOTS)
#undef VECTOR_DOTS
#undef DOT4
        }
#define SCALE(r, c) if (MR > r) {                                                                  \
            const i64 at = (m0 + r) * x->groups + g;                                               \
            f_##r##_##c = f_##r##_##c + __builtin_convertvector(a_##r##_##c, VF) * (s * x->d[at]);  \
            if (w->offsets) f_##r##_##c = f_##r##_##c + o * x->dsum[at];                            \
        }
#define VECTOR_SCALE(c) if (NC > c) {                                                         \
            const i64 at = ((p + c / HV) * w->panel_groups + g) * PANEL + (c % HV) * IL;      \
            VF s = (VF)vparams(w->scales, at, w->scale_kind), o = (VF)vparams(w->offsets, at, w->scale_kind); \
            R8(SCALE, c)                                                                      \
        }
        C4(VECTOR_SCALE)
#undef VECTOR_SCALE
#undef SCALE
    }
#define OUT(r, c) if (MR > r && NC > c) {                                                  \
        const i64 col = (p + c / HV) * PANEL + (c % HV) * IL, n = N - col < IL ? N - col : IL; \
        if (n > 0) memcpy(y + (m0 + r) * ldy + col, &f_##r##_##c, n * sizeof(float));       \
    }
    RC(OUT)
#undef OUT
}

/* panels per tile: several for few rows (each sum a chain of dependent products: a decode step's one row needs
 * several in flight), fewer as rows fill the registers; at most 4 vectors */
#define PANELS_FOR(MR) ((MR) <= 2 ? 4 / HV : (MR) <= 4 ? 2 / HV : 1)

/* every row of x in tiles of up to MAX_ROWS against panels [p, p + PP), the panels' codes read from L1 after the
 * first tile */
void int8_panel_rows(const Weight *w, const Rows *x, i64 p, i64 M, const int PP, float *y, i64 ldy, i64 N,
                     const uint8_t *ahead) {
    /* rows split evenly between the tiles (9 as 5 and 4, not 8 and 1: a tile of one row and one panel would
     * wait on its one chain of dependent products) */
    const i64 count = (M + MAX_ROWS - 1) / MAX_ROWS;
    for (i64 t = 0, m0 = 0; t < count; t++) {
        const int MR = (int)((M - m0 + count - t - 1) / (count - t));
        switch (MR * 16 + PP / 2 + (w->bits == 4 ? 4 : w->bits == 7 ? 8 : w->bits == 6 ? 12 : 0)) {
#define CASE(MR_, PP_) case MR_ * 16 + PP_ / 2 + 4: tile(w, x, p, m0, MR_, PP_ * HV, 4, y, ldy, N, ahead); break;  \
                       case MR_ * 16 + PP_ / 2 + 8: tile(w, x, p, m0, MR_, PP_ * HV, 7, y, ldy, N, ahead); break;  \
                       case MR_ * 16 + PP_ / 2 + 12: tile(w, x, p, m0, MR_, PP_ * HV, 6, y, ldy, N, ahead); break; \
                       case MR_ * 16 + PP_ / 2: tile(w, x, p, m0, MR_, PP_ * HV, 8, y, ldy, N, ahead); break;
#if IL == 16
        CASE(1, 4) CASE(2, 4) CASE(3, 2) CASE(4, 2)
        CASE(1, 1) CASE(2, 1) CASE(3, 1) CASE(4, 1) CASE(5, 1) CASE(6, 1) CASE(7, 1) CASE(8, 1)
#else
        CASE(1, 2) CASE(2, 2) CASE(3, 1) CASE(4, 1) CASE(1, 1) CASE(2, 1)
#endif
#undef CASE
        default: /* no such tile (PANELS_FOR and MAX_ROWS make none): say so in y rather than leave it unwritten */
            for (i64 r = m0; r < m0 + MR; r++)
                for (i64 c = p * PANEL; c < (p + PP) * PANEL && c < N; c++) y[r * ldy + c] = __builtin_nanf("");
        }
        m0 += MR;
    }
}

int int8_panels(i64 M) { return M <= MAX_ROWS ? PANELS_FOR(M) : 1; }

Rows int8_rows_from(const Rows *r, i64 first) {
    return (Rows){r->q + first * r->K, r->d + first * r->groups, r->dsum + first * r->groups,
                  r->bias + first * r->groups, r->K, r->groups};
}

/* room for M rows of K in the calling thread's scratch (kept between calls); 0 where memory ran out */
static int room(Rows *r, i64 M, i64 K, i64 groups) {
    static __thread void *q_buf, *f_buf;
    static __thread size_t q_size, f_size;
    float *f = grown(&f_buf, &f_size, (size_t)(M * groups) * 3 * sizeof(float));
    *r = (Rows){grown(&q_buf, &q_size, (size_t)(M * K)), f, f + M * groups, (int32_t *)(f + 2 * M * groups), K,
                groups};
    return M == 0 || (r->q && f);
}

/* Up to this many rows (a decode step, a short verification) each thread quantizes x for itself: a few hundred
 * values a row, cheaper than the barrier a shared copy needs before any thread may read it. */
#define OWN_ROWS 4

/* y [M, N] = x [M, K] @ w.T, rows ldy apart, from codes in quad order (bits 4, 6, 7 or 8); 0 where memory
 * ran out */
int qmm_int8(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
             int bits, i64 group, int scale_kind, float *y, i64 ldy, int threads) {
    Rows shared;
    if (M > OWN_ROWS && !room(&shared, M, K, K / group)) return 0;
    Weight w = weight_of(codes, scales, offsets, K, group, bits, scale_kind);
    const int PP = int8_panels(M);
    const i64 tiles = ((N + PANEL - 1) / PANEL + PP - 1) / PP;
    int ran = 1;
#pragma omp parallel num_threads(threads)
    {
        Rows own, *rows = &shared;
        if (M <= OWN_ROWS) {
            rows = room(&own, M, K, K / group) ? &own : NULL;
            for (i64 m = 0; rows && m < M; m++) int8_quantize_row(x, m, group, bits, rows);
        } else {
#pragma omp for schedule(static)
            for (i64 m = 0; m < M; m++) int8_quantize_row(x, m, group, bits, rows);
        }
        if (!rows) {
#pragma omp atomic write
            ran = 0;
        }
#pragma omp for schedule(static)
        for (i64 t = 0; t < tiles; t++)
            if (rows) int8_panel_rows(&w, rows, t * PP, M, PP, y, ldy, N, codes + (t + 1) * PP * w.panel_code_bytes);
    }
    return ran;
}
