// Norms, rotary embedding, elementwise ops, KV-cache writes, and their fused forms.
// Row-major f32 activations; KV cache rows are f16 bits.

// x (rows, d) -> out (rows, d) = x / sqrt(mean(x^2) + eps) * w;  w (d,) or null. One warp per row;
// out may alias x (each warp reads its whole row before writing it).
extern "C" __global__ void rms_norm(const float *x, const float *w, float *out, int rows, int d, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float *xr = x + (size_t)row * d;
    float ss = 0.f;
    for (int c = lane; c < d; c += 32) ss += xr[c] * xr[c];
    const float scale = rsqrtf(warp_sum(ss) / (float)d + eps);
    float *o = out + (size_t)row * d;
    for (int c = lane; c < d; c += 32) o[c] = xr[c] * scale * (w ? w[c] : 1.f);
}

// Fused: h (rows, d) = rms_norm(h) * w, then x (rows, d) += h. One warp per row.
extern "C" __global__ void norm_add(float *h, const float *w, float *x, int rows, int d, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    float *hr = h + (size_t)row * d, *xr = x + (size_t)row * d;
    float ss = 0.f;
    for (int c = lane; c < d; c += 32) ss += hr[c] * hr[c];
    const float scale = rsqrtf(warp_sum(ss) / (float)d + eps);
    for (int c = lane; c < d; c += 32) {
        const float v = hr[c] * scale * w[c];
        hr[c] = v;
        xr[c] += v;
    }
}

// out (n,) = silu(gate) * up
extern "C" __global__ void silu_mul(const float *gate, const float *up, float *out, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = silu_f(gate[i]) * up[i];
}

// out (n,) = gelu_tanh(gate) * up
extern "C" __global__ void gelu_mul(const float *gate, const float *up, float *out, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gelu_tanh_f(gate[i]) * up[i];
}

// out (n,) = a + b   (out may alias a or b)
extern "C" __global__ void add(const float *a, const float *b, float *out, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

// x (n,) *= s
extern "C" __global__ void scale(float *x, float s, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// x (rows, d) += b (d,)
extern "C" __global__ void add_row(float *x, const float *b, int rows, int d) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (i64)rows * d) x[i] += b[i % d];
}

// out (n, d) = x[idx[r]] for r < n
extern "C" __global__ void gather_rows(const float *x, const int *idx, float *out, int n, int d) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)n * d) return;
    const int r = (int)(i / d), c = (int)(i % d);
    out[i] = x[(size_t)idx[r] * d + c];
}

// k_cache[slots[t]] = f16(k[t]) (k_dim values), v_cache likewise; one block per token.
// k (n, k_dim), v (n, v_dim) f32; caches (n_slots, dim) f16.
extern "C" __global__ void kv_store(const float *k, const float *v, u16 *k_cache, u16 *v_cache,
                                    const i64 *slots, int k_dim, int v_dim) {
    const int t = blockIdx.x;
    const i64 slot = slots[t];
    for (int c = threadIdx.x; c < k_dim; c += blockDim.x) k_cache[slot * k_dim + c] = f2h(k[(size_t)t * k_dim + c]);
    for (int c = threadIdx.x; c < v_dim; c += blockDim.x) v_cache[slot * v_dim + c] = f2h(v[(size_t)t * v_dim + c]);
}

// ---- rotary embedding ----

struct RopeP {
    int n_rot, neox;
    float base, freq_scale, ext_factor, mscale, corr_low, corr_high;
    const float *freq_factors;  // (n_rot/2,) or null
};

// cos and sin of pair i at position pos (ggml's YaRN / linear scaling), formed in double.
__device__ void rope_cos_sin(const RopeP &p, int pos, int i, float &c, float &s) {
    const double inv = pow((double)p.base, -2.0 * (double)i / (double)p.n_rot);
    double extrap = (double)pos * inv;
    if (p.freq_factors) extrap /= (double)p.freq_factors[i];
    const double interp = (double)p.freq_scale * extrap;
    double theta = interp;
    if (p.ext_factor != 0.f) {
        const double y = ((double)i - (double)p.corr_low) / fmax(0.001, (double)p.corr_high - (double)p.corr_low);
        const double mix = (1.0 - fmin(1.0, fmax(0.0, y))) * (double)p.ext_factor;
        theta = interp * (1.0 - mix) + extrap * mix;
    }
    double sn, cs;
    sincos(theta, &sn, &cs);
    c = (float)(cs * (double)p.mscale);
    s = (float)(sn * (double)p.mscale);
}

