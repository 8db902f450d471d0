/* The 8-bit kernel's vectors (cpu_int8.c): a panel's rows as int32 and fp32 lanes, and the integer dot products of
 * codes and x's bytes in each build, for cpu_int8.c alone. */
#pragma once
#include "cpu_kernel.h"

/* Integer and float vectors of IL lanes: a panel's 16 rows in one AVX-512 register, or in two halves of 8 (AVX2 and
 * the portable build: GCC splits a 64-byte vector into 16-byte pieces through the stack there, 2x slower, measured) */
#if defined(__AVX512F__)
#define IL 16
#else
#define IL 8
#endif
#define HV (PANEL / IL) /* vectors per panel */
typedef int32_t VI __attribute__((vector_size(IL * 4)));
typedef float VF __attribute__((vector_size(IL * 4)));

/* What a dot4 is handed: 4 or 6-bit codes (every byte of u below 64), 8-bit codes (u = q + 128), 8-bit codes
 * none of which is -128 (bits 7 in quad order: u = q + 128 >= 1), or a table's values themselves (signed bytes,
 * none -128: AVX2's lookup, table_lookup) */
enum { BYTES, NIBBLES, SIGNED, VALUES };

/* acc + the dot products of u's 4 unsigned bytes and x's 4 signed ones per 32-bit lane (SIGNED where SEVEN_SIGNED:
 * of u - 128; VALUES: of u's bytes read as signed) */
INLINE VI dot4(VI acc, VI u, int32_t x, const int kind) {
#if VNNI && IL == 16
    (void)kind;
    return (VI)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)u, _mm512_set1_epi32(x));
#elif VNNI
    (void)kind;
    return (VI)_mm256_dpbusd_avx_epi32((__m256i)acc, (__m256i)u, _mm256_set1_epi32(x));
#elif defined(__AVX2__)
    /* vpmaddubsw sums two products of unsigned and signed bytes into an int16, which saturates past 32767: 4 and
     * 6-bit codes times |x| <= 128 (a digit may be -128) stay under it (2 * 63 * 128); 8-bit codes go in as their
     * two nibbles (u = 16 hi + lo), the high one's sums scaled by 16 in int32 by vpmaddwd; and codes without -128 as
     * |x| times q * sign(x) (2 * 128 * 127 = 32512). Exact integers every way, the same as vpdpbusd's and the
     * portable loop's. */
    const __m256i xb = _mm256_set1_epi32(x), ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    __m256i half[IL / 8], sum[IL / 8];
    memcpy(half, &u, sizeof half);
    memcpy(sum, &acc, sizeof sum);
    for (int i = 0; i < IL / 8; i++) {
        if (kind == NIBBLES) {
            sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(half[i], xb), ones));
        } else if (kind == SIGNED || kind == VALUES) {
            __m256i q = kind == VALUES ? half[i] : _mm256_xor_si256(half[i], _mm256_set1_epi8((char)0x80));
            __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(q, xb));
            sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(p, ones));
        } else {
            __m256i lo = _mm256_and_si256(half[i], low), hi = _mm256_and_si256(_mm256_srli_epi16(half[i], 4), low);
            sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xb), ones));
            sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xb), _mm256_set1_epi16(16)));
        }
    }
    memcpy(&acc, sum, sizeof acc);
    return acc;
#else
    (void)kind;
    for (int i = 0; i < 4; i++) acc += ((u >> (8 * i)) & 0xFF) * (int32_t)(int8_t)(x >> (8 * i));
    return acc;
#endif
}

/* Where products of pairs may be summed in int16 lanes before vpmaddwd widens them (AVX2's two-step products, no
 * VNNI): a pair of 4-bit codes (at most 15) times |x| <= 128 is at most 3,840, so a group's 32 k's (16 a lane, 8
 * vpmaddubsw) sum to at most 30,720; a pair of 6-bit ones (at most 63) is at most 16,128, so two vpmaddubsw's fit.
 * One widening a group (4-bit: half the multiplies) or two a unit of 16 k's (6-bit: two vpmaddwd of four saved) in
 * place of one a product, the same exact integers. The bound holds for groups of at most 32 k's: cpu_layout's
 * groups are 16 or 32 (a 4-bit format of longer groups would need a widening every 32 k's). */
