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

/* A run of t tokens of one sequence from its state [hv, dk, dv] (updated in place): the same inputs as
 * delta_rule_rows with t rows, out [t, hv, dv]. */
void delta_rule_run(const float *q, const float *k, const float *v, const float *g, const float *beta,
                    float *state, float *out, i64 t, i64 hk, i64 hv, i64 dk, i64 dv, int threads) {
    const i64 per = hv / hk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (i64 h = 0; h < hv; h++) {
        float *s = state + h * dk * dv;
        for (i64 r = 0; r < t; r++)
            delta_step(s, k + (r * hk + h / per) * dk, q + (r * hk + h / per) * dk, v + (r * hv + h) * dv,
                       out + (r * hv + h) * dv, expf(g[r * hv + h]), beta[r * hv + h], dk, dv);
    }
}
