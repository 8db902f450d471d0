/* A step's routed experts in one call: a decode step's few tokens, or a prompt's (in blocks of up to 256 tokens,
 * experts.py's PROMPT_TOKENS, where the stacks are in quad order): the (token, expert) pairs sorted by expert, each
 * expert's rows meet its weights in one pass (up to ROWS_X rows a chunk for the fp32 kernel's tiles, up to
 * QUAD_CHUNK for the 8-bit kernel's), the gate and up matmuls of all the experts share one parallel region, then
 * SiLU-and-multiply, the down matmuls, and the weighted sums. Calling the quantized kernel once per matmul (24
 * calls for one token of Qwen3-30B-A3B's 8 experts) streamed each expert's small matrices at 8.5 GB/s (measured:
 * 104 us for one 768 x 2048 Q4_K matrix); a prompt's per-expert loop in Python spent a sixth of its time gathering
 * tokens and scattering results.
 *
 * The arithmetic is the per-expert loop's (backend/quant/experts.py): each matmul row is the quantized kernel's
 * (whatever the rows beside it), SiLU-and-multiply is cpu_ops.c's, and a token's output sums weight * down in
 * ascending expert order, from zero. In an engine with activations="int8" the stacks are in quad order and each
 * (token, expert) pair's x, then its activations, is quantized as the 8-bit kernel quantizes a row (cpu_int8.c):
 * the same codes for a token whichever expert it meets, at a cost far below the matmuls'; an fp32 engine's stacks
 * in quad order ("digits", where the build has VNNI) take x and the activations in three 8-bit digits the same way.
 */
#include <omp.h>

#include "cpu_exports.h"
#include "cpu_kernel.h"

/* The most rows of one expert's pairs a chunk of the 8-bit kernel holds: a prompt's expert meets each of its panels
 * in one job (the panel from L1 for each tile of rows, the chunk's codes from L2: 64 rows of 2048 in three digits
 * are 384 KB) */
#define QUAD_CHUNK 64
/* a job's cost beside its rows' (the thread's split of the jobs, share) */
#define JOB_COST 2

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
 * the fp32 kernel's panels or (quads: x's code rows a row, 1 or 3) the 8-bit one's; an expert's chunks side by side
 * for each of its panels, so that a panel read from memory for one is in cache for the next. cost[j]: the work of
 * the jobs before j, for share. */
static i64 tile_jobs(const Chunk *chunks, i64 count, i64 rows, i64 parts, int quads, int amx, i64 *jobs, i64 *cost) {
    i64 n = 0;
    cost[0] = 0;
    for (i64 c0 = 0, c1; c0 < count; c0 = c1) {
        for (c1 = c0 + 1; c1 < count && chunks[c1].expert == chunks[c0].expert; c1++) {}
        for (i64 part = 0; part < parts; part++)
            for (i64 p = 0; p < (rows + PANEL - 1) / PANEL; p++)
                for (i64 c = c0; c < c1; c++) {
                    const i64 step = !quads ? tile_panels(chunks[c].rows)
                                     : amx && chunks[c].rows >= 16 ? 2 : int8_panels(chunks[c].rows, quads);
                    if (p % step) continue;
                    jobs[3 * n] = c, jobs[3 * n + 1] = part, jobs[3 * n + 2] = p;
                    cost[n + 1] = cost[n] + (chunks[c].rows + JOB_COST) * step;
                    n++;
                }
    }
    return n;
}

