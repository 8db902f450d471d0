/* The fp32 kernel's 4-bit panels with AVX-512 (cpu_kernel.c's layout: per panel and k, byte j = q[row j] |
 * q[row j + 8] << 4; q the code, or for a table's codes its value there, table_of): a weight is q * scale + offset,
 * so a group's share of an output is
 *
 *     scale * (sum over the group's even k of q * x  +  sum over its odd k of q * x)  +  offset * sum(x)
 *
 * each sum in k's order in fp32, the groups in order; sum(x) likewise an even and an odd sum, added. One fma a
 * weight and row where decoding each weight first took two, and the codes become floats by a table lookup
 * (vpermps reads a lane's low 4 bits) instead of a widening and a conversion: 1.8x cpu_kernel.c's general tile on
 * a weight in L2 (measured, one row). Each output's arithmetic is the same whatever the rows or columns computed
 * with it, in both ways the vectors are laid out here:
 *
 *   halves (from the codes): a k pair's 16 bytes widened to 16 lanes are rows 0-7 at k then at k + 1 in their
 *   low nibbles, rows 8-15 in their high ones: two lookups give [k | k+1] x rows 0-7 and x rows 8-15, met by
 *   [x_k x 8 | x_k+1 x 8];
 *   pairs (decoded once for many rows of x): rows 0-7 then 8-15 as (k, k+1) lane pairs, met by (x_k, x_k+1)
 *   broadcast as one 64-bit value, read straight from x's pair-transposed tiles (cpu_kernel.h).
 *
 * Accumulators: two a row and column vector (even and odd k of rows 0-7, and of rows 8-15), at most 16.
 */
#include "cpu_exports.h"
#include "cpu_kernel.h"

#if LANES == 16
#define R8(F, c) F(0, c) F(1, c) F(2, c) F(3, c) F(4, c) F(5, c) F(6, c) F(7, c)
#define RC(F) R8(F, 0) R8(F, 1) R8(F, 2) R8(F, 3)
#define C4(F) F(0) F(1) F(2) F(3)
/* column vectors a tile of MR <= 8 rows can hold: 2 * MR * NC accumulators */
#define NIBBLE_COLUMNS(MR) (MR <= 2 ? 4 : MR <= 4 ? 2 : 1)

/* what a code is, as fp32: itself (bits 4), or its value in a table (bits TABLE_BITS + t), for the lookup the
 * codes take anyway: the codebook formats cost what Q4_0 does */
INLINE V table_of(int bits) {
    if (!tabled(bits)) return _mm512_cvtepi32_ps(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)CODE_TABLES[bits - TABLE_BITS])));
}

/* a panel's codes at k and k + 1 (its 16 bytes) as fp32: halves [k | k+1] of rows 0-7 (a) and of rows 8-15 (b) */
INLINE void lookup_halves(const uint8_t *c, V table, V *a, V *b) {
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    *a = _mm512_permutexvar_ps(d, table);
    *b = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table);
}

/* the same in pairs: (k, k+1) of row 0, of row 1, .. of rows 0-7 (a) and of rows 8-15 (b) */
INLINE void lookup_pairs(const uint8_t *c, V table, V *a, V *b) {
    const __m128i pairs = _mm_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m512i d = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)c), pairs));
    *a = _mm512_permutexvar_ps(d, table);
    *b = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table);
}

/* y[m, ..] for MR rows and NC panels from p; x in pairs, row r's (x_k, x_k+1) at xt[k * xs + 2r] (xs: ROWS_X, or 1
 * for one row, x itself). decoded: the panels' codes as fp32 in pairs order, [K / 2][NC][32], or NULL. */
