/* NEON kernels (arm64 only; NEON is part of the base ISA there, so no run-time check is needed).
 * Baseline ARMv8: no dot-product instructions, so 16 products at a time come from widening
 * multiplies (int8 x int8 -> int16 folded pairwise into int32 lanes for the K-quants' int8
 * activations; int16 x int16 -> int32 for the 32-value types' int16 ones). Weights are made signed
 * (offset subtracted) before the product, so each block's integer sum is exactly the scalar one;
 * the float side follows quant_scalar.c block by block. Activations are quantized by the scalar
 * code. Tiles are one W row by up to 4 tokens: a block is unpacked once per 4 tokens, and dotted
 * with each token's row. */
#include "quant.h"

#if defined(EMBER_ARM64)
#include <arm_neon.h>

#define NEON_TOKENS 4

/* The activation row of token c. */
static inline const int8_t *act_row(const void *a, int64_t as, int c) { return (const int8_t *)a + c * as; }

static inline float h2f(uint16_t h) { return ember_f16_to_f32(h); }

/* sum of the 16 products w . q */
static inline int32x4_t dot16_acc(int32x4_t acc, int8x16_t w, int8x16_t q) {
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(w), vget_low_s8(q)));
    return vpadalq_s16(acc, vmull_high_s8(w, q));
}

/* sum of the 32 products (w0 | w1) . q[0..32) */
static inline int32_t dot32(int8x16_t w0, int8x16_t w1, const int8_t *q) {
    int32x4_t acc = dot16_acc(vdupq_n_s32(0), w0, vld1q_s8(q));
    return vaddvq_s32(dot16_acc(acc, w1, vld1q_s8(q + 16)));
}

static inline int32_t dot16(int8x16_t w, const int8_t *q) { return vaddvq_s32(dot16_acc(vdupq_n_s32(0), w, vld1q_s8(q))); }

/* acc + the 16 products of w (widened to int16) with c[0..16) */
static inline int32x4_t dot16_c16_acc(int32x4_t acc, int8x16_t w, const int16_t *c) {
    int16x8_t lo = vmovl_s8(vget_low_s8(w)), hi = vmovl_high_s8(w), c0 = vld1q_s16(c), c1 = vld1q_s16(c + 8);
    acc = vmlal_s16(acc, vget_low_s16(lo), vget_low_s16(c0));
    acc = vmlal_high_s16(acc, lo, c0);
    acc = vmlal_s16(acc, vget_low_s16(hi), vget_low_s16(c1));
    return vmlal_high_s16(acc, hi, c1);
}

/* sum of the 32 products (w0 | w1) . c[0..32) */
static inline int32_t dot32_c16(int8x16_t w0, int8x16_t w1, const int16_t *c) {
    return vaddvq_s32(dot16_c16_acc(dot16_c16_acc(vdupq_n_s32(0), w0, c), w1, c + 16));
}

/* ---- 32-value blocks ---- */

