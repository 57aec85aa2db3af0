// The KV cache in a storage type other than f16: BF16, Q8_0 or Q4_0 (ggml's block layouts, type
// ids as ggml's). Rows are bytes: a cache row is one token's keys (or values) of every kv head, a
// head's part starting on a block boundary (head sizes are multiples of 32 for the block types).
// kv_store_q quantizes as ggml's reference quantizers round; attn_q reads the rows in place.

#define KV_F16 1
#define KV_Q4_0 2
#define KV_Q8_0 8
#define KV_BF16 30
#define ATTQ_MAX_D 512  // head sizes attn_q takes (16 values a lane)

// Bytes of n values of type t (n whole blocks for the block types).
__device__ __forceinline__ i64 kv_bytes(int t, i64 n) {
    return t == KV_Q8_0 ? n / 32 * 34 : t == KV_Q4_0 ? n / 32 * 18 : 2 * n;
}

// Value i of a row of type t.
__device__ __forceinline__ float kv_value(const u8 *row, int t, int i) {
    if (t == KV_F16) return h2f(((const u16 *)row)[i]);
    if (t == KV_BF16) return bf2f(((const u16 *)row)[i]);
    const int b = i >> 5, l = i & 31;
    if (t == KV_Q8_0) {
        const u8 *blk = row + (size_t)b * 34;
        return h2f(*(const u16 *)blk) * (float)((const i8 *)(blk + 2))[l];
    }
    const u8 *blk = row + (size_t)b * 18;  // Q4_0
    const u8 q = blk[2 + (l & 15)];
    return h2f(*(const u16 *)blk) * (float)((l < 16 ? (q & 15) : (q >> 4)) - 8);
}

