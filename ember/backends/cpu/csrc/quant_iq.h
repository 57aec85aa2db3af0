/* Internal header of the low-bit types (IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S TQ1_0 TQ2_0):
 * their ggml block layouts, the expanded grids and sign tables every kernel reads, and the portable
 * unpacking of a super-block that the scalar kernels, the dequantizers and the tests' reference share.
 *
 * Every one of these types is, per super-block of 256 values, signed integers v (|v| <= 62) times an
 * odd integer scale per 16 values times one float factor:
 *   IQ2_*    v = grid * sign, scale 2s + 1, factor d / 8
 *   IQ3_XXS  v = grid * sign, scale 2s + 1, factor d / 4
 *   IQ3_S    v = grid * sign, scale 2s + 1, factor d
 *   IQ1_*    v = 8 grid +- 1 (grid in {-1, 0, 1}, the +-1/8 shift made integer), scale 2s + 1, factor d / 8
 *   TQ*_0    v = trit - 1, scale 1, factor d
 * so the products with llama.cpp's Q8_K activations are exact integer sums per super-block, like the
 * K-quants'. */
#ifndef EMBER_QUANT_IQ_H
#define EMBER_QUANT_IQ_H

#include "quant.h"

typedef struct { uint16_t d; uint8_t qs[64]; } blk_iq2_xxs;                          /* qs: u32 pairs per 32 values */
typedef struct { uint16_t d; uint16_t qs[32]; uint8_t scales[8]; } blk_iq2_xs;
typedef struct { uint16_t d; uint8_t qs[32]; uint8_t signs[32]; uint8_t qh[8]; uint8_t scales[8]; } blk_iq2_s;
typedef struct { uint16_t d; uint8_t qs[64]; uint8_t ss[32]; } blk_iq3_xxs;          /* ss: u32 per 32 values */
typedef struct { uint16_t d; uint8_t qs[64]; uint8_t qh[8]; uint8_t signs[32]; uint8_t scales[4]; } blk_iq3_s;
typedef struct { uint16_t d; uint8_t qs[32]; uint16_t qh[8]; } blk_iq1_s;
typedef struct { uint8_t qs[32]; uint8_t qh[16]; uint16_t scales[4]; } blk_iq1_m;     /* d: top nibbles of scales */
typedef struct { uint8_t qs[48]; uint8_t qh[4]; uint16_t d; } blk_tq1_0;
typedef struct { uint8_t qs[64]; uint16_t d; } blk_tq2_0;

_Static_assert(sizeof(blk_iq2_xxs) == 66 && sizeof(blk_iq2_xs) == 74 && sizeof(blk_iq2_s) == 82 &&
               sizeof(blk_iq3_xxs) == 98 && sizeof(blk_iq3_s) == 110 && sizeof(blk_iq1_s) == 50 &&
               sizeof(blk_iq1_m) == 56 && sizeof(blk_tq1_0) == 54 && sizeof(blk_tq2_0) == 66,
               "low-bit block sizes");

/* Grids expanded once at load from the codes of quant_iq_grids.h: one byte per value. The IQ1 grid
 * holds 8 * {-1, 0, 1}, ready for the +-1 shift. */
extern uint64_t ember_iq2xxs_grid[256], ember_iq2xs_grid[512], ember_iq2s_grid[1024], ember_iq1s_grid[2048];
extern uint32_t ember_iq3xxs_grid[256], ember_iq3s_grid[512];
/* Sign masks as 8 bytes of +1 / -1: by the full mask byte, and by the 7 stored bits of a mask whose
 * eighth bit makes the count of minus signs even (IQ2_XXS, IQ2_XS, IQ3_XXS). */
extern uint64_t ember_iq_sign8[256], ember_iq_sign7[128];

/* The kernel tables of these types, one per instruction set (matmul.c tries them after the main ones). */
extern const ember_kernels ember_kernels_iq_scalar;
extern const ember_kernels ember_kernels_iq_avx2;
extern const ember_kernels ember_kernels_iq_avx512;
extern const ember_kernels ember_kernels_iq_neon;

const ember_qtype *ember_iq_qtype_get(int type);

