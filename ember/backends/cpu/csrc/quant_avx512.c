/* AVX-512 kernels (x86-64 only; F/BW/VL/DQ + VNNI, chosen at run time when the CPU has them).
 *
 * Few tokens: the microtiles of quant_x86.h on 256-bit vectors with VNNI doing the integer dots, and
 * for Q4_K, Q5_K and Q6_K rows 512-bit ones (below); one token against lone Q8_0 and Q5_0 rows, two
 * blocks a 512-bit step (below).
 * Many tokens (prompts): packed panels. 16 rows of W are unpacked and interleaved so that one 512-bit
 * vector holds 4 consecutive weight bytes (the K-quants) or 2 int16 weights (the 32-value types) of
 * each of the 16 rows; a dpbusd (dpwssd) with the token's 4 bytes (2 int16) broadcast then adds 4 (2)
 * products to each row's lane. Every lane is one output, so there are no horizontal sums, and each
 * block's float scaling serves 16 rows at once. The panel is packed once and swept by all the tokens. */
#include "quant.h"

#if defined(EMBER_X86)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#endif
#include <immintrin.h>

#define ALWAYS static inline __attribute__((always_inline))
/* The 32 products land in 16 lanes of a 512-bit dpwssd, folded to 8. */
ALWAYS __m256i dot_w8_c16(__m256i w, const int16_t *c) {
    __m512i p = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_cvtepi8_epi16(w), _mm512_loadu_si512((const void *)c));
    return _mm256_add_epi32(_mm512_castsi512_si256(p), _mm512_extracti64x4_epi64(p, 1));
}

ALWAYS __m256i dot_u8_s8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }

ALWAYS __m256i dot_u8_s8_acc(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }

ALWAYS __m256i dot2w_acc(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }

ALWAYS __m256i q5_high_bits(uint32_t qh) { return _mm256_maskz_set1_epi8((__mmask32)qh, 0x10); }

/* bytes [64 i, 64 i + 64) of the first n at p, zeros past n (masked: never reads past n) */
ALWAYS __m512i load64_upto(const uint8_t *p, int i, int n) {
    int left = n - 64 * i;
    if (left <= 0) return _mm512_setzero_si512();
    __mmask64 k = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
    return _mm512_maskz_loadu_epi8(k, p + 64 * i);
}

/* bytes [0, n) at p, zeros past n (masked: never reads past n) */
ALWAYS __m256i load32_upto(const uint8_t *p, int n) {
    if (n <= 0) return _mm256_setzero_si256();
    return n >= 32 ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi8(((__mmask32)1 << n) - 1, p);
}

/* block_scales8 for blocks of at most 20 bytes (Q4_0, Q4_1, IQ4_NL) in 256-bit vectors only: 512-bit
 * instructions close a vector port to the rest of the loop on Intel cores, and the decode microtiles
 * of those types are bound by vector instructions. Blocks 0-3 lie in the first 64 bytes, 4-7 in the
 * 64 from block 4; word lane j < 8 takes block j's first word (d), lane 8 + j the next (m). */
ALWAYS __m256 block_scales8_ymm(int bs, int mn, const uint8_t *p, int g, __m256 *m) {
    const int head = mn ? 4 : 2;
    const __m256i lane = _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i blk = _mm256_and_si256(lane, _mm256_set1_epi16(3));
    const __m256i idx = _mm256_add_epi16(_mm256_mullo_epi16(blk, _mm256_set1_epi16((short)(bs / 2))),
                                         _mm256_srli_epi16(lane, 3));
    const int na = (EMBER_MIN(g, 4) - 1) * bs + head, nb = (g - 5) * bs + head;
    __m256i v = _mm256_permutex2var_epi16(load32_upto(p, na), idx, load32_upto(p + 32, na - 32));
    if (g > 4) {
        const uint8_t *q = p + 4 * bs;
        v = _mm256_mask_blend_epi16(0xf0f0, v, _mm256_permutex2var_epi16(load32_upto(q, nb), idx, load32_upto(q + 32, nb - 32)));
    }
    const __mmask16 valid = (__mmask16)(((1u << g) - 1) | ((1u << g) - 1) << 8);
    v = _mm256_maskz_mov_epi16(valid, v);
    if (mn) *m = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
    return _mm256_cvtph_ps(_mm256_castsi256_si128(v));
}

/* The blocks' first words picked out of the loaded bytes with word permutes (gathers are slow on
 * AMD): word lane j < 8 takes word j * bs/2 (d), lane 8 + j the word after it (m). */
ALWAYS __m256 block_scales8(int bs, int mn, const uint8_t *p, int g, __m256 *m) {
    if (bs <= 20) return block_scales8_ymm(bs, mn, p, g, m);
    const int n = (g - 1) * bs + (mn ? 4 : 2), last_word = 7 * bs / 2 + (mn ? 1 : 0);
    const __m512i lane = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x000f000e, 0x000d000c, 0x000b000a, 0x00090008,
                                          0x00070006, 0x00050004, 0x00030002, 0x00010000);
    const __m512i j = _mm512_and_si512(lane, _mm512_set1_epi16(7)), hi = _mm512_srli_epi16(lane, 3);
    const __m512i idx = _mm512_add_epi16(_mm512_mullo_epi16(j, _mm512_set1_epi16((short)(bs / 2))), hi);
    __m512i v = _mm512_permutex2var_epi16(load64_upto(p, 0, n), idx, load64_upto(p, 1, n));
    if (last_word >= 64) { /* words 64.. come from the next 128 bytes */
        __m512i v2 = _mm512_permutex2var_epi16(load64_upto(p, 2, n), idx, load64_upto(p, 3, n));
        v = _mm512_mask_blend_epi16(_mm512_cmpge_epi16_mask(idx, _mm512_set1_epi16(64)), v, v2);
    }
    const __m512i zero_past_g = _mm512_set1_epi16((short)g);
    v = _mm512_maskz_mov_epi16(_mm512_cmplt_epi16_mask(j, zero_past_g), v);
    if (mn) *m = _mm256_cvtph_ps(_mm512_extracti32x4_epi32(v, 1));
    return _mm256_cvtph_ps(_mm512_castsi512_si128(v));
}

/* From this many tokens the exact Q4_0 / Q4_1 / Q8_0 products take rows in lanes (so always: see matmul.c). */
#define LANES_MIN_TOKENS 1
#define X86_TILE_Q4_0 {tile_q4_0, TILE32_R, TILE_C, SHORT_ROW_BYTES, NULL, lanes_q4_0, LANES_MIN_TOKENS}
#define X86_TILE_Q4_1 {tile_q4_1, TILE32_R, TILE_C, SHORT_ROW_BYTES, NULL, lanes_q4_1, LANES_MIN_TOKENS}
#define X86_TILE_Q8_0 {tile_q8_0, TILE32_R, TILE_C, SHORT_ROW_BYTES, NULL, lanes_q8_0, LANES_MIN_TOKENS}
#define X86_TILE_Q4_K {tile_q4_k_zmm, 1, TILE_C, 0, rows_q4_k_zmm}
#define X86_TILE_Q5_K {tile_q5_k_zmm, 1, TILE_C, 0, rows_q5_k_zmm}
#define X86_TILE_Q6_K {tile_q6_k_zmm, 1, TILE_C, 0, rows_q6_k_zmm}
/* Q8_0 and Q5_0 rows against one token's int8 activations: two blocks a 512-bit step (below). */
static void rows_q5_0_zmm(int64_t k, const void *w, int64_t ws, const void *a, float *y, int64_t n_rows);
#define X86_Q5_0_ROWS rows_q5_0_zmm
static void q8_0_row_zmm(int64_t k, const uint8_t *w, const uint8_t *a, float *y);
static void rows_q8_0_zmm(int64_t k, const void *w, int64_t ws, const void *a, float *y, int64_t n_rows);
#define X86_Q8_0_ROW q8_0_row_zmm
#define X86_Q8_0_ROWS rows_q8_0_zmm

#include "quant_x86.h"

/* ================= Q4_K, Q5_K and Q6_K rows on 512-bit vectors ================= */
/* The decode products of the K-quant files people run. A vector holds 64 weights of a row: for Q4_K /
 * Q5_K two 32-value sub-blocks (the low and high nibbles of the same 32 bytes), for Q6_K four 16-value
 * groups; the activations of those 64 values are contiguous, so one load serves them. dpbusd sums them
 * four products a lane (small enough for 16 bits), two such vectors are packed to words, and one
 * multiply-add takes each word times its sub-block's (group's) integer scale, picked into place by a word
 * permute, into int32 lanes; per super-block one float FMA. Against maddubs + dpwssd per 64 values with a
 * permute each, this is 1.2x (Q4_K) and 1.07-1.09x (Q6_K) the rate on one core (bench/NOTES.md). */

/* words 0-15 take word lo, 16-31 word hi */
ALWAYS __m512i pick2_words(int lo, int hi) {
    return _mm512_mask_blend_epi16(0xffff0000u, _mm512_set1_epi16((short)lo), _mm512_set1_epi16((short)hi));
}

/* 32 bytes at p in both halves of a vector */
ALWAYS __m512i both_halves(const uint8_t *p) { return _mm512_broadcast_i64x4(load256(p)); }

