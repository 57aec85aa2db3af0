/* The low-bit types: grids expanded at load, dequantization (bit-exact with ember/quant/lowbit.py, so
 * no fused multiply-adds here), the table of their facts, and the portable products, which define the
 * integer sums the SIMD kernels reproduce. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "quant_iq.h"
#include "quant_iq_grids.h"

uint64_t ember_iq2xxs_grid[256], ember_iq2xs_grid[512], ember_iq2s_grid[1024], ember_iq1s_grid[2048];
uint32_t ember_iq3xxs_grid[256], ember_iq3s_grid[512];
uint64_t ember_iq_sign8[256], ember_iq_sign7[128];

/* codes (n,) of 8 two-bit fields -> n entries of 8 bytes, field f -> levels[f] */
static void expand8(const uint16_t *codes, int n, const int8_t *levels, uint64_t *out) {
    for (int e = 0; e < n; e++) {
        uint64_t v = 0;
        for (int j = 0; j < 8; j++) v |= (uint64_t)(uint8_t)levels[(codes[e] >> 2 * j) & 3] << 8 * j;
        out[e] = v;
    }
}

/* codes (n,) of 4 three-bit fields -> n entries of 4 bytes */
static void expand4(const uint16_t *codes, int n, const uint8_t *levels, uint32_t *out) {
    for (int e = 0; e < n; e++) {
        uint32_t v = 0;
        for (int j = 0; j < 4; j++) v |= (uint32_t)levels[(codes[e] >> 3 * j) & 7] << 8 * j;
        out[e] = v;
    }
}

static uint64_t sign_bytes(unsigned mask) {
    uint64_t v = 0;
    for (int j = 0; j < 8; j++) v |= (uint64_t)((mask >> j) & 1 ? 0xffu : 0x01u) << 8 * j;
    return v;
}

__attribute__((constructor)) static void iq_tables_init(void) {
    static const int8_t iq2_levels[3] = {8, 25, 43}, iq1_levels[3] = {-8, 0, 8};
    static const uint8_t iq3xxs_levels[8] = {4, 12, 20, 28, 36, 44, 52, 62}, iq3s_levels[8] = {1, 3, 5, 7, 9, 11, 13, 15};
    expand8(iq2_xxs_codes, 256, iq2_levels, ember_iq2xxs_grid);
    expand8(iq2_xs_codes, 512, iq2_levels, ember_iq2xs_grid);
    expand8(iq2_s_codes, 1024, iq2_levels, ember_iq2s_grid);
    expand8(iq1_s_codes, 2048, iq1_levels, ember_iq1s_grid);
    expand4(iq3_xxs_codes, 256, iq3xxs_levels, ember_iq3xxs_grid);
    expand4(iq3_s_codes, 512, iq3s_levels, ember_iq3s_grid);
    for (unsigned m = 0; m < 256; m++) ember_iq_sign8[m] = sign_bytes(m);
    for (unsigned m = 0; m < 128; m++) ember_iq_sign7[m] = sign_bytes(m | (unsigned)(__builtin_popcount(m) & 1) << 7);
}

/* ---- dequantization: the reference's float steps, value by value ---- */

/* The float scale of 16-value group h, formed as ggml forms it. */
static inline float group_scale(int type, const iq_block *b, int h) {
    const float s = (float)((b->sc[h] - 1) / 2);
    switch (type) {
    case EMBER_T_IQ2_XXS: case EMBER_T_IQ2_XS: case EMBER_T_IQ2_S: return b->d * (0.5f + s) * 0.25f;
    case EMBER_T_IQ3_XXS: return b->d * (0.5f + s) * 0.5f;
    default: return b->d * (float)b->sc[h]; /* IQ3_S, IQ1_*, TQ*_0 (scale 1) */
    }
}

static void dequant_iq(int type, int bytes, const void *src, float *dst, int64_t nb) {
    const float unit = type == EMBER_T_IQ1_S || type == EMBER_T_IQ1_M ? 0.125f : 1.0f; /* IQ1: v = 8 (grid + delta) */
    for (int64_t i = 0; i < nb; i++, dst += QK_K) {
        iq_block b;
        iq_unpack(type, (const uint8_t *)src + i * bytes, &b);
        for (int h = 0; h < 16; h++) {
            const float dl = group_scale(type, &b, h);
            for (int l = 0; l < 16; l++) dst[16 * h + l] = dl * ((float)b.v[16 * h + l] * unit);
        }
    }
}

