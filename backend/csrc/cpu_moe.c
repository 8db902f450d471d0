/* A few tokens' routed experts in one call (a MoE layer's decode step for a batch of up to 64 sequences): each
 * expert's tokens meet its weights in one pass, up to ROWS_X rows at a time, and the gate and up matmuls of all
 * the experts share one parallel region, then SiLU-and-multiply, the down matmuls, and the weighted sums. Calling
 * the quantized kernel once per matmul (24 calls for one token of Qwen3-30B-A3B's 8 experts) streamed each
 * expert's small matrices at 8.5 GB/s (measured: 104 us for one 768 x 2048 Q4_K matrix).
 *
 * The arithmetic is the per-expert loop's (backend/quant/experts.py): each matmul row is the quantized kernel's
 * (whatever the rows beside it), SiLU-and-multiply is cpu_ops.c's, and a token's output sums weight * down in
 * ascending expert order, from zero. In an engine with activations="int8" the stacks are in quad order and each
 * (token, expert) pair's x, then its activations, is quantized as the 8-bit kernel quantizes a row (cpu_int8.c):
 * the same codes for a token whichever expert it meets, at a cost far below the matmuls'; an fp32 engine's stacks
 * in quad order ("digits", where the build has VNNI) take x and the activations in three 8-bit digits the same way.
 */
#include "cpu_exports.h"
#include "cpu_kernel.h"

static Weight expert(const ExpertStack *s, i64 e) {
    return weight_of(s->codes + e * s->codes_stride, s->scales + e * s->params_stride,
                     s->offsets ? s->offsets + e * s->params_stride : NULL, s->cols, s->group, (int)s->bits,
                     (int)s->scale_kind);
}

/* Rows [first, first + rows) of the pairs sorted by expert, all routed to `expert`; their x (then their
 * activations) transposed at xt in the scratch */
typedef struct {
    i64 expert, first, rows, xt;
} Chunk;

/* rows of x [rows][K] laid out as qmm_rows_tile reads them: [K / 2][ROWS_X][2], or one row as it is */
static void transpose_rows(const float *x, i64 rows, i64 K, float *xt) {
    if (rows == 1) memcpy(xt, x, (size_t)K * sizeof(float));
    else transpose_tile(x, 0, rows, K, xt);
}

/* One matmul per chunk as (chunk, part, panel) jobs: `parts` matrices of `rows` (gate and up, or down), in tiles of
 * the fp32 kernel's panels or (quads: x's code rows a row, 1 or 3) the 8-bit one's */
static i64 tile_jobs(const Chunk *chunks, i64 count, i64 rows, i64 parts, int quads, i64 *jobs) {
    i64 n = 0;
    for (i64 c = 0; c < count; c++) {
        const i64 step = quads ? int8_panels(chunks[c].rows, quads) : tile_panels(chunks[c].rows);
        for (i64 part = 0; part < parts; part++)
            for (i64 p = 0; p < (rows + PANEL - 1) / PANEL; p += step, n++)
                jobs[3 * n] = c, jobs[3 * n + 1] = part, jobs[3 * n + 2] = p;
    }
    return n;
}

/* where job j's panels lie: jobs (chunk, part, panel) of the matrices `parts` (gate and up, or down) */
static const uint8_t *job_codes(const i64 *jobs, i64 j, const Chunk *chunks, const ExpertStack *const *parts) {
    const Weight w = expert(parts[jobs[3 * j + 1]], chunks[jobs[3 * j]].expert);
    return w.codes + jobs[3 * j + 2] * w.panel_code_bytes;
}

/* an expert's matmul tile: rows [first, first + rows) against panels from p of w, into y; ahead (8-bit tiles): the
 * panels the thread meets next (the next job's, often another expert's), fetched while it computes */
static void expert_tile(const Weight *w, int quads, const Rows *q, const float *xt, const Chunk *ch, i64 p,
                        float *y, i64 N, i64 ldy, const uint8_t *ahead) {
    if (quads) {
        Rows view = int8_rows_from(q, ch->first);
        int8_panel_rows(w, &view, p, ch->rows, int8_panels(ch->rows, (int)q->digits), y, ldy, N, ahead);
    } else {
        qmm_rows_tile(w, p, xt + ch->xt, ch->rows, y, N, ldy);
    }
}

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
 * (router [experts, H] fp32, each logit a dot_row), the largest first (the lower id on a tie), with those
 * probabilities as weights, renormalised to sum to one where asked (Qwen3-MoE's norm_topk_prob; Mixtral's softmax
 * over its top k logits is the same numbers). Returns 1; 0 where memory ran out. */
