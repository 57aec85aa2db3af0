/* Portable kernels: the activation quantizers and one dot product per type. They define the results
 * the SIMD kernels must reproduce (same quantized activations, same integer sums per block, same float
 * factors) and are the fallback for any type or CPU without a SIMD kernel. Each weight block is
 * unpacked once into signed bytes and scales, then dotted with the activation row. */
#include <math.h>

#include "quant.h"

/* ---- activation quantizers (see quant.h) ---- */

/* x (k,) -> EMBER_ACT_Q16 row: c (k,) | d (k/32,) | s (k/32,) */
static void quantize_q16(const float *x, void *dst, int64_t k) {
    int16_t *c = dst;
    float *d = (float *)(c + k), *s = d + k / QK;
    for (int64_t b = 0; b < k / QK; b++, x += QK, c += QK) {
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(x[i]));
        const float id = amax != 0.0f ? 32767.0f / amax : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) sum += c[i] = (int16_t)nearbyintf(x[i] * id);
        d[b] = amax / 32767.0f;
        s[b] = d[b] * (float)sum;
    }
}

static float f16_round(float v) { return ember_f16_to_f32(ember_f32_to_f16(v)); }

/* x (k,) -> the same row, rounded as llama.cpp's Q8_0 / Q8_1, and its values again as int8 (and their block sums) */
static void quantize_q16_llama(const float *x, void *dst, int64_t k) {
    int16_t *c = dst;
    float *d = (float *)(c + k), *s = d + k / QK;
    int8_t *q = (int8_t *)dst + ember_q16_q8_offset(k);
    int32_t *qsum = (int32_t *)((uint8_t *)dst + ember_q16_qsum_offset(k));
    for (int64_t b = 0; b < k / QK; b++, x += QK, c += QK, q += QK) {
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(x[i]));
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f, d32 = amax / 127.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) sum += q[i] = (int8_t)(c[i] = (int16_t)nearbyintf(x[i] * id));
        qsum[b] = sum;
        d[b] = f16_round(d32);
        s[b] = f16_round(d32 * (float)sum);
    }
}

/* x (k,) -> EMBER_ACT_Q8K row: q (k,) | d (k/256,) | bsums (k/16,) | the panels' sums */
static void quantize_q8k(const float *x, void *dst, int64_t k) {
    int8_t *q = dst;
    float *d = (float *)(q + k);
    int16_t *bsums = (int16_t *)(d + k / QK_K);
    for (int64_t b = 0; b < k / QK_K; b++, x += QK_K, q += QK_K) {
        float amax = 0.0f, m = 0.0f; /* m: the first value of largest magnitude */
        for (int i = 0; i < QK_K; i++)
            if (fabsf(x[i]) > amax) amax = fabsf(x[i]), m = x[i];
        const float iscale = amax != 0.0f ? -127.0f / m : 0.0f;
        for (int i = 0; i < QK_K; i++) q[i] = (int8_t)fminf(127.0f, nearbyintf(iscale * x[i]));
        d[b] = amax != 0.0f ? 1.0f / iscale : 0.0f;
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += q[16 * g + i];
            bsums[16 * b + g] = (int16_t)sum;
        }
    }
    ember_q8k_sums(dst, k);
}

/* ---- views of quantized activation rows ---- */

typedef struct {
    const int16_t *c;    /* (k,) */
    const float *d, *s;  /* (k/32,) each */
} act_q16;