INLINE void tile(const Weight *w, i64 p, const float *xt, i64 xs, const int MR, const int NC, float *y, i64 ldy,
                 i64 N, const float *decoded, const int HALVES) {
#define ACC(r, c) V e_##r##_##c = vzero(), f_##r##_##c = vzero();
    RC(ACC)
#undef ACC
    V total[8][4];
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NC; c++) total[r][c] = vzero();
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    const __m512i swap = _mm512_setr_epi32(1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    const i64 pair = 2 * PANEL * 4 / 8; /* bytes of a panel's k pair */
    const V table = table_of(w->bits);
    const uint8_t *next = w->codes + (p + NC) * w->panel_code_bytes;
#define CODES(c) const uint8_t *codes##c = w->codes + (p + c) * w->panel_code_bytes;
    C4(CODES)
#undef CODES
    for (i64 g = 0; g < w->K / w->group; g++) {
        if (!decoded) /* the next tile's panels, this group (past the last panel a prefetch is harmless) */
            for (i64 c = 0; c < NC; c++)
                for (i64 b = 0; b < w->group * pair / 2; b += 64)
                    PREFETCH_L2(next + c * w->panel_code_bytes + g * w->group * pair / 2 + b);
        V sums = vzero(); /* sum(x): row r's even k in lane 2r, odd in 2r + 1 */
        for (i64 k = g * w->group; k < (g + 1) * w->group; k += 2) {
            const float *xp = xt + k * xs;
            sums = _mm512_add_ps(sums, xs == 1 ? _mm512_zextps128_ps512(_mm_castpd_ps(_mm_load_sd((const double *)xp)))
                                              : _mm512_loadu_ps(xp));
            V a0 = vzero(), b0 = vzero(), a1 = vzero(), b1 = vzero(), a2 = vzero(), b2 = vzero();
            V a3 = vzero(), b3 = vzero();
            if (HALVES) { /* one row (xs 1), from the codes */
#define LOOKUP(c) if (NC > c) lookup_halves(codes##c + k * pair / 2, table, &a##c, &b##c);
                C4(LOOKUP)
#undef LOOKUP
                const V x = _mm512_shuffle_f32x4(vset1(xp[0]), vset1(xp[1]), 0x44);
#define FMA(c) if (NC > c) { e_0_##c = vfma(a##c, x, e_0_##c); f_0_##c = vfma(b##c, x, f_0_##c); }
                C4(FMA)
#undef FMA
            } else {
                if (decoded) {
#define LOAD(c) if (NC > c) { a##c = vload(decoded + ((k / 2) * NC + c) * 32); b##c = vload(decoded + ((k / 2) * NC + c) * 32 + 16); }
                    C4(LOAD)
#undef LOAD
                } else {
#define LOOKUP(c) if (NC > c) lookup_pairs(codes##c + k * pair / 2, table, &a##c, &b##c);
                    C4(LOOKUP)
#undef LOOKUP
                }
#define FMA(r, c) if (MR > r && NC > c) {                                                         \
                      double pair_;                                                                \
                      memcpy(&pair_, xp + 2 * r, sizeof pair_);                                    \
                      const V x = _mm512_castpd_ps(_mm512_set1_pd(pair_));                         \
                      e_##r##_##c = vfma(a##c, x, e_##r##_##c);                                    \
                      f_##r##_##c = vfma(b##c, x, f_##r##_##c);                                    \
                  }
                RC(FMA)
#undef FMA
            }
        }
        float xsum[16] __attribute__((aligned(64)));
        vstore(xsum, _mm512_add_ps(sums, _mm512_permutexvar_ps(swap, sums)));
#define PARAMS(c) const i64 at##c = ((p + c) * w->panel_groups + g) * PANEL;                                \
                  const V s##c = NC > c ? vparams(w->scales, at##c, w->scale_kind) : vzero();              \
                  const V o##c = NC > c && w->offsets ? vparams(w->offsets, at##c, w->scale_kind) : vzero();
        C4(PARAMS)
#undef PARAMS
        /* even + odd per row of the panel: pairs' lanes, or halves' 256-bit halves */
#define FOLD(r, c) if (MR > r && NC > c) {                                                                      \
                       const V sum = !HALVES                                                                    \
                           ? _mm512_add_ps(_mm512_permutex2var_ps(e_##r##_##c, even, f_##r##_##c),              \
                                           _mm512_permutex2var_ps(e_##r##_##c, odd, f_##r##_##c))               \
                           : _mm512_add_ps(_mm512_shuffle_f32x4(e_##r##_##c, f_##r##_##c, 0x44),                \
                                           _mm512_shuffle_f32x4(e_##r##_##c, f_##r##_##c, 0xEE));               \
                       total[r][c] = vfma(s##c, sum, total[r][c]);                                              \
                       if (w->offsets) total[r][c] = vfma(o##c, vset1(xsum[2 * r]), total[r][c]);               \
                       e_##r##_##c = f_##r##_##c = vzero();                                                     \
                   }
        RC(FOLD)
#undef FOLD
    }
    float out[LANES] __attribute__((aligned(64)));
    for (int r = 0; r < MR; r++)
        for (int c = 0; c < NC; c++) {
            const i64 col = (p + c) * PANEL, n = N - col < LANES ? N - col : LANES;
            if (n == LANES) vstoreu(y + r * ldy + col, total[r][c]);
            else if (n > 0) { vstore(out, total[r][c]); memcpy(y + r * ldy + col, out, n * sizeof(float)); }
        }
}

/* M <= ROWS_X rows by `panels` panels from p (cpu_kernel.c's few_rows): rows 8 at a time, each by as many
 * panels as its accumulators allow. */
void nibble_rows(const Weight *w, i64 p, i64 panels, const float *xt, i64 xs, i64 M, float *y, i64 N, i64 ldy) {
    if (xs == 1) { /* one row, x itself */
        for (i64 c0 = 0; c0 < panels;) {
            const int one = panels - c0 < 4;
            if (one) tile(w, p + c0, xt, 1, 1, 1, y, ldy, N, NULL, 1);
            else tile(w, p + c0, xt, 1, 1, 4, y, ldy, N, NULL, 1);
            c0 += one ? 1 : 4;
        }
        return;
    }
    for (i64 r0 = 0; r0 < M; r0 += 8) {
        const i64 mr = M - r0 < 8 ? M - r0 : 8;
        /* as many panels at a time as fit the accumulators, then one at a time */
        for (i64 c0 = 0; c0 < panels; c0 += panels - c0 < NIBBLE_COLUMNS(mr) ? 1 : NIBBLE_COLUMNS(mr)) {
            const int one = panels - c0 < NIBBLE_COLUMNS(mr);
            switch (mr) {
#define CASE(MR) case MR:                                                                               \
                if (one) tile(w, p + c0, xt + 2 * r0, xs, MR, 1, y + r0 * ldy, ldy, N, NULL, 0);        \
                else tile(w, p + c0, xt + 2 * r0, xs, MR, NIBBLE_COLUMNS(MR), y + r0 * ldy, ldy, N, NULL, 0); \
                break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
            }
        }
    }
}

/* Panel p's codes as fp32 in pairs order, [K / 2][32]: decoded once for many tiles of rows (the same values the
 * lookup gives, so the same bits either way). */
static void decode_pairs(const Weight *w, i64 p, float *out) {
    const uint8_t *codes = w->codes + p * w->panel_code_bytes;
    const V table = table_of(w->bits);
    for (i64 k = 0; k < w->K; k += 2) {
        if (k % 8 == 0) PREFETCH_L2(codes + w->panel_code_bytes + k * 8); /* the next panel, a line per 8 k's */
        V a, b;
        lookup_pairs(codes + k * 8, table, &a, &b);
        vstore(out + k * 16, a);
        vstore(out + k * 16 + 16, b);
    }
}

/* Rows of x past ROWS_X (cpu_kernel.c's many_rows): each of `panels` panels from p decoded once into `decoded`
 * ([K][16] floats), then met by tiles of 8 rows; xt: x's pair-transposed tiles of ROWS_X rows. */
void nibble_many_rows(const Weight *w, i64 p, i64 panels, const float *xt, i64 M, float *y, i64 N, i64 ldy,
                      float *decoded) {
    for (i64 j = 0; j < panels; j++) {
        decode_pairs(w, p + j, decoded);
        for (i64 m0 = 0; m0 < M; m0 += 8) {
            const float *xm = xt + (m0 / ROWS_X) * w->K * ROWS_X + 2 * (m0 % ROWS_X);
            switch (M - m0 < 8 ? M - m0 : 8) {
#define CASE(MR) case MR: tile(w, p + j, xm, ROWS_X, MR, 1, y + m0 * ldy, ldy, N, decoded, 0); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
            }
        }
    }
}
#endif
