/* Decode attention on the CPU: single query rows (decode steps, a draft's verification rows, short prompt chunks)
 * over the paged KV cache, in place. fp32 arithmetic over a cache of fp32, fp16 or bf16 elements (kv_cache_dtype:
 * each read as the float it holds); its torch reference is attention.decode_attention's fallback, which the tests
 * hold it to. Compiled with -ffp-contract=off like cpu_ops.c. */
#include "cpu_exports.h"
#include "cpu_vectors.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* q . the key at element `at` of the cache */
ALWAYS_INLINE float dot(const float *a, const void *cache, i64 at, i64 n, const int kind) {
    V8 acc = v8_set1(0.0f);
    i64 i = 0;
    for (; i + 8 <= n; i += 8) acc = v8_fma(v8_loadu(a + i), v8_load_kv(cache, at + i, kind), acc);
    float sum = hsum8(acc);
    for (; i < n; i++) sum += a[i] * kv_at(cache, at + i, kind);
    return sum;
}

/* q . k_j for 8 keys at once (dim a multiple of 8), for one query head or two (q2 NULL: one) sharing the keys'
 * loads: the 8 partial-sum vectors of each reduced together. */
ALWAYS_INLINE void dot8(const float *q, const float *q2, const void *k_cache, const i64 k[8], i64 dim, V8 *out,
                        V8 *out2, const int kind) {
    V8 a[8], b[8];
    for (int j = 0; j < 8; j++) a[j] = b[j] = v8_set1(0.0f);
    for (i64 i = 0; i < dim; i += 8) {
        V8 qv = v8_loadu(q + i), qv2 = q2 ? v8_loadu(q2 + i) : qv;
        for (int j = 0; j < 8; j++) {
            V8 kv = v8_load_kv(k_cache, k[j] + i, kind);
            a[j] = v8_fma(qv, kv, a[j]);
            if (q2) b[j] = v8_fma(qv2, kv, b[j]);
        }
    }
    *out = hsum8x8(a);
    if (q2) *out2 = hsum8x8(b);
}

/* o[i] = sum over t of p[t] * v_t[i] in t order from 0, the sums held in registers (a loop over o in memory
 * loads and stores every o[i] once per position); with p2 (dim 64), o2 likewise for a second query head from the
 * same value loads. */
ALWAYS_INLINE void weigh_values(const float *p, const float *p2, i64 n, const i64 *at, const void *v_cache,
                                const i64 dim, float *o, float *o2, const int kind) {
    V8 acc[16], acc2[8];
    for (i64 i = 0; i < dim / 8; i++) acc[i] = v8_set1(0.0f);
    for (i64 i = 0; i < 8; i++) acc2[i] = v8_set1(0.0f);  /* all 8 (dim 64 with p2): no warning of a maybe unset one */
    for (i64 t = 0; t < n; t++) {
        V8 pt = v8_set1(p[t]), pt2 = p2 ? v8_set1(p2[t]) : pt;
        for (i64 i = 0; i < dim / 8; i++) {
            V8 vv = v8_load_kv(v_cache, at[t] + 8 * i, kind);
            acc[i] = v8_fma(pt, vv, acc[i]);
            if (p2) acc2[i] = v8_fma(pt2, vv, acc2[i]);
        }
    }
    for (i64 i = 0; i < dim / 8; i++) v8_storeu(o + 8 * i, acc[i]);
    for (i64 i = 0; p2 && i < dim / 8; i++) v8_storeu(o2 + 8 * i, acc2[i]);
}

/* The group query heads of one kv head (q: group x dim, heads dim apart) over n positions whose keys and values
 * sit at at[0..n) in the caches. Without m: o = softmax(q k / sqrt) v, final; sinks (the group's heads', or NULL)
 * join each head's softmax as one more score that weighs no value (gpt-oss). With m: the span's part of a longer
 * context, o = sum of e^(score - m) v unnormalised, m its top score and l the sum of its e^(score - m), per head
 * (merged by merge_spans, which adds the sink). scores: group x stride floats of scratch. */
