/* AVX-512 inner loops of the ops (ops_kernels.h). Head dims that are not a multiple of 16 use the AVX2 loops. */
#include "ops_kernels.h"

#if defined(EMBER_X86)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif
#include <immintrin.h>
#include <math.h>

#include "transpose_avx512.h"

/* e^x to about 1 ulp: x = n ln2 + r, |r| <= ln2/2, polynomial for e^r, then scale by 2^n.
 * Inputs below -87.3 give exactly 0 (so exp(-inf) = 0); NaN stays NaN. */
static inline __m512 exp16(__m512 x) {
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_set1_ps(88.3762626647949f), x);
    x = _mm512_max_ps(_mm512_set1_ps(-87.33654f), x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps((__mmask16)~tiny, _mm512_scalef_ps(y, n));
}

static inline __mmask16 tail_mask(int64_t n) { return (__mmask16)((1u << n) - 1); }

static inline __m512 silu_mul16(__m512 g, __m512 u) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

static void silu_mul_avx512(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, silu_mul16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(out + i, m, silu_mul16(_mm512_maskz_loadu_ps(m, gate + i), _mm512_maskz_loadu_ps(m, up + i)));
    }
}

/* gelu_tanh(x) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3): no cancellation for negative x. */
static inline __m512 gelu_mul16(__m512 g, __m512 u) {
    const __m512 c1 = _mm512_set1_ps(-2.0f * 0.7978845608028654f), c3 = _mm512_set1_ps(-2.0f * 0.7978845608028654f * 0.044715f);
    __m512 t = _mm512_mul_ps(g, _mm512_fmadd_ps(c3, _mm512_mul_ps(g, g), c1)); /* -2u */
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(t))), u);
}

static void gelu_mul_avx512(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, gelu_mul16(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(out + i, m, gelu_mul16(_mm512_maskz_loadu_ps(m, gate + i), _mm512_maskz_loadu_ps(m, up + i)));
    }
}

static void f32_to_f16_avx512(const float *src, uint16_t *dst, int64_t n) {
    enum { rne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC };  // clang wants a constant expression here
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), rne));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm256_mask_storeu_epi16(dst + i, m, _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, src + i), rne));
    }
}

static void gather_f16_rows_avx512(const void *base, const int64_t *offs, int64_t n_rows, int64_t width,
                                   float *dst) {
    if (width % 16) {
        ember_op_kernels_avx2.gather_f16_rows(base, offs, n_rows, width, dst);
        return;
    }
    for (int64_t r = 0; r < n_rows; r++) {
        const uint16_t *src = (const uint16_t *)((const char *)base + offs[r]);
        float *d = dst + r * width;
        for (int64_t i = 0; i < width; i += 16)
            _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    }
}

/* Sums of a, b, c, d (16 lanes each) in lanes 0..3. */
static inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    __m512 x = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)), _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* R (1..4) query rows against four keys: each key vector is loaded once for all rows. */
static inline __attribute__((always_inline)) void dot_rx4(const float *q, int64_t q_stride, int R, const float *k,
                                                          int64_t d, __m128 *sums) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) {
        __m512 k0 = _mm512_loadu_ps(k + i), k1 = _mm512_loadu_ps(k + d + i);
        __m512 k2 = _mm512_loadu_ps(k + 2 * d + i), k3 = _mm512_loadu_ps(k + 3 * d + i);
        for (int r = 0; r < R; r++) {
            __m512 x = _mm512_loadu_ps(q + r * q_stride + i);
            acc[r][0] = _mm512_fmadd_ps(x, k0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(x, k1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(x, k2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(x, k3, acc[r][3]);
        }
    }
    for (int r = 0; r < R; r++) sums[r] = hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
}

static inline float dot_1x1(const float *q0, const float *k, int64_t d) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q0 + i), _mm512_loadu_ps(k + i), a);
    return _mm512_reduce_add_ps(a);
}

