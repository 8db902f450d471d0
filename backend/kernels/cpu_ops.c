/* The small per-layer operations of a decode step on the CPU, one call each instead of PyTorch's several ops
 * (an rms_norm with its residual add was seven, ~35 us at batch 1; the rotary five). fp32, rows contiguous;
 * each has its torch reference in the .py file beside it, which the tests hold it to. Compiled with
 * -ffp-contract=off: a * b + c rounds twice, as PyTorch's separate ops do.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef int64_t i64;

/* e^x for 8 floats: 2^n e^r with n = round(x log2 e) and r = x - n ln 2 (ln 2 in two parts), e^r by Cephes'
 * degree-6 polynomial for expf (about 1 ulp); x clamped to +-88.38, where fp32 saturates anyway. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* out = x * rsqrt(mean(x^2) + eps) * weight, row by row; with residual: x + residual first, written to summed. */
void rms_norm_rows(const float *x, const float *residual, const float *weight, float *summed, float *out, i64 rows,
                   i64 cols, float eps) {
    for (i64 r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        if (residual) {
            float *sr = summed + r * cols;
            for (i64 c = 0; c < cols; c++) sr[c] = xr[c] + residual[r * cols + c];
            xr = sr;
        }
        __m256 acc = _mm256_setzero_ps();
        i64 c = 0;
        for (; c + 8 <= cols; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(xr + c), _mm256_loadu_ps(xr + c), acc);
        float squares = hsum8(acc);
        for (; c < cols; c++) squares += xr[c] * xr[c];
        float scale = 1.0f / sqrtf(squares / (float)cols + eps);
        for (c = 0; c < cols; c++) out[r * cols + c] = xr[c] * scale * weight[c];
    }
}

/* out [tokens, heads, dim] = the "rotate half" rotary of Hugging Face checkpoints, x * cos + cat(-x2, x1) * sin,
 * of x [tokens, heads, dim] (token stride ldx, head stride dim), with cos/sin [tokens, dim] (token stride ldc). */
void rotary_rows(const float *x, float *out, i64 tokens, i64 heads, i64 dim, i64 ldx, const float *cos,
                 const float *sin, i64 ldc) {
    i64 half = dim / 2;
    for (i64 t = 0; t < tokens; t++) {
        const float *c = cos + t * ldc, *s = sin + t * ldc;
        for (i64 h = 0; h < heads; h++) {
            const float *v = x + t * ldx + h * dim;
            float *o = out + (t * heads + h) * dim;
            for (i64 i = 0; i < half; i++) {
                float x1 = v[i], x2 = v[i + half];
                o[i] = x1 * c[i] + -x2 * s[i];
                o[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/* out [rows, inter] = silu(gate) * up, gate_up [rows, 2 * inter] (gate columns, then up). */
void silu_mul_rows(const float *gate_up, float *out, i64 rows, i64 inter) {
    for (i64 r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        i64 i = 0;
        for (; i + 8 <= inter; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
        for (; i < inter; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

static float dot(const float *a, const float *b, i64 n) {
    __m256 acc = _mm256_setzero_ps();
    i64 i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float sum = hsum8(acc);
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* q . k_j for 8 keys at once (dim a multiple of 8): the 8 partial-sum vectors reduced together. */
static __m256 dot8(const float *q, const float *const k[8], i64 dim) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (i64 i = 0; i < dim; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + i), a[j]);
    }
    __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}

/* Attention of single query rows over a paged cache, each row as one decoding sequence's token: row r attends
 * to its sequence's positions [max(0, len_r - window), len_r) (window 0: all), the key of position t in slot
 * table_r[t / block_size] * block_size + t % block_size of k_cache [slots, hkv, dim]; the hq / hkv query heads
 * of a kv head together, so each key and value is read once. q [rows, hq, dim] (row stride ldq), out [rows, hq, dim]; tables [rows, table_stride] (a stride of 0: one table for every
 * row, a draft's verification rows). A row's arithmetic is the same whatever the other rows (speculation exact). */
void decode_attention_rows(const float *q, i64 ldq, float *out, i64 rows, i64 hq, i64 hkv, i64 dim,
                           const float *k_cache, const float *v_cache, i64 block_size, const int64_t *tables,
                           i64 table_stride, const int64_t *lens, i64 window, float scale, i64 max_len, int threads) {
    i64 group = hq / hkv;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc((size_t)(group * max_len) * sizeof(float));
#pragma omp for schedule(static)
        for (i64 job = 0; job < rows * hkv; job++) {
            i64 r = job / hkv, kv = job % hkv;
            const int64_t *table = tables + r * table_stride;
            i64 len = lens[r], start = window > 0 && len > window ? len - window : 0, n = len - start;
            const float *qr = q + r * ldq + kv * group * dim;
            float *o = out + (r * hq + kv * group) * dim;
            i64 t = 0;
            if (dim % 8 == 0)  /* 8 keys at a time, each read once for the query heads that share it */
                for (; t + 8 <= n; t += 8) {
                    const float *k[8];
                    for (int j = 0; j < 8; j++) {
                        i64 pos = start + t + j;
                        k[j] = k_cache + ((table[pos / block_size] * block_size + pos % block_size) * hkv + kv) * dim;
                    }
                    for (i64 g = 0; g < group; g++)
                        _mm256_storeu_ps(scores + g * max_len + t,
                                         _mm256_mul_ps(dot8(qr + g * dim, k, dim), _mm256_set1_ps(scale)));
                }
            for (; t < n; t++) {
                i64 pos = start + t, slot = table[pos / block_size] * block_size + pos % block_size;
                const float *k = k_cache + (slot * hkv + kv) * dim;
                for (i64 g = 0; g < group; g++) scores[g * max_len + t] = dot(qr + g * dim, k, dim) * scale;
            }
            for (i64 g = 0; g < group; g++) {
                float *sc = scores + g * max_len, top = -INFINITY;
                for (t = 0; t < n; t++) top = sc[t] > top ? sc[t] : top;
                t = 0;
                __m256 sum = _mm256_setzero_ps();
                for (; t + 8 <= n; t += 8) {
                    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), _mm256_set1_ps(top)));
                    _mm256_storeu_ps(sc + t, e);
                    sum = _mm256_add_ps(sum, e);
                }
                float total = hsum8(sum);
                for (; t < n; t++) total += sc[t] = expf(sc[t] - top);
                for (t = 0; t < n; t++) sc[t] /= total;
                for (i64 i = 0; i < dim; i++) o[g * dim + i] = 0.0f;
            }
            for (i64 t = 0; t < n; t++) {
                i64 pos = start + t, slot = table[pos / block_size] * block_size + pos % block_size;
                const float *v = v_cache + (slot * hkv + kv) * dim;
                for (i64 g = 0; g < group; g++) {
                    float p = scores[g * max_len + t], *og = o + g * dim;
                    for (i64 i = 0; i < dim; i++) og[i] += p * v[i];
                }
            }
        }
        free(scores);
    }
}
