/* Portable kernels: the activation quantizers and one dot product per type. They define the results
 * the SIMD kernels must reproduce (same integer sums per block, same float factors) and are the
 * fallback for any type or CPU without a SIMD kernel. */
#include <math.h>

#include "quant.h"

/* ---- activation quantizers ---- */

/* Quantize n values with one scale: q (n,) = round_even(x * 127 / amax); returns d = amax / 127. */
static float quantize_block(const float *x, int8_t *q, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < n; i++) q[i] = (int8_t)nearbyintf(x[i] * id);
    return amax / 127.0f;
}

/* x (k,) -> EMBER_ACT_Q8 row: q (k,) | d (k/32,) | s (k/32,) | nq (k/32,) */
static void quantize_q8(const float *x, void *dst, int64_t k) {
    int8_t *q = dst;
    float *d = (float *)(q + k), *s = d + k / QK;
    int32_t *nq = (int32_t *)(s + k / QK);
    for (int64_t b = 0; b < k / QK; b++) {
        d[b] = quantize_block(x + b * QK, q + b * QK, QK);
        int sum = 0;
        for (int i = 0; i < QK; i++) sum += q[b * QK + i];
        s[b] = d[b] * (float)sum;
        nq[b] = -sum;
    }
}

/* x (k,) -> EMBER_ACT_Q8K row: q (k,) | d (k/256,) | bsums (k/16,) (chunk sums: the callers) */
static void quantize_q8k(const float *x, void *dst, int64_t k) {
    int8_t *q = dst;
    float *d = (float *)(q + k);
    int16_t *bsums = (int16_t *)(d + k / QK_K);
    for (int64_t b = 0; b < k / QK_K; b++) d[b] = quantize_block(x + b * QK_K, q + b * QK_K, QK_K);
    for (int64_t g = 0; g < k / 16; g++) {
        int sum = 0;
        for (int i = 0; i < 16; i++) sum += q[g * 16 + i];
        bsums[g] = (int16_t)sum;
    }
}

static void quantize_q8k16(const float *x, void *dst, int64_t k) {
    quantize_q8k(x, dst, k);
    ember_q8k_chunk_sums(dst, k, 16);
}

static void quantize_q8k32(const float *x, void *dst, int64_t k) {
    quantize_q8k(x, dst, k);
    ember_q8k_chunk_sums(dst, k, 32);
}

/* ---- views of a quantized activation row ---- */

typedef struct {
    const int8_t *q;     /* (k,) */
    const float *d, *s;  /* (k/32,) each */
} act_q8;

static inline act_q8 act_q8_view(const void *a, int64_t k) {
    const int8_t *q = a;
    const float *d = (const float *)(q + k);
    return (act_q8){q, d, d + k / QK};
}

typedef struct {
    const int8_t *q;       /* (k,) */
    const float *d;        /* (k/256,) */
    const int16_t *bsums;  /* (k/16,) */
} act_q8k;

static inline act_q8k act_q8k_view(const void *a, int64_t k) {
    const int8_t *q = a;
    const float *d = (const float *)(q + k);
    return (act_q8k){q, d, (const int16_t *)(d + k / QK_K)};
}

static inline float h2f(uint16_t h) { return ember_f16_to_f32(h); }

/* ---- 32-value blocks: w row (k/32 blocks) . activation row ---- */

/* sum over a block of (q_w - off) * q_a, with q_w given as its 32 unsigned values */
static inline int block_dot(const uint8_t *u, const int8_t *qa, int off) {
    int sum = 0;
    for (int l = 0; l < QK; l++) sum += ((int)u[l] - off) * qa[l];
    return sum;
}

static inline void unpack_nibbles(const uint8_t *qs16, uint8_t *u) {
    for (int l = 0; l < 16; l++) {
        u[l] = qs16[l] & 0xf;
        u[l + 16] = qs16[l] >> 4;
    }
}

static inline void add_high_bits(const uint8_t *qh4, uint8_t *u) {
    uint32_t qh;
    memcpy(&qh, qh4, 4);
    for (int l = 0; l < QK; l++) u[l] |= ((qh >> l) & 1) << 4;
}

