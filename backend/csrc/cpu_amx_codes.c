/* Quantized matmul of up to 16 rows on AMX tiles, fed the codes themselves: what a bfloat16 engine on an
 * AMX CPU uses for a lone sequence's decode steps and its drafts' verification rows, a decode batch of up to 16
 * and short prompt chunks. A verification row then costs about a quarter of the fp32 kernel's (SmolLM2, Q4_1:
 * 16 rows 8.0 ms against 17.2 a step's matmuls, one row 4.5 against 5.5, measured), and a sequence's rows get
 * the same bits alone, in a batch or verifying drafts (one kernel from 1 to 16 rows, each row's sums in one
 * order).
 *
 * The layout (cpu_layout.pair_order): per panel of 16 weight rows, its codes in the order of a weight tile's
 * rows (k pairs side by side): 4-bit, 32 bytes for two tile rows, the low nibbles one and the high nibbles the
 * next; 8-bit, a byte a word (qmm_codes below). Word i of a tile row is column i / 2 at k + i % 2. A code u
 * expands to bf16 as 0x4300 | u, which is exactly 128 + u, in four vector operations a 32 bytes, with no
 * conversion. Per group of weights (one scale s and
 * offset o each), one tile product C = sum x (128 + q) into a fresh accumulator, then in fp32
 *
 *   y += s C + (o - bias s) sum x       (the sum of the group's x as the tiles read it: rounded to bf16)
 *
 * so the products are bf16(x) times the weight's exact code: closer to x @ w than bf16 weights (cpu_amx.c).
 * Returns 0 where it did not run (no AMX, K not a multiple of 32, no memory for x's copy).
 */
#include "cpu_amx.h"
#include "cpu_exports.h"

#if HAVE_AMX
/* Per 32 codes of a group of panel p: the tile rows of bf16 128 + u (4-bit: two rows a 32 bytes, the low nibbles
 * and the high; 7: one row; 8, split: u's low nibble into out, its high into high_out) */
INLINE void expand(const Weight *w, i64 p, i64 g, int bits, uint16_t *out, uint16_t *high_out) {
    const i64 bytes = w->panel_code_bytes / w->panel_groups;
    const uint8_t *c = w->codes + p * w->panel_code_bytes + g * bytes;
    const __m512i low = _mm512_set1_epi16(15), bias = _mm512_set1_epi16(0x4300);
    for (i64 i = 0; i < bytes / 32; i++) {
        __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(c + 32 * i)));
        if (bits == 7) {
            _mm512_store_si512(out + 32 * i, _mm512_or_si512(u, bias));
            continue;
        }
        uint16_t *lo = bits == 4 ? out + 64 * i : out + 32 * i, *hi = bits == 4 ? out + 64 * i + 32 : high_out + 32 * i;
        _mm512_store_si512(lo, _mm512_ternarylogic_epi32(u, low, bias, 0xEA)); /* (u & low) | bias */
        _mm512_store_si512(hi, _mm512_or_si512(_mm512_srli_epi16(u, 4), bias));
    }
}

/* acc [M][32] (the two panels' columns) += s C + (o - bias s) xsum, for one panel of the pair */
INLINE void scale_into(const Weight *w, i64 p, i64 g, float bias, const float *C, const float *xsum, i64 G, i64 M,
                       float *acc) {
    i64 at = (p * w->panel_groups + g) * PANEL;
    V s = vparams(w->scales, at, w->scale_kind), o = vparams(w->offsets, at, w->scale_kind);
    V o_bias = _mm512_fnmadd_ps(_mm512_set1_ps(bias), s, o);
    for (i64 m = 0; m < M; m++) {
        V a = vfma(s, vload(C + m * 16), vload(acc + m * 32));
        vstore(acc + m * 32, vfma(o_bias, vset1(xsum[m * G + g]), a));
    }
}

/* x's M rows in bf16 (and, split, 16 x: exact, a power of two), and each row's sum of a group's bf16 x, in k's
 * order: a row's sum is the same whatever M */
static void round_rows(const float *x, i64 M, i64 K, i64 group, int split, uint16_t *xb, uint16_t *xb16,
                       float *xsum) {
    for (i64 r = 0; r < M; r++) {
        bf16_row(x, r, M, K, xb);
        for (i64 k = 0; split && k < K; k += 16)
            _mm256_storeu_si256((__m256i *)(xb16 + r * K + k),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + r * K + k),
                                                                          _mm512_set1_ps(16.0f))));
        for (i64 g = 0; g < K / group; g++) {
            float t = 0;
            for (i64 k = g * group; k < (g + 1) * group; k++) {
                uint32_t bits = (uint32_t)xb[r * K + k] << 16;
                float f;
                memcpy(&f, &bits, sizeof f);
                t += f;
            }
            xsum[r * (K / group) + g] = t;
        }
    }
}

