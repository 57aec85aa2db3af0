/* Elementwise ops, RMS norm, rotary embedding, KV-cache writes and paged attention (api_ops.h).
 * This file holds the drivers (threading, paging, online softmax) and the portable inner loops;
 * ops_avx2.c / ops_avx512.c provide the same inner loops with intrinsics (ops_kernels.h). */
#include <math.h>
#include <stdatomic.h>

#include "ops_kernels.h"
#include "kv_types.h"
#include "quant.h"
#include "api_ops.h"
#include "api_encoder.h"

/* Below this many elements touched, waking the other threads costs more than it saves. */
#define PARALLEL_MIN_WORK 32768

static const ember_op_kernels *kernels(void) {
    switch (ember_isa_active) {
#if defined(EMBER_X86)
    case EMBER_ISA_AVX512: return &ember_op_kernels_avx512;
    case EMBER_ISA_AVX2: return &ember_op_kernels_avx2;
#endif
    default: return &ember_op_kernels_scalar;
    }
}

/* ---- splitting a range over the pool ---- */

typedef void (*range_fn)(void *ctx, int64_t lo, int64_t hi);

typedef struct {
    range_fn fn;
    void *ctx;
    int64_t n, align;
} range_job;

static void range_task(void *p, int ith, int nth) {
    const range_job *job = p;
    int64_t lo, hi;
    ember_split((job->n + job->align - 1) / job->align, ith, nth, &lo, &hi);
    lo *= job->align;
    hi = EMBER_MIN(hi * job->align, job->n);
    if (lo < hi) job->fn(job->ctx, lo, hi);
}

/* fn over [0, n) in contiguous pieces whose bounds are multiples of align; threaded only when
 * `work` (elements touched) is large enough to pay for it. */
static void parallel_range(ember_pool *pool, range_fn fn, void *ctx, int64_t n, int64_t align, int64_t work) {
    if (n <= 0) return;
    if (work < PARALLEL_MIN_WORK || ember_pool_threads(pool) == 1) {
        fn(ctx, 0, n);
        return;
    }
    range_job job = {fn, ctx, n, align};
    ember_parallel(pool, range_task, &job);
}

/* ---- portable inner loops ---- */

/* f32 -> f16 bits, round to nearest even, half subnormals included. */
static uint16_t f16_from_f32(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds beyond 65504 */
    if (ax < 0x38800000u) {
        /* Below 2^-14 half steps are 2^-24; adding 0.5 makes the FPU round |f| to that step (nearest even). */
        float t = fabsf(f) + 0.5f;
        uint32_t tb;
        memcpy(&tb, &t, 4);
        return (uint16_t)(sign | (tb - 0x3f000000u));
    }
    uint32_t h = (ax >> 13) - (112u << 10), rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

static void f32_to_f16_scalar(const float *src, uint16_t *dst, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] = f16_from_f32(src[i]);
}

