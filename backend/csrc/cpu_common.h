/* What every CPU kernel file starts from: the C library headers they use and the index type. Nothing here
 * declares a kernel (cpu_exports.h does) or a vector (cpu_vectors.h: 8-float vectors for the small ops and
 * attention; cpu_kernel.h: the quantized kernels' panel vectors and Weight). */
#pragma once
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;
