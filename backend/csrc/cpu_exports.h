/* Every entry point of the CPU kernels, and every struct they exchange: what Python binds with ctypes
 * (backend/kernels/native.py; the structs mirrored in models/cpu_decoder.py and quant/experts.py, their layouts
 * tested through struct_layouts) and what one kernel file calls in another. Each kernel file includes it, so its
 * definitions are checked against these declarations. qmm (cpu_dispatch.c) is the one entry to the quantized
 * matmuls; it alone knows the kernels behind it. */
#pragma once
#include "cpu_common.h"

struct Weight; /* a packed weight as the quantized kernels read it (cpu_kernel.h) */

/* A stack of experts' matrices [E, rows, cols] in our packed layout: expert e's codes, scales and offsets lie e
 * strides (bytes) after the first's. */
typedef struct {
    const uint8_t *codes;
    const uint8_t *scales, *offsets; /* offsets may be NULL */
    i64 codes_stride, params_stride, rows, cols, group, bits, scale_kind;
    i64 order; /* cpu_layout.ORDERS: 0 the fp32 kernel's panels, 2 quads (8-bit activations), 3 quads (x in three
                * 8-bit digits: cpu_int8_rows.c); one for all three */
} ExpertStack;

/* the code rows the 8-bit kernel takes a row of x in for codes in `order` (cpu_layout.ORDERS): 1 for quads, 3 for
 * digits, 0 where the order is not quad order */
static inline int quad_digits(i64 order) { return order == 2 ? 1 : order == 3 ? 3 : 0; }

/* x's rows quantized (cpu_int8_rows.c): `digits` code rows of K for each row of x (xq [M * digits][K]), per row and
 * group d and d * sum of x as taken, and per code row and group the bias its integer sum starts at */
typedef struct {
    int8_t *q;
    float *d, *dsum;
    int32_t *bias;
    i64 K, groups, digits;
} Rows;

typedef struct {
    const uint8_t *codes;
    const void *scales, *offsets;
    i64 rows, cols, group, bits, scale_kind, order; /* as qmm's */
} QuantMatrix;

/* A fused layer's weight: its row blocks (q|k|v, gate|up) in their own formats, stacked. */
typedef struct {
    QuantMatrix parts[3];
    i64 count, rows;
    const float *bias; /* or NULL */
} Linear;

/* A MoE layer's feed-forward: router [experts, hidden] fp32 and the experts' stacks; a shared expert (a dense
 * feed-forward of shared_inter) where shared_inter is not 0: weighted by sigmoid(x . shared_gate) where shared_gate
 * is not NULL (Qwen2-MoE), else added as it is (Granite-MoE); gpt-oss's router bias, experts' biases and clamped
 * SwiGLU (limit > 0) as moe_tokens_biased takes them */
typedef struct {
    const float *router; /* NULL: a dense layer (gate_up and down) */
    i64 experts, top_k, renormalize;
    ExpertStack gate, up, down;
    const float *shared_gate;
    Linear shared_gate_up, shared_down;
    i64 shared_inter;
    const float *router_bias, *bias_gate_up, *bias_down; /* NULL where the model has none */
    float alpha, limit;
} Experts;

/* Multi-head latent attention's weights (models/mla.py, kernels/mla_attention.py): q through q_a, its norm and q
 * (q_a.count 0: q in one projection), kv_a's latent (normed) and shared rotary key, kv_b's halves per head as
 * mla_decode_rows reads them (int8 with scales, or fp32 where the scales are NULL), their heads uk_hs and uv_hs
 * elements apart */
typedef struct {
    Linear q_a, q, kv_a;
    const float *q_a_norm, *kv_a_norm;
    const void *w_uk, *w_uv;
    const float *uk_scales, *uv_scales;
    i64 uk_hs, uv_hs, lora, nope, rope, v;
    i64 interleaved; /* 1: the rotary parts' dimensions in adjacent pairs, gathered into halves before rotating */
    float eps;       /* the latent norms' */
} Latent;

