/* AVX-512 prompt kernel for float weights (float_x86.h): panels of 32 rows (2 vectors), tiles of
 * 32 rows x 8 tokens: 16 accumulators, 2 panel loads and 8 broadcasts per 16 FMAs. */
#include <string.h>

#include "quant.h"

#if defined(EMBER_X86)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#endif
#include <immintrin.h>

typedef __m512 fvec;
#define FP_LANES 16
#define FP_VECS 2
#define FP_TOKENS 8
#define fv_load(p) _mm512_load_ps(p)
#define fv_loadu(p) _mm512_loadu_ps(p)
#define fv_storeu(p, v) _mm512_storeu_ps(p, v)
#define fv_set1(f) _mm512_set1_ps(f)
#define fv_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define fv_add(a, b) _mm512_add_ps(a, b)
#define fv_zero() _mm512_setzero_ps()
#define fv_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define fv_bf16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))

#include "transpose_avx512.h"
#define fv_transpose(v) ember_transpose16_ps(v)

#include "float_x86.h"

_Static_assert(FP_ROWS == FLOAT_PANEL_ROWS_AVX512, "the kernel table hands out runs of FLOAT_PANEL_ROWS_AVX512 rows");
FLOAT_PANEL_FN(ember_float_panel_avx512)

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