/* Bytes v -> their low nibbles in the vector's low half, their high nibbles in its high half (the Q4_K and
 * Q5_K layout: 32 bytes hold sub-block 2i in their low nibbles, 2i + 1 in their high ones, both halves of v
 * the same 32 bytes). With GFNI one affine transform does it: each 64-bit lane of m holds the bit matrix of
 * "and 0x0f" (low half) or "shift right by 4" (high half). Written as assembly so that the rest of the file
 * needs no GFNI; taken only where the CPU has it (ember_x86_gfni). */
ALWAYS __m512i k32_nibbles(const int gfni, __m512i v) {
    if (gfni) {
        const __m512i m = _mm512_set_epi64(0x1020408000000000LL, 0x1020408000000000LL, 0x1020408000000000LL,
                                           0x1020408000000000LL, 0x0102040800000000LL, 0x0102040800000000LL,
                                           0x0102040800000000LL, 0x0102040800000000LL);
        __m512i u;
        __asm__("vgf2p8affineqb $0, %2, %1, %0" : "=v"(u) : "v"(v), "v"(m));
        return u;
    }
    return _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xffff0000u, v, 4), _mm512_set1_epi8(0x0f));
}

/* The values of piece i (64 weights: sub-blocks 2i and 2i + 1) of a Q4_K / Q5_K super-block, as bytes */
ALWAYS __m512i k32_values(const int five, const int gfni, const uint8_t *qs, __m512i qh, int i) {
    __m512i u = k32_nibbles(gfni, both_halves(qs + 32 * i));
    if (five) { /* bit 2i of qh[l] tops sub-block 2i, bit 2i + 1 sub-block 2i + 1 */
        const __m512i hb = _mm512_srlv_epi16(qh, pick2_words(2 * i, 2 * i + 1));
        u = _mm512_or_si512(u, _mm512_slli_epi16(_mm512_and_si512(hb, _mm512_set1_epi8(1)), 4));
    }
    return u;
}

/* packs_epi32(A, B) holds in its 128-bit chunk c A's lanes 4c..4c+3, then B's: for pieces 0 and 1 (A, B) those
 * are sub-blocks (c < 2 ? 0 : 1) and (c < 2 ? 2 : 3); pieces 2 and 3 add 4. Words of the scale vector for
 * them, from the 8 scales in words g0 .. g0 + 7 of `scales`. */
ALWAYS __m512i k32_pack_scales(__m512i scales, int g0) {
    const __m512i pick = _mm512_set_epi16(3, 3, 3, 3, 1, 1, 1, 1, 3, 3, 3, 3, 1, 1, 1, 1,
                                          2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0);
    return _mm512_permutexvar_epi16(_mm512_add_epi16(pick, _mm512_set1_epi16((short)g0)), scales);
}

/* A super-block's integer sums from its 4 pieces' dpbusd lanes (each a sum of 4 products, |.| <= 4 * 31 *
 * 128: a word holds it): two pieces' lanes packed to words, times their sub-blocks' scales by one multiply-add.
 * The one-row and the many-token kernels share it, so a token's sums have the same bits in both. */
ALWAYS __m512i k32_scaled(const __m512i s[4], __m512i sc01, __m512i sc23) {
    return _mm512_dpwssd_epi32(_mm512_madd_epi16(_mm512_packs_epi32(s[0], s[1]), sc01), _mm512_packs_epi32(s[2], s[3]), sc23);
}

/* Q4_K (five = 0) or Q5_K (five = 1) row x nc tokens -> y[c * ys]. Per 64 weights its values times each
 * token's by one dpbusd into lanes of 4-product sums; per super-block k32_scaled. */
ALWAYS void tilek32_zmm_body(const int five, int64_t k, const uint8_t *w, const uint8_t *a, int64_t as, float *y,
                             int64_t ys, const int nc) {
    const int64_t nb = k / QK_K;
    __m512 acc[TILE_C];
    __m256 accm[TILE_C];
    UNROLL for (int c = 0; c < nc; c++) acc[c] = _mm512_setzero_ps(), accm[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * (five ? sizeof(blk_q5_k) : sizeof(blk_q4_k));
        prefetch_ahead(blk, 3); /* 144 (Q5_K: 176) bytes a super-block */
        const blk_q4_k *x4 = (const blk_q4_k *)blk; /* Q5_K begins the same way */
        const blk_q5_k *x5 = (const blk_q5_k *)blk;
        const uint8_t *qs = five ? x5->qs : x4->qs; /* the header is the same */
        uint8_t sc[8], m[8];
        ember_q4k_scales(x4->scales, sc, m);
        const __m512i scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
        const __m128i mv = _mm_loadl_epi64((const __m128i *)m);
        const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mv, mv));
        const __m512i qh = five ? both_halves(x5->qh) : _mm512_setzero_si512();
        __m512i s[TILE_C][4];
        UNROLL for (int i = 0; i < 4; i++) {
            const __m512i u = k32_values(five, 0, qs, qh, i);
            UNROLL for (int c = 0; c < nc; c++)
                s[c][i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u,
                                              _mm512_loadu_si512((const void *)(a + c * as + b * QK_K + 64 * i)));
        }
        const __m512i sc01 = k32_pack_scales(scales, 0), sc23 = k32_pack_scales(scales, 4);
        const float d = f16_to_f32(x4->d), dmin = f16_to_f32(x4->dmin);
        UNROLL for (int c = 0; c < nc; c++) {
            const float *ad = (const float *)(a + c * as + k);
            const int16_t *bsums = (const int16_t *)(ad + nb);
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(k32_scaled(s[c], sc01, sc23)), _mm512_set1_ps(d * ad[b]), acc[c]);
            const __m256 msum = _mm256_cvtepi32_ps(_mm256_madd_epi16(mins16, load256(bsums + 16 * b)));
            accm[c] = _mm256_fmadd_ps(msum, _mm256_set1_ps(dmin * ad[b]), accm[c]);
        }
    }
    UNROLL for (int c = 0; c < nc; c++) y[c * ys] = _mm512_reduce_add_ps(acc[c]) - hsum8(accm[c]);
}

/* The lines of [p, p + bytes) that [p - bytes, p) does not touch, asked for into L2: each line of a stream of
 * blocks once. For Q6_K's 210-byte super-blocks this replaced 4 lines a block into L1 (prefetch_ahead), which
 * overlapped the next block's: those left the product after them reading ~25% slower for a millisecond or two
 * (the 8B's q/k/v after a Q6_K ffn_down: 20 against 28 GB/s), and the Q6_K products themselves read 7-15% faster
 * this way (bench/NOTES.md). */
#define PF_Q6K_BYTES 3072 /* Q6_K's distance: 8B down 2 KB 25.2-26.2 GB/s, 2.5 KB 26.7-27.7, 3 KB 26.7-28.7, 3.5 KB 26.1-26.9, 4 KB 27.0-27.6 */
ALWAYS void prefetch_new_lines(const uint8_t *p, int bytes) {
    const uintptr_t end = ((uintptr_t)p + bytes - 1) >> 6;
    for (uintptr_t l = (((uintptr_t)p - 1) >> 6) + 1; l <= end; l++) __builtin_prefetch((const void *)(l << 6), 0, 2);
}

/* Q6_K row x nc tokens -> y[c * ys]: values u - 32 with u = 4 bits of ql and 2 of qh; the 32 goes back
 * per super-block as -32 * sum_g scale_g * bsums_g, the starting value of the integer sums. */
ALWAYS void tilek_q6_zmm_body(int64_t k, const uint8_t *w, const uint8_t *a, int64_t as, float *y, int64_t ys,
                              const int nc) {
    const int64_t nb = k / QK_K;
    const __m512i low4 = _mm512_set1_epi8(0x0f), bits45 = _mm512_set1_epi8(0x30);
    const __m512i shl01 = pick2_words(4, 2), shr23 = pick2_words(0, 2);
    __m512 acc[TILE_C];
    UNROLL for (int c = 0; c < nc; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const blk_q6_k *x = (const blk_q6_k *)w + b;
        prefetch_new_lines((const uint8_t *)x + PF_Q6K_BYTES, sizeof(blk_q6_k)); /* 210 bytes a super-block */
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
        const __m512i scales = _mm512_castsi256_si512(sc16);
        __m512i iacc[TILE_C];
        UNROLL for (int c = 0; c < nc; c++) {
            const int16_t *bsums = (const int16_t *)((const float *)(a + c * as + k) + nb);
            __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(sc16, load256(bsums + 16 * b)), 5);
            iacc[c] = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), corr));
        }
        UNROLL for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(x->ql + 64 * h)), qh = both_halves(x->qh + 32 * h);
            const __m512i u01 = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                                _mm512_and_si512(_mm512_sllv_epi16(qh, shl01), bits45));
            const __m512i u23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                                _mm512_and_si512(_mm512_srlv_epi16(qh, shr23), bits45));
            /* packs_epi32(A, B), chunk c: A's lanes 4c..4c+3 (group 8h + c of 16 values), then B's (group 8h + 4 + c) */
            const __m512i sv = _mm512_permutexvar_epi16(
                _mm512_add_epi16(_mm512_set_epi16(7, 7, 7, 7, 3, 3, 3, 3, 6, 6, 6, 6, 2, 2, 2, 2,
                                                  5, 5, 5, 5, 1, 1, 1, 1, 4, 4, 4, 4, 0, 0, 0, 0),
                                 _mm512_set1_epi16((short)(8 * h))), scales);
            UNROLL for (int c = 0; c < nc; c++) {
                const uint8_t *q = a + c * as + b * QK_K + 128 * h;
                /* 4-product sums of 6-bit values: |s| <= 4 * 63 * 128, a word holds them */
                const __m512i sa = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u01, _mm512_loadu_si512((const void *)q));
                const __m512i sb = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u23, _mm512_loadu_si512((const void *)(q + 64)));
                iacc[c] = _mm512_dpwssd_epi32(iacc[c], _mm512_packs_epi32(sa, sb), sv);
            }
        }
        const float d = f16_to_f32(x->d);
        UNROLL for (int c = 0; c < nc; c++) {
            const float *ad = (const float *)(a + c * as + k);
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[c]), _mm512_set1_ps(d * ad[b]), acc[c]);
        }
    }
    UNROLL for (int c = 0; c < nc; c++) y[c * ys] = _mm512_reduce_add_ps(acc[c]);
}

