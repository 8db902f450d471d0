/* Quantized matmul on the CPU: y[m, n] = sum_k x[m, k] * w[n, k], each weight decoded inside the loop from the
 * integer code and the scale (and offset) of a GGUF block format, repacked at load by cpu_layout.py:
 *
 *   weight rows in panels of 16 (padded with zero rows to a multiple of 4 panels); for each panel and each k, the
 *   codes of its 16 rows: bits 4: 8 bytes, byte j = q[row j] | q[row j + 8] << 4 (q unsigned, 0..15); bits 8: 16
 *   signed bytes; a table's (TABLE_BITS + t): as bits 4, q the value at that place of table t (CODE_TABLES)
 *   scales, offsets: per panel and group of `group` k's (16 or 32), the 16 rows' values, fp32, fp16 or a K-quant's
 *   parts (scale_kind, cpu_kernel.h);
 *   offsets may be NULL (zero)
 *
 * w = fma(q, scale, offset) is gguf-py's dequantized weight bit for bit (every format's q * scale is exact in
 * fp32), and each output is the sum over k of x * w in k's order, in fp32: the arithmetic of one row does not
 * depend on how many rows are computed with it (a sequence decodes the same alone or in a batch, as a draft's
 * verification row or as a decode row). With AVX-512, 4-bit panels go to cpu_nibbles.c: the same weights, each
 * group's codes summed against x and scaled once (one fma a weight and row), every row again in the same order.
 *
 * A vector holds LANES rows of a panel (16 with AVX-512, 8 otherwise: a panel is then two halves), and a tile
 * meets up to ROWS_X rows of x (16 with AVX-512, 4 otherwise) with an accumulator per row and vector (at most 16
 * of AVX-512's 32 registers, 8 of AVX2's 16), so a decode step, a verification run of up to ROWS_X - 1 drafts
 * and a batch cost one pass over the weights per ROWS_X rows. Past ROWS_X rows the panels are decoded once into
 * a buffer and reused by every tile (many_rows).
 *
 * Compiled at first use with -march=native: AVX-512 or AVX2 (with FMA and F16C) intrinsics on x86, otherwise
 * (ARM, older x86) GCC's portable vectors of 8 floats, which the compiler maps to the CPU's (NEON, SSE).
 */
#include "cpu_exports.h"
#include "cpu_kernel.h"

/* H vectors make a panel; a tile's NC column vectors cover panels p, p + 1, .. (vector c: panel p + c / H, rows
 * (c % H) * LANES ..). Several column vectors for few rows of x: each output's sum is one chain of dependent
 * fma's, so a decode step's single row needs several chains in flight to keep the FMA units busy. */
#define H (PANEL / LANES)
#define R16(F, c) F(0, c) F(1, c) F(2, c) F(3, c) F(4, c) F(5, c) F(6, c) F(7, c) \
                  F(8, c) F(9, c) F(10, c) F(11, c) F(12, c) F(13, c) F(14, c) F(15, c)
#define RC(F) R16(F, 0) R16(F, 1) R16(F, 2) R16(F, 3)
#define C4(F) F(0) F(1) F(2) F(3)

/* y[m, ..] for MR rows of x (MR <= ROWS_X) and NC column vectors, x transposed in k pairs: row m's x at k is
 * xt[(k & ~1) * xs + 2 * m + (k & 1)] (xs: ROWS_X, or 1 for one row, x itself). The weights come
 * from the codes, or from `decoded` ([K][NC * LANES] fp32, the same values) when the panels meet several tiles.
 * The accumulators are named, one per row and column vector (GCC stores an array of vectors to the stack on
 * every iteration); those past MR and NC are compiled out. */
