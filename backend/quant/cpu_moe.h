/* A MoE layer's routed experts on the CPU (cpu_moe.c): the router's choice and the experts' weighted sum, called
 * by the module path (backend/quant/experts.py, backend/kernels/moe.py) and by the one-call decode step
 * (backend/kernels/cpu_decoder.c) alike, so both compute the same bits. */
#pragma once
#include <stdint.h>

typedef int64_t i64;

/* A stack of experts' matrices [E, rows, cols] in our packed layout: expert e's codes, scales and offsets lie e
 * strides (bytes) after the first's. */
typedef struct {
    const uint8_t *codes;
    const uint8_t *scales, *offsets; /* offsets may be NULL */
    i64 codes_stride, params_stride, rows, cols, group, bits, f16;
    i64 order; /* cpu_layout.ORDERS: 0 the fp32 kernel's panels, 2 quads (8-bit activations); one for all three */
} ExpertStack;

int moe_route_rows(const float *x, i64 M, const float *router, i64 experts, i64 H, i64 k, int renormalize,
                   int64_t *ids, float *weights, int threads);
void moe_add_shared_rows(const float *x, i64 M, const float *gate, i64 H, const float *shared, float *out);
int moe_tokens(const float *x, i64 T, const int64_t *ids, const float *weights, i64 k, i64 experts,
               const ExpertStack *gate, const ExpertStack *up, const ExpertStack *down, float *out, int threads);