#if defined(__AVX2__) && !VNNI
#define PAIRS16 1
/* acc's int16 lanes + the sums of u's unsigned bytes times x's signed ones in pairs */
INLINE VI pairs16(VI acc, VI u, int32_t x) {
    const __m256i xb = _mm256_set1_epi32(x);
    __m256i half[IL / 8], sum[IL / 8];
    memcpy(half, &u, sizeof half);
    memcpy(sum, &acc, sizeof sum);
    for (int i = 0; i < IL / 8; i++) sum[i] = _mm256_add_epi16(sum[i], _mm256_maddubs_epi16(half[i], xb));
    memcpy(&acc, sum, sizeof acc);
    return acc;
}
/* int16 lanes summed in adjacent pairs into int32 lanes */
INLINE VI widened(VI acc16) {
    __m256i sum[IL / 8];
    memcpy(sum, &acc16, sizeof sum);
    for (int i = 0; i < IL / 8; i++) sum[i] = _mm256_madd_epi16(sum[i], _mm256_set1_epi16(1));
    memcpy(&acc16, sum, sizeof acc16);
    return acc16;
}
#else
#define PAIRS16 0
INLINE VI pairs16(VI acc, VI u, int32_t x) { (void)u, (void)x; return acc; }
INLINE VI widened(VI acc16) { return acc16; }
#endif

#if !((IL == 16 && defined(__AVX512BW__)) || (IL == 8 && defined(__AVX2__)))
/* the portable build's lookup, a byte at a time: one copy, not one inlined in each of the tiles (the build's compile
 * time) */
static __attribute__((noinline)) VI table_bytes_of(VI u, int t) {
    uint8_t b[IL * 4];
    memcpy(b, &u, sizeof b);
    for (int i = 0; i < IL * 4; i++) b[i] = (uint8_t)(CODE_TABLES[t][b[i]] + 128);
    memcpy(&u, b, sizeof u);
    return u;
}
#endif

/* u's bytes (each below 16) as their values in table t (one byte shuffle), for the codes of bits TABLE_BITS + t: plus
 * 128, then read as bits 7's bytes are (no table value is -128); or, `values`, the signed values themselves
 * (SEVEN_SIGNED builds: dot4's VALUES) */
INLINE VI table_lookup(VI u, int t, const int values) {
#if (IL == 16 && defined(__AVX512BW__)) || (IL == 8 && defined(__AVX2__))
    const __m128i table = _mm_xor_si128(_mm_load_si128((const __m128i *)CODE_TABLES[t]),
                                        _mm_set1_epi8(values ? 0 : (char)0x80));
#if IL == 16
    return (VI)_mm512_shuffle_epi8(_mm512_broadcast_i32x4(table), (__m512i)u);
#else
    return (VI)_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(table), (__m256i)u);
#endif
#else
    return table_bytes_of(u, t) ^ (values ? (int32_t)0x80808080 : 0);
#endif
}

/* bits of a call's 6-bit codes laid out again as bytes (u = q + 32, below 64: quad order as 8-bit codes; in_bytes) */
#define SIX_BYTES 9
/* The composition of a 6-bit unit of 16 k's (192 bytes a panel: two nibble units, then the plane of the high 2 bits)
 * for the vector of rows at `half`: its k + 0 .. 3, 4 .. 7, 8 .. 11 and 12 .. 15 as u = q + 32 bytes */
INLINE void six_bit_bytes(const uint8_t *codes, i64 half, VI *u0, VI *u1, VI *u2, VI *u3) {
    VI plane;
    memcpy(u0, codes + half, sizeof *u0);
    memcpy(u2, codes + 64 + half, sizeof *u2);
    memcpy(&plane, codes + 128 + half, sizeof plane);
    *u1 = ((*u0 >> 4) & 0x0F0F0F0F) | ((plane << 2) & 0x30303030);
    *u0 = (*u0 & 0x0F0F0F0F) | ((plane << 4) & 0x30303030);
    *u3 = ((*u2 >> 4) & 0x0F0F0F0F) | ((plane >> 2) & 0x30303030);
    *u2 = (*u2 & 0x0F0F0F0F) | (plane & 0x30303030);
}

#if defined(__AVX2__) && IL == 8
/* panels [p, p + PP) of w (those that exist below N's columns) with a byte a code in quad order, in the thread's
 * scratch: e, or w itself where memory ran out (cpu_int8_bytes.c) */
const Weight *in_bytes(const Weight *w, i64 p, int PP, i64 N, Weight *e);
#endif
