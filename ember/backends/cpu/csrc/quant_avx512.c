/* AVX-512 kernels (x86-64 only; F/BW/VL/DQ + VNNI, chosen at run time when the CPU has them).
 *
 * Few tokens: the microtiles of quant_x86.h on 256-bit vectors, with dpbusd/dpwssd doing the integer
 * dots (on Zen 4 a 512-bit op costs two 256-bit ones, and decoding is bound by memory anyway).
 * Many tokens (prompts): packed panels. 16 rows of W are unpacked into bytes and interleaved so that
 * one 512-bit vector holds 4 consecutive weights of each of the 16 rows; a dpbusd with 4 activation
 * bytes broadcast then adds 4 products to each row's lane. Every lane is one output, so there are no
 * horizontal sums, and each block's float scaling serves 16 rows at once. The panel is packed once
 * and swept by all the tokens; a token's residual row (two-level activations) is dotted with the same
 * loaded weights right after its main row. */
#include "quant.h"

#if defined(EMBER_X86)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#endif
#include <immintrin.h>

#define ALWAYS static inline __attribute__((always_inline))
#define X86_VNNI 1

ALWAYS __m256i dot4_acc(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }

ALWAYS __m256i dot2w_acc(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }

ALWAYS __m256i q5_high_bits(uint32_t qh) { return _mm256_maskz_set1_epi8((__mmask32)qh, 0x10); }

/* bytes [64 i, 64 i + 64) of the first n at p, zeros past n (masked: never reads past n) */
ALWAYS __m512i load64_upto(const uint8_t *p, int i, int n) {
    int left = n - 64 * i;
    if (left <= 0) return _mm512_setzero_si512();
    __mmask64 k = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
    return _mm512_maskz_loadu_epi8(k, p + 64 * i);
}

/* The blocks' first words picked out of the loaded bytes with word permutes (gathers are slow on
 * AMD): word lane j < 8 takes word j * bs/2 (d), lane 8 + j the word after it (m). */
ALWAYS __m256 block_scales8(int bs, int mn, const uint8_t *p, int g, __m256 *m) {
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

#define X86_ROW_Q8_0_C16 /* row_q8_0_c16 below: lone Q8_0 rows take it (quant_x86.h) */

#include "quant_x86.h"

/* ================= Q8_0 rows against both activation levels at once ================= */

/* One Q8_0 row (k/32 blocks) against one token's c16 = 256 q1 + q2 (quant.h) -> *y. The signed weights,
 * widened to 16 bits, meet c16 in one dpwssd per block instead of a dpbusd per level plus the offset
 * and level arithmetic: output heads (262144 x 640 in Gemma 3) were bound by that integer work, not by
 * memory. Each int32 lane sums two products (|sum| < 2^24), so it converts to float exactly. */
static void row_q8_0_c16(int64_t k, const uint8_t *w, const uint8_t *a, int64_t ar, float *y) {
    const int64_t nb = k / QK;
    const int16_t *c16 = (const int16_t *)(a + ember_act_q8_c16_offset(k)); /* (k,) */
    const float *d2 = (const float *)(a + ar + k);                            /* (nb,) residual-level scales */
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const blk_q8_0 *b0 = (const blk_q8_0 *)w + b, *b1 = b0 + 1;
        __m512i s0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_cvtepi8_epi16(load256(b0->qs)),
                                         _mm512_load_si512((const void *)(c16 + 32 * b)));
        __m512i s1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_cvtepi8_epi16(load256(b1->qs)),
                                         _mm512_load_si512((const void *)(c16 + 32 * b + 32)));
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(f16_to_f32(b0->d) * d2[b]), acc0);
        acc1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_set1_ps(f16_to_f32(b1->d) * d2[b + 1]), acc1);
    }
    if (b < nb) {
        const blk_q8_0 *b0 = (const blk_q8_0 *)w + b;
        __m512i s0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_cvtepi8_epi16(load256(b0->qs)),
                                         _mm512_load_si512((const void *)(c16 + 32 * b)));
        acc0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(f16_to_f32(b0->d) * d2[b]), acc0);
    }
    *y = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}


/* ================= packed panels ================= */

