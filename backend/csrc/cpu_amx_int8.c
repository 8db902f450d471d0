/* The 8-bit kernel's many rows on AMX tiles (Intel's tile matrix units, Sapphire Rapids and later): a prompt chunk's
 * or a large batch's rows of x, quantized as cpu_int8_rows.c quantizes them (one digit, or three), against codes in
 * quad order (cpu_int8.c's layout), with the same integer sums and the same float steps as cpu_int8.c's tiles, so
 * the same bits: a row's result does not depend on whether its batch went through the tiles.
 *
 * An 8-bit weight tile of AMX holds 16 rows of 64 bytes, row i the 4 bytes of k's 4i .. 4i + 3 for each of 16
 * columns: a panel's quads as they are stored (8-bit codes, plus 128). 4-bit and 6-bit codes and a table's places
 * are spread into such bytes once a call (the panel's whole K, 16 bytes a k), then every block of 16 rows of x
 * reads them. TDPBSUD sums x's signed bytes times those unsigned ones in int32, a group's k's (16 or 32) at a time,
 * since every group has its own scale: per group, rows and column, the exact integer sum of cpu_int8.c's dot4's,
 * which starts from the same bias, becomes fp32 and is scaled in the same order:
 *
 *   f += float(sum) * (s * d)  [+ o * dsum]         (three digits: sum = (float(c2) / 256 + float(c1)) / 256 + float(c0))
 *
 * A block of 16 rows meets one panel at a time, its 16 accumulators in registers across the groups. One digit: two
 * groups' sums in flight (x tiles 0/1, weights 2/3, sums 4/5 by the group's parity), so the tiles' latency hides
 * behind the scaling; three: the digits' three sums at once (x 0-2, weights 3, sums 4-6). qmm's x is laid out again
 * first as the tiles read them (int8_amx_tile_rows: a tile's rows in one run, not 16 lines D K bytes apart; three
 * digits 25% faster, one the same), a MoE chunk's is read where it is. A block of fewer than 16 rows goes to
 * cpu_int8.c's tiles (the same bits).
 *
 * One thread, 2048 x 2048, 256 rows (a Xeon with AMX, 2026-12-07), billions of multiply-adds a second against
 * cpu_int8.c's VNNI tiles: one digit Q4_K 113 -> 158, IQ4_XS 123 -> 189, Q8_0 124 -> 182, Q6_K 86 -> 106; three
 * digits 45-47 -> 49-58, Q6_K level (34). Per group of 32 k's a tile's 8,192 products take one instruction, and the
 * scaling of its 256 sums (a store, then 7 or 8 vector operations a row) is most of the time: the groups' own scales
 * are what keeps it from the tiles' peak.
 */
#include "cpu_amx.h"
#include "cpu_exports.h"
#include "cpu_int8.h"

#if HAVE_AMX && defined(__AMX_INT8__)
/* panel p's codes spread into bytes for the tiles, [K / 4][64]: 8-bit codes are read where they are */
static void spread_codes(const Weight *w, i64 p, uint8_t *out) {
    const uint8_t *c = w->codes + p * w->panel_code_bytes;
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    const __m512i table = tabled(w->bits) ? _mm512_broadcast_i32x4(_mm_xor_si128(
        _mm_load_si128((const __m128i *)CODE_TABLES[w->bits - TABLE_BITS]), _mm_set1_epi8((char)0x80)))
                                          : _mm512_setzero_si512();
    if (w->bits == 6) { /* 192 bytes a 16 k's: two units of low nibbles, then the plane of the high 2 bits */
        for (i64 k = 0; k < w->K; k += 16, c += 192, out += 256) {
            const __m512i b0 = _mm512_loadu_si512(c), b1 = _mm512_loadu_si512(c + 64);
            const __m512i plane = _mm512_loadu_si512(c + 128);
            _mm512_storeu_si512(out, _mm512_or_si512(_mm512_and_si512(b0, low),
                                                     _mm512_and_si512(_mm512_slli_epi16(plane, 4), top)));
            _mm512_storeu_si512(out + 64, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b0, 4), low),
                                                          _mm512_and_si512(_mm512_slli_epi16(plane, 2), top)));
            _mm512_storeu_si512(out + 128, _mm512_or_si512(_mm512_and_si512(b1, low), _mm512_and_si512(plane, top)));
            _mm512_storeu_si512(out + 192, _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(b1, 4), low),
                                                           _mm512_and_si512(_mm512_srli_epi16(plane, 2), top)));
        }
        return;
    }
    for (i64 k = 0; k < w->K; k += 8, c += 64, out += 128) { /* 4-bit: k + i low, k + 4 + i high */
        __m512i lo = _mm512_and_si512(_mm512_loadu_si512(c), low);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(c), 4), low);
        if (tabled(w->bits)) lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
        _mm512_storeu_si512(out, lo);
        _mm512_storeu_si512(out + 64, hi);
    }
}

