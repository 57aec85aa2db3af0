/* AVX2 + FMA + F16C inner loops of the ops (ops_kernels.h). Head dims that are not a multiple of 8 use the
 * portable loops; elementwise tails go through a padded 8-float buffer. */
#include "ops_kernels.h"

#if defined(EMBER_X86)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif
#include <immintrin.h>
#include <math.h>

/* e^x to about 1 ulp: x = n ln2 + r, |r| <= ln2/2, polynomial for e^r, then 2^n through the exponent bits
 * (inputs clamped to [-87.3, 88] so that 2^n stays a normal float). Below -87.3 gives exactly 0. */
static inline __m256 exp8(__m256 x) {
    __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
    x = _mm256_max_ps(_mm256_set1_ps(-87.33654f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

static inline __m256 silu_mul8(__m256 g, __m256 u) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* gelu_tanh(x) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3): no cancellation for negative x. */
static inline __m256 gelu_mul8(__m256 g, __m256 u) {
    const __m256 c1 = _mm256_set1_ps(-2.0f * 0.7978845608028654f), c3 = _mm256_set1_ps(-2.0f * 0.7978845608028654f * 0.044715f);
    __m256 t = _mm256_mul_ps(g, _mm256_fmadd_ps(c3, _mm256_mul_ps(g, g), c1)); /* -2u */
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(t))), u);
}

static void silu_mul_avx2(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, silu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
    if (i < n) {
        float g[8] = {0}, u[8] = {0}, o[8];
        memcpy(g, gate + i, sizeof(float) * (n - i));
        memcpy(u, up + i, sizeof(float) * (n - i));
        _mm256_storeu_ps(o, silu_mul8(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
        memcpy(out + i, o, sizeof(float) * (n - i));
    }
}

static void gelu_mul_avx2(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, gelu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
    if (i < n) {
        float g[8] = {0}, u[8] = {0}, o[8];
        memcpy(g, gate + i, sizeof(float) * (n - i));
        memcpy(u, up + i, sizeof(float) * (n - i));
        _mm256_storeu_ps(o, gelu_mul8(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
        memcpy(out + i, o, sizeof(float) * (n - i));
    }
}

static void f32_to_f16_avx2(const float *src, uint16_t *dst, int64_t n) {
    enum { rne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC };  // clang wants a constant expression here
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), rne));
    if (i < n) {
        float f[8] = {0};
        uint16_t h[8];
        memcpy(f, src + i, sizeof(float) * (n - i));
        _mm_storeu_si128((__m128i *)h, _mm256_cvtps_ph(_mm256_loadu_ps(f), rne));
        memcpy(dst + i, h, sizeof(uint16_t) * (n - i));
    }
}

static void gather_f16_rows_avx2(const void *base, const int64_t *offs, int64_t n_rows, int64_t width, float *dst) {
    if (width % 8) {
        ember_op_kernels_scalar.gather_f16_rows(base, offs, n_rows, width, dst);
        return;
    }
    for (int64_t r = 0; r < n_rows; r++) {
        const uint16_t *src = (const uint16_t *)((const char *)base + offs[r]);
        float *d = dst + r * width;
        for (int64_t i = 0; i < width; i += 8)
            _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    }
}

/* Sums of a, b, c, d (8 lanes each) in lanes 0..3. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

static inline float hsum(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* Two query rows against four keys: the key loads are shared by both rows. */
static inline void dot_2x4(const float *q0, const float *q1, const float *k, int64_t d, __m128 *s0, __m128 *s1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t i = 0; i < d; i += 8) {
        __m256 x0 = _mm256_loadu_ps(q0 + i), x1 = _mm256_loadu_ps(q1 + i);
        __m256 k0 = _mm256_loadu_ps(k + i), k1 = _mm256_loadu_ps(k + d + i);
        __m256 k2 = _mm256_loadu_ps(k + 2 * d + i), k3 = _mm256_loadu_ps(k + 3 * d + i);
        a0 = _mm256_fmadd_ps(x0, k0, a0);
        a1 = _mm256_fmadd_ps(x0, k1, a1);
        a2 = _mm256_fmadd_ps(x0, k2, a2);
        a3 = _mm256_fmadd_ps(x0, k3, a3);
        b0 = _mm256_fmadd_ps(x1, k0, b0);
        b1 = _mm256_fmadd_ps(x1, k1, b1);
        b2 = _mm256_fmadd_ps(x1, k2, b2);
        b3 = _mm256_fmadd_ps(x1, k3, b3);
    }
    *s0 = hsum4(a0, a1, a2, a3);
    *s1 = hsum4(b0, b1, b2, b3);
}