#define K_ZMM_TILE(fname, CALL)                                                                               \
    static void fname(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, float *y, int64_t ys, \
                      int nr, int nc) {                                                                       \
        (void)ws, (void)nr;                                                                                   \
        switch (nc) {                                                                                         \
        case 1: CALL(1); return;                                                                              \
        case 2: CALL(2); return;                                                                              \
        case 3: CALL(3); return;                                                                              \
        default: CALL(4); return;                                                                             \
        }                                                                                                     \
    }

#define Q4K_CALL(NC) tilek32_zmm_body(0, k, w, a, as, y, ys, NC)
#define Q5K_CALL(NC) tilek32_zmm_body(1, k, w, a, as, y, ys, NC)
#define Q6K_CALL(NC) tilek_q6_zmm_body(k, w, a, as, y, ys, NC)
K_ZMM_TILE(tile_q4_k_zmm, Q4K_CALL)
K_ZMM_TILE(tile_q5_k_zmm, Q5K_CALL)
K_ZMM_TILE(tile_q6_k_zmm, Q6K_CALL)

/* Two Q4_K (five = 0) or Q5_K (five = 1) rows w0, w1 against one token -> y0, y1, each with the bits
 * tilek32_zmm_body gives it. A super-block of a row takes 4 dpbusd, 2 packs, 2 scale permutes and 2
 * multiply-adds (k32_scaled), where the earlier kernel took 4 maddubs, 4 permutes and 4 dpwssd. The work that
 * does not scale with the weights is done for both rows at once: their 12-byte scale headers unpacked side
 * by side in the two halves of one 256-bit vector (vector shifts and masks instead of scalar ones), widened
 * to words by one conversion, their four f16 factors converted together, their mins against the token's
 * block sums taken by one multiply-add, and the token's activations loaded once. */
ALWAYS void tilek32_pair_zmm(const int five, const int gfni, int64_t k, const uint8_t *w0, const uint8_t *w1,
                             const uint8_t *a, float *y0, float *y1) {
    const int64_t nb = k / QK_K, bs = five ? sizeof(blk_q5_k) : sizeof(blk_q4_k);
    const __m256i m3f = _mm256_set1_epi8(0x3f), m30 = _mm256_set1_epi8(0x30), m0f = _mm256_set1_epi8(0x0f);
    const __m256i shift_hi = _mm256_setr_epi32(0, 4, 0, 0, 0, 4, 0, 0);
    /* words 2j, 2j + 1 of each half take m_j: row 0's mins (words 8-15) low, row 1's (24-31) high */
    const __m512i pick_mins = _mm512_set_epi16(31, 31, 30, 30, 29, 29, 28, 28, 27, 27, 26, 26, 25, 25, 24, 24,
                                               15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    const __m512i pick_dmin = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
    const float *ad = (const float *)(a + k);
    const int16_t *bsums = (const int16_t *)(ad + nb);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps(), accm = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *b0 = w0 + b * bs, *b1 = w1 + b * bs;
        /* dwords a0, a1, a2 of each header (and 4 bytes of what follows, unused) */
        const __m256i h = _mm256_loadu2_m128i((const __m128i *)((const blk_q4_k *)b1)->scales,
                                              (const __m128i *)((const blk_q4_k *)b0)->scales);
        const __m256i lo = _mm256_and_si256(h, m3f); /* dwords 0, 1: sc 0-3, m 0-3 */
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi32(h, 0xaa), shift_hi), m0f),
                                           _mm256_and_si256(_mm256_srli_epi32(h, 2), m30)); /* dwords 0, 1: sc 4-7, m 4-7 */
        /* words 0-7 row 0's sc, 8-15 its m, 16-23 row 1's sc, 24-31 its m */
        const __m512i scales = _mm512_cvtepu8_epi16(_mm256_unpacklo_epi32(lo, hi));
        /* d0, dmin0, d1, dmin1 times the token's d */
        const __m128 dd = _mm_mul_ps(_mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128((int)load_u32(b0)),
                                                                     _mm_cvtsi32_si128((int)load_u32(b1)))),
                                     _mm_set1_ps(ad[b]));
        const __m512 ddz = _mm512_castps128_ps512(dd);
        const __m512i ms = _mm512_madd_epi16(_mm512_permutexvar_epi16(pick_mins, scales),
                                             _mm512_broadcast_i64x4(load256(bsums + 16 * b)));
        accm = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_permutexvar_ps(pick_dmin, ddz), accm);
        const uint8_t *qs0 = five ? ((const blk_q5_k *)b0)->qs : ((const blk_q4_k *)b0)->qs;
        const uint8_t *qs1 = five ? ((const blk_q5_k *)b1)->qs : ((const blk_q4_k *)b1)->qs;
        const __m512i qh0 = five ? both_halves(((const blk_q5_k *)b0)->qh) : _mm512_setzero_si512();
        const __m512i qh1 = five ? both_halves(((const blk_q5_k *)b1)->qh) : _mm512_setzero_si512();
        __m512i s0[4], s1[4];
        UNROLL for (int i = 0; i < 4; i++) {
            const __m512i q = _mm512_loadu_si512((const void *)(a + b * QK_K + 64 * i));
            s0[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k32_values(five, gfni, qs0, qh0, i), q);
            s1[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), k32_values(five, gfni, qs1, qh1, i), q);
        }
        const __m512i i0 = k32_scaled(s0, k32_pack_scales(scales, 0), k32_pack_scales(scales, 4));
        const __m512i i1 = k32_scaled(s1, k32_pack_scales(scales, 16), k32_pack_scales(scales, 20));
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_set1_ps(_mm_cvtss_f32(dd)), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_permutexvar_ps(_mm512_set1_epi32(2), ddz), acc1);
    }
    *y0 = _mm512_reduce_add_ps(acc0) - hsum8(_mm512_castps512_ps256(accm));
    *y1 = _mm512_reduce_add_ps(acc1) - hsum8(_mm512_extractf32x8_ps(accm, 1));
}

/* A thread's run of lone rows against one token, in one call: rows i and h + i (h = n_rows / 2) in pairs,
 * two sequential streams as ROWS_IN_STREAMS walks them; an odd last row paired with itself, so that a row's
 * sum is the same wherever the run splits. */
ALWAYS void rows_k32_run(const int five, const int gfni, int64_t k, const uint8_t *w, int64_t ws, const uint8_t *a,
                         float *y, int64_t n_rows) {
    const int64_t h = n_rows / 2;
    for (int64_t i = 0; i < h; i++) tilek32_pair_zmm(five, gfni, k, w + i * ws, w + (h + i) * ws, a, y + i, y + h + i);
    if (n_rows & 1) {
        float twin;
        const uint8_t *wl = w + (n_rows - 1) * ws;
        tilek32_pair_zmm(five, gfni, k, wl, wl, a, y + n_rows - 1, &twin);
    }
}

/* The run with GFNI's nibble split where the CPU has it, both builds inlined. */
ALWAYS void rows_k32_zmm(const int five, int64_t k, const uint8_t *w, int64_t ws, const uint8_t *a, float *y,
                         int64_t n_rows) {
    if (ember_x86_gfni) rows_k32_run(five, 1, k, w, ws, a, y, n_rows);
    else rows_k32_run(five, 0, k, w, ws, a, y, n_rows);
}

static void rows_q4_k_zmm(int64_t k, const void *w, int64_t ws, const void *a, float *y, int64_t n_rows) {
    rows_k32_zmm(0, k, (const uint8_t *)w, ws, (const uint8_t *)a, y, n_rows);
}

static void rows_q5_k_zmm(int64_t k, const void *w, int64_t ws, const void *a, float *y, int64_t n_rows) {
    rows_k32_zmm(1, k, (const uint8_t *)w, ws, (const uint8_t *)a, y, n_rows);
}

static void rows_q6_k_zmm(int64_t k, const void *w, int64_t ws, const void *a, float *y, int64_t n_rows) {
    ROWS_IN_STREAMS(n_rows, r, tilek_q6_zmm_body(k, (const uint8_t *)w + r * ws, a, 0, y + r, 0, 1));
}

