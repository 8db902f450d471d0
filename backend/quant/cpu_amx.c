/* Quantized matmul with bf16 products on AMX (Intel's tile matrix units, Sapphire Rapids and later): what a
 * bfloat16 engine on the CPU uses for steps of many rows (batches, prompt chunks), where the tiles beat fp32 FMA
 * several times over (SmolLM2's layers at 32 rows: 285 GFLOP/s fp32, 2 cores).
 *
 * Each weight is decoded as cpu_kernel.c decodes it (fma(q, scale, offset) in fp32) and rounded to bf16, x is
 * rounded to bf16, and the tiles sum the products in fp32: torch's x.bfloat16() @ w.bfloat16().T, summed in
 * another order. A weight tile holds 32 k's by 16 rows of w in VNNI order (k pairs side by side); two panels of
 * w and two tiles of 16 rows of x make four accumulator tiles, all eight tiles in use. Up to 32 rows of x (a
 * decode batch) the two panels are decoded 32 k's at a time between the tiles' products, so they are still in L1
 * (15% less time at 32 rows, measured); past 32, once each for every 32 rows.
 *
 * qmm calls it from the number of rows its caller chose (cpu_native.BF16_FROM_ROWS: fewer rows keep the fp32
 * kernel, exact and as fast for a row or two), or, for 4-bit codes in the tiles' pair order (cpu_amx_codes.c),
 * past 16 rows. It returns 0 where it does not run: no AMX in this build or CPU, the kernel refusing the
 * permission, K not a multiple of 32. The caller then takes the fp32 path (or, for the pair order, reports it).
 */
#include "cpu_amx.h"

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
 * of the 16 weight rows. k0 and k1 are multiples of 32, the largest group. */
static void vnni_rows(const Weight *w, i64 p, i64 k0, i64 k1, uint16_t *out) {
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const uint8_t *codes = w->codes + p * w->panel_code_bytes;
    const i64 step = PANEL * w->bits / 8;
    for (i64 g = k0 / w->group; g < k1 / w->group; g++) {
        i64 at = (p * w->panel_groups + g) * PANEL;
        V s = vparams(w->scales, at, w->f16), o = vparams(w->offsets, at, w->f16);
        /* the next pair's codes, as tile() in cpu_kernel.c does (about 10% at 32 rows, measured) */
        const uint8_t *next = codes + 2 * w->panel_code_bytes + g * w->group * step;
        for (i64 b = 0; b < w->group * step; b += 64) PREFETCH(next + b);
        for (i64 k = g * w->group; k < (g + 1) * w->group; k += 2) {
            V lo, hi;
            vcodes2(codes + k * step, w->bits, 0, &lo, &hi);
            __m512bh both = _mm512_cvtne2ps_pbh(vfma(hi, s, o), vfma(lo, s, o)); /* k's 16, then k + 1's */
            _mm512_storeu_si512(out + (k - k0) * PANEL, _mm512_permutexvar_epi16(pairs, (__m512i)both));
        }
    }
}

/* The same from 4-bit codes already in the tiles' pair order (cpu_amx_codes.c's layout): 32 bytes hold two
 * tile rows, the low nibbles one, the high the next; word i of a row is column i / 2 at k + i % 2. */
static void vnni_rows_of_pairs(const Weight *w, i64 p, i64 k0, i64 k1, uint16_t *out) {
    const __m512i low_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i high_cols = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    const uint8_t *codes = w->codes + p * w->panel_code_bytes;
    for (i64 g = k0 / w->group; g < k1 / w->group; g++) {
        i64 at = (p * w->panel_groups + g) * PANEL;
        V s = vparams(w->scales, at, w->f16), o = vparams(w->offsets, at, w->f16);
        V s0 = _mm512_permutexvar_ps(low_cols, s), s1 = _mm512_permutexvar_ps(high_cols, s);
        V o0 = _mm512_permutexvar_ps(low_cols, o), o1 = _mm512_permutexvar_ps(high_cols, o);
        const uint8_t *next = codes + 2 * w->panel_code_bytes + g * w->group * 8;
        for (i64 b = 0; b < w->group * 8; b += 64) PREFETCH(next + b);
        for (i64 k = g * w->group; k < (g + 1) * w->group; k += 4) {
            __m512i both = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(codes + k * 8)));
            __m512i rows[2] = {_mm512_and_si512(both, _mm512_set1_epi16(15)), _mm512_srli_epi16(both, 4)};
            for (int j = 0; j < 2; j++) {
                V a = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(rows[j])));
                V b = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(rows[j], 1)));
                __m512bh both_bf16 = _mm512_cvtne2ps_pbh(vfma(b, s1, o1), vfma(a, s0, o0));
                _mm512_storeu_si512(out + (k - k0 + 2 * j) * PANEL, (__m512i)both_bf16);
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

/* whether qmm_bf16 runs here (experts.py: bf16 products change what a token's experts compute only then) */
int amx_usable(void) { return amx_ready(); }

/* pairs_order: 4-bit codes in the tiles' pair order (cpu_native.pair_order), else cpu_kernel.c's layout */
int qmm_bf16(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
             int bits, i64 group, int f16, int pairs_order, float *y, i64 ldy, int threads) {
    if (K % 32 || !amx_ready()) return 0;
    void (*decode)(const Weight *, i64, i64, i64, uint16_t *) = pairs_order ? vnni_rows_of_pairs : vnni_rows;
    Weight w = weight_of(codes, scales, offsets, K, group, bits, f16);
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
                /* panels are padded to whole groups of 4 (cpu_native.pack), so panel 2 pp + 1 exists */
                uint16_t *w0 = wb, *w1 = wb + K * PANEL;
                if (padded <= 32) { /* one block of rows: 32 k's decoded at a time, still in L1 for the tiles */
                    zero_tiles();
                    for (i64 k = 0; k < K; k += 32) {
                        decode(&w, 2 * pp, k, k + 32, w0 + k * PANEL);
                        decode(&w, 2 * pp + 1, k, k + 32, w1 + k * PANEL);
                        products(w0 + k * PANEL, w1 + k * PANEL, xb, K, 0, padded > 16, k, k + 32);
                    }
                    store_tiles(tile, y, ldy, M, N, 0, 2 * pp * PANEL, padded > 16);
                } else { /* many: the two panels decoded once, for every block of rows */
                    decode(&w, 2 * pp, 0, K, w0);
                    decode(&w, 2 * pp + 1, 0, K, w1);
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

int qmm_bf16(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
             int bits, i64 group, int f16, int pairs_order, float *y, i64 ldy, int threads) {
    (void)x, (void)M, (void)codes, (void)scales, (void)offsets, (void)N, (void)K, (void)bits, (void)group, (void)f16,
        (void)pairs_order, (void)y, (void)ldy, (void)threads;
    return 0;
}
#endif