int moe_route_rows(const float *x, i64 M, const float *router, i64 experts, i64 H, i64 k, int renormalize,
                   int64_t *ids, float *weights, int threads) {
    float *logits = malloc((size_t)(M * experts) * sizeof(float));
    if (!logits) return 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (M * experts * H >= (1 << 18))
    for (i64 j = 0; j < M * experts; j++) logits[j] = dot_row(x + j / experts * H, router + j % experts * H, H);
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

/* gpt-oss's experts: a bias on each expert's gate|up rows [experts][2I] and down rows [experts][H], and the SwiGLU
 * clamped at `limit` with its alpha and the (up + 1) term; NULL biases and limit 0: plain silu(gate) * up */
typedef struct {
    const float *bias_gate_up, *bias_down;
    float alpha, limit;
} Activation;

/* rows of [gate | up] (I each) plus the expert's biases, then transformers' clamped SwiGLU (moe_torch.py's
 * swiglu_clamped, in its order of operations) or cpu_ops.c's silu_mul_rows */
static void activate(float *gate_up, i64 rows, i64 I, const Activation *a, i64 expert, float *act) {
    if (a->bias_gate_up)
        for (i64 r = 0; r < rows; r++)
            for (i64 j = 0; j < 2 * I; j++) gate_up[r * 2 * I + j] += a->bias_gate_up[expert * 2 * I + j];
    if (a->limit <= 0.0f) {
        silu_mul_rows(gate_up, act, rows, I);
        return;
    }
    for (i64 r = 0; r < rows; r++)
        for (i64 j = 0; j < I; j++) {
            float g = gate_up[r * 2 * I + j], u = gate_up[r * 2 * I + I + j];
            g = g > a->limit ? a->limit : g; /* NaN stays NaN, as torch's clamp keeps it */
            u = u > a->limit ? a->limit : u < -a->limit ? -a->limit : u;
            act[r * I + j] = (u + 1.0f) * (g * (1.0f / (1.0f + expf(-(g * a->alpha)))));
        }
}

/* out [T, H]: token t's sum over its k experts e = ids[t, j] (distinct), in ascending order, of weights[t, j] *
 * down_e(silu(gate_e x_t) * up_e x_t) (with `a`'s biases and clamp: (down_e(act) + bias) * weight). Returns 1; 0
 * (out untouched) where memory ran out, -1 for an id outside [0, experts). */
static int moe_run(const float *x, i64 T, const int64_t *ids, const float *weights, i64 k, i64 experts,
                   const ExpertStack *gate, const ExpertStack *up, const ExpertStack *down, const Activation *a,
                   float *out, int threads) {
    const i64 P = T * k, I = gate->rows, H = down->rows, widest = I > H ? I : H;
    for (i64 i = 0; i < P; i++)
        if (ids[i] < 0 || ids[i] >= experts) return -1;
    const size_t most_jobs = (size_t)(2 * P * (widest / PANEL + 1));
    i64 *start = calloc((size_t)experts + 1, sizeof(i64)), *filled = calloc((size_t)T, sizeof(i64));
    i64 *order = malloc((size_t)P * sizeof(i64)), *at = malloc((size_t)P * sizeof(i64));
    i64 *up_jobs = malloc(3 * most_jobs * sizeof(i64)), *down_jobs = malloc(3 * most_jobs * sizeof(i64));
    Chunk *chunks = malloc((size_t)P * sizeof(Chunk));
    float *act = malloc((size_t)(P * I) * sizeof(float)), *gate_up = malloc((size_t)(P * 2 * I) * sizeof(float));
    float *y = malloc((size_t)(P * widest) * sizeof(float)), *xt = NULL;
    /* quads: x quantized for gate and for up (one copy where their groups and bits agree), activations for down */
    const int quads = quad_digits(gate->order); /* x's code rows a row, or 0: fp32 panels */
    const int shared = gate->group == up->group && gate->bits == up->bits;
    Rows qg = {0}, qu = {0}, qd = {0};
    if (quads) {
        qg = int8_rows_alloc(P, H, gate->group, quads);
        qu = shared ? qg : int8_rows_alloc(P, H, up->group, quads);
        qd = int8_rows_alloc(P, I, down->group, quads);
    }
    i64 count = 0, used = 0;
    if (start && filled && order && at && chunks) {
        /* the pairs i = t * k + j sorted by expert, then by token: a counting sort */
        for (i64 i = 0; i < P; i++) start[ids[i] + 1]++;
        for (i64 e = 0; e < experts; e++) start[e + 1] += start[e];
        for (i64 i = 0; i < P; i++) order[start[ids[i]]++] = i; /* start[e] ends as expert e's end */
        for (i64 e = 0, first = 0; e < experts; first = start[e], e++)
            for (i64 r = first; r < start[e]; r += ROWS_X, count++) {
                i64 rows = start[e] - r < ROWS_X ? start[e] - r : ROWS_X;
                chunks[count] = (Chunk){e, r, rows, used};
                used += quads ? 0 : (rows == 1 ? 1 : ROWS_X) * widest;
            }
        /* at[t * k + n]: where token t's n-th pair in ascending expert order sits in the sorted order */
        for (i64 i = 0; i < P; i++) at[order[i] / k * k + filled[order[i] / k]++] = i;
        xt = malloc((size_t)(used ? used : 1) * sizeof(float));
    }
    int ok = start && filled && order && at && up_jobs && down_jobs && chunks && act && gate_up && y && xt;
    ok = ok && (!quads || (qg.q && qu.q && qd.q));
    if (ok) {
        const ExpertStack *gate_up_stacks[2] = {gate, up};
        const i64 n_up = tile_jobs(chunks, count, I, 2, quads, up_jobs);
        const i64 n_down = tile_jobs(chunks, count, H, 1, quads, down_jobs);
#pragma omp parallel num_threads(threads)
        {
            if (quads) {
#pragma omp for schedule(static)
                for (i64 i = 0; i < P; i++) {
                    Rows g = int8_rows_from(&qg, i), u = int8_rows_from(&qu, i);
                    int8_quantize_row(x + order[i] / k * H, 0, gate->group, (int)gate->bits, &g);
                    if (!shared) int8_quantize_row(x + order[i] / k * H, 0, up->group, (int)up->bits, &u);
                }
            } else {
#pragma omp for schedule(static)
                for (i64 c = 0; c < count; c++) {
                    float *rows = y + chunks[c].first * widest; /* the chunk's x gathered, in y as scratch */
                    for (i64 r = 0; r < chunks[c].rows; r++)
                        memcpy(rows + r * H, x + order[chunks[c].first + r] / k * H, (size_t)H * sizeof(float));
                    transpose_rows(rows, chunks[c].rows, H, xt + chunks[c].xt);
                }
            }
#pragma omp for schedule(static)
            for (i64 j = 0; j < n_up; j++) {
                const Chunk *ch = chunks + up_jobs[3 * j];
                const int part = (int)up_jobs[3 * j + 1];
                Weight w = expert(part ? up : gate, ch->expert);
                expert_tile(&w, quads, part ? &qu : &qg, xt, ch, up_jobs[3 * j + 2],
                            gate_up + ch->first * 2 * I + part * I, I, 2 * I,
                            quads ? job_codes(up_jobs, j + 1 < n_up ? j + 1 : j, chunks, gate_up_stacks) : NULL);
            }
#pragma omp for schedule(static)
            for (i64 c = 0; c < count; c++) {
                const Chunk *ch = chunks + c;
                activate(gate_up + ch->first * 2 * I, ch->rows, I, a, ch->expert, act + ch->first * I);
                if (quads) {
                    Rows d = int8_rows_from(&qd, ch->first);
                    for (i64 r = 0; r < ch->rows; r++)
                        int8_quantize_row(act + ch->first * I, r, down->group, (int)down->bits, &d);
                } else {
                    transpose_rows(act + ch->first * I, ch->rows, I, xt + ch->xt);
                }
            }
#pragma omp for schedule(static)
            for (i64 j = 0; j < n_down; j++) {
                const Chunk *ch = chunks + down_jobs[3 * j];
                Weight w = expert(down, ch->expert);
                expert_tile(&w, quads, &qd, xt, ch, down_jobs[3 * j + 2], y + ch->first * H, H, H,
                            quads ? job_codes(down_jobs, j + 1 < n_down ? j + 1 : j, chunks, &down) : NULL);
            }
#pragma omp for schedule(static)
            for (i64 t = 0; t < T; t++)
                for (i64 c = 0; c < H; c++) {
                    float sum = 0.0f;
                    for (i64 n = 0; n < k; n++) {
                        const i64 i = at[t * k + n];
                        float down_row = y[i * H + c];
                        if (a->bias_down) down_row = down_row + a->bias_down[ids[order[i]] * H + c];
                        sum = sum + down_row * weights[order[i]];
                    }
                    out[t * H + c] = sum;
                }
        }
    }
    free(start), free(filled), free(order), free(at), free(up_jobs), free(down_jobs), free(chunks);
    free(xt), free(act), free(gate_up), free(y);
    free(qg.d), free(shared ? NULL : qu.d), free(qd.d); /* each Rows' one allocation starts at d */
    return ok;
}

int moe_tokens(const float *x, i64 T, const int64_t *ids, const float *weights, i64 k, i64 experts,
               const ExpertStack *gate, const ExpertStack *up, const ExpertStack *down, float *out, int threads) {
    const Activation plain = {NULL, NULL, 0.0f, 0.0f};
    return moe_run(x, T, ids, weights, k, experts, gate, up, down, &plain, out, threads);
}

/* moe_tokens for gpt-oss's experts: biases (either may be NULL) and the clamped SwiGLU (limit > 0) */
int moe_tokens_biased(const float *x, i64 T, const int64_t *ids, const float *weights, i64 k, i64 experts,
                      const ExpertStack *gate, const ExpertStack *up, const ExpertStack *down,
                      const float *bias_gate_up, const float *bias_down, float alpha, float limit, float *out,
                      int threads) {
    const Activation a = {bias_gate_up, bias_down, alpha, limit};
    return moe_run(x, T, ids, weights, k, experts, gate, up, down, &a, out, threads);
}
