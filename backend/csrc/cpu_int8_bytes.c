/* The 8-bit kernel's codes laid out again for a call (cpu_int8.c): one byte a code, on 8 lanes. */
#include "cpu_int8.h"

#if defined(__AVX2__) && IL == 8
/* 8 lanes (AVX2, and AVX-VNNI's vpdpbusd): where a call has two tiles of rows or more, the codes that each tile of 3
 * or 4 rows would unpack again are written once as one byte a code in the thread's scratch (in_bytes), then
 * multiplied as such: the same integer products and group sums, so the same bits. The bytes are read from L1 or L2.
 * - A table's codes (IQ4_NL, IQ4_XS, MXFP4) as their values plus 128 (bits 7's bytes), where each tile did the
 *   nibbles' split and two byte shuffles a vector of codes. One core, 64 rows of 768 x 2048, billions of
 *   multiply-adds a second: AVX2 IQ4_XS 37.5 -> 43; AVX-VNNI IQ4_XS 58-65 -> 75, MXFP4 67-68 -> 78-83. With AVX-512's
 *   16 lanes (tiles of 8 rows, 16-lane shuffles) it gained nothing.
 * - 6-bit codes (Q6_K, the Q5's) as q + 32 (SIX_BYTES), where each tile composed a byte from two nibble units and a
 *   plane of high bits (17 vector operations for 128 codes).
 */

const Weight *in_bytes(const Weight *w, i64 p, int PP, i64 N, Weight *e) {
    static __thread void *buf;
    static __thread size_t size;
    const i64 bytes = w->K * PANEL; /* a panel's: one byte a code */
    uint8_t *out = grown(&buf, &size, (size_t)(PP * bytes));
    if (!out) return w;
    for (i64 c = 0; c < PP && (p + c) * PANEL < N; c++) {
        const uint8_t *codes = w->codes + (p + c) * w->panel_code_bytes;
        uint8_t *o = out + c * bytes;
        if (w->bits == 6) {
            for (i64 k = 0; k < w->K; k += 16, codes += 192, o += 256)
                for (i64 half = 0; half < 64; half += IL * 4) {
                    VI u[4];
                    six_bit_bytes(codes, half, u, u + 1, u + 2, u + 3);
                    for (int i = 0; i < 4; i++) memcpy(o + 64 * i + half, u + i, sizeof *u);
                }
            continue;
        }
        for (i64 k = 0; k < w->K; k += 8, codes += 64, o += 128) /* 8 k's: k + i in low nibbles, k + 4 + i high */
            for (i64 half = 0; half < 64; half += IL * 4) {
                VI v;
                memcpy(&v, codes + half, sizeof v);
                const VI lo = table_lookup(v & 0x0F0F0F0F, w->bits - TABLE_BITS, 0);
                const VI hi = table_lookup((v >> 4) & 0x0F0F0F0F, w->bits - TABLE_BITS, 0);
                memcpy(o + half, &lo, sizeof lo);
                memcpy(o + 64 + half, &hi, sizeof hi);
            }
    }
    *e = *w;
    e->codes = out, e->codes_from = p, e->bits = w->bits == 6 ? SIX_BYTES : 7, e->panel_code_bytes = bytes;
    return e;
}
#endif