/* ================= Q8_0 and Q5_0 rows against one token's int8 activations ================= */
/* Gemma 3's decode: its Q8_0 output head (262,144 rows of 640) and its Q5_0 q/k/v and gate/up products
 * (440-byte rows). Two blocks a 512-bit step: their 64 weights in one vector as unsigned bytes u = w + off
 * (Q8_0: w xor 0x80, off 128; Q5_0: the nibbles with the fifth bit added in as 16, off 16), so that one
 * dpbusd multiplies them with the activations, the offset taken back by starting the sums at
 * -off * (the sums of 4 activations); the blocks' two f16 scales picked into the vector's halves by one
 * word permute and converted together. The starting sums and the pairs' activation scales d_a depend on
 * the token only: a run of rows forms them once. Per pair of blocks Q8_0 takes 9 vector operations
 * and Q5_0 12, where the 256-bit kernels of quant_x86.h take 8-11 a block. Either alone left the decode
 * as fast as before; the two together made it faster (bench/NOTES.md). */

#define ROW_PAIRS 128 /* pairs of blocks whose terms a run forms once (rows up to 8192 values) */

typedef struct {
    __m512i base; /* -off * the sums of 4 consecutive activations of the pair */
    __m512 da;    /* lanes 0-7 the first block's d_a, 8-15 the second's */
} row_pair;

/* The terms of pair j for stored values w + off: blocks 2j and 2j + 1, or 2j alone (two = 0; the
 * second block's terms zero). */
ALWAYS row_pair row_pair_terms(const uint8_t *a, int64_t q8, const float *ad, int64_t j, const int off, const int two) {
    const uint8_t *q = a + q8 + 64 * j;
    const __m512i qa = two ? _mm512_loadu_si512((const void *)q) : _mm512_zextsi256_si512(load256(q));
    const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8((char)off), qa);
    const __m512 d = _mm512_insertf32x8(_mm512_set1_ps(ad[2 * j]), _mm256_set1_ps(two ? ad[2 * j + 1] : 0.0f), 1);
    return (row_pair){_mm512_sub_epi32(_mm512_setzero_si512(), s), d};
}

/* Words 0-7 take word 0 (the first block's d), 8-15 word bs / 2 (the second's). */
ALWAYS __m512i pick_pair_d(const int bs) {
    const long long w = 0x0001000100010001LL * (bs / 2);
    return _mm512_set_epi64(0, 0, 0, 0, w, w, 0, 0);
}

/* The pair's integer sums (from t's starting sums) scaled by d_w * d_a into f. */
ALWAYS __m512 pair_scaled(const int bs, __m512i u, __m512i q, __m512i head, const row_pair *t, __m512 f) {
    const __m512i dot = _mm512_dpbusd_epi32(t->base, u, q);
    const __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(pick_pair_d(bs), head)));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, t->da), f);
}

/* The activations of the pair at qa; alone, the second half zero. */
ALWAYS __m512i pair_act(const uint8_t *qa, const int two) {
    return two ? _mm512_loadu_si512((const void *)qa) : _mm512_zextsi256_si512(load256(qa));
}

/* A pair of Q8_0 blocks at p against the token (its int8 values at qa), from its terms t, into f; a
 * block alone (two = 0) has 0x80 (zero) weights, d and activations in the second half. */
ALWAYS __m512 q8_0_pair(const uint8_t *p, const uint8_t *qa, const row_pair *t, __m512 f, const int two) {
    const __m512i wq = two ? _mm512_inserti64x4(_mm512_castsi256_si512(load256(p + 2)), load256(p + 36), 1)
                           : _mm512_zextsi256_si512(load256(p + 2));
    const __m512i head = two ? _mm512_loadu_si512((const void *)p) : _mm512_castsi128_si512(_mm_cvtsi32_si128(load_u16(p)));
    return pair_scaled(sizeof(blk_q8_0), _mm512_xor_si512(wq, _mm512_set1_epi8((char)0x80)), pair_act(qa, two), head, t, f);
}

/* A pair of Q5_0 blocks at p, as q8_0_pair: each block's 16 bytes of nibbles in two 128-bit lanes, the
 * high nibbles shifted down in the second, the fifth bits of both blocks one 64-bit mask. */
ALWAYS __m512 q5_0_pair(const uint8_t *p, const uint8_t *qa, const row_pair *t, __m512 f, const int two) {
    const __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + 6)));
    __m512i v;
    __mmask64 fifth;
    if (two) {
        v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + 28))), 1);
        fifth = (__mmask64)load_u32(p + 2) | (__mmask64)load_u32(p + 24) << 32;
    } else {
        v = _mm512_zextsi256_si512(lo);
        fifth = (__mmask64)load_u32(p + 2);
    }
    __m512i u = _mm512_and_si512(_mm512_mask_srli_epi16(v, 0xff00ff00u, v, 4), _mm512_set1_epi8(0x0f));
    u = _mm512_mask_add_epi8(u, fifth, u, _mm512_set1_epi8(0x10));
    const __m512i head = two ? _mm512_castsi256_si512(load256(p)) : _mm512_castsi128_si512(_mm_cvtsi32_si128(load_u16(p)));
    return pair_scaled(sizeof(blk_q5_0), u, pair_act(qa, two), head, t, f);
}

/* One row (Q8_0 or Q5_0) against one token: terms, the pairs' row_pair_terms (NULL: formed here), two
 * sums, the row's lines asked for pf bytes ahead at its start, as the 256-bit kernels. */
ALWAYS void row_pairs_body(const int type, int64_t k, const uint8_t *w, const uint8_t *a, const row_pair *terms, float *y) {
    const int q5 = type == EMBER_T_Q5_0, bs = q5 ? (int)sizeof(blk_q5_0) : (int)sizeof(blk_q8_0), off = q5 ? 16 : 0x80;
    const int64_t pf = q5 ? PF_BYTES : PF32_ROW_BYTES;
    const int64_t nb = k / QK, np = nb / 2, q8 = ember_q16_q8_offset(k);
    const float *ad = (const float *)(a + ember_q16_d_offset(k));
    for (int64_t o = 0; o < nb * bs; o += 64) __builtin_prefetch(w + pf + o);
    __m512 f0 = _mm512_setzero_ps(), f1 = _mm512_setzero_ps();
    row_pair t;
#define PAIR(j, two, f) \
    (f = (q5 ? q5_0_pair : q8_0_pair)(w + (j) * 2 * bs, a + q8 + 64 * (j), \
                                      terms ? &terms[j] : (t = row_pair_terms(a, q8, ad, j, off, two), &t), f, two))
    int64_t j = 0;
    for (; j + 2 <= np; j += 2) {
        PAIR(j, 1, f0);
        PAIR(j + 1, 1, f1);
    }
    if (j < np) PAIR(j, 1, f0);
    if (nb & 1) PAIR(np, 0, f1);
#undef PAIR
    *y = _mm512_reduce_add_ps(_mm512_add_ps(f0, f1));
}

/* A thread's run of lone rows against one token, the pairs' terms formed once where they fit. */
ALWAYS void row_pairs_run(const int type, int64_t k, const void *w, int64_t ws, const void *a, float *y, int64_t n_rows) {
    const int64_t nb = k / QK, np = nb / 2, q8 = ember_q16_q8_offset(k);
    const int off = type == EMBER_T_Q5_0 ? 16 : 0x80;
    const float *ad = (const float *)((const uint8_t *)a + ember_q16_d_offset(k));
    if (np + (nb & 1) > ROW_PAIRS) {
        ROWS_IN_STREAMS(n_rows, r, row_pairs_body(type, k, (const uint8_t *)w + r * ws, a, NULL, y + r));
        return;
    }
    row_pair terms[ROW_PAIRS];
    for (int64_t j = 0; j < np; j++) terms[j] = row_pair_terms(a, q8, ad, j, off, 1);
    if (nb & 1) terms[np] = row_pair_terms(a, q8, ad, np, off, 0);
    ROWS_IN_STREAMS(n_rows, r, row_pairs_body(type, k, (const uint8_t *)w + r * ws, a, terms, y + r));
}

static void rows_q8_0_zmm(int64_t k, const void *w, int64_t ws, const void *a, float *y, int64_t n_rows) {
    row_pairs_run(EMBER_T_Q8_0, k, w, ws, a, y, n_rows);
}

static void rows_q5_0_zmm(int64_t k, const void *w, int64_t ws, const void *a, float *y, int64_t n_rows) {
    row_pairs_run(EMBER_T_Q5_0, k, w, ws, a, y, n_rows);
}

/* A lone Q8_0 row against one token in a microtile (the last token of a few), its terms formed here. */
static void q8_0_row_zmm(int64_t k, const uint8_t *w, const uint8_t *a, float *y) {
    row_pairs_body(EMBER_T_Q8_0, k, w, a, NULL, y);
}

/* ================= rows in lanes: few-token products of the exact Q4_0 / Q4_1 / Q8_0 ================= */
/* (ember_lanes_fn) A group of 16 rows at a time: each block's weights of the 16 rows are widened to int16
 * and transposed in registers, so that vector j holds weights 2j, 2j + 1 of every row (a row a dword
 * lane); a token then costs 16 dpwssd against its int16 pairs broadcast, and one conversion and one FMA
 * (two for Q4_1's mins) for the block of all 16 rows, where a microtile pays them per row. The integer
 * sums are the microtiles' (a block's whole sum is converted at once: exact below 2^24, so for Q4_0 / Q4_1;
 * Q8_0's may round in its last bit, as in the panels). */

#define LANES_ROWS EMBER_LANES_ROWS

