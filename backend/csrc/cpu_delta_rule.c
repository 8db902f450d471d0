/* The gated delta rule's recurrent update for decode rows (kernels/delta_rule.py, recurrent_step), on the state
 * pool in place: each row reads and writes its sequence's slot, so no state is gathered or scattered. One job a
 * (row, value head): two passes over its [dk, dv] state, the second while the first's rows are still in cache. */
#include <math.h>
#include <string.h>

#include "cpu_exports.h"

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
        float *restrict s = states + (slots[r] * hv + h) * dk * dv;
        const float *kr = k + (r * hk + h / per) * dk, *qr = q + (r * hk + h / per) * dk;
        const float *restrict vr = v + (r * hv + h) * dv;
        float *restrict o = out + (r * hv + h) * dv;
        const float decay = expf(g[r * hv + h]), b = beta[r * hv + h];
        float predicted[dv], write[dv];
        if (fresh[r]) memset(s, 0, (size_t)(dk * dv) * sizeof(float));
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
}