static float dot_q4_0(int64_t k, const void *w, const void *a) {
    const blk_q4_0 *b = w;
    act_q8 x = act_q8_view(a, k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK; i++) {
        uint8_t u[QK];
        unpack_nibbles(b[i].qs, u);
        sum += h2f(b[i].d) * x.d[i] * (float)block_dot(u, x.q + i * QK, 8);
    }
    return sum;
}

static float dot_q4_1(int64_t k, const void *w, const void *a) {
    const blk_q4_1 *b = w;
    act_q8 x = act_q8_view(a, k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK; i++) {
        uint8_t u[QK];
        unpack_nibbles(b[i].qs, u);
        sum += h2f(b[i].d) * x.d[i] * (float)block_dot(u, x.q + i * QK, 0) + h2f(b[i].m) * x.s[i];
    }
    return sum;
}

static float dot_q5_0(int64_t k, const void *w, const void *a) {
    const blk_q5_0 *b = w;
    act_q8 x = act_q8_view(a, k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK; i++) {
        uint8_t u[QK];
        unpack_nibbles(b[i].qs, u);
        add_high_bits(b[i].qh, u);
        sum += h2f(b[i].d) * x.d[i] * (float)block_dot(u, x.q + i * QK, 16);
    }
    return sum;
}

static float dot_q5_1(int64_t k, const void *w, const void *a) {
    const blk_q5_1 *b = w;
    act_q8 x = act_q8_view(a, k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK; i++) {
        uint8_t u[QK];
        unpack_nibbles(b[i].qs, u);
        add_high_bits(b[i].qh, u);
        sum += h2f(b[i].d) * x.d[i] * (float)block_dot(u, x.q + i * QK, 0) + h2f(b[i].m) * x.s[i];
    }
    return sum;
}

static float dot_q8_0(int64_t k, const void *w, const void *a) {
    const blk_q8_0 *b = w;
    act_q8 x = act_q8_view(a, k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK; i++) {
        int isum = 0;
        for (int l = 0; l < QK; l++) isum += b[i].qs[l] * x.q[i * QK + l];
        sum += h2f(b[i].d) * x.d[i] * (float)isum;
    }
    return sum;
}

static float dot_iq4_nl(int64_t k, const void *w, const void *a) {
    const blk_iq4_nl *b = w;
    act_q8 x = act_q8_view(a, k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK; i++) {
        const int8_t *qa = x.q + i * QK;
        int isum = 0;
        for (int l = 0; l < 16; l++)
            isum += ember_iq4nl_values[b[i].qs[l] & 0xf] * qa[l] + ember_iq4nl_values[b[i].qs[l] >> 4] * qa[l + 16];
        sum += h2f(b[i].d) * x.d[i] * (float)isum;
    }
    return sum;
}

/* ---- 256-value super-blocks: w row (k/256 blocks) . activation row ---- */

/* sum over 16 values of u * q_a (u unsigned weights without their offset) */
static inline int dot16(const uint8_t *u, const int8_t *qa) {
    int sum = 0;
    for (int l = 0; l < 16; l++) sum += u[l] * qa[l];
    return sum;
}

static float dot_q2_k(int64_t k, const void *w, const void *a) {
    const blk_q2_k *b = w;
    act_q8k x = act_q8k_view(a, k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++) {
        const int8_t *qa = x.q + i * QK_K;
        const int16_t *bs = x.bsums + i * 16;
        int isum = 0, msum = 0;
        for (int g = 0; g < 16; g++) { /* 16 values: v = 16g .. ; h = g / 8, s = (g / 2) % 4 */
            uint8_t u[16];
            int h = g >> 3, s = (g >> 1) & 3, l0 = 16 * (g & 1);
            for (int l = 0; l < 16; l++) u[l] = (b[i].qs[32 * h + l0 + l] >> (2 * s)) & 3;
            isum += (b[i].scales[g] & 0xf) * dot16(u, qa + 16 * g);
            msum += (b[i].scales[g] >> 4) * bs[g];
        }
        sum += x.d[i] * (h2f(b[i].d) * (float)isum - h2f(b[i].dmin) * (float)msum);
    }
    return sum;
}