INLINE void tile(const Weight *w, i64 p, const float *xt, i64 xs, const int MR, const int NC, float *y, i64 ldy,
                 i64 N, int bits, const float *decoded) {
#define ACC(r, c) V a_##r##_##c = vzero();
    RC(ACC)
#undef ACC
#define FMA(r, c) if (MR > r && NC > c) a_##r##_##c = vfma(vset1(xk[2 * r]), w##c, a_##r##_##c);
    if (decoded) {
        for (i64 k = 0; k < w->K; k++) {
#define LOAD(c) V w##c = NC > c ? vload(decoded + (k * NC + c) * LANES) : vzero();
            C4(LOAD)
#undef LOAD
            const float *xk = xt + (k & ~(i64)1) * xs + (k & 1);
            RC(FMA)
        }
    } else {
        const i64 step = PANEL * code_bits(bits) / 8;
        const uint8_t *next = w->codes + (p + (NC + H - 1) / H) * w->panel_code_bytes;
#define CODES(c) const uint8_t *codes##c = w->codes + (p + c / H) * w->panel_code_bytes;
        C4(CODES)
#undef CODES
        for (i64 g = 0; g < w->K / w->group; g++) {
#define PARAMS(c) i64 at##c = ((p + c / H) * w->panel_groups + g) * PANEL + (c % H) * LANES;        \
                  V s##c = NC > c ? vparams(w->scales, at##c, w->scale_kind) : vzero();                  \
                  V o##c = NC > c ? vparams(w->offsets, at##c, w->scale_kind) : vzero();
            C4(PARAMS)
#undef PARAMS
            /* the next panels' codes (past the last panel a prefetch is harmless): a core streamed 4 GB/s
             * without it (measured) */
            for (i64 b = 0; b < (NC + H - 1) / H * w->group * step; b += 64)
                PREFETCH_L2(next + g * w->group * step + b);
            /* two k at a time (groups are 16 or 32 long): one load and nibble split serve both */
            for (i64 k = g * w->group; k < (g + 1) * w->group; k += 2) {
                V w0 = vzero(), u0 = vzero(), w1 = vzero(), u1 = vzero(), w2 = vzero(), u2 = vzero();
                V w3 = vzero(), u3 = vzero();
#define CODES2(c) if (NC > c) vcodes2(codes##c + k * step, bits, c % H, &w##c, &u##c);
                /* a panel's two halves (vectors c and c + 1) from one load and one widening, where H is 2 */
                if (PAIRED_HALVES && code_bits(bits) == 4) {
                    vcodes_halves(codes0 + k * step, bits, &w0, &u0, &w1, &u1);
                    if (NC > 2) vcodes_halves(codes2 + k * step, bits, &w2, &u2, &w3, &u3);
                } else {
                    C4(CODES2)
                }
#undef CODES2
#define DECODE(c) if (NC > c) {                                                       \
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
                xk += 1; /* x in pairs: row r's x at k + 1 follows its x at k */
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

/* Panels [p, p + count)'s weights, [K][count * 16] fp32: decoded once when more than one tile of x rows meets
 * them (the same values tile would decode, so the result is the same bits either way; decoding inside the tile
 * is twice as fast for a decode step's one row, measured). */
INLINE void decode_panels(const Weight *w, i64 p, i64 count, float *out, int bits) {
    const i64 step = PANEL * code_bits(bits) / 8, width = count * PANEL;
    for (i64 j = 0; j < count; j++) {
        const uint8_t *codes = w->codes + (p + j) * w->panel_code_bytes, *next = codes + w->panel_code_bytes;
        for (i64 g = 0; g < w->K / w->group; g++) {
            for (i64 b = 0; b < w->group * step; b += 64)
                PREFETCH_L2(next + g * w->group * step + b);
            for (int h = 0; h < PANEL / LANES; h++) {
                i64 at = ((p + j) * w->panel_groups + g) * PANEL + h * LANES;
                V s = vparams(w->scales, at, w->scale_kind), o = vparams(w->offsets, at, w->scale_kind);
                for (i64 k = g * w->group; k < (g + 1) * w->group; k++)
                    vstore(out + k * width + j * PANEL + h * LANES, vfma(vcodes(codes + k * step, bits, h), s, o));
            }
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
#if LANES == 16
    if (code_bits(w->bits) == 4) {
        nibble_rows(w, p, PANELS_PER_TILE(M), x, xs, M, y, N, ldy);
        return;
    }
#endif
    switch (M) {
#define CASE(MR) case MR: {                                                                   \
        if (w->bits == 4) tile(w, p, x, xs, MR, COLUMNS(MR), y, ldy, N, 4, NULL);              \
        else if (w->bits == TABLE_BITS) tile(w, p, x, xs, MR, COLUMNS(MR), y, ldy, N, TABLE_BITS, NULL); \
        else if (tabled(w->bits)) tile(w, p, x, xs, MR, COLUMNS(MR), y, ldy, N, TABLE_BITS + 1, NULL); \
        else tile(w, p, x, xs, MR, COLUMNS(MR), y, ldy, N, 8, NULL);                           \
        break;                                                                                \
    }
    ALL_ROWS(CASE)
#undef CASE
    }
}

/* Past ROWS_X rows of x: MANY_PANELS panels decoded once, then tiles of MANY_ROWS rows by all their column
 * vectors (AVX-512: 8 rows by 2 panels, 16 accumulators fed by 2 weight loads and 8 broadcasts a k; one panel by
 * 16 rows needed 17 loads for 16 fma's and ran at 70% of the FMA units' peak, measured). */
#if LANES == 16
#define MANY_PANELS 2
#define MANY_ROWS 8 /* a divisor of ROWS_X: a tile's rows lie in one of x's transposed tiles */
#define MANY_CASES(F) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8)
#else
#define MANY_PANELS 1
#define MANY_ROWS ROWS_X
#define MANY_CASES ALL_ROWS
#endif
#define MANY_NC (MANY_PANELS * H)

static void many_rows(const Weight *w, i64 p, const float *xt, i64 M, float *y, i64 N, i64 ldy, float *decoded) {
#if LANES == 16
    if (code_bits(w->bits) == 4) {
        nibble_many_rows(w, p, MANY_PANELS, xt, M, y, N, ldy, decoded);
        return;
    }
#endif
    if (w->bits == 4) decode_panels(w, p, MANY_PANELS, decoded, 4);
    else if (w->bits == TABLE_BITS) decode_panels(w, p, MANY_PANELS, decoded, TABLE_BITS);
    else if (tabled(w->bits)) decode_panels(w, p, MANY_PANELS, decoded, TABLE_BITS + 1);
    else decode_panels(w, p, MANY_PANELS, decoded, 8);
    for (i64 m0 = 0; m0 < M; m0 += MANY_ROWS) {
        /* rows m0.. in x's transposed tiles of ROWS_X: tile m0 / ROWS_X, from its row m0 % ROWS_X */
        const float *xm = xt + (m0 / ROWS_X) * w->K * ROWS_X + 2 * (m0 % ROWS_X);
        float *ym = y + m0 * ldy;
        switch (M - m0 < MANY_ROWS ? M - m0 : MANY_ROWS) {
#define CASE(MR) case MR: { tile(w, p, xm, ROWS_X, MR, MANY_NC, ym, ldy, N, 8, decoded); break; }
        MANY_CASES(CASE)
#undef CASE
        }
    }
}

/* y [M, N] = x [M, K] @ w.T from codes in this kernel's panels, y's rows ldy apart (a part of a fused layer's
 * output writes its own columns); 0 where there was no memory for x's transposed tiles. */
int qmm_fp32(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
             int bits, i64 group, int scale_kind, float *y, i64 ldy, int threads) {
    Weight w = weight_of(codes, scales, offsets, K, group, bits, scale_kind);
    i64 panels = (N + PANEL - 1) / PANEL, tiles = (M + ROWS_X - 1) / ROWS_X;
    /* x transposed per tile of ROWS_X rows, in k pairs ([tiles][K / 2][ROWS_X][2], transpose_tile): a tile's
     * broadcasts then read one pointer at fixed
     * offsets (a pointer per row would not fit the general registers); one row is its own transpose. Several
     * tiles (a batch, a prompt chunk) are transposed once, a share by each thread, into the calling thread's
     * scratch (a copy per thread was the whole x again per thread: 117 MB each for a 2,048-row chunk of a
     * 14,336-wide layer, and as much transposing as the matmul's arithmetic per thread on a 64-core CPU); one
     * tile by each thread for itself, with no barrier (a decode step). */
    static __thread void *shared_buf;
    static __thread size_t shared_size;
    float *shared =
        M > ROWS_X ? grown(&shared_buf, &shared_size, (size_t)(tiles * K * ROWS_X) * sizeof(float)) : NULL;
    if (M > ROWS_X && !shared) return 0;
    int failed = 0; /* a thread without memory for its scratch: said in the result, its tiles not computed */
#pragma omp parallel num_threads(threads)
    {
        static __thread void *xt_buf, *decoded_buf;
        static __thread size_t xt_size, decoded_size;
        float *xt = shared;
        if (shared) {
#pragma omp for schedule(static)
            for (i64 t = 0; t < tiles; t++) transpose_tile(x, t, M, K, xt);
        } else if (M > 1) {
            xt = grown(&xt_buf, &xt_size, (size_t)(K * ROWS_X) * sizeof(float));
            if (xt) transpose_tile(x, 0, M, K, xt);
        }
        if (M > ROWS_X) {
            float *decoded = grown(&decoded_buf, &decoded_size, (size_t)K * PANEL * MANY_PANELS * sizeof(float));
            if (!decoded) {
#pragma omp atomic write
                failed = 1;
            }
            i64 groups = (panels + MANY_PANELS - 1) / MANY_PANELS;
#pragma omp for schedule(static)
            for (i64 g = 0; g < groups; g++)
                if (decoded) many_rows(&w, g * MANY_PANELS, xt, M, y, N, ldy, decoded);
        } else {
            if (M > 1 && !xt) {
#pragma omp atomic write
                failed = 1;
            }
            i64 per = PANELS_PER_TILE(M), groups = (panels + per - 1) / per;
#pragma omp for schedule(static)
            for (i64 g = 0; g < groups; g++)
                if (M == 1 || xt) few_rows(&w, g * per, M == 1 ? x : xt, M == 1 ? 1 : ROWS_X, M, y, N, ldy);
        }
    }
    return !failed;
}

/* M <= ROWS_X rows of x against the panels [p, p + tile_panels(M)) of w, on the calling thread: a piece of a matmul
 * for callers that run many matmuls in one parallel region (cpu_moe.c). xt: x transposed, [K / 2][ROWS_X][2] (one row:
 * the row itself), as qmm lays a tile out, so each row gets qmm's bits. */
i64 tile_panels(i64 M) { return PANELS_PER_TILE(M); }

const i64 ROWS_PER_TILE = ROWS_X; /* for callers choosing between tiles and qmm's decode-once path (experts.py) */

void qmm_rows_tile(const Weight *w, i64 p, const float *xt, i64 M, float *y, i64 N, i64 ldy) {
    few_rows(w, p, xt, M > 1 ? ROWS_X : 1, M, y, N, ldy);
}
