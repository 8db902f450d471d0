/* The one entry to the quantized matmuls, and the only file that knows them all: the codes' order says which
 * kernel reads them (cpu_layout.ORDERS). 0, the fp32 kernel's panels (cpu_kernel.c); 1, a bfloat16 engine's on an
 * AMX CPU (cpu_layout.pair_order): bf16 products on the tiles, fed the codes themselves up to 16 rows
 * (cpu_amx_codes.c), weights rounded to bf16 past that (cpu_amx.c); 2, an engine with 8-bit activations
 * (cpu_layout.quad_order, cpu_int8.c). Only the loader makes the pairs' order, where the tiles run. */
#include "cpu_amx.h"
#include "cpu_exports.h"

/* a kernel that did not run (no memory for its buffers) says so in y: NaN, not a result computed from garbage */
static void unrun(float *y, i64 M, i64 N, i64 ldy) {
    for (i64 r = 0; r < M; r++)
        for (i64 c = 0; c < N; c++) y[r * ldy + c] = __builtin_nanf("");
}

/* y [M, N] = x [M, K] @ w.T, y's rows ldy apart (a part of a fused layer's output writes its own columns) */
void qmm(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
         int bits, i64 group, int scale_kind, int order, float *y, i64 ldy, int threads) {
    int ran = 0;
    if (order == 0) ran = qmm_fp32(x, M, codes, scales, offsets, N, K, bits, group, scale_kind, y, ldy, threads);
    else if (quad_digits(order)) /* quads, x in one 8-bit digit or three */
        ran = qmm_int8(x, M, codes, scales, offsets, N, K, bits, group, scale_kind, quad_digits(order), y, ldy,
                       threads);
#if HAVE_AMX
    else if (tabled(bits)) ran = 0; /* the pairs' codes are never a table's (cpu_layout.pair_order) */
    else if (M <= 16) ran = qmm_codes(x, M, codes, scales, offsets, N, K, bits, group, scale_kind, y, ldy, threads);
    else ran = qmm_bf16(x, M, codes, scales, offsets, N, K, bits, group, scale_kind, y, ldy, threads);
#endif
    if (!ran) unrun(y, M, N, ldy);
}

/* y [M, ..] = x [M, K] @ w.T for each of `count` parts (a fused layer's q|k|v or gate|up, each in its own format; or
 * several layers' weights of one input), part i into y's columns from columns[i], rows ldy apart: each part's
 * columns are the bits qmm gives it. In quad order x is quantized once for the parts that read it alike
 * (cpu_int8.c); in the other orders each part is a qmm of its own. */
void qmm_parts(const float *x, i64 M, const QuantMatrix *parts, const i64 *columns, i64 count, float *y, i64 ldy,
               int threads) {
    int quads = count > 0 && quad_digits(parts[0].order);
    for (i64 i = 1; i < count; i++) quads = quads && parts[i].order == parts[0].order;
    if (quads && qmm_int8_parts(x, M, parts, columns, count, y, ldy, threads)) return;
    for (i64 i = 0; i < count; i++) {
        const QuantMatrix *p = parts + i;
        if (quads) unrun(y + columns[i], M, p->rows, ldy);
        else qmm(x, M, p->codes, p->scales, p->offsets, p->rows, p->cols, (int)p->bits, p->group, (int)p->scale_kind,
                 (int)p->order, y + columns[i], ldy, threads);
    }
}