static float dot_q3_k(int64_t k, const void *w, const void *a) {
    const blk_q3_k *b = w;
    act_q8k x = act_q8k_view(a, k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++) {
        const int8_t *qa = x.q + i * QK_K;
        const int16_t *bs = x.bsums + i * 16;
        int8_t sc[16];
        ember_q3k_scales(b[i].scales, sc);
        int isum = 0;
        for (int g = 0; g < 16; g++) { /* u = low 2 bits + 4 * hmask bit, value u - 4 */
            uint8_t u[16];
            int h = g >> 3, s = (g >> 1) & 3, l0 = 16 * (g & 1);
            for (int l = 0; l < 16; l++)
                u[l] = (uint8_t)(((b[i].qs[32 * h + l0 + l] >> (2 * s)) & 3) |
                                 (((b[i].hmask[l0 + l] >> (4 * h + s)) & 1) << 2));
            isum += sc[g] * (dot16(u, qa + 16 * g) - 4 * bs[g]);
        }
        sum += h2f(b[i].d) * x.d[i] * (float)isum;
    }
    return sum;
}

/* Q4_K and Q5_K: sub-block j of 32 values has six-bit scale sc[j] and min m[j]. */
static float dot_q45_k(int64_t k, const void *w, const void *a, int five) {
    act_q8k x = act_q8k_view(a, k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++) {
        const blk_q4_k *b4 = (const blk_q4_k *)w + i;
        const blk_q5_k *b5 = (const blk_q5_k *)w + i;
        const uint8_t *scales = five ? b5->scales : b4->scales, *qs = five ? b5->qs : b4->qs;
        uint16_t d = five ? b5->d : b4->d, dmin = five ? b5->dmin : b4->dmin;
        const int8_t *qa = x.q + i * QK_K;
        const int16_t *bs = x.bsums + i * 16;
        uint8_t sc[8], m[8];
        ember_q4k_scales(scales, sc, m);
        int isum = 0, msum = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t u[32];
            for (int l = 0; l < 32; l++) {
                u[l] = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 0xf;
                if (five) u[l] |= ((b5->qh[l] >> j) & 1) << 4;
            }
            isum += sc[j] * (dot16(u, qa + 32 * j) + dot16(u + 16, qa + 32 * j + 16));
            msum += m[j] * (bs[2 * j] + bs[2 * j + 1]);
        }
        sum += x.d[i] * (h2f(d) * (float)isum - h2f(dmin) * (float)msum);
    }
    return sum;
}

static float dot_q4_k(int64_t k, const void *w, const void *a) { return dot_q45_k(k, w, a, 0); }

static float dot_q5_k(int64_t k, const void *w, const void *a) { return dot_q45_k(k, w, a, 1); }

static float dot_q6_k(int64_t k, const void *w, const void *a) {
    const blk_q6_k *b = w;
    act_q8k x = act_q8k_view(a, k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++) {
        const int8_t *qa = x.q + i * QK_K;
        const int16_t *bs = x.bsums + i * 16;
        int isum = 0;
        for (int g = 0; g < 16; g++) { /* v = 16g + l = 128h + 32s + l' */
            uint8_t u[16];
            int h = g >> 3, s = (g >> 1) & 3, l0 = 16 * (g & 1);
            for (int l = 0; l < 16; l++) {
                int lo = (b[i].ql[64 * h + 32 * (s & 1) + l0 + l] >> (4 * (s >> 1))) & 0xf;
                int hi = (b[i].qh[32 * h + l0 + l] >> (2 * s)) & 3;
                u[l] = (uint8_t)(lo | hi << 4);
            }
            isum += b[i].scales[g] * (dot16(u, qa + 16 * g) - 32 * bs[g]);
        }
        sum += h2f(b[i].d) * x.d[i] * (float)isum;
    }
    return sum;
}