static inline __m128 dot_1x4(const float *q0, const float *k, int64_t d) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t i = 0; i < d; i += 8) {
        __m256 x0 = _mm256_loadu_ps(q0 + i);
        a0 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(k + i), a0);
        a1 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(k + d + i), a1);
        a2 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(k + 2 * d + i), a2);
        a3 = _mm256_fmadd_ps(x0, _mm256_loadu_ps(k + 3 * d + i), a3);
    }
    return hsum4(a0, a1, a2, a3);
}

static inline float dot_1x1(const float *q0, const float *k, int64_t d) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + i), _mm256_loadu_ps(k + i), a);
    return hsum(a);
}

static void dot_rows_avx2(const float *q, int64_t q_stride, int64_t n_q, const float *k, int64_t n_k, int64_t d,
                          float scale, float *s, int64_t s_stride) {
    if (d % 8) {
        ember_op_kernels_scalar.dot_rows(q, q_stride, n_q, k, n_k, d, scale, s, s_stride);
        return;
    }
    const __m128 vs = _mm_set1_ps(scale);
    int64_t r = 0;
    for (; r + 2 <= n_q; r += 2) {
        const float *q0 = q + r * q_stride, *q1 = q0 + q_stride;
        float *s0 = s + r * s_stride, *s1 = s0 + s_stride;
        int64_t j = 0;
        for (; j + 4 <= n_k; j += 4) {
            __m128 x0, x1;
            dot_2x4(q0, q1, k + j * d, d, &x0, &x1);
            _mm_storeu_ps(s0 + j, _mm_mul_ps(x0, vs));
            _mm_storeu_ps(s1 + j, _mm_mul_ps(x1, vs));
        }
        for (; j < n_k; j++) {
            s0[j] = scale * dot_1x1(q0, k + j * d, d);
            s1[j] = scale * dot_1x1(q1, k + j * d, d);
        }
    }
    if (r < n_q) {
        const float *q0 = q + r * q_stride;
        float *s0 = s + r * s_stride;
        int64_t j = 0;
        for (; j + 4 <= n_k; j += 4) _mm_storeu_ps(s0 + j, _mm_mul_ps(dot_1x4(q0, k + j * d, d), vs));
        for (; j < n_k; j++) s0[j] = scale * dot_1x1(q0, k + j * d, d);
    }
}

/* tanh(y) = sign(y) (1 - 2 / (exp(2|y|) + 1)); absolute error ~1e-7, which is what a logit cap needs. */
static inline __m256 softcap8(__m256 x, __m256 cap, __m256 inv_cap) {
    __m256 y = _mm256_mul_ps(x, inv_cap);
    __m256 sign = _mm256_and_ps(y, _mm256_set1_ps(-0.0f));
    __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), y);
    __m256 e = exp8(_mm256_add_ps(a, a));
    __m256 t = _mm256_sub_ps(_mm256_set1_ps(1.0f), _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, _mm256_set1_ps(1.0f))));
    return _mm256_mul_ps(cap, _mm256_or_ps(t, sign));
}

static void softcap_avx2(float *x, int64_t n, float cap) {
    const __m256 vc = _mm256_set1_ps(cap), vi = _mm256_set1_ps(1.0f / cap);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, softcap8(_mm256_loadu_ps(x + i), vc, vi));
    if (i < n) {
        float b[8] = {0};
        memcpy(b, x + i, sizeof(float) * (n - i));
        _mm256_storeu_ps(b, softcap8(_mm256_loadu_ps(b), vc, vi));
        memcpy(x + i, b, sizeof(float) * (n - i));
    }
}

static float max_avx2(const float *x, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float r = _mm_cvtss_f32(h);
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    return r;
}

static float exp_sum_avx2(float *x, int64_t n, float m) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    if (i < n) {
        float b[8];
        for (int l = 0; l < 8; l++) b[l] = i + l < n ? x[i + l] : -INFINITY; /* exp(-inf) = 0 */
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(b), vm));
        _mm256_storeu_ps(b, e);
        memcpy(x + i, b, sizeof(float) * (n - i));
        sum = _mm256_add_ps(sum, e);
    }
    return hsum(sum);
}