/* bits: 4 (4-bit codes u = q), 7 (bytes u = q + 64, 0..127) or 8 (bytes u = q + 128, split in two nibbles: one
 * product of x by 128 + the low, one of 16 x by 128 + the high, into the same accumulator) */
int qmm_codes(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
              int bits, i64 group, int scale_kind, float *y, i64 ldy, int threads) {
    if (K % 32 || M > 16 || M < 1 || !amx_ready()) return 0;
    /* sum x (128 + u) = sum x q + bias sum x (split: 128 + low + 16 (128 + high) = 2176 + u = 2304 + q) */
    const float bias = bits == 4 ? 128.0f : bits == 7 ? 192.0f : 2304.0f;
    const int split = bits == 8;
    Weight w = weight_of(codes, scales, offsets, K, group, bits, scale_kind);
    const i64 panels = (N + PANEL - 1) / PANEL, pairs = (panels + 1) / 2, G = K / group;
    const i64 group_bytes = w.panel_code_bytes / G;
    int done = 1;
#pragma omp parallel num_threads(threads)
    {
        /* each thread rounds the few rows of x for itself (sharing them would cost a barrier) */
        static __thread void *xb_buf, *sum_buf;
        static __thread size_t xb_size, sum_size;
        uint16_t *xb = grown(&xb_buf, &xb_size, (size_t)(2 * M * K) * 2), *xb16 = xb ? xb + M * K : NULL;
        float *xsum = grown(&sum_buf, &sum_size, (size_t)(M * G) * sizeof(float));
        uint16_t wb[2][32 * 16] __attribute__((aligned(64))), wh[2][32 * 16] __attribute__((aligned(64)));
        float C[2][16 * 16] __attribute__((aligned(64))), acc[16 * 32] __attribute__((aligned(64)));
        if (!(xb && xsum)) {
#pragma omp atomic write
            done = 0;
        }
#pragma omp barrier
        if (done) {
            round_rows(x, M, K, group, split, xb, xb16, xsum);
            /* accumulators 0, 1: M x 16 fp32; x: tile 4 (16 x: 5), M rows of a group's k's; weights: tiles 6, 7 */
            TileConfig cfg = {.palette = 1};
            cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = cfg.rows[5] = (uint8_t)M;
            cfg.bytes_per_row[0] = cfg.bytes_per_row[1] = 64;
            cfg.bytes_per_row[4] = cfg.bytes_per_row[5] = (uint16_t)(group * 2);
            cfg.rows[6] = cfg.rows[7] = (uint8_t)(group / 2);
            cfg.bytes_per_row[6] = cfg.bytes_per_row[7] = 64;
            _tile_loadconfig(&cfg);
#pragma omp for schedule(static)
            for (i64 pp = 0; pp < pairs; pp++) {
                memset(acc, 0, sizeof(float) * (size_t)(M * 32));
                for (i64 g = 0; g < G; g++) {
                    /* the next pair's codes of this group (as cpu_kernel.c's tile prefetches) */
                    const uint8_t *next = codes + (2 * pp + 2) * w.panel_code_bytes + g * group_bytes;
                    for (i64 b = 0; b < 2 * w.panel_code_bytes && 2 * pp + 2 < panels; b += w.panel_code_bytes)
                        for (i64 c = 0; c < group_bytes; c += 64) PREFETCH(next + b + c);
                    expand(&w, 2 * pp, g, bits, wb[0], wh[0]);
                    expand(&w, 2 * pp + 1, g, bits, wb[1], wh[1]);
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_loadd(4, xb + g * group, K * 2);
                    _tile_loadd(6, wb[0], 64);
                    _tile_loadd(7, wb[1], 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    if (split) {
                        _tile_loadd(5, xb16 + g * group, K * 2);
                        _tile_loadd(6, wh[0], 64);
                        _tile_loadd(7, wh[1], 64);
                        _tile_dpbf16ps(0, 5, 6);
                        _tile_dpbf16ps(1, 5, 7);
                    }
                    _tile_stored(0, C[0], 64);
                    _tile_stored(1, C[1], 64);
                    scale_into(&w, 2 * pp, g, bias, C[0], xsum, G, M, acc);
                    scale_into(&w, 2 * pp + 1, g, bias, C[1], xsum, G, M, acc + 16);
                }
                i64 col = 2 * pp * PANEL, cols = N - col < 32 ? N - col : 32;
                for (i64 m = 0; m < M; m++) memcpy(y + m * ldy + col, acc + m * 32, (size_t)cols * sizeof(float));
            }
            _tile_release();
        }
    }
    return done;
}
#endif
