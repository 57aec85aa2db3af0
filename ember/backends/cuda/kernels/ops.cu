// Norms, rotary embedding, elementwise ops, KV-cache writes, and their fused forms.
// Row-major f32 activations; KV cache rows are f16 bits.

// Row norms, one warp per row. Their time is latency (a row is a few KB): rows of up to
// 32 * 4 * NORM_V4 values with d % 4 == 0 are loaded whole into registers with 16-byte loads, all
// issued before any is used, and written from there: one round trip to memory instead of one per
// 32 values of each pass.
// The norm weights depend on no earlier kernel: they are loaded before pdl_wait. Longer or odd
// rows take the strided loops.
#define NORM_V4 8

// Whether rows of d values go through registers: d % 4 == 0, short enough, 16-byte aligned arrays.
__device__ __forceinline__ bool norm_in_regs(int d, const void *a, const void *b, const void *c) {
    const unsigned long long bits = (unsigned long long)a | (unsigned long long)b | (unsigned long long)c;
    return (d & 3) == 0 && d <= 32 * 4 * NORM_V4 && (bits & 15) == 0;
}

// v[i] = row's float4 lane + 32 i (zero past the row's d4 float4s)
__device__ __forceinline__ void norm_load(float4 (&v)[NORM_V4], const float *row, int d4, int lane) {
    const float4 *r = (const float4 *)row;
#pragma unroll
    for (int i = 0; i < NORM_V4; i++) v[i] = lane + 32 * i < d4 ? r[lane + 32 * i] : make_float4(0.f, 0.f, 0.f, 0.f);
}

__device__ __forceinline__ float norm_sumsq(const float4 (&v)[NORM_V4]) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < NORM_V4; i++) ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
    return warp_sum(ss);
}

__device__ __forceinline__ float4 scale4(float4 a, float s, float4 w) {
    return make_float4(a.x * s * w.x, a.y * s * w.y, a.z * s * w.z, a.w * s * w.w);
}

// x (rows, d) -> out (rows, d) = x / sqrt(mean(x^2) + eps) * w;  w (d,) or null. One warp per row;
// out may alias x (each warp reads its whole row before writing it).
extern "C" __global__ void rms_norm(const float *x, const float *w, float *out, int rows, int d, float eps) {
    pdl_launch_next();
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const bool regs = norm_in_regs(d, x, w, out);
    float4 wv[NORM_V4];
    if (regs) {
        if (w) {
            norm_load(wv, w, d >> 2, lane);
        } else {
#pragma unroll
            for (int i = 0; i < NORM_V4; i++) wv[i] = make_float4(1.f, 1.f, 1.f, 1.f);
        }
    }
    pdl_wait();
    if (row >= rows) return;
    const float *xr = x + (size_t)row * d;
    float *o = out + (size_t)row * d;
    if (regs) {
        const int d4 = d >> 2;
        float4 v[NORM_V4];
        norm_load(v, xr, d4, lane);
        const float scale = rsqrtf(norm_sumsq(v) / (float)d + eps);
#pragma unroll
        for (int i = 0; i < NORM_V4; i++)
            if (lane + 32 * i < d4) ((float4 *)o)[lane + 32 * i] = scale4(v[i], scale, wv[i]);
        return;
    }
    float ss = 0.f;
    for (int c = lane; c < d; c += 32) ss += xr[c] * xr[c];
    const float scale = rsqrtf(warp_sum(ss) / (float)d + eps);
    for (int c = lane; c < d; c += 32) o[c] = xr[c] * scale * (w ? w[c] : 1.f);
}

