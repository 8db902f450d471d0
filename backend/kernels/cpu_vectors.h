/* Vectors of 8 floats for our small CPU kernels (cpu_ops.c, cpu_attention.c): AVX2's, or GCC's portable ones
 * elsewhere, with the same operators, and e^x over them. */
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;

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