ALWAYS_INLINE void attend_span(const float *qr, i64 group, i64 dim, const void *k_cache, const void *v_cache,
                               const i64 *at, i64 n, float scale, float *scores, i64 stride, float *o, float *m,
                               float *l, const float *sinks, const int kind) {
    const char *kb = k_cache, *vb = v_cache;
    const i64 size = kv_size(kind);
    i64 t = 0;
    if (dim % 8 == 0)  /* 8 keys at a time, each loaded once for two query heads that share it */
        for (; t + 8 <= n; t += 8) {
            const i64 *k = at + t;
            /* the caches outgrow the CPU's caches past a few sequences: the next keys, and the values read
             * after the softmax, fetched while these are scored (at batch 32 and 96 positions, 8.1 -> 5.1 ms a
             * step, measured), into L2 (locality 1): into L1 each held one of the core's few L1 miss buffers until
             * its line came (SmolLM2 decode at 1,000 / 4,000 / 8,000 positions 1.22x / 1.45x / 1.51x, measured) */
            for (int j = 0; j < 8 && t + 16 + j < n; j++)
                for (i64 b = 0; b < dim * size; b += 64) __builtin_prefetch(kb + at[t + 16 + j] * size + b, 0, 1);
            for (int j = 0; j < 8; j++)
                for (i64 b = 0; b < dim * size; b += 64) __builtin_prefetch(vb + at[t + j] * size + b, 0, 1);
            for (i64 g = 0; g < group; g += 2) {
                const float *q2 = g + 1 < group ? qr + (g + 1) * dim : NULL;
                V8 s1, s2;
                dot8(qr + g * dim, q2, k_cache, k, dim, &s1, &s2, kind);
                v8_storeu(scores + g * stride + t, s1 * v8_set1(scale));
                if (q2) v8_storeu(scores + (g + 1) * stride + t, s2 * v8_set1(scale));
            }
        }
    for (; t < n; t++)
        for (i64 g = 0; g < group; g++) scores[g * stride + t] = dot(qr + g * dim, k_cache, at[t], dim, kind) * scale;
    for (i64 g = 0; g < group; g++) {
        float *sc = scores + g * stride, top = sinks ? sinks[g] : -INFINITY;
        for (t = 0; t < n; t++) top = sc[t] > top ? sc[t] : top;
        t = 0;
        V8 sum = v8_set1(0.0f);
        for (; t + 8 <= n; t += 8) {
            V8 e = exp8(v8_loadu(sc + t) - v8_set1(top));
            v8_storeu(sc + t, e);
            sum = sum + e;
        }
        float total = hsum8(sum);
        for (; t < n; t++) total += sc[t] = expf(sc[t] - top);
        if (sinks) total += expf(sinks[g] - top);
        if (m) m[g] = top, l[g] = total;
        else
            for (t = 0; t < n; t++) sc[t] /= total;
        for (i64 i = 0; i < dim; i++) o[g * dim + i] = 0.0f;
    }
    for (i64 g = 0; g < group; g++) {
        const float *p = scores + g * stride;
        if (dim == 64 && g + 1 < group) {
            weigh_values(p, p + stride, n, at, v_cache, 64, o + g * dim, o + (g + 1) * dim, kind);
            g++;
        } else if (dim == 64) {
            weigh_values(p, NULL, n, at, v_cache, 64, o + g * dim, NULL, kind);
        } else if (dim == 128) {
            weigh_values(p, NULL, n, at, v_cache, 128, o + g * dim, NULL, kind);
        } else {
            for (t = 0; t < n; t++)
                for (i64 i = 0; i < dim; i++) o[g * dim + i] += p[t] * kv_at(v_cache, at[t] + i, kind);
        }
    }
}

/* attend_span compiled for each kind of cache element */
static void attend(const float *qr, i64 group, i64 dim, const void *k_cache, const void *v_cache, const i64 *at,
                   i64 n, float scale, float *scores, i64 stride, float *o, float *m, float *l, const float *sinks,
                   int kind) {
    if (kind == KV_F16)
        attend_span(qr, group, dim, k_cache, v_cache, at, n, scale, scores, stride, o, m, l, sinks, KV_F16);
    else if (kind == KV_BF16)
        attend_span(qr, group, dim, k_cache, v_cache, at, n, scale, scores, stride, o, m, l, sinks, KV_BF16);
    else
        attend_span(qr, group, dim, k_cache, v_cache, at, n, scale, scores, stride, o, m, l, sinks, KV_F32);
}

/* One head's output from its spans' parts (attend_span with m), in span order: the parts rescaled to the top
 * score of all (the flash-decoding merge), the head's sink (-INFINITY: none) one more term of the denominator.
 * part: count parts of dim + 2 floats (o, m, l) each, stride apart. */
static void merge_spans(const float *part, i64 count, i64 stride, i64 dim, float sink, float *o) {
    float top = sink, total = 0.0f;
    for (i64 c = 0; c < count; c++) top = part[c * stride + dim] > top ? part[c * stride + dim] : top;
    for (i64 i = 0; i < dim; i++) o[i] = 0.0f;
    for (i64 c = 0; c < count; c++) {
        const float *pc = part + c * stride;
        float w = expf(pc[dim] - top);
        total += pc[dim + 1] * w;
        for (i64 i = 0; i < dim; i++) o[i] += pc[i] * w;
    }
    if (sink > -INFINITY) total += expf(sink - top);
    for (i64 i = 0; i < dim; i++) o[i] /= total;
}

/* Positions per job of a longer context: one sequence's attention then spreads over the threads (a decode step
 * of one sequence has only kv_heads jobs otherwise: 3 for SmolLM2, one of 2 threads idle a third of the time;
 * at 4,000 positions 16.5 -> 11.3 ms a step, measured). Jobs go to threads in contiguous runs (static): a
 * row's jobs stay on one thread where there are many rows (dynamic scheduling cost batch 32 a sixth). A row's
 * jobs run span by span, its kv heads within a span one after another: the heads of a position lie side by side
 * in the cache, so the lines one head's reads bring in serve the next (head by head: 1.06-1.09x at 2,000-8,000
 * positions, measured). */
