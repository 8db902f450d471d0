/* Quantized matmul against 8-bit activations, for an engine with activations="int8" (llama.cpp's arithmetic on the
 * CPU, where it is always on), and against x in three 8-bit digits for an exact (fp32) one where this build has VNNI
 * (cpu_int8_rows.c). Each row of x is quantized per group of the weights' `group` k's (16 or 32) with one fp32 scale,
 * d = max |x| / 127 and xq = round(x * 127 / max |x|) (to nearest even), and y = (xq d) @ w.T: per group
 *
 *   y += float(sum q xq) * (s * d) + o * (d * float(sum xq))      (the sums in int32, exact)
 *
 * With digits c0, c1, c2 in place of xq (x = d (c0 + c1 / 256 + c2 / 65536) to 24 bits), each digit's integer sum
 * is taken in a row of its own and float(sum q xq) is (float(sum q c2) / 256 + float(sum q c1)) / 256 + float(sum q
 * c0): three times one digit's integer work, and at one row under half the instructions of fp32 products (for
 * 128 4-bit weights, a load, three to split the nibbles and six vpdpbusd, against cpu_nibbles.c's twenty-odd).
 *
 * with s and o the weights' scale and offset (cpu_kernel.c's layout and values). The integer sums are exact and a
 * row's float steps are fixed, so its bits do not depend on the rows beside it: a sequence decodes the same alone,
 * in a batch, or as a verification row at any draft length. Every build (AVX-512 or portable) does the same float
 * operations in the same order, so gives the same bits.
 *
 * Codes in quad order (cpu_layout.quad_order): per panel of 16 weight rows, 64 bytes for each 4 k's (8-bit: byte
 * 4r + i is row r's q at k + i, plus 128; "bits 7" where no q is -128, cpu_layout.quad_bits) or each 8 k's (4-bit:
 * byte 4r + i holds row r's q at k + i in its low nibble and at k + 4 + i in its high one), or 192 bytes for each
 * 16 k's (6-bit, where every q fits -32 .. 31: Q6_K and the Q5's, as u = q + 32: two 4-bit units of the low bits,
 * then a plane of the high 2, composed into bytes in registers; on 8 lanes from two tiles of rows, once a call:
 * in_bytes). One AVX-512 VNNI
 * instruction (vpdpbusd) then multiplies 16 rows' 4 codes by 4 of xq and adds them into the 16 rows' sums: 64
 * multiply-adds where an fp32 fma does 16, at the same rate (measured on Zen 4); AVX-VNNI's 8-lane vpdpbusd (AVX2
 * CPUs without AVX-512, Intel's since Alder Lake) does 32 in one; AVX2 alone has vpmaddubsw and vpmaddwd, two
 * instructions for 32 (see dot4). vpdpbusd's codes are unsigned: 8-bit codes are stored plus 128 (6-bit plus 32),
 * and a group's sum starts at -128 (-32) sum xq to take it back out (AVX2 multiplies bits 7's q itself, from 0).
 * A table's codes (IQ4_NL, IQ4_XS, MXFP4: bits TABLE_BITS + t, 4-bit places laid out as the 4-bit codes) become
 * their values plus 128 by one byte shuffle a unit of nibbles (cpu_int8.h's table_lookup), then sum as bits 7's do
 * (AVX2 without VNNI looks up the signed values themselves and multiplies them as bits 7's q). On 8 lanes a call with
 * rows enough looks them up once (in_bytes).
 */
#include <omp.h>

#include "cpu_exports.h"
#include "cpu_int8.h"
#include "cpu_kernel.h"

