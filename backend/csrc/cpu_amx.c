/* Quantized matmul with bf16 products on AMX (Intel's tile matrix units, Sapphire Rapids and later): what a
 * bfloat16 engine on the CPU uses for steps of more than 16 rows (batches, prompt chunks), where the tiles beat
 * fp32 FMA several times over (SmolLM2's layers at 32 rows: 285 GFLOP/s fp32, 2 cores). Up to 16 rows take
 * cpu_amx_codes.c, which reads the same layout: the codes in the tiles' pair order.
 *
 * Each weight is decoded as cpu_kernel.c decodes it (fma(q, scale, offset) in fp32) and rounded to bf16, x is
 * rounded to bf16, and the tiles sum the products in fp32: torch's x.bfloat16() @ w.bfloat16().T, summed in
 * another order. A weight tile holds 32 k's by 16 rows of w in VNNI order (k pairs side by side); two panels of
 * w and two tiles of 16 rows of x make four accumulator tiles, all eight tiles in use. Up to 32 rows of x (a
 * decode batch) the two panels are decoded 32 k's at a time between the tiles' products, so they are still in L1
 * (15% less time at 32 rows, measured); past 32, once each for every 32 rows.
 *
 * It returns 0 where it does not run: no AMX in this build or CPU, the kernel refusing the permission, K not a
 * multiple of 32, no memory for its buffers (the loader makes the layout only where the tiles run).
 */
#include "cpu_amx.h"
#include "cpu_exports.h"

#if HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out the tiles' 8 KB of state per process on request; -1: not asked yet */
static int amx_permitted = -1;

int amx_ready(void) {
    if (amx_permitted < 0) amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return amx_permitted;
}

/* Weights k0 .. k1 of panel p as [(k1 - k0) / 2][16][2] bf16: row k / 2 of a weight tile holds k and k + 1 of each
 * of the 16 weight rows. k0 and k1 are multiples of 32, the largest group. From the codes in the tiles' pair order
 * (cpu_amx_codes.c's layout): 4-bit, 32 bytes hold two tile rows, the low nibbles one, the high the next; bytes
 * (bits 7 and 8: q + 64 and q + 128), 32 bytes a row. Word i of a row is column i / 2 at k + i % 2. */
static void vnni_rows(const Weight *w, i64 p, i64 k0, i64 k1, uint16_t *out) {
    const __m512i low_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i high_cols = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    const i64 code_bytes = w->panel_code_bytes / w->K; /* a k's */
    const __m512i shift = _mm512_set1_epi32(w->bits == 4 ? 0 : w->bits == 7 ? 64 : 128);
    const uint8_t *codes = w->codes + p * w->panel_code_bytes;
    for (i64 g = k0 / w->group; g < k1 / w->group; g++) {
        i64 at = (p * w->panel_groups + g) * PANEL;
        V s = vparams(w->scales, at, w->scale_kind), o = vparams(w->offsets, at, w->scale_kind);
        V s0 = _mm512_permutexvar_ps(low_cols, s), s1 = _mm512_permutexvar_ps(high_cols, s);
        V o0 = _mm512_permutexvar_ps(low_cols, o), o1 = _mm512_permutexvar_ps(high_cols, o);
        const uint8_t *next = codes + 2 * w->panel_code_bytes + g * w->group * code_bytes;
        for (i64 b = 0; b < w->group * code_bytes; b += 64) PREFETCH(next + b);
        for (i64 k = g * w->group; k < (g + 1) * w->group; k += 32 / code_bytes) { /* 32 bytes */
            __m512i u = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + k * code_bytes)));
            __m512i rows[2] = {u, u};
            if (w->bits == 4) rows[0] = _mm512_and_si512(u, _mm512_set1_epi16(15)), rows[1] = _mm512_srli_epi16(u, 4);
            for (int j = 0; j < (w->bits == 4 ? 2 : 1); j++) {
                __m512i a = _mm512_sub_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(rows[j])), shift);
                __m512i b = _mm512_sub_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(rows[j], 1)), shift);
                __m512bh both = _mm512_cvtne2ps_pbh(vfma(_mm512_cvtepi32_ps(b), s1, o1),
                                                    vfma(_mm512_cvtepi32_ps(a), s0, o0));
                _mm512_storeu_si512(out + (k - k0 + 2 * j) * PANEL, (__m512i)both);
            }
        }
    }
}

/* 16 x 16 fp32 of a tile into y, the rows and columns that exist */
static void store_tile(const float *tile, float *y, i64 ldy, i64 rows, i64 cols) {
    for (i64 r = 0; r < rows; r++) memcpy(y + r * ldy, tile + r * 16, (size_t)cols * sizeof(float));
}