/* 16 bytes, one per bit of the 16 bits of qh16: 0x10 where set */
static inline uint8x16_t high_bits16(uint32_t qh16) {
    static const uint8_t bit[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    uint8x16_t v = vcombine_u8(vdup_n_u8((uint8_t)(qh16 & 0xff)), vdup_n_u8((uint8_t)(qh16 >> 8)));
    return vandq_u8(vtstq_u8(v, vld1q_u8(bit)), vdupq_n_u8(0x10));
}

/* A block's 32 weights as signed bytes (values 0..15 in w0, 16..31 in w1), and d, m. */
typedef struct {
    int8x16_t w0, w1;
    float d, m;
} wblock;

static inline wblock unpack_block(int type, const uint8_t *p) {
    wblock r = {vdupq_n_s8(0), vdupq_n_s8(0), 0.0f, 0.0f};
    uint16_t dm[2];
    memcpy(dm, p, 4);
    r.d = h2f(dm[0]);
    if (type == EMBER_T_Q8_0) {
        r.w0 = vld1q_s8(((const blk_q8_0 *)p)->qs);
        r.w1 = vld1q_s8(((const blk_q8_0 *)p)->qs + 16);
        return r;
    }
    const uint8_t *qs = type == EMBER_T_Q4_1 ? ((const blk_q4_1 *)p)->qs
                      : type == EMBER_T_Q5_0 ? ((const blk_q5_0 *)p)->qs
                      : type == EMBER_T_Q5_1 ? ((const blk_q5_1 *)p)->qs
                                             : ((const blk_q4_0 *)p)->qs; /* Q4_0, IQ4_NL */
    uint8x16_t v = vld1q_u8(qs), lo = vandq_u8(v, vdupq_n_u8(0x0f)), hi = vshrq_n_u8(v, 4);
    if (type == EMBER_T_Q5_0 || type == EMBER_T_Q5_1) {
        uint32_t qh;
        memcpy(&qh, type == EMBER_T_Q5_0 ? ((const blk_q5_0 *)p)->qh : ((const blk_q5_1 *)p)->qh, 4);
        lo = vorrq_u8(lo, high_bits16(qh & 0xffff));
        hi = vorrq_u8(hi, high_bits16(qh >> 16));
    }
    if (type == EMBER_T_IQ4_NL) {
        int8x16_t table = vld1q_s8(ember_iq4nl_values);
        r.w0 = vqtbl1q_s8(table, lo);
        r.w1 = vqtbl1q_s8(table, hi);
        return r;
    }
    int off = type == EMBER_T_Q4_0 ? 8 : type == EMBER_T_Q5_0 ? 16 : 0;
    r.w0 = vsubq_s8(vreinterpretq_s8_u8(lo), vdupq_n_s8((int8_t)off));
    r.w1 = vsubq_s8(vreinterpretq_s8_u8(hi), vdupq_n_s8((int8_t)off));
    if (type == EMBER_T_Q4_1 || type == EMBER_T_Q5_1) r.m = h2f(dm[1]);
    return r;
}

static int block_size_of(int type) {
    switch (type) {
    case EMBER_T_Q4_1: return sizeof(blk_q4_1);
    case EMBER_T_Q5_0: return sizeof(blk_q5_0);
    case EMBER_T_Q5_1: return sizeof(blk_q5_1);
    case EMBER_T_Q8_0: return sizeof(blk_q8_0);
    default: return sizeof(blk_q4_0); /* Q4_0, IQ4_NL */
    }
}

/* one W row (k/32 blocks) x activation rows (nc, EMBER_ACT_Q16) -> y[c * ys] */
static void tile32(int type, int64_t k, const void *w, const void *a, int64_t as, float *y, int64_t ys, int nc) {
    const int64_t nb = k / QK;
    const int bs = block_size_of(type);
    float sum[NEON_TOKENS] = {0};
    for (int64_t b = 0; b < nb; b++) {
        wblock wb = unpack_block(type, (const uint8_t *)w + b * bs);
        for (int c = 0; c < nc; c++) {
            const int16_t *cv = (const int16_t *)act_row(a, as, c);
            const float *d = (const float *)(cv + k), *s = d + nb;
            sum[c] += wb.d * (d[b] * (float)dot32_c16(wb.w0, wb.w1, cv + b * QK)) + wb.m * s[b];
        }
    }
    for (int c = 0; c < nc; c++) y[c * ys] = sum[c];
}

/* ---- super-blocks ---- */

/* Q4_K / Q5_K: sub-block j of 32 values, six-bit scale and min. */
static void tile_q45k(int five, int64_t k, const void *w, const void *a, int64_t as, float *y, int64_t ys, int nc) {
    const int64_t nb = k / QK_K;
    float sum[NEON_TOKENS] = {0};
    for (int64_t i = 0; i < nb; i++) {
        const blk_q4_k *b4 = (const blk_q4_k *)w + i;
        const blk_q5_k *b5 = (const blk_q5_k *)w + i;
        const uint8_t *scales = five ? b5->scales : b4->scales, *qs = five ? b5->qs : b4->qs;
        float d = h2f(five ? b5->d : b4->d), dmin = h2f(five ? b5->dmin : b4->dmin);
        uint8_t sc[8], m[8];
        ember_q4k_scales(scales, sc, m);
        uint8x16_t qh0 = five ? vld1q_u8(b5->qh) : vdupq_n_u8(0), qh1 = five ? vld1q_u8(b5->qh + 16) : vdupq_n_u8(0);
        int8x16_t wv[8][2];
        for (int j = 0; j < 8; j++) {
            uint8x16_t v0 = vld1q_u8(qs + 32 * (j / 2)), v1 = vld1q_u8(qs + 32 * (j / 2) + 16);
            if (j & 1) {
                v0 = vshrq_n_u8(v0, 4);
                v1 = vshrq_n_u8(v1, 4);
            } else {
                v0 = vandq_u8(v0, vdupq_n_u8(0x0f));
                v1 = vandq_u8(v1, vdupq_n_u8(0x0f));
            }
            if (five) { /* bit j of qh[l] is the fifth bit */
                uint8x16_t bit = vdupq_n_u8((uint8_t)(1u << j)), h = vdupq_n_u8(0x10);
                v0 = vorrq_u8(v0, vandq_u8(vtstq_u8(qh0, bit), h));
                v1 = vorrq_u8(v1, vandq_u8(vtstq_u8(qh1, bit), h));
            }
            wv[j][0] = vreinterpretq_s8_u8(v0); /* values <= 31: fine as signed */
            wv[j][1] = vreinterpretq_s8_u8(v1);
        }
        for (int c = 0; c < nc; c++) {
            const int8_t *q = act_row(a, as, c) + i * QK_K;
            const float *ad = (const float *)(act_row(a, as, c) + k);
            const int16_t *bs = (const int16_t *)(ad + nb) + i * 16;
            int isum = 0, msum = 0;
            for (int j = 0; j < 8; j++) {
                isum += sc[j] * dot32(wv[j][0], wv[j][1], q + 32 * j);
                msum += m[j] * (bs[2 * j] + bs[2 * j + 1]);
            }
            sum[c] += ad[i] * (d * (float)isum - dmin * (float)msum);
        }
    }
    for (int c = 0; c < nc; c++) y[c * ys] = sum[c];
}

/* Q6_K: value v = 128h + 32s + l; weights u - 32 (signed), scale per 16 values. */
static void tile_q6k(int64_t k, const void *w, const void *a, int64_t as, float *y, int64_t ys, int nc) {
    const int64_t nb = k / QK_K;
    float sum[NEON_TOKENS] = {0};
    for (int64_t i = 0; i < nb; i++) {
        const blk_q6_k *b = (const blk_q6_k *)w + i;
        int8x16_t wv[16]; /* 16 groups of 16 values */
        for (int j = 0; j < 8; j++) {
            const int h = j / 4, s = j % 4;
            for (int half = 0; half < 2; half++) {
                uint8x16_t lo = vld1q_u8(b->ql + 64 * h + 32 * (s & 1) + 16 * half);
                lo = (s >> 1) ? vshrq_n_u8(lo, 4) : vandq_u8(lo, vdupq_n_u8(0x0f));
                uint8x16_t hi = vld1q_u8(b->qh + 32 * h + 16 * half);
                hi = vandq_u8(vshlq_u8(hi, vdupq_n_s8((int8_t)-(2 * s))), vdupq_n_u8(3));
                uint8x16_t u = vorrq_u8(lo, vshlq_n_u8(hi, 4));
                wv[2 * j + half] = vsubq_s8(vreinterpretq_s8_u8(u), vdupq_n_s8(32));
            }
        }
        for (int c = 0; c < nc; c++) {
            const int8_t *q = act_row(a, as, c) + i * QK_K;
            const float *ad = (const float *)(act_row(a, as, c) + k);
            int isum = 0;
            for (int g = 0; g < 16; g++) isum += b->scales[g] * dot16(wv[g], q + 16 * g);
            sum[c] += ad[i] * (h2f(b->d) * (float)isum);
        }
    }
    for (int c = 0; c < nc; c++) y[c * ys] = sum[c];
}

/* ---- tiles (nr is 1: one row per call) ---- */

#define NEON_TILE32(name, TYPE)                                                                               \
    static void tile_##name(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, float *y, int64_t ys, \
                            int nr, int nc) {                                                                     \
        (void)ws, (void)nr;                                                                                       \
        tile32(TYPE, k, w, a, as, y, ys, nc);                                                                     \
    }