// Fused: h (rows, d) = rms_norm(h) * w, then x (rows, d) += h. One warp per row; h and x disjoint.
extern "C" __global__ void norm_add(float *h, const float *w, float *x, int rows, int d, float eps) {
    pdl_launch_next();
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const bool regs = norm_in_regs(d, h, w, x);
    float4 wv[NORM_V4];
    if (regs) norm_load(wv, w, d >> 2, lane);
    pdl_wait();
    if (row >= rows) return;
    float *hr = h + (size_t)row * d, *xr = x + (size_t)row * d;
    if (regs) {
        const int d4 = d >> 2;
        float4 v[NORM_V4], xv[NORM_V4];
        norm_load(v, hr, d4, lane);
        norm_load(xv, xr, d4, lane);
        const float scale = rsqrtf(norm_sumsq(v) / (float)d + eps);
#pragma unroll
        for (int i = 0; i < NORM_V4; i++) {
            if (lane + 32 * i >= d4) continue;
            const float4 t = scale4(v[i], scale, wv[i]);
            ((float4 *)hr)[lane + 32 * i] = t;
            ((float4 *)xr)[lane + 32 * i] = make_float4(xv[i].x + t.x, xv[i].y + t.y, xv[i].z + t.z, xv[i].w + t.w);
        }
        return;
    }
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
    PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gated_act(ACT_SILU, gate[i], up[i], 0.f, 0.f);
}

// out (n,) = gelu_tanh(gate) * up
extern "C" __global__ void gelu_mul(const float *gate, const float *up, float *out, i64 n) {
    PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gated_act(ACT_GELU, gate[i], up[i], 0.f, 0.f);
}

// out (n,) = a + b   (out may alias a or b)
extern "C" __global__ void add(const float *a, const float *b, float *out, i64 n) {
    PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}

// x (n,) *= s
extern "C" __global__ void scale(float *x, float s, i64 n) {
    PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// x (n,) = cap * tanh(x / cap)   (logit soft-capping, cap > 0)
extern "C" __global__ void softcap(float *x, float cap, i64 n) {
    PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

// row t of x (rows, d) *= 1 + scale * log(floor((pos[t] + offset) / length) + 1)   (attention temperature)
extern "C" __global__ void pos_scale(float *x, const int *pos, int rows, int d, int length, float scale,
                                     float offset) {
    PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)rows * d) return;
    const float p = (float)pos[i / d];
    x[i] *= 1.f + scale * logf(floorf((p + offset) / (float)length) + 1.f);
}

// x (rows, d) += b (d,)
extern "C" __global__ void add_row(float *x, const float *b, int rows, int d) {
    PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (i64)rows * d) x[i] += b[i % d];
}

// out (n, d) = x[idx[r]] for r < n
extern "C" __global__ void gather_rows(const float *x, const int *idx, float *out, int n, int d) {
    PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)n * d) return;
    const int r = (int)(i / d), c = (int)(i % d);
    out[i] = x[(size_t)idx[r] * d + c];
}

// k_cache[slots[t]] = f16(k[t]) (k_dim values), v_cache likewise; one block per token.
// k (n, k_dim), v (n, v_dim) f32; caches (n_slots, dim) f16.
extern "C" __global__ void kv_store(const float *k, const float *v, u16 *k_cache, u16 *v_cache,
                                    const i64 *slots, int k_dim, int v_dim) {
    PDL_ENTER();
    const int t = blockIdx.x;
    const i64 slot = slots[t];
    for (int c = threadIdx.x; c < k_dim; c += blockDim.x) k_cache[slot * k_dim + c] = f2h(k[(size_t)t * k_dim + c]);
    for (int c = threadIdx.x; c < v_dim; c += blockDim.x) v_cache[slot * v_dim + c] = f2h(v[(size_t)t * v_dim + c]);
}

// Page copies of one layer's caches (copy on write): for each pair p, page pairs[2p + 1] of k and v
// becomes a copy of page pairs[2p]. A page of k is page * k_dim f16 values, of v page * v_dim;
// grid (chunks, n_pairs), 16-byte moves when a page's values come in eights (caches are 256-byte
// aligned, so every page then starts on 16 bytes).
extern "C" __global__ void copy_pages(u16 *k, u16 *v, const int *pairs, int page, int k_dim, int v_dim) {
    PDL_ENTER();
    const i64 src = pairs[2 * blockIdx.y], dst = pairs[2 * blockIdx.y + 1];
    const i64 nk = (i64)page * k_dim, nv = (i64)page * v_dim;
    const i64 step = (i64)gridDim.x * blockDim.x, first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (nk % 8 == 0 && nv % 8 == 0) {
        uint4 *k4 = (uint4 *)k, *v4 = (uint4 *)v;
        for (i64 i = first; i < nk / 8; i += step) k4[dst * (nk / 8) + i] = k4[src * (nk / 8) + i];
        for (i64 i = first; i < nv / 8; i += step) v4[dst * (nv / 8) + i] = v4[src * (nv / 8) + i];
    } else {
        for (i64 i = first; i < nk; i += step) k[dst * nk + i] = k[src * nk + i];
        for (i64 i = first; i < nv; i += step) v[dst * nv + i] = v[src * nv + i];
    }
}

