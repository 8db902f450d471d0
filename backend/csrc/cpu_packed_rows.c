/* An embedding table's token rows read from the quantized kernels' packed weights (cpu_kernel.c's panels, cpu_int8.c's
 * quads) as gguf-py dequantizes them: one C call for a lookup, not the torch ops of dequantize. */
#include "cpu_exports.h"
#include "cpu_kernel.h"

/* q of row j of a panel at k: in the panels layout (order 0) or cpu_int8.c's quad order (order 2 or 3; bits 7
 * are bytes as 8's are; a table's codes are looked up) */
INLINE int code_at(const uint8_t *c, i64 k, i64 j, int bits, int order) {
    if (order == 0)
        return bits == 4 ? (c[k * PANEL * 4 / 8 + j % 8] >> (4 * (j / 8))) & 15 : ((const int8_t *)c)[k * PANEL + j];
    if (bits == 4) /* 64 bytes per 8 k's: byte 4j + i holds k = 8u + i low, 8u + 4 + i high */
        return (c[(k / 8) * 64 + 4 * j + k % 4] >> (4 * ((k % 8) / 4))) & 15;
    if (bits == 6) { /* 192 bytes per 16 k's: two 4-bit units, then the high 2 bits, k + 4 * quarter + i */
        const uint8_t *b = c + (k / 16) * 192;
        const i64 r = k % 16;
        const int low = (b[(r / 8) * 64 + 4 * j + r % 4] >> (4 * ((r % 8) / 4))) & 15;
        return (low | ((b[128 + 4 * j + r % 4] >> (2 * (r / 4))) & 3) << 4) - 32;
    }
    return (int)c[(k / 4) * 64 + 4 * j + k % 4] - 128; /* 64 bytes per 4 k's, q + 128 */
}

/* Rows ids [n] of a [rows, K] weight in the panels layout or the quad order as fp32 out [n, K]: q * scale + offset,
 * gguf-py's dequantized values bit for bit (q * scale is exact), for an embedding table's lookup. Returns 1; 0 for
 * an id outside [0, rows) or an order it does not read (AMX's pairs). */
int rows_of_packed(const uint8_t *codes, const void *scales, const void *offsets, i64 rows, i64 K, i64 group,
                   int bits, int scale_kind, int order, const int64_t *ids, i64 n, float *out) {
    if (order != 0 && !quad_digits(order)) return 0;
    for (i64 i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows) return 0;
    const Weight w = weight_of(codes, scales, offsets, K, group, bits, scale_kind);
    for (i64 i = 0; i < n; i++) {
        const i64 p = ids[i] / PANEL, j = ids[i] % PANEL;
        const uint8_t *c = codes + p * w.panel_code_bytes;
        for (i64 g = 0; g < w.panel_groups; g++) {
            const i64 at = (p * w.panel_groups + g) * PANEL + j;
            const float s = param_at(scales, at, scale_kind), o = param_at(offsets, at, scale_kind);
            for (i64 k = g * group; k < (g + 1) * group; k++)
                out[i * K + k] = (float)(tabled(bits) ? CODE_TABLES[bits - TABLE_BITS][code_at(c, k, j, 4, order)]
                                                      : code_at(c, k, j, bits, order)) * s + o;
        }
    }
    return 1;
}