/* z[i] (i < 8): 8 dwords of row i in the low half, of row i + 8 in the high half -> out[j]: dword j of rows
 * 0..15. An 8x8 dword transpose in both halves, then a lane shuffle. */
ALWAYS void transpose16x8(const __m512i *z, __m512i *out) {
    const __m512i pick_lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
    const __m512i pick_hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    __m512i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);     /* rows i, i+1: dwords 0 1 | 4 5 */
        t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]); /* dwords 2 3 | 6 7 */
    }
    for (int h = 0; h < 8; h += 4) { /* rows h..h+3: u[h + j] holds dword j | dword j + 4 */
        u[h + 0] = _mm512_unpacklo_epi64(t[h], t[h + 2]);
        u[h + 1] = _mm512_unpackhi_epi64(t[h], t[h + 2]);
        u[h + 2] = _mm512_unpacklo_epi64(t[h + 1], t[h + 3]);
        u[h + 3] = _mm512_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    for (int j = 0; j < 4; j++) {
        out[j] = _mm512_permutex2var_epi64(u[j], pick_lo, u[j + 4]);
        out[j + 4] = _mm512_permutex2var_epi64(u[j], pick_hi, u[j + 4]);
    }
}

/* 16 bytes at p and at q in the low and high halves */
ALWAYS __m256i two16(const uint8_t *p, const uint8_t *q) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                   _mm_loadu_si128((const __m128i *)q), 1);
}

/* The weights of the block at byte ofs of the 16 rows rp[] as int16 pairs: w[j] holds weights 2j, 2j + 1
 * of every row (Q4_0 less its 8). A Q4 block's byte i holds weights i (low nibble) and 16 + i (high). */
ALWAYS void lanes_weights(const int type, const uint8_t *const *rp, int64_t ofs, __m512i *w) {
    __m512i z[8];
    if (type == EMBER_T_Q8_0) {
        for (int h = 0; h < 2; h++) {
            for (int i = 0; i < 8; i++) z[i] = _mm512_cvtepi8_epi16(two16(rp[i] + ofs + 2 + 16 * h, rp[i + 8] + ofs + 2 + 16 * h));
            transpose16x8(z, w + 8 * h);
        }
        return;
    }
    const int64_t qs = ofs + block_bytes(type) - 16;
    for (int i = 0; i < 8; i++) z[i] = _mm512_cvtepu8_epi16(two16(rp[i] + qs, rp[i + 8] + qs));
    __m512i v[8];
    transpose16x8(z, v);
    const __m512i low = _mm512_set1_epi16(0x0f), off = _mm512_set1_epi16(8);
    for (int j = 0; j < 8; j++) {
        w[j] = _mm512_and_si512(v[j], low);
        w[j + 8] = _mm512_srli_epi16(v[j], 4);
        if (type == EMBER_T_Q4_0) w[j] = _mm512_sub_epi16(w[j], off), w[j + 8] = _mm512_sub_epi16(w[j + 8], off);
    }
}

/* d (and m) of the block at byte ofs of the rows at byte offsets offs from g: one dword gathered a row */
ALWAYS __m512 lanes_scales(const int type, const uint8_t *g, __m512i offs, int64_t ofs, __m512 *m) {
    const __m512i dm = _mm512_i32gather_epi32(offs, (const void *)(g + ofs), 1);
    if (has_min(type)) *m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
}

/* W rows (n_rows, k/32 blocks) x nc activation rows (EMBER_ACT_Q16, exact) -> y[c * ys + r]. A block's
 * weights stay in 16 registers while the tokens pass over them (their sums wait in acc, on the stack past
 * what registers hold). Each group asks for the bytes of the group after next (16 contiguous rows) a
 * block's share at a time: the group walks 16 rows side by side, which the hardware prefetchers do not
 * follow (SmolLM2 tg 241-279 tok/s against 230-256 asking for the next group; bench/NOTES.md). */
ALWAYS void lanes_body(const int type, int64_t k, const uint8_t *w, int64_t ws, int64_t n_rows, const uint8_t *a,
                       int64_t as, const int nc, float *y, int64_t ys) {
    const int64_t nb = k / QK, bs = block_bytes(type), pf_lines = (LANES_ROWS * ws / nb + 63) / 64;
    for (int64_t r0 = 0; r0 < n_rows; r0 += LANES_ROWS) {
        const int nr = (int)EMBER_MIN((int64_t)LANES_ROWS, n_rows - r0);
        const uint8_t *g = w + r0 * ws, *next = g + 2 * LANES_ROWS * ws;
        const uint8_t *rp[LANES_ROWS];
        for (int i = 0; i < LANES_ROWS; i++) rp[i] = g + EMBER_MIN(i, nr - 1) * ws; /* lanes past nr: the last row again */
        const __m512i row = _mm512_min_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(nr - 1));
        const __m512i offs = _mm512_mullo_epi32(row, _mm512_set1_epi32((int)ws));
        __m512 acc[EMBER_LANES_TOKENS];
        for (int c = 0; c < nc; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            if (r0 + 2 * LANES_ROWS < n_rows)
                for (int64_t l = 0; l < pf_lines; l++) __builtin_prefetch(next + (b * pf_lines + l) * 64);
            __m512i wv[16];
            lanes_weights(type, rp, b * bs, wv);
            __m512 mw = _mm512_setzero_ps();
            const __m512 dw = lanes_scales(type, g, offs, b * bs, &mw);
            for (int c = 0; c < nc; c++) {
                const uint8_t *ta = a + c * as;
                const int32_t *c2 = (const int32_t *)ta + 16 * b; /* the block's int16 values in pairs */
                const float *ad = (const float *)(ta + ember_q16_d_offset(k)); /* d (nb,), s (nb,) */
                __m512i s0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv[0], _mm512_set1_epi32(c2[0]));
                __m512i s1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), wv[1], _mm512_set1_epi32(c2[1]));
                UNROLL for (int j = 2; j < 16; j += 2) {
                    s0 = _mm512_dpwssd_epi32(s0, wv[j], _mm512_set1_epi32(c2[j]));
                    s1 = _mm512_dpwssd_epi32(s1, wv[j + 1], _mm512_set1_epi32(c2[j + 1]));
                }
                const __m512 isum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
                acc[c] = _mm512_fmadd_ps(isum, _mm512_mul_ps(dw, _mm512_set1_ps(ad[b])), acc[c]);
                if (has_min(type)) acc[c] = _mm512_fmadd_ps(mw, _mm512_set1_ps(ad[nb + b]), acc[c]);
            }
        }
        const __mmask16 mask = (__mmask16)((1u << nr) - 1);
        for (int c = 0; c < nc; c++) _mm512_mask_storeu_ps(y + c * ys + r0, mask, acc[c]);
    }
}

#define DEFINE_LANES(fname, TYPE)                                                                              \
    static void fname(int64_t k, const void *w, int64_t ws, int64_t n_rows, const void *a, int64_t as, int nc, \
                      float *y, int64_t ys) {                                                                  \
        lanes_body(TYPE, k, w, ws, n_rows, a, as, nc, y, ys);                                                  \
    }

DEFINE_LANES(lanes_q4_0, EMBER_T_Q4_0)
DEFINE_LANES(lanes_q4_1, EMBER_T_Q4_1)
DEFINE_LANES(lanes_q8_0, EMBER_T_Q8_0)

/* ================= packed panels ================= */

#define PANEL_ROWS 16
#define PANEL_TOKENS 8           /* tokens per microkernel call: accumulators in registers */
#define PANEL_KMAX 2048          /* values of k packed at once (the panel lives on the stack) */
#define PANEL_ROW_BYTES (2 * PANEL_KMAX) /* a row of the unpacking buffer: int16 weights of the 32-value types */

/* Panel layout for chunks of CH values (CH = 32, or 16 for the K-quants with 16-value scales):
 *   w     (n_chunks, CH/4, 16 rows) uint32: 4 unsigned weight bytes (the K-quants), or
 *         (n_chunks, CH/2, 16 rows) uint32: 2 signed int16 weights (the 32-value block types)
 *   scale (n_chunks, 16 rows) f32;  mins (n_chunks, 16 rows) f32
 * A row's value is scale * (u - off) + min with off = 32 (Q3_K, Q6_K) or 128 (IQ4_XS), or min for the
 * types that have one;
 * the int16 weights are signed: scale * w + min. Rows are first unpacked one by one into rows
 * (16, PANEL_ROW_BYTES), reading each W row sequentially, then transposed 16 rows x 8 dwords at a time. */
typedef struct {
    uint32_t *w;
    float *scale, *mins;
    uint8_t *rows;
} panel;

ALWAYS int panel_chunk(int type) {
    return type == EMBER_T_Q2_K || type == EMBER_T_Q3_K || type == EMBER_T_Q6_K ? 16 : 32;
}

ALWAYS int panel_has_min(int type) {
    return type == EMBER_T_Q4_1 || type == EMBER_T_Q5_1 || type == EMBER_T_Q4_K || type == EMBER_T_Q5_K ||
           type == EMBER_T_Q2_K;
}

/* Row r of chunk c: its CH weight bytes (to the row buffer), scale and min. */
ALWAYS void put_chunk32(panel *p, int64_t c, int r, __m256i u, float scale, float min) {
    _mm256_store_si256((__m256i *)(p->rows + r * PANEL_ROW_BYTES + 32 * c), u);
    p->scale[c * PANEL_ROWS + r] = scale;
    p->mins[c * PANEL_ROWS + r] = min;
}