#define SPAN 256

/* Attention of single query rows over a paged cache, each row as one decoding sequence's token: row r attends
 * to its sequence's positions [max(0, len_r - window), len_r) (window 0: all), the key of position t in slot
 * table_r[t / block_size] * block_size + t % block_size of k_cache [slots, hkv, dim] (elements of `kind`); the
 * hq / hkv query heads of a kv head together, so each key and value is read once. q [rows, hq, dim] (row stride
 * ldq), out [rows, hq, dim]; tables [rows, table_stride] (a stride of 0: one table for every row, a draft's
 * verification rows). A row's arithmetic is the same whatever the other rows (speculation exact): a context of
 * more than SPAN positions is cut into spans of SPAN by its own length alone, each a job, merged in order.
 * sinks [hq]: a learned logit a query head in each of its softmaxes' denominators (gpt-oss), or NULL. */
void decode_attention_rows(const float *q, i64 ldq, float *out, i64 rows, i64 hq, i64 hkv, i64 dim,
                           const void *k_cache, const void *v_cache, int kind, i64 block_size,
                           const int64_t *tables, i64 table_stride, const int64_t *lens, i64 window, float scale,
                           const float *sinks, i64 max_len, int threads) {
    const i64 group = hq / hkv, part_stride = dim + 2;
    /* jobs: row r's kv heads, each in spans[r] spans; first[r]: r's first job; parts for the split rows */
    i64 *first = malloc((size_t)(rows + 1) * sizeof(i64)), *part_at = malloc((size_t)rows * sizeof(i64));
    i64 parts = 0;
    first[0] = 0;
    for (i64 r = 0; r < rows; r++) {
        i64 len = lens[r], n = window > 0 && len > window ? window : len, spans = n > SPAN ? (n + SPAN - 1) / SPAN : 1;
        first[r + 1] = first[r] + hkv * spans;
        part_at[r] = parts;
        if (spans > 1) parts += hkv * spans * group;
    }
    float *part = parts ? malloc((size_t)(parts * part_stride) * sizeof(float)) : NULL;
#pragma omp parallel num_threads(threads)
    {
        i64 width = max_len < SPAN ? max_len : SPAN;
        float *scores = malloc((size_t)(group * max_len) * sizeof(float));
        i64 *at = malloc((size_t)max_len * sizeof(i64)); /* the job's keys' and values' offsets in the caches */
#pragma omp for schedule(static)
        for (i64 job = 0; job < first[rows]; job++) {
            i64 lo = 0, hi = rows - 1;  /* the row whose jobs hold this one */
            while (lo < hi) {
                i64 mid = (lo + hi + 1) / 2;
                if (first[mid] <= job) lo = mid;
                else hi = mid - 1;
            }
            const i64 r = lo, spans = (first[r + 1] - first[r]) / hkv, kv = (job - first[r]) % hkv,
                      span = (job - first[r]) / hkv;
            const int64_t *table = tables + r * table_stride;
            i64 len = lens[r], start = window > 0 && len > window ? len - window : 0, n = len - start;
            if (spans > 1) {
                start += span * SPAN;
                n = n - span * SPAN < SPAN ? n - span * SPAN : SPAN;
            }
            for (i64 t = 0, b = start / block_size, in = start % block_size; t < n; t++) {
                at[t] = ((table[b] * block_size + in) * hkv + kv) * dim;
                if (++in == block_size) in = 0, b++;
            }
            const float *qr = q + r * ldq + kv * group * dim;
            if (spans == 1) {
                attend(qr, group, dim, k_cache, v_cache, at, n, scale, scores, max_len,
                       out + (r * hq + kv * group) * dim, NULL, NULL, sinks ? sinks + kv * group : NULL, kind);
            } else {
                float o[group * dim], m[group], l[group];
                attend(qr, group, dim, k_cache, v_cache, at, n, scale, scores, width, o, m, l, NULL, kind);
                for (i64 g = 0; g < group; g++) {  /* part of (row, head kv * group + g, span) */
                    float *pc = part + (part_at[r] + ((kv * group + g) * spans + span)) * part_stride;
                    memcpy(pc, o + g * dim, (size_t)dim * sizeof(float));
                    pc[dim] = m[g], pc[dim + 1] = l[g];
                }
            }
        }
#pragma omp for schedule(static)
        for (i64 rh = 0; rh < rows * hq; rh++) {
            i64 r = rh / hq, h = rh % hq, spans = (first[r + 1] - first[r]) / hkv;
            if (spans > 1)
                merge_spans(part + (part_at[r] + h * spans) * part_stride, spans, part_stride, dim,
                            sinks ? sinks[h] : -INFINITY, out + rh * dim);
        }
        free(scores);
        free(at);
    }
    free(part);
    free(first);
    free(part_at);
}