// ---- rotary embedding (RopeP, rope_cos_sin, rope_rotate: common.cuh) ----

// x (n_tok, n_head, head_dim) rotated in place at pos (n_tok,); one block per token, n_rot <= 512.
extern "C" __global__ void rope(float *x, const int *pos, int n_head, int head_dim, ROPE_PARAMS) {
    PDL_ENTER();
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
    pdl_launch_next();
    __shared__ float cs[256], sn[256];
    const RopeP p = ROPE_ARGS;
    const int t = blockIdx.x, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    float *qt = q + (size_t)t * n_head * hd, *kt = k + (size_t)t * n_kv * hd;
    // positions are step inputs (see pdl_launch_next): the rope table is made before the wait
    for (int i = threadIdx.x; i < n_rot / 2; i += blockDim.x) rope_cos_sin(p, pos[t], i, cs[i], sn[i]);
    pdl_wait();
    if (q_norm) {  // one warp per head of q, then of k
        for (int h = warp; h < n_head + n_kv; h += n_warps)
            warp_rms_norm(h < n_head ? qt + (size_t)h * hd : kt + (size_t)(h - n_head) * hd,
                          h < n_head ? q_norm : k_norm, hd, eps);
    }
    __syncthreads();
    rope_rotate(qt, n_head, hd, p, cs, sn);
    rope_rotate(kt, n_kv, hd, p, cs, sn);
    __syncthreads();
    const i64 slot = slots[t];
    const int k_dim = n_kv * hd;
    const float *vt = v + (size_t)t * v_dim;
    for (int c0 = threadIdx.x; c0 < max(k_dim, v_dim); c0 += 4 * blockDim.x) {  // loads first, then stores
        float kv[4], vv[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int c = c0 + i * (int)blockDim.x;
            kv[i] = c < k_dim ? kt[c] : 0.f;
            vv[i] = c < v_dim ? vt[c] : 0.f;
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int c = c0 + i * (int)blockDim.x;
            if (c < k_dim) k_cache[slot * k_dim + c] = f2h(kv[i]);
            if (c < v_dim) v_cache[slot * v_dim + c] = f2h(vv[i]);
        }
    }
}

