/* Multi-head latent attention's decode rows in one call (kernels/mla_attention.py's absorbed form): each head's
 * query taken into the latent space through W_UK, attention over the latent cache as one kv head whose rows are
 * the keys and the values alike (cpu_attention.c's decode_attention_rows), the attended latent taken out through
 * W_UV. What goes is the torch path's batched matmuls over the fp32 kv_b weight (8 MB a DeepSeek-V2-Lite layer read
 * a token) and the copies around them: the weights are read here as int8 blocks where kv_b holds them exactly
 * (a GGUF's Q8_0 attn_k_b / attn_v_b: 2 MB a layer), else as fp32. Compiled with -ffp-contract=off like
 * cpu_attention.c; its torch reference is mla_attention.absorbed_attention's torch path, which the tests hold it to. */
#include "cpu_exports.h"
#include "cpu_vectors.h"

#define BLOCK 32 /* columns a scale of the int8 weights covers */

/* 8 floats from 8 int8 */
static inline V8 v8_of_i8(const int8_t *p) {
#if defined(__AVX2__) && defined(__FMA__)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    V8 v;
    for (int i = 0; i < 8; i++) v[i] = (float)p[i];
    return v;
#endif
}

/* y[j] = w_j . x for the 8 rows of w from row `row` (cols columns each): fp32 rows where scales is NULL, else
 * int8 rows whose every BLOCK columns share one scale (scales [rows][cols / BLOCK]) */
static void dot_rows8(const void *w, const float *scales, i64 row, i64 cols, const float *x, float *y) {
    V8 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = v8_set1(0.0f);
    if (!scales) {
        const float *wf = (const float *)w + row * cols;
        for (i64 c = 0; c < cols; c += 8) {
            V8 xv = v8_loadu(x + c);
            for (int j = 0; j < 8; j++) acc[j] = v8_fma(xv, v8_loadu(wf + j * cols + c), acc[j]);
        }
    } else {
        const int8_t *wq = (const int8_t *)w + row * cols;
        const float *s = scales + row * (cols / BLOCK);
        for (i64 c = 0, b = 0; c < cols; c += BLOCK, b++) {
            V8 x0 = v8_loadu(x + c), x1 = v8_loadu(x + c + 8), x2 = v8_loadu(x + c + 16), x3 = v8_loadu(x + c + 24);
            for (int j = 0; j < 8; j++) {
                const int8_t *p = wq + j * cols + c;
                V8 part = v8_fma(x0, v8_of_i8(p), v8_set1(0.0f));
                part = v8_fma(x1, v8_of_i8(p + 8), part);
                part = v8_fma(x2, v8_of_i8(p + 16), part);
                part = v8_fma(x3, v8_of_i8(p + 24), part);
                acc[j] = v8_fma(v8_set1(s[j * (cols / BLOCK) + b]), part, acc[j]);
            }
        }
    }
    v8_storeu(y, hsum8x8(acc));
}

/* out[r][h] = W[h] x[r][h] for every row and head: W [heads][n][k], heads wh elements apart (int8 with scales
 * [heads][n][k / BLOCK], or fp32), x's rows ldx apart and heads hx apart, out's lo apart and ho apart. A head's
 * weight is read once for all the rows (the rows inner), the heads spread over the threads. */
static void heads_matvec(const void *w, const float *scales, i64 wh, i64 heads, i64 n, i64 k, const float *x,
                         i64 ldx, i64 hx, i64 rows, float *out, i64 lo, i64 ho, int threads) {
    const i64 elem = scales ? 1 : 4, chunks = n / 8;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 job = 0; job < heads * chunks; job++) {
        const i64 h = job / chunks, row = (job % chunks) * 8;
        const void *head = (const char *)w + h * wh * elem;
        const float *sh = scales ? scales + h * n * (k / BLOCK) : NULL;
        for (i64 r = 0; r < rows; r++) dot_rows8(head, sh, row, k, x + r * ldx + h * hx, out + r * lo + h * ho + row);
    }
}

/* The absorbed attention of `rows` decoding rows. q_nope [rows][heads][nope] and q_pe [rows][heads][rope] (rows
 * ld_nope and ld_pe floats apart, heads hs_nope and hs_pe apart); w_uk [heads][lora][nope] and w_uv
 * [heads][v][lora], heads uk_hs and uv_hs elements apart, int8 with their scales or fp32 (scales NULL); the cache
 * [slots][lora + rope] of `kind`, tables / lens / max_len as decode_attention_rows reads them; out
 * [rows][heads][v]. lora, nope and v multiples of BLOCK, rope of 8. Returns 0 where memory ran out. */
int mla_decode_rows(const float *q_nope, i64 ld_nope, i64 hs_nope, const float *q_pe, i64 ld_pe, i64 hs_pe, i64 rows,
                    i64 heads, i64 nope, i64 rope, i64 lora, i64 v, const void *w_uk, const float *uk_scales, i64 uk_hs,
                    const void *w_uv, const float *uv_scales, i64 uv_hs, const void *cache, int kind, i64 block_size,
                    const int64_t *tables, i64 table_stride, const int64_t *lens, float scale, i64 max_len,
                    float *out, int threads) {
    const i64 dim = lora + rope;
    float *q = malloc((size_t)(2 * rows * heads * dim) * sizeof(float)), *latent = q + rows * heads * dim;
    if (!q) return 0;
    /* each head's query: W_UK's rows times q_nope, then its rotary part as it is */
    heads_matvec(w_uk, uk_scales, uk_hs, heads, lora, nope, q_nope, ld_nope, hs_nope, rows, q, heads * dim, dim,
                 threads);
    for (i64 r = 0; r < rows; r++)
        for (i64 h = 0; h < heads; h++)
            memcpy(q + (r * heads + h) * dim + lora, q_pe + r * ld_pe + h * hs_pe, (size_t)rope * sizeof(float));
    decode_attention_rows(q, heads * dim, latent, rows, heads, 1, dim, cache, cache, kind, block_size, tables,
                          table_stride, lens, 0, scale, NULL, max_len, threads);
    /* the attended latent's first lora columns (the rest is the rotary keys' mix) through W_UV */
    heads_matvec(w_uv, uv_scales, uv_hs, heads, v, lora, latent, heads * dim, dim, rows, out, heads * v, v, threads);
    free(q);
    return 1;
}
