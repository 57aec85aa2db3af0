/* Dequantization of every supported ggml type (the embedding lookup and the float reference use it),
 * and the table of per-type facts. Results are bit-exact with the numpy reference, so products here
 * must not be fused into multiply-adds. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "quant.h"
#include "quant_iq.h"

const int8_t ember_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                       1,    13,   25,  38,  53,  69,  89,  113};

const int8_t ember_mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float h2f(uint16_t h) { return ember_f16_to_f32(h); }

/* ---- float types ---- */

static void dequant_f32(const void *src, float *dst, int64_t n) { memcpy(dst, src, (size_t)n * 4); }

static void dequant_f16(const void *src, float *dst, int64_t n) {
    const uint16_t *s = src; /* (n,) */
    for (int64_t i = 0; i < n; i++) dst[i] = h2f(s[i]);
}

static void dequant_bf16(const void *src, float *dst, int64_t n) {
    const uint16_t *s = src; /* (n,) */
    for (int64_t i = 0; i < n; i++) dst[i] = ember_bf16_to_f32(s[i]);
}

/* ---- 32-value blocks ---- */

static void dequant_q4_0(const void *src, float *dst, int64_t nb) {
    const blk_q4_0 *b = src; /* (nb,) -> dst (nb, 32) */
    for (int64_t i = 0; i < nb; i++, b++, dst += QK) {
        float d = h2f(b->d);
        for (int l = 0; l < 16; l++) {
            dst[l] = d * (float)((b->qs[l] & 0xf) - 8);
            dst[l + 16] = d * (float)((b->qs[l] >> 4) - 8);
        }
    }
}

static void dequant_q4_1(const void *src, float *dst, int64_t nb) {
    const blk_q4_1 *b = src;
    for (int64_t i = 0; i < nb; i++, b++, dst += QK) {
        float d = h2f(b->d), m = h2f(b->m);
        for (int l = 0; l < 16; l++) {
            dst[l] = d * (float)(b->qs[l] & 0xf) + m;
            dst[l + 16] = d * (float)(b->qs[l] >> 4) + m;
        }
    }
}

/* The fifth bit of value l of a Q5 block, as 0 or 16. */
static inline int q5_high(const uint8_t *qh4, int l) {
    uint32_t qh;
    memcpy(&qh, qh4, 4);
    return (int)((qh >> l) & 1) << 4;
}

static void dequant_q5_0(const void *src, float *dst, int64_t nb) {
    const blk_q5_0 *b = src;
    for (int64_t i = 0; i < nb; i++, b++, dst += QK) {
        float d = h2f(b->d);
        for (int l = 0; l < 16; l++) {
            dst[l] = d * (float)(((b->qs[l] & 0xf) | q5_high(b->qh, l)) - 16);
            dst[l + 16] = d * (float)(((b->qs[l] >> 4) | q5_high(b->qh, l + 16)) - 16);
        }
    }
}

static void dequant_q5_1(const void *src, float *dst, int64_t nb) {
    const blk_q5_1 *b = src;
    for (int64_t i = 0; i < nb; i++, b++, dst += QK) {
        float d = h2f(b->d), m = h2f(b->m);
        for (int l = 0; l < 16; l++) {
            dst[l] = d * (float)((b->qs[l] & 0xf) | q5_high(b->qh, l)) + m;
            dst[l + 16] = d * (float)((b->qs[l] >> 4) | q5_high(b->qh, l + 16)) + m;
        }
    }
}

static void dequant_q8_0(const void *src, float *dst, int64_t nb) {
    const blk_q8_0 *b = src;
    for (int64_t i = 0; i < nb; i++, b++, dst += QK) {
        float d = h2f(b->d);
        for (int l = 0; l < QK; l++) dst[l] = (float)b->qs[l] * d;
    }
}

static void dequant_iq4_nl(const void *src, float *dst, int64_t nb) {
    const blk_iq4_nl *b = src;
    for (int64_t i = 0; i < nb; i++, b++, dst += QK) {
        float d = h2f(b->d);
        for (int l = 0; l < 16; l++) {
            dst[l] = d * (float)ember_iq4nl_values[b->qs[l] & 0xf];
            dst[l + 16] = d * (float)ember_iq4nl_values[b->qs[l] >> 4];
        }
    }
}

static void dequant_mxfp4(const void *src, float *dst, int64_t nb) {
    const blk_mxfp4 *b = src;
    for (int64_t i = 0; i < nb; i++, b++, dst += QK) {
        const float d = ember_e8m0_half(b->e);
        for (int l = 0; l < 16; l++) {
            dst[l] = d * (float)ember_mxfp4_values[b->qs[l] & 0xf];
            dst[l + 16] = d * (float)ember_mxfp4_values[b->qs[l] >> 4];
        }
    }
}