// Rotate pair i of every head of one token's row x (n_head, head_dim).
__device__ __forceinline__ void rope_rotate(float *x, int n_head, int head_dim, const RopeP &p, const float *cs,
                                            const float *sn) {
    const int half = p.n_rot / 2;
    for (int idx = threadIdx.x; idx < n_head * half; idx += blockDim.x) {
        const int h = idx / half, i = idx % half;
        float *xh = x + (size_t)h * head_dim;
        const int ia = p.neox ? i : 2 * i, ib = p.neox ? i + half : 2 * i + 1;
        const float a = xh[ia], b = xh[ib];
        xh[ia] = a * cs[i] - b * sn[i];
        xh[ib] = a * sn[i] + b * cs[i];
    }
}

#define ROPE_PARAMS                                                                                       \
    int n_rot, int neox, float base, float freq_scale, float ext_factor, float mscale, float corr_low, \
        float corr_high, const float *freq_factors
#define ROPE_ARGS {n_rot, neox, base, freq_scale, ext_factor, mscale, corr_low, corr_high, freq_factors}

// x (n_tok, n_head, head_dim) rotated in place at pos (n_tok,); one block per token, n_rot <= 512.
extern "C" __global__ void rope(float *x, const int *pos, int n_head, int head_dim, ROPE_PARAMS) {
    __shared__ float cs[256], sn[256];
    const RopeP p = ROPE_ARGS;
    const int t = blockIdx.x;
    for (int i = threadIdx.x; i < n_rot / 2; i += blockDim.x) rope_cos_sin(p, pos[t], i, cs[i], sn[i]);
    __syncthreads();
    rope_rotate(x + (size_t)t * n_head * head_dim, n_head, head_dim, p, cs, sn);
}

// Fused attention input stage, one block per token: optional per-head RMS norms of q and k
// (weights (head_dim,)), rotary embedding of q and k, then k and v written to the KV cache.
// q (n, n_head, hd), k (n, n_kv, hd), v (n, v_dim); caches (n_slots, n_kv * hd) / (n_slots, v_dim).
extern "C" __global__ void qkv_post(float *q, float *k, const float *v, const float *q_norm, const float *k_norm,
                                    float eps, const int *pos, ROPE_PARAMS, int n_head, int n_kv, int hd, int v_dim,
                                    u16 *k_cache, u16 *v_cache, const i64 *slots) {
    __shared__ float cs[256], sn[256];
    const RopeP p = ROPE_ARGS;
    const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    float *qt = q + (size_t)t * n_head * hd, *kt = k + (size_t)t * n_kv * hd;
    for (int i = threadIdx.x; i < n_rot / 2; i += blockDim.x) rope_cos_sin(p, pos[t], i, cs[i], sn[i]);
    if (q_norm) {  // one warp per head of q, then of k
        for (int h = warp; h < n_head + n_kv; h += n_warps) {
            float *row = h < n_head ? qt + (size_t)h * hd : kt + (size_t)(h - n_head) * hd;
            const float *w = h < n_head ? q_norm : k_norm;
            float ss = 0.f;
            for (int c = lane; c < hd; c += 32) ss += row[c] * row[c];
            const float sc = rsqrtf(warp_sum(ss) / (float)hd + eps);
            for (int c = lane; c < hd; c += 32) row[c] = row[c] * sc * w[c];
        }
    }
    __syncthreads();
    rope_rotate(qt, n_head, hd, p, cs, sn);
    rope_rotate(kt, n_kv, hd, p, cs, sn);
    __syncthreads();
    const i64 slot = slots[t];
    const int k_dim = n_kv * hd;
    for (int c = threadIdx.x; c < k_dim; c += blockDim.x) k_cache[slot * k_dim + c] = f2h(kt[c]);
    for (int c = threadIdx.x; c < v_dim; c += blockDim.x) v_cache[slot * v_dim + c] = f2h(v[(size_t)t * v_dim + c]);
}