/* The row buffer's chunks [0, nch) -> p->w: per chunk, 16 rows x 8 dwords become 8 vectors of 16 rows
 * (rows 0-7 and 8-15 in the low and high halves, transposed by transpose16x8). */
static void transpose_chunks32(panel *p, int64_t nch) {
    for (int64_t c = 0; c < nch; c++) {
        __m512i z[8], v[8];
        for (int i = 0; i < 8; i++) {
            const uint8_t *row = p->rows + i * PANEL_ROW_BYTES + 32 * c;
            z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(load256(row)), load256(row + 8 * PANEL_ROW_BYTES), 1);
        }
        transpose16x8(z, v);
        uint32_t *out = p->w + c * 8 * PANEL_ROWS;
        for (int j = 0; j < 8; j++) _mm512_store_si512((void *)(out + j * PANEL_ROWS), v[j]);
    }
}

ALWAYS void put_chunk16(panel *p, int64_t c, int r, __m128i u, float scale, float min) {
    _mm_store_si128((__m128i *)(p->rows + r * PANEL_ROW_BYTES + 16 * c), u);
    p->scale[c * PANEL_ROWS + r] = scale;
    p->mins[c * PANEL_ROWS + r] = min;
}

/* As transpose_chunks32 for 16 rows x 4 dwords: with rows q, q+4, q+8, q+12 in the four 128-bit
 * lanes of z[q], two rounds of unpacks leave dword j of rows 4L..4L+3 in lane L of output j. */
static void transpose_chunks16(panel *p, int64_t nch) {
    for (int64_t c = 0; c < nch; c++) {
        __m512i z[4], t[4];
        for (int q = 0; q < 4; q++) {
            const uint8_t *row = p->rows + q * PANEL_ROW_BYTES + 16 * c;
            __m512i v = _mm512_castsi128_si512(_mm_load_si128((const __m128i *)row));
            v = _mm512_inserti32x4(v, _mm_load_si128((const __m128i *)(row + 4 * PANEL_ROW_BYTES)), 1);
            v = _mm512_inserti32x4(v, _mm_load_si128((const __m128i *)(row + 8 * PANEL_ROW_BYTES)), 2);
            z[q] = _mm512_inserti32x4(v, _mm_load_si128((const __m128i *)(row + 12 * PANEL_ROW_BYTES)), 3);
        }
        t[0] = _mm512_unpacklo_epi32(z[0], z[1]); /* rows 4L, 4L+1: dwords 0 1 */
        t[1] = _mm512_unpackhi_epi32(z[0], z[1]); /* dwords 2 3 */
        t[2] = _mm512_unpacklo_epi32(z[2], z[3]); /* rows 4L+2, 4L+3 */
        t[3] = _mm512_unpackhi_epi32(z[2], z[3]);
        uint32_t *out = p->w + c * 4 * PANEL_ROWS;
        _mm512_store_si512((void *)(out + 0 * PANEL_ROWS), _mm512_unpacklo_epi64(t[0], t[2]));
        _mm512_store_si512((void *)(out + 1 * PANEL_ROWS), _mm512_unpackhi_epi64(t[0], t[2]));
        _mm512_store_si512((void *)(out + 2 * PANEL_ROWS), _mm512_unpacklo_epi64(t[1], t[3]));
        _mm512_store_si512((void *)(out + 3 * PANEL_ROWS), _mm512_unpackhi_epi64(t[1], t[3]));
    }
}

/* The int8 panels' offset of a 32-value type: its weights are packed unsigned, u = w + offset (the
 * stored nibbles of Q4_0 and Q5_0; the signed bytes of Q8_0, IQ4_NL and MXFP4 with their top bit
 * flipped); 0 for the types with a min, whose stored values are already u. */
ALWAYS int panel8_offset(int type) {
    return type == EMBER_T_Q4_0 ? 8 : type == EMBER_T_Q5_0 ? 16 : has_min(type) ? 0 : 128;
}

/* Pack blocks [b0, b0 + nb) of one row (legacy 32-value blocks) as panel row r: 32 int16 weights
 * (64 bytes, two of put_chunk32's 32-byte pieces) per block, or for the int8 panels (i8) its 32 unsigned
 * weight bytes u (one chunk). */
ALWAYS void pack_row32(const int type, const int i8, const uint8_t *row, int64_t b0, int64_t nb, int r, panel *p) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + (b0 + b) * block_bytes(type);
        uint16_t dm[2]; /* every legacy block starts with d (MXFP4: an E8M0 byte); Q4_1 and Q5_1 then m */
        memcpy(dm, blk, 4);
        const float scale = type == EMBER_T_MXFP4 ? ember_e8m0_half(blk[0]) : f16_to_f32(dm[0]);
        const float min = has_min(type) ? f16_to_f32(dm[1]) : 0.0f;
        if (i8) {
            __m256i u = weights32_i8(type, blk);
            if (panel8_offset(type) == 128) u = _mm256_xor_si256(u, bytes(0x80));
            put_chunk32(p, b, r, u, scale, min);
            continue;
        }
        _mm512_store_si512((void *)(p->rows + r * PANEL_ROW_BYTES + 64 * b), _mm512_cvtepi8_epi16(weights32(type, blk)));
        p->scale[b * PANEL_ROWS + r] = scale;
        p->mins[b * PANEL_ROWS + r] = min;
    }
}

/* Super-blocks [b0, b0 + nb) of one row of Q4_K, Q5_K or IQ4_XS (8 chunks of 32 each). */
ALWAYS void pack_row_k32(const int type, const uint8_t *row, int64_t b0, int64_t nb, int r, panel *p) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + (b0 + b) * k_block_bytes(type);
        if (type == EMBER_T_IQ4_XS) {
            const blk_iq4_xs *x = (const blk_iq4_xs *)blk;
            float d = f16_to_f32(x->d);
            for (int j = 0; j < 8; j++)
                put_chunk32(p, b * 8 + j, r, _mm256_xor_si256(unpack_k32(type, blk, j), bytes(0x80)),
                            d * (float)ember_iq4xs_scale(x, j), 0.0f);
            continue;
        }
        const blk_q4_k *x = (const blk_q4_k *)blk; /* Q5_K begins the same way */
        float d = f16_to_f32(x->d), dmin = f16_to_f32(x->dmin);
        uint8_t sc[8], m[8];
        ember_q4k_scales(x->scales, sc, m);
        for (int j = 0; j < 8; j++)
            put_chunk32(p, b * 8 + j, r, unpack_k32(type, blk, j), d * (float)sc[j], -(dmin * (float)m[j]));
    }
}

/* Super-blocks of one row of Q2_K, Q3_K or Q6_K (16 chunks of 16 each). */
ALWAYS void pack_row_k16(const int type, const uint8_t *row, int64_t b0, int64_t nb, int r, panel *p) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + (b0 + b) * k_block_bytes(type);
        float scale[16], min[16] = {0};
        if (type == EMBER_T_Q2_K) {
            const blk_q2_k *x = (const blk_q2_k *)blk;
            float d = f16_to_f32(x->d), dmin = f16_to_f32(x->dmin);
            for (int g = 0; g < 16; g++) {
                scale[g] = d * (float)(x->scales[g] & 0xf);
                min[g] = -(dmin * (float)(x->scales[g] >> 4));
            }
        } else if (type == EMBER_T_Q3_K) {
            const blk_q3_k *x = (const blk_q3_k *)blk;
            int8_t sc[16];
            ember_q3k_scales(x->scales, sc);
            for (int g = 0; g < 16; g++) scale[g] = f16_to_f32(x->d) * (float)sc[g];
        } else {
            const blk_q6_k *x = (const blk_q6_k *)blk;
            for (int g = 0; g < 16; g++) scale[g] = f16_to_f32(x->d) * (float)x->scales[g];
        }
        for (int j = 0; j < 8; j++) {
            __m256i u = unpack_k16(type, blk, j); /* Q3_K: w + 4, moved to w + 32 as Q6_K's */
            if (type == EMBER_T_Q3_K) u = _mm256_add_epi8(u, bytes(28));
            put_chunk16(p, b * 16 + 2 * j, r, _mm256_castsi256_si128(u), scale[2 * j], min[2 * j]);
            put_chunk16(p, b * 16 + 2 * j + 1, r, _mm256_extracti128_si256(u, 1), scale[2 * j + 1], min[2 * j + 1]);
        }
    }
}