INLINE void zero_tiles(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* Accumulators 0 and 1 (rows m0 .. m0 + 15 of x by the two panels w0 and w1) and, with two, 2 and 3 (the next 16
 * rows) += the products over k0 .. k1. w0 and w1 point at k0's row pair of their panels; a row's sum runs over k
 * in the same order whatever M and however the weights were decoded, so each row of y has the same bits. */
INLINE void products(const uint16_t *w0, const uint16_t *w1, const uint16_t *xb, i64 K, i64 m0, int two, i64 k0,
                     i64 k1) {
    for (i64 k = k0; k < k1; k += 32) {
        _tile_loadd(6, w0 + (k - k0) * PANEL, 64);
        _tile_loadd(7, w1 + (k - k0) * PANEL, 64);
        _tile_loadd(4, xb + m0 * K + k, K * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, xb + (m0 + 16) * K + k, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* the accumulators into y at rows m0.., columns col.. (the two panels), what exists of them */
static void store_tiles(float *tile, float *y, i64 ldy, i64 M, i64 N, i64 m0, i64 col0, int two) {
    for (int part = 0; part < (two ? 4 : 2); part++) {
        i64 row = m0 + (part / 2) * 16, col = col0 + (part % 2) * PANEL;
        if (part == 0) _tile_stored(0, tile, 64);
        else if (part == 1) _tile_stored(1, tile, 64);
        else if (part == 2) _tile_stored(2, tile, 64);
        else _tile_stored(3, tile, 64);
        if (col < N && row < M)
            store_tile(tile, y + row * ldy + col, ldy, M - row < 16 ? M - row : 16, N - col < 16 ? N - col : 16);
    }
}

/* whether the tiles run here (modules.py stores a bfloat16 engine's codes in their order only then) */
int amx_usable(void) { return amx_ready(); }

int qmm_bf16(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
             int bits, i64 group, int scale_kind, float *y, i64 ldy, int threads) {
    if (K % 32 || !amx_ready()) return 0;
    Weight w = weight_of(codes, scales, offsets, K, group, bits, scale_kind);
    const i64 panels = (N + PANEL - 1) / PANEL, pairs = (panels + 1) / 2, padded = (M + 15) / 16 * 16;
    /* x in bf16, [padded][K], rows past M zero. A prompt's chunk is converted once, a share of the rows by each
     * thread, into the calling thread's scratch (a copy per thread was all of x again per thread); a decode batch's
     * few rows by each thread for itself (sharing them cost a barrier more than the copy: 2% at batch 32) */
    const int share = padded > 64;
    static __thread void *shared_buf;
    static __thread size_t shared_size;
    uint16_t *shared = share ? grown(&shared_buf, &shared_size, (size_t)(padded * K) * 2) : NULL;
    if (share && !shared) return 0;
    int done = 1; /* 0 where a thread could not get its buffers: the caller's fp32 kernel then writes all of y */
#pragma omp parallel num_threads(threads)
    {
        static __thread void *xb_buf, *wb_buf;
        static __thread size_t xb_size, wb_size;
        float tile[16 * 16] __attribute__((aligned(64)));
        uint16_t *xb = share ? shared : grown(&xb_buf, &xb_size, (size_t)(padded * K) * 2);
        uint16_t *wb = grown(&wb_buf, &wb_size, (size_t)(2 * K * PANEL) * 2);
        if (!(xb && wb)) {
#pragma omp atomic write
            done = 0;
        }
#pragma omp barrier
        if (done) { /* every thread or none: a worksharing loop must be met by all of them */
            if (share) {
#pragma omp for schedule(static)
                for (i64 r = 0; r < padded; r++) bf16_row(x, r, M, K, xb);
            } else {
                for (i64 r = 0; r < padded; r++) bf16_row(x, r, M, K, xb);
            }
            TileConfig cfg = {.palette = 1};
            for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.bytes_per_row[t] = 64;
            _tile_loadconfig(&cfg);
#pragma omp for schedule(static)
            for (i64 pp = 0; pp < pairs; pp++) {
                /* panels are padded to whole groups of 4 (cpu_layout.pack), so panel 2 pp + 1 exists */
                uint16_t *w0 = wb, *w1 = wb + K * PANEL;
                if (padded <= 32) { /* one block of rows: 32 k's decoded at a time, still in L1 for the tiles */
                    zero_tiles();
                    for (i64 k = 0; k < K; k += 32) {
                        vnni_rows(&w, 2 * pp, k, k + 32, w0 + k * PANEL);
                        vnni_rows(&w, 2 * pp + 1, k, k + 32, w1 + k * PANEL);
                        products(w0 + k * PANEL, w1 + k * PANEL, xb, K, 0, padded > 16, k, k + 32);
                    }
                    store_tiles(tile, y, ldy, M, N, 0, 2 * pp * PANEL, padded > 16);
                } else { /* many: the two panels decoded once, for every block of rows */
                    vnni_rows(&w, 2 * pp, 0, K, w0);
                    vnni_rows(&w, 2 * pp + 1, 0, K, w1);
                    for (i64 m0 = 0; m0 < padded; m0 += 32) {
                        zero_tiles();
                        products(w0, w1, xb, K, m0, m0 + 16 < padded, 0, K);
                        store_tiles(tile, y, ldy, M, N, m0, 2 * pp * PANEL, m0 + 16 < padded);
                    }
                }
            }
            _tile_release();
        }
    }
    return done;
}
#else
int amx_usable(void) { return 0; }
#endif