static void silu_mul_scalar(const float *gate, const float *up, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* 0.5 x (1 + tanh(u)) == x / (1 + exp(-2u)): the same function without the cancellation of 1 + tanh
 * for negative x. */
static void gelu_mul_scalar(const float *gate, const float *up, float *out, int64_t n) {
    const float c = 2.0f * 0.7978845608028654f; /* 2 sqrt(2/pi) */
    for (int64_t i = 0; i < n; i++) {
        float x = gate[i], u2 = c * (x + 0.044715f * x * x * x);
        out[i] = x / (1.0f + expf(-u2)) * up[i];
    }
}

static void gather_f16_rows_scalar(const void *base, const int64_t *offs, int64_t n_rows, int64_t width,
                                   float *dst) {
    for (int64_t r = 0; r < n_rows; r++) {
        const uint16_t *src = (const uint16_t *)((const char *)base + offs[r]);
        float *d = dst + r * width;
        for (int64_t i = 0; i < width; i++) d[i] = ember_f16_to_f32(src[i]);
    }
}

/* q.k in 8 independent lanes so the compiler can vectorize without reassociating. */
static float dot_scalar(const float *a, const float *b, int64_t d) {
    float lane[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; l++) lane[l] += a[i + l] * b[i + l];
    float s = 0;
    for (; i < d; i++) s += a[i] * b[i];
    for (int l = 0; l < 8; l++) s += lane[l];
    return s;
}

static void dot_rows_scalar(const float *q, int64_t q_stride, int64_t n_q, const float *k, int64_t n_k, int64_t d,
                            float scale, float *s, int64_t s_stride) {
    for (int64_t r = 0; r < n_q; r++)
        for (int64_t j = 0; j < n_k; j++) s[r * s_stride + j] = scale * dot_scalar(q + r * q_stride, k + j * d, d);
}

static void softcap_scalar(float *x, int64_t n, float cap) {
    for (int64_t i = 0; i < n; i++) x[i] = cap * tanhf(x[i] / cap);
}

static float max_scalar(const float *x, int64_t n) {
    float m = x[0];
    for (int64_t i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static float exp_sum_scalar(float *x, int64_t n, float m) {
    float s = 0;
    for (int64_t i = 0; i < n; i++) {
        x[i] = expf(x[i] - m);
        s += x[i];
    }
    return s;
}

static void weighted_sum_scalar(const float *p, int64_t p_stride, int64_t n_q, const float *v, int64_t n_k,
                                int64_t d, float *acc, int64_t acc_stride) {
    for (int64_t r = 0; r < n_q; r++) {
        float *a = acc + r * acc_stride;
        for (int64_t j = 0; j < n_k; j++) {
            float w = p[r * p_stride + j];
            const float *vj = v + j * d;
            for (int64_t i = 0; i < d; i++) a[i] += w * vj[i];
        }
    }
}

const ember_op_kernels ember_op_kernels_scalar = {
    .silu_mul = silu_mul_scalar,
    .gelu_mul = gelu_mul_scalar,
    .f32_to_f16 = f32_to_f16_scalar,
    .gather_f16_rows = gather_f16_rows_scalar,
    .dot_rows = dot_rows_scalar,
    .softcap = softcap_scalar,
    .max = max_scalar,
    .exp_sum = exp_sum_scalar,
    .weighted_sum = weighted_sum_scalar,
};

/* ---- elementwise ---- */

typedef struct {
    const float *a, *b;
    float *out;
    float s;
    const ember_op_kernels *k;
} binary_ctx;

static void silu_mul_range(void *p, int64_t lo, int64_t hi) {
    const binary_ctx *c = p;
    c->k->silu_mul(c->a + lo, c->b + lo, c->out + lo, hi - lo);
}

static void gelu_mul_range(void *p, int64_t lo, int64_t hi) {
    const binary_ctx *c = p;
    c->k->gelu_mul(c->a + lo, c->b + lo, c->out + lo, hi - lo);
}

static void add_range(void *p, int64_t lo, int64_t hi) {
    const binary_ctx *c = p;
    for (int64_t i = lo; i < hi; i++) c->out[i] = c->a[i] + c->b[i];
}

static void scale_range(void *p, int64_t lo, int64_t hi) {
    const binary_ctx *c = p;
    for (int64_t i = lo; i < hi; i++) c->out[i] *= c->s;
}

void ember_silu_mul(ember_pool *pool, const float *gate, const float *up, float *out, int64_t n) {
    binary_ctx c = {gate, up, out, 0, kernels()};
    parallel_range(pool, silu_mul_range, &c, n, 64, 4 * n); /* exp makes each element count more */
}

void ember_gelu_mul(ember_pool *pool, const float *gate, const float *up, float *out, int64_t n) {
    binary_ctx c = {gate, up, out, 0, kernels()};
    parallel_range(pool, gelu_mul_range, &c, n, 64, 4 * n);
}

/* gelu_tanh(x) alone (the encoders' FFN): the gated kernel against a run of ones */
static void gelu_range(void *p, int64_t lo, int64_t hi) {
    const binary_ctx *c = p;
    float ones[256];
    for (int i = 0; i < 256; i++) ones[i] = 1.0f;
    for (int64_t i = lo; i < hi; i += 256) c->k->gelu_mul(c->a + i, ones, c->out + i, EMBER_MIN(256, hi - i));
}

void ember_gelu(ember_pool *pool, const float *x, float *out, int64_t n) {
    binary_ctx c = {x, NULL, out, 0, kernels()};
    parallel_range(pool, gelu_range, &c, n, 64, 4 * n);
}

void ember_add(ember_pool *pool, const float *a, const float *b, float *out, int64_t n) {
    binary_ctx c = {a, b, out, 0, NULL};
    parallel_range(pool, add_range, &c, n, 64, n);
}

void ember_scale(ember_pool *pool, float *x, float s, int64_t n) {
    binary_ctx c = {NULL, NULL, x, s, NULL};
    parallel_range(pool, scale_range, &c, n, 64, n);
}

static void softcap_range(void *p, int64_t lo, int64_t hi) {
    const binary_ctx *c = p;
    c->k->softcap(c->out + lo, hi - lo, c->s);
}

void ember_softcap(ember_pool *pool, float *x, float cap, int64_t n) {
    binary_ctx c = {NULL, NULL, x, cap, kernels()};
    parallel_range(pool, softcap_range, &c, n, 64, 4 * n); /* tanh makes each element count more */
}

void ember_pos_scale(float *x, const int32_t *pos, int64_t n_tok, int64_t d, int64_t length, float scale,
                     float offset) {
    for (int64_t t = 0; t < n_tok; t++) {
        const float s = 1.0f + scale * logf(floorf(((float)pos[t] + offset) / (float)length) + 1.0f);
        for (int64_t j = 0; j < d; j++) x[t * d + j] *= s;
    }
}

/* ---- RMS norm ---- */

typedef struct {
    const float *x, *w;
    float *out;
    int64_t d;
    float eps;
} rms_ctx;

/* Sum of squares in 8 double lanes: exact enough for any row length, and the lanes vectorize. */
static double sum_squares(const float *x, int64_t d) {
    double lane[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; l++) lane[l] += (double)x[i + l] * x[i + l];
    double s = 0;
    for (; i < d; i++) s += (double)x[i] * x[i];
    for (int l = 0; l < 8; l++) s += lane[l];
    return s;
}

static void rms_norm_rows(void *p, int64_t lo, int64_t hi) {
    const rms_ctx *c = p;
    for (int64_t r = lo; r < hi; r++) {
        const float *x = c->x + r * c->d; /* (d,) */
        float *y = c->out + r * c->d;     /* (d,) */
        float inv = (float)(1.0 / sqrt(sum_squares(x, c->d) / (double)c->d + c->eps));
        if (c->w)
            for (int64_t i = 0; i < c->d; i++) y[i] = x[i] * inv * c->w[i];
        else
            for (int64_t i = 0; i < c->d; i++) y[i] = x[i] * inv;
    }
}

void ember_rms_norm(ember_pool *pool, const float *x, const float *w, float *out, int64_t n, int64_t d, float eps) {
    if (d <= 0) return;
    rms_ctx c = {x, w, out, d, eps};
    parallel_range(pool, rms_norm_rows, &c, n, 1, n * d);
}

/* ---- rotary embedding ---- */

#define ROPE_PAIRS 256 /* rotation pairs whose angles are computed together */

typedef struct {
    float *x;                   /* (n_tok, n_head, head_dim) */
    float *x2;                  /* (n_tok, n_head2, head_dim) or NULL: rotated at the same positions */
    const int32_t *pos;         /* (n_tok,) */
    const float *freq_factors;  /* (n_rot/2,) or NULL */
    int64_t n_tok, n_head, n_head2, head_dim, n_rot, n_pairs;
    int neox;
    double freq_base, freq_scale, ext_factor, mscale, corr_lo, corr_hi;
} rope_ctx;

/* Pair index at which YaRN's blend for a given number of rotations over n_ctx_orig sits (ggml's formula). */
static double yarn_corr_dim(double n_rot, double n_ctx_orig, double turns, double base) {
    return n_rot * log(n_ctx_orig / (turns * 2 * M_PI)) / (2 * log(base));
}

/* freq (np,): angle per unit of position of pairs [p0, p0 + np): freq_base^(-2i/n_rot) (by repeated
 * multiplication in double), divided by its frequency factor, then YaRN's blend of interpolation
 * (freq_scale) and extrapolation, ramping over pairs [corr_lo, corr_hi]. */
static void rope_pair_freqs(const rope_ctx *c, int64_t p0, int64_t np, double *freq) {
    double step = pow(c->freq_base, -2.0 / (double)c->n_rot), extrap = pow(c->freq_base, -2.0 * p0 / c->n_rot);
    for (int64_t k = 0; k < np; k++, extrap *= step) {
        int64_t i = p0 + k;
        double mix = 0.0;
        if (c->ext_factor != 0.0) {
            double y = ((double)i - c->corr_lo) / fmax(0.001, c->corr_hi - c->corr_lo);
            mix = c->ext_factor * (1.0 - fmin(1.0, fmax(0.0, y)));
        }
        freq[k] = extrap / (c->freq_factors ? c->freq_factors[i] : 1.0) * (c->freq_scale * (1.0 - mix) + mix);
    }
}

/* cs, sn (np,) = mscale * cos/sin(pos * freq). The angle is formed and reduced to [-pi, pi] in double
 * (positions reach 1e5+, where a float angle would be off by ~1e-2), then float sin/cos are exact enough. */
static void rope_cos_sin(const rope_ctx *c, int32_t pos, const double *freq, int64_t np, float *cs, float *sn) {
    const double two_pi = 2 * M_PI;
    for (int64_t i = 0; i < np; i++) {
        double theta = (double)pos * freq[i];
        float r = (float)(theta - two_pi * nearbyint(theta / two_pi));
        cs[i] = cosf(r) * (float)c->mscale;
        sn[i] = sinf(r) * (float)c->mscale;
    }
}

static void rotate_pairs(const rope_ctx *c, float *head, int64_t p0, int64_t np, const float *cs, const float *sn) {
    if (c->neox) {
        float *a = head + p0, *b = head + c->n_pairs + p0;
        for (int64_t i = 0; i < np; i++) {
            float x0 = a[i], x1 = b[i];
            a[i] = x0 * cs[i] - x1 * sn[i];
            b[i] = x0 * sn[i] + x1 * cs[i];
        }
    } else {
        float *v = head + 2 * p0;
        for (int64_t i = 0; i < np; i++) {
            float x0 = v[2 * i], x1 = v[2 * i + 1];
            v[2 * i] = x0 * cs[i] - x1 * sn[i];
            v[2 * i + 1] = x0 * sn[i] + x1 * cs[i];
        }
    }
}

/* Head h of token t: x's heads first, then x2's. */
static float *rope_head(const rope_ctx *c, int64_t t, int64_t h) {
    return h < c->n_head ? c->x + (t * c->n_head + h) * c->head_dim
                         : c->x2 + (t * c->n_head2 + h - c->n_head) * c->head_dim;
}

/* Each thread takes a range of (token, head) rows and computes a token's cos/sin once for its heads
 * (of both tensors). */
static void rope_task(void *p, int ith, int nth) {
    const rope_ctx *c = p;
    const int64_t heads = c->n_head + c->n_head2;
    int64_t lo, hi;
    ember_split(c->n_tok * heads, ith, nth, &lo, &hi);
    double freq[ROPE_PAIRS];          /* (np,) angle per position */
    float cs[ROPE_PAIRS], sn[ROPE_PAIRS]; /* (np,) scaled cos and sin at one token's position */
    for (int64_t p0 = 0; p0 < c->n_pairs; p0 += ROPE_PAIRS) {
        int64_t np = EMBER_MIN(ROPE_PAIRS, c->n_pairs - p0);
        rope_pair_freqs(c, p0, np, freq);
        for (int64_t row = lo; row < hi;) {
            int64_t t = row / heads, end = EMBER_MIN(hi, (t + 1) * heads);
            rope_cos_sin(c, c->pos[t], freq, np, cs, sn);
            for (; row < end; row++) rotate_pairs(c, rope_head(c, t, row - t * heads), p0, np, cs, sn);
        }
    }
}

void ember_rope(ember_pool *pool, float *x, int64_t n_tok, int64_t n_head, int64_t head_dim, const int32_t *pos,
                int64_t n_rot, int neox, float freq_base, float freq_scale, const float *freq_factors,
                float ext_factor, float attn_factor, float beta_fast, float beta_slow, int64_t n_ctx_orig) {
    ember_rope_pair(pool, x, n_head, NULL, 0, n_tok, head_dim, pos, n_rot, neox, freq_base, freq_scale, freq_factors,
                    ext_factor, attn_factor, beta_fast, beta_slow, n_ctx_orig);
}

void ember_rope_pair(ember_pool *pool, float *x, int64_t n_head, float *x2, int64_t n_head2, int64_t n_tok,
                     int64_t head_dim, const int32_t *pos, int64_t n_rot, int neox, float freq_base, float freq_scale,
                     const float *freq_factors, float ext_factor, float attn_factor, float beta_fast, float beta_slow,
                     int64_t n_ctx_orig) {
    if (!x2) n_head2 = 0;
    if (n_tok <= 0 || n_head <= 0 || n_head2 < 0 || n_rot < 2 || n_rot > head_dim) return; /* outside the contract */
    rope_ctx c = {x, x2, pos, freq_factors, n_tok, n_head, n_head2, head_dim, n_rot, n_rot / 2, neox,
                  freq_base, freq_scale, ext_factor, attn_factor, 0.0, 0.0};
    if (ext_factor != 0.0f) {
        c.mscale *= 1.0 + 0.1 * log(1.0 / (double)freq_scale);
        c.corr_lo = fmax(0.0, floor(yarn_corr_dim((double)n_rot, (double)n_ctx_orig, beta_fast, freq_base)));
        c.corr_hi = fmin((double)n_rot - 1, ceil(yarn_corr_dim((double)n_rot, (double)n_ctx_orig, beta_slow, freq_base)));
    }
    if (n_tok * (n_head + n_head2) * n_rot < PARALLEL_MIN_WORK / 2 || ember_pool_threads(pool) == 1)
        rope_task(&c, 0, 1);
    else
        ember_parallel(pool, rope_task, &c);
}

/* ---- KV cache ---- */

/* Byte offset of part j of slot s in a cache of `parts` parts of part_bytes, pages of page_size (api_ops.h). */
static inline int64_t kv_part_offset(int64_t s, int64_t j, int64_t parts, int64_t page_size, int64_t part_bytes) {
    return ((s / page_size * parts + j) * page_size + s % page_size) * part_bytes;
}

typedef struct {
    const float *k, *v;          /* (n_tok, k_dim), (n_tok, v_dim) */
    char *k_cache, *v_cache;     /* (n_slots, k_row), (n_slots, v_row) bytes of k_type, v_type, in parts */
    const int64_t *slots;        /* (n_tok,) */
    int64_t k_dim, v_dim, k_part, v_part, page_size, parts; /* k_part, v_part: bytes of a part */
    int k_type, v_type;
    const ember_op_kernels *kern;
} kv_store_ctx;

static void kv_store_rows(void *p, int64_t lo, int64_t hi) {
    const kv_store_ctx *c = p;
    const int64_t kn = c->k_dim / c->parts, vn = c->v_dim / c->parts; /* values of a part */
    for (int64_t t = lo; t < hi; t++)
        for (int64_t j = 0; j < c->parts; j++) {
            ember_kv_write_row(c->k_type, c->kern, c->k + t * c->k_dim + j * kn,
                               c->k_cache + kv_part_offset(c->slots[t], j, c->parts, c->page_size, c->k_part), kn);
            ember_kv_write_row(c->v_type, c->kern, c->v + t * c->v_dim + j * vn,
                               c->v_cache + kv_part_offset(c->slots[t], j, c->parts, c->page_size, c->v_part), vn);
        }
}

int64_t ember_kv_row_bytes(int type, int64_t n) { return ember_kv_bytes(type, n); }

void ember_kv_store(ember_pool *pool, const float *k, const float *v, void *k_cache, void *v_cache,
                    const int64_t *slots, int64_t n_tok, int64_t k_dim, int64_t v_dim, int k_type, int v_type,
                    int64_t page_size, int64_t parts) {
    if (parts < 1 || page_size < 1 || k_dim % parts || v_dim % parts) return; /* outside the contract */
    int64_t k_part = ember_kv_bytes(k_type, k_dim / parts), v_part = ember_kv_bytes(v_type, v_dim / parts);
    if (k_part < 0 || v_part < 0) return;
    kv_store_ctx c = {k, v, k_cache, v_cache, slots, k_dim, v_dim, k_part, v_part, page_size, parts,
                      k_type, v_type, kernels()};
    parallel_range(pool, kv_store_rows, &c, n_tok, 1, n_tok * (k_dim + v_dim));
}

/* ---- Walsh-Hadamard rotation ---- */

typedef struct {
    const float *x;
    float *out;
    int64_t d, block;
} hadamard_ctx;

/* x (block,) = H x in place, H the orthonormal Sylvester-Hadamard matrix (H[i][j] = (-1)^popcount(i & j)
 * / sqrt(block)): butterflies, then one scale. */
static void hadamard_block(float *x, int64_t block) {
    for (int64_t h = 1; h < block; h *= 2)
        for (int64_t i = 0; i < block; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
    float s = 1.0f / sqrtf((float)block);
    for (int64_t i = 0; i < block; i++) x[i] *= s;
}

static void hadamard_rows(void *p, int64_t lo, int64_t hi) {
    const hadamard_ctx *c = p;
    for (int64_t r = lo; r < hi; r++) {
        float *o = c->out + r * c->d;
        if (o != c->x + r * c->d) memcpy(o, c->x + r * c->d, sizeof(float) * c->d);
        for (int64_t b = 0; b < c->d; b += c->block) hadamard_block(o + b, c->block);
    }
}

void ember_hadamard(ember_pool *pool, const float *x, float *out, int64_t n, int64_t d, int64_t block) {
    if (block < 2 || (block & (block - 1)) || d % block) return; /* outside the contract */
    hadamard_ctx c = {x, out, d, block};
    parallel_range(pool, hadamard_rows, &c, n, 1, n * d);
}

/* ---- paged attention ----
 * Work item: a block of query tokens x one kv head (x a range of its query heads when a group is very
 * large) x, for calls with few items, a piece of the key range. An item walks its keys in chunks: the
 * chunk's K and V are converted to f32 once and used by all the item's rows (tokens x heads sharing the
 * kv head), with an online softmax per row; the rows are staged together, so the tokens that see the
 * same keys of a chunk (all but the causal diagonal's) take one product of 4-row tiles (with 3 heads a
 * kv head, 4-row tiles are ~30% cheaper a row than a token's 3 rows). Items are claimed from a shared
 * counter, last blocks (the longest causal ranges) first.
 *
 * Shared prefixes: sequences whose page tables begin with the same pages (the prefix cache hands one
 * system prompt's pages to many sequences) read those keys once for all their tokens. A first pass
 * attends the tokens of each such group, in blocks that mix its sequences, to the shared keys only,
 * leaving every row's unnormalized sums in out and its max and total aside; the second pass attends
 * each sequence's blocks to the keys after the shared ones, starting each row's online softmax from the
 * first pass's state (the log-sum-exp merge of the two ranges). Decode steps of many sequences read
 * their common prefix once a step instead of once a sequence. */

#define ATTN_MAX_ROWS 64          /* query rows (tokens x heads) of one item */
#define ATTN_ROW_FLOATS 8192      /* an item's queries (rows, hd_k) and sums (rows, hd_v), staged */
#define ATTN_MAX_CHUNK 64         /* keys per chunk */
#define ATTN_CHUNK_FLOATS 8192    /* f32 staging of one key chunk, and of one value chunk */
#define ATTN_PARTIAL_FLOATS 32768 /* results of key-range pieces, combined after the parallel pass */
#define ATTN_KT_MIN_ROWS 8         /* pieces of this many rows take scores from transposed keys */
_Static_assert(ATTN_MAX_CHUNK <= EMBER_KT_STRIDE, "a chunk's keys fit the columns of its transposed copy");
#define ATTN_MIN_SPLIT_KEYS 256   /* key ranges are split only into pieces at least this long */
#define ATTN_SHARED_TOKENS 512    /* calls of more tokens (prompts, whose blocks already share reads) */
#define ATTN_SHARED_ROWS 4096     /* or more rows (tokens x heads) read shared prefixes per sequence */
#define ATTN_MIN_SHARED_KEYS 64   /* a common prefix shorter than one chunk is read per sequence */

typedef struct {
    int64_t n_list;                         /* tokens in groups */
    int32_t list[ATTN_SHARED_TOKENS];       /* (n_list,) those tokens, group after group */
    int32_t list_group[ATTN_SHARED_TOKENS]; /* (n_list,) the group of each */
    int32_t keys[ATTN_SHARED_TOKENS];       /* (n_tok,) token t's keys [0, keys[t]) are shared; 0: none */
    float m[ATTN_SHARED_ROWS], l[ATTN_SHARED_ROWS]; /* (n_tok, n_head) first pass's running max and total */
} attn_shared;

typedef struct {
    const float *q;                    /* (n_tok, n_head, hd_k) */
    const char *k_cache, *v_cache;     /* (n_slots, n_kv_head, k_head) bytes, (n_slots, n_kv_head, v_head), in parts */
    float *out;                        /* (n_tok, n_head, hd_v) */
    const int32_t *tok_pos, *tok_seq;  /* (n_tok,) */
    const int32_t *block_tables;       /* (n_seq, max_pages) */
    int64_t n_tok, n_head, n_kv_head, hd_k, hd_v, max_pages, page_size, window;
    int k_type, v_type;      /* storage types of the caches (kv_types.h) */
    int64_t k_head, v_head;  /* bytes of one kv head's keys, values in a cache row */
    int64_t parts;           /* the caches' layout (ember_kv_store): 1 or n_kv_head */
    float scale, softcap;
    const float *sinks;      /* (n_head,) or NULL: a logit per head in every softmax's denominator */
    int64_t group;           /* query heads per kv head */
    int64_t item_heads;      /* query heads of one item (<= group) */
    int64_t n_hsub;          /* items per group and block: ceil(group / item_heads) */
    int64_t block_tokens;    /* most tokens per block: block_tokens * item_heads <= ATTN_MAX_ROWS */
    int64_t n_chunk;         /* keys per chunk */
    attn_shared *shared;     /* NULL: no shared prefixes */
    /* per pass */
    int64_t n_entry;         /* the pass's tokens: 0..n_tok, or the first pass's shared->list */
    int first_pass;          /* shared keys of the groups' tokens, results left unnormalized */
    int64_t n_split;         /* pieces of each item's key range */
    int64_t items_per_block; /* n_kv_head * n_hsub * n_split */
    float *partial;          /* n_split > 1: piece i at partial + i * piece_floats */
    int64_t piece_floats;    /* sums (piece_rows, hd_v), then maxima (piece_rows,), then totals (piece_rows,) */
    int64_t piece_rows;
    const ember_op_kernels *kern;
    atomic_llong next_item;
} attn_ctx;

typedef struct {
    float k[ATTN_CHUNK_FLOATS];               /* (n_chunk, hd_k) keys of the chunk */
    float kt[ATTN_CHUNK_FLOATS];              /* (hd_k, EMBER_KT_STRIDE) the same, transposed (pieces of many rows) */
    float v[ATTN_CHUNK_FLOATS];               /* (n_chunk, hd_v) values of the chunk */
    float q[ATTN_ROW_FLOATS];                 /* (rows, hd_k) the piece's queries, row j * nh + i */
    float acc[ATTN_ROW_FLOATS];               /* (rows, hd_v) their weighted sums of values */
    float s[ATTN_MAX_ROWS * ATTN_MAX_CHUNK];  /* (rows, n_chunk) scores, then weights */
    float m[ATTN_MAX_ROWS], l[ATTN_MAX_ROWS]; /* (rows,) running max and sum of weights */
    int64_t k_off[2][ATTN_MAX_CHUNK], v_off[2][ATTN_MAX_CHUNK]; /* (n_chunk,) byte offsets: this chunk, next */
} attn_scratch;

/* Heads [h0, h0 + nh) of kv head g for entries [t0, t1) of the pass, over keys [k_lo, k_hi); piece
 * `split` of the item's key range. Rows end in out, or in acc (rows, hd_v) when split. */
typedef struct {
    int64_t t0, t1, g, h0, nh, k_lo, k_hi, split;
    float *acc;
} attn_piece;

typedef struct {
    int64_t index, t0, t1; /* block number `index` (counted from the last entry) is entries [t0, t1) */
} attn_block;

static int64_t entry_token(const attn_ctx *c, int64_t e) {
    return c->first_pass ? c->shared->list[e] : e;
}

/* Entries of one block share this: their sequence, or in the first pass their group. */
static int32_t entry_run(const attn_ctx *c, int64_t e) {
    return c->first_pass ? c->shared->list_group[e] : c->tok_seq[e];
}

static void token_keys(const attn_ctx *c, int64_t t, int64_t *lo, int64_t *hi) {
    int64_t pos = c->tok_pos[t];
    *hi = pos + 1;
    *lo = c->window > 0 ? EMBER_MAX(0, pos - c->window + 1) : 0;
}

/* The keys of entry e that this pass attends: the shared ones in the first pass, the rest in the second. */
static void entry_keys(const attn_ctx *c, int64_t e, int64_t *lo, int64_t *hi) {
    int64_t t = entry_token(c, e);
    token_keys(c, t, lo, hi);
    if (!c->shared) return;
    if (c->first_pass)
        *hi = EMBER_MIN(*hi, c->shared->keys[t]);
    else
        *lo = EMBER_MAX(*lo, c->shared->keys[t]);
}

/* First entry of the block ending at t1: up to block_tokens entries of one run. */
static int64_t block_start(const attn_ctx *c, int64_t t1) {
    int64_t t0 = t1 - 1;
    while (t0 > 0 && t1 - t0 < c->block_tokens && entry_run(c, t0 - 1) == entry_run(c, t1 - 1)) t0--;
    return t0;
}

/* Move b forward to block number `index`; 0 when the entries run out first. */
static int seek_block(const attn_ctx *c, attn_block *b, int64_t index) {
    while (b->index < index) {
        if (b->t0 == 0) return 0;
        b->t1 = b->t0;
        b->t0 = block_start(c, b->t1);
        b->index++;
    }
    return 1;
}

static attn_block first_block_cursor(const attn_ctx *c) {
    attn_block b = {-1, c->n_entry, c->n_entry};
    return b;
}

/* The keys any entry of the block attends in this pass: [lo, hi), empty when lo == hi. */
static void block_keys(const attn_ctx *c, const attn_block *b, int64_t *lo, int64_t *hi) {
    *lo = INT64_MAX;
    *hi = 0;
    for (int64_t e = b->t0; e < b->t1; e++) {
        int64_t el, eh;
        entry_keys(c, e, &el, &eh);
        *lo = EMBER_MIN(*lo, el);
        *hi = EMBER_MAX(*hi, eh);
    }
    *hi = EMBER_MAX(*hi, *lo);
}

/* Fills w with work item `item`; 0 when there is no such item. */
static int item_piece(const attn_ctx *c, attn_block *b, int64_t item, attn_piece *w) {
    if (!seek_block(c, b, item / c->items_per_block)) return 0;
    int64_t rest = item % c->items_per_block;
    int64_t split = rest % c->n_split, hs = (rest / c->n_split) % c->n_hsub, g = rest / c->n_split / c->n_hsub;
    int64_t lo, hi;
    block_keys(c, b, &lo, &hi);
    w->t0 = b->t0;
    w->t1 = b->t1;
    w->g = g;
    w->h0 = hs * c->item_heads;
    w->nh = EMBER_MIN(c->item_heads, c->group - w->h0);
    w->k_lo = lo + (hi - lo) * split / c->n_split;
    w->k_hi = lo + (hi - lo) * (split + 1) / c->n_split;
    w->split = split;
    w->acc = c->n_split == 1 ? NULL : c->partial + item * c->piece_floats;
    return 1;
}

/* Online softmax: fold n new scores s into a row's running max m and sum l, rescaling its sums acc. */
static void softmax_update(const attn_ctx *c, float *s, int64_t n, float *m, float *l, float *acc) {
    if (c->softcap > 0) c->kern->softcap(s, n, c->softcap);
    float m_new = c->kern->max(s, n);
    if (m_new > *m) {
        if (*l > 0) {
            float corr = expf(*m - m_new);
            *l *= corr;
            for (int64_t i = 0; i < c->hd_v; i++) acc[i] *= corr;
        }
        *m = m_new;
    }
    *l += c->kern->exp_sum(s, n, *m);
}

/* Byte offsets of the K and V rows (kv head w->g) of keys [p0, p1) of the piece's sequence (in the first
 * pass, of any sequence of the group: the shared keys are on the same pages in all of them). */
static void chunk_offsets(const attn_ctx *c, const attn_piece *w, int64_t p0, int64_t p1, int64_t *k_off,
                          int64_t *v_off) {
    const int32_t *pages = c->block_tables + (int64_t)c->tok_seq[entry_token(c, w->t0)] * c->max_pages;
    int64_t page = p0 / c->page_size, in_page = p0 % c->page_size; /* walked, not divided, per key */
    const int64_t per = c->n_kv_head / c->parts, part = w->g / per, in_part = w->g % per; /* kv heads a part */
    for (int64_t j = 0; j < p1 - p0; j++) {
        int64_t row = ((int64_t)pages[page] * c->parts + part) * c->page_size + in_page; /* in parts' rows */
        k_off[j] = (row * per + in_part) * c->k_head;
        v_off[j] = (row * per + in_part) * c->v_head;
        if (++in_page == c->page_size) {
            in_page = 0;
            page++;
        }
    }
}

/* Ask for rows ahead of use: a kv head's rows are strided by the other heads and scattered over pages,
 * which the hardware prefetchers follow poorly (~10% on decode from DRAM). */
static void prefetch_rows(const attn_ctx *c, const int64_t *k_off, const int64_t *v_off, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        const char *k = c->k_cache + k_off[j], *v = c->v_cache + v_off[j];
        for (int64_t b = 0; b < c->k_head; b += 64) __builtin_prefetch(k + b);
        for (int64_t b = 0; b < c->v_head; b += 64) __builtin_prefetch(v + b);
    }
}

/* Whether a piece of `rows` query rows takes its scores from the chunk's keys transposed (the table has the
 * kernels, the head dim suits them, and enough rows share the transpose). */
static int uses_kt(const attn_ctx *c, int64_t rows) {
    return c->kern->dot_rows_kt && rows >= ATTN_KT_MIN_ROWS && c->hd_k % 16 == 0 &&
           c->hd_k * EMBER_KT_STRIDE <= ATTN_CHUNK_FLOATS;
}

/* Keys [p0, p1) (rows at k_off, v_off): convert them once, then update every row of the piece that sees
 * some, the rows of consecutive entries that see the same keys (all but the causal diagonal) at once. */
static void attend_chunk(const attn_ctx *c, const attn_piece *w, attn_scratch *sc, int64_t p0, int64_t p1,
                         const int64_t *k_off, const int64_t *v_off) {
    int64_t n = w->t1 - w->t0, lo, hi, lo1 = 0, hi1 = 0;
    const int kt = uses_kt(c, n * w->nh);
    if (kt && c->k_type == EMBER_T_F16 && c->kern->gather_f16_keys_t) {
        c->kern->gather_f16_keys_t(c->k_cache, k_off, p1 - p0, c->hd_k, sc->kt);
    } else {
        ember_kv_gather_rows(c->k_type, c->kern, c->k_cache, k_off, p1 - p0, c->hd_k, sc->k);
        if (kt) c->kern->transpose_keys(sc->k, p1 - p0, c->hd_k, sc->kt);
    }
    ember_kv_gather_rows(c->v_type, c->kern, c->v_cache, v_off, p1 - p0, c->hd_v, sc->v);
    entry_keys(c, w->t0, &lo, &hi);
    for (int64_t j = 0, j1; j < n; j = j1, lo = lo1, hi = hi1) {
        int64_t a = EMBER_MAX(lo, p0), b = EMBER_MIN(hi, p1); /* entries [j, j1) see keys [a, b) */
        for (j1 = j + 1; j1 < n; j1++) {
            entry_keys(c, w->t0 + j1, &lo1, &hi1);
            if (EMBER_MAX(lo1, p0) != a || EMBER_MIN(hi1, p1) != b) break;
        }
        if (a >= b) continue;
        int64_t r0 = j * w->nh, rows = (j1 - j) * w->nh;
        float *s = sc->s + r0 * c->n_chunk; /* (rows, n_chunk) */
        if (kt)
            c->kern->dot_rows_kt(sc->q + r0 * c->hd_k, c->hd_k, rows, sc->kt + (a - p0), b - a, c->hd_k, c->scale, s,
                                 c->n_chunk);
        else
            c->kern->dot_rows(sc->q + r0 * c->hd_k, c->hd_k, rows, sc->k + (a - p0) * c->hd_k, b - a, c->hd_k,
                              c->scale, s, c->n_chunk);
        for (int64_t r = r0; r < r0 + rows; r++)
            softmax_update(c, sc->s + r * c->n_chunk, b - a, &sc->m[r], &sc->l[r], sc->acc + r * c->hd_v);
        c->kern->weighted_sum(s, c->n_chunk, rows, sc->v + (a - p0) * c->hd_v, b - a, c->hd_v, sc->acc + r0 * c->hd_v,
                              c->hd_v);
    }
}

/* Stage the piece's queries; every row starts empty, except (second pass, first piece) a token's with a
 * shared prefix: from the first pass's sums (in out) and its max and total. */
static void start_piece(const attn_ctx *c, const attn_piece *w, attn_scratch *sc) {
    for (int64_t j = 0; j < w->t1 - w->t0; j++) {
        int64_t t = entry_token(c, w->t0 + j), h = t * c->n_head + w->g * c->group + w->h0, r0 = j * w->nh;
        memcpy(sc->q + r0 * c->hd_k, c->q + h * c->hd_k, sizeof(float) * w->nh * c->hd_k);
        int seeded = c->shared && !c->first_pass && w->split == 0 && c->shared->keys[t] > 0;
        for (int64_t i = 0; i < w->nh; i++) {
            sc->m[r0 + i] = seeded ? c->shared->m[h + i] : -INFINITY;
            sc->l[r0 + i] = seeded ? c->shared->l[h + i] : 0;
        }
        if (seeded)
            memcpy(sc->acc + r0 * c->hd_v, c->out + h * c->hd_v, sizeof(float) * w->nh * c->hd_v);
        else
            memset(sc->acc + r0 * c->hd_v, 0, sizeof(float) * w->nh * c->hd_v);
    }
}

static void attend_piece(const attn_ctx *c, const attn_piece *w, attn_scratch *sc) {
    start_piece(c, w, sc);
    int cur = 0; /* offsets of the chunk being attended; the other buffer holds the next chunk's */
    if (w->k_lo < w->k_hi)
        chunk_offsets(c, w, w->k_lo, EMBER_MIN(w->k_lo + c->n_chunk, w->k_hi), sc->k_off[0], sc->v_off[0]);
    for (int64_t p0 = w->k_lo; p0 < w->k_hi; p0 += c->n_chunk, cur = !cur) {
        int64_t p1 = EMBER_MIN(p0 + c->n_chunk, w->k_hi), p2 = EMBER_MIN(p1 + c->n_chunk, w->k_hi);
        if (p1 < p2) {
            chunk_offsets(c, w, p1, p2, sc->k_off[!cur], sc->v_off[!cur]);
            prefetch_rows(c, sc->k_off[!cur], sc->v_off[!cur], p2 - p1);
        }
        attend_chunk(c, w, sc, p0, p1, sc->k_off[cur], sc->v_off[cur]);
    }
}

/* 1 / the softmax total of a row of head h whose weights sum to l relative to max m, with the head's
 * sink (a score no value goes with) in the total; the weighted sums are relative to m too. */
static float softmax_inverse(const attn_ctx *c, int64_t h, float m, float l) {
    if (c->sinks) {
        const float s = c->sinks[h];
        if (l <= 0 || s > m) return l > 0 ? expf(m - s) / (l * expf(m - s) + 1.0f) : 0.0f;
        l += expf(s - m);
    }
    return l > 0 ? 1.0f / l : 0.0f;
}

/* Row (token t, head h) of out = sums (hd_v,) relative to max m with total l, divided by the softmax total;
 * in the first pass the sums as they are, m and l kept for the second. sums may be that row itself. */
static void finish_row(const attn_ctx *c, int64_t t, int64_t h, const float *sums, float m, float l) {
    float *out = c->out + (t * c->n_head + h) * c->hd_v, inv = 1.0f;
    if (c->first_pass) {
        c->shared->m[t * c->n_head + h] = m;
        c->shared->l[t * c->n_head + h] = l;
    } else {
        inv = softmax_inverse(c, h, m, l);
    }
    for (int64_t i = 0; i < c->hd_v; i++) out[i] = sums[i] * inv;
}

/* A whole item: finish its rows. A piece: keep max and total for combine_pieces. */
static void finish_piece(const attn_ctx *c, const attn_piece *w, const attn_scratch *sc, int64_t item) {
    int64_t rows = (w->t1 - w->t0) * w->nh;
    if (c->n_split > 1) {
        float *m = w->acc + c->piece_rows * c->hd_v, *l = m + c->piece_rows;
        memcpy(w->acc, sc->acc, sizeof(float) * rows * c->hd_v);
        memcpy(m, sc->m, sizeof(float) * rows);
        memcpy(l, sc->l, sizeof(float) * rows);
        return;
    }
    for (int64_t r = 0; r < rows; r++)
        finish_row(c, entry_token(c, w->t0 + r / w->nh), w->g * c->group + w->h0 + r % w->nh, sc->acc + r * c->hd_v,
                   sc->m[r], sc->l[r]);
}

static void attention_task(void *p, int ith, int nth) {
    attn_ctx *c = p;
    (void)ith;
    (void)nth;
    attn_scratch sc;
    attn_block b = first_block_cursor(c);
    attn_piece w;
    for (;;) {
        int64_t item = atomic_fetch_add(&c->next_item, 1);
        if (!item_piece(c, &b, item, &w)) break;
        attend_piece(c, &w, &sc);
        finish_piece(c, &w, &sc, item);
    }
}

/* Merge the n_split pieces of every item into its output rows (softmax of the concatenated keys). */
static void combine_pieces(const attn_ctx *c) {
    attn_block b = first_block_cursor(c);
    attn_piece w;
    for (int64_t base = 0; item_piece(c, &b, base, &w); base += c->n_split) {
        for (int64_t r = 0; r < (w.t1 - w.t0) * w.nh; r++) {
            int64_t t = entry_token(c, w.t0 + r / w.nh), h = w.g * c->group + w.h0 + r % w.nh;
            float *out = c->out + (t * c->n_head + h) * c->hd_v; /* (hd_v,) */
            float m_all = -INFINITY, total = 0;
            for (int64_t s = 0; s < c->n_split; s++)
                m_all = EMBER_MAX(m_all, c->partial[(base + s) * c->piece_floats + c->piece_rows * c->hd_v + r]);
            memset(out, 0, sizeof(float) * c->hd_v);
            for (int64_t s = 0; s < c->n_split; s++) {
                const float *piece = c->partial + (base + s) * c->piece_floats;
                float m = piece[c->piece_rows * c->hd_v + r], l = piece[c->piece_rows * (c->hd_v + 1) + r];
                if (l <= 0) continue;
                float wgt = expf(m - m_all);
                total += wgt * l;
                for (int64_t i = 0; i < c->hd_v; i++) out[i] += wgt * piece[r * c->hd_v + i];
            }
            finish_row(c, t, h, out, m_all, total);
        }
    }
}

/* Blocks this pass forms, the most entries in one of them and the longest key range of one. */
static int64_t count_blocks(const attn_ctx *c, int64_t *most_tokens, int64_t *most_keys) {
    attn_block b = first_block_cursor(c);
    *most_tokens = *most_keys = 0;
    while (seek_block(c, &b, b.index + 1)) {
        int64_t lo, hi;
        block_keys(c, &b, &lo, &hi);
        *most_tokens = EMBER_MAX(*most_tokens, b.t1 - b.t0);
        *most_keys = EMBER_MAX(*most_keys, hi - lo);
    }
    return b.index + 1;
}

/* Key-range pieces per item: only when there are too few items to keep every thread busy (decode),
 * with long enough ranges, and as many as the partial-result buffer holds. */
static int64_t choose_split(attn_ctx *c, int nth) {
    int64_t most_tokens, max_keys;
    int64_t items = count_blocks(c, &most_tokens, &max_keys) * c->n_kv_head * c->n_hsub;
    if (nth <= 1 || items >= 4 * nth || items == 0) return 1;
    c->piece_rows = most_tokens * c->item_heads;
    c->piece_floats = c->piece_rows * (c->hd_v + 2);
    int64_t want = (4 * nth + items - 1) / items; /* a few pieces per thread absorb a late-starting thread */
    int64_t by_keys = max_keys / ATTN_MIN_SPLIT_KEYS, by_room = ATTN_PARTIAL_FLOATS / (items * c->piece_floats);
    int64_t n = EMBER_MIN(want, EMBER_MIN(by_keys, by_room));
    for (int64_t fewer = n - 1; fewer >= (n + 1) / 2; fewer--) /* prefer an even share per thread */
        if ((n * items) % nth != 0 && (fewer * items) % nth == 0) n = fewer;
    return EMBER_MAX(1, n);
}

static void attention_pass(ember_pool *pool, attn_ctx *c, int nth, float *partial) {
    c->n_split = choose_split(c, nth);
    c->items_per_block = c->n_kv_head * c->n_hsub * c->n_split;
    c->partial = partial;
    atomic_store(&c->next_item, 0);
    if (nth == 1)
        attention_task(c, 0, 1);
    else
        ember_parallel(pool, attention_task, c);
    if (c->n_split > 1) combine_pieces(c);
}

/* ---- finding shared prefixes ---- */

typedef struct {
    int32_t row;              /* row of block_tables */
    int64_t lo, hi, n_tok;    /* its tokens' keys span [lo, hi); how many tokens */
    int32_t group;            /* -1: none yet */
} attn_seq;

/* The sequences of the call's tokens in order of appearance; tok_index[t] = t's. Returns how many. */
static int64_t list_sequences(const attn_ctx *c, attn_seq *seqs, int32_t *tok_index) {
    int64_t n = 0;
    for (int64_t t = 0; t < c->n_tok; t++) {
        int64_t i = n > 0 && seqs[n - 1].row == c->tok_seq[t] ? n - 1 : 0;
        while (i < n && seqs[i].row != c->tok_seq[t]) i++;
        if (i == n) seqs[n++] = (attn_seq){c->tok_seq[t], INT64_MAX, 0, 0, -1};
        int64_t lo, hi;
        token_keys(c, t, &lo, &hi);
        seqs[i].lo = EMBER_MIN(seqs[i].lo, lo);
        seqs[i].hi = EMBER_MAX(seqs[i].hi, hi);
        seqs[i].n_tok++;
        tok_index[t] = (int32_t)i;
    }
    return n;
}

/* Keys on the same pages in rows a and b among the first `keys` (whole pages). */
static int64_t common_keys(const attn_ctx *c, int32_t a, int32_t b, int64_t keys) {
    const int32_t *pa = c->block_tables + (int64_t)a * c->max_pages, *pb = c->block_tables + (int64_t)b * c->max_pages;
    int64_t pages = EMBER_MIN(c->max_pages, (keys + c->page_size - 1) / c->page_size), p = 0;
    while (p < pages && pa[p] == pb[p]) p++;
    return p * c->page_size;
}

/* Sequences joining seqs[lead]'s group: their common prefix with it, and its keys; worth it when the
 * group's blocks read the prefix fewer times than its sequences' own blocks would. */
static int64_t form_group(const attn_ctx *c, attn_seq *seqs, int64_t n_seq, int64_t lead, int32_t id) {
    int64_t keys = INT64_MAX, lo = seqs[lead].lo, hi = seqs[lead].hi, n_tok = seqs[lead].n_tok;
    int64_t own_blocks = (n_tok + c->block_tokens - 1) / c->block_tokens;
    seqs[lead].group = id;
    for (int64_t i = lead + 1; i < n_seq; i++) {
        if (seqs[i].group >= 0) continue;
        int64_t k = common_keys(c, seqs[lead].row, seqs[i].row, EMBER_MAX(hi, seqs[i].hi));
        if (k < ATTN_MIN_SHARED_KEYS) continue;
        seqs[i].group = id;
        keys = EMBER_MIN(keys, k);
        lo = EMBER_MIN(lo, seqs[i].lo);
        hi = EMBER_MAX(hi, seqs[i].hi);
        n_tok += seqs[i].n_tok;
        own_blocks += (seqs[i].n_tok + c->block_tokens - 1) / c->block_tokens;
    }
    keys = EMBER_MIN(keys, hi);
    int worth = keys != INT64_MAX && keys - lo >= ATTN_MIN_SHARED_KEYS &&
                own_blocks > (n_tok + c->block_tokens - 1) / c->block_tokens;
    if (!worth)
        for (int64_t i = lead; i < n_seq; i++)
            if (seqs[i].group == id) seqs[i].group = -2; /* read per sequence */
    return worth ? keys : 0;
}

/* Fills sh with the groups of sequences whose tables begin with the same pages; 0 when there are none
 * (or the call is too large for sh). */
static int find_shared(const attn_ctx *c, attn_shared *sh) {
    if (c->n_tok > ATTN_SHARED_TOKENS || c->n_tok * c->n_head > ATTN_SHARED_ROWS) return 0;
    attn_seq seqs[ATTN_SHARED_TOKENS];
    int32_t tok_index[ATTN_SHARED_TOKENS];
    int64_t group_keys[ATTN_SHARED_TOKENS];
    int64_t n_seq = list_sequences(c, seqs, tok_index);
    int32_t n_group = 0;
    for (int64_t i = 0; i < n_seq; i++) {
        if (seqs[i].group != -1) continue;
        int64_t keys = form_group(c, seqs, n_seq, i, n_group);
        if (keys > 0) group_keys[n_group++] = keys;
    }
    sh->n_list = 0;
    for (int64_t t = 0; t < c->n_tok; t++) {
        int32_t g = seqs[tok_index[t]].group;
        sh->keys[t] = g >= 0 ? (int32_t)group_keys[g] : 0;
    }
    for (int32_t g = 0; g < n_group; g++)
        for (int64_t t = 0; t < c->n_tok; t++)
            if (seqs[tok_index[t]].group == g) {
                sh->list[sh->n_list] = (int32_t)t;
                sh->list_group[sh->n_list++] = g;
            }
    return n_group > 0;
}

void ember_attention(ember_pool *pool, const float *q, const void *k_cache, const void *v_cache, float *out,
                     int64_t n_tok, int64_t n_head, int64_t n_kv_head, int64_t hd_k, int64_t hd_v,
                     const int32_t *tok_pos, const int32_t *tok_seq, const int32_t *block_tables, int64_t max_pages,
                     int64_t page_size, int64_t window, float scale, float softcap, int k_type, int v_type,
                     const float *sinks, int64_t parts) {
    if (n_tok <= 0 || n_head <= 0 || n_kv_head <= 0 || hd_k <= 0 || hd_v <= 0 || page_size <= 0) return;
    if (parts < 1 || n_kv_head % parts) return;
    if (n_head % n_kv_head != 0 || EMBER_MAX(hd_k, hd_v) > ATTN_CHUNK_FLOATS) return; /* outside the contract */
    int64_t k_head = ember_kv_bytes(k_type, hd_k), v_head = ember_kv_bytes(v_type, hd_v);
    if (k_head < 0 || v_head < 0) return;
    attn_ctx c = {
        .q = q, .k_cache = k_cache, .v_cache = v_cache, .out = out, .tok_pos = tok_pos, .tok_seq = tok_seq,
        .block_tables = block_tables, .n_tok = n_tok, .n_head = n_head, .n_kv_head = n_kv_head, .hd_k = hd_k,
        .hd_v = hd_v, .max_pages = max_pages, .page_size = page_size, .window = window, .k_type = k_type,
        .v_type = v_type, .k_head = k_head, .v_head = v_head, .parts = parts, .scale = scale, .softcap = softcap,
        .sinks = sinks,
        .kern = kernels(),
    };
    c.group = n_head / n_kv_head;
    int64_t widest = EMBER_MAX(hd_k, hd_v), max_rows = EMBER_MAX(1, EMBER_MIN(ATTN_MAX_ROWS, ATTN_ROW_FLOATS / widest));
    c.item_heads = EMBER_MIN(c.group, max_rows);
    c.n_hsub = (c.group + c.item_heads - 1) / c.item_heads;
    c.block_tokens = EMBER_MAX(1, max_rows / c.item_heads);
    int64_t n_chunk = EMBER_MIN(ATTN_MAX_CHUNK, ATTN_CHUNK_FLOATS / widest);
    c.n_chunk = n_chunk >= 16 ? n_chunk & ~(int64_t)15 : EMBER_MAX(1, n_chunk);
    atomic_init(&c.next_item, 0);
    int nth = ember_pool_threads(pool);
    float partial[ATTN_PARTIAL_FLOATS]; /* (items, piece_floats) of a pass that splits key ranges */
    attn_shared shared;
    if (find_shared(&c, &shared)) {
        c.shared = &shared;
        c.first_pass = 1;
        c.n_entry = shared.n_list;
        attention_pass(pool, &c, nth, partial);
    }
    c.first_pass = 0;
    c.n_entry = n_tok;
    attention_pass(pool, &c, nth, partial);
}