/* the tiles' shapes for groups of `group` k's and D digit rows: x tiles hold 16 rows of a group's bytes, weight tiles
 * group / 4 rows of 64 bytes, sums 16 rows of 16 int32. One digit: x 0 and 1, weights 2 and 3, sums 4 and 5 (two
 * groups in flight); three: x 0-2 (a digit each), weights 3, sums 4-6. */
static void configure(i64 group, int D) {
    TileConfig cfg = {.palette = 1};
    for (int t = 0; t < 7; t++) {
        const int is_x = D == 1 ? t < 2 : t < 3, is_w = D == 1 ? t == 2 || t == 3 : t == 3;
        cfg.rows[t] = is_w ? (uint8_t)(group / 4) : 16;
        cfg.bytes_per_row[t] = is_x ? (uint16_t)group : 64;
    }
    _tile_loadconfig(&cfg);
}

#define R16(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15)

/* a sum tile's row r as fp32, its code row's bias added first (an exact integer, as cpu_int8.c starts from it) */
INLINE __m512 sum_row(const int32_t *sums, int r, int32_t bias) {
    return _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_load_si512(sums + 16 * r), _mm512_set1_epi32(bias)));
}

/* Rows m0 .. m0 + 15 of x (D code rows each) by panel p: per group, the tiles' integer sums of each digit row, then
 * cpu_int8.c's float steps lane by lane, the accumulators (one a row) in registers across the groups:
 *
 *   f += float(sum) * (s * d)  [+ o * dsum]     (three digits: sum = (float(c2) / 256 + float(c1)) / 256 + float(c0))
 *
 * wb: the panel's codes as the weight tile reads them. */
INLINE void block(const Weight *w, const Rows *x, const int8_t *tiled, i64 p, i64 m0, const uint8_t *wb, float *y,
                  i64 ldy, i64 N, const int D) {
    int32_t sums[3][256] __attribute__((aligned(64)));
    const i64 G = w->group, groups = x->groups, K = x->K;
    /* x tiles: this block's rows in tiled ([group][digit][16][G]), or in x itself (code rows D K apart) */
    const i64 stride = tiled ? G : D * K;
    const int8_t *q = tiled ? tiled + m0 * D * K : x->q + D * m0 * K;
#define X_AT(g, j) (tiled ? q + ((g) * D + (j)) * 16 * G : q + (j) * K + (g) * G)
    const __m512 eighth = _mm512_set1_ps(0x1p-8f);
#define ACC(r) __m512 f##r = _mm512_setzero_ps();
    R16(ACC)
#undef ACC
    /* one digit: group g + 1's sums start (tiles 0/1, 2/3, 4/5 by g's parity) before g's are stored and scaled,
     * so the tiles' latency hides behind the scaling; three digits: their three sums in flight at once */
/* group g's one-digit sums started in sum tile S from x tile X and weight tile W (tile numbers are immediates) */
#define START(g, X, W, S) {                                 \
        _tile_loadd(W, wb + (g) * G * 16, 64);               \
        _tile_loadd(X, X_AT(g, 0), stride);                  \
        _tile_zero(S);                                       \
        _tile_dpbsud(S, X, W);                               \
    }
    if (D == 1) START(0, 0, 2, 4)
    for (i64 g = 0; g < w->panel_groups; g++) {
        if (D == 1) {
            const int more = g + 1 < w->panel_groups;
            if (g & 1) {
                if (more) START(g + 1, 0, 2, 4)
                _tile_stored(5, sums[0], 64);
            } else {
                if (more) START(g + 1, 1, 3, 5)
                _tile_stored(4, sums[0], 64);
            }
        } else {
            _tile_loadd(3, wb + g * G * 16, 64);
            _tile_loadd(0, X_AT(g, 0), stride);
            _tile_loadd(1, X_AT(g, 1), stride);
            _tile_loadd(2, X_AT(g, 2), stride);
            _tile_zero(4);
            _tile_zero(5);
            _tile_zero(6);
            _tile_dpbsud(4, 0, 3);
            _tile_dpbsud(5, 1, 3);
            _tile_dpbsud(6, 2, 3);
            _tile_stored(4, sums[0], 64);
            _tile_stored(5, sums[1], 64);
            _tile_stored(6, sums[2], 64);
        }
        const i64 at = (p * w->panel_groups + g) * PANEL;
        const __m512 s = vparams(w->scales, at, w->scale_kind), o = vparams(w->offsets, at, w->scale_kind);
        const int32_t *bias = x->bias + D * m0 * groups + g; /* code row cr's at bias[cr * groups] */
        const float *d = x->d + m0 * groups + g, *dsum = x->dsum + m0 * groups + g;
#define ROW(r) {                                                                                              \
            __m512 sum = sum_row(sums[0], r, bias[D * r * groups]);                                           \
            if (D == 3)                                                                                       \
                sum = _mm512_add_ps(_mm512_mul_ps(_mm512_add_ps(_mm512_mul_ps(                                \
                          sum_row(sums[2], r, bias[(3 * r + 2) * groups]), eighth),                           \
                          sum_row(sums[1], r, bias[(3 * r + 1) * groups])), eighth), sum);                    \
            f##r = _mm512_add_ps(f##r, _mm512_mul_ps(sum, _mm512_mul_ps(s, _mm512_set1_ps(d[r * groups])))); \
            if (w->offsets) f##r = _mm512_add_ps(f##r, _mm512_mul_ps(o, _mm512_set1_ps(dsum[r * groups])));  \
        }
        R16(ROW)
