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

/* 16 x 16: pairs of rows interleaved, then quadruples; then lanes of 128 bits gathered across them. */
static inline __attribute__((always_inline)) void fv_transpose(__m512 v[16]) {
    __m512 t[16], q[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) { /* q[g + j], 128-bit lane L: rows g..g+3, value 4 L + j */
        q[g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[g]), _mm512_castps_pd(t[g + 2])));
        q[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[g]), _mm512_castps_pd(t[g + 2])));
        q[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[g + 1]), _mm512_castps_pd(t[g + 3])));
        q[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[g + 1]), _mm512_castps_pd(t[g + 3])));
    }
    for (int j = 0; j < 4; j++) {
        const __m512 a = _mm512_shuffle_f32x4(q[j], q[4 + j], 0x88), b = _mm512_shuffle_f32x4(q[8 + j], q[12 + j], 0x88);
        const __m512 c = _mm512_shuffle_f32x4(q[j], q[4 + j], 0xdd), d = _mm512_shuffle_f32x4(q[8 + j], q[12 + j], 0xdd);
        v[j] = _mm512_shuffle_f32x4(a, b, 0x88);
        v[8 + j] = _mm512_shuffle_f32x4(a, b, 0xdd);
        v[4 + j] = _mm512_shuffle_f32x4(c, d, 0x88);
        v[12 + j] = _mm512_shuffle_f32x4(c, d, 0xdd);
    }
}

#include "float_x86.h"

_Static_assert(FP_ROWS == FLOAT_PANEL_ROWS_AVX512, "the kernel table hands out runs of FLOAT_PANEL_ROWS_AVX512 rows");
FLOAT_PANEL_FN(ember_float_panel_avx512)

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
