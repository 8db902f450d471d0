/* The 8-bit-activation matmul's pieces (cpu_int8.c) that cpu_moe.c runs for the experts of an engine with
 * activations="int8": rows of x quantized once, then tiles of panels against them. */
#pragma once
#include "cpu_kernel.h"

/* x's rows quantized: xq [M][K], and per row and group d, d * sum xq and the bias each group's integer sum starts
 * at */
typedef struct {
    int8_t *q;
    float *d, *dsum;
    int32_t *bias;
    i64 K, groups;
} Rows;

/* row m of x [.., K] into r's row m, per group of `group` k's, for weights of `bits` */
void int8_quantize_row(const float *x, i64 m, i64 group, int bits, const Rows *r);
/* r's rows [first, first + M) as a Rows of their own */
Rows int8_rows_from(const Rows *r, i64 first);
/* panels a tile of M rows covers */
int int8_panels(i64 M);
/* y [M, N] columns [p * 16, (p + PP) * 16) = x's M rows against w's panels [p, p + PP) (w in quad order) */
void int8_panel_rows(const Weight *w, const Rows *x, i64 p, i64 M, int PP, float *y, i64 ldy, i64 N);
