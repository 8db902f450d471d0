/* A decode step through a whole dense decoder stack in one call: the same kernels, in the same order, as the
 * model's modules call one by one (cpu_ops.c, cpu_attention.c, cpu_kernel.c), so the result is the same
 * bits; what goes is Python's work between them (module calls, tensor allocations, ctypes conversions: about 3 ms
 * of a 15 ms SmolLM2 step, measured).
 *
 * Every row attends as a decoding token at its own position (a sequence's next token, a verification run's rows,
 * a short prompt chunk's), with the keys and values of all the step's rows stored first. Layers: RMSNorm (the
 * residual added first), fused q|k|v, rotary over q and k (each head RMS-normed first where the model has q/k
 * norms: Qwen3, or all of q and of k: OLMoE; no rotary in a NoPE layer: SmolLM3), paged attention (full, or the
 * layer's own sliding window), o, RMSNorm, fused gate|up, SiLU-and-multiply, down; all weights in our quantized
 * layout (a fused layer's parts each in its own format), biases where the model has them (Qwen2's q|k|v). A MoE
 * layer (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, Granite-MoE) has, in place of gate|up and down, its router and
 * routed experts and, in Qwen2-MoE, a gated shared expert (in Granite-MoE an ungated one): the module path's calls
 * (moe_route_rows, moe_tokens, moe_add_shared_rows in cpu_moe.c), here without Python between them. Granite's residual multiplier scales
 * each branch's output before it is added; its attention multiplier is Shape's scale. A latent attention layer
 * (DeepSeek's MLA: Layer's mla) runs its projections, norms and rotary as models/mla.py does and attends through
 * mla_decode_rows (cpu_mla.c), as the module does for up to mla_attention.C_ROWS rows. Gemma 3: its (1 + w) norms
 * are weights (1 + w taken at build, as the module takes it each call), a sandwich of norms around each branch
 * (Layer's pre_ff_norm, post_ff_norm), GELU's tanh form, and its local layers' own rotary table (rope_offset); its
 * embeddings' scale is the caller's (models/cpu_decoder.py embeds the rows as the module does). Partial rotary
 * (Shape's rotary_dim below head_dim: Phi-4-mini, Qwen3.5) rotates each head's leading dimensions. Hybrid models
 * (Qwen3-Next, Qwen3.5-MoE): a linear-attention layer (Layer's linear) projects q|k|v|z and b|a in one call, runs
 * its rows through deltanet_rows (cpu_deltanet.c, the module's own decode rows) on each row's state slot, then o;
 * a gated full-attention layer (output_gate) splits each head's query from its gate and multiplies attention's
 * output by sigmoid(gate) before o. Each row is then one token of its own sequence (kernels/step_paths.py).
 * gpt-oss: attention sinks (Layer's sinks, decode_attention_rows's), q/k/v and o biases, the router's bias and the
 * experts' biases and clamped SwiGLU (Experts' router_bias .. limit: moe_tokens_biased, the module's call).
 */
#include <omp.h>

#include "cpu_exports.h"
#include "cpu_vectors.h"

/* The sizes and some offsets of the structs cpu_decoder.py and experts.py mirror with ctypes, in this order, for a
 * test to hold the two to the same layout */
void struct_layouts(int64_t *out) {
    const int64_t v[] = {sizeof(QuantMatrix), sizeof(Linear), offsetof(Linear, bias), sizeof(ExpertStack),
                         offsetof(ExpertStack, order), sizeof(Experts), offsetof(Experts, gate),
                         offsetof(Experts, shared_gate), offsetof(Experts, shared_inter), sizeof(Layer),
                         offsetof(Layer, moe), offsetof(Layer, k_cache), offsetof(Layer, window), sizeof(Shape),
                         offsetof(Shape, eps),
                         offsetof(Shape, final_norm), offsetof(Shape, kv_kind), offsetof(Layer, mla),
                         sizeof(Latent), offsetof(Latent, kv_a), offsetof(Latent, lora), offsetof(Latent, eps),
                         offsetof(Layer, pre_ff_norm), offsetof(Layer, rope_offset), offsetof(Shape, gelu),
                         sizeof(DeltaNet), offsetof(DeltaNet, hk), offsetof(DeltaNet, eps), offsetof(Layer, linear),
                         offsetof(Layer, ba), offsetof(Shape, rotary_dim), offsetof(Shape, attn_width),
                         offsetof(Experts, router_bias), offsetof(Experts, limit), offsetof(Layer, sinks)};
    memcpy(out, v, sizeof v);
}

