/* NEON products of the low-bit types (arm64; baseline ARMv8, no dot-product instructions). Each
 * 32-value sub-block is unpacked once per tile into two vectors of signed bytes (grid rows times
 * their +-1 signs), then dotted with each token's Q8_K row by widening multiplies; the integer sums
 * per super-block are the scalar kernel's exactly. */
#include "quant_iq.h"

#if defined(EMBER_ARM64)
#include <arm_neon.h>

#define IQ_TOKENS 4

typedef struct {
    int8x16_t v[2];
    int sc[2]; /* scales of values 0-15 and 16-31 */
} iq_sub;

static inline int8x16_t rows2(const uint64_t *g, int i0, int i1) { return vreinterpretq_s8_u64(vcombine_u64(vcreate_u64(g[i0]), vcreate_u64(g[i1]))); }

static inline int8x16_t rows2x2(const uint32_t *g, const int *i) {
    uint64_t lo = g[i[0]] | (uint64_t)g[i[1]] << 32, hi = g[i[2]] | (uint64_t)g[i[3]] << 32;
    return vreinterpretq_s8_u64(vcombine_u64(vcreate_u64(lo), vcreate_u64(hi)));
}

static inline int8x16_t signed_rows(int8x16_t mag, int8x16_t sign) { return vmulq_s8(mag, sign); }

/* TQ1_0: trits of bytes x with per-byte powers of 3 p, minus 1 (see quant_iq_x86.h). */
static inline int8x16_t trits_minus1(uint8x16_t x, uint8x16_t p) {
    uint8x16_t y = vmulq_u8(x, p);
    int8x16_t ge86 = vreinterpretq_s8_u8(vcgeq_u8(y, vdupq_n_u8(86))), ge171 = vreinterpretq_s8_u8(vcgeq_u8(y, vdupq_n_u8(171)));
    return vsubq_s8(vsubq_s8(vdupq_n_s8(-1), ge86), ge171);
}