/* A Gated DeltaNet layer (cpu_deltanet.c): its convolution's weights [conv_dim, kernel], dt_bias and A_log [hv],
 * its output norm's weight [dv], and the state pool's tensors (models/gated_deltanet.py's conv_state [slots,
 * conv_dim, kernel - 1] and delta_state [slots, hv, dk, dv]) */
typedef struct {
    const float *conv_weight, *dt_bias, *a_log, *norm;
    float *conv_state, *delta_state;
    i64 hk, hv, dk, dv, kernel;
    i64 grouped; /* q|k|v|z and b|a grouped by key head (Qwen3-Next's checkpoints) */
    i64 tiled;   /* value head h reads key head h % hk (llama.cpp's qwen35moe files), not h / (hv / hk) */
    float eps;   /* the output norm's */
} DeltaNet;

typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* the q/k norms: NULL where the model has none */
    Linear qkv, o, gate_up, down;
    Experts moe;
    void *k_cache, *v_cache; /* elements of Shape's kv_kind */
    i64 window;              /* sliding attention's window in tokens; 0: full attention */
    i64 rope;                /* 0: a NoPE layer, whose q and k are stored and attend as projected */
    i64 qk_norm_full;        /* 1: q_norm and k_norm span all of q and all of k (OLMoE); 0: each head (Qwen3) */
    const Latent *mla;       /* a latent attention layer's (its cache k_cache's rows); NULL: q|k|v attention */
    /* Gemma's sandwich: post_norm norms the attention's output before it joins the residual, pre_ff_norm then
     * norms the feed-forward's input and post_ff_norm its output; NULL: post_norm norms the feed-forward's input */
    const float *pre_ff_norm, *post_ff_norm;
    i64 rope_offset; /* its rotary table's cos and sin this many floats past the model's (Gemma 3's local base) */
    i64 output_gate; /* 1: q's projection holds each head's query then its gate's columns; attention's output is
                      * multiplied by sigmoid(gate) before o (Qwen3-Next, Qwen3.5) */
    const DeltaNet *linear; /* a linear-attention layer's (qkv: its q|k|v|z, o: its out_proj); NULL: attention */
    Linear ba;              /* a linear-attention layer's b|a projection */
    const float *sinks;     /* gpt-oss's learned logit a query head in its softmax's denominator; NULL: none */
} Layer;

typedef struct {
    /* inter: the widest feed-forward (dense, or a shared expert); top_k: the most of a MoE layer */
    i64 layers, hidden, heads, kv_heads, head_dim, inter, top_k, block_size;
    float eps, scale;
    const float *final_norm;
    i64 kv_kind; /* the KV cache's elements: KV_F32, KV_F16 or KV_BF16 (cpu_vectors.h) */
    float residual_scale; /* each branch's output times this before it joins the residual stream (Granite); 1 */
    i64 gelu;             /* 1: the dense feed-forward's GELU in its tanh form (Gemma); 0: SiLU */
    i64 rotary_dim;       /* the leading dimensions of each head that rotate (Phi-4-mini, Qwen3.5: partial rotary) */
    /* the widest first projection of any layer (q|k|v, q and gate|k|v, a linear layer's q|k|v|z and b|a), and the
     * widest attention output (heads * head_dim, a linear layer's value heads, its b|a) */
    i64 proj_width, attn_width;
} Shape;

/* A layout's bits TABLE_BITS + t: 4-bit codes, laid out as bits 4's, that index table t of 16 int8 values (the
 * weight: the value times its group's scale; no offsets): t 0 IQ4_NL's (IQ4_XS's too), 1 MXFP4's (cpu_kernel.h's
 * CODE_TABLES, cpu_layout.TABLES). The fp32 and 8-bit kernels read them; AMX tiles' pairs never hold them. */
#define TABLE_BITS 16
static inline int tabled(int bits) { return bits >= TABLE_BITS; }

/* --- quantized matmuls (cpu_dispatch.c chooses; cpu_kernel.c fp32 products, cpu_int8.c 8-bit activations,
 * cpu_amx*.c bf16 on AMX tiles). y [M, N] = x [M, K] @ w.T from w's codes, scales and offsets in the order
 * `order` names (cpu_layout.ORDERS); the kernels return 0 where they did not run (no memory, no tiles). */