NEON_TILE32(q4_0, EMBER_T_Q4_0)
NEON_TILE32(q4_1, EMBER_T_Q4_1)
NEON_TILE32(q5_0, EMBER_T_Q5_0)
NEON_TILE32(q5_1, EMBER_T_Q5_1)
NEON_TILE32(q8_0, EMBER_T_Q8_0)
NEON_TILE32(iq4_nl, EMBER_T_IQ4_NL)

static void tile_q4_k(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, float *y, int64_t ys, int nr,
                      int nc) {
    (void)ws, (void)nr;
    tile_q45k(0, k, w, a, as, y, ys, nc);
}

static void tile_q5_k(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, float *y, int64_t ys, int nr,
                      int nc) {
    (void)ws, (void)nr;
    tile_q45k(1, k, w, a, as, y, ys, nc);
}

static void tile_q6_k(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, float *y, int64_t ys, int nr,
                      int nc) {
    (void)ws, (void)nr;
    tile_q6k(k, w, a, as, y, ys, nc);
}

#define TN(name) {tile_##name, 1, NEON_TOKENS}

const ember_kernels ember_kernels_neon = {
    .tile = {
        [EMBER_T_Q4_0] = TN(q4_0), [EMBER_T_Q4_1] = TN(q4_1), [EMBER_T_Q5_0] = TN(q5_0),
        [EMBER_T_Q5_1] = TN(q5_1), [EMBER_T_Q8_0] = TN(q8_0), [EMBER_T_IQ4_NL] = TN(iq4_nl),
        [EMBER_T_Q4_K] = TN(q4_k), [EMBER_T_Q5_K] = TN(q5_k), [EMBER_T_Q6_K] = TN(q6_k),
    },
};

#else
const ember_kernels ember_kernels_neon = {0};
#endif