/* Up to four rows: s (R, n_k) = scale * q (R, d) @ k (n_k, d)^T */
static inline __attribute__((always_inline)) void dot_rows_r(const float *q, int64_t q_stride, int R, const float *k,
                                                             int64_t n_k, int64_t d, float scale, float *s,
                                                             int64_t s_stride) {
    const __m128 vs = _mm_set1_ps(scale);
    int64_t j = 0;
    for (; j + 4 <= n_k; j += 4) {
        __m128 sums[4];
        dot_rx4(q, q_stride, R, k + j * d, d, sums);
        for (int r = 0; r < R; r++) _mm_storeu_ps(s + r * s_stride + j, _mm_mul_ps(sums[r], vs));
    }
    for (; j < n_k; j++)
        for (int r = 0; r < R; r++) s[r * s_stride + j] = scale * dot_1x1(q + r * q_stride, k + j * d, d);
}

static void dot_rows_avx512(const float *q, int64_t q_stride, int64_t n_q, const float *k, int64_t n_k, int64_t d,
                            float scale, float *s, int64_t s_stride) {
    if (d % 16) {
        ember_op_kernels_avx2.dot_rows(q, q_stride, n_q, k, n_k, d, scale, s, s_stride);
        return;
    }
    for (int64_t r = 0; r < n_q; r += 4) {
        const float *qr = q + r * q_stride;
        float *sr = s + r * s_stride;
        switch (EMBER_MIN(4, n_q - r)) {
        case 4: dot_rows_r(qr, q_stride, 4, k, n_k, d, scale, sr, s_stride); break;
        case 3: dot_rows_r(qr, q_stride, 3, k, n_k, d, scale, sr, s_stride); break;
        case 2: dot_rows_r(qr, q_stride, 2, k, n_k, d, scale, sr, s_stride); break;
        default: dot_rows_r(qr, q_stride, 1, k, n_k, d, scale, sr, s_stride); break;
        }
    }
}

/* kt (d, EMBER_KT_STRIDE) = the n_k keys^T in 16 x 16 blocks, each block loaded (f32 rows of k, or with
 * f16: rows of f16 bits at byte offsets offs[r] from base, converted in registers, no f32 copy in between)
 * and transposed in registers; a block's keys past n_k are zeros. */
static inline __attribute__((always_inline)) void keys_t(const int f16, const float *k, const void *base,
                                                         const int64_t *offs, int64_t n_k, int64_t d, float *kt) {
    for (int64_t kb = 0; kb < n_k; kb += 16) {
        const int64_t nr = EMBER_MIN(16, n_k - kb);
        for (int64_t db = 0; db < d; db += 16) {
            __m512 v[16];
            for (int r = 0; r < 16; r++)
                v[r] = r >= nr ? _mm512_setzero_ps()
                       : f16   ? _mm512_cvtph_ps(_mm256_loadu_si256(
                                   (const __m256i *)((const char *)base + offs[kb + r] + 2 * db)))
                               : _mm512_loadu_ps(k + (kb + r) * d + db);
            ember_transpose16_ps(v);
            for (int i = 0; i < 16; i++) _mm512_storeu_ps(kt + (db + i) * EMBER_KT_STRIDE + kb, v[i]);
        }
    }
}

static void transpose_keys_avx512(const float *k, int64_t n_k, int64_t d, float *kt) {
    keys_t(0, k, NULL, NULL, n_k, d, kt);
}

/* transpose_keys of f16 rows at byte offsets offs[r] from base */
static void gather_f16_keys_t_avx512(const void *base, const int64_t *offs, int64_t n_k, int64_t d, float *kt) {
    keys_t(1, NULL, base, offs, n_k, d, kt);
}

/* R (1..4) rows x NV (1..4) vectors of 16 keys: every dim's key vectors loaded once for all rows, each
 * row's query value broadcast against them; no horizontal sums. The last vector is masked to n_k. */
