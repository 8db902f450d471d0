/* Vectors of 8 floats for our small CPU kernels (cpu_ops.c, cpu_attention.c): AVX2's, or GCC's portable ones
 * elsewhere, with the same operators, and e^x over them. */
#pragma once
#include "cpu_common.h"

/* Vectors of 8 floats: AVX2's, or GCC's portable ones elsewhere (ARM: NEON pairs), with the same operators. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
typedef __m256 V8;
#define v8_set1 _mm256_set1_ps
#define v8_loadu _mm256_loadu_ps
#define v8_storeu _mm256_storeu_ps
#define v8_fma _mm256_fmadd_ps /* a * b + c, one rounding */
#define v8_min _mm256_min_ps
#define v8_max _mm256_max_ps
#define v8_floor _mm256_floor_ps
/* 2^n for whole n in a float vector */
static inline V8 v8_pow2(V8 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline float hsum8(V8 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
/* the 8 vectors' sums, in one vector (lane j: a[j]'s) */
static inline V8 hsum8x8(const V8 a[8]) {
    __m256 s0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 s1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0, s1, 0x20), _mm256_permute2f128_ps(s0, s1, 0x31));
}
#else
typedef float V8 __attribute__((vector_size(32)));
typedef int32_t I8 __attribute__((vector_size(32)));
static inline V8 v8_set1(float x) { return (V8){x, x, x, x, x, x, x, x}; }
static inline V8 v8_loadu(const float *p) { V8 v; memcpy(&v, p, sizeof v); return v; }
static inline void v8_storeu(float *p, V8 v) { memcpy(p, &v, sizeof v); }
static inline V8 v8_fma(V8 a, V8 b, V8 c) {
    V8 r;
    for (int i = 0; i < 8; i++) r[i] = fmaf(a[i], b[i], c[i]);
    return r;
}
static inline V8 v8_min(V8 a, V8 b) {
    for (int i = 0; i < 8; i++) a[i] = a[i] < b[i] ? a[i] : b[i];
    return a;
}
static inline V8 v8_max(V8 a, V8 b) {
    for (int i = 0; i < 8; i++) a[i] = a[i] > b[i] ? a[i] : b[i];
    return a;
}
static inline V8 v8_floor(V8 x) {
    V8 r;
    for (int i = 0; i < 8; i++) r[i] = floorf(x[i]);
    return r;
}
static inline V8 v8_pow2(V8 n) {
    I8 e = (__builtin_convertvector(n, I8) + 127) << 23;
    V8 r;
    memcpy(&r, &e, sizeof r);
    return r;
}
static inline float hsum8(V8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }
static inline V8 hsum8x8(const V8 a[8]) {
    V8 r;
    for (int j = 0; j < 8; j++) r[j] = hsum8(a[j]);
    return r;
}
#endif

/* e^x for 8 floats: 2^n e^r with n = round(x log2 e) and r = x - n ln 2 (ln 2 in two parts), e^r by Cephes'
 * degree-6 polynomial for expf (about 1 ulp); x clamped to +-88.38, where fp32 saturates anyway. */
static inline V8 exp8(V8 x) {
    x = v8_min(v8_max(x, v8_set1(-88.3762626647949f)), v8_set1(88.3762626647949f));
    V8 n = v8_floor(v8_fma(x, v8_set1(1.44269504088896341f), v8_set1(0.5f)));
    V8 r = v8_fma(-n, v8_set1(0.693359375f), x);
    r = v8_fma(-n, v8_set1(-2.12194440e-4f), r);
    V8 y = v8_set1(1.9875691500e-4f);
    y = v8_fma(y, r, v8_set1(1.3981999507e-3f));
    y = v8_fma(y, r, v8_set1(8.3334519073e-3f));
    y = v8_fma(y, r, v8_set1(4.1665795894e-2f));
    y = v8_fma(y, r, v8_set1(1.6666665459e-1f));
    y = v8_fma(y, r, v8_set1(5.0000001201e-1f));
    y = v8_fma(y, r * r, r) + v8_set1(1.0f);
    return y * v8_pow2(n);
}

/* KV cache elements: fp32, or fp16 / bf16 (kv_cache_dtype), stored as PyTorch's .to() rounds (to nearest, ties to
 * even) and read back exactly. */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

static inline float f32_of_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_of_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    if (exp == 0) /* zero or subnormal: mant * 2^-24, exact */
        return f32_of_bits(sign | bits_of_f32((float)mant * 0x1p-24f));
    if (exp == 0x1f) return f32_of_bits(sign | 0x7f800000 | mant << 13);
    return f32_of_bits(sign | (exp + 112) << 23 | mant << 13);
}

/* Rounds to nearest even in the float unit: scaled so that fp16's last place is fp32's, the sum of the value and
 * a power of two at the right exponent leaves the rounded mantissa in the low bits (subnormals included);
 * overflow becomes infinity. */
static inline uint16_t f32_to_f16(float f) {
    uint32_t u = bits_of_f32(f), twice = u + u, sign = (u >> 16) & 0x8000;
    if (twice > 0xff000000u) return (uint16_t)(sign | 0x7e00); /* NaN */
    float base = (fabsf(f) * 0x1p+112f) * 0x1p-110f;
    uint32_t bias = twice & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    uint32_t b = bits_of_f32(f32_of_bits((bias >> 1) + 0x07800000u) + base);
    return (uint16_t)(sign | (((b >> 13) & 0x7c00) + (b & 0x0fff)));
}

static inline float bf16_to_f32(uint16_t h) { return f32_of_bits((uint32_t)h << 16); }

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = bits_of_f32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

/* element at of a cache of this kind */
static inline float kv_at(const void *cache, i64 at, int kind) {
    if (kind == KV_F16) return f16_to_f32(((const uint16_t *)cache)[at]);
    if (kind == KV_BF16) return bf16_to_f32(((const uint16_t *)cache)[at]);
    return ((const float *)cache)[at];
}

/* 8 elements from at */
static inline V8 v8_load_kv(const void *cache, i64 at, int kind) {
    if (kind == KV_F32) return v8_loadu((const float *)cache + at);
    const uint16_t *h = (const uint16_t *)cache + at;
#if defined(__AVX2__) && defined(__FMA__)
    __m128i raw = _mm_loadu_si128((const __m128i *)h);
    if (kind == KV_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
#ifdef __F16C__
    return _mm256_cvtph_ps(raw);
#endif
#endif
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = kind == KV_F16 ? f16_to_f32(h[i]) : bf16_to_f32(h[i]);
    return v8_loadu(f);
}

/* n floats into a cache of this kind from element at */
static inline void store_kv_elements(void *cache, i64 at, const float *x, i64 n, int kind) {
    if (kind == KV_F32) {
        memcpy((float *)cache + at, x, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *h = (uint16_t *)cache + at;
    for (i64 i = 0; i < n; i++) h[i] = kind == KV_F16 ? f32_to_f16(x[i]) : f32_to_bf16(x[i]);
}

/* bytes of one element */
static inline i64 kv_size(int kind) { return kind == KV_F32 ? 4 : 2; }
