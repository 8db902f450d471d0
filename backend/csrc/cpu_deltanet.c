/* A Gated DeltaNet layer's decode rows between its projections and out_proj (models/gated_deltanet.py): each row
 * one token of its own sequence, its states in the pool's slot slots[r] (zeros first where fresh[r]). The module's
 * decode and verification rows call this, and so does the one-call step (cpu_decoder.c), so both compute the same
 * bits; a prompt run goes through the module's torch steps and the chunked or recurrent rule (cpu_delta_rule.c).
 *
 * A row: q|k|v|z and b|a as the checkpoint lays them out (grouped by key head in Qwen3-Next's: each key head's q,
 * k, its value heads' v, then their z; its value heads' b, then a), q|k|v through the depthwise causal convolution
 * (the slot's last kernel - 1 inputs, then this one) and SiLU; beta = sigmoid(b), g = -exp(A_log) softplus(a +
 * dt_bias) (softplus x past 20, as torch's); q and k L2-normed (q also by dk^-1/2); the delta rule's step
 * (delta_rule_rows); each value head's output RMS-normed, times the norm's weight and SiLU(z). */
#include "cpu_exports.h"

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* One row's inputs laid out apart: q|k|v (conv wide), z (value), b and a (hv each) */
static void ungroup(const DeltaNet *n, const float *qkvz, const float *ba, float *mixed, float *z, float *b, float *a) {
    const i64 hk = n->hk, hv = n->hv, dk = n->dk, dv = n->dv, key = hk * dk, value = hv * dv, per = hv / hk;
    if (!n->grouped) {
        memcpy(mixed, qkvz, (size_t)(2 * key + value) * sizeof(float));
        memcpy(z, qkvz + 2 * key + value, (size_t)value * sizeof(float));
        memcpy(b, ba, (size_t)hv * sizeof(float));
        memcpy(a, ba + hv, (size_t)hv * sizeof(float));
        return;
    }
    for (i64 h = 0; h < hk; h++) {
        const float *from = qkvz + h * (2 * dk + 2 * per * dv), *pair = ba + h * 2 * per;
        memcpy(mixed + h * dk, from, (size_t)dk * sizeof(float));
        memcpy(mixed + key + h * dk, from + dk, (size_t)dk * sizeof(float));
        memcpy(mixed + 2 * key + h * per * dv, from + 2 * dk, (size_t)(per * dv) * sizeof(float));
        memcpy(z + h * per * dv, from + 2 * dk + per * dv, (size_t)(per * dv) * sizeof(float));
        memcpy(b + h * per, pair, (size_t)per * sizeof(float));
        memcpy(a + h * per, pair + per, (size_t)per * sizeof(float));
    }
}

/* The convolution over the slot's state and this input, in place, the state shifted by one; then SiLU */
static void convolve(const DeltaNet *n, float *mixed, float *state, i64 conv) {
    const i64 K = n->kernel;
    for (i64 c = 0; c < conv; c++) {
        float *s = state + c * (K - 1);
        const float *w = n->conv_weight + c * K;
        float y = 0.0f;
        for (i64 j = 0; j < K - 1; j++) y = y + s[j] * w[j];
        y = y + mixed[c] * w[K - 1];
        for (i64 j = 0; j + 1 < K - 1; j++) s[j] = s[j + 1];
        if (K > 1) s[K - 2] = mixed[c];
        mixed[c] = silu(y);
    }
}

/* x [d] times 1 / sqrt(sum of squares + 1e-6) (the models' L2 norm), then times scale */
static void l2_norm(const float *x, float *out, i64 d, float scale) {
    float squares = 0.0f;
    for (i64 i = 0; i < d; i++) squares = squares + x[i] * x[i];
    const float inv = 1.0f / sqrtf(squares + 1e-6f);
    for (i64 i = 0; i < d; i++) out[i] = x[i] * inv * scale;
}

/* qkvz [M] rows ld_qkvz apart, ba rows ld_ba apart; out [M, hv * dv]. Returns 0 where memory ran out. */
int deltanet_rows(const DeltaNet *n, const float *qkvz, i64 ld_qkvz, const float *ba, i64 ld_ba, i64 M,
                  const int64_t *slots, const uint8_t *fresh, float *out, int threads) {
    const i64 hk = n->hk, hv = n->hv, dk = n->dk, dv = n->dv, K = n->kernel;
    const i64 key = hk * dk, value = hv * dv, conv = 2 * key + value;
    const i64 heads = n->tiled ? hv : hk; /* the key heads the rule reads: tiled, one copy for each value head */
    const size_t per_row = (size_t)(conv + 2 * value + 2 * heads * dk + 4 * hv);
    float *mem = malloc((size_t)M * per_row * sizeof(float));
    if (!mem) return 0;
    float *mixed = mem, *z = mixed + M * conv, *v = z + M * value, *q = v + M * value, *k = q + M * heads * dk;
    float *g = k + M * heads * dk, *beta = g + M * hv, *b = beta + M * hv, *a = b + M * hv;
    const float q_scale = 1.0f / sqrtf((float)dk);
    for (i64 r = 0; r < M; r++) {
        float *m = mixed + r * conv;
        ungroup(n, qkvz + r * ld_qkvz, ba + r * ld_ba, m, z + r * value, b + r * hv, a + r * hv);
        float *state = n->conv_state + slots[r] * conv * (K - 1);
        if (fresh[r]) memset(state, 0, (size_t)(conv * (K - 1)) * sizeof(float));
        convolve(n, m, state, conv);
        for (i64 h = 0; h < hv; h++) {
            const float x = a[r * hv + h] + n->dt_bias[h];
            beta[r * hv + h] = 1.0f / (1.0f + expf(-b[r * hv + h]));
            g[r * hv + h] = -expf(n->a_log[h]) * (x > 20.0f ? x : log1pf(expf(x)));
        }
        for (i64 h = 0; h < heads; h++) {
            const i64 from = n->tiled ? h % hk : h;
            l2_norm(m + from * dk, q + (r * heads + h) * dk, dk, q_scale);
            l2_norm(m + key + from * dk, k + (r * heads + h) * dk, dk, 1.0f);
        }
        memcpy(v + r * value, m + 2 * key, (size_t)value * sizeof(float));
    }
    float *core = mixed; /* the rule's output [M, hv, dv], over the inputs it no longer needs */
    delta_rule_rows(q, k, v, g, beta, n->delta_state, slots, fresh, core, M, heads, hv, dk, dv, threads);
    for (i64 r = 0; r < M * hv; r++) { /* a row and value head: its RMS norm, the weight, SiLU(z) */
        const float *c = core + r * dv, *zr = z + r * dv;
        float squares = 0.0f;
        for (i64 j = 0; j < dv; j++) squares = squares + c[j] * c[j];
        const float inv = 1.0f / sqrtf(squares / (float)dv + n->eps);
        for (i64 j = 0; j < dv; j++) out[r * dv + j] = n->norm[j] * (c[j] * inv) * silu(zr[j]);
    }
    free(mem);
    return 1;
}