// Activations for the decode products, grid (n, chunks): row src = idx ? idx[r] : r (r =
// blockIdx.x) of x (rows, k) f32, RMS-normalised and scaled by w when w is set (eps), written as
// f32 to h (n, k) when h is set, and quantized into xq: (n, k) int8 then (n, k/32) float4 meta
// (q8_store_warp's format), when xq is set. k a multiple of 32. Each of a row's blocks sums the
// whole row's squares and writes its chunk of the 32-value blocks (a long row in one block is a
// long chain of loads); h may be x itself only with one chunk and no idx (every value is
// read before any is written). A warp quantizes 32-value blocks, loading QX_BATCH of them
// before using any (h may alias x, so the compiler could not hoist the loads itself).
#define QX_BATCH 8
extern "C" __global__ void __launch_bounds__(128)
    quant_x(const float *x, const int *idx, const float *w, float eps, float *h, u8 *xq, int n, int k) {
    PDL_ENTER();
    __shared__ float red[32];
    const int r = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, nw = blockDim.x >> 5;
    const int kb = k / 32;
    const float *xr = x + (size_t)(idx ? idx[r] : r) * k;
    float scale = 1.f;
    if (w) {
        float ss = 0.f;
        if ((k & 3) == 0 && ((size_t)xr & 15) == 0) {  // 16-byte loads, eight in flight a thread
            const float4 *x4 = (const float4 *)xr;
#pragma unroll 8
            for (int c = tid; c < k / 4; c += blockDim.x) {
                const float4 v = x4[c];
                ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
        } else {
            for (int c = tid; c < k; c += blockDim.x) ss += xr[c] * xr[c];
        }
        scale = rsqrtf(block_sum(ss, red) / (float)k + eps);
        __syncthreads();  // every thread has read its values of x before h (maybe x) is written
    }
    float4 *meta = (float4 *)(xq + (size_t)n * k);
    const int per = (kb + gridDim.y - 1) / gridDim.y, b_end = min(kb, (int)(blockIdx.y + 1) * per);
    for (int b0 = blockIdx.y * per + warp; b0 < b_end; b0 += QX_BATCH * nw) {
        float v[QX_BATCH], wv[QX_BATCH];
#pragma unroll
        for (int i = 0; i < QX_BATCH; i++) {
            const int b = b0 + i * nw;
            v[i] = b < b_end ? xr[32 * b + lane] : 0.f;
            wv[i] = b < b_end && w ? w[32 * b + lane] : 1.f;
        }
#pragma unroll
        for (int i = 0; i < QX_BATCH; i++) {
            const int b = b0 + i * nw;
            if (b >= b_end) break;  // whole warps: b depends on the warp only
            const int c = 32 * b + lane;
            float t = v[i];
            if (w) t = t * scale * wv[i];
            if (h) h[(size_t)r * k + c] = t;
            if (xq) q8_store_warp(t, (size_t)r * k + c, xq, meta);
        }
    }
}

// A lane's values j = 0..7 of quant_x_llama, at at + 32 j (0 from j = valid on): x's, or (act != ACT_NONE)
// the gated activation of gate x and up, which the caller also stores to act_out (each element read and
// written by one thread: act_out may be x or up). Every load is issued before any value is used (no
// branch between them), then the activations computed.
__device__ __forceinline__ void qxl_load8(float (&v)[8], const float *x, const float *up, size_t at, int valid,
                                          int act, float alpha, float limit) {
    float u[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const bool ok = j < valid;
        v[j] = ok ? x[at + 32 * j] : 0.f;
        u[j] = ok && act != ACT_NONE ? up[at + 32 * j] : 0.f;
    }
    if (act != ACT_NONE) {
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = j < valid ? gated_act(act, v[j], u[j], alpha, limit) : 0.f;
    }
}

// Activations of the grouped expert products rounded as llama.cpp's CPU rounds them for the
// weights' type, in quant_x's format (xq (n, k) int8, then (n, k/32) float4 (d, d * sum q[0..15],
// d * sum q[16..31], 0)): group 256 as its Q8_K (the K-quants: one scale a 256 values, the first
// value of largest magnitude m maps to -127, iscale = -127 / m, q = min(127, rint(iscale * x)),
// d = 1 / iscale), group 32 as its Q8_0 (d = max|x| / 127 rounded to f16, q = rint(x * 127 / max|x|)).
// The same rounding on both sides leaves the products differing by float sums only. Grid
// (n, ceil(k / 1024)), 128 threads: a warp 256 values (one group of 256, or eight of 32), lane l holding
// values j * 32 + l. With act (a fused GatedAct or SwigluOai) x is the gate, and act(gate) * up is what is
// rounded (and stored to act_out). quant_x_llama_block is block (r, by) of that grid (route_quant_x_llama
// runs it beside the routing).
__device__ __forceinline__ void quant_x_llama_block(int r, int by, const float *x, u8 *__restrict__ xq, int n,
                                                    int k, int group, const float *up, float *act_out, int act,
                                                    float alpha, float limit) {
    const int lane = threadIdx.x & 31;
    float4 *meta = (float4 *)(xq + (size_t)n * k);
    if (group == 32) {  // eight groups a warp: their loads in flight together, their reductions side by side
        const int b0 = (by * 4 + (threadIdx.x >> 5)) * 8, nb = k >> 5;
        if (b0 >= nb) return;
        float v[8], amax[8];
        qxl_load8(v, x, up, (size_t)r * k + 32 * b0 + lane, nb - b0, act, alpha, limit);
#pragma unroll
        for (int j = 0; j < 8; j++) amax[j] = fabsf(v[j]);
        for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int j = 0; j < 8; j++) amax[j] = fmaxf(amax[j], __shfl_xor_sync(FULL_MASK, amax[j], o));
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (b0 + j >= nb) break;  // alike in the whole warp
            const float d = h2f(f2h(amax[j] / 127.f)), mul = amax[j] > 0.f ? 127.f / amax[j] : 0.f;
            const int q = min(127, __float2int_rn(__fmul_rn(mul, v[j])));
            int s = q;
            for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);  // sums over each half of 16
            const int s_hi = __shfl_sync(FULL_MASK, s, 16);
            const size_t idx = (size_t)r * k + 32 * (b0 + j) + lane;
            xq[idx] = (u8)(q & 0xFF);
            if (act != ACT_NONE) act_out[idx] = v[j];
            if (lane == 0) meta[idx >> 5] = make_float4(d, d * (float)s, d * (float)s_hi, 0.f);
        }
        return;
    }
    const int g = by * 4 + (threadIdx.x >> 5);  // group 256: a warp a group
    if (g * group >= k) return;
    const size_t base = (size_t)r * k + (size_t)g * group;
    float v[8];
    float amax = 0.f;
    int at = 1 << 30;  // index of the first value of largest magnitude (this lane's, then the warp's)
    qxl_load8(v, x, up, base + lane, 8, act, alpha, limit);
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const float a = fabsf(v[j]);
        if (a > amax) amax = a, at = j * 32 + lane;
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float a2 = __shfl_xor_sync(FULL_MASK, amax, o);
        const int at2 = __shfl_xor_sync(FULL_MASK, at, o);
        if (a2 > amax || (a2 == amax && at2 < at)) amax = a2, at = at2;
    }
    float mine = 0.f;  // the value at `at`, from the registers of the lane that holds it
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (j == (at >> 5)) mine = v[j];
    mine = __shfl_sync(FULL_MASK, mine, at & 31);
    const float m = amax > 0.f ? mine : 0.f;
    const float mul = amax > 0.f ? -127.f / m : 0.f, d = amax > 0.f ? 1.f / mul : 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int q = min(127, __float2int_rn(__fmul_rn(mul, v[j])));
        int s = q;
        for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);  // sums over each half of 16
        const int s_hi = __shfl_sync(FULL_MASK, s, 16);
        const size_t idx = base + j * 32 + lane;
        xq[idx] = (u8)(q & 0xFF);
        if (act != ACT_NONE) act_out[idx] = v[j];
        if (lane == 0) meta[idx >> 5] = make_float4(d, d * (float)s, d * (float)s_hi, 0.f);
    }
}

