/* AVX2 + FMA + F16C kernels (x86-64 only; chosen at run time when the CPU has them). */
#include "quant.h"

#if defined(EMBER_X86)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif
#include <immintrin.h>

#define ALWAYS static inline __attribute__((always_inline))
#define TILE32_R 2 /* 16 registers: 2 short rows x 4 tokens of accumulators */

ALWAYS __m256i dot_w8_c16(__m256i w, const int16_t *c) {
    __m256i lo = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(w)), _mm256_loadu_si256((const __m256i *)c));
    __m256i hi = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(w, 1)),
                                   _mm256_loadu_si256((const __m256i *)(c + 16)));
    return _mm256_add_epi32(lo, hi);
}

ALWAYS __m256i dot_u8_s8(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }

ALWAYS __m256i dot_u8_s8_acc(__m256i acc, __m256i u, __m256i s) { return _mm256_add_epi32(acc, dot_u8_s8(u, s)); }

ALWAYS __m256i dot2w_acc(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }

ALWAYS __m256i q5_high_bits(uint32_t qh) {
    /* byte i takes byte i / 8 of qh, then keeps bit i % 8 */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

ALWAYS __m256 block_scales8(int bs, int mn, const uint8_t *p, int g, __m256 *m) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(g), lane);
    __m256i v = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)p,
                                            _mm256_mullo_epi32(lane, _mm256_set1_epi32(bs)), valid, 1);
    /* low halves of the 8 dwords to the low 128 bits, high halves to the high 128 bits */
    const __m256i pick = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                          0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pick), 0xd8);
    if (mn) *m = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
    return _mm256_cvtph_ps(_mm256_castsi256_si128(v));
}

#include "quant_x86.h"

#define PANEL_F(min_tokens) {ember_float_panel_avx2, FLOAT_PANEL_ROWS_AVX2, min_tokens}

const ember_kernels ember_kernels_avx2 = {
    X86_QUANTIZE_AND_TILES,
    .panel = {[EMBER_T_F16] = PANEL_F(8), [EMBER_T_BF16] = PANEL_F(8), [EMBER_T_F32] = PANEL_F(8)},
};

#if defined(__clang__)
#pragma clang attribute pop
#endif

#else
const ember_kernels ember_kernels_avx2 = {0};
#endif