static inline uint32_t iq_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* IQ1_M's f16 scale, spread over the top nibbles of its four scale words. */
static inline uint16_t iq1m_d(const blk_iq1_m *b) {
    return (uint16_t)((b->scales[0] >> 12) | ((b->scales[1] >> 8) & 0x00f0) | ((b->scales[2] >> 4) & 0x0f00) |
                      (b->scales[3] & 0xf000));
}

/* A super-block unpacked: value i = factor * sc[i / 16] * v[i] (see the top of this file). */
typedef struct {
    int8_t v[QK_K];
    int16_t sc[16];
    float factor;
    float d; /* the block's f16 scale */
} iq_block;

/* 8 bytes of a grid entry, each times the +-1 of the same byte of signs. */
static inline void iq_put8(int8_t *v, uint64_t grid, uint64_t signs) {
    for (int j = 0; j < 8; j++) v[j] = (int8_t)((int8_t)(grid >> 8 * j) * (int8_t)(signs >> 8 * j));
}

/* Trit i of a base-3 fraction byte q: the top trit of (q * 3^i mod 256), 0..2. */
static inline int tq_trit(uint8_t q, int i) {
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    return ((uint8_t)(q * pow3[i]) * 3) >> 8;
}

static inline void iq_unpack(int type, const void *p, iq_block *b) {
    switch (type) {
    case EMBER_T_IQ2_XXS: {
        const blk_iq2_xxs *x = p;
        for (int ib = 0; ib < 8; ib++) {
            uint32_t a0 = iq_u32(x->qs + 8 * ib), a1 = iq_u32(x->qs + 8 * ib + 4);
            b->sc[2 * ib] = b->sc[2 * ib + 1] = (int16_t)(2 * (a1 >> 28) + 1);
            for (int l = 0; l < 4; l++)
                iq_put8(b->v + 32 * ib + 8 * l, ember_iq2xxs_grid[(a0 >> 8 * l) & 255], ember_iq_sign7[(a1 >> 7 * l) & 127]);
        }
        b->d = ember_f16_to_f32(x->d);
        b->factor = b->d * 0.125f;
        break;
    }
    case EMBER_T_IQ2_XS: {
        const blk_iq2_xs *x = p;
        for (int g = 0; g < 32; g++) iq_put8(b->v + 8 * g, ember_iq2xs_grid[x->qs[g] & 511], ember_iq_sign7[x->qs[g] >> 9]);
        for (int h = 0; h < 16; h++) b->sc[h] = (int16_t)(2 * ((x->scales[h / 2] >> 4 * (h % 2)) & 15) + 1);
        b->d = ember_f16_to_f32(x->d);
        b->factor = b->d * 0.125f;
        break;
    }
    case EMBER_T_IQ2_S: {
        const blk_iq2_s *x = p;
        for (int g = 0; g < 32; g++) {
            int idx = x->qs[g] | ((x->qh[g / 4] >> 2 * (g % 4)) & 3) << 8;
            iq_put8(b->v + 8 * g, ember_iq2s_grid[idx], ember_iq_sign8[x->signs[g]]);
        }
        for (int h = 0; h < 16; h++) b->sc[h] = (int16_t)(2 * ((x->scales[h / 2] >> 4 * (h % 2)) & 15) + 1);
        b->d = ember_f16_to_f32(x->d);
        b->factor = b->d * 0.125f;
        break;
    }
    case EMBER_T_IQ3_XXS: {
        const blk_iq3_xxs *x = p;
        for (int ib = 0; ib < 8; ib++) {
            uint32_t aux = iq_u32(x->ss + 4 * ib);
            b->sc[2 * ib] = b->sc[2 * ib + 1] = (int16_t)(2 * (aux >> 28) + 1);
            for (int l = 0; l < 4; l++) {
                const uint8_t *q = x->qs + 8 * ib + 2 * l;
                uint64_t grid = ember_iq3xxs_grid[q[0]] | (uint64_t)ember_iq3xxs_grid[q[1]] << 32;
                iq_put8(b->v + 32 * ib + 8 * l, grid, ember_iq_sign7[(aux >> 7 * l) & 127]);
            }
        }
        b->d = ember_f16_to_f32(x->d);
        b->factor = b->d * 0.25f;
        break;
    }
    case EMBER_T_IQ3_S: {
        const blk_iq3_s *x = p;
        for (int g = 0; g < 32; g++) {
            int i0 = 2 * g, i1 = 2 * g + 1;
            int idx0 = x->qs[i0] | ((x->qh[i0 / 8] >> (i0 % 8)) & 1) << 8, idx1 = x->qs[i1] | ((x->qh[i1 / 8] >> (i1 % 8)) & 1) << 8;
            iq_put8(b->v + 8 * g, ember_iq3s_grid[idx0] | (uint64_t)ember_iq3s_grid[idx1] << 32, ember_iq_sign8[x->signs[g]]);
        }
        for (int h = 0; h < 16; h++) b->sc[h] = (int16_t)(2 * ((x->scales[h / 4] >> 4 * ((h / 2) % 2)) & 15) + 1);
        b->d = ember_f16_to_f32(x->d);
        b->factor = b->d;
        break;
    }
    case EMBER_T_IQ1_S: {
        const blk_iq1_s *x = p;
        for (int ib = 0; ib < 8; ib++) {
            const int qh = x->qh[ib], delta = qh & 0x8000 ? -1 : 1;
            b->sc[2 * ib] = b->sc[2 * ib + 1] = (int16_t)(2 * ((qh >> 12) & 7) + 1);
            for (int l = 0; l < 4; l++) {
                uint64_t grid = ember_iq1s_grid[x->qs[4 * ib + l] | ((qh >> 3 * l) & 7) << 8];
                for (int j = 0; j < 8; j++) b->v[32 * ib + 8 * l + j] = (int8_t)((int8_t)(grid >> 8 * j) + delta);
            }
        }
        b->d = ember_f16_to_f32(x->d);
        b->factor = b->d * 0.125f;
        break;
    }
    case EMBER_T_IQ1_M: {
        const blk_iq1_m *x = p;
        for (int g = 0; g < 32; g++) {
            const int nib = (x->qh[g / 2] >> 4 * (g % 2)) & 15, delta = nib & 8 ? -1 : 1;
            uint64_t grid = ember_iq1s_grid[x->qs[g] | (nib & 7) << 8];
            for (int j = 0; j < 8; j++) b->v[8 * g + j] = (int8_t)((int8_t)(grid >> 8 * j) + delta);
        }
        for (int h = 0; h < 16; h++) b->sc[h] = (int16_t)(2 * ((x->scales[h / 4] >> 3 * (h % 4)) & 7) + 1);
        b->d = ember_f16_to_f32(iq1m_d(x));
        b->factor = b->d * 0.125f;
        break;
    }
    case EMBER_T_TQ1_0: {
        const blk_tq1_0 *x = p;
        for (int i = 0; i < 5; i++)
            for (int m = 0; m < 32; m++) b->v[32 * i + m] = (int8_t)(tq_trit(x->qs[m], i) - 1);
        for (int i = 0; i < 5; i++)
            for (int m = 0; m < 16; m++) b->v[160 + 16 * i + m] = (int8_t)(tq_trit(x->qs[32 + m], i) - 1);
        for (int i = 0; i < 4; i++)
            for (int m = 0; m < 4; m++) b->v[240 + 4 * i + m] = (int8_t)(tq_trit(x->qh[m], i) - 1);
        for (int h = 0; h < 16; h++) b->sc[h] = 1;
        b->d = ember_f16_to_f32(x->d);
        b->factor = b->d;
        break;
    }
    default: { /* TQ2_0 */
        const blk_tq2_0 *x = p;
        for (int v = 0; v < QK_K; v++) b->v[v] = (int8_t)(((x->qs[32 * (v >> 7) + (v & 31)] >> 2 * ((v >> 5) & 3)) & 3) - 1);
        for (int h = 0; h < 16; h++) b->sc[h] = 1;
        b->d = ember_f16_to_f32(x->d);
        b->factor = b->d;
    }
    }
}

#endif
