/* A prompt chunk's attention on the CPU: the S query rows of one sequence, the last S of its context, each causal
 * at its own position, over the paged KV cache in place (no gather, no mask tensor). Flash-attention style: the
 * keys and values are read in tiles, each tile once for a block of rows and every query head of its kv head, with
 * the softmax kept online (a running top score, sum and unnormalised output per query). fp32 arithmetic over a
 * cache of fp32, fp16 or bf16 elements; its torch reference is attention.prefill_attention's fallback, which the
 * tests hold it to. Compiled with -ffp-contract=off like cpu_ops.c. */
#include "cpu_exports.h"
#include "cpu_vectors.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* keys a tile; query rows a job (times the group's heads: the queries that share each key's load) */
enum { TILE = 64, ROWS = 16 };
/* a job's keys are split only into spans of at least this many, and only while there are fewer than
 * JOBS_PER_THREAD jobs a thread (a short chunk over a long context: 8 rows of SmolLM2 are 3 jobs otherwise) */
enum { MIN_SPAN = 512, JOBS_PER_THREAD = 8 };
/* Register blocks. Scores: KEYS keys by 3 vectors of 8 queries; values: 4 queries by VALUE_VECS vectors of the
 * head dimension. AVX-512's 32 vector registers hold the larger blocks; AVX2's 16 the smaller. */
#ifdef __AVX512F__
#define KEYS 8
#define VALUE_VECS 4
#else
#define KEYS 4
#define VALUE_VECS 2
#endif

/* st[t][j] = sum over d of k_t[d] qt[d][j], for KEYS keys (rows krow[0..KEYS)) and nv vectors of 8 queries (qt: the
 * queries transposed, mp apart) */