#define PANEL_ROWS 16
#define PANEL_TOKENS 8           /* tokens per microkernel call: accumulators in registers */
#define PANEL_KMAX 2048          /* values of k packed at once (the panel lives on the stack) */
#define PANEL_ACT_BYTES (768 * 1024) /* quantized activations swept per packing, about L2 */

/* Panel layout for chunks of CH values (CH = 32, or 16 for the K-quants with 16-value scales):
 *   w     (n_chunks, CH/4, 16 rows) uint32: 4 unsigned weight bytes
 *   scale (n_chunks, 16 rows) f32;  mins (n_chunks, 16 rows) f32
 * A row's value is scale * (u - off) + min with off = 2^shift (or min, for the types that have one).
 * Rows are first unpacked one by one into rows (16, PANEL_KMAX) bytes, reading each W row
 * sequentially, then transposed 16 rows x CH/4 dwords at a time. */
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

/* log2 of the weight offset of the types without a min */
static int panel_shift(int type) {
    switch (type) {
    case EMBER_T_Q4_0: return 3;
    case EMBER_T_Q5_0: return 4;
    case EMBER_T_Q3_K: return 2;
    case EMBER_T_Q6_K: return 5;
    default: return 7; /* Q8_0, IQ4_NL, IQ4_XS: signed bytes + 128 */
    }
}

/* Row r of chunk c: its CH weight bytes (to the row buffer), scale and min. */
ALWAYS void put_chunk32(panel *p, int64_t c, int r, __m256i u, float scale, float min) {
    _mm256_store_si256((__m256i *)(p->rows + r * PANEL_KMAX + 32 * c), u);
    p->scale[c * PANEL_ROWS + r] = scale;
    p->mins[c * PANEL_ROWS + r] = min;
}

/* The row buffer's chunks [0, nch) -> p->w: per chunk, 16 rows x 8 dwords become 8 vectors of 16 rows.
 * Rows 0-7 and 8-15 share each 512-bit vector (low and high halves); an 8x8 dword transpose in
 * both halves, then a lane shuffle, puts dword j of all 16 rows in one vector. */
static void transpose_chunks32(panel *p, int64_t nch) {
    const __m512i pick_lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);
    const __m512i pick_hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int64_t c = 0; c < nch; c++) {
        __m512i z[8], t[8], u[8];
        for (int i = 0; i < 8; i++) {
            const uint8_t *row = p->rows + i * PANEL_KMAX + 32 * c;
            z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(load256(row)), load256(row + 8 * PANEL_KMAX), 1);
        }
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
        uint32_t *out = p->w + c * 8 * PANEL_ROWS;
        for (int j = 0; j < 4; j++) {
            _mm512_store_si512((void *)(out + j * PANEL_ROWS), _mm512_permutex2var_epi64(u[j], pick_lo, u[j + 4]));
            _mm512_store_si512((void *)(out + (j + 4) * PANEL_ROWS), _mm512_permutex2var_epi64(u[j], pick_hi, u[j + 4]));
        }
    }
}

ALWAYS void put_chunk16(panel *p, int64_t c, int r, __m128i u, float scale, float min) {
    _mm_store_si128((__m128i *)(p->rows + r * PANEL_KMAX + 16 * c), u);
    p->scale[c * PANEL_ROWS + r] = scale;
    p->mins[c * PANEL_ROWS + r] = min;
}

/* As transpose_chunks32 for 16 rows x 4 dwords: with rows q, q+4, q+8, q+12 in the four 128-bit
 * lanes of z[q], two rounds of unpacks leave dword j of rows 4L..4L+3 in lane L of output j. */
