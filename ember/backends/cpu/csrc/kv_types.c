/* Writing and reading the KV cache's rows in its storage types (kv_types.h). F16 goes through the
 * SIMD kernels of the op table; the others are plain loops the compiler vectorizes. */
#include <math.h>

#include "kv_types.h"
#include "quant.h"

int64_t ember_kv_bytes(int t, int64_t n) {
    switch (t) {
    case EMBER_T_F16:
    case EMBER_T_BF16:
        return 2 * n;
    case EMBER_T_Q8_0:
        return n % QK ? -1 : n / QK * (int64_t)sizeof(blk_q8_0);
    case EMBER_T_Q4_0:
        return n % QK ? -1 : n / QK * (int64_t)sizeof(blk_q4_0);
    default:
        return -1;
    }
}

/* Round to nearest even, NaN kept quiet. */
static uint16_t bf16_from_f32(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

/* ggml's reference Q8_0 rounding: d = amax / 127, q = round(x / d), ties away from zero. */
static void q8_0_from_f32(const float *x, blk_q8_0 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b++, x += QK) {
        float amax = 0;
        for (int l = 0; l < QK; l++) amax = fmaxf(amax, fabsf(x[l]));
        float d = amax / 127, id = d != 0 ? 1.0f / d : 0.0f;
        b->d = ember_f32_to_f16(d);
        for (int l = 0; l < QK; l++) b->qs[l] = (int8_t)roundf(x[l] * id);
    }
}

/* ggml's reference Q4_0 rounding: the value of largest magnitude maps to -8, d = it / -8,
 * q = min(15, trunc(x / d + 8.5)); values l and l + 16 share byte l. */
static void q4_0_from_f32(const float *x, blk_q4_0 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, b++, x += QK) {
        float amax = 0, max = 0;
        for (int l = 0; l < QK; l++)
            if (fabsf(x[l]) > amax) {
                amax = fabsf(x[l]);
                max = x[l];
            }
        float d = max / -8, id = d != 0 ? 1.0f / d : 0.0f;
        b->d = ember_f32_to_f16(d);
        for (int l = 0; l < QK / 2; l++) {
            uint8_t lo = (uint8_t)EMBER_MIN(15, (int8_t)(x[l] * id + 8.5f));
            uint8_t hi = (uint8_t)EMBER_MIN(15, (int8_t)(x[l + QK / 2] * id + 8.5f));
            b->qs[l] = lo | (uint8_t)(hi << 4);
        }
    }
}

void ember_kv_write_row(int t, const ember_op_kernels *kern, const float *src, void *dst, int64_t n) {
    switch (t) {
    case EMBER_T_F16:
        kern->f32_to_f16(src, dst, n);
        return;
    case EMBER_T_BF16:
        for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = bf16_from_f32(src[i]);
        return;
    case EMBER_T_Q8_0:
        q8_0_from_f32(src, dst, n / QK);
        return;
    case EMBER_T_Q4_0:
        q4_0_from_f32(src, dst, n / QK);
        return;
    }
}

static void gather_bf16(const char *base, const int64_t *offs, int64_t n_rows, int64_t width, float *dst) {
    for (int64_t r = 0; r < n_rows; r++, dst += width) {
        const uint16_t *s = (const uint16_t *)(base + offs[r]); /* (width,) */
        for (int64_t i = 0; i < width; i++) {
            uint32_t x = (uint32_t)s[i] << 16;
            memcpy(dst + i, &x, 4);
        }
    }
}

static void gather_q8_0(const char *base, const int64_t *offs, int64_t n_rows, int64_t width, float *dst) {
    for (int64_t r = 0; r < n_rows; r++) {
        const blk_q8_0 *b = (const blk_q8_0 *)(base + offs[r]); /* (width / 32,) */
        for (int64_t i = 0; i < width / QK; i++, b++, dst += QK) {
            float d = ember_f16_to_f32(b->d);
            for (int l = 0; l < QK; l++) dst[l] = d * (float)b->qs[l];
        }
    }
}

static void gather_q4_0(const char *base, const int64_t *offs, int64_t n_rows, int64_t width, float *dst) {
    for (int64_t r = 0; r < n_rows; r++) {
        const blk_q4_0 *b = (const blk_q4_0 *)(base + offs[r]); /* (width / 32,) */
        for (int64_t i = 0; i < width / QK; i++, b++, dst += QK) {
            float d = ember_f16_to_f32(b->d);
            for (int l = 0; l < QK / 2; l++) {
                dst[l] = d * (float)((b->qs[l] & 0xf) - 8);
                dst[l + QK / 2] = d * (float)((b->qs[l] >> 4) - 8);
            }
        }
    }
}

void ember_kv_gather_rows(int t, const ember_op_kernels *kern, const void *base, const int64_t *offs,
                          int64_t n_rows, int64_t width, float *dst) {
    switch (t) {
    case EMBER_T_F16:
        kern->gather_f16_rows(base, offs, n_rows, width, dst);
        return;
    case EMBER_T_BF16:
        gather_bf16(base, offs, n_rows, width, dst);
        return;
    case EMBER_T_Q8_0:
        gather_q8_0(base, offs, n_rows, width, dst);
        return;
    case EMBER_T_Q4_0:
        gather_q4_0(base, offs, n_rows, width, dst);
        return;
    }
}