static inline __attribute__((always_inline)) void dot_kt_rv(const float *q, int64_t q_stride, int R, const float *kt,
                                                            int NV, int64_t n_k, int64_t d, __m512 vs, float *s,
                                                            int64_t s_stride) {
    __m512 acc[4][4];
    const __mmask16 last = tail_mask(n_k - 16 * (NV - 1));
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i++) {
        const float *ki = kt + i * EMBER_KT_STRIDE;
        __m512 kv[4];
        for (int v = 0; v < NV; v++)
            kv[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(last, ki + 16 * v) : _mm512_loadu_ps(ki + 16 * v);
        for (int r = 0; r < R; r++) {
            const __m512 x = _mm512_set1_ps(q[r * q_stride + i]);
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_fmadd_ps(x, kv[v], acc[r][v]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) {
            const __m512 y = _mm512_mul_ps(acc[r][v], vs);
            if (v == NV - 1) _mm512_mask_storeu_ps(s + r * s_stride + 16 * v, last, y);
            else _mm512_storeu_ps(s + r * s_stride + 16 * v, y);
        }
}

static inline __attribute__((always_inline)) void dot_kt_r(const float *q, int64_t q_stride, int R, const float *kt,
                                                           int64_t n_k, int64_t d, __m512 vs, float *s, int64_t s_stride) {
    switch ((n_k + 15) / 16) {
    case 4: dot_kt_rv(q, q_stride, R, kt, 4, n_k, d, vs, s, s_stride); break;
    case 3: dot_kt_rv(q, q_stride, R, kt, 3, n_k, d, vs, s, s_stride); break;
    case 2: dot_kt_rv(q, q_stride, R, kt, 2, n_k, d, vs, s, s_stride); break;
    default: dot_kt_rv(q, q_stride, R, kt, 1, n_k, d, vs, s, s_stride); break;
    }
}

static void dot_rows_kt_avx512(const float *q, int64_t q_stride, int64_t n_q, const float *kt, int64_t n_k, int64_t d,
                               float scale, float *s, int64_t s_stride) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < n_q; r += 4) {
        const float *qr = q + r * q_stride;
        float *sr = s + r * s_stride;
        switch (EMBER_MIN(4, n_q - r)) {
        case 4: dot_kt_r(qr, q_stride, 4, kt, n_k, d, vs, sr, s_stride); break;
        case 3: dot_kt_r(qr, q_stride, 3, kt, n_k, d, vs, sr, s_stride); break;
        case 2: dot_kt_r(qr, q_stride, 2, kt, n_k, d, vs, sr, s_stride); break;
        default: dot_kt_r(qr, q_stride, 1, kt, n_k, d, vs, sr, s_stride); break;
        }
    }
}

/* tanh(y) = sign(y) (1 - 2 / (exp(2|y|) + 1)); absolute error ~1e-7, which is what a logit cap needs. */
static inline __m512 softcap16(__m512 x, __m512 cap, __m512 inv_cap) {
    __m512 y = _mm512_mul_ps(x, inv_cap);
    __m512 sign = _mm512_and_ps(y, _mm512_set1_ps(-0.0f));
    __m512 e = exp16(_mm512_add_ps(_mm512_abs_ps(y), _mm512_abs_ps(y)));
    __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.0f), _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
    return _mm512_mul_ps(cap, _mm512_or_ps(t, sign));
}

static void softcap_avx512(float *x, int64_t n, float cap) {
    const __m512 vc = _mm512_set1_ps(cap), vi = _mm512_set1_ps(1.0f / cap);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, softcap16(_mm512_loadu_ps(x + i), vc, vi));
    if (i < n) {
        __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, m, softcap16(_mm512_maskz_loadu_ps(m, x + i), vc, vi));
    }
}

static float max_avx512(const float *x, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    if (i < n) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(n - i), x + i));
    return _mm512_reduce_max_ps(m);
}