static void transpose_chunks16(panel *p, int64_t nch) {
    for (int64_t c = 0; c < nch; c++) {
        __m512i z[4], t[4];
        for (int q = 0; q < 4; q++) {
            const uint8_t *row = p->rows + q * PANEL_KMAX + 16 * c;
            __m512i v = _mm512_castsi128_si512(_mm_load_si128((const __m128i *)row));
            v = _mm512_inserti32x4(v, _mm_load_si128((const __m128i *)(row + 4 * PANEL_KMAX)), 1);
            v = _mm512_inserti32x4(v, _mm_load_si128((const __m128i *)(row + 8 * PANEL_KMAX)), 2);
            z[q] = _mm512_inserti32x4(v, _mm_load_si128((const __m128i *)(row + 12 * PANEL_KMAX)), 3);
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

/* Pack blocks [b0, b0 + nb) of one row (legacy 32-value blocks) as panel row r. */
ALWAYS void pack_row32(const int type, const uint8_t *row, int64_t b0, int64_t nb, int r, panel *p) {
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + (b0 + b) * block_bytes(type);
        uint16_t dm[2]; /* every legacy block starts with d; Q4_1 and Q5_1 then m */
        memcpy(dm, blk, 4);
        put_chunk32(p, b, r, weights32(type, blk), f16_to_f32(dm[0]), has_min(type) ? f16_to_f32(dm[1]) : 0.0f);
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
            __m256i u = unpack_k16(type, blk, j);
            put_chunk16(p, b * 16 + 2 * j, r, _mm256_castsi256_si128(u), scale[2 * j], min[2 * j]);
            put_chunk16(p, b * 16 + 2 * j + 1, r, _mm256_extracti128_si256(u, 1), scale[2 * j + 1], min[2 * j + 1]);
        }
    }
}

static void pack_row(int type, const uint8_t *row, int64_t b0, int64_t nb, int r, panel *p) {
    switch (type) {
    case EMBER_T_Q4_0: pack_row32(EMBER_T_Q4_0, row, b0, nb, r, p); break;
    case EMBER_T_Q4_1: pack_row32(EMBER_T_Q4_1, row, b0, nb, r, p); break;
    case EMBER_T_Q5_0: pack_row32(EMBER_T_Q5_0, row, b0, nb, r, p); break;
    case EMBER_T_Q5_1: pack_row32(EMBER_T_Q5_1, row, b0, nb, r, p); break;
    case EMBER_T_Q8_0: pack_row32(EMBER_T_Q8_0, row, b0, nb, r, p); break;
    case EMBER_T_IQ4_NL: pack_row32(EMBER_T_IQ4_NL, row, b0, nb, r, p); break;
    case EMBER_T_Q4_K: pack_row_k32(EMBER_T_Q4_K, row, b0, nb, r, p); break;
    case EMBER_T_Q5_K: pack_row_k32(EMBER_T_Q5_K, row, b0, nb, r, p); break;
    case EMBER_T_IQ4_XS: pack_row_k32(EMBER_T_IQ4_XS, row, b0, nb, r, p); break;
    case EMBER_T_Q2_K: pack_row_k16(EMBER_T_Q2_K, row, b0, nb, r, p); break;
    case EMBER_T_Q3_K: pack_row_k16(EMBER_T_Q3_K, row, b0, nb, r, p); break;
    default: pack_row_k16(EMBER_T_Q6_K, row, b0, nb, r, p); break;
    }
}

/* Activation rows as the panel kernel reads them: q, and per chunk dc, s, nq. */
typedef struct {
    const uint8_t *a; /* (n, a_stride) */
    int64_t a_stride, a_res; /* a_res: bytes from a row to its residual row (0: none) */
    int64_t meta_offset, n_chunks; /* chunks in a whole row */
} act_rows;

#define LEVELS 2

/* y[c * ys + lane] (+)= sum over chunks [ch0, ch0 + nch) of 16 rows x tc tokens (L rows each), for
 * lanes in mask. */
ALWAYS void panel_tile(const int CH, const int MIN, const int tc, const int L, int shift, const panel *p, int64_t ch0,
                       int64_t nch, const act_rows *act, int64_t t0, float *y, int64_t ys, __mmask16 mask,
                       int accumulate) {
    __m512 acc[PANEL_TOKENS];
    const uint8_t *q[PANEL_TOKENS][LEVELS];
    const float *dc[PANEL_TOKENS][LEVELS];
    UNROLL for (int c = 0; c < tc; c++) {
        acc[c] = _mm512_setzero_ps();
        UNROLL for (int l = 0; l < L; l++) {
            q[c][l] = act->a + (t0 + c) * act->a_stride + l * act->a_res;
            dc[c][l] = (const float *)(q[c][l] + act->meta_offset);
        }
    }
    const int64_t nc = act->n_chunks;
    for (int64_t i = 0; i < nch; i++) {
        const int64_t ci = ch0 + i; /* chunk index in the activation row */
        __m512i w[CH / 4];
        UNROLL for (int j = 0; j < CH / 4; j++)
            w[j] = _mm512_load_si512((const void *)(p->w + (i * (CH / 4) + j) * PANEL_ROWS));
        __m512 scale = _mm512_load_ps(p->scale + i * PANEL_ROWS);
        __m512 mins = MIN ? _mm512_load_ps(p->mins + i * PANEL_ROWS) : _mm512_setzero_ps();
        UNROLL for (int c = 0; c < tc; c++) {
            UNROLL for (int l = 0; l < L; l++) {
                const int32_t nq = ((const int32_t *)(dc[c][l] + 2 * nc))[ci];
                __m512i isum = MIN ? _mm512_setzero_si512() : _mm512_slli_epi32(_mm512_set1_epi32(nq), shift);
                const int32_t *q4 = (const int32_t *)(q[c][l] + ci * CH);
                UNROLL for (int j = 0; j < CH / 4; j++) isum = _mm512_dpbusd_epi32(isum, w[j], _mm512_set1_epi32(q4[j]));
                __m512 da = _mm512_set1_ps(dc[c][l][ci]);
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(scale, da), acc[c]);
            }
            if (MIN) { /* mins times the sum of the token's values, both levels */
                float s = dc[c][0][nc + ci] + (L == 2 ? dc[c][L - 1][nc + ci] : 0.0f);
                acc[c] = _mm512_fmadd_ps(mins, _mm512_set1_ps(s), acc[c]);
            }
        }
    }
    UNROLL for (int c = 0; c < tc; c++) {
        float *yc = y + (t0 + c) * ys;
        if (accumulate) acc[c] = _mm512_add_ps(acc[c], _mm512_maskz_loadu_ps(mask, yc));
        _mm512_mask_storeu_ps(yc, mask, acc[c]);
    }
}