double matmul_seconds; /* wall time in the matmuls, for bench/engine_vs_peers.py's split of a step */

/* y = x @ a.T, then x @ b.T in the columns after (b NULL: a alone), every part of both in one call (x quantized
 * once, as the module's outputs_of does for two layers of one input); each layer's bias added after, as the module
 * adds it */
static void matmul_pair(const Linear *a, const Linear *b, const float *x, i64 M, float *y, int threads) {
    double start = omp_get_wtime();
    QuantMatrix parts[6];
    i64 columns[6], n = 0, width = 0;
    for (const Linear *w = a; w; w = w == a ? b : NULL)
        for (i64 i = 0; i < w->count; width += w->parts[i].rows, i++, n++) {
            parts[n] = w->parts[i];
            columns[n] = width;
        }
    qmm_parts(x, M, parts, columns, n, y, width, threads);
    for (i64 at = 0, j = 0; j < 2; at += a->rows, j++) {
        const Linear *w = j ? b : a;
        for (i64 r = 0; w && w->bias && r < M; r++)
            for (i64 c = 0; c < w->rows; c++) y[r * width + at + c] = y[r * width + at + c] + w->bias[c];
    }
    matmul_seconds += omp_get_wtime() - start;
}

static void matmul(const Linear *w, const float *x, i64 M, float *y, int threads) {
    matmul_pair(w, NULL, x, M, y, threads);
}

/* q and k [M, heads, D] rows ld apart: the leading `rot` dimensions of each head rotated, the rest as they are
 * (the module's partial rotary: rotary_rows over those dimensions gathered, then put back); tmp [2 * M * heads *
 * rot] */
static void rotate_part(float *qk, i64 M, i64 heads, i64 D, i64 rot, i64 ld, const float *cos, const float *sin,
                        i64 ldc, float *tmp) {
    float *rotated = tmp + M * heads * rot;
    for (i64 r = 0; r < M; r++)
        for (i64 j = 0; j < heads; j++)
            memcpy(tmp + (r * heads + j) * rot, qk + r * ld + j * D, (size_t)rot * sizeof(float));
    rotary_rows(tmp, rotated, M, heads, rot, heads * rot, cos, sin, ldc);
    for (i64 r = 0; r < M; r++)
        for (i64 j = 0; j < heads; j++)
            memcpy(qk + r * ld + j * D, rotated + (r * heads + j) * rot, (size_t)rot * sizeof(float));
}

/* Granite's residual_multiplier on an attention or feed-forward output, as the module multiplies it */
static void scale_branch(float *out, i64 n, float scale) {
    if (scale != 1.0f)
        for (i64 i = 0; i < n; i++) out[i] = out[i] * scale;
}

/* A latent attention layer's rows (models/mla.py's forward, in its order and with its kernels): q, the latent
 * (normed) and the shared rotary key, q's rotary parts and that key rotated together as heads of one tensor, the
 * latent row stored, mla_decode_rows over the cache; attn [M, heads * v] out. Returns 0 where memory ran out. */