extern "C" __global__ void __launch_bounds__(128)
    quant_x_llama(const float *x, u8 *__restrict__ xq, int n, int k, int group, const float *up, float *act_out,
                  int act, float alpha, float limit) {
    PDL_ENTER();
    quant_x_llama_block(blockIdx.x, blockIdx.y, x, xq, n, k, group, up, act_out, act, alpha, limit);
}

// Encoders (BERT): x (rows, d) -> out = (x - mean) / sqrt(var + eps) * w + b over each row; w, b (d,) or
// null. One warp per row, two passes (mean, then centred squares); out may alias x.
extern "C" __global__ void layer_norm(const float *x, const float *w, const float *b, float *out, int rows, int d,
                                      float eps) {
    PDL_ENTER();
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float *xr = x + (size_t)row * d;
    float *o = out + (size_t)row * d;
    float s = 0.f;
    for (int c = lane; c < d; c += 32) s += xr[c];
    const float mean = warp_sum(s) / (float)d;
    float ss = 0.f;
    for (int c = lane; c < d; c += 32) ss += (xr[c] - mean) * (xr[c] - mean);
    const float inv = rsqrtf(warp_sum(ss) / (float)d + eps);
    for (int c = lane; c < d; c += 32) o[c] = (xr[c] - mean) * inv * (w ? w[c] : 1.f) + (b ? b[c] : 0.f);
}