void qmm(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
         int bits, i64 group, int scale_kind, int order, float *y, i64 ldy, int threads);
int qmm_fp32(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
             int bits, i64 group, int scale_kind, float *y, i64 ldy, int threads);
int qmm_int8(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
             int bits, i64 group, int scale_kind, int digits, float *y, i64 ldy, int threads);
int qmm_codes(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
              int bits, i64 group, int scale_kind, float *y, i64 ldy, int threads);
int qmm_bf16(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
             int bits, i64 group, int scale_kind, float *y, i64 ldy, int threads);
int amx_usable(void);
/* several parts' matmuls of one input (a fused layer's q|k|v or gate|up, or two layers'), part i into y's columns from
 * columns[i]: cpu_dispatch.c's qmm_parts, x quantized once for the parts that read it alike (cpu_int8.c's) */
void qmm_parts(const float *x, i64 M, const QuantMatrix *parts, const i64 *columns, i64 count, float *y, i64 ldy,
               int threads);
int qmm_int8_parts(const float *x, i64 M, const QuantMatrix *parts, const i64 *columns, i64 count, float *y, i64 ldy,
                   int threads);
/* the fp32 kernel's pieces for callers that run many matmuls in one parallel region (cpu_moe.c) */
extern const i64 ROWS_PER_TILE;
i64 tile_panels(i64 M);
void qmm_rows_tile(const struct Weight *w, i64 p, const float *xt, i64 M, float *y, i64 N, i64 ldy);
/* the fp32 kernel's 4-bit panels with AVX-512 (cpu_nibbles.c), for cpu_kernel.c */
void nibble_rows(const struct Weight *w, i64 p, i64 panels, const float *xt, i64 xs, i64 M, float *y, i64 N, i64 ldy);
void nibble_many_rows(const struct Weight *w, i64 p, i64 panels, const float *xt, i64 M, float *y, i64 N, i64 ldy,
                      float *decoded);
/* the 8-bit kernel's pieces (cpu_int8.c, its rows cpu_int8_rows.c), for the same callers */
void int8_quantize_row(const float *x, i64 m, i64 group, int bits, const Rows *r);
Rows int8_rows_from(const Rows *r, i64 first);
void int8_row_copy(const Rows *from, i64 m, const Rows *to, i64 n);
size_t int8_rows_bytes(i64 M, i64 K, i64 group, int digits);
Rows int8_rows_in(void *mem, i64 M, i64 K, i64 group, int digits);
int int8_panels(i64 M, int digits);
int int8_vnni(void);
void int8_panel_rows(const struct Weight *w, const Rows *x, i64 p, i64 M, int PP, float *y, i64 ldy, i64 N,
                     const uint8_t *ahead);
/* the 8-bit kernel's blocks of 16 rows on AMX tiles (cpu_amx_int8.c): panels p and p + 1, the same bits */
int int8_amx_usable(void);
void int8_amx_tile_rows(const Rows *x, i64 b, i64 group, int8_t *out);
void int8_amx_rows(const struct Weight *w, const Rows *x, const int8_t *tiled, i64 p, i64 M, float *y, i64 ldy, i64 N);
/* token rows of an embedding table in the fp32 kernel's panels or the int8 kernel's quads (order: Layout.order_code),
 * as gguf-py dequantizes them; 0: an id past it, or AMX's pairs */
int rows_of_packed(const uint8_t *codes, const void *scales, const void *offsets, i64 rows, i64 K, i64 group,
                   int bits, int scale_kind, int order, const int64_t *ids, i64 count, float *out);

/* --- MoE (cpu_moe.c; the router and the shared expert's rows cpu_moe_route.c) */
int moe_route_rows(const float *x, i64 M, const float *router, const float *bias, i64 experts, i64 H, i64 k,
                   int renormalize, int64_t *ids, float *weights, int threads);
void moe_add_shared_rows(const float *x, i64 M, const float *gate, i64 H, const float *shared, float *out);
int moe_tokens(const float *x, i64 T, const int64_t *ids, const float *weights, i64 k, i64 experts,
               const ExpertStack *gate, const ExpertStack *up, const ExpertStack *down, float *out, int threads);