static float dot_iq4_xs(int64_t k, const void *w, const void *a) {
    const blk_iq4_xs *b = w;
    act_q8k x = act_q8k_view(a, k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++) {
        const int8_t *qa = x.q + i * QK_K;
        int isum = 0;
        for (int ib = 0; ib < 8; ib++) {
            int s = 0;
            for (int l = 0; l < 16; l++) {
                uint8_t q = b[i].qs[16 * ib + l];
                s += ember_iq4nl_values[q & 0xf] * qa[32 * ib + l] + ember_iq4nl_values[q >> 4] * qa[32 * ib + l + 16];
            }
            isum += ember_iq4xs_scale(&b[i], ib) * s;
        }
        sum += h2f(b[i].d) * x.d[i] * (float)isum;
    }
    return sum;
}

/* ---- float weights with f32 activations ---- */

static float dot_f32(int64_t k, const void *w, const void *a) {
    const float *x = w, *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < k; i++) sum += x[i] * y[i];
    return sum;
}

static float dot_f16(int64_t k, const void *w, const void *a) {
    const uint16_t *x = w;
    const float *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < k; i++) sum += h2f(x[i]) * y[i];
    return sum;
}

static float dot_bf16(int64_t k, const void *w, const void *a) {
    const uint16_t *x = w;
    const float *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < k; i++) sum += ember_bf16_to_f32(x[i]) * y[i];
    return sum;
}

/* ---- tiles: one dot product per (row, token) ---- */

typedef float (*dot_fn)(int64_t k, const void *w, const void *a);

static inline void tile_by_dots(dot_fn dot, int64_t k, const void *w, int64_t ws, const void *a, int64_t as,
                                float *y, int64_t ys, int nr, int nc) {
    for (int c = 0; c < nc; c++)
        for (int r = 0; r < nr; r++)
            y[c * ys + r] = dot(k, (const uint8_t *)w + r * ws, (const uint8_t *)a + c * as);
}

#define SCALAR_TILE(name)                                                                                \
    static void tile_##name(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, float *y,   \
                            int64_t ys, int nr, int nc) {                                                \
        tile_by_dots(dot_##name, k, w, ws, a, as, y, ys, nr, nc);                                        \
    }

SCALAR_TILE(q4_0)
SCALAR_TILE(q4_1)
SCALAR_TILE(q5_0)
SCALAR_TILE(q5_1)
SCALAR_TILE(q8_0)
SCALAR_TILE(iq4_nl)
SCALAR_TILE(q2_k)
SCALAR_TILE(q3_k)
SCALAR_TILE(q4_k)
SCALAR_TILE(q5_k)
SCALAR_TILE(q6_k)
SCALAR_TILE(iq4_xs)
SCALAR_TILE(f32)
SCALAR_TILE(f16)
SCALAR_TILE(bf16)

#define T1(name) {tile_##name, 1, 4}

const ember_kernels ember_kernels_scalar = {
    .quantize = {[EMBER_ACT_Q8] = quantize_q8, [EMBER_ACT_Q8K16] = quantize_q8k16, [EMBER_ACT_Q8K32] = quantize_q8k32},
    .tile = {
        [EMBER_T_Q4_0] = T1(q4_0), [EMBER_T_Q4_1] = T1(q4_1), [EMBER_T_Q5_0] = T1(q5_0),
        [EMBER_T_Q5_1] = T1(q5_1), [EMBER_T_Q8_0] = T1(q8_0), [EMBER_T_IQ4_NL] = T1(iq4_nl),
        [EMBER_T_Q2_K] = T1(q2_k), [EMBER_T_Q3_K] = T1(q3_k), [EMBER_T_Q4_K] = T1(q4_k),
        [EMBER_T_Q5_K] = T1(q5_k), [EMBER_T_Q6_K] = T1(q6_k), [EMBER_T_IQ4_XS] = T1(iq4_xs),
        [EMBER_T_F32] = T1(f32), [EMBER_T_F16] = T1(f16), [EMBER_T_BF16] = T1(bf16),
    },
};