static iq_sub unpack_sub(int type, const uint8_t *blk, int ib) {
    iq_sub r;
    switch (type) {
    case EMBER_T_IQ2_XXS: {
        const blk_iq2_xxs *x = (const blk_iq2_xxs *)blk;
        const uint32_t a0 = iq_u32(x->qs + 8 * ib), a1 = iq_u32(x->qs + 8 * ib + 4);
        const uint64_t *g = ember_iq2xxs_grid, *sg = ember_iq_sign7;
        r.v[0] = signed_rows(rows2(g, a0 & 255, (a0 >> 8) & 255), rows2(sg, a1 & 127, (a1 >> 7) & 127));
        r.v[1] = signed_rows(rows2(g, (a0 >> 16) & 255, a0 >> 24), rows2(sg, (a1 >> 14) & 127, (a1 >> 21) & 127));
        r.sc[0] = r.sc[1] = 2 * (int)(a1 >> 28) + 1;
        break;
    }
    case EMBER_T_IQ2_XS: {
        const blk_iq2_xs *x = (const blk_iq2_xs *)blk;
        const uint16_t *q = x->qs + 4 * ib;
        const uint64_t *g = ember_iq2xs_grid, *sg = ember_iq_sign7;
        r.v[0] = signed_rows(rows2(g, q[0] & 511, q[1] & 511), rows2(sg, q[0] >> 9, q[1] >> 9));
        r.v[1] = signed_rows(rows2(g, q[2] & 511, q[3] & 511), rows2(sg, q[2] >> 9, q[3] >> 9));
        r.sc[0] = 2 * (x->scales[ib] & 15) + 1, r.sc[1] = 2 * (x->scales[ib] >> 4) + 1;
        break;
    }
    case EMBER_T_IQ2_S: {
        const blk_iq2_s *x = (const blk_iq2_s *)blk;
        const uint8_t *q = x->qs + 4 * ib, *sn = x->signs + 4 * ib;
        const int h = x->qh[ib];
        const uint64_t *g = ember_iq2s_grid, *sg = ember_iq_sign8;
        r.v[0] = signed_rows(rows2(g, q[0] | (h & 3) << 8, q[1] | (h & 12) << 6), rows2(sg, sn[0], sn[1]));
        r.v[1] = signed_rows(rows2(g, q[2] | (h & 48) << 4, q[3] | (h & 192) << 2), rows2(sg, sn[2], sn[3]));
        r.sc[0] = 2 * (x->scales[ib] & 15) + 1, r.sc[1] = 2 * (x->scales[ib] >> 4) + 1;
        break;
    }
    case EMBER_T_IQ3_XXS: {
        const blk_iq3_xxs *x = (const blk_iq3_xxs *)blk;
        const uint8_t *q = x->qs + 8 * ib;
        const uint32_t aux = iq_u32(x->ss + 4 * ib);
        const int i0[4] = {q[0], q[1], q[2], q[3]}, i1[4] = {q[4], q[5], q[6], q[7]};
        const uint64_t *sg = ember_iq_sign7;
        r.v[0] = signed_rows(rows2x2(ember_iq3xxs_grid, i0), rows2(sg, aux & 127, (aux >> 7) & 127));
        r.v[1] = signed_rows(rows2x2(ember_iq3xxs_grid, i1), rows2(sg, (aux >> 14) & 127, (aux >> 21) & 127));
        r.sc[0] = r.sc[1] = 2 * (int)(aux >> 28) + 1;
        break;
    }
    case EMBER_T_IQ3_S: {
        const blk_iq3_s *x = (const blk_iq3_s *)blk;
        const uint8_t *q = x->qs + 8 * ib, *sn = x->signs + 4 * ib;
        const int h = x->qh[ib];
        int idx[8];
        for (int j = 0; j < 8; j++) idx[j] = q[j] | ((h << (8 - j)) & 256);
        const uint64_t *sg = ember_iq_sign8;
        r.v[0] = signed_rows(rows2x2(ember_iq3s_grid, idx), rows2(sg, sn[0], sn[1]));
        r.v[1] = signed_rows(rows2x2(ember_iq3s_grid, idx + 4), rows2(sg, sn[2], sn[3]));
        r.sc[0] = r.sc[1] = 2 * ((x->scales[ib / 2] >> 4 * (ib % 2)) & 15) + 1;
        break;
    }
    case EMBER_T_IQ1_S: {
        const blk_iq1_s *x = (const blk_iq1_s *)blk;
        const uint8_t *q = x->qs + 4 * ib;
        const int h = x->qh[ib];
        const int8x16_t delta = vdupq_n_s8(h & 0x8000 ? -1 : 1);
        const uint64_t *g = ember_iq1s_grid;
        r.v[0] = vaddq_s8(rows2(g, q[0] | (h & 7) << 8, q[1] | (h & 56) << 5), delta);
        r.v[1] = vaddq_s8(rows2(g, q[2] | (h & 448) << 2, q[3] | (h & 3584) >> 1), delta);
        r.sc[0] = r.sc[1] = 2 * ((h >> 12) & 7) + 1;
        break;
    }
    case EMBER_T_IQ1_M: {
        const blk_iq1_m *x = (const blk_iq1_m *)blk;
        const uint8_t *q = x->qs + 4 * ib;
        const int h0 = x->qh[2 * ib], h1 = x->qh[2 * ib + 1], sw = x->scales[ib / 2] >> 6 * (ib % 2);
        const uint64_t *g = ember_iq1s_grid, plus = 0x0101010101010101ull, minus = ~0ull;
        int8x16_t d0 = vreinterpretq_s8_u64(vcombine_u64(vcreate_u64(h0 & 0x08 ? minus : plus), vcreate_u64(h0 & 0x80 ? minus : plus)));
        int8x16_t d1 = vreinterpretq_s8_u64(vcombine_u64(vcreate_u64(h1 & 0x08 ? minus : plus), vcreate_u64(h1 & 0x80 ? minus : plus)));
        r.v[0] = vaddq_s8(rows2(g, q[0] | (h0 & 7) << 8, q[1] | (h0 & 0x70) << 4), d0);
        r.v[1] = vaddq_s8(rows2(g, q[2] | (h1 & 7) << 8, q[3] | (h1 & 0x70) << 4), d1);
        r.sc[0] = 2 * (sw & 7) + 1, r.sc[1] = 2 * ((sw >> 3) & 7) + 1;
        break;
    }
    case EMBER_T_TQ1_0: {
        const blk_tq1_0 *x = (const blk_tq1_0 *)blk;
        static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
        static const uint8_t qh_pow[16] = {1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27};
        const uint8x16_t tail = vld1q_u8(x->qs + 32);
        if (ib < 5) {
            const uint8x16_t p = vdupq_n_u8(pow3[ib]);
            r.v[0] = trits_minus1(vld1q_u8(x->qs), p), r.v[1] = trits_minus1(vld1q_u8(x->qs + 16), p);
        } else if (ib < 7) {
            r.v[0] = trits_minus1(tail, vdupq_n_u8(pow3[2 * (ib - 5)]));
            r.v[1] = trits_minus1(tail, vdupq_n_u8(pow3[2 * (ib - 5) + 1]));
        } else {
            r.v[0] = trits_minus1(tail, vdupq_n_u8(81));
            r.v[1] = trits_minus1(vreinterpretq_u8_u32(vdupq_n_u32(iq_u32(x->qh))), vld1q_u8(qh_pow));
        }
        r.sc[0] = r.sc[1] = 1;
        break;
    }
    default: { /* TQ2_0 */
        const blk_tq2_0 *x = (const blk_tq2_0 *)blk;
        const uint8_t *q = x->qs + 32 * (ib / 4);
        const int8x16_t shift = vdupq_n_s8((int8_t)(-2 * (ib % 4)));
        for (int j = 0; j < 2; j++) {
            uint8x16_t t = vandq_u8(vshlq_u8(vld1q_u8(q + 16 * j), shift), vdupq_n_u8(3));
            r.v[j] = vsubq_s8(vreinterpretq_s8_u8(t), vdupq_n_s8(1));
        }
        r.sc[0] = r.sc[1] = 1;
    }
    }
    return r;
}

