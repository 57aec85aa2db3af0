/* AVX2 prompt kernel for float weights (float_x86.h): panels of 16 rows (2 vectors), tiles of
 * 16 rows x 6 tokens: 12 accumulators, 2 panel loads and 6 broadcasts per 12 FMAs (15 of the 16
 * registers). */
#include <string.h>

#include "quant.h"

#if defined(EMBER_X86)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif
#include <immintrin.h>

typedef __m256 fvec;
#define FP_LANES 8
#define FP_VECS 2
#define FP_TOKENS 6
#define fv_load(p) _mm256_load_ps(p)
#define fv_loadu(p) _mm256_loadu_ps(p)
#define fv_storeu(p, v) _mm256_storeu_ps(p, v)
#define fv_set1(f) _mm256_set1_ps(f)
#define fv_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define fv_add(a, b) _mm256_add_ps(a, b)
#define fv_zero() _mm256_setzero_ps()
#define fv_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define fv_bf16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))

/* 8 x 8: pairs of rows interleaved, then quadruples, then the 128-bit halves swapped across them. */
static inline __attribute__((always_inline)) void fv_transpose(__m256 v[8]) {
    __m256 t[8], q[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int g = 0; g < 8; g += 4) { /* q[g + j], 128-bit half h: rows g..g+3, value 4 h + j */
        q[g + 0] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
        q[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xee);
        q[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
        q[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xee);
    }
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_permute2f128_ps(q[j], q[4 + j], 0x20);
        v[4 + j] = _mm256_permute2f128_ps(q[j], q[4 + j], 0x31);
    }
}

#include "float_x86.h"

_Static_assert(FP_ROWS == FLOAT_PANEL_ROWS_AVX2, "the kernel table hands out runs of FLOAT_PANEL_ROWS_AVX2 rows");
FLOAT_PANEL_FN(ember_float_panel_avx2)

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
