/* What our two AMX kernels share (cpu_amx.c: weights decoded and rounded to bf16; cpu_amx_codes.c: the codes
 * themselves): the tiles' configuration, the permission to use them, x rounded to bf16. Their entry points are in
 * cpu_exports.h. */
#pragma once
#include "cpu_kernel.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} TileConfig;

/* whether Linux lets this process use the tiles (asked once) */
int amx_ready(void);

/* row r of x [M, K] in bf16 at xb + r * K (zeros past M) */
INLINE void bf16_row(const float *x, i64 r, i64 M, i64 K, uint16_t *xb) {
    for (i64 k = 0; k < K; k += 16)
        _mm256_storeu_si256((__m256i *)(xb + r * K + k),
                            r < M ? (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * K + k))
                                  : _mm256_setzero_si256());
}
#else
#define HAVE_AMX 0
#endif