__device__ __forceinline__ u16 bf16_rne(float f) {
    const u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40u);  // NaN stays quiet
    return (u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// One 32-value block of x, held one value a lane by a whole warp, written as type t at dst.
__device__ __forceinline__ void kv_block_store(float x, int t, u8 *dst) {
    const int lane = threadIdx.x & 31;
    if (t == KV_Q8_0) {
        const float d = warp_max(fabsf(x)) / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        if (lane == 0) *(u16 *)dst = f2h(d);
        ((i8 *)(dst + 2))[lane] = (i8)roundf(__fmul_rn(x, id));
        return;
    }
    // Q4_0: the value of largest magnitude (the first among equals, as ggml's loop keeps) maps to -8
    float amax = fabsf(x), mx = x;
    int at = lane;
    for (int o = 16; o > 0; o >>= 1) {
        const float a = __shfl_xor_sync(FULL_MASK, amax, o), m = __shfl_xor_sync(FULL_MASK, mx, o);
        const int i = __shfl_xor_sync(FULL_MASK, at, o);
        if (a > amax || (a == amax && i < at)) amax = a, mx = m, at = i;
    }
    const float d = mx / -8.f, id = d != 0.f ? 1.f / d : 0.f;
    const int q = min(15, (int)(i8)__fadd_rn(__fmul_rn(x, id), 8.5f));  // no fused multiply-add: ggml's rounding
    const int hi = __shfl_down_sync(FULL_MASK, q, 16);
    if (lane == 0) *(u16 *)dst = f2h(d);
    if (lane < 16) dst[2 + lane] = (u8)(q | (hi << 4));
}

// Row of n values (f32) stored as type t at dst, by the block's warps.
__device__ __forceinline__ void kv_row_store(const float *x, int t, u8 *dst, int n) {
    if (t == KV_F16 || t == KV_BF16) {
        for (int c = threadIdx.x; c < n; c += blockDim.x)
            ((u16 *)dst)[c] = t == KV_F16 ? f2h(x[c]) : bf16_rne(x[c]);
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const i64 blk_bytes = t == KV_Q8_0 ? 34 : 18;
    for (int b = warp; b < n / 32; b += n_warps) kv_block_store(x[32 * b + lane], t, dst + b * blk_bytes);
}

// k_cache row slots[t] = k[t] as k_type (k_dim values), v likewise; one block per token, blockDim a
// multiple of 32. k (n, k_dim), v (n, v_dim) f32; caches (n_slots, row bytes) u8.
extern "C" __global__ void kv_store_q(const float *k, const float *v, u8 *k_cache, u8 *v_cache, const i64 *slots,
                                      int k_dim, int v_dim, int k_type, int v_type) {
    PDL_ENTER();
    const int t = blockIdx.x;
    const i64 slot = slots[t];
    kv_row_store(k + (size_t)t * k_dim, k_type, k_cache + slot * kv_bytes(k_type, k_dim), k_dim);
    kv_row_store(v + (size_t)t * v_dim, v_type, v_cache + slot * kv_bytes(v_type, v_dim), v_dim);
}

// Causal attention over caches of types k_type and v_type (see attention.cu for the batch layout:
// token t of sequence row seq_rows[t] at position pos[t] attends to positions
// max(0, pos - window + 1) .. pos, read through its page table). One block per (token, query head),
// 4 warps: warp w takes keys w, w + 4, ..., a lane dims lane, lane + 32, ... with an online softmax
// of its own; the warps' results are merged at the end.
// q (n, n_head, hd_k) f32, out (n, n_head, hd_v) f32; hd_k, hd_v <= ATTQ_MAX_D.
extern "C" __global__ void attn_q(const float *q, const u8 *k_cache, const u8 *v_cache, float *out, const int *pos,
                                  const int *seq_rows, const int *tables, int max_pages, int page_size, int n_head,
                                  int n_kv, int hd_k, int hd_v, int window, float scale, float softcap, int k_type,
                                  int v_type, const float *sinks) {
    PDL_ENTER();
    __shared__ float wm[4], wl[4], wacc[4][ATTQ_MAX_D];
    const int t = blockIdx.x, h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = h / (n_head / n_kv), p = pos[t];
    const int lo = window > 0 ? max(0, p - window + 1) : 0;
    const int *table = tables + (size_t)seq_rows[t] * max_pages;
    const i64 k_row = kv_bytes(k_type, (i64)n_kv * hd_k), v_row = kv_bytes(v_type, (i64)n_kv * hd_v);
    const i64 k_head = kv_bytes(k_type, hd_k) * g, v_head = kv_bytes(v_type, hd_v) * g;
    float qr[ATTQ_MAX_D / 32], acc[ATTQ_MAX_D / 32];
    const float *qh = q + ((size_t)t * n_head + h) * hd_k;
    for (int i = 0; i < ATTQ_MAX_D / 32; i++) {
        const int c = lane + 32 * i;
        qr[i] = c < hd_k ? qh[c] * scale : 0.f;
        acc[i] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    for (int j = lo + warp; j <= p; j += 4) {
        const i64 slot = (i64)table[j / page_size] * page_size + j % page_size;
        const u8 *kr = k_cache + slot * k_row + k_head, *vr = v_cache + slot * v_row + v_head;
        float s = 0.f;
        for (int i = 0; i < ATTQ_MAX_D / 32 && lane + 32 * i < hd_k; i++) s += qr[i] * kv_value(kr, k_type, lane + 32 * i);
        s = warp_sum(s);
        if (softcap > 0.f) s = softcap * tanhf(s / softcap);
        const float m_new = fmaxf(m, s), corr = expf(m - m_new), w = expf(s - m_new);
        l = l * corr + w;
        for (int i = 0; i < ATTQ_MAX_D / 32 && lane + 32 * i < hd_v; i++)
            acc[i] = acc[i] * corr + w * kv_value(vr, v_type, lane + 32 * i);
        m = m_new;
    }
    if (lane == 0) wm[warp] = m, wl[warp] = l;
    for (int i = 0; i < ATTQ_MAX_D / 32 && lane + 32 * i < hd_v; i++) wacc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    float m_all = NEG_INF;
    for (int w = 0; w < 4; w++) m_all = fmaxf(m_all, wm[w]);
    float total = 0.f;
    for (int w = 0; w < 4; w++) total += wl[w] > 0.f ? wl[w] * expf(wm[w] - m_all) : 0.f;
    if (sinks) total += expf(sinks[h] - m_all);  // attention sinks (gpt-oss): a logit with no value
    float *o = out + ((size_t)t * n_head + h) * hd_v;
    for (int c = threadIdx.x; c < hd_v; c += blockDim.x) {
        float sum = 0.f;
        for (int w = 0; w < 4; w++)
            if (wl[w] > 0.f) sum += wacc[w][c] * expf(wm[w] - m_all);
        o[c] = total > 0.f ? sum / total : 0.f;
    }
}

// out (n, d) = x rotated in blocks of `block` values (a power of two, 2..1024, dividing d): each block
// times the orthonormal Walsh-Hadamard matrix (see the CPU's ember_hadamard). One thread block per
// (row, block of values), `block` threads; out may be x.
extern "C" __global__ void hadamard(const float *x, float *out, int d, int block) {
    PDL_ENTER();
    __shared__ float s[1024];
    const size_t at = (size_t)blockIdx.x * d + (size_t)blockIdx.y * block;
    const int i = threadIdx.x;
    s[i] = x[at + i];
    __syncthreads();
    for (int h = 1; h < block; h *= 2) {
        const float a = s[i], b = s[i ^ h];
        __syncthreads();
        s[i] = (i & h) ? b - a : a + b;
        __syncthreads();
    }
    out[at + i] = s[i] * rsqrtf((float)block);
}