/* i8: the 32-value types for the int8 panels. */
static void pack_row(int type, int i8, const uint8_t *row, int64_t b0, int64_t nb, int r, panel *p) {
    switch (type) {
    case EMBER_T_Q4_0: pack_row32(EMBER_T_Q4_0, i8, row, b0, nb, r, p); break;
    case EMBER_T_Q4_1: pack_row32(EMBER_T_Q4_1, i8, row, b0, nb, r, p); break;
    case EMBER_T_Q5_0: pack_row32(EMBER_T_Q5_0, i8, row, b0, nb, r, p); break;
    case EMBER_T_Q5_1: pack_row32(EMBER_T_Q5_1, i8, row, b0, nb, r, p); break;
    case EMBER_T_Q8_0: pack_row32(EMBER_T_Q8_0, i8, row, b0, nb, r, p); break;
    case EMBER_T_IQ4_NL: pack_row32(EMBER_T_IQ4_NL, i8, row, b0, nb, r, p); break;
    case EMBER_T_MXFP4: pack_row32(EMBER_T_MXFP4, i8, row, b0, nb, r, p); break;
    case EMBER_T_Q4_K: pack_row_k32(EMBER_T_Q4_K, row, b0, nb, r, p); break;
    case EMBER_T_Q5_K: pack_row_k32(EMBER_T_Q5_K, row, b0, nb, r, p); break;
    case EMBER_T_IQ4_XS: pack_row_k32(EMBER_T_IQ4_XS, row, b0, nb, r, p); break;
    case EMBER_T_Q2_K: pack_row_k16(EMBER_T_Q2_K, row, b0, nb, r, p); break;
    case EMBER_T_Q3_K: pack_row_k16(EMBER_T_Q3_K, row, b0, nb, r, p); break;
    default: pack_row_k16(EMBER_T_Q6_K, row, b0, nb, r, p); break;
    }
}

/* Activation rows as the panel kernels read them. */
typedef struct {
    const uint8_t *a;  /* (n, a_stride) */
    int64_t a_stride;
    int64_t d, sums, off; /* byte offsets in a row: scales (per chunk, or per super-block), the sums of q as
                             floats (for mins) and the weight offsets' terms (int32), per chunk; the int8
                             panels of the 32-value types: off is the weights' offset itself */
    int64_t q8, qsum;     /* those panels' int8 values and their int32 block sums */
} act_rows;

ALWAYS act_rows act_rows_for(int type, const void *a, int64_t as, int64_t k) {
    if (ember_qtype_get(type)->act == EMBER_ACT_Q16)
        return (act_rows){a, as, ember_q16_d_offset(k), ember_q16_s_offset(k), panel8_offset(type), ember_q16_q8_offset(k),
                          ember_q16_qsum_offset(k)};
    const int ch = panel_chunk(type);
    return (act_rows){a, as, ember_q8k_d_offset(k), ch == 16 ? ember_q8k_sum16_offset(k) : ember_q8k_sum32_offset(k),
                      ch == 16 ? ember_q8k_off16_offset(k) : ember_q8k_off32_offset(k), 0, 0};
}

/* Chunk i of the panel against token row ta: the integer sum, starting from the offset term
 * (-off * sum(q), or 0 for the types with mins), as floats. */
ALWAYS __m512 chunk_dot(const int CH, const int MIN, const __m512i *w, const uint8_t *ta, const act_rows *act,
                        int64_t ci) {
    __m512i isum = MIN ? _mm512_setzero_si512() : _mm512_set1_epi32(((const int32_t *)(ta + act->off))[ci]);
    const int32_t *q4 = (const int32_t *)(ta + ci * CH);
    UNROLL for (int j = 0; j < CH / 4; j++) isum = _mm512_dpbusd_epi32(isum, w[j], _mm512_set1_epi32(q4[j]));
    return _mm512_cvtepi32_ps(isum);
}

ALWAYS void load_chunk(const int CH, const panel *p, int64_t i, __m512i *w) {
    UNROLL for (int j = 0; j < CH / 4; j++) w[j] = _mm512_load_si512((const void *)(p->w + (i * (CH / 4) + j) * PANEL_ROWS));
}

ALWAYS void store_tile(const int tc, __m512 *acc, float *y, int64_t ys, __mmask16 mask, int accumulate) {
    UNROLL for (int c = 0; c < tc; c++) {
        float *yc = y + c * ys;
        if (accumulate) acc[c] = _mm512_add_ps(acc[c], _mm512_maskz_loadu_ps(mask, yc));
        _mm512_mask_storeu_ps(yc, mask, acc[c]);
    }
}

/* 32-value blocks: y[c * ys + lane] (+)= the chunks [ch0, ch0 + nch) of 16 rows x tc tokens from t0,
 * for lanes in mask; each chunk has its own activation scale d. The int16 weights meet the int16
 * activations two at a time (dpwssd), or in the int8 panels (I8: activations rounded as llama.cpp) the
 * unsigned weight bytes meet the token's int8 values four at a time (dpbusd: half the instructions), each
 * block's integer sum starting from -offset * sum(q) (the qsum field). The integer sums are the same
 * either way, so are the results. */
ALWAYS void panel_tile_legacy(const int I8, const int MIN, const int tc, const panel *p, int64_t ch0, int64_t nch,
                              const act_rows *act, int64_t t0, float *y, int64_t ys, __mmask16 mask,
                              int accumulate) {
    __m512 acc[PANEL_TOKENS];
    UNROLL for (int c = 0; c < tc; c++) acc[c] = _mm512_setzero_ps();
    const int32_t off = -act->off;
    for (int64_t i = 0; i < nch; i++) {
        const int64_t ci = ch0 + i;
        __m512i w[16];
        if (I8) load_chunk(32, p, i, w);
        else UNROLL for (int j = 0; j < 16; j++) w[j] = _mm512_load_si512((const void *)(p->w + (i * 16 + j) * PANEL_ROWS));
        const __m512 scale = _mm512_load_ps(p->scale + i * PANEL_ROWS);
        const __m512 mins = MIN ? _mm512_load_ps(p->mins + i * PANEL_ROWS) : _mm512_setzero_ps();
        UNROLL for (int c = 0; c < tc; c++) {
            const uint8_t *ta = act->a + (t0 + c) * act->a_stride;
            __m512i isum;
            if (I8) {
                const int32_t *q4 = (const int32_t *)(ta + act->q8 + 32 * ci);
                isum = MIN ? _mm512_setzero_si512() : _mm512_set1_epi32(off * ((const int32_t *)(ta + act->qsum))[ci]);
                UNROLL for (int j = 0; j < 8; j++) isum = _mm512_dpbusd_epi32(isum, w[j], _mm512_set1_epi32(q4[j]));
            } else {
                const int32_t *c2 = (const int32_t *)(ta + 64 * ci); /* the chunk's int16 values in pairs */
                isum = _mm512_setzero_si512();
                UNROLL for (int j = 0; j < 16; j++) isum = _mm512_dpwssd_epi32(isum, w[j], _mm512_set1_epi32(c2[j]));
            }
            const __m512 da = _mm512_set1_ps(((const float *)(ta + act->d))[ci]);
            acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scale, da), acc[c]);
            if (MIN) acc[c] = _mm512_fmadd_ps(mins, _mm512_set1_ps(((const float *)(ta + act->sums))[ci]), acc[c]);
        }
    }
    store_tile(tc, acc, y + t0 * ys, ys, mask, accumulate);
}

/* Super-blocks: the chunks' scaled sums gather in part[] over a super-block, which the token's scale
 * d (one per 256 values) then multiplies once. ch0 and nch are whole super-blocks. */
ALWAYS void panel_tile_k(const int CH, const int MIN, const int tc, const panel *p, int64_t ch0,
                         int64_t nch, const act_rows *act, int64_t t0, float *y, int64_t ys, __mmask16 mask,
                         int accumulate) {
    const int cps = QK_K / CH; /* chunks per super-block */
    __m512 acc[PANEL_TOKENS], part[PANEL_TOKENS];
    UNROLL for (int c = 0; c < tc; c++) acc[c] = _mm512_setzero_ps();
    for (int64_t i0 = 0; i0 < nch; i0 += cps) {
        UNROLL for (int c = 0; c < tc; c++) part[c] = _mm512_setzero_ps();
        for (int64_t i = i0; i < i0 + cps; i++) {
            const int64_t ci = ch0 + i;
            __m512i w[8];
            load_chunk(CH, p, i, w);
            const __m512 scale = _mm512_load_ps(p->scale + i * PANEL_ROWS);
            const __m512 mins = MIN ? _mm512_load_ps(p->mins + i * PANEL_ROWS) : _mm512_setzero_ps();
            UNROLL for (int c = 0; c < tc; c++) {
                const uint8_t *ta = act->a + (t0 + c) * act->a_stride;
                part[c] = _mm512_fmadd_ps(chunk_dot(CH, MIN, w, ta, act, ci), scale, part[c]);
                if (MIN) part[c] = _mm512_fmadd_ps(mins, _mm512_set1_ps(((const float *)(ta + act->sums))[ci]), part[c]);
            }
        }
        const int64_t sb = (ch0 + i0) / cps;
        UNROLL for (int c = 0; c < tc; c++) {
            const float *da = (const float *)(act->a + (t0 + c) * act->a_stride + act->d);
            acc[c] = _mm512_fmadd_ps(part[c], _mm512_set1_ps(da[sb]), acc[c]);
        }
    }
    store_tile(tc, acc, y + t0 * ys, ys, mask, accumulate);
}

