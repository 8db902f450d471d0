/* x's rows as the 8-bit kernel (cpu_int8.c) reads them, per group of the weights' `group` k's (16 or 32), with
 * d = max |x| / 127 and v = x * 127 / max |x| (|v| <= 127):
 *
 * - one digit (activations="int8", llama.cpp's arithmetic): xq = round(v), to nearest even; x is taken as d xq,
 *   off by up to half a step, max |x| / 254.
 * - three digits (cpu_layout's "digits": an fp32 engine's layers, and a bf16 one's off AMX tiles, where the build
 *   has VNNI): v = c0 + c1 / 256 + c2 / 65536 + e, each c a signed byte and |e| <= 2^-16, so x is taken to 24
 *   bits of its group's largest value, fp32's own precision there (within a few units of its last place): the
 *   integer sums of codes times digits are exact, and a group's sum of x * w is then as close as fp32's products
 *   and sums would bring it. c0 = round(v); c1 = round(256 (v - c0)); c2 = round(256 (256 (v -
 *   c0) - c1)); every difference is exact in fp32 (its terms within a factor of two of each other, or one zero).
 *   c1 = 128 (v - c0 at least 127.5 / 256) is taken as c0 + 1 and c1 = -128, the same value; c2 = 128 as 127.
 *   (That holds while d is a normal float, max |x| above 1.5e-36; below, d's own denormal spacing limits it.)
 *
 * Per row and group: d, dsum = d * sum of x as taken (in digits' units, their integer sums combined in fp32), and
 * per digit row the bias its group's integer sum starts at (cpu_int8.c). The float steps are the same in every
 * build (AVX-512 or portable) and do not depend on the rows beside it, so a row's codes are the same bits alone
 * or in any batch. A NaN or an infinity in a group makes its d NaN (and so the row's y), as in the fp32 kernel.
 */
#include "cpu_exports.h"
#include "cpu_kernel.h"


/* Groups whose max |x| is below 2^-64 are scaled up by 2^64 before 127 / max |x| (which would overflow below
 * 127 / FLT_MAX): exact, and the same codes the unscaled arithmetic gives wherever it does not overflow. */
#define UP(amax) ((amax) < 0x1p-64f ? 0x1p64f : 1.0f)

/* max |x| over a group; *bad where it holds a NaN or an infinity (the same value in any order: a max) */
INLINE float group_max(const float *xg, i64 group, int *bad) {
    float amax = 0.0f;
    int b = 0;
#if defined(__AVX512F__)
    __m512 m = _mm512_setzero_ps();
    for (i64 k = 0; k < group; k += 16) {
        __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xg + k));
        b |= _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.4028235e38f), _CMP_NLE_UQ);
        m = _mm512_max_ps(m, a);
    }
    amax = _mm512_reduce_max_ps(m);
#else
    for (i64 k = 0; k < group; k++) {
        b |= !(fabsf(xg[k]) <= 3.4028235e38f);
        amax = fabsf(xg[k]) > amax ? fabsf(xg[k]) : amax;
    }
#endif
    *bad = b;
    return amax;
}

/* A group's `digits` (1 or 3) code rows, `stride` bytes apart from q, and their integer sums */
INLINE void group_codes(const float *xg, i64 group, float up, float inv, int digits, int8_t *q, i64 stride,
                        int32_t *total) {
#if defined(__AVX512F__)
    __m512i t0 = _mm512_setzero_si512(), t1 = t0, t2 = t0;
    const __m512i top = _mm512_set1_epi32(128), top2 = _mm512_set1_epi32(127), wrap = _mm512_set1_epi32(256);
    for (i64 k = 0; k < group; k += 16) {
        __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xg + k), _mm512_set1_ps(up)), _mm512_set1_ps(inv));
        v = _mm512_mask_mov_ps(_mm512_setzero_ps(), _mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v); /* NaN -> 0 */
        __m512i c0 = _mm512_cvtps_epi32(v); /* to nearest even */
        if (digits == 3) {
            const __m512 s1 = _mm512_mul_ps(_mm512_sub_ps(v, _mm512_cvtepi32_ps(c0)), _mm512_set1_ps(256.0f));
            __m512i c1 = _mm512_cvtps_epi32(s1);
            const __m512 s2 = _mm512_mul_ps(_mm512_sub_ps(s1, _mm512_cvtepi32_ps(c1)), _mm512_set1_ps(256.0f));
            const __m512i c2 = _mm512_min_epi32(_mm512_cvtps_epi32(s2), top2);
            const __mmask16 carry = _mm512_cmpeq_epi32_mask(c1, top);
            c0 = _mm512_mask_add_epi32(c0, carry, c0, _mm512_set1_epi32(1));
            c1 = _mm512_mask_sub_epi32(c1, carry, c1, wrap);
            _mm_storeu_si128((__m128i *)(q + stride + k), _mm512_cvtepi32_epi8(c1));
            _mm_storeu_si128((__m128i *)(q + 2 * stride + k), _mm512_cvtepi32_epi8(c2));
            t1 = _mm512_add_epi32(t1, c1), t2 = _mm512_add_epi32(t2, c2);
        }
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(c0));
        t0 = _mm512_add_epi32(t0, c0);
    }
    total[0] = _mm512_reduce_add_epi32(t0), total[1] = _mm512_reduce_add_epi32(t1);
    total[2] = _mm512_reduce_add_epi32(t2);
