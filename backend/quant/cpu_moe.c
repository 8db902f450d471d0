/* A token's routed experts in one call (a MoE layer's decode step at batch 1): the gate and up matmuls of all its
 * experts share one parallel region, then SiLU-and-multiply, the down matmuls, and the weighted sum, where one
 * call of the quantized kernel per matmul (24 for Qwen3-30B-A3B's 8 experts) streamed each expert's small
 * matrices at 8.5 GB/s (measured: 104 us for one 768 x 2048 Q4_K matrix).
 *
 * The arithmetic is the per-expert loop's (backend/quant/experts.py): each matmul is the quantized kernel's one-row
 * tile, SiLU-and-multiply is cpu_ops.c's, and the token's output sums weight * down in ascending expert order,
 * from zero.
 */
#include "cpu_kernel.h"

extern const i64 ROW_TILE_PANELS;
void qmm_row_tile(const Weight *w, i64 p, const float *x, float *y, i64 N, i64 ldy);
void silu_mul_rows(const float *gate_up, float *out, i64 rows, i64 inter);

/* A stack of experts' matrices [E, rows, cols] in our packed layout: expert e's codes, scales and offsets lie e
 * strides (bytes) after the first's. */
typedef struct {
    const uint8_t *codes;
    const uint8_t *scales, *offsets; /* offsets may be NULL */
    i64 codes_stride, params_stride, rows, cols, group, bits, f16;
} ExpertStack;

static Weight expert(const ExpertStack *s, i64 e) {
    return weight_of(s->codes + e * s->codes_stride, s->scales + e * s->params_stride,
                     s->offsets ? s->offsets + e * s->params_stride : NULL, s->cols, s->group, (int)s->bits,
                     (int)s->f16);
}

/* out [H] = sum over k of weights[k] * down_e(silu(gate_e x) * up_e x), e = experts[k] (ascending). */
void moe_token(const float *x, const int64_t *experts, const float *weights, i64 k, const ExpertStack *gate,
               const ExpertStack *up, const ExpertStack *down, float *out, int threads) {
    const i64 I = gate->rows, H = down->rows, per = ROW_TILE_PANELS;
    const i64 up_tiles = ((I + 15) / 16 + per - 1) / per, down_tiles = ((H + 15) / 16 + per - 1) / per;
    float *gate_up = malloc((size_t)(k * 2 * I) * sizeof(float)), *act = malloc((size_t)(k * I) * sizeof(float));
    float *y = malloc((size_t)(k * H) * sizeof(float));
    if (!gate_up || !act || !y) {  /* too small to fail in practice; the caller checks nothing, so say so loudly */
        free(gate_up), free(act), free(y);
        for (i64 c = 0; c < H; c++) out[c] = __builtin_nanf("");
        return;
    }
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (i64 j = 0; j < k * 2 * up_tiles; j++) {
            i64 pair = j / (2 * up_tiles), which = j / up_tiles % 2, t = j % up_tiles;
            Weight w = expert(which ? up : gate, experts[pair]);
            qmm_row_tile(&w, t * per, x, gate_up + pair * 2 * I + which * I, I, 2 * I);
        }
#pragma omp for schedule(static)
        for (i64 pair = 0; pair < k; pair++) silu_mul_rows(gate_up + pair * 2 * I, act + pair * I, 1, I);
#pragma omp for schedule(static)
        for (i64 j = 0; j < k * down_tiles; j++) {
            i64 pair = j / down_tiles, t = j % down_tiles;
            Weight w = expert(down, experts[pair]);
            qmm_row_tile(&w, t * per, act + pair * I, y + pair * H, H, H);
        }
#pragma omp for schedule(static)
        for (i64 c = 0; c < H; c++) {
            float sum = 0.0f;
            for (i64 pair = 0; pair < k; pair++) sum = sum + y[pair * H + c] * weights[pair];
            out[c] = sum;
        }
    }
    free(gate_up), free(act), free(y);
}
