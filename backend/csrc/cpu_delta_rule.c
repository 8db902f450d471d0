/* The gated delta rule (kernels/delta_rule.py) on states in place: decode rows on the state pool (each row reads and
 * writes its sequence's slot, so no state is gathered or scattered), and a prompt run of one sequence token by token
 * (the recurrent form: each value head's [dk, dv] state stays in cache through the run, where the chunked form's
 * matrix products go through memory per chunk). One job a (row, value head) or a value head. */
#include <math.h>
#include <string.h>

#include "cpu_exports.h"

/* One token on one value head's state s [dk, dv]: decay, the delta write of (v - predicted) * beta along k, and the
 * read o = s^T q; two passes over the state, the second while the first's rows are still in cache. */
static void delta_step(float *restrict s, const float *kr, const float *qr, const float *restrict vr,
                       float *restrict o, float decay, float b, i64 dk, i64 dv) {
    float predicted[dv], write[dv];
    memset(predicted, 0, sizeof predicted);
    for (i64 i = 0; i < dk; i++) {
        float *restrict row = s + i * dv;
        const float ki = kr[i];
        for (i64 j = 0; j < dv; j++) {
            row[j] *= decay;
            predicted[j] += ki * row[j];
        }
    }
    for (i64 j = 0; j < dv; j++) write[j] = (vr[j] - predicted[j]) * b;
    memset(o, 0, (size_t)dv * sizeof(float));
    for (i64 i = 0; i < dk; i++) {
        float *restrict row = s + i * dv;
        const float ki = kr[i], qi = qr[i];
        for (i64 j = 0; j < dv; j++) {
            row[j] += ki * write[j];
            o[j] += qi * row[j];
        }
    }
}

/* q, k [rows, hk, dk] (L2-normed, q scaled), v [rows, hv, dv], g (log decay) and beta [rows, hv], states
 * [slots, hv, dk, dv]; row r's state is slot slots[r], zeroed first where fresh[r]; out [rows, hv, dv]. Value head
 * h reads key head h / (hv / hk). */
void delta_rule_rows(const float *q, const float *k, const float *v, const float *g, const float *beta,
                     float *states, const int64_t *slots, const uint8_t *fresh, float *out, i64 rows, i64 hk,
                     i64 hv, i64 dk, i64 dv, int threads) {
    const i64 per = hv / hk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 job = 0; job < rows * hv; job++) {
        const i64 r = job / hv, h = job % hv;
        float *s = states + (slots[r] * hv + h) * dk * dv;
        if (fresh[r]) memset(s, 0, (size_t)(dk * dv) * sizeof(float));
        delta_step(s, k + (r * hk + h / per) * dk, q + (r * hk + h / per) * dk, v + (r * hv + h) * dv,
                   out + (r * hv + h) * dv, expf(g[r * hv + h]), beta[r * hv + h], dk, dv);
    }
}

/* A run takes a value head's state a block of columns at a time: the columns are independent (each has its own
 * prediction, write and output), and a block [dk, COLS] stays in L1 through the run. One pass over the block a token
 * does the last token's write and read, then this token's decay and prediction: delta_step's arithmetic in its
 * order, so a run's outputs and state are those of its tokens decoded one at a time, to the bit. */
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64), aligned(4))); /* 16 lanes at any alignment */
enum { LANES = 16 };
#else /* a register's 8 lanes: GCC's 16-lane vectors on AVX2 went through memory, 3.7x slower (Qwen3.5's widths) */
typedef float vec __attribute__((vector_size(32), aligned(4)));
enum { LANES = 8 };
#endif
enum { COLS = 32, VECS = COLS / LANES };

/* A run's inputs for one value head h: key and query rows hk * dk apart, v, g and beta rows hv apart (v and out
 * offset to the block's first column). */
typedef struct {
    const float *q, *k, *v, *g, *beta;
    float *out;
    i64 t, hk, hv, dk, dv, h, per;
} Run;

static inline const float *key_of(const Run *r, const float *x, i64 token) {
    return x + (token * r->hk + r->h / r->per) * r->dk;
}