/* the first job j <= count whose cost before it is at least `at` */
static i64 job_at(const i64 *cost, i64 count, i64 at) {
    i64 lo = 0, hi = count;
    while (lo < hi) {
        const i64 mid = (lo + hi) / 2;
        if (cost[mid] < at) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* the calling thread's jobs [*first, *end) of `count`: one run of about an equal share of the cost (tile_jobs's),
 * each job once; a run, so that the panels a thread meets next are the next job's (fetched ahead) */
static void share(const i64 *cost, i64 count, i64 *first, i64 *end) {
    const i64 me = omp_get_thread_num(), threads = omp_get_num_threads(), total = cost[count];
    *first = job_at(cost, count, total * me / threads);
    *end = me + 1 == threads ? count : job_at(cost, count, total * (me + 1) / threads);
}

/* where job j's panels lie: jobs (chunk, part, panel) of the matrices `parts` (gate and up, or down) */
static const uint8_t *job_codes(const i64 *jobs, i64 j, const Chunk *chunks, const ExpertStack *const *parts) {
    const Weight w = expert(parts[jobs[3 * j + 1]], chunks[jobs[3 * j]].expert);
    return w.codes + jobs[3 * j + 2] * w.panel_code_bytes;
}

/* an expert's matmul tile: rows [first, first + rows) against panels from p of w, into y; ahead (8-bit tiles): the
 * panels the thread meets next (the next job's, often another expert's), fetched while it computes */
static void expert_tile(const Weight *w, int quads, int amx, const Rows *q, const float *xt, const Chunk *ch, i64 p,
                        float *y, i64 N, i64 ldy, const uint8_t *ahead) {
    if (quads) {
        Rows view = int8_rows_from(q, ch->first);
        if (amx && ch->rows >= 16) /* two panels a job (tile_jobs), on AMX tiles (cpu_amx_int8.c) */
            int8_amx_rows(w, &view, NULL, p, ch->rows, y, ldy, N);
        else
            int8_panel_rows(w, &view, p, ch->rows, int8_panels(ch->rows, (int)q->digits), y, ldy, N, ahead);
    } else {
        qmm_rows_tile(w, p, xt + ch->xt, ch->rows, y, N, ldy);
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

/* the per-pair arrays of a call, in one buffer of the calling thread kept between calls (a prompt block's are tens
 * of MB: allocated a call, each call would fault their pages in again); rows of x, then of the activations, for
 * gate, up (the same as gate's where their groups and bits agree) and down where the stacks are in quad order */
typedef struct {
    float *act, *gate_up, *y;
    Rows tg, tu, qg, qu, qd; /* tg, tu: each token's x for gate and up, once; qg, qu: a row a pair */
} Scratch;

static size_t aligned(size_t bytes) { return (bytes + 63) / 64 * 64; }

static int scratch(Scratch *s, i64 T, i64 k, i64 I, i64 H, int quads, int shared, const ExpertStack *gate,
                   const ExpertStack *up, const ExpertStack *down) {
    static __thread void *buf;
    static __thread size_t size;
    const i64 P = T * k, widest = I > H ? I : H;
    const size_t floats[3] = {aligned((size_t)(P * I) * 4), aligned((size_t)(P * 2 * I) * 4),
                              aligned((size_t)(P * widest) * 4)};
    const size_t g = quads ? aligned(int8_rows_bytes(1, H, gate->group, quads)) : 0;
    const size_t u = quads && !shared ? aligned(int8_rows_bytes(1, H, up->group, quads)) : 0;
    const size_t d = quads ? aligned(int8_rows_bytes(P, I, down->group, quads)) : 0;
    uint8_t *at = grown(&buf, &size, floats[0] + floats[1] + floats[2] + (g + u) * (T + P) + d);
    if (!at) return 0;
    s->act = (float *)at, at += floats[0];
    s->gate_up = (float *)at, at += floats[1];
    s->y = (float *)at, at += floats[2];
    if (quads) {
        s->tg = int8_rows_in(at, T, H, gate->group, quads), at += g * T;
        s->qg = int8_rows_in(at, P, H, gate->group, quads), at += g * P;
        s->tu = shared ? s->tg : int8_rows_in(at, T, H, up->group, quads), at += u * T;
        s->qu = shared ? s->qg : int8_rows_in(at, P, H, up->group, quads), at += u * P;
        s->qd = int8_rows_in(at, P, I, down->group, quads);
    }
    return 1;
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
    const int quads = quad_digits(gate->order); /* x's code rows a row, or 0: fp32 panels */
    /* one digit's chunks of 16 rows or more on AMX tiles (three digits read from x's own rows there are slower
     * than cpu_int8.c's tiles) */
    const int amx = quads == 1 && int8_amx_usable();
    const int shared = gate->group == up->group && gate->bits == up->bits;
    const i64 most_rows = quads ? QUAD_CHUNK : ROWS_X, most_jobs = 2 * P * (widest / PANEL + 1);
    i64 *start = calloc((size_t)experts + 1, sizeof(i64)), *filled = calloc((size_t)T, sizeof(i64));
    i64 *order = malloc((size_t)P * sizeof(i64)), *at = malloc((size_t)P * sizeof(i64));
    /* each job list: 3 i64 a job, then its costs (most_jobs + 1) */
    i64 *up_jobs = malloc((size_t)(4 * most_jobs + 1) * sizeof(i64));
    i64 *down_jobs = malloc((size_t)(4 * most_jobs + 1) * sizeof(i64));
    i64 *up_cost = up_jobs + 3 * most_jobs, *down_cost = down_jobs + 3 * most_jobs;
    Chunk *chunks = malloc((size_t)P * sizeof(Chunk));
    float *xt = NULL;
    Scratch s;
    i64 count = 0, used = 0;
    if (start && filled && order && at && chunks) {
        /* the pairs i = t * k + j sorted by expert, then by token: a counting sort */
        for (i64 i = 0; i < P; i++) start[ids[i] + 1]++;
        for (i64 e = 0; e < experts; e++) start[e + 1] += start[e];
        for (i64 i = 0; i < P; i++) order[start[ids[i]]++] = i; /* start[e] ends as expert e's end */
        for (i64 e = 0, first = 0; e < experts; first = start[e], e++)
            for (i64 r = first; r < start[e]; r += most_rows, count++) {
                i64 rows = start[e] - r < most_rows ? start[e] - r : most_rows;
                chunks[count] = (Chunk){e, r, rows, used};
                used += quads ? 0 : (rows == 1 ? 1 : ROWS_X) * widest;
            }
        /* at[t * k + n]: where token t's n-th pair in ascending expert order sits in the sorted order */
        for (i64 i = 0; i < P; i++) at[order[i] / k * k + filled[order[i] / k]++] = i;
        xt = malloc((size_t)(used ? used : 1) * sizeof(float));
    }
    int ok = start && filled && order && at && up_jobs && down_jobs && chunks && xt;
    ok = ok && scratch(&s, T, k, I, H, quads, shared, gate, up, down);
    if (ok) {
        const ExpertStack *gate_up_stacks[2] = {gate, up};
        const i64 n_up = tile_jobs(chunks, count, I, 2, quads, amx, up_jobs, up_cost);
        const i64 n_down = tile_jobs(chunks, count, H, 1, quads, amx, down_jobs, down_cost);
        float *act = s.act, *gate_up = s.gate_up, *y = s.y;
#pragma omp parallel num_threads(threads)
        {
            if (quads) { /* each token quantized once, then copied to its pairs' rows */
#pragma omp for schedule(static)
                for (i64 t = 0; t < T; t++) {
                    int8_quantize_row(x, t, gate->group, (int)gate->bits, &s.tg);
                    if (!shared) int8_quantize_row(x, t, up->group, (int)up->bits, &s.tu);
                }
#pragma omp for schedule(static)
                for (i64 i = 0; i < P; i++) {
                    int8_row_copy(&s.tg, order[i] / k, &s.qg, i);
                    if (!shared) int8_row_copy(&s.tu, order[i] / k, &s.qu, i);
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
            i64 first, end;
            share(up_cost, n_up, &first, &end);
            for (i64 j = first; j < end; j++) {
                const Chunk *ch = chunks + up_jobs[3 * j];
                const int part = (int)up_jobs[3 * j + 1];
                Weight w = expert(part ? up : gate, ch->expert);
                expert_tile(&w, quads, amx, part ? &s.qu : &s.qg, xt, ch, up_jobs[3 * j + 2],
                            gate_up + ch->first * 2 * I + part * I, I, 2 * I,
                            quads ? job_codes(up_jobs, j + 1 < end ? j + 1 : j, chunks, gate_up_stacks) : NULL);
            }
#pragma omp barrier
            if (quads) {
#pragma omp for schedule(static)
                for (i64 i = 0; i < P; i++) {
                    activate(gate_up + i * 2 * I, 1, I, a, ids[order[i]], act + i * I);
                    int8_quantize_row(act, i, down->group, (int)down->bits, &s.qd);
                }
            } else {
#pragma omp for schedule(static)
                for (i64 c = 0; c < count; c++) {
                    const Chunk *ch = chunks + c;
                    activate(gate_up + ch->first * 2 * I, ch->rows, I, a, ch->expert, act + ch->first * I);
                    transpose_rows(act + ch->first * I, ch->rows, I, xt + ch->xt);
                }
            }
            share(down_cost, n_down, &first, &end);
            for (i64 j = first; j < end; j++) {
                const Chunk *ch = chunks + down_jobs[3 * j];
                Weight w = expert(down, ch->expert);
                expert_tile(&w, quads, amx, &s.qd, xt, ch, down_jobs[3 * j + 2], y + ch->first * H, H, H,
                            quads ? job_codes(down_jobs, j + 1 < end ? j + 1 : j, chunks, &down) : NULL);
            }
#pragma omp barrier
#pragma omp for schedule(static)
            for (i64 t = 0; t < T; t++) {
                float *sum = out + t * H;
                for (i64 c = 0; c < H; c++) sum[c] = 0.0f;
                for (i64 n = 0; n < k; n++) { /* a row at a time, so that the sums over c are vectors */
                    const i64 i = at[t * k + n];
                    const float *row = y + i * H, weight = weights[order[i]];
                    const float *bias = a->bias_down ? a->bias_down + ids[order[i]] * H : NULL;
                    if (bias)
                        for (i64 c = 0; c < H; c++) sum[c] = sum[c] + (row[c] + bias[c]) * weight;
                    else
                        for (i64 c = 0; c < H; c++) sum[c] = sum[c] + row[c] * weight;
                }
            }
        }
    }
    free(start), free(filled), free(order), free(at), free(up_jobs), free(down_jobs), free(chunks), free(xt);
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