#undef ROW
    }
    const i64 col = p * PANEL, n = N - col < PANEL ? N - col : PANEL;
    float out[16] __attribute__((aligned(64)));
#define OUT(r) if (n == PANEL) _mm512_storeu_ps(y + (m0 + r) * ldy + col, f##r);                        \
               else if (n > 0) { _mm512_store_ps(out, f##r); memcpy(y + (m0 + r) * ldy + col, out, n * sizeof(float)); }
    R16(OUT)
#undef OUT
#undef START
#undef X_AT
}

/* block b (rows 16 b .. 16 b + 15) of x's code rows as the tiles read them, [group][digit][16][group bytes] at
 * out + 16 b D K: each tile of x one run of 16 rows (x's own rows are D K bytes apart: 16 lines a tile, far apart) */
void int8_amx_tile_rows(const Rows *x, i64 b, i64 group, int8_t *out) {
    const i64 D = x->digits, K = x->K;
    int8_t *o = out + 16 * b * D * K;
    for (i64 g = 0; g < K / group; g++)
        for (i64 j = 0; j < D; j++)
            for (i64 r = 0; r < 16; r++, o += group) memcpy(o, x->q + ((16 * b + r) * D + j) * K + g * group, (size_t)group);
}

#endif

/* rows [first, M) of x against panels p and p + 1 (the second only where it holds columns of y) by cpu_int8.c's
 * tiles, one panel at a time: the rows past the tiles' blocks, or all of them where the tiles do not run */
static void vector_rows(const Weight *w, const Rows *x, i64 p, i64 first, i64 M, float *y, i64 ldy, i64 N) {
    if (first >= M) return;
    const Rows rest = int8_rows_from(x, first);
    for (i64 c = 0; c < ((p + 1) * PANEL < N ? 2 : 1); c++)
        int8_panel_rows(w, &rest, p + c, M - first, 1, y + first * ldy, ldy, N, w->codes + (p + 2) * w->panel_code_bytes);
}

#if HAVE_AMX && defined(__AMX_INT8__)
int int8_amx_usable(void) { return amx_ready(); }

/* Every row of x (M of them) against panels p and p + 1 on the tiles, on the calling thread; the rows past the last
 * whole block of 16, and every row where the tiles cannot take the codes or there is no memory to spread them, by
 * cpu_int8.c's tiles (the same bits either way). */
void int8_amx_rows(const Weight *w, const Rows *x, const int8_t *tiled, i64 p, i64 M, float *y, i64 ldy, i64 N) {
    static __thread void *spread_buf;
    static __thread size_t spread_size;
    const int D = (int)x->digits, spread = code_bits(w->bits) != 8;
    const int panels = (p + 1) * PANEL < N ? 2 : 1; /* the second panel only where it holds columns of y */
    /* codes the spread knows (4 and 6-bit, a table's, bytes) in groups a tile holds */
    const int known = (code_bits(w->bits) == 4 || w->bits == 6 || code_bits(w->bits) == 8) &&
                      (w->group == 16 || w->group == 32);
    uint8_t *room = known && spread ? grown(&spread_buf, &spread_size, (size_t)(2 * w->K * 16)) : NULL;
    if (!known || (spread && !room)) {
        vector_rows(w, x, p, 0, M, y, ldy, N);
        return;
    }
    const uint8_t *wb[2];
    for (int c = 0; c < panels; c++) {
        if (spread) spread_codes(w, p + c, room + c * w->K * 16);
        wb[c] = spread ? room + c * w->K * 16 : w->codes + (p + c) * w->panel_code_bytes;
    }
    const i64 blocks = M / 16;
    configure(w->group, D);
    for (int c = 0; c < panels; c++)
        for (i64 b = 0; b < blocks; b++) {
            if (D == 1) block(w, x, tiled, p + c, 16 * b, wb[c], y, ldy, N, 1);
            else block(w, x, tiled, p + c, 16 * b, wb[c], y, ldy, N, 3);
        }
    _tile_release();
    vector_rows(w, x, p, 16 * blocks, M, y, ldy, N);
}
#else
int int8_amx_usable(void) { return 0; }
void int8_amx_tile_rows(const Rows *x, i64 b, i64 group, int8_t *out) { (void)x, (void)b, (void)group, (void)out; }
void int8_amx_rows(const Weight *w, const Rows *x, const int8_t *tiled, i64 p, i64 M, float *y, i64 ldy, i64 N) {
    (void)tiled;
    vector_rows(w, x, p, 0, M, y, ldy, N);
}
#endif