static float exp_sum_avx512(float *x, int64_t n, float m) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
        _mm512_storeu_ps(x + i, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (i < n) {
        __mmask16 k = tail_mask(n - i);
        __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm)));
        _mm512_mask_storeu_ps(x + i, k, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* R (1..4) rows: acc[r] (64,) += sum_j p[r][j] * v[j] (64,); each value vector is loaded once for all rows. */
static inline __attribute__((always_inline)) void wsum_rx64(const float *p, int64_t p_stride, int R, const float *v,
                                                            int64_t n_k, int64_t d, float *acc, int64_t acc_stride) {
    __m512 x[4][4];
    for (int r = 0; r < R; r++)
        for (int u = 0; u < 4; u++) x[r][u] = _mm512_loadu_ps(acc + r * acc_stride + 16 * u);
    for (int64_t j = 0; j < n_k; j++) {
        const float *vj = v + j * d;
        __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16), v2 = _mm512_loadu_ps(vj + 32),
               v3 = _mm512_loadu_ps(vj + 48);
        for (int r = 0; r < R; r++) {
            __m512 w = _mm512_set1_ps(p[r * p_stride + j]);
            x[r][0] = _mm512_fmadd_ps(w, v0, x[r][0]);
            x[r][1] = _mm512_fmadd_ps(w, v1, x[r][1]);
            x[r][2] = _mm512_fmadd_ps(w, v2, x[r][2]);
            x[r][3] = _mm512_fmadd_ps(w, v3, x[r][3]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(acc + r * acc_stride + 16 * u, x[r][u]);
}

/* One row, 16 columns: acc (16,) += sum_j p[j] * v[j] (16,) */
static inline void wsum_1x16(const float *p, const float *v, int64_t n_k, int64_t d, float *a) {
    __m512 x = _mm512_loadu_ps(a);
    for (int64_t j = 0; j < n_k; j++) x = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(v + j * d), x);
    _mm512_storeu_ps(a, x);
}

static inline __attribute__((always_inline)) void weighted_sum_r(const float *p, int64_t p_stride, int R,
                                                                 const float *v, int64_t n_k, int64_t d, float *acc,
                                                                 int64_t acc_stride) {
    int64_t i = 0;
    for (; i + 64 <= d; i += 64) wsum_rx64(p, p_stride, R, v + i, n_k, d, acc + i, acc_stride);
    for (; i < d; i += 16)
        for (int r = 0; r < R; r++) wsum_1x16(p + r * p_stride, v + i, n_k, d, acc + r * acc_stride + i);
}

static void weighted_sum_avx512(const float *p, int64_t p_stride, int64_t n_q, const float *v, int64_t n_k,
                                int64_t d, float *acc, int64_t acc_stride) {
    if (d % 16) {
        ember_op_kernels_avx2.weighted_sum(p, p_stride, n_q, v, n_k, d, acc, acc_stride);
        return;
    }
    for (int64_t r = 0; r < n_q; r += 4) {
        const float *pr = p + r * p_stride;
        float *ar = acc + r * acc_stride;
        switch (EMBER_MIN(4, n_q - r)) {
        case 4: weighted_sum_r(pr, p_stride, 4, v, n_k, d, ar, acc_stride); break;
        case 3: weighted_sum_r(pr, p_stride, 3, v, n_k, d, ar, acc_stride); break;
        case 2: weighted_sum_r(pr, p_stride, 2, v, n_k, d, ar, acc_stride); break;
        default: weighted_sum_r(pr, p_stride, 1, v, n_k, d, ar, acc_stride); break;
        }
    }
}

const ember_op_kernels ember_op_kernels_avx512 = {
    .silu_mul = silu_mul_avx512,
    .gelu_mul = gelu_mul_avx512,
    .f32_to_f16 = f32_to_f16_avx512,
    .gather_f16_rows = gather_f16_rows_avx512,
    .dot_rows = dot_rows_avx512,
    .transpose_keys = transpose_keys_avx512,
    .gather_f16_keys_t = gather_f16_keys_t_avx512,
    .dot_rows_kt = dot_rows_kt_avx512,
    .softcap = softcap_avx512,
    .max = max_avx512,
    .exp_sum = exp_sum_avx512,
    .weighted_sum = weighted_sum_avx512,
};

#if defined(__clang__)
#pragma clang attribute pop
#endif
#endif