/* acc0/acc1 (32,) += sum_j p0[j]/p1[j] * v[j] (32,): eight accumulators live in registers. */
static inline void wsum_2x32(const float *p0, const float *p1, const float *v, int64_t n_k, int64_t d, float *a0,
                             float *a1) {
    __m256 x0 = _mm256_loadu_ps(a0), x1 = _mm256_loadu_ps(a0 + 8), x2 = _mm256_loadu_ps(a0 + 16),
           x3 = _mm256_loadu_ps(a0 + 24);
    __m256 y0 = _mm256_loadu_ps(a1), y1 = _mm256_loadu_ps(a1 + 8), y2 = _mm256_loadu_ps(a1 + 16),
           y3 = _mm256_loadu_ps(a1 + 24);
    for (int64_t j = 0; j < n_k; j++) {
        const float *vj = v + j * d;
        __m256 w0 = _mm256_broadcast_ss(p0 + j), w1 = _mm256_broadcast_ss(p1 + j);
        __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8), v2 = _mm256_loadu_ps(vj + 16),
               v3 = _mm256_loadu_ps(vj + 24);
        x0 = _mm256_fmadd_ps(w0, v0, x0);
        x1 = _mm256_fmadd_ps(w0, v1, x1);
        x2 = _mm256_fmadd_ps(w0, v2, x2);
        x3 = _mm256_fmadd_ps(w0, v3, x3);
        y0 = _mm256_fmadd_ps(w1, v0, y0);
        y1 = _mm256_fmadd_ps(w1, v1, y1);
        y2 = _mm256_fmadd_ps(w1, v2, y2);
        y3 = _mm256_fmadd_ps(w1, v3, y3);
    }
    _mm256_storeu_ps(a0, x0);
    _mm256_storeu_ps(a0 + 8, x1);
    _mm256_storeu_ps(a0 + 16, x2);
    _mm256_storeu_ps(a0 + 24, x3);
    _mm256_storeu_ps(a1, y0);
    _mm256_storeu_ps(a1 + 8, y1);
    _mm256_storeu_ps(a1 + 16, y2);
    _mm256_storeu_ps(a1 + 24, y3);
}

/* acc (32,) += sum_j p[j] * v[j] (32,): four independent chains hide the FMA latency. */
static inline void wsum_1x32(const float *p, const float *v, int64_t n_k, int64_t d, float *a) {
    __m256 x0 = _mm256_loadu_ps(a), x1 = _mm256_loadu_ps(a + 8), x2 = _mm256_loadu_ps(a + 16),
           x3 = _mm256_loadu_ps(a + 24);
    for (int64_t j = 0; j < n_k; j++) {
        const float *vj = v + j * d;
        __m256 w = _mm256_broadcast_ss(p + j);
        x0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj), x0);
        x1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 8), x1);
        x2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 16), x2);
        x3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vj + 24), x3);
    }
    _mm256_storeu_ps(a, x0);
    _mm256_storeu_ps(a + 8, x1);
    _mm256_storeu_ps(a + 16, x2);
    _mm256_storeu_ps(a + 24, x3);
}

/* acc (8,) += sum_j p[j] * v[j] (8,) */
static inline void wsum_1x8(const float *p, const float *v, int64_t n_k, int64_t d, float *a) {
    __m256 x = _mm256_loadu_ps(a);
    for (int64_t j = 0; j < n_k; j++) x = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), _mm256_loadu_ps(v + j * d), x);
    _mm256_storeu_ps(a, x);
}

static void weighted_sum_avx2(const float *p, int64_t p_stride, int64_t n_q, const float *v, int64_t n_k, int64_t d,
                              float *acc, int64_t acc_stride) {
    if (d % 8) {
        ember_op_kernels_scalar.weighted_sum(p, p_stride, n_q, v, n_k, d, acc, acc_stride);
        return;
    }
    int64_t r = 0;
    for (; r + 2 <= n_q; r += 2) {
        const float *p0 = p + r * p_stride, *p1 = p0 + p_stride;
        float *a0 = acc + r * acc_stride, *a1 = a0 + acc_stride;
        int64_t i = 0;
        for (; i + 32 <= d; i += 32) wsum_2x32(p0, p1, v + i, n_k, d, a0 + i, a1 + i);
        for (; i < d; i += 8) {
            wsum_1x8(p0, v + i, n_k, d, a0 + i);
            wsum_1x8(p1, v + i, n_k, d, a1 + i);
        }
    }
    if (r < n_q) {
        const float *p0 = p + r * p_stride;
        float *a0 = acc + r * acc_stride;
        int64_t i = 0;
        for (; i + 32 <= d; i += 32) wsum_1x32(p0, v + i, n_k, d, a0 + i);
        for (; i < d; i += 8) wsum_1x8(p0, v + i, n_k, d, a0 + i);
    }
}

const ember_op_kernels ember_op_kernels_avx2 = {
    .silu_mul = silu_mul_avx2,
    .gelu_mul = gelu_mul_avx2,
    .f32_to_f16 = f32_to_f16_avx2,
    .gather_f16_rows = gather_f16_rows_avx2,
    .dot_rows = dot_rows_avx2,
    .softcap = softcap_avx2,
    .max = max_avx2,
    .exp_sum = exp_sum_avx2,
    .weighted_sum = weighted_sum_avx2,
};

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