static inline act_q16 act_q16_view(const void *a, int64_t k) {
    const int16_t *c = a;
    const float *d = (const float *)(c + k);
    return (act_q16){c, d, d + k / QK};
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

static inline int dot_n(const int8_t *v, const int8_t *q, int n) {
    int sum = 0;
    for (int l = 0; l < n; l++) sum += v[l] * q[l];
    return sum;
}

static inline int dot_n16(const int8_t *v, const int16_t *c, int n) {
    int sum = 0;
    for (int l = 0; l < n; l++) sum += v[l] * c[l];
    return sum;
}

/* ---- 32-value blocks ---- */

/* A legacy block as 32 signed weights v (offset removed), its scale d and min m (0 when none). */
typedef struct {
    int8_t v[QK];
    float d, m;
} block32;

static inline int q5_high(const uint8_t *qh4, int l) {
    uint32_t qh;
    memcpy(&qh, qh4, 4);
    return (int)((qh >> l) & 1) << 4;
}

/* The nibbles of qs (16 bytes), low then high, plus the fifth bits of qh (when not NULL), minus off. */
static inline void unpack_nibbles(const uint8_t *qs, const uint8_t *qh, int off, int8_t *v) {
    for (int l = 0; l < 16; l++) {
        v[l] = (int8_t)(((qs[l] & 0xf) | (qh ? q5_high(qh, l) : 0)) - off);
        v[l + 16] = (int8_t)(((qs[l] >> 4) | (qh ? q5_high(qh, l + 16) : 0)) - off);
    }
}

static block32 unpack_block32(int type, const void *p) {
    block32 b = {.m = 0.0f};
    switch (type) {
    case EMBER_T_Q4_0: {
        const blk_q4_0 *x = p;
        unpack_nibbles(x->qs, NULL, 8, b.v);
        b.d = h2f(x->d);
        break;
    }
    case EMBER_T_Q4_1: {
        const blk_q4_1 *x = p;
        unpack_nibbles(x->qs, NULL, 0, b.v);
        b.d = h2f(x->d), b.m = h2f(x->m);
        break;
    }
    case EMBER_T_Q5_0: {
        const blk_q5_0 *x = p;
        unpack_nibbles(x->qs, x->qh, 16, b.v);
        b.d = h2f(x->d);
        break;
    }
    case EMBER_T_Q5_1: {
        const blk_q5_1 *x = p;
        unpack_nibbles(x->qs, x->qh, 0, b.v);
        b.d = h2f(x->d), b.m = h2f(x->m);
        break;
    }
    case EMBER_T_Q8_0: {
        const blk_q8_0 *x = p;
        memcpy(b.v, x->qs, QK);
        b.d = h2f(x->d);
        break;
    }
    case EMBER_T_MXFP4: {
        const blk_mxfp4 *x = p;
        for (int l = 0; l < 16; l++) {
            b.v[l] = ember_mxfp4_values[x->qs[l] & 0xf];
            b.v[l + 16] = ember_mxfp4_values[x->qs[l] >> 4];
        }
        b.d = ember_e8m0_half(x->e);
        break;
    }
    default: { /* IQ4_NL */
        const blk_iq4_nl *x = p;
        for (int l = 0; l < 16; l++) {
            b.v[l] = ember_iq4nl_values[x->qs[l] & 0xf];
            b.v[l + 16] = ember_iq4nl_values[x->qs[l] >> 4];
        }
        b.d = h2f(x->d);
    }
    }
    return b;
}

/* w row (k/32 blocks of `type`) . activation row a */
static float dot_legacy(int type, int64_t k, const void *w, const void *a) {
    const int bytes = ember_qtype_get(type)->type_size;
    const act_q16 x = act_q16_view(a, k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK; i++) {
        const block32 b = unpack_block32(type, (const uint8_t *)w + i * bytes);
        sum += b.d * (x.d[i] * (float)dot_n16(b.v, x.c + i * QK, QK)) + b.m * x.s[i];
    }
    return sum;
}

/* ---- 256-value super-blocks ---- */

/* A super-block as 256 signed weights v (offsets removed), an integer scale and min per 16 values
 * (the 32-value types repeat theirs), and the float factors: value = d sc v - dmin mn. */
typedef struct {
    int8_t v[QK_K];
    int sc[16], mn[16];
    float d, dmin;
} block256;

static void unpack_q2_k(const blk_q2_k *x, block256 *b) {
    for (int v = 0; v < QK_K; v++) /* v = 128h + 32s + l: bits 2s of qs[32h + l] */
        b->v[v] = (int8_t)((x->qs[32 * (v >> 7) + (v & 31)] >> (2 * ((v >> 5) & 3))) & 3);
    for (int g = 0; g < 16; g++) b->sc[g] = x->scales[g] & 0xf, b->mn[g] = x->scales[g] >> 4;
    b->d = h2f(x->d), b->dmin = h2f(x->dmin);
}

static void unpack_q3_k(const blk_q3_k *x, block256 *b) {
    for (int v = 0; v < QK_K; v++) { /* like Q2_K; a clear bit (4h + s) of hmask[l] means minus 4 */
        int h = v >> 7, s = (v >> 5) & 3, l = v & 31;
        int q = (x->qs[32 * h + l] >> (2 * s)) & 3;
        b->v[v] = (int8_t)(q - (((x->hmask[l] >> (4 * h + s)) & 1) ? 0 : 4));
    }
    int8_t sc[16];
    ember_q3k_scales(x->scales, sc);
    for (int g = 0; g < 16; g++) b->sc[g] = sc[g], b->mn[g] = 0;
    b->d = h2f(x->d), b->dmin = 0.0f;
}

/* Q4_K (qh NULL) and Q5_K: sub-block j: nibble (j & 1) of qs[32 (j / 2) + l], fifth bit j of qh[l] */
static void unpack_q45_k(const uint8_t *scales, const uint8_t *qs, const uint8_t *qh, uint16_t d, uint16_t dmin,
                         block256 *b) {
    uint8_t sc[8], m[8];
    ember_q4k_scales(scales, sc, m);
    for (int j = 0; j < 8; j++) {
        for (int l = 0; l < 32; l++) {
            int q = (qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 0xf;
            b->v[32 * j + l] = (int8_t)(q | (qh ? ((qh[l] >> j) & 1) << 4 : 0));
        }
        b->sc[2 * j] = b->sc[2 * j + 1] = sc[j];
        b->mn[2 * j] = b->mn[2 * j + 1] = m[j];
    }
    b->d = h2f(d), b->dmin = h2f(dmin);
}

static void unpack_q6_k(const blk_q6_k *x, block256 *b) {
    for (int v = 0; v < QK_K; v++) { /* low 4 bits: ql[64h + 32(s&1) + l] nibble s/2; high 2: qh[32h + l] bits 2s */
        int h = v >> 7, s = (v >> 5) & 3, l = v & 31;
        int lo = (x->ql[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 0xf;
        int hi = (x->qh[32 * h + l] >> (2 * s)) & 3;
        b->v[v] = (int8_t)((lo | hi << 4) - 32);
    }
    for (int g = 0; g < 16; g++) b->sc[g] = x->scales[g], b->mn[g] = 0;
    b->d = h2f(x->d), b->dmin = 0.0f;
}

static void unpack_iq4_xs(const blk_iq4_xs *x, block256 *b) {
    for (int ib = 0; ib < 8; ib++) { /* sub-block ib: low nibbles of qs[16 ib ..] then high nibbles */
        for (int l = 0; l < 16; l++) {
            b->v[32 * ib + l] = ember_iq4nl_values[x->qs[16 * ib + l] & 0xf];
            b->v[32 * ib + l + 16] = ember_iq4nl_values[x->qs[16 * ib + l] >> 4];
        }
        b->sc[2 * ib] = b->sc[2 * ib + 1] = ember_iq4xs_scale(x, ib);
        b->mn[2 * ib] = b->mn[2 * ib + 1] = 0;
    }
    b->d = h2f(x->d), b->dmin = 0.0f;
}

static void unpack_block256(int type, const void *p, block256 *b) {
    switch (type) {
    case EMBER_T_Q2_K: unpack_q2_k(p, b); break;
    case EMBER_T_Q3_K: unpack_q3_k(p, b); break;
    case EMBER_T_Q4_K: {
        const blk_q4_k *x = p;
        unpack_q45_k(x->scales, x->qs, NULL, x->d, x->dmin, b);
        break;
    }
    case EMBER_T_Q5_K: {
        const blk_q5_k *x = p;
        unpack_q45_k(x->scales, x->qs, x->qh, x->d, x->dmin, b);
        break;
    }
    case EMBER_T_Q6_K: unpack_q6_k(p, b); break;
    default: unpack_iq4_xs(p, b);
    }
}

/* w row (k/256 super-blocks of `type`) . activation row a */
static float dot_k(int type, int64_t k, const void *w, const void *a) {
    const int bytes = ember_qtype_get(type)->type_size;
    const act_q8k x = act_q8k_view(a, k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++) {
        block256 b;
        unpack_block256(type, (const uint8_t *)w + i * bytes, &b);
        const int8_t *qa = x.q + i * QK_K;
        const int16_t *bs = x.bsums + i * 16;
        int isum = 0, msum = 0;
        for (int g = 0; g < 16; g++) {
            isum += b.sc[g] * dot_n(b.v + 16 * g, qa + 16 * g, 16);
            msum += b.mn[g] * bs[g];
        }
        sum += x.d[i] * (b.d * (float)isum - b.dmin * (float)msum);
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

#define QUANT_TILE(name, TYPE, DOT)                                                                            \
    static void tile_##name(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, float *y,         \
                            int64_t ys, int nr, int nc) {                                                      \
        for (int c = 0; c < nc; c++)                                                                           \
            for (int r = 0; r < nr; r++)                                                                       \
                y[c * ys + r] = DOT(TYPE, k, (const uint8_t *)w + r * ws, (const uint8_t *)a + c * as);        \
    }

#define FLOAT_TILE(name)                                                                                       \
    static void tile_##name(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, float *y,         \
                            int64_t ys, int nr, int nc) {                                                      \
        for (int c = 0; c < nc; c++)                                                                           \
            for (int r = 0; r < nr; r++)                                                                       \
                y[c * ys + r] = dot_##name(k, (const uint8_t *)w + r * ws, (const uint8_t *)a + c * as);       \
    }

QUANT_TILE(q4_0, EMBER_T_Q4_0, dot_legacy)
QUANT_TILE(q4_1, EMBER_T_Q4_1, dot_legacy)
QUANT_TILE(q5_0, EMBER_T_Q5_0, dot_legacy)
QUANT_TILE(q5_1, EMBER_T_Q5_1, dot_legacy)
QUANT_TILE(q8_0, EMBER_T_Q8_0, dot_legacy)
QUANT_TILE(iq4_nl, EMBER_T_IQ4_NL, dot_legacy)
QUANT_TILE(mxfp4, EMBER_T_MXFP4, dot_legacy)
QUANT_TILE(q2_k, EMBER_T_Q2_K, dot_k)
QUANT_TILE(q3_k, EMBER_T_Q3_K, dot_k)
QUANT_TILE(q4_k, EMBER_T_Q4_K, dot_k)
QUANT_TILE(q5_k, EMBER_T_Q5_K, dot_k)
QUANT_TILE(q6_k, EMBER_T_Q6_K, dot_k)
QUANT_TILE(iq4_xs, EMBER_T_IQ4_XS, dot_k)
FLOAT_TILE(f32)
FLOAT_TILE(f16)
FLOAT_TILE(bf16)

#define T1(name) {tile_##name, 1, 4}

const ember_kernels ember_kernels_scalar = {
    .quantize = {[EMBER_ACT_Q16] = quantize_q16, [EMBER_ACT_Q16_LLAMA] = quantize_q16_llama, [EMBER_ACT_Q8K] = quantize_q8k},
    .tile = {
        [EMBER_T_Q4_0] = T1(q4_0), [EMBER_T_Q4_1] = T1(q4_1), [EMBER_T_Q5_0] = T1(q5_0),
        [EMBER_T_Q5_1] = T1(q5_1), [EMBER_T_Q8_0] = T1(q8_0), [EMBER_T_IQ4_NL] = T1(iq4_nl),
        [EMBER_T_MXFP4] = T1(mxfp4), [EMBER_T_Q2_K] = T1(q2_k), [EMBER_T_Q3_K] = T1(q3_k), [EMBER_T_Q4_K] = T1(q4_k),
        [EMBER_T_Q5_K] = T1(q5_k), [EMBER_T_Q6_K] = T1(q6_k), [EMBER_T_IQ4_XS] = T1(iq4_xs),
        [EMBER_T_F32] = T1(f32), [EMBER_T_F16] = T1(f16), [EMBER_T_BF16] = T1(bf16),
    },
};
