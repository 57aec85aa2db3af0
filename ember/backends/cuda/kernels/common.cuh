// Shared definitions of ember's CUDA kernels. Compiled at run time (NVRTC, or hipRTC under
// ROCm), so no header is included: integer types, f16 conversions and reductions are here.
// Activations are row-major f32; "(a, b)" shapes list the slowest dimension first.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;

#define FULL_MASK 0xffffffffu

// DEVI: device helpers. EMBER_HOST_TEST builds the block decoders as host code instead, with
// software versions of the few intrinsics they use (bench/cuda_decode_check.py compares them
// with the numpy references without a GPU).
#ifdef EMBER_HOST_TEST
#include <cstring>
#define DEVI static inline
#ifndef __CUDACC__  // plain C++ (g++): the CUDA vector types the decoders load through
struct uint2 { u32 x, y; };
struct uint4 { u32 x, y, z, w; };
#endif
static inline float as_float(u32 u) { float f; memcpy(&f, &u, 4); return f; }
static inline u32 fshr(u32 lo, u32 hi, u32 s) { return (u32)((((unsigned long long)hi << 32) | lo) >> (s & 31)); }
static inline u32 bperm(u32 x, u32 y, u32 s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    u32 r = 0;
    for (int n = 0; n < 4; n++) r |= (u32)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
    return r;
}
static inline float h2f(u16 h) {
    const u32 sign = (u32)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023;
    if (e == 31) return as_float(sign | 0x7F800000u | (m << 13));
    if (e == 0) return (sign ? -1.f : 1.f) * (float)m * 5.9604644775390625e-8f;  // 2^-24
    return as_float(sign | ((e + 112) << 23) | (m << 13));
}
#else
#define DEVI __device__ __forceinline__
DEVI float as_float(u32 u) { return __uint_as_float(u); }
DEVI u32 fshr(u32 lo, u32 hi, u32 s) { return __funnelshift_r(lo, hi, s); }
DEVI u32 bperm(u32 x, u32 y, u32 s) { return __byte_perm(x, y, s); }

// ---- half precision (stored as raw u16 bits) ----
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
DEVI float h2f(u16 h) { return (float)__builtin_bit_cast(_Float16, h); }
DEVI u16 f2h(float f) { return __builtin_bit_cast(u16, (_Float16)f); }
#else
DEVI float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
DEVI u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif
// Two f32 -> one word of two f16 (low half = a).
DEVI u32 pack_h2(float a, float b) { return (u32)f2h(a) | ((u32)f2h(b) << 16); }

// ---- integer dot product of four int8 lanes ----
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
DEVI int dp4a(int a, int b, int c) {
    for (int j = 0; j < 4; j++) c += (int)(i8)(a >> (8 * j)) * (int)(i8)(b >> (8 * j));
    return c;
}
#else
DEVI int dp4a(int a, int b, int c) { return __dp4a(a, b, c); }
#endif
#endif  // EMBER_HOST_TEST

DEVI float bf2f(u16 b) { return as_float(((u32)b) << 16); }

// ---- unaligned little-endian loads from GGUF blocks (many block sizes are not multiples of 4) ----
DEVI u32 ld_u32_a4(const u8 *p) { return *(const u32 *)p; }
DEVI float ld_f16(const u8 *p) { return h2f(*(const u16 *)p); }

#ifndef EMBER_HOST_TEST
#define NEG_INF __int_as_float(0xff800000)