ALWAYS_INLINE void score_keys(const float *qt, i64 mp, i64 dim, const float *const *krow, float *st, const int nv) {
    V8 acc[KEYS][3];
    for (int i = 0; i < KEYS; i++)
        for (int j = 0; j < nv; j++) acc[i][j] = v8_set1(0.0f);
    for (i64 d = 0; d < dim; d++) {
        V8 qv[3];
        for (int j = 0; j < nv; j++) qv[j] = v8_loadu(qt + d * mp + 8 * j);
        for (int i = 0; i < KEYS; i++) {
            V8 kb = v8_set1(krow[i][d]);
            for (int j = 0; j < nv; j++) acc[i][j] = v8_fma(kb, qv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < KEYS; i++)
        for (int j = 0; j < nv; j++) v8_storeu(st + i * mp + 8 * j, acc[i][j]);
}

/* o[i][d..] = o[i][d..] * corr[i] + sum over t of p[t][i] v_t[d..], for 4 queries (p: the tile's weights, mp
 * apart by key) and nv vectors of the head dimension from d */
ALWAYS_INLINE void weigh_values(const float *p, i64 mp, const float *const *vrow, i64 nt, i64 d, float *o, i64 dim,
                                const float *corr, const int nv) {
    V8 acc[4][VALUE_VECS];
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < nv; k++) acc[i][k] = v8_set1(0.0f);
    for (i64 t = 0; t < nt; t++) {
        V8 vv[VALUE_VECS];
        for (int k = 0; k < nv; k++) vv[k] = v8_loadu(vrow[t] + d + 8 * k);
        for (int i = 0; i < 4; i++) {
            V8 pb = v8_set1(p[t * mp + i]);
            for (int k = 0; k < nv; k++) acc[i][k] = v8_fma(pb, vv[k], acc[i][k]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < nv; k++) {
            float *at = o + i * dim + d + 8 * k;
            v8_storeu(at, v8_fma(v8_loadu(at), v8_set1(corr[i]), acc[i][k]));
        }
}

/* A thread's scratch, sized for the largest job */
typedef struct {
    float *qt;           /* [dim][mp]: the job's queries (times the scale), transposed, zero past the last */
    float *st;           /* [TILE][mp]: a tile's scores, then its weights */
    float *o;            /* [mp][dim]: unnormalised outputs */
    float *top, *sum, *corr, *shift; /* [mp]: running top score and sum; this tile's rescale and subtrahend */
    float *ks, *vs;      /* [TILE][dim]: a tile's keys and values as floats (fp16 / bf16 caches) */
    float *zero;         /* [dim]: the row that pads a tile to whole register blocks */
    const float **krow, **vrow; /* [TILE]: each key's and value's row */
} Scratch;

/* Where position p's row of kv head kv lies in the caches (in elements) */
static inline i64 row_at(const int64_t *table, i64 block_size, i64 hkv, i64 kv, i64 dim, i64 p) {
    return ((table[p / block_size] * block_size + p % block_size) * hkv + kv) * dim;
}

/* The job's keys [k0, k1) for queries at positions qpos[0..mp) (window 0: none), kv head kv, into s->o, s->top and
 * s->sum (set up by the caller) */
static void attend_keys(Scratch *s, i64 mp, i64 dim, const void *k_cache, const void *v_cache, const int kind,
                        i64 block_size, const int64_t *table, i64 hkv, i64 kv, const i64 *qpos, i64 window, i64 k0,
                        i64 k1) {
    const i64 size = kv_size(kind), mv = mp / 8;
    i64 first_q = qpos[0], last_q = qpos[0];
    for (i64 m = 1; m < mp; m++) {
        first_q = qpos[m] < first_q ? qpos[m] : first_q;
        last_q = qpos[m] > last_q ? qpos[m] : last_q;
    }
    for (i64 p0 = k0; p0 < k1; p0 += TILE) {
        const i64 n = k1 - p0 < TILE ? k1 - p0 : TILE, nt = (n + KEYS - 1) / KEYS * KEYS;
        for (i64 t = 0; t < n; t++) {
            const i64 at = row_at(table, block_size, hkv, kv, dim, p0 + t);
            if (kind == KV_F32) {
                s->krow[t] = (const float *)k_cache + at;
                s->vrow[t] = (const float *)v_cache + at;
            } else {
                for (i64 d = 0; d < dim; d += 8) {
                    v8_storeu(s->ks + t * dim + d, v8_load_kv(k_cache, at + d, kind));
                    v8_storeu(s->vs + t * dim + d, v8_load_kv(v_cache, at + d, kind));
                }
                s->krow[t] = s->ks + t * dim;
                s->vrow[t] = s->vs + t * dim;
            }
            /* the next tile's rows: a block table's jumps are past the hardware prefetcher */
            if (p0 + TILE + t < k1) {
                const i64 next = row_at(table, block_size, hkv, kv, dim, p0 + TILE + t) * size;
                for (i64 b = 0; b < dim * size; b += 64) {
                    __builtin_prefetch((const char *)k_cache + next + b, 0, 1);
                    __builtin_prefetch((const char *)v_cache + next + b, 0, 1);
                }
            }
        }
        for (i64 t = n; t < nt; t++) s->krow[t] = s->vrow[t] = s->zero;
        for (i64 t = 0; t < nt; t += KEYS) {
            i64 j = 0;
            for (; j + 3 <= mv; j += 3) score_keys(s->qt + 8 * j, mp, dim, s->krow + t, s->st + t * mp + 8 * j, 3);
            if (mv - j == 2) score_keys(s->qt + 8 * j, mp, dim, s->krow + t, s->st + t * mp + 8 * j, 2);
            if (mv - j == 1) score_keys(s->qt + 8 * j, mp, dim, s->krow + t, s->st + t * mp + 8 * j, 1);
        }
        /* causal (a key after some query), the window (a key before some query's reach) and the padding */
        if (p0 + n - 1 > first_q || (window > 0 && p0 <= last_q - window) || nt > n)
            for (i64 t = 0; t < nt; t++)
                for (i64 m = 0; m < mp; m++)
                    if (t >= n || p0 + t > qpos[m] || (window > 0 && p0 + t <= qpos[m] - window))
                        s->st[t * mp + m] = -INFINITY;
        for (i64 j = 0; j < mv; j++) {
            V8 best = v8_set1(-INFINITY);
            for (i64 t = 0; t < nt; t++) best = v8_max(best, v8_loadu(s->st + t * mp + 8 * j));
            float tile_top[8];
            v8_storeu(tile_top, best);
            for (i64 i = 0; i < 8; i++) {
                const i64 m = 8 * j + i;
                const float top = tile_top[i] > s->top[m] ? tile_top[i] : s->top[m];
                /* no key yet: subtract 0, so that the masked scores' e^-inf give 0 rather than e^(-inf + inf) */
                s->shift[m] = top == -INFINITY ? 0.0f : top;
                s->corr[m] = expf(s->top[m] - s->shift[m]);
                s->top[m] = top;
            }
            /* exp8 clamps -inf to its lowest input, whose power of two is 0: a masked weight is exactly 0 */
            const V8 shift = v8_loadu(s->shift + 8 * j);
            V8 total = v8_set1(0.0f);
            for (i64 t = 0; t < nt; t++) {
                V8 e = exp8(v8_loadu(s->st + t * mp + 8 * j) - shift);
                v8_storeu(s->st + t * mp + 8 * j, e);
                total = total + e;
            }
            v8_storeu(s->sum + 8 * j, v8_loadu(s->sum + 8 * j) * v8_loadu(s->corr + 8 * j) + total);
        }
        for (i64 m = 0; m < mp; m += 4) {
            i64 d = 0;
            for (; d + 8 * VALUE_VECS <= dim; d += 8 * VALUE_VECS)
                weigh_values(s->st + m, mp, s->vrow, nt, d, s->o + m * dim, dim, s->corr + m, VALUE_VECS);
            for (; d < dim; d += 8)
                weigh_values(s->st + m, mp, s->vrow, nt, d, s->o + m * dim, dim, s->corr + m, 1);
        }
    }
}

/* One query's output from its spans' parts: o (unnormalised), top and sum of span c at o + c * stride,
 * top + c * stride, sum + c * stride; the sink (-INFINITY: none) one more term of the denominator */
static void normalise(i64 count, const float *o, const float *top, const float *sum, i64 stride, i64 dim, float sink,
                      float *out) {
    float best = sink, total = 0.0f;
    for (i64 c = 0; c < count; c++) best = top[c * stride] > best ? top[c * stride] : best;
    for (i64 i = 0; i < dim; i++) out[i] = 0.0f;
    for (i64 c = 0; c < count; c++) {
        if (top[c * stride] == -INFINITY) continue; /* a span of keys that no key of this query's reached */
        const float w = expf(top[c * stride] - best);
        total += sum[c * stride] * w;
        for (i64 i = 0; i < dim; i++) out[i] += o[c * stride + i] * w;
    }
    if (sink > -INFINITY) total += expf(sink - best);
    for (i64 i = 0; i < dim; i++) out[i] /= total;
}

typedef struct {
    i64 kv, block, k0, k1; /* kv head, row block, keys [k0, k1) */
    i64 part;              /* its part's index (its span's), or -1: the job's keys are the block's all */
} Job;

/* Causal attention of a chunk of `rows` query rows of one sequence, row i at position context_len - rows + i, over
 * its paged cache: the key of position t in slot table[t / block_size] * block_size + t % block_size of k_cache
 * [slots, hkv, dim] (elements of `kind`), read in place. A row attends positions (pos - window, pos] (window 0:
 * [0, pos]), and the blocks before its first row's reach are never read. q [rows, hq, dim] (row stride ldq), out
 * [rows, hq, dim]; dim a multiple of 8. sinks [hq]: a learned logit a query head in each of its softmaxes'
 * denominators (gpt-oss), or NULL. Jobs: a kv head's block of ROWS rows, the costliest (last) blocks first; where
 * they are few, their keys split into spans merged after. */
void chunk_attention(const float *q, i64 ldq, float *out, i64 rows, i64 hq, i64 hkv, i64 dim, const void *k_cache,
                     const void *v_cache, int kind, i64 block_size, const int64_t *table, i64 context_len,
                     i64 window, float scale, const float *sinks, int threads) {
    const i64 group = hq / hkv, blocks = (rows + ROWS - 1) / ROWS, start = context_len - rows;
    const i64 per_block = ROWS * group, part_size = per_block * (dim + 2);
    const i64 wanted = (i64)JOBS_PER_THREAD * threads, split = hkv * blocks >= wanted ? 1 : (wanted + hkv * blocks - 1) / (hkv * blocks);
    i64 count = 0, parts = 0;
    i64 *spans = malloc((size_t)blocks * sizeof(i64)), *span_len = malloc((size_t)blocks * sizeof(i64)),
        *part_at = malloc((size_t)blocks * sizeof(i64));
    for (i64 b = 0; b < blocks; b++) {
        const i64 last = start + (b + 1 < blocks ? (b + 1) * ROWS : rows) - 1, first = start + b * ROWS;
        const i64 lo = window > 0 && first - window + 1 > 0 ? first - window + 1 : 0, n = last + 1 - lo;
        i64 c = n / MIN_SPAN < split ? n / MIN_SPAN : split;
        c = c < 1 ? 1 : c;
        span_len[b] = ((n + c - 1) / c + TILE - 1) / TILE * TILE;
        spans[b] = (n + span_len[b] - 1) / span_len[b];
        part_at[b] = parts;
        if (spans[b] > 1) parts += hkv * spans[b];
        count += hkv * spans[b];
    }
    Job *jobs = malloc((size_t)count * sizeof(Job));
    count = 0;
    for (i64 b = blocks - 1; b >= 0; b--) {
        const i64 last = start + (b + 1 < blocks ? (b + 1) * ROWS : rows) - 1, first = start + b * ROWS;
        const i64 lo = window > 0 && first - window + 1 > 0 ? first - window + 1 : 0;
        for (i64 kv = 0; kv < hkv; kv++)
            for (i64 c = 0; c < spans[b]; c++) {
                const i64 k0 = lo + c * span_len[b], k1 = k0 + span_len[b] < last + 1 ? k0 + span_len[b] : last + 1;
                jobs[count++] = (Job){kv, b, k0, k1, spans[b] > 1 ? part_at[b] + kv * spans[b] + c : -1};
            }
    }
    float *part = parts ? malloc((size_t)(parts * part_size) * sizeof(float)) : NULL;
    const i64 mp_max = (per_block + 7) / 8 * 8;
#pragma omp parallel num_threads(threads)
    {
        Scratch s;
        float *mem = calloc((size_t)(dim * mp_max * 2 + TILE * mp_max + 4 * mp_max + 2 * TILE * dim + dim),
                            sizeof(float));
        s.qt = mem, s.o = s.qt + dim * mp_max, s.st = s.o + mp_max * dim, s.top = s.st + TILE * mp_max;
        s.sum = s.top + mp_max, s.corr = s.sum + mp_max, s.shift = s.corr + mp_max, s.ks = s.shift + mp_max;
        s.vs = s.ks + TILE * dim, s.zero = s.vs + TILE * dim;
        s.krow = malloc(2 * TILE * sizeof(float *));
        s.vrow = s.krow + TILE;
        i64 qpos[mp_max];
#pragma omp for schedule(dynamic, 1)
        for (i64 j = 0; j < count; j++) {
            const Job job = jobs[j];
            const i64 r0 = job.block * ROWS, nr = rows - r0 < ROWS ? rows - r0 : ROWS, nq = nr * group;
            const i64 mp = (nq + 7) / 8 * 8;
            for (i64 m = 0; m < mp; m++) { /* query m: row r0 + m / group, head kv * group + m % group */
                const i64 r = m < nq ? m / group : nr - 1, g = m % group;
                qpos[m] = start + r0 + r;
                for (i64 d = 0; d < dim; d++)
                    s.qt[d * mp + m] = m < nq ? q[(r0 + r) * ldq + (job.kv * group + g) * dim + d] * scale : 0.0f;
                s.top[m] = -INFINITY, s.sum[m] = 0.0f;
            }
            memset(s.o, 0, (size_t)(mp * dim) * sizeof(float));
            attend_keys(&s, mp, dim, k_cache, v_cache, kind, block_size, table, hkv, job.kv, qpos, window, job.k0,
                        job.k1);
            for (i64 m = 0; m < nq; m++) {
                const i64 h = job.kv * group + m % group;
                if (job.part < 0) {
                    normalise(1, s.o + m * dim, s.top + m, s.sum + m, 0, dim, sinks ? sinks[h] : -INFINITY,
                              out + ((r0 + m / group) * hq + h) * dim);
                } else { /* o [per_block][dim], then top and sum [per_block] */
                    float *pc = part + job.part * part_size;
                    memcpy(pc + m * dim, s.o + m * dim, (size_t)dim * sizeof(float));
                    pc[per_block * dim + m] = s.top[m];
                    pc[per_block * (dim + 1) + m] = s.sum[m];
                }
            }
        }
#pragma omp for schedule(static)
        for (i64 i = 0; i < rows * hq; i++) {
            const i64 r = i / hq, h = i % hq, b = r / ROWS, kv = h / group, m = (r % ROWS) * group + h % group;
            if (spans[b] > 1) {
                const float *pc = part + (part_at[b] + kv * spans[b]) * part_size;
                normalise(spans[b], pc + m * dim, pc + per_block * dim + m, pc + per_block * (dim + 1) + m, part_size,
                          dim, sinks ? sinks[h] : -INFINITY, out + i * dim);
            }
        }
        free(s.krow);
        free(mem);
    }
    free(part);
    free(jobs);
    free(spans);
    free(span_len);
    free(part_at);
}