#define PANEL_TILE_CASE(CH, MIN, TC, L) \
    case TC: panel_tile(CH, MIN, TC, L, shift, p, ch0, nch, act, t0, y, ys, mask, accumulate); return

#define PANEL_TILE_CASES(CH, MIN, L)                                                                         \
    switch (tc) {                                                                                            \
        PANEL_TILE_CASE(CH, MIN, 1, L); PANEL_TILE_CASE(CH, MIN, 2, L); PANEL_TILE_CASE(CH, MIN, 3, L);      \
        PANEL_TILE_CASE(CH, MIN, 4, L); PANEL_TILE_CASE(CH, MIN, 5, L); PANEL_TILE_CASE(CH, MIN, 6, L);      \
        PANEL_TILE_CASE(CH, MIN, 7, L); default: PANEL_TILE_CASE(CH, MIN, 8, L);                             \
    }

#define DEFINE_PANEL_TILES(fname, CH, MIN)                                                                   \
    static void fname(int tc, int shift, const panel *p, int64_t ch0, int64_t nch, const act_rows *act,     \
                      int64_t t0, float *y, int64_t ys, __mmask16 mask, int accumulate) {                   \
        if (act->a_res) PANEL_TILE_CASES(CH, MIN, 2);                                                        \
        PANEL_TILE_CASES(CH, MIN, 1);                                                                        \
    }

DEFINE_PANEL_TILES(panel_tiles_32, 32, 0)
DEFINE_PANEL_TILES(panel_tiles_32m, 32, 1)
DEFINE_PANEL_TILES(panel_tiles_16, 16, 0)
DEFINE_PANEL_TILES(panel_tiles_16m, 16, 1)

typedef void (*panel_tiles_fn)(int tc, int shift, const panel *p, int64_t ch0, int64_t nch, const act_rows *act,
                               int64_t t0, float *y, int64_t ys, __mmask16 mask, int accumulate);