// out (n,) = gelu_tanh(x)   (no gate; out may alias x)
extern "C" __global__ void gelu(const float *x, float *out, i64 n) {
    PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gelu_tanh_f(x[i]);
}

// x (n,) = tanh(x)   (classification heads)
extern "C" __global__ void tanh_inplace(float *x, i64 n) {
    PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = tanhf(x[i]);
}

// ---- mixture of experts ----

// Routing, one warp per token: ids (n, k) and weights (n, k) = the k most probable experts of
// softmax(logits[t]) (n_expert <= 32 * ROUTE_PER_LANE, expert lane + 32 i held by lane), best first,
// the lower id among equal ones; the weights divided by their sum (kept from 0, as llama.cpp) when norm.
#define ROUTE_PER_LANE 8
__device__ __forceinline__ void route_token(const float *logits, int *ids, float *weights, int n, int n_expert,
                                            int k, int norm, int t) {
    const int lane = threadIdx.x & 31;
    if (t >= n) return;
    const float *z = logits + (size_t)t * n_expert;
    float p[ROUTE_PER_LANE];
    float mx = NEG_INF;
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; i++) {
        const int e = lane + 32 * i;
        p[i] = e < n_expert ? z[e] : NEG_INF;
        mx = fmaxf(mx, p[i]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; i++) {
        p[i] = lane + 32 * i < n_expert ? expf(p[i] - mx) : -1.f;  // -1: no expert (never chosen)
        sum += fmaxf(p[i], 0.f);
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < ROUTE_PER_LANE; i++) p[i] = p[i] >= 0.f ? p[i] / sum : -1.f;  // the probabilities, once
    float chosen = 0.f;
    for (int u = 0; u < k; u++) {
        float best = -1.f;
        int id = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < ROUTE_PER_LANE; i++)
            if (p[i] >= 0.f && p[i] > best) best = p[i], id = lane + 32 * i;
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(FULL_MASK, best, o);
            const int oid = __shfl_xor_sync(FULL_MASK, id, o);
            if (ob > best || (ob == best && oid < id)) best = ob, id = oid;
        }
        if (id == 0x7fffffff) best = 0.f, id = 0;  // NaN logits: no weight
        else if ((id & 31) == lane) p[id >> 5] = -1.f;  // taken
        chosen += best;
        if (lane == 0) ids[(size_t)t * k + u] = id, weights[(size_t)t * k + u] = best;
    }
    if (norm && lane == 0) {
        const float div = fmaxf(chosen, 6.103515625e-5f);
        for (int u = 0; u < k; u++) weights[(size_t)t * k + u] /= div;
    }
}

extern "C" __global__ void route_experts(const float *logits, int *ids, float *weights, int n, int n_expert, int k,
                                         int norm) {
    PDL_ENTER();
    route_token(logits, ids, weights, n, n_expert, k, norm, blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
}

// route_experts and the quant_x_llama of the expert products that read its ids, side by side in one
// launch (neither reads what the other writes): blocks 0 .. route_blocks - 1 route (a warp a token), the
// rest are quant_x_llama's grid (n_q rows x qy blocks) flattened. 128 threads, as both.
extern "C" __global__ void __launch_bounds__(128)
    route_quant_x_llama(const float *logits, int *ids, float *weights, int n, int n_expert, int k, int norm,
                        int route_blocks, const float *x, u8 *__restrict__ xq, int n_q, int kq, int group,
                        const float *up, float *act_out, int act, float alpha, float limit, int qy) {
    PDL_ENTER();
    if ((int)blockIdx.x < route_blocks) {
        route_token(logits, ids, weights, n, n_expert, k, norm, blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5));
        return;
    }
    const int b = blockIdx.x - route_blocks;
    quant_x_llama_block(b / qy, b % qy, x, xq, n_q, kq, group, up, act_out, act, alpha, limit);
}