#define PANEL_TILE_CASE(CALL, TC) case TC: CALL; return
#define PANEL_TILE_CASES(BODY, ...)                                                                           \
    switch (tc) {                                                                                             \
        PANEL_TILE_CASE(BODY(__VA_ARGS__, 1, p, ch0, nch, act, t0, y, ys, mask, accumulate), 1);       \
        PANEL_TILE_CASE(BODY(__VA_ARGS__, 2, p, ch0, nch, act, t0, y, ys, mask, accumulate), 2);       \
        PANEL_TILE_CASE(BODY(__VA_ARGS__, 3, p, ch0, nch, act, t0, y, ys, mask, accumulate), 3);       \
        PANEL_TILE_CASE(BODY(__VA_ARGS__, 4, p, ch0, nch, act, t0, y, ys, mask, accumulate), 4);       \
        PANEL_TILE_CASE(BODY(__VA_ARGS__, 5, p, ch0, nch, act, t0, y, ys, mask, accumulate), 5);       \
        PANEL_TILE_CASE(BODY(__VA_ARGS__, 6, p, ch0, nch, act, t0, y, ys, mask, accumulate), 6);       \
        PANEL_TILE_CASE(BODY(__VA_ARGS__, 7, p, ch0, nch, act, t0, y, ys, mask, accumulate), 7);       \
    default:                                                                                                  \
        PANEL_TILE_CASE(BODY(__VA_ARGS__, 8, p, ch0, nch, act, t0, y, ys, mask, accumulate), 8);       \
    }

typedef void (*panel_tiles_fn)(int tc, const panel *p, int64_t ch0, int64_t nch, const act_rows *act,
                               int64_t t0, float *y, int64_t ys, __mmask16 mask, int accumulate);

#define DEFINE_PANEL_TILES(fname, BODY, ...)                                                                  \
    static void fname(int tc, const panel *p, int64_t ch0, int64_t nch, const act_rows *act,      \
                      int64_t t0, float *y, int64_t ys, __mmask16 mask, int accumulate) {                    \
        PANEL_TILE_CASES(BODY, __VA_ARGS__)                                                                   \
    }

DEFINE_PANEL_TILES(panel_tiles_legacy, panel_tile_legacy, 0, 0)
DEFINE_PANEL_TILES(panel_tiles_legacy_min, panel_tile_legacy, 0, 1)
DEFINE_PANEL_TILES(panel_tiles_legacy8, panel_tile_legacy, 1, 0)
DEFINE_PANEL_TILES(panel_tiles_legacy8_min, panel_tile_legacy, 1, 1)
DEFINE_PANEL_TILES(panel_tiles_k32, panel_tile_k, 32, 0)
DEFINE_PANEL_TILES(panel_tiles_k32_min, panel_tile_k, 32, 1)
DEFINE_PANEL_TILES(panel_tiles_k16, panel_tile_k, 16, 0)
DEFINE_PANEL_TILES(panel_tiles_k16_min, panel_tile_k, 16, 1)

/* i8: the int8 panels of a 32-value type. */
static panel_tiles_fn panel_tiles_for(int type, int i8) {
    const int min = panel_has_min(type);
    if (i8) return min ? panel_tiles_legacy8_min : panel_tiles_legacy8;
    if (ember_qtype_get(type)->act == EMBER_ACT_Q16) return min ? panel_tiles_legacy_min : panel_tiles_legacy;
    if (panel_chunk(type) == 32) return min ? panel_tiles_k32_min : panel_tiles_k32;
    return min ? panel_tiles_k16_min : panel_tiles_k16;
}

/* W rows (nrows, k) -> y[t * ys + r] for t < n: each panel of 16 rows is packed once per k-slice of at
 * most PANEL_KMAX values, and every token is swept over it. i8: the 32-value types' int8 panels. */
ALWAYS void panel_matmul_body(const int i8, int type, int64_t k, const void *w, int64_t ws, int64_t nrows, const void *a,
                              int64_t as, int64_t n, float *y, int64_t ys) {
    _Alignas(64) uint8_t buf[2 * PANEL_ROWS * PANEL_ROW_BYTES + 2 * 4 * PANEL_ROWS * (PANEL_KMAX / 16)];
    const int CH = panel_chunk(type);
    const int legacy = ember_qtype_get(type)->act == EMBER_ACT_Q16;
    const int qk = ember_qtype_get(type)->block_size;
    const panel_tiles_fn tiles = panel_tiles_for(type, i8);
    const act_rows act = act_rows_for(type, a, as, k);
    panel p = {(uint32_t *)buf, (float *)(buf + PANEL_ROWS * PANEL_ROW_BYTES), NULL, NULL};
    p.mins = p.scale + PANEL_ROWS * (PANEL_KMAX / 16);
    p.rows = (uint8_t *)(p.mins + PANEL_ROWS * (PANEL_KMAX / 16));
    for (int64_t r0 = 0; r0 < nrows; r0 += PANEL_ROWS) {
        const int nr = (int)EMBER_MIN((int64_t)PANEL_ROWS, nrows - r0);
        const __mmask16 mask = (__mmask16)((1u << nr) - 1);
        for (int64_t k0 = 0; k0 < k; k0 += PANEL_KMAX) {
            const int64_t kn = EMBER_MIN((int64_t)PANEL_KMAX, k - k0), nch = kn / CH;
            if (nr < PANEL_ROWS) memset(buf, 0, sizeof buf); /* lanes past nr: zeros, not garbage */
            for (int r = 0; r < nr; r++) pack_row(type, i8, (const uint8_t *)w + (r0 + r) * ws, k0 / qk, kn / qk, r, &p);
            if (legacy && !i8) transpose_chunks32(&p, 2 * nch); /* int16 weights: two 32-byte pieces a chunk */
            else if (CH == 32) transpose_chunks32(&p, nch);
            else transpose_chunks16(&p, nch);
            for (int64_t t = 0; t < n; t += PANEL_TOKENS) {
                int tc = (int)EMBER_MIN((int64_t)PANEL_TOKENS, n - t);
                tiles(tc, &p, k0 / CH, nch, &act, t, y + r0, ys, mask, k0 > 0);
            }
        }
    }
}

static void panel_matmul(int type, int64_t k, const void *w, int64_t ws, int64_t nrows, const void *a, int64_t as,
                         int64_t n, float *y, int64_t ys) {
    panel_matmul_body(0, type, k, w, ws, nrows, a, as, n, y, ys);
}

/* The 32-value types against activations rounded as llama.cpp (their int8 q and block sums). */
static void panel_matmul8(int type, int64_t k, const void *w, int64_t ws, int64_t nrows, const void *a, int64_t as,
                          int64_t n, float *y, int64_t ys) {
    panel_matmul_body(1, type, k, w, ws, nrows, a, as, n, y, ys);
}

#define PANEL_F(min_tokens) {ember_float_panel_avx512, FLOAT_PANEL_ROWS_AVX512, min_tokens}

#define PANEL(min_tokens) {panel_matmul, PANEL_ROWS, min_tokens}
#define PANEL8(min_tokens) {panel_matmul8, PANEL_ROWS, min_tokens}

/* The token counts from which packing pays (measured on Zen 4, k = 576 .. 2048; the float panels on a Xeon).
 * Q4_0, Q4_1 and Q8_0 take the panels only against rows rounded as llama.cpp (from INT8_TILE_TOKENS, matmul.c):
 * against exact rows their rows in lanes beat both microtiles and panels (SmolLM2's shapes, 2 threads: the
 * Q8_0 head at 8 / 48 / 512 tokens 1.3-1.7 / 6.9 / 76 ms against 4.0-4.2 / 13.4 / 130 in panels, its Q4_1
 * gate 45-48 / 231 / 2585 us against 79 in microtiles / 377 / 3834 in panels; bench/NOTES.md). */
const ember_kernels ember_kernels_avx512 = {
    X86_QUANTIZE_AND_TILES,
    .panel = {
        [EMBER_T_Q4_0] = PANEL(20), [EMBER_T_Q4_1] = PANEL(20), [EMBER_T_Q5_0] = PANEL(6),
        [EMBER_T_Q5_1] = PANEL(6), [EMBER_T_Q8_0] = PANEL(6), [EMBER_T_IQ4_NL] = PANEL(6), [EMBER_T_MXFP4] = PANEL(6),
        [EMBER_T_Q4_K] = PANEL(8), [EMBER_T_Q5_K] = PANEL(8), [EMBER_T_IQ4_XS] = PANEL(8),
        [EMBER_T_Q2_K] = PANEL(20), [EMBER_T_Q3_K] = PANEL(20), [EMBER_T_Q6_K] = PANEL(20),
        [EMBER_T_F16] = PANEL_F(8), [EMBER_T_BF16] = PANEL_F(8), [EMBER_T_F32] = PANEL_F(8),
    },
    /* Against the int8 microtiles from 4 tokens (Gemma 3's Q5_0 and Q8_0 shapes, 2 threads; 2048 x 2048 Q4_1
     * and Q8_0 alike), from 6 for the nibble types without a min, whose microtiles are cheapest (Q4_0 2048 x
     * 2048: 4 tokens 0.19 ms in microtiles against 0.23 in panels, 6 tokens 0.29 against 0.23; bench/NOTES.md). */
    .panel8 = {
        [EMBER_T_Q4_0] = PANEL8(6), [EMBER_T_Q4_1] = PANEL8(4), [EMBER_T_Q5_0] = PANEL8(4), [EMBER_T_Q5_1] = PANEL8(4),
        [EMBER_T_Q8_0] = PANEL8(4), [EMBER_T_IQ4_NL] = PANEL8(6), [EMBER_T_MXFP4] = PANEL8(4),
    },
};

#if defined(__clang__)
#pragma clang attribute pop
#endif

#else
const ember_kernels ember_kernels_avx512 = {0};
#endif