static int latent_attention(const Latent *A, const float *h, i64 M, i64 heads, void *cache, int kind, i64 block_size,
                            const int64_t *slots, const int64_t *tables, i64 table_stride, const int64_t *lens,
                            i64 max_len, float scale, const float *cos, const float *sin, i64 ldc, float *attn,
                            int threads) {
    const i64 lora = A->lora, rope = A->rope, dim = A->nope + rope, row = lora + rope, half = rope / 2;
    const i64 q_lora = A->q_a.count ? A->q_a.rows : 0;
    float *q = malloc((size_t)(M * (heads * dim + 2 * q_lora + row + lora + 2 * (heads + 1) * rope)) *
                      sizeof(float));
    if (!q) return 0;
    float *q_a = q + M * heads * dim, *q_a_normed = q_a + M * q_lora, *kv = q_a_normed + M * q_lora;
    float *latent = kv + M * row, *pe = latent + M * lora, *pe_rotated = pe + M * (heads + 1) * rope;
    if (q_lora) {
        matmul(&A->q_a, h, M, q_a, threads);
        rms_norm_rows(q_a, NULL, A->q_a_norm, NULL, q_a_normed, M, q_lora, A->eps);
        matmul(&A->q, q_a_normed, M, q, threads);
    } else {
        matmul(&A->q, h, M, q, threads);
    }
    matmul(&A->kv_a, h, M, kv, threads);
    for (i64 r = 0; r < M; r++) {
        rms_norm_rows(kv + r * row, NULL, A->kv_a_norm, NULL, latent + r * lora, 1, lora, A->eps);
        for (i64 j = 0; j <= heads; j++) { /* q's heads, then the shared key */
            const float *from = j < heads ? q + (r * heads + j) * dim + A->nope : kv + r * row + lora;
            float *to = pe + (r * (heads + 1) + j) * rope;
            for (i64 i = 0; i < half; i++) {
                to[i] = A->interleaved ? from[2 * i] : from[i];
                to[half + i] = A->interleaved ? from[2 * i + 1] : from[half + i];
            }
        }
    }
    rotary_rows(pe, pe_rotated, M, heads + 1, rope, (heads + 1) * rope, cos, sin, ldc);
    for (i64 r = 0; r < M; r++) {
        if (slots[r] < 0) continue;
        store_kv_elements(cache, slots[r] * row, latent + r * lora, lora, kind);
        store_kv_elements(cache, slots[r] * row + lora, pe_rotated + (r * (heads + 1) + heads) * rope, rope, kind);
    }
    int done = mla_decode_rows(q, heads * dim, dim, pe_rotated, (heads + 1) * rope, rope, M, heads, A->nope, rope,
                               lora, A->v, A->w_uk, A->uk_scales, A->uk_hs, A->w_uv, A->uv_scales, A->uv_hs, cache,
                               kind, block_size, tables, table_stride, lens, scale, max_len, attn, threads);
    free(q);
    return done;
}

/* x [M, hidden]: the rows' embeddings in, the final norm's output out. cos, sin: [M, head_dim] with row stride
 * ldc. slots [M]: each row's cache slot; tables [M, table_stride] and lens [M] as decode_attention_rows reads
 * them (max_len: the longest context a table can hold); window_slots and window_tables [M, window_stride]: the
 * same for sliding layers, whose cache is the sliding group's own pool (engine/cache_groups.py; the full group's
 * pointers where there is none); state_slots [M] and fresh [M]: linear-attention layers' state slot of each row, and
 * whether it starts its sequence (its states read as zeros). Returns 1; 0 where memory ran out (x is then not the
 * step's). */