/* ---- 256-value super-blocks ---- */

static void dequant_q2_k(const void *src, float *dst, int64_t nb) {
    const blk_q2_k *b = src; /* value v = 128h + 32s + l: bits 2s of qs[32h + l]; scale index v / 16 */
    for (int64_t i = 0; i < nb; i++, b++, dst += QK_K) {
        float d = h2f(b->d), dmin = h2f(b->dmin);
        for (int v = 0; v < QK_K; v++) {
            int h = v >> 7, s = (v >> 5) & 3, l = v & 31;
            uint8_t sc = b->scales[v >> 4];
            float dl = d * (float)(sc & 0xf), ml = dmin * (float)(sc >> 4);
            dst[v] = dl * (float)((b->qs[32 * h + l] >> (2 * s)) & 3) - ml;
        }
    }
}

static void dequant_q3_k(const void *src, float *dst, int64_t nb) {
    const blk_q3_k *b = src; /* like Q2_K, plus bit (4h + s) of hmask[l]: clear means minus 4 */
    for (int64_t i = 0; i < nb; i++, b++, dst += QK_K) {
        float d = h2f(b->d);
        int8_t sc[16];
        ember_q3k_scales(b->scales, sc);
        for (int v = 0; v < QK_K; v++) {
            int h = v >> 7, s = (v >> 5) & 3, l = v & 31;
            int q = (b->qs[32 * h + l] >> (2 * s)) & 3;
            int hbit = (b->hmask[l] >> (4 * h + s)) & 1;
            dst[v] = (d * (float)sc[v >> 4]) * (float)(q - (hbit ? 0 : 4));
        }
    }
}