int moe_tokens_biased(const float *x, i64 T, const int64_t *ids, const float *weights, i64 k, i64 experts,
                      const ExpertStack *gate, const ExpertStack *up, const ExpertStack *down,
                      const float *bias_gate_up, const float *bias_down, float alpha, float limit, float *out,
                      int threads);

/* --- small ops (cpu_ops.c) and attention (cpu_attention.c) */
void rms_norm_rows(const float *x, const float *residual, const float *weight, float *summed, float *out, i64 rows,
                   i64 cols, float eps);
void rotary_rows(const float *x, float *out, i64 tokens, i64 heads, i64 dim, i64 ldx, const float *cos,
                 const float *sin, i64 ldc);
void silu_mul_rows(const float *gate_up, float *out, i64 rows, i64 inter);
void gelu_tanh_mul_rows(const float *gate_up, float *out, i64 rows, i64 inter); /* Gemma's feed-forward */
void sigmoid_mul_rows(float *x, const float *gate, i64 rows, i64 cols, i64 ld_gate); /* Qwen3-Next's output gate */
/* cpu_delta_rule.c: the gated delta rule's recurrent update of decode rows, on the state pool in place, and of a
 * prompt run of one sequence on its state */
void delta_rule_rows(const float *q, const float *k, const float *v, const float *g, const float *beta,
                     float *states, const int64_t *slots, const uint8_t *fresh, float *out, i64 rows, i64 hk,
                     i64 hv, i64 dk, i64 dv, int threads);
void delta_rule_run(const float *q, const float *k, const float *v, const float *g, const float *beta,
                    float *state, float *out, i64 t, i64 hk, i64 hv, i64 dk, i64 dv, int threads);
/* cpu_deltanet.c: a Gated DeltaNet layer's decode rows between its projections and out_proj */
int deltanet_rows(const DeltaNet *n, const float *qkvz, i64 ld_qkvz, const float *ba, i64 ld_ba, i64 M,
                  const int64_t *slots, const uint8_t *fresh, float *out, int threads);
void kv_store(void *cache, const float *x, i64 n, int kind);
void decode_attention_rows(const float *q, i64 ldq, float *out, i64 rows, i64 hq, i64 hkv, i64 dim,
                           const void *k_cache, const void *v_cache, int kind, i64 block_size,
                           const int64_t *tables, i64 table_stride, const int64_t *lens, i64 window, float scale,
                           const float *sinks, i64 max_len, int threads);
/* cpu_chunk_attention.c: a prompt chunk's rows, causal, over its sequence's paged cache in place */
void chunk_attention(const float *q, i64 ldq, float *out, i64 rows, i64 hq, i64 hkv, i64 dim, const void *k_cache,
                     const void *v_cache, int kind, i64 block_size, const int64_t *table, i64 context_len,
                     i64 window, float scale, const float *sinks, int threads);
/* cpu_mla.c: multi-head latent attention's decode rows (W_UK, the latent attention, W_UV) */
int mla_decode_rows(const float *q_nope, i64 ld_nope, i64 hs_nope, const float *q_pe, i64 ld_pe, i64 hs_pe, i64 rows,
                    i64 heads, i64 nope, i64 rope, i64 lora, i64 v, const void *w_uk, const float *uk_scales, i64 uk_hs,
                    const void *w_uv, const float *uv_scales, i64 uv_hs, const void *cache, int kind, i64 block_size,
                    const int64_t *tables, i64 table_stride, const int64_t *lens, float scale, i64 max_len,
                    float *out, int threads);

/* --- the one-call decode step (cpu_decoder.c) */
int decode_layers(const Layer *layers, const Shape *s, float *x, i64 M, const float *cos, const float *sin, i64 ldc,
                  const int64_t *slots, const int64_t *tables, i64 table_stride, const int64_t *lens, i64 max_len,
                  const int64_t *window_slots, const int64_t *window_tables, i64 window_stride,
                  const int64_t *state_slots, const uint8_t *fresh, int threads);
void struct_layouts(int64_t *out);