int decode_layers(const Layer *layers, const Shape *s, float *x, i64 M, const float *cos, const float *sin, i64 ldc,
                   const int64_t *slots, const int64_t *tables, i64 table_stride, const int64_t *lens, i64 max_len,
                   const int64_t *window_slots, const int64_t *window_tables, i64 window_stride,
                   const int64_t *state_slots, const uint8_t *fresh, int threads) {
    static __thread float *work;
    static __thread size_t work_floats;
    const i64 H = s->hidden, D = s->head_dim, hq = s->heads, hkv = s->kv_heads;
    const i64 qkv_cols = (hq + 2 * hkv) * D, qk_cols = (hq + hkv) * D;
    const i64 proj_cols = s->proj_width > qkv_cols ? s->proj_width : qkv_cols;
    const i64 attn_cols = s->attn_width > hq * D ? s->attn_width : hq * D;
    const int kind = (int)s->kv_kind;
    size_t need = (size_t)M * (4 * H + proj_cols + qkv_cols + 3 * qk_cols + 2 * attn_cols + 3 * s->inter +
                               3 * s->top_k) + 2;
    if (work_floats < need) {
        free(work);
        work = malloc(need * sizeof(float));
        work_floats = work ? need : 0;
        if (!work) return 0;
    }
    float *residual = work, *h = residual + M * H, *out = h + M * H, *proj = out + M * H, *qkv = proj + M * proj_cols;
    float *qk = qkv + M * qkv_cols, *rot = qk + M * qk_cols, *attn = rot + 2 * M * qk_cols, *gate = attn + M * attn_cols;
    float *gate_up = gate + M * attn_cols, *act = gate_up + M * 2 * s->inter;
    float *shared = act + M * s->inter, *weights = shared + M * H;
    int64_t *ids = (int64_t *)(((uintptr_t)(weights + M * s->top_k) + 7) & ~(uintptr_t)7);
    for (i64 l = 0; l < s->layers; l++) {
        const Layer *L = layers + l;
        if (l == 0) {
            memcpy(residual, x, (size_t)(M * H) * sizeof(float));
            rms_norm_rows(x, NULL, L->input_norm, NULL, h, M, H, s->eps);
        } else {
            rms_norm_rows(out, residual, L->input_norm, residual, h, M, H, s->eps);
        }
        if (L->mla) {
            if (!latent_attention(L->mla, h, M, hq, L->k_cache, kind, s->block_size, slots, tables, table_stride, lens,
                                  max_len, s->scale, cos, sin, ldc, attn, threads))
                return 0;
        } else if (L->linear) {
            const i64 width = L->qkv.rows + L->ba.rows;
            matmul_pair(&L->qkv, &L->ba, h, M, proj, threads);
            if (!deltanet_rows(L->linear, proj, width, proj + L->qkv.rows, width, M, state_slots, fresh, attn, threads))
                return 0;
        } else {
            if (L->output_gate) { /* each head's query, then its gate: the query to q|k|v's place, the gate apart */
                matmul(&L->qkv, h, M, proj, threads);
                for (i64 r = 0; r < M; r++) {
                    const float *from = proj + r * L->qkv.rows;
                    for (i64 j = 0; j < hq; j++) {
                        memcpy(qkv + r * qkv_cols + j * D, from + 2 * j * D, (size_t)D * sizeof(float));
                        memcpy(gate + r * hq * D + j * D, from + (2 * j + 1) * D, (size_t)D * sizeof(float));
                    }
                    memcpy(qkv + r * qkv_cols + hq * D, from + 2 * hq * D, (size_t)(2 * hkv * D) * sizeof(float));
                }
            } else {
                matmul(&L->qkv, h, M, qkv, threads);
            }
            for (i64 r = 0; L->q_norm && r < M; r++) {  /* in place, a head (or all of q, of k) at a time */
                float *row = qkv + r * qkv_cols;
                const i64 q_rows = L->qk_norm_full ? 1 : hq, k_rows = L->qk_norm_full ? 1 : hkv;
                rms_norm_rows(row, NULL, L->q_norm, NULL, row, q_rows, hq * D / q_rows, s->eps);
                rms_norm_rows(row + hq * D, NULL, L->k_norm, NULL, row + hq * D, k_rows, hkv * D / k_rows, s->eps);
            }
            if (L->rope && s->rotary_dim == D) {
                rotary_rows(qkv, qk, M, hq + hkv, D, qkv_cols, cos + L->rope_offset, sin + L->rope_offset, ldc);
            } else { /* q and k as projected, packed as rotary_rows would leave them; then a partial rotary */
                for (i64 r = 0; r < M; r++)
                    memcpy(qk + r * qk_cols, qkv + r * qkv_cols, (size_t)qk_cols * sizeof(float));
                if (L->rope)
                    rotate_part(qk, M, hq + hkv, D, s->rotary_dim, qk_cols, cos + L->rope_offset,
                                sin + L->rope_offset, ldc, rot);
            }
            const int64_t *at = L->window ? window_slots : slots, *table = L->window ? window_tables : tables;
            for (i64 r = 0; r < M; r++) {
                if (at[r] < 0) continue;
                store_kv_elements(L->k_cache, at[r] * hkv * D, qk + r * qk_cols + hq * D, hkv * D, kind);
                store_kv_elements(L->v_cache, at[r] * hkv * D, qkv + r * qkv_cols + qk_cols, hkv * D, kind);
            }
            decode_attention_rows(qk, qk_cols, attn, M, hq, hkv, D, L->k_cache, L->v_cache, kind, s->block_size,
                                  table, L->window ? window_stride : table_stride, lens, L->window, s->scale,
                                  L->sinks, max_len, threads);
            if (L->output_gate) sigmoid_mul_rows(attn, gate, M, hq * D, hq * D);
        }
        matmul(&L->o, attn, M, out, threads);
        scale_branch(out, M * H, s->residual_scale);
        if (L->pre_ff_norm) { /* Gemma's sandwich: the attention's output normed, then added and normed again */
            rms_norm_rows(out, NULL, L->post_norm, NULL, out, M, H, s->eps);
            rms_norm_rows(out, residual, L->pre_ff_norm, residual, h, M, H, s->eps);
        } else {
            rms_norm_rows(out, residual, L->post_norm, residual, h, M, H, s->eps);
        }
        if (L->moe.router) {
            const Experts *E = &L->moe;
            if (!moe_route_rows(h, M, E->router, E->router_bias, E->experts, H, E->top_k, (int)E->renormalize, ids,
                                weights, threads))
                return 0;
            const int done = E->bias_gate_up || E->bias_down || E->limit > 0.0f
                ? moe_tokens_biased(h, M, ids, weights, E->top_k, E->experts, &E->gate, &E->up, &E->down,
                                    E->bias_gate_up, E->bias_down, E->alpha, E->limit, out, threads)
                : moe_tokens(h, M, ids, weights, E->top_k, E->experts, &E->gate, &E->up, &E->down, out, threads);
            if (done != 1) return 0;
            if (E->shared_inter) { /* the module's order: the routed experts' sum, then the shared expert */
                matmul(&E->shared_gate_up, h, M, gate_up, threads);
                silu_mul_rows(gate_up, act, M, E->shared_inter);
                matmul(&E->shared_down, act, M, shared, threads);
                if (E->shared_gate)
                    moe_add_shared_rows(h, M, E->shared_gate, H, shared, out);
                else
                    for (i64 i = 0; i < M * H; i++) out[i] = out[i] + shared[i];
            }
        } else {
            matmul(&L->gate_up, h, M, gate_up, threads);
            (s->gelu ? gelu_tanh_mul_rows : silu_mul_rows)(gate_up, act, M, s->inter);
            matmul(&L->down, act, M, out, threads);
        }
        if (L->post_ff_norm)  /* the sandwich's last norm, in the multiplier's place (the module's order) */
            rms_norm_rows(out, NULL, L->post_ff_norm, NULL, out, M, H, s->eps);
        else
            scale_branch(out, M * H, s->residual_scale);
    }
    rms_norm_rows(out, residual, s->final_norm, residual, x, M, H, s->eps);
    if (M > 64) {  /* a prompt's worth of rows: not kept for the decode steps that follow */
        free(work);
        work = NULL;
        work_floats = 0;
    }
    return 1;
}