#else
    total[0] = total[1] = total[2] = 0;
    for (i64 k = 0; k < group; k++) {
        float v = xg[k] * up * inv;
        v = v == v ? v : 0.0f;
        int c0 = (int)nearbyintf(v);
        if (digits == 3) {
            const float s1 = (v - (float)c0) * 256.0f;
            int c1 = (int)nearbyintf(s1);
            const float s2 = (s1 - (float)c1) * 256.0f;
            const int c2 = (int)nearbyintf(s2) < 127 ? (int)nearbyintf(s2) : 127;
            if (c1 == 128) c0 += 1, c1 -= 256;
            q[stride + k] = (int8_t)c1, q[2 * stride + k] = (int8_t)c2;
            total[1] += c1, total[2] += c2;
        }
        q[k] = (int8_t)c0;
        total[0] += c0;
    }
#endif
}

/* row m of x [.., K] into r (r->digits code rows for it) */
void int8_quantize_row(const float *x, i64 m, i64 group, int bits, const Rows *r) {
    const int D = (int)r->digits;
    for (i64 g = 0; g < r->groups; g++) {
        const float *xg = x + m * r->K + g * group;
        int bad;
        const float amax = group_max(xg, group, &bad), up = UP(amax);
        const float inv = amax > 0.0f && !bad ? 127.0f / (amax * up) : 0.0f;
        int32_t total[3];
        group_codes(xg, group, up, inv, D, r->q + m * D * r->K + g * group, r->K, total);
        const i64 at = m * r->groups + g;
        r->d[at] = bad ? __builtin_nanf("") : amax / 127.0f;
        const float units = D == 1 ? (float)total[0]
                                   : ((float)total[2] * 0x1p-8f + (float)total[1]) * 0x1p-8f + (float)total[0];
        r->dsum[at] = r->d[at] * units;
        for (int j = 0; j < D; j++)
            r->bias[(m * D + j) * r->groups + g] =
                bits == 8 || ((bits == 7 || tabled(bits) || bits == 5) && !SEVEN_SIGNED) ? -128 * total[j]
                : bits == 5                                                              ? -64 * total[j]
                : bits == 6                                                              ? -32 * total[j]
                                                                                         : 0;
    }
}

Rows int8_rows_from(const Rows *r, i64 first) {
    return (Rows){r->q + first * r->digits * r->K, r->d + first * r->groups, r->dsum + first * r->groups,
                  r->bias + first * r->digits * r->groups, r->K, r->groups, r->digits};
}

/* row m of `from` as row n of `to` (rows of the same K, group and digits): a token's x quantized once for all the
 * experts it meets (cpu_moe.c) */
void int8_row_copy(const Rows *from, i64 m, const Rows *to, i64 n) {
    const i64 D = from->digits, G = from->groups;
    memcpy(to->q + n * D * to->K, from->q + m * D * from->K, (size_t)(D * from->K));
    memcpy(to->d + n * G, from->d + m * G, (size_t)G * sizeof(float));
    memcpy(to->dsum + n * G, from->dsum + m * G, (size_t)G * sizeof(float));
    memcpy(to->bias + n * D * G, from->bias + m * D * G, (size_t)(D * G) * sizeof(int32_t));
}

/* bytes of M rows of K in `digits` code rows each, quantized per group of `group` k's, as int8_rows_in lays them out */
size_t int8_rows_bytes(i64 M, i64 K, i64 group, int digits) {
    return (size_t)(M * (K / group)) * (2 + digits) * sizeof(float) + (size_t)(M * digits * K);
}

/* those rows laid out in mem (int8_rows_bytes of it, aligned to 4 bytes at least) */
Rows int8_rows_in(void *mem, i64 M, i64 K, i64 group, int digits) {
    const i64 groups = K / group;
    float *f = mem;
    return (Rows){(int8_t *)(f + (2 + digits) * M * groups), f, f + M * groups, (int32_t *)(f + 2 * M * groups), K,
                  groups, digits};
}
