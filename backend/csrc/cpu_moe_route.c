/* A MoE layer's router and Qwen2-MoE's gated shared expert, row by row (the one-call decode step's, cpu_decoder.c,
 * and the modules' on the CPU, moe_torch.py's route_rows and add_shared): each row's bits whatever the rows beside
 * it, so a decode step and a prompt choose the same experts for the same row. */
#include "cpu_exports.h"
#include "cpu_kernel.h"

/* a . b over n floats in a fixed order (lanes, then their sum, then the tail): a row's, whatever rows beside it */
static float dot_row(const float *a, const float *b, i64 n) {
    V acc = vzero();
    i64 c = 0;
    for (; c + LANES <= n; c += LANES) acc = vfma(vloadu(a + c), vloadu(b + c), acc);
    float lanes[LANES], sum = 0.0f;
    vstoreu(lanes, acc);
    for (int l = 0; l < LANES; l++) sum += lanes[l];
    for (; c < n; c++) sum += a[c] * b[c];
    return sum;
}

/* The router of M rows x [M, H]: for each row, the k experts with the largest softmax probabilities of its logits
 * (router [experts, H] fp32, each logit a dot_row, plus the router's bias where it has one: gpt-oss's), the largest
 * first (the lower id on a tie), with those probabilities as weights, renormalised to sum to one where asked
 * (Qwen3-MoE's norm_topk_prob; Mixtral's and gpt-oss's softmax over the top k logits is the same numbers).
 * Returns 1; 0 where memory ran out. */
int moe_route_rows(const float *x, i64 M, const float *router, const float *bias, i64 experts, i64 H, i64 k,
                   int renormalize, int64_t *ids, float *weights, int threads) {
    float *logits = malloc((size_t)(M * experts) * sizeof(float));
    if (!logits) return 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (M * experts * H >= (1 << 18))
    for (i64 j = 0; j < M * experts; j++) {
        logits[j] = dot_row(x + j / experts * H, router + j % experts * H, H);
        if (bias) logits[j] = logits[j] + bias[j % experts];
    }
    for (i64 r = 0; r < M; r++) {
        float *p = logits + r * experts, most = p[0], total = 0.0f, kept = 0.0f;
        for (i64 e = 1; e < experts; e++) most = p[e] > most ? p[e] : most;
        for (i64 e = 0; e < experts; e++) total += p[e] = expf(p[e] - most);
        for (i64 e = 0; e < experts; e++) p[e] /= total;
        for (i64 j = 0; j < k; j++) {
            i64 best = -1;
            for (i64 e = 0; e < experts; e++)
                if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
            for (i64 e = 0; best < 0 && e < experts; e++) /* NaN logits (x held a NaN): any expert not yet chosen */
                if (p[e] != -1.0f) best = e;
            ids[r * k + j] = best;
            weights[r * k + j] = p[best];
            kept += p[best];
            p[best] = -1.0f; /* chosen */
        }
        for (i64 j = 0; renormalize && j < k; j++) weights[r * k + j] /= kept;
    }
    free(logits);
    return 1;
}

/* out [M, H] += sigmoid(x . gate) * shared, row by row: Qwen2-MoE's shared expert beside the routed ones (gate
 * [H] fp32) */
void moe_add_shared_rows(const float *x, i64 M, const float *gate, i64 H, const float *shared, float *out) {
    for (i64 r = 0; r < M; r++) {
        const float s = 1.0f / (1.0f + expf(-dot_row(x + r * H, gate, H)));
        for (i64 c = 0; c < H; c++) out[r * H + c] = out[r * H + c] + s * shared[r * H + c];
    }
}