#define DEQUANT(name, TYPE)                                                                                    \
    static void dequant_##name(const void *src, float *dst, int64_t nb) {                                     \
        dequant_iq(TYPE, sizeof(blk_##name), src, dst, nb);                                                    \
    }
DEQUANT(iq2_xxs, EMBER_T_IQ2_XXS)
DEQUANT(iq2_xs, EMBER_T_IQ2_XS)
DEQUANT(iq2_s, EMBER_T_IQ2_S)
DEQUANT(iq3_xxs, EMBER_T_IQ3_XXS)
DEQUANT(iq3_s, EMBER_T_IQ3_S)
DEQUANT(iq1_s, EMBER_T_IQ1_S)
DEQUANT(iq1_m, EMBER_T_IQ1_M)
DEQUANT(tq1_0, EMBER_T_TQ1_0)
DEQUANT(tq2_0, EMBER_T_TQ2_0)

#define QTYPE(name) {QK_K, sizeof(blk_##name), EMBER_ACT_Q8K, dequant_##name}

static const ember_qtype qtypes[EMBER_T_COUNT] = {
    [EMBER_T_IQ2_XXS] = QTYPE(iq2_xxs), [EMBER_T_IQ2_XS] = QTYPE(iq2_xs), [EMBER_T_IQ2_S] = QTYPE(iq2_s),
    [EMBER_T_IQ3_XXS] = QTYPE(iq3_xxs), [EMBER_T_IQ3_S] = QTYPE(iq3_s),   [EMBER_T_IQ1_S] = QTYPE(iq1_s),
    [EMBER_T_IQ1_M] = QTYPE(iq1_m),     [EMBER_T_TQ1_0] = QTYPE(tq1_0),   [EMBER_T_TQ2_0] = QTYPE(tq2_0),
};

const ember_qtype *ember_iq_qtype_get(int type) {
    if (type < 0 || type >= EMBER_T_COUNT || !qtypes[type].dequant) return NULL;
    return &qtypes[type];
}

/* ---- portable products ---- */

/* w row (k/256 super-blocks of `type`) . Q8K activation row a */
static float dot_iq(int type, int bytes, int64_t k, const void *w, const void *a) {
    const int8_t *q = a;
    const float *yd = (const float *)(q + k);
    float sum = 0.0f;
    for (int64_t i = 0; i < k / QK_K; i++, q += QK_K) {
        iq_block b;
        iq_unpack(type, (const uint8_t *)w + i * bytes, &b);
        int isum = 0;
        for (int h = 0; h < 16; h++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += b.v[16 * h + l] * q[16 * h + l];
            isum += b.sc[h] * s;
        }
        sum += yd[i] * (b.factor * (float)isum);
    }
    return sum;
}

#define IQ_TILE(name, TYPE)                                                                                    \
    static void tile_##name(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, float *y,         \
                            int64_t ys, int nr, int nc) {                                                      \
        for (int c = 0; c < nc; c++)                                                                           \
            for (int r = 0; r < nr; r++)                                                                       \
                y[c * ys + r] = dot_iq(TYPE, sizeof(blk_##name), k, (const uint8_t *)w + r * ws,              \
                                       (const uint8_t *)a + c * as);                                           \
    }
IQ_TILE(iq2_xxs, EMBER_T_IQ2_XXS)
IQ_TILE(iq2_xs, EMBER_T_IQ2_XS)
IQ_TILE(iq2_s, EMBER_T_IQ2_S)
IQ_TILE(iq3_xxs, EMBER_T_IQ3_XXS)
IQ_TILE(iq3_s, EMBER_T_IQ3_S)
IQ_TILE(iq1_s, EMBER_T_IQ1_S)
IQ_TILE(iq1_m, EMBER_T_IQ1_M)
IQ_TILE(tq1_0, EMBER_T_TQ1_0)
IQ_TILE(tq2_0, EMBER_T_TQ2_0)

#define T1(name) {tile_##name, 1, 4, 0}

const ember_kernels ember_kernels_iq_scalar = {
    .tile = {
        [EMBER_T_IQ2_XXS] = T1(iq2_xxs), [EMBER_T_IQ2_XS] = T1(iq2_xs), [EMBER_T_IQ2_S] = T1(iq2_s),
        [EMBER_T_IQ3_XXS] = T1(iq3_xxs), [EMBER_T_IQ3_S] = T1(iq3_s),   [EMBER_T_IQ1_S] = T1(iq1_s),
        [EMBER_T_IQ1_M] = T1(iq1_m),     [EMBER_T_TQ1_0] = T1(tq1_0),   [EMBER_T_TQ2_0] = T1(tq2_0),
    },
};