#define R8(F, c) F(0, c) F(1, c) F(2, c) F(3, c) F(4, c) F(5, c) F(6, c) F(7, c)
#define R12(F, c) R8(F, c) F(8, c) F(9, c) F(10, c) F(11, c)
#define RC(F) R12(F, 0) R12(F, 1) R12(F, 2) R12(F, 3)
#define TILE_ROWS 12 /* code rows RC names; MAX_ROWS and DIGIT_ROWS stay within it */
#define C4(F) F(0) F(1) F(2) F(3)
/* rows of x a tile meets: its int32 and fp32 accumulators fill the registers (2 per row and vector) */
#if IL == 16
#define MAX_ROWS 8
#define DIGIT_ROWS 12 /* code rows of a tile of three-digit rows: 4 rows of x (their int32 sums fill the registers) */
#else
#define MAX_ROWS 4
#define DIGIT_ROWS 3
#endif
/* rows of a tile of signed products (AVX2's bits 7 and tables: an int32 sum a product, none in int16 lanes): 3, so that
 * the accumulators, the codes and the rows' broadcasts stay in the 16 registers (4 spilled sums to the stack in the
 * inner loop: Q8_0 9% and IQ4_XS 3% slower, measured) */
#if IL == 8 && SEVEN_SIGNED
#define SIGNED_ROWS 3
#else
#define SIGNED_ROWS MAX_ROWS
#endif
_Static_assert(MAX_ROWS <= TILE_ROWS && DIGIT_ROWS <= TILE_ROWS, "a tile's code rows are named up to TILE_ROWS");

/* code rows [m0, m0 + MR) of x (D to a row of x: D 3, its digits) against NC column vectors from vector h0 of panel
 * p on (vector c: panel p + (h0 + c) / HV, rows ((h0 + c) % HV) * IL ..): y's columns p * 16 ... Accumulators named, one int32 per
 * code row and vector, one fp32 per row of x and vector (those past MR and NC compiled out). A row's digits' sums
 * are combined in fp32 before its group's scale, the smallest first. */