// out (n, d) = sum over u < k of weights[t, u] * y[t * k + u]   (y (n * k, d)); where res is given, also
// res (n, d) += out (the residual add after the experts, fused)
extern "C" __global__ void expert_sum(const float *y, const float *weights, float *out, int n, int k, int d,
                                      float *res) {
    PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)n * d) return;
    const i64 t = i / d, c = i % d;
    float acc = 0.f;
    for (int u = 0; u < k; u++) acc += weights[t * k + u] * y[(t * k + u) * d + c];
    out[i] = acc;
    if (res) res[i] = res[i] + acc;
}

// MXFP4 rows as GGUF stores them (units of 17 bytes: an E8M0 scale, then 16 bytes of codes) into the
// device layout unit_q reads (quant.cuh): each run of 16 units becomes 272 bytes, their 16 scales then
// their 16 code runs, so every code run is 16-byte aligned. A row's last run of t < 16 units takes
// 16 + 16 t bytes (its unused scale bytes zero), so rows grow by at most 15 bytes and are 16-byte
// multiples (experts.py device_row_bytes). A thread a unit slot: rows of n units in, row_bytes out.
extern "C" __global__ void mxfp4_regroup(const u8 *__restrict__ src, u8 *__restrict__ dst, i64 rows, int n,
                                         i64 row_bytes) {
    const int slots = (n + 15) / 16 * 16;
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * slots) return;
    const i64 r = i / slots;
    const int u = (int)(i % slots), j = u % 16;
    u8 *g = dst + r * row_bytes + (i64)(u / 16) * 272;
    if (u >= n) {  // a slot of the last run past the row's units: its scale byte only
        g[j] = 0;
        return;
    }
    const u8 *s = src + (r * n + u) * 17;
    g[j] = s[0];
    for (int b = 0; b < 16; b++) g[16 + 16 * j + b] = s[1 + b];
}

// y (rows, d) += b[ids[s]] (b (n_expert, d)) for each row s: the chosen experts' biases
extern "C" __global__ void expert_bias(float *y, const float *b, const int *ids, int rows, int d) {
    PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (i64)rows * d) return;
    y[i] += b[(i64)ids[i / d] * d + i % d];
}

// out (n,) = g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + 1), g = min(gate, limit)   (gpt-oss)
extern "C" __global__ void swiglu_oai(const float *gate, const float *up, float *out, i64 n, float alpha,
                                      float limit) {
    PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = gated_act(ACT_OAI, gate[i], up[i], alpha, limit);
}

// The prompt products through the BLAS library take x in f16: xh (n, k) = x * s_t, s_t the row's
// f16_row_scale (as the tensor-core tiles scale their copies); inv[t] = 1 / s_t. A warp a row.
extern "C" __global__ void x_to_f16(const float *__restrict__ x, u16 *__restrict__ xh, int n, int k,
                                    float *__restrict__ inv) {
    PDL_ENTER();
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (t >= n) return;
    const float *xr = x + (size_t)t * k;
    u16 *hr = xh + (size_t)t * k;
    float m = 0.f;
    for (int c = 4 * lane; c < k; c += 128) {
        const float4 v = *(const float4 *)(xr + c);
        m = fmaxf(m, amax4(v));
    }
    const float s = f16_row_scale(warp_max(m));
    if (lane == 0) inv[t] = 1.f / s;
    for (int c = 4 * lane; c < k; c += 128) {
        const float4 v = *(const float4 *)(xr + c);
        *(uint2 *)(hr + c) = make_uint2(pack_h2(v.x * s, v.y * s), pack_h2(v.z * s, v.w * s));
    }
}

// y (n, cols): row t *= inv[t] where x_to_f16 scaled row t (the other rows' blocks return at
// once). A block a row.
extern "C" __global__ void unscale_rows(float *__restrict__ y, int n, int cols, const float *__restrict__ inv) {
    PDL_ENTER();
    const int t = blockIdx.x;
    const float s = inv[t];
    if (s == 1.f) return;
    float *yr = y + (size_t)t * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] *= s;
}
