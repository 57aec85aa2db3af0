/* Cross-checks the NEON kernels against the portable ones on an arm64 build (run under an emulator by
 * tests/test_cpu_neon.py): for every type, products of random weights with random activations, both
 * roundings of the 32-value types, few tokens (microtiles) and many. Prints one line per case:
 * "type k n rounding max|neon - scalar| / max(sum |w| |x|)" and exits 0. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ember_cpu.h" /* the integer types, then api_core.h */
#include "api_quant.h"

static uint64_t rng_state = 88172645463325252ull;

static uint32_t next_u32(void) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (uint32_t)rng_state;
}

static float next_normalish(void) { /* sum of 4 uniforms, centred: enough spread for the products */
    float s = 0;
    for (int i = 0; i < 4; i++) s += (float)(next_u32() & 0xffffff) / 16777216.0f;
    return s - 2.0f;
}

typedef struct { int type, block, bytes, f16_at[2]; } type_info;

static const type_info TYPES[] = {
    {2, 32, 18, {0, -1}},    {3, 32, 20, {0, 2}},     {6, 32, 22, {0, -1}},    {7, 32, 24, {0, 2}},
    {8, 32, 34, {0, -1}},    {20, 32, 18, {0, -1}},   {10, 256, 84, {80, 82}}, {11, 256, 110, {108, -1}},
    {12, 256, 144, {0, 2}},  {13, 256, 176, {0, 2}},  {14, 256, 210, {208, -1}}, {23, 256, 136, {0, -1}},
    {1, 1, 2, {-1, -1}},     {0, 1, 4, {-1, -1}},     {30, 1, 2, {-1, -1}},
    /* the low-bit types; IQ1_M (29) keeps its f16 scale in the top nibbles of the words at 48 */
    {16, 256, 66, {0, -1}},  {17, 256, 74, {0, -1}},  {22, 256, 82, {0, -1}},  {18, 256, 98, {0, -1}},
    {21, 256, 110, {0, -1}}, {19, 256, 50, {0, -1}},  {29, 256, 56, {-1, -1}}, {34, 256, 54, {52, -1}},
    {35, 256, 66, {64, -1}},
};

/* Random blocks with small valid f16 scales (or random float weights). */
static void fill_weights(const type_info *t, uint8_t *w, int64_t m, int64_t k) {
    int64_t nb = m * k / t->block;
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *p = w + b * t->bytes;
        if (t->type == 0) {
            float v = next_normalish() * 0.05f;
            memcpy(p, &v, 4);
            continue;
        }
        if (t->type == 1 || t->type == 30) {
            float v = next_normalish() * 0.05f;
            uint32_t bits;
            memcpy(&bits, &v, 4);
            uint16_t h = t->type == 1 ? ember_f32_to_f16(v) : (uint16_t)(bits >> 16);
            memcpy(p, &h, 2);
            continue;
        }
        for (int i = 0; i < t->bytes; i++) p[i] = (uint8_t)next_u32();
        for (int f = 0; f < 2; f++) {
            if (t->f16_at[f] < 0) continue;
            uint16_t h = ember_f32_to_f16((0.002f + 0.01f * (float)(next_u32() & 1023) / 1024.0f) * ((next_u32() & 1) ? 1 : -1));
            memcpy(p + t->f16_at[f], &h, 2);
        }
        if (t->type == 29) {
            uint16_t h = ember_f32_to_f16((0.002f + 0.01f * (float)(next_u32() & 1023) / 1024.0f) * ((next_u32() & 1) ? 1 : -1));
            for (int j = 0; j < 4; j++) {
                uint16_t wd;
                memcpy(&wd, p + 48 + 2 * j, 2);
                wd = (uint16_t)((wd & 0x0fff) | ((h >> 4 * j) & 0xf) << 12);
                memcpy(p + 48 + 2 * j, &wd, 2);
            }
        }
    }
}

static void product(const char *isa, const type_info *t, const uint8_t *w, int64_t m, int64_t k, const float *x,
                    int64_t n, float *y, int rounding, ember_pool *pool) {
    if (ember_cpu_set_isa(isa) != 0) {
        fprintf(stderr, "no %s path\n", isa);
        exit(1);
    }
    int64_t size = ember_matmul_scratch_size(t->type, k, n);
    void *scratch = aligned_alloc(64, (size_t)(size + 64));
    ember_matmul(pool, t->type, w, m, k, x, n, y, scratch, rounding);
    free(scratch);
}

int main(void) {
    ember_pool *pool = ember_pool_create(2);
    const int64_t m = 37, ks[] = {256, 768}, ns[] = {1, 3, 33};
    for (size_t ti = 0; ti < sizeof TYPES / sizeof TYPES[0]; ti++) {
        const type_info *t = &TYPES[ti];
        for (int ki = 0; ki < 2; ki++) {
            const int64_t k = ks[ki], nb = k / t->block;
            uint8_t *w = malloc((size_t)(m * nb * t->bytes));
            fill_weights(t, w, m, k);
            float *wf = malloc(sizeof(float) * (size_t)(m * k));
            ember_dequantize(t->type, w, wf, m * k);
            for (int ni = 0; ni < 3; ni++) {
                const int64_t n = ns[ni];
                float *x = malloc(sizeof(float) * (size_t)(n * k)), *y0 = malloc(sizeof(float) * (size_t)(n * m)),
                      *y1 = malloc(sizeof(float) * (size_t)(n * m));
                for (int64_t i = 0; i < n * k; i++) x[i] = next_normalish();
                double mag = 0;
                for (int64_t r = 0; r < n; r++)
                    for (int64_t c = 0; c < m; c++) {
                        double s = 0;
                        for (int64_t i = 0; i < k; i++) s += fabs((double)wf[c * k + i] * x[r * k + i]);
                        if (s > mag) mag = s;
                    }
                for (int rounding = 0; rounding < (t->block == 32 ? 2 : 1); rounding++) {
                    product("scalar", t, w, m, k, x, n, y0, rounding, pool);
                    product("neon", t, w, m, k, x, n, y1, rounding, pool);
                    double worst = 0;
                    for (int64_t i = 0; i < n * m; i++) worst = fmax(worst, fabs((double)y0[i] - y1[i]));
                    printf("%d %lld %lld %d %.3g\n", t->type, (long long)k, (long long)n, rounding, worst / mag);
                }
                free(x), free(y0), free(y1);
            }
            free(w), free(wf);
        }
    }
    ember_pool_destroy(pool);
    return 0;
}