INLINE void tile(const Weight *w, const Rows *x, i64 p, i64 m0, const int MR, const int NC, const int bits,
                 const int D, float *y, i64 ldy, i64 N, const uint8_t *ahead, const int h0) {
    /* k's and bytes a step of the loop below reads: 8 in 64 bytes (4-bit), 16 in 192 (6-bit), 4 in 64 (8-bit) */
    const int nibbles = code_bits(bits) == 4 || bits == 6; /* codes split in two units of nibbles */
    const int six_bytes = bits == SIX_BYTES; /* two units of 4 k's a step, 64 bytes apart */
    const i64 unit = code_bits(bits) == 4 || six_bytes ? 8 : bits == 6 ? 16 : 4;
    const i64 step = bits == 6 ? 192 : six_bytes ? 128 : 64;
    const i64 group_bytes = w->group / unit * step, panels = (NC + HV - 1) / HV;
    /* a group's sums kept in int16 lanes (PAIRS16: 4-bit codes, groups of at most 32 k's) */
    const int wide = PAIRS16 && bits == 4;
    /* bits 5 here only in SEVEN_SIGNED builds (others take bits 7's tiles for them): q + 64 below 128 as unsigned
     * bytes, whose two products times |x| <= 127 stay under vpmaddubsw's 32767 (2 * 127 * 127), no sign step */
    const int kind = bits == 4 || bits == 6 || bits == 5 || six_bytes ? NIBBLES
                     : tabled(bits) && SEVEN_SIGNED                  ? VALUES
                     : bits == 7 && SEVEN_SIGNED                     ? SIGNED
                                                                   : BYTES;
#define ACC(r, c) VF f_##r##_##c = {0}; VI a_##r##_##c;
    RC(ACC)
#undef ACC
    for (i64 g = 0; g < w->panel_groups; g++) {
#define START(r, c) if (MR > r && NC > c) a_##r##_##c = (VI){0} + (wide ? 0 : x->bias[(m0 + r) * x->groups + g]);
        RC(START)
#undef START
#define CODES(c) const uint8_t *codes##c = w->codes + (p - w->codes_from + (h0 + c) / HV) * w->panel_code_bytes + g * group_bytes \
                                           + ((h0 + c) % HV) * IL * 4;
        C4(CODES)
#undef CODES
        /* the panels the thread reads next, taken as laid out like this tile's (another expert's may differ in
         * bits or width: then the fetch is approximate, never wrong; past the last panel it is harmless) */
        for (i64 c = 0; c < panels; c++)
            for (i64 b = 0; b < group_bytes; b += 64)
                PREFETCH_L2(ahead + c * w->panel_code_bytes + g * group_bytes + b);
        const int8_t *xq = x->q + m0 * x->K + g * w->group;
        for (i64 u = 0; u < group_bytes; u += step, xq += unit) {
            int32_t x0[TILE_ROWS], x1[TILE_ROWS], x2[TILE_ROWS], x3[TILE_ROWS]; /* xq at k + 0, 4, 8, 12 */
            for (int r = 0; r < MR; r++) {
                memcpy(x0 + r, xq + r * x->K, 4);
                if (nibbles || six_bytes) memcpy(x1 + r, xq + r * x->K + 4, 4);
                if (bits == 6) { memcpy(x2 + r, xq + r * x->K + 8, 4); memcpy(x3 + r, xq + r * x->K + 12, 4); }
            }
#define DOT4(r, c) if (MR > r && wide) a_##r##_##c = pairs16(pairs16(a_##r##_##c, u0, x0[r]), u1, x1[r]);  \
                   else if (MR > r && PAIRS16 && (bits == 6 || six_bytes)) {                                \
                       a_##r##_##c += widened(pairs16(pairs16((VI){0}, u0, x0[r]), u1, x1[r]));             \
                       if (bits == 6) a_##r##_##c += widened(pairs16(pairs16((VI){0}, u2, x2[r]), u3, x3[r])); } \
                   else if (MR > r) { a_##r##_##c = dot4(a_##r##_##c, u0, x0[r], kind);                      \
                                 if (nibbles || six_bytes) a_##r##_##c = dot4(a_##r##_##c, u1, x1[r], kind); \
                                 if (bits == 6) { a_##r##_##c = dot4(a_##r##_##c, u2, x2[r], kind);          \
                                                  a_##r##_##c = dot4(a_##r##_##c, u3, x3[r], kind); } }
#define VECTOR_DOTS(c) if (NC > c) {                                                          \
                VI u0, u1, u2 = {0}, u3 = {0};                                                \
                if (bits == 6) six_bit_bytes(codes##c + u, 0, &u0, &u1, &u2, &u3);            \
                else {                                                                        \
                    memcpy(&u0, codes##c + u, sizeof u0);                                     \
                    if (bits == 5) u0 -= 0x40404040; /* q + 64 in each byte (no borrow) */    \
                    if (six_bytes) memcpy(&u1, codes##c + u + 64, sizeof u1);                 \
                    if (nibbles) { u1 = (u0 >> 4) & 0x0F0F0F0F; u0 &= 0x0F0F0F0F; }           \
                    if (tabled(bits)) {                                                       \
                        u0 = table_lookup(u0, bits - TABLE_BITS, kind == VALUES);             \
                        u1 = table_lookup(u1, bits - TABLE_BITS, kind == VALUES);             \
                    }                                                                         \
                }                                                                             \
                R12(DOT4, c)                                                                  \
            }
            C4(VECTOR_DOTS)
#undef VECTOR_DOTS
#undef DOT4
        }
        if (wide) { /* the group's int16 sums widened, its start added */
#define WIDEN(r, c) if (MR > r && NC > c) a_##r##_##c = widened(a_##r##_##c) + x->bias[(m0 + r) * x->groups + g];
            RC(WIDEN)
#undef WIDEN
        }
#define F(r, c) __builtin_convertvector(a_##r##_##c, VF)
#define ADD(r, c, sum) if (MR > r && r % D == 0) {                                         \
            const i64 at = ((m0 + r) / D) * x->groups + g;                                 \
            f_##r##_##c = f_##r##_##c + (sum) * (s * x->d[at]);                            \
            if (w->offsets) f_##r##_##c = f_##r##_##c + o * x->dsum[at];                    \
        }
#define SCALE(r, c) ADD(r, c, F(r, c))
#define DIGITS(r, r1, r2, c) ADD(r, c, (F(r2, c) * 0x1p-8f + F(r1, c)) * 0x1p-8f + F(r, c))
#define VECTOR_SCALE(c) if (NC > c) {                                                         \
            const i64 at = ((p + (h0 + c) / HV) * w->panel_groups + g) * PANEL + ((h0 + c) % HV) * IL;      \
            VF s = (VF)vparams(w->scales, at, w->scale_kind), o = (VF)vparams(w->offsets, at, w->scale_kind); \
            if (D == 1) { R8(SCALE, c) }                                                      \
            else { DIGITS(0, 1, 2, c) DIGITS(3, 4, 5, c) DIGITS(6, 7, 8, c) DIGITS(9, 10, 11, c) } \
        }
        C4(VECTOR_SCALE)
#undef VECTOR_SCALE
#undef DIGITS
#undef SCALE
#undef ADD
#undef F
    }
#define OUT(r, c) if (MR > r && NC > c && r % D == 0) {                                     \
        const i64 col = (p + (h0 + c) / HV) * PANEL + ((h0 + c) % HV) * IL, n = N - col < IL ? N - col : IL; \
        if (n > 0) memcpy(y + (m0 + r) / D * ldy + col, &f_##r##_##c, n * sizeof(float));   \
    }
    RC(OUT)
#undef OUT
}

/* panels per tile: several for few rows (each sum a chain of dependent products: a decode step's one row needs
 * several in flight), fewer as rows fill the registers; at most 4 vectors */
#define PANELS_FOR(MR) ((MR) <= 2 ? 4 / HV : (MR) <= 4 ? 2 / HV : 1)

#if defined(__AVX2__) && IL == 8
/* 8 lanes, 4-bit codes (Q4_K, Q4_0, Q4_1, ...), a call of HALF_ROWS rows or more: tiles of up to HALF_ROWS rows by one
 * vector, half a panel, in place of MAX_ROWS rows by the whole panel. The same accumulators (a row's int32 and fp32
 * sums a vector), so the same bits, but each vector of codes is split into its nibbles once for twice the rows. One
 * core, Q4_K 10,240 x 2,560 at 192 rows: AVX2 54 -> 61, AVX-VNNI 65 -> 72 billion multiply-adds a second (6 rows a
 * tile 59 and 71; tables' and 6-bit codes, read as bytes there, gained nothing). */
#define HALF_ROWS 8
/* rows [m0, m0 + rows) (4 .. HALF_ROWS) against panels [p, p + PP), a vector at a time */
static void half_panel_tiles(const Weight *w, const Rows *x, i64 p, int PP, i64 m0, int rows, float *y, i64 ldy,
                             i64 N, const uint8_t *ahead) {
    for (int c = 0; c < PP; c++)
        for (int h = 0; h < HV; h++) switch (rows) {
#define HALF(MR_) case MR_: tile(w, x, p + c, m0, MR_, 1, 4, 1, y, ldy, N, ahead, h); break;
            HALF(4) HALF(5) HALF(6) HALF(7) HALF(8)
#undef HALF
            default: /* none (int8_panel_rows makes none): say so in y */
                for (i64 r = m0; r < m0 + rows; r++)
                    for (i64 k = (p + c) * PANEL + h * IL; k < (p + c) * PANEL + (h + 1) * IL && k < N; k++)
                        y[r * ldy + k] = __builtin_nanf("");
        }
}
#define HALF_TILES 1
#else
#define HALF_TILES 0
#define HALF_ROWS 1
#endif

/* every row of x (M of them, x->digits code rows each) in tiles of up to MAX_ROWS code rows (DIGIT_ROWS with three
 * digits, SIGNED_ROWS for signed products) against panels [p, p + PP), the panels' codes read from L1 after the
 * first tile */
void int8_panel_rows(const Weight *w, const Rows *x, i64 p, i64 M, const int PP, float *y, i64 ldy, i64 N,
                     const uint8_t *ahead) {
    /* rows split evenly between the tiles (9 as 5 and 4, not 8 and 1: a tile of one row and one panel would
     * wait on its one chain of dependent products); a row's digits in one tile */
    const int D = (int)x->digits;
    const int signed_products = SEVEN_SIGNED && (w->bits == 7 || tabled(w->bits)); /* a table's looked up: 7's */
    const int half = HALF_TILES && w->bits == 4 && D == 1 && M >= HALF_ROWS; /* tiles of half a panel */
    const i64 per = half ? HALF_ROWS : D == 3 ? DIGIT_ROWS / 3 : signed_products ? SIGNED_ROWS : MAX_ROWS;
    const i64 count = (M + per - 1) / per;
#if defined(__AVX2__) && IL == 8
    Weight e;
    if ((tabled(w->bits) || w->bits == 6) && M >= 2 * per) w = in_bytes(w, p, PP, N, &e); /* two tiles or more */
#endif
    for (i64 t = 0, m0 = 0; t < count; t++) {
        const int rows = (int)((M - m0 + count - t - 1) / (count - t)), MR = rows * D;
#if HALF_TILES
        if (half) {
            half_panel_tiles(w, x, p, PP, m0, rows, y, ldy, N, ahead);
            m0 += rows;
            continue;
        }
#endif
        const int B = w->bits == 4 ? 1 : w->bits == 7 || (w->bits == 5 && !SEVEN_SIGNED) ? 2 : w->bits == 6 ? 3
                    : w->bits == 8 ? 0 : w->bits == TABLE_BITS ? 4 : w->bits == TABLE_BITS + 1 ? 5
                    : w->bits == 5 ? 6 : w->bits == SIX_BYTES ? 7 : 8; /* 8: none (NaN below) */
        switch ((D == 3) * 4096 + MR * 64 + B * 4 + PP / 2) {
#define TILE(D_, MR_, PP_, B_, bits) case (D_ == 3) * 4096 + MR_ * 64 + B_ * 4 + PP_ / 2:                    \
            tile(w, x, p, m0 * D_, MR_, PP_ * HV, bits, D_, y, ldy, N, ahead, 0); break;
#define CASE3(D_, MR_, PP_) TILE(D_, MR_, PP_, 1, 4) TILE(D_, MR_, PP_, 2, 7) TILE(D_, MR_, PP_, 3, 6)      \
                            TILE(D_, MR_, PP_, 0, 8) TILE(D_, MR_, PP_, 4, TABLE_BITS)                     \
                            TILE(D_, MR_, PP_, 5, TABLE_BITS + 1) NEAR7(D_, MR_, PP_) BYTES6(D_, MR_, PP_)
#if SEVEN_SIGNED
#define NEAR7(D_, MR_, PP_) TILE(D_, MR_, PP_, 6, 5)
#else
#define NEAR7(D_, MR_, PP_)
#endif
#if defined(__AVX2__) && IL == 8 /* in_bytes' 6-bit codes */
#define BYTES6(D_, MR_, PP_) TILE(D_, MR_, PP_, 7, SIX_BYTES)
#else
#define BYTES6(D_, MR_, PP_)
#endif
#define CASE(MR_, PP_) CASE3(1, MR_, PP_)
#if IL == 16
        CASE(1, 4) CASE(2, 4) CASE(3, 2) CASE(4, 2)
        CASE(1, 1) CASE(2, 1) CASE(3, 1) CASE(4, 1) CASE(5, 1) CASE(6, 1) CASE(7, 1) CASE(8, 1)
        CASE3(3, 3, 2) CASE3(3, 3, 1) CASE3(3, 6, 1) CASE3(3, 9, 1) CASE3(3, 12, 1) /* (3, 1): a row past AMX's blocks */
#else
        CASE(1, 2) CASE(2, 2) CASE(3, 1) CASE(4, 1) CASE(1, 1) CASE(2, 1)
        CASE3(3, 3, 1)
#endif
#undef CASE
#undef CASE3
#undef NEAR7
#undef BYTES6
#undef TILE
        default: /* no such tile (int8_panels and the rows a tile takes make none): say so in y, not leave it as is */
            for (i64 r = m0; r < m0 + rows; r++)
                for (i64 c = p * PANEL; c < (p + PP) * PANEL && c < N; c++) y[r * ldy + c] = __builtin_nanf("");
        }
        m0 += rows;
    }
}

/* Whether an exact (fp32) engine's matmuls take x in three digits here: where this build sums with AVX-512 VNNI
 * (vpdpbusd; 1.5-1.8x the fp32 kernel's one-row matmuls, measured on Zen 4). Not with AVX-VNNI's 8 lanes (Alder
 * Lake's): there the digits decoded 15-25% faster than the fp32 kernel but prompts ran 20-35% slower (a Xeon's
 * cores built for Alder Lake, SmolLM2 and a MoE file in IQ4_XS), nor with AVX2's two-step products (0.4-1.2x) */
int int8_vnni(void) { return VNNI && IL == 16; }

/* panels a tile reads for M rows of x in `digits` code rows each */
int int8_panels(i64 M, int digits) {
    return M * digits <= (digits == 3 ? DIGIT_ROWS : MAX_ROWS) ? PANELS_FOR(M * digits) : 1;
}

/* room for M rows of K quantized as each of kinds[0 .. n) reads them (its group; `digits` code rows a row) in the
 * calling thread's scratch (kept between calls); 0 where memory ran out */
static int room(Rows *rows, const QuantMatrix *const *kinds, i64 n, i64 M, i64 K, int digits) {
    static __thread void *buf;
    static __thread size_t size;
    size_t total = 0;
    for (i64 j = 0; j < n; j++) total += (int8_rows_bytes(M, K, kinds[j]->group, digits) + 63) / 64 * 64;
    uint8_t *at = grown(&buf, &size, total ? total : 1);
    if (!at) return 0;
    for (i64 j = 0; j < n; j++) {
        rows[j] = int8_rows_in(at, M, K, kinds[j]->group, digits);
        at += (int8_rows_bytes(M, K, kinds[j]->group, digits) + 63) / 64 * 64;
    }
    return 1;
}

/* Up to this many rows (a decode step, a short verification) each thread quantizes x for itself: a few hundred
 * values a row, cheaper than the barrier a shared copy needs before any thread may read it. */
#define OWN_ROWS 4

/* y [M, ..] = x [M, K] @ w.T for each of `count` parts in quad order (one order, one K), part i into y's columns
 * from columns[i], rows ldy apart: a fused layer's q|k|v or gate|up, or the linear-attention layer's two input
 * projections, from one input. x is quantized once for the parts that read it alike (the same group and bits; a
 * Q6_K v beside Q4_K q and k takes its own), then every part's tiles share one parallel loop; each part's columns
 * are the bits a call of its own gives. 0 where memory ran out. */
int qmm_int8_parts(const float *x, i64 M, const QuantMatrix *parts, const i64 *columns, i64 count, float *y, i64 ldy,
                   int threads) {
    if (count < 1) return 1;
    const i64 K = parts[0].cols;
    const int digits = quad_digits(parts[0].order);
    const QuantMatrix *kinds[count]; /* the first part of each group and bits */
    i64 kind_of[count], first[count + 1], n = 0;
    Weight w[count];
    first[0] = 0;
    for (i64 i = 0; i < count; i++) {
        const QuantMatrix *p = parts + i;
        i64 j = 0;
        while (j < n && !(kinds[j]->group == p->group && kinds[j]->bits == p->bits)) j++;
        if (j == n) kinds[n++] = p;
        kind_of[i] = j;
        w[i] = weight_of(p->codes, p->scales, p->offsets, K, p->group, (int)p->bits, (int)p->scale_kind);
    }
    Rows shared[count];
    if (M > OWN_ROWS && !room(shared, kinds, n, M, K, digits)) return 0;
    /* a block of 16 rows or more: the AMX tiles where the CPU has them (cpu_amx_int8.c), two panels a task, x's
     * whole blocks laid out again as the tiles read them (tiled: for each kind, [M / 16][K / group][digits][16][group]) */
    static __thread void *tiled_buf;
    static __thread size_t tiled_size;
    const i64 blocks = M / 16, block_bytes = 16 * digits * K;
    i64 all_panels = 0; /* two a task halves the tasks: only where every thread still gets two or more */
    for (i64 i = 0; i < count; i++) all_panels += (parts[i].rows + PANEL - 1) / PANEL;
    const int tiles = blocks && all_panels >= 4 * threads && int8_amx_usable();
    const int PP = tiles ? 2 : int8_panels(M, digits);
    /* NULL where memory ran out: the tiles then read x's own rows (one digit as fast, three 20-25% slower) */
    int8_t *tiled = tiles ? grown(&tiled_buf, &tiled_size, (size_t)(n * blocks * block_bytes)) : NULL;
    for (i64 i = 0; i < count; i++) /* each part's tasks from first[i], PP panels a task */
        first[i + 1] = first[i] + ((parts[i].rows + PANEL - 1) / PANEL + PP - 1) / PP;
    int ran = 1;
#pragma omp parallel num_threads(threads)
    {
        Rows own[count], *rows = shared;
        if (M <= OWN_ROWS) {
            rows = room(own, kinds, n, M, K, digits) ? own : NULL;
            for (i64 j = 0; rows && j < n; j++)
                for (i64 m = 0; m < M; m++) int8_quantize_row(x, m, kinds[j]->group, (int)kinds[j]->bits, own + j);
        } else {
#pragma omp for schedule(static)
            for (i64 m = 0; m < M; m++)
                for (i64 j = 0; j < n; j++) int8_quantize_row(x, m, kinds[j]->group, (int)kinds[j]->bits, shared + j);
        }
        if (!rows) {
#pragma omp atomic write
            ran = 0;
        }
        if (tiled) {
#pragma omp for schedule(static)
            for (i64 b = 0; b < blocks * n; b++)
                int8_amx_tile_rows(shared + b % n, b / n, kinds[b % n]->group, tiled + (b % n) * blocks * block_bytes);
        }
#pragma omp for schedule(static)
        for (i64 t = 0; t < first[count]; t++) {
            i64 i = 0;
            while (t >= first[i + 1]) i++;
            const i64 p = (t - first[i]) * PP;
            if (rows && tiles)
                int8_amx_rows(w + i, rows + kind_of[i], tiled ? tiled + kind_of[i] * blocks * block_bytes : NULL, p, M,
                              y + columns[i], ldy, parts[i].rows);
            else if (rows)
                int8_panel_rows(w + i, rows + kind_of[i], p, M, PP, y + columns[i], ldy, parts[i].rows,
                                parts[i].codes + (p + PP) * w[i].panel_code_bytes);
        }
    }
    return ran;
}

/* y [M, N] = x [M, K] @ w.T, rows ldy apart, from codes in quad order (bits 4, 6, 7, 8 or a table's); 0 where memory
 * ran out */
int qmm_int8(const float *x, i64 M, const uint8_t *codes, const void *scales, const void *offsets, i64 N, i64 K,
             int bits, i64 group, int scale_kind, int digits, float *y, i64 ldy, int threads) {
    const QuantMatrix part = {codes, scales, offsets, N, K, group, bits, scale_kind, digits == 3 ? 3 : 2};
    const i64 column = 0;
    return qmm_int8_parts(x, M, &part, &column, 1, y, ldy, threads);
}
