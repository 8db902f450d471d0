/* The small per-layer operations of a decode step on the CPU, one call each instead of PyTorch's several ops
 * (an rms_norm with its residual add was seven, ~35 us at batch 1; the rotary five). fp32, rows contiguous;
 * each has its torch reference in the .py file beside it, which the tests hold it to. Compiled with
 * -ffp-contract=off: a * b + c rounds twice, as PyTorch's separate ops do.
 */
#include "cpu_exports.h"
#include "cpu_vectors.h"

/* out = x * rsqrt(mean(x^2) + eps) * weight, row by row; with residual: x + residual first, written to summed. */
void rms_norm_rows(const float *x, const float *residual, const float *weight, float *summed, float *out, i64 rows,
                   i64 cols, float eps) {
    for (i64 r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        if (residual) {
            float *sr = summed + r * cols;
            for (i64 c = 0; c < cols; c++) sr[c] = xr[c] + residual[r * cols + c];
            xr = sr;
        }
        V8 acc = v8_set1(0.0f);
        i64 c = 0;
        for (; c + 8 <= cols; c += 8) acc = v8_fma(v8_loadu(xr + c), v8_loadu(xr + c), acc);
        float squares = hsum8(acc);
        for (; c < cols; c++) squares += xr[c] * xr[c];
        float scale = 1.0f / sqrtf(squares / (float)cols + eps);
        for (c = 0; c < cols; c++) out[r * cols + c] = xr[c] * scale * weight[c];
    }
}

/* out [tokens, heads, dim] = the "rotate half" rotary of Hugging Face checkpoints, x * cos + cat(-x2, x1) * sin,
 * of x [tokens, heads, dim] (token stride ldx, head stride dim), with cos/sin [tokens, dim] (token stride ldc). */
void rotary_rows(const float *x, float *out, i64 tokens, i64 heads, i64 dim, i64 ldx, const float *cos,
                 const float *sin, i64 ldc) {
    i64 half = dim / 2;
    for (i64 t = 0; t < tokens; t++) {
        const float *c = cos + t * ldc, *s = sin + t * ldc;
        for (i64 h = 0; h < heads; h++) {
            const float *v = x + t * ldx + h * dim;
            float *o = out + (t * heads + h) * dim;
            for (i64 i = 0; i < half; i++) {
                float x1 = v[i], x2 = v[i + half];
                o[i] = x1 * c[i] + -x2 * s[i];
                o[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/* out [rows, inter] = act(gate) * up, gate_up [rows, 2 * inter] (gate columns, then up); act is SiLU, g / (1 + e^-g),
 * or GELU in its tanh form (Gemma's gelu_pytorch_tanh): 0.5 g (1 + tanh(z)) with z = sqrt(2 / pi) (g + 0.044715 g^3)
 * is g / (1 + e^(-2z)), exp8 as SiLU's, and no cancellation where tanh(z) is near -1. The module path calls these
 * too (models/mlp.py), so the one-call step and the modules compute the same bits. */
static void gated_rows(const float *gate_up, float *out, i64 rows, i64 inter, int gelu) {
    const float cube = 0.044715f, minus_2k = -2.0f * 0.7978845608028654f; /* -2 sqrt(2 / pi) */
    for (i64 r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        i64 i = 0;
        for (; i + 8 <= inter; i += 8) {
            V8 gv = v8_loadu(g + i);
            V8 e = gelu ? exp8((gv + v8_set1(cube) * gv * gv * gv) * v8_set1(minus_2k)) : exp8(v8_set1(0.0f) - gv);
            v8_storeu(o + i, gv / (v8_set1(1.0f) + e) * v8_loadu(u + i));
        }
        for (; i < inter; i++) {
            float e = gelu ? expf((g[i] + cube * g[i] * g[i] * g[i]) * minus_2k) : expf(-g[i]);
            o[i] = g[i] / (1.0f + e) * u[i];
        }
    }
}

void silu_mul_rows(const float *gate_up, float *out, i64 rows, i64 inter) { gated_rows(gate_up, out, rows, inter, 0); }

void gelu_tanh_mul_rows(const float *gate_up, float *out, i64 rows, i64 inter) {
    gated_rows(gate_up, out, rows, inter, 1);
}

/* x [rows, cols] times sigmoid(gate) in place, gate's rows ld_gate apart (Qwen3-Next's attention output gate; the
 * module calls it too) */
void sigmoid_mul_rows(float *x, const float *gate, i64 rows, i64 cols, i64 ld_gate) {
    for (i64 r = 0; r < rows; r++)
        for (i64 c = 0; c < cols; c++)
            x[r * cols + c] = x[r * cols + c] * (1.0f / (1.0f + expf(-gate[r * ld_gate + c])));
}

/* x [n] stored as a KV cache of `kind` stores keys and values (cpu_decoder.c): its tests compare it with PyTorch's
 * rounding. */
void kv_store(void *cache, const float *x, i64 n, int kind) { store_kv_elements(cache, 0, x, n, kind); }