/* W rows (nrows, k) -> y[t * ys + r] for t < n: pack 16 rows (a k-slice at a time), sweep the tokens. */
static void panel_matmul(int type, int64_t k, const void *w, int64_t ws, int64_t nrows, const void *a,
                         int64_t as, int64_t ar, int64_t n, float *y, int64_t ys) {
    _Alignas(64) uint8_t buf[2 * PANEL_ROWS * PANEL_KMAX + 2 * 4 * PANEL_ROWS * (PANEL_KMAX / 16)];
    const int CH = panel_chunk(type), min = panel_has_min(type), shift = panel_shift(type);
    const int qk = ember_qtype_get(type)->block_size;
    const int act_kind = ember_qtype_get(type)->act;
    const panel_tiles_fn tiles = CH == 32 ? (min ? panel_tiles_32m : panel_tiles_32) : (min ? panel_tiles_16m : panel_tiles_16);
    const act_rows act = {a, as, ar, ember_act_meta_offset(act_kind, k), k / CH};
    panel p = {(uint32_t *)buf, (float *)(buf + PANEL_ROWS * PANEL_KMAX), NULL, NULL};
    p.mins = p.scale + PANEL_ROWS * (PANEL_KMAX / 16);
    p.rows = (uint8_t *)(p.mins + PANEL_ROWS * (PANEL_KMAX / 16));
    const int64_t t_step = EMBER_MAX(PANEL_TOKENS, PANEL_ACT_BYTES / as);
    for (int64_t t0 = 0; t0 < n; t0 += t_step) {
        const int64_t t1 = EMBER_MIN(n, t0 + t_step);
        for (int64_t r0 = 0; r0 < nrows; r0 += PANEL_ROWS) {
            const int nr = (int)EMBER_MIN((int64_t)PANEL_ROWS, nrows - r0);
            const __mmask16 mask = (__mmask16)((1u << nr) - 1);
            for (int64_t k0 = 0; k0 < k; k0 += PANEL_KMAX) {
                const int64_t kn = EMBER_MIN((int64_t)PANEL_KMAX, k - k0), nch = kn / CH;
                if (nr < PANEL_ROWS) memset(buf, 0, sizeof buf); /* lanes past nr: zeros, not garbage */
                for (int r = 0; r < nr; r++)
                    pack_row(type, (const uint8_t *)w + (r0 + r) * ws, k0 / qk, kn / qk, r, &p);
                if (CH == 32) transpose_chunks32(&p, nch);
                else transpose_chunks16(&p, nch);
                for (int64_t t = t0; t < t1; t += PANEL_TOKENS) {
                    int tc = (int)EMBER_MIN((int64_t)PANEL_TOKENS, t1 - t);
                    tiles(tc, shift, &p, k0 / CH, nch, &act, t, y + r0, ys, mask, k0 > 0);
                }
            }
        }
    }
}

#define PANEL(one, two) {panel_matmul, PANEL_ROWS, {one, two}}

/* The token counts from which packing pays, with one and with two activation levels (measured on
 * Zen 4, k = 576 .. 2048; with two levels a microtile takes 2 tokens, not 4, per unpacked block). */
const ember_kernels ember_kernels_avx512 = {
    X86_QUANTIZE_AND_TILES,
    .panel = {
        [EMBER_T_Q4_0] = PANEL(6, 3), [EMBER_T_Q4_1] = PANEL(6, 3), [EMBER_T_Q5_0] = PANEL(6, 4),
        [EMBER_T_Q5_1] = PANEL(6, 4), [EMBER_T_Q8_0] = PANEL(6, 2), [EMBER_T_IQ4_NL] = PANEL(6, 3),
        [EMBER_T_Q4_K] = PANEL(8, 4), [EMBER_T_Q5_K] = PANEL(8, 4), [EMBER_T_IQ4_XS] = PANEL(8, 4),
        [EMBER_T_Q2_K] = PANEL(20, 12), [EMBER_T_Q3_K] = PANEL(20, 12), [EMBER_T_Q6_K] = PANEL(20, 12),
    },
};

#if defined(__clang__)
#pragma clang attribute pop
#endif

#else
const ember_kernels ember_kernels_avx512 = {0};
#endif