static float block_factor(int type, const uint8_t *blk) {
    uint16_t d;
    memcpy(&d, blk, 2);
    switch (type) {
    case EMBER_T_IQ2_XXS: case EMBER_T_IQ2_XS: case EMBER_T_IQ2_S: case EMBER_T_IQ1_S:
        return ember_f16_to_f32(d) * 0.125f;
    case EMBER_T_IQ3_XXS: return ember_f16_to_f32(d) * 0.25f;
    case EMBER_T_IQ3_S: return ember_f16_to_f32(d);
    case EMBER_T_IQ1_M: return ember_f16_to_f32(iq1m_d((const blk_iq1_m *)blk)) * 0.125f;
    case EMBER_T_TQ1_0: return ember_f16_to_f32(((const blk_tq1_0 *)blk)->d);
    default: return ember_f16_to_f32(((const blk_tq2_0 *)blk)->d);
    }
}

/* acc + the 16 products w . q */
static inline int32x4_t dot16_acc(int32x4_t acc, int8x16_t w, const int8_t *q) {
    int8x16_t x = vld1q_s8(q);
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(w), vget_low_s8(x)));
    return vpadalq_s16(acc, vmull_high_s8(w, x));
}

/* One W row (k/256 blocks of `type`, `bytes` each) . nc activation rows a + c as -> y[c ys]. */
static void tile_iq(int type, int bytes, int64_t k, const uint8_t *w, const uint8_t *a, int64_t as, float *y,
                    int64_t ys, int nc) {
    float sum[IQ_TOKENS] = {0};
    for (int64_t i = 0; i < k / QK_K; i++) {
        const uint8_t *blk = w + i * bytes;
        int32x4_t acc[IQ_TOKENS];
        for (int c = 0; c < nc; c++) acc[c] = vdupq_n_s32(0);
        for (int ib = 0; ib < 8; ib++) {
            const iq_sub sb = unpack_sub(type, blk, ib);
            for (int c = 0; c < nc; c++) {
                const int8_t *q = (const int8_t *)(a + c * as) + i * QK_K + 32 * ib;
                acc[c] = vmlaq_n_s32(acc[c], dot16_acc(vdupq_n_s32(0), sb.v[0], q), sb.sc[0]);
                acc[c] = vmlaq_n_s32(acc[c], dot16_acc(vdupq_n_s32(0), sb.v[1], q + 16), sb.sc[1]);
            }
        }
        const float f = block_factor(type, blk);
        for (int c = 0; c < nc; c++) sum[c] += ((const float *)(a + c * as + k))[i] * (f * (float)vaddvq_s32(acc[c]));
    }
    for (int c = 0; c < nc; c++) y[c * ys] = sum[c];
}

#define IQ_TILE_FN(name, TYPE)                                                                                \
    static void tile_##name(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, float *y,        \
                            int64_t ys, int nr, int nc) {                                                     \
        (void)ws, (void)nr;                                                                                   \
        tile_iq(TYPE, sizeof(blk_##name), k, w, a, as, y, ys, nc);                                            \
    }
IQ_TILE_FN(iq2_xxs, EMBER_T_IQ2_XXS)
IQ_TILE_FN(iq2_xs, EMBER_T_IQ2_XS)
IQ_TILE_FN(iq2_s, EMBER_T_IQ2_S)
IQ_TILE_FN(iq3_xxs, EMBER_T_IQ3_XXS)
IQ_TILE_FN(iq3_s, EMBER_T_IQ3_S)
IQ_TILE_FN(iq1_s, EMBER_T_IQ1_S)
IQ_TILE_FN(iq1_m, EMBER_T_IQ1_M)
IQ_TILE_FN(tq1_0, EMBER_T_TQ1_0)
IQ_TILE_FN(tq2_0, EMBER_T_TQ2_0)

#define IQ_T(name) {tile_##name, 1, IQ_TOKENS, 0}

const ember_kernels ember_kernels_iq_neon = {
    .tile = {
        [EMBER_T_IQ2_XXS] = IQ_T(iq2_xxs), [EMBER_T_IQ2_XS] = IQ_T(iq2_xs), [EMBER_T_IQ2_S] = IQ_T(iq2_s),
        [EMBER_T_IQ3_XXS] = IQ_T(iq3_xxs), [EMBER_T_IQ3_S] = IQ_T(iq3_s),   [EMBER_T_IQ1_S] = IQ_T(iq1_s),
        [EMBER_T_IQ1_M] = IQ_T(iq1_m),     [EMBER_T_TQ1_0] = IQ_T(tq1_0),   [EMBER_T_TQ2_0] = IQ_T(tq2_0),
    },
};

#else
const ember_kernels ember_kernels_iq_neon = {0};
#endif