/* COLS columns whose sums stay in registers. */
static void run_block(const Run *r, float *s) {
    vec predicted[VECS], write[VECS], o[VECS];
    const i64 hv = r->hv, h = r->h, dv = r->dv;
    const float *kr = key_of(r, r->k, 0);
    float decay = expf(r->g[h]);
    for (int u = 0; u < VECS; u++) predicted[u] = (vec){0};
    for (i64 i = 0; i < r->dk; i++) {
        vec *row = (vec *)(s + i * dv);
        for (int u = 0; u < VECS; u++) {
            row[u] = row[u] * decay;
            predicted[u] += kr[i] * row[u];
        }
    }
    for (i64 t = 0; t < r->t; t++) {
        const float *qr = key_of(r, r->q, t), b = r->beta[t * hv + h];
        const vec *vr = (const vec *)(r->v + (t * hv + h) * dv);
        const int last = t + 1 == r->t;
        const float *next = last ? kr : key_of(r, r->k, t + 1);
        decay = last ? 1.0f : expf(r->g[(t + 1) * hv + h]);
        for (int u = 0; u < VECS; u++) {
            write[u] = (vr[u] - predicted[u]) * b;
            o[u] = predicted[u] = (vec){0};
        }
        for (i64 i = 0; i < r->dk; i++) {
            vec *row = (vec *)(s + i * dv);
            for (int u = 0; u < VECS; u++) {
                vec x = row[u] + kr[i] * write[u];
                o[u] += qr[i] * x;
                if (!last) {
                    x = x * decay;
                    predicted[u] += next[i] * x;
                }
                row[u] = x;
            }
        }
        vec *orow = (vec *)(r->out + (t * hv + h) * dv);
        for (int u = 0; u < VECS; u++) orow[u] = o[u];
        kr = next;
    }
}

/* The last w < COLS columns, the same a column at a time. */
static void run_columns(const Run *r, float *s, i64 w) {
    float predicted[COLS], write[COLS], o[COLS];
    const i64 hv = r->hv, h = r->h, dv = r->dv;
    const float *kr = key_of(r, r->k, 0);
    float decay = expf(r->g[h]);
    for (i64 j = 0; j < w; j++) predicted[j] = 0.0f;
    for (i64 i = 0; i < r->dk; i++)
        for (i64 j = 0; j < w; j++) {
            s[i * dv + j] *= decay;
            predicted[j] += kr[i] * s[i * dv + j];
        }
    for (i64 t = 0; t < r->t; t++) {
        const float *qr = key_of(r, r->q, t), *vr = r->v + (t * hv + h) * dv, b = r->beta[t * hv + h];
        const int last = t + 1 == r->t;
        const float *next = last ? kr : key_of(r, r->k, t + 1);
        decay = last ? 1.0f : expf(r->g[(t + 1) * hv + h]);
        for (i64 j = 0; j < w; j++) {
            write[j] = (vr[j] - predicted[j]) * b;
            o[j] = predicted[j] = 0.0f;
        }
        for (i64 i = 0; i < r->dk; i++)
            for (i64 j = 0; j < w; j++) {
                float x = s[i * dv + j] + kr[i] * write[j];
                o[j] += qr[i] * x;
                if (!last) {
                    x *= decay;
                    predicted[j] += next[i] * x;
                }
                s[i * dv + j] = x;
            }
        for (i64 j = 0; j < w; j++) r->out[(t * hv + h) * dv + j] = o[j];
        kr = next;
    }
}

/* A run of t tokens of one sequence from its state [hv, dk, dv] (updated in place): the same inputs as
 * delta_rule_rows with t rows, out [t, hv, dv]. One job a value head's block of columns. */
void delta_rule_run(const float *q, const float *k, const float *v, const float *g, const float *beta,
                    float *state, float *out, i64 t, i64 hk, i64 hv, i64 dk, i64 dv, int threads) {
    const i64 blocks = (dv + COLS - 1) / COLS;
    if (t <= 0) return;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 job = 0; job < hv * blocks; job++) {
        const i64 h = job / blocks, c = (job % blocks) * COLS;
        const Run r = {q, k, v + c, g, beta, out + c, t, hk, hv, dk, dv, h, hv / hk};
        if (dv - c >= COLS)
            run_block(&r, state + h * dk * dv + c);
        else
            run_columns(&r, state + h * dk * dv + c, dv - c);
    }
}