// ---- reductions ----
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ float amax4(float4 v) {
    return fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
}
// The f16 copy of an activation row whose largest magnitude is m: scaled by the power of two that
// brings m to 2^15 where it would overflow f16, else (and for inf / nan) by 1. Exact to undo.
__device__ __forceinline__ float f16_row_scale(float m) {
    return m > 32768.f && m <= 3.0e38f ? exp2f(-ceilf(log2f(m / 32768.f))) : 1.f;
}
// Sum over aligned groups of `width` lanes (width a power of two <= 32).
__device__ __forceinline__ float group_sum(float v, int width) {
    for (int o = width >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Sum of v over the whole block; red: caller's shared scratch of >= 32 floats. All threads get it.
__device__ __forceinline__ float block_sum(float v, float *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();  // red may still be read from a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < n_warps; w++) s += red[w];
    return s;
}

// Quantize one 32-value block held one value per lane (all 32 lanes of the warp take part;
// idx = block start + lane): int8 values q = round(v / d), d = max|v| / 127, written to
// xq[idx]; lane 0 writes meta[idx / 32] = (d, d * sum(q[0..15]), d * sum(q[16..31]), 0).
// This is the activation format every decode product reads (see matmul.cu).
__device__ __forceinline__ void q8_store_warp(float v, size_t idx, u8 *__restrict__ xq, float4 *__restrict__ meta) {
    const float amax = warp_max(fabsf(v));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const int q = __float2int_rn(v * id);
    int s = q;
    for (int o = 8; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);  // sums over each half of 16
    const int s_hi = __shfl_sync(FULL_MASK, s, 16);
    xq[idx] = (u8)(q & 0xFF);
    if ((threadIdx.x & 31) == 0) meta[idx >> 5] = make_float4(d, d * (float)s, d * (float)s_hi, 0.f);
}

// q8_store_warp's format for a 32-value block held by 16 lanes, two values each (the block of
// the group of 16 aligned lanes; idx = the lane's first value, even): the same values, scales and
// sums. Every lane of the warp takes part; a group of 16 with store false writes nothing.
__device__ __forceinline__ void q8_store_pair(float2 v, size_t idx, u8 *__restrict__ xq, float4 *__restrict__ meta,
                                              bool store) {
    float amax = fmaxf(fabsf(v.x), fabsf(v.y));
    for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const int q0 = __float2int_rn(v.x * id), q1 = __float2int_rn(v.y * id);
    int s = q0 + q1;
    for (int o = 4; o > 0; o >>= 1) s += __shfl_xor_sync(FULL_MASK, s, o);  // each half of 16 values: eight lanes
    const int s_hi = __shfl_xor_sync(FULL_MASK, s, 8);
    if (!store) return;
    *(u16 *)(xq + idx) = (u16)((q0 & 0xFF) | (q1 & 0xFF) << 8);
    if ((threadIdx.x & 15) == 0) meta[idx >> 5] = make_float4(d, d * (float)s, d * (float)s_hi, 0.f);
}

// ---- programmatic dependent launch (Hopper and later; see _launch.py) ----
// Inside a captured step every kernel may be launched while the one before it still runs. It
// first lets its own successor launch (pdl_launch_next), may then read constant data (weights,
// and the step's inputs: the copies at a captured step's start write them before its first kernel
// runs) and prefetch into L2, and waits (pdl_wait) for everything earlier kernels wrote before it
// reads or writes any activation. L2 is the point of coherence, so a prefetch can never make a later
// load stale. Launched the ordinary way (eager runs, ROCm, older GPUs) all three do nothing.
__device__ __forceinline__ void pdl_launch_next() {
#if !defined(__HIPCC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if !defined(__HIPCC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// ---- thread-block clusters (Hopper and later, CUDA only; see attention.cu's cluster_merge) ----
#if !defined(__HIPCC__) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define CLUSTERS_OK 1
#else
#define CLUSTERS_OK 0
#endif
// Every thread of every block of the cluster arrives: shared-memory writes before it are seen by
// the cluster's reads after it. Without clusters: nothing (no kernel of that build uses one).
__device__ __forceinline__ void cluster_sync() {
#if CLUSTERS_OK
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
// The float at p in the shared memory of the cluster's block `rank` (p: this block's address of it).
__device__ __forceinline__ float ld_cluster(const float *p, int rank) {
#if CLUSTERS_OK
    unsigned a = (unsigned)__cvta_generic_to_shared(p), r;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(r) : "memory");
    return v;
#else
    return *p;
#endif
}
__device__ __forceinline__ void prefetch_l2(const void *p) {
#if !defined(__HIPCC__) && defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#endif
}
// The bytes [p, p + n) into L2, lines lane, lane + lanes, ... of 128 bytes.
__device__ __forceinline__ void prefetch_range_l2(const void *p, long long n, int lane, int lanes) {
    const unsigned long long a = (unsigned long long)p, end = a + (unsigned long long)n;
    for (unsigned long long l = (a & ~127ull) + 128ull * (unsigned long long)lane; l < end;
         l += 128ull * (unsigned long long)lanes)
        prefetch_l2((const void *)l);
}
// Loads of what other blocks of the same launch wrote (after a counter says they did): from L2,
// never from this multiprocessor's L1.
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
__device__ __forceinline__ float ld_l2(const float *p) { return *(const volatile float *)p; }
__device__ __forceinline__ int ld_l2(const int *p) { return *(const volatile int *)p; }
__device__ __forceinline__ float2 ld_l2(const float2 *p) {
    const volatile float *q = (const volatile float *)p;
    return make_float2(q[0], q[1]);
}
#else
__device__ __forceinline__ float ld_l2(const float *p) { return __ldcg(p); }
__device__ __forceinline__ int ld_l2(const int *p) { return __ldcg(p); }
__device__ __forceinline__ float2 ld_l2(const float2 *p) { return __ldcg(p); }
#endif

// First statement of a kernel that reads or writes activations from its first instruction on.
#define PDL_ENTER() (pdl_launch_next(), pdl_wait())

__device__ __forceinline__ float silu_f(float g) { return g / (1.f + expf(-g)); }
__device__ __forceinline__ float gelu_tanh_f(float g) {
    const float c = 0.7978845608028654f;  // sqrt(2 / pi)
    return 0.5f * g * (1.f + tanhf(c * (g + 0.044715f * g * g * g)));
}

// Gated activations of a feed-forward: act(gate) * up. ACT_OAI is gpt-oss's clamped form:
// g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + 1), g = min(gate, limit). The elementwise
// kernels and quant_x_llama (which rounds the activation for the down products) share this one
// definition, so the two paths give the same bits. Codes as ops/experts.py ACT_CODES.
#define ACT_NONE 0
#define ACT_SILU 1
#define ACT_GELU 2
#define ACT_OAI 3
__device__ __forceinline__ float gated_act(int act, float g, float u, float alpha, float limit) {
    if (act == ACT_SILU) return silu_f(g) * u;
    if (act == ACT_GELU) return gelu_tanh_f(g) * u;
    const float gc = fminf(g, limit), uc = fminf(fmaxf(u, -limit), limit);
    return gc / (1.f + expf(-alpha * gc)) * (uc + 1.f);
}

// ---- attention inputs: per-head RMS norms and rotary embedding ----
// Used by ops.cu (rope, qkv_post) and by attention.cu's attn, which does qkv_post's work itself
// in decode steps.

// row (d,) = row / sqrt(mean(row^2) + eps) * w (d,), by one whole warp; values loaded eight at a
// time per lane before any is stored (row is read and written).
__device__ __forceinline__ void warp_rms_norm(float *row, const float *w, int d, float eps) {
    const int lane = threadIdx.x & 31;
    float ss = 0.f;
    for (int c = lane; c < d; c += 32) ss += row[c] * row[c];
    const float sc = rsqrtf(warp_sum(ss) / (float)d + eps);
    for (int c0 = lane; c0 < d; c0 += 8 * 32) {
        float vals[8], wv[8];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int c = c0 + 32 * i;
            vals[i] = c < d ? row[c] : 0.f;
            wv[i] = c < d ? w[c] : 0.f;
        }
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (c0 + 32 * i < d) row[c0 + 32 * i] = vals[i] * sc * wv[i];
    }
}

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

// Rotate pair i of every head of one token's row x (n_head, head_dim), global or shared, by the
// whole block. Loads go out ROPE_BATCH pairs at a time before any store (x is read and written:
// the compiler would not hoist them).
#define ROPE_BATCH 4
__device__ __forceinline__ void rope_rotate(float *x, int n_head, int head_dim, const RopeP &p, const float *cs,
                                            const float *sn) {
    const int half = p.n_rot / 2, total = n_head * half;
    for (int i0 = threadIdx.x; i0 < total; i0 += ROPE_BATCH * blockDim.x) {
        float a[ROPE_BATCH], b[ROPE_BATCH];
        int at_a[ROPE_BATCH], at_b[ROPE_BATCH], pair[ROPE_BATCH];
#pragma unroll
        for (int r = 0; r < ROPE_BATCH; r++) {
            const int idx = min(i0 + r * (int)blockDim.x, total - 1);
            const int h = idx / half, i = idx % half;
            pair[r] = i;
            at_a[r] = h * head_dim + (p.neox ? i : 2 * i);
            at_b[r] = h * head_dim + (p.neox ? i + half : 2 * i + 1);
            a[r] = x[at_a[r]];
            b[r] = x[at_b[r]];
        }
#pragma unroll
        for (int r = 0; r < ROPE_BATCH; r++) {
            if (i0 + r * (int)blockDim.x >= total) break;
            const int i = pair[r];
            x[at_a[r]] = a[r] * cs[i] - b[r] * sn[i];
            x[at_b[r]] = a[r] * sn[i] + b[r] * cs[i];
        }
    }
}

// ---- tensor cores ----
// c (16x8 f32) += a (16x16 f16, row-major fragments) * b (16x8 f16, column-major): mma.sync
// m16n8k16 (compute capability 8.0+). Fragments: a0 = A[g][2q..2q+1], a1 = A[g+8][2q..], a2 =
// A[g][2q+8..], a3 = A[g+8][2q+8..]; b0 = B[2q..2q+1][g], b1 = B[2q+8..][g]; c0, c1 = C[g][2q..],
// c2, c3 = C[g+8][2q..] (lane = 4g + q; low halves hold the lower column or row).
__device__ __forceinline__ void mma_16816(float *c, const u32 *a, u32 b0, u32 b1) {
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
    // not reached: HIP builds take the kernels' scalar paths (matmul.cu) or other kernels
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// ---- asynchronous copies global -> shared (compute capability 8.0+, CUDA only) ----
#if !defined(__HIP_PLATFORM_AMD__) && !defined(__HIPCC__)
// 16 bytes at src into dst; bytes past src_bytes (0..16) are filled with zeros.
__device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
    const u32 s = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif

#define ROPE_PARAMS                                                                                       \
    int n_rot, int neox, float base, float freq_scale, float ext_factor, float mscale, float corr_low, \
        float corr_high, const float *freq_factors
#define ROPE_ARGS {n_rot, neox, base, freq_scale, ext_factor, mscale, corr_low, corr_high, freq_factors}
#endif  // EMBER_HOST_TEST