static void dequant_q4_k(const void *src, float *dst, int64_t nb) {
    const blk_q4_k *b = src; /* sub-block j (32 values): nibble (j & 1) of qs[32 (j / 2) + l] */
    for (int64_t i = 0; i < nb; i++, b++, dst += QK_K) {
        float d = h2f(b->d), dmin = h2f(b->dmin);
        uint8_t sc[8], m[8];
        ember_q4k_scales(b->scales, sc, m);
        for (int j = 0; j < 8; j++) {
            float dl = d * (float)sc[j], ml = dmin * (float)m[j];
            for (int l = 0; l < 32; l++) {
                int q = (b->qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 0xf;
                dst[32 * j + l] = dl * (float)q - ml;
            }
        }
    }
}

static void dequant_q5_k(const void *src, float *dst, int64_t nb) {
    const blk_q5_k *b = src; /* as Q4_K, fifth bit: bit j of qh[l] */
    for (int64_t i = 0; i < nb; i++, b++, dst += QK_K) {
        float d = h2f(b->d), dmin = h2f(b->dmin);
        uint8_t sc[8], m[8];
        ember_q4k_scales(b->scales, sc, m);
        for (int j = 0; j < 8; j++) {
            float dl = d * (float)sc[j], ml = dmin * (float)m[j];
            for (int l = 0; l < 32; l++) {
                int q = ((b->qs[32 * (j / 2) + l] >> (4 * (j & 1))) & 0xf) | (((b->qh[l] >> j) & 1) << 4);
                dst[32 * j + l] = dl * (float)q - ml;
            }
        }
    }
}

static void dequant_q6_k(const void *src, float *dst, int64_t nb) {
    const blk_q6_k *b = src; /* v = 128h + 32s + l: low 4 bits from ql[64h + 32(s&1) + l] nibble s/2,
                                 high 2 bits from qh[32h + l] bits 2s; scale index v / 16 */
    for (int64_t i = 0; i < nb; i++, b++, dst += QK_K) {
        float d = h2f(b->d);
        for (int v = 0; v < QK_K; v++) {
            int h = v >> 7, s = (v >> 5) & 3, l = v & 31;
            int lo = (b->ql[64 * h + 32 * (s & 1) + l] >> (4 * (s >> 1))) & 0xf;
            int hi = (b->qh[32 * h + l] >> (2 * s)) & 3;
            dst[v] = (d * (float)b->scales[v >> 4]) * (float)((lo | hi << 4) - 32);
        }
    }
}

static void dequant_iq4_xs(const void *src, float *dst, int64_t nb) {
    const blk_iq4_xs *b = src; /* sub-block ib: low nibbles of qs[16 ib ..] then high nibbles */
    for (int64_t i = 0; i < nb; i++, b++, dst += QK_K) {
        float d = h2f(b->d);
        for (int ib = 0; ib < 8; ib++) {
            float dl = d * (float)ember_iq4xs_scale(b, ib);
            for (int l = 0; l < 16; l++) {
                uint8_t q = b->qs[16 * ib + l];
                dst[32 * ib + l] = dl * (float)ember_iq4nl_values[q & 0xf];
                dst[32 * ib + l + 16] = dl * (float)ember_iq4nl_values[q >> 4];
            }
        }
    }
}

/* ---- the table ---- */

static const ember_qtype qtypes[EMBER_T_COUNT] = {
    [EMBER_T_F32] = {1, 4, EMBER_ACT_F32, dequant_f32},
    [EMBER_T_F16] = {1, 2, EMBER_ACT_F32, dequant_f16},
    [EMBER_T_BF16] = {1, 2, EMBER_ACT_F32, dequant_bf16},
    [EMBER_T_Q4_0] = {QK, sizeof(blk_q4_0), EMBER_ACT_Q16, dequant_q4_0},
    [EMBER_T_Q4_1] = {QK, sizeof(blk_q4_1), EMBER_ACT_Q16, dequant_q4_1},
    [EMBER_T_Q5_0] = {QK, sizeof(blk_q5_0), EMBER_ACT_Q16, dequant_q5_0},
    [EMBER_T_Q5_1] = {QK, sizeof(blk_q5_1), EMBER_ACT_Q16, dequant_q5_1},
    [EMBER_T_Q8_0] = {QK, sizeof(blk_q8_0), EMBER_ACT_Q16, dequant_q8_0},
    [EMBER_T_IQ4_NL] = {QK, sizeof(blk_iq4_nl), EMBER_ACT_Q16, dequant_iq4_nl},
    [EMBER_T_MXFP4] = {QK, sizeof(blk_mxfp4), EMBER_ACT_Q16, dequant_mxfp4},
    [EMBER_T_Q2_K] = {QK_K, sizeof(blk_q2_k), EMBER_ACT_Q8K, dequant_q2_k},
    [EMBER_T_Q3_K] = {QK_K, sizeof(blk_q3_k), EMBER_ACT_Q8K, dequant_q3_k},
    [EMBER_T_Q4_K] = {QK_K, sizeof(blk_q4_k), EMBER_ACT_Q8K, dequant_q4_k},
    [EMBER_T_Q5_K] = {QK_K, sizeof(blk_q5_k), EMBER_ACT_Q8K, dequant_q5_k},
    [EMBER_T_Q6_K] = {QK_K, sizeof(blk_q6_k), EMBER_ACT_Q8K, dequant_q6_k},
    [EMBER_T_IQ4_XS] = {QK_K, sizeof(blk_iq4_xs), EMBER_ACT_Q8K, dequant_iq4_xs},
};

const ember_qtype *ember_qtype_get(int type) {
    if (type < 0 || type >= EMBER_T_COUNT) return NULL;
    return qtypes[type].dequant ? &qtypes[type] : ember_iq_qtype_get(type);
}

int ember_type_supported(int type) { return ember_qtype_get(type) != NULL; }

void ember_dequantize(int type, const void *src, float *dst, int64_t count) {
    const ember_qtype *t = ember_qtype_get(type);
    if (!t || count <= 0) return;
    t->dequant(src, dst, count / t->block_size);
}

/* ---- embedding lookup ---- */

typedef struct {
    const ember_qtype *t;
    const uint8_t *w; /* (m, row_bytes) */
    int64_t k, row_bytes;
    const int32_t *ids; /* (n,) */
    int64_t n;
    float *out; /* (n, k) */
} get_rows_job;

static void get_rows_task(void *ctx, int ith, int nth) {
    const get_rows_job *j = ctx;
    int64_t lo, hi;
    ember_split(j->n, ith, nth, &lo, &hi);
    for (int64_t i = lo; i < hi; i++)
        j->t->dequant(j->w + (int64_t)j->ids[i] * j->row_bytes, j->out + i * j->k, j->k / j->t->block_size);
}

void ember_get_rows(ember_pool *pool, int type, const void *w, int64_t m, int64_t k, const int32_t *ids,
                    int64_t n, float *out) {
    (void)m; /* ids are checked against m by the caller */
    const ember_qtype *t = ember_qtype_get(type);
    if (!t || n <= 0) return;
    get_rows_job j = {t, w, k, k / t->block_size * t->type_size, ids, n, out};
    if (n * k < 65536) pool = NULL; /* a few rows: waking threads costs more than it saves */
    ember_parallel(pool, get_rows_task, &j);
}
