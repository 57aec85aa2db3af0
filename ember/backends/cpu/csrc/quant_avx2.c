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
#define X86_VNNI 0
#define TILE32_R 2 /* 16 registers: 2 short rows x 4 tokens of accumulators */

ALWAYS __m256i dot4_acc(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

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

#define X86_ROW_Q8_0_C16 /* row_q8_0_c16 below: lone Q8_0 rows take it (quant_x86.h) */

#include "quant_x86.h"

/* One Q8_0 row (k/32 blocks) against one token's c16 = 256 q1 + q2 (quant.h) -> *y: the signed weights,
 * widened to 16 bits, meet c16 in two vpmaddwd per block, instead of a sign-fixed vpmaddubsw pair per
 * level plus the level arithmetic (the AVX-512 file does the same with one vpdpwssd). Each int32 lane
 * sums four products (|sum| <= 4 * 128 * 32639 < 2^24), so it converts to float exactly. */
static void row_q8_0_c16(int64_t k, const uint8_t *w, const uint8_t *a, int64_t ar, float *y) {
    const int64_t nb = k / QK;
    const int16_t *c16 = (const int16_t *)(a + ember_act_q8_c16_offset(k)); /* (k,) */
    const float *d2 = (const float *)(a + ar + k);                            /* (nb,) residual-level scales */
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk_q8_0 *bl = (const blk_q8_0 *)w + b;
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)bl->qs));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(bl->qs + 16)));
        const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(w0, load256(c16 + 32 * b)),
                                           _mm256_madd_epi16(w1, load256(c16 + 32 * b + 16)));
        const __m256 sc = _mm256_set1_ps(f16_to_f32(bl->d) * d2[b]);
        if (b & 1) acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc, acc1);
        else acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc, acc0);
    }
    *y = hsum8(_mm256_add_ps(acc0, acc1));
}


const ember_kernels ember_kernels_avx2 = {X86_QUANTIZE_AND_TILES};

#if defined(__clang__)
#pragma clang attribute pop
#endif

#else
const ember_kernels ember_kernels_avx2 = {0};
#endif
