// Matrix products with GGUF-block weights of one type QT (defined by the loader), and get_rows.
//
//   y (n, rows) = x (n, k) @ W.T      W: rows of k values, each row k/32 units of GGUF blocks
//
// mv_n{1,2,4,8}: decode (n <= 8). Memory-bound: one pass over the weights, 32-value units
//   decoded in registers. A team of T lanes (T a power of two <= 32) computes two output rows;
//   x is staged once per block in shared memory, for quantized types as int8 (per-32 scale,
//   per-16 sums) so a unit costs eight dp4a per activation row. Optional fusions, used by
//   recorded steps: an RMS norm of x before the product (prologue), and an epilogue that adds
//   the result into a residual or applies a gated activation to two matrices' rows.
// mm_tile: prefill / batched (n > 8). 64 tokens x 128 rows per block; units dequantized to
//   f16 tiles in shared memory; tensor-core mma.sync m16n8k16 with f32 accumulation.

#ifndef QT
#error "QT (the ggml type id) must be defined"
#endif

constexpr bool QFLOAT = QT == T_F32 || QT == T_F16 || QT == T_BF16;

#define MV_THREADS 128
#define MODE_STORE 0
#define MODE_RESIDUAL 1
#define MODE_SILU 2
#define MODE_GELU 3

struct MvArgs {
    const u8 *w[4];    // matrices (rows_m, row_bytes), all of type QT and k columns
    float *y[4];       // outputs (n, rows_m)
    int rows[4];
    int n_mat;
    i64 row_bytes;
    int k, n;
    const float *x;       // (n, k)
    const float *norm_w;  // (k,) or null: x is RMS-normalised and scaled by norm_w first
    float eps;
    float *h_out;         // (n, k) or null: the normalised x is also written here (block 0)
    int mode;
    float *aux;           // MODE_RESIDUAL: (n, rows_0) += y_0; gated modes: (n, rows_0) = act(y_0) * y_1
    int team_log2;
};

// Stage x (n, k) in shared memory: normalised if asked, then as int8 units (quantized types)
// or floats. Quantized layout per row j: q bytes [k], scale [k/32], scale * half-sums [k/16].
__device__ void mv_stage_x(const MvArgs &a, u8 *smem, float *red) {
    const int k = a.k, units = k / 32;
    for (int j = 0; j < a.n; j++) {
        const float *xr = a.x + (size_t)j * k;
        float scale = 1.f;
        if (a.norm_w) {
            float ss = 0.f;
            for (int c = threadIdx.x; c < k; c += blockDim.x) ss += xr[c] * xr[c];
            scale = rsqrtf(block_sum(ss, red) / (float)k + a.eps);
        }
        for (int u = threadIdx.x; u < units; u += blockDim.x) {
            float v[32];
            const float4 *p = (const float4 *)(xr + 32 * u);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                const float4 f = p[i];
                v[4 * i] = f.x, v[4 * i + 1] = f.y, v[4 * i + 2] = f.z, v[4 * i + 3] = f.w;
            }
            if (a.norm_w) {
#pragma unroll
                for (int i = 0; i < 32; i++) v[i] *= scale * a.norm_w[32 * u + i];
                if (a.h_out && blockIdx.x == 0) {
                    float4 *h = (float4 *)(a.h_out + (size_t)j * k + 32 * u);
#pragma unroll
                    for (int i = 0; i < 8; i++) h[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
                }
            }
            if constexpr (QFLOAT) {
                float4 *dst = (float4 *)smem + ((size_t)j * k + 32 * u) / 4;
#pragma unroll
                for (int i = 0; i < 8; i++) dst[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
            } else {
                float amax = 0.f;
#pragma unroll
                for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(v[i]));
                const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
                int sum[2] = {0, 0};
                u32 *qw = (u32 *)smem + ((size_t)j * k + 32 * u) / 4;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    u32 word = 0;
#pragma unroll
                    for (int b = 0; b < 4; b++) {
                        const int q = __float2int_rn(v[4 * i + b] * id);
                        sum[i >> 2] += q;
                        word |= ((u32)q & 0xFFu) << (8 * b);
                    }
                    qw[i] = word;
                }
                float *xd = (float *)(smem + (size_t)a.n * k);
                float *xs = xd + (size_t)a.n * units;
                xd[(size_t)j * units + u] = d;
                xs[(size_t)j * 2 * units + 2 * u] = d * (float)sum[0];
                xs[(size_t)j * 2 * units + 2 * u + 1] = d * (float)sum[1];
            }
        }
    }
    __syncthreads();
}

// Element i (0..3) of a 4-array with a run-time index, without sending the array to local memory.
template <typename T>
__device__ __forceinline__ T pick4(const T *arr, int i) {
    return i == 0 ? arr[0] : i == 1 ? arr[1] : i == 2 ? arr[2] : arr[3];
}

// Which matrix and row job `v` of the concatenated rows is; false past the end.
__device__ __forceinline__ bool mv_job(const MvArgs &a, int v, int &m, int &r) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (i >= a.n_mat) break;
        if (v < a.rows[i]) {
            m = i, r = v;
            return true;
        }
        v -= a.rows[i];
    }
    m = 0, r = 0;
    return false;
}

template <int NMAX>
__device__ void mv_body(const MvArgs &a) {
    extern __shared__ __align__(16) u8 smem[];
    __shared__ float red[32];
    mv_stage_x(a, smem, red);

    const int T = 1 << a.team_log2, lane = threadIdx.x & (T - 1);
    const int team = blockIdx.x * (MV_THREADS >> a.team_log2) + (threadIdx.x >> a.team_log2);
    const bool gated = a.mode == MODE_SILU || a.mode == MODE_GELU;
    int m[2], r[2];
    bool ok[2];
    if (gated) {
        m[0] = 0, m[1] = 1, r[0] = r[1] = team;
        ok[0] = ok[1] = team < a.rows[0];
    } else {
        ok[0] = mv_job(a, 2 * team, m[0], r[0]);
        ok[1] = mv_job(a, 2 * team + 1, m[1], r[1]);
    }
    // Teams past the end still take part in the shuffles below (whole warps), computing nothing.
    const u8 *wrow[2];
#pragma unroll
    for (int jb = 0; jb < 2; jb++) wrow[jb] = ok[jb] ? pick4(a.w, m[jb]) + (size_t)r[jb] * a.row_bytes : nullptr;

    const int k = a.k, units = k / 32;
    float acc[2][NMAX];
#pragma unroll
    for (int jb = 0; jb < 2; jb++)
#pragma unroll
        for (int j = 0; j < NMAX; j++) acc[jb][j] = 0.f;

#pragma unroll 2
    for (int u = lane; u < units; u += T) {
#pragma unroll
        for (int jb = 0; jb < 2; jb++) {
            if (!ok[jb]) continue;
            if constexpr (QFLOAT) {
                float wv[32];
                unit_f<QT>(wrow[jb], u, wv);
#pragma unroll
                for (int j = 0; j < NMAX; j++) {
                    if (j >= a.n) break;
                    const float4 *xv = (const float4 *)smem + ((size_t)j * k + 32 * u) / 4;
                    float s = 0.f;
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        const float4 f = xv[i];
                        s += wv[4 * i] * f.x + wv[4 * i + 1] * f.y + wv[4 * i + 2] * f.z + wv[4 * i + 3] * f.w;
                    }
                    acc[jb][j] += s;
                }
            } else {
                QUnit q;
                unit_q<QT>(wrow[jb], u, q);
                const float *xd = (const float *)(smem + (size_t)a.n * k);
                const float *xs = xd + (size_t)a.n * units;
#pragma unroll
                for (int j = 0; j < NMAX; j++) {
                    if (j >= a.n) break;
                    const int4 *xq = (const int4 *)(smem + (size_t)j * k + 32 * u);
                    const int4 x0 = xq[0], x1 = xq[1];
                    int d0 = dp4a(q.q[0], x0.x, 0);
                    d0 = dp4a(q.q[1], x0.y, d0);
                    d0 = dp4a(q.q[2], x0.z, d0);
                    d0 = dp4a(q.q[3], x0.w, d0);
                    int d1 = dp4a(q.q[4], x1.x, 0);
                    d1 = dp4a(q.q[5], x1.y, d1);
                    d1 = dp4a(q.q[6], x1.z, d1);
                    d1 = dp4a(q.q[7], x1.w, d1);
                    const size_t ju = (size_t)j * units + u;
                    acc[jb][j] += xd[ju] * (q.a[0] * (float)d0 + q.a[1] * (float)d1) + q.b[0] * xs[2 * ju] +
                                  q.b[1] * xs[2 * ju + 1];
                }
            }
        }
    }

#pragma unroll
    for (int jb = 0; jb < 2; jb++)
#pragma unroll
        for (int j = 0; j < NMAX; j++) acc[jb][j] = group_sum(acc[jb][j], T);
    if (lane != 0) return;

    if (gated) {
        if (!ok[0]) return;
        const int rows = a.rows[0], row = r[0];
#pragma unroll
        for (int j = 0; j < NMAX; j++) {
            if (j >= a.n) break;
            const float g = acc[0][j], up = acc[1][j];
            const size_t at = (size_t)j * rows + row;
            a.y[0][at] = g;
            a.y[1][at] = up;
            a.aux[at] = (a.mode == MODE_SILU ? silu_f(g) : gelu_tanh_f(g)) * up;
        }
        return;
    }
#pragma unroll
    for (int jb = 0; jb < 2; jb++) {
        if (!ok[jb]) continue;
        const int rows = pick4(a.rows, m[jb]);
        float *y = pick4(a.y, m[jb]);
#pragma unroll
        for (int j = 0; j < NMAX; j++) {
            if (j >= a.n) break;
            const size_t at = (size_t)j * rows + r[jb];
            y[at] = acc[jb][j];
            if (a.mode == MODE_RESIDUAL) a.aux[at] += acc[jb][j];
        }
    }
}

#define MV_PARAMS                                                                                           \
    const u8 *w0, const u8 *w1, const u8 *w2, const u8 *w3, float *y0, float *y1, float *y2, float *y3, \
        int rows0, int rows1, int rows2, int rows3, int n_mat, i64 row_bytes, int k, int n, const float *x, \
        const float *norm_w, float eps, float *h_out, int mode, float *aux, int team_log2
#define MV_ARGS                                                                                           \
    MvArgs a = {{w0, w1, w2, w3}, {y0, y1, y2, y3}, {rows0, rows1, rows2, rows3}, n_mat, row_bytes, k, n, \
                x,  norm_w,        eps,              h_out,                  mode,  aux,       team_log2}

extern "C" __global__ void __launch_bounds__(MV_THREADS) mv_n1(MV_PARAMS) { MV_ARGS; mv_body<1>(a); }
extern "C" __global__ void __launch_bounds__(MV_THREADS) mv_n2(MV_PARAMS) { MV_ARGS; mv_body<2>(a); }
extern "C" __global__ void __launch_bounds__(MV_THREADS) mv_n4(MV_PARAMS) { MV_ARGS; mv_body<4>(a); }
extern "C" __global__ void __launch_bounds__(MV_THREADS) mv_n8(MV_PARAMS) { MV_ARGS; mv_body<8>(a); }

// ---- prefill: tensor-core tiles ----

#define TILE_M 64    // tokens per block
#define TILE_N 128   // weight rows per block
#define TILE_K 32    // one unit
#define TILE_LD 40   // shared row stride in halves: 80 bytes, conflict-free fragment loads

__device__ __forceinline__ void mma_16816(float *c, const u32 *a, u32 b0, u32 b1) {
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
    // not reached: the HIP build uses mm_tile_scalar_step below
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// y_m (n, rows_m) = x (n, k) @ W_m.T for matrix m = blockIdx.z; grid (row tiles, token tiles, n_mat).
extern "C" __global__ void __launch_bounds__(128)
    mm_tile(const u8 *w0, const u8 *w1, const u8 *w2, const u8 *w3, float *y0, float *y1, float *y2, float *y3,
            int rows0, int rows1, int rows2, int rows3, i64 row_bytes, int k, int n, const float *__restrict__ x) {
    __shared__ __align__(16) u16 xs[TILE_M][TILE_LD];  // x tile as f16 (tokens, k)
    // Float weights are (nearly) exact in f16, so x's rounding would dominate their error: x is
    // split into f16 high and low parts, two products (quantized weights do not need it).
    __shared__ __align__(16) u16 xs_lo[QFLOAT ? TILE_M : 1][TILE_LD];
    __shared__ __align__(16) u16 ws[TILE_N][TILE_LD];  // weight tile as f16 (rows, k)
    const int mi_ = blockIdx.z;
    const u8 *w = mi_ == 0 ? w0 : mi_ == 1 ? w1 : mi_ == 2 ? w2 : w3;
    float *y = mi_ == 0 ? y0 : mi_ == 1 ? y1 : mi_ == 2 ? y2 : y3;
    const int rows = mi_ == 0 ? rows0 : mi_ == 1 ? rows1 : mi_ == 2 ? rows2 : rows3;
    const int r0 = blockIdx.x * TILE_N, t0 = blockIdx.y * TILE_M;
    if (r0 >= rows) return;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 64;  // this warp's 32 tokens x 64 rows
    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    for (int k0 = 0; k0 < k; k0 += TILE_K) {
#pragma unroll
        for (int i = 0; i < 4; i++) {  // x tile: 64 x 32 floats, 512 float4
            const int idx = tid + 128 * i, tr = idx >> 3, c4 = (idx & 7) * 4;
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (t0 + tr < n) v = *(const float4 *)(x + (size_t)(t0 + tr) * k + k0 + c4);
            const uint2 hi = make_uint2(pack_h2(v.x, v.y), pack_h2(v.z, v.w));
            *(uint2 *)&xs[tr][c4] = hi;
            if constexpr (QFLOAT) {
                const float4 r = make_float4(v.x - h2f((u16)(hi.x & 0xFFFFu)), v.y - h2f((u16)(hi.x >> 16)),
                                             v.z - h2f((u16)(hi.y & 0xFFFFu)), v.w - h2f((u16)(hi.y >> 16)));
                *(uint2 *)&xs_lo[tr][c4] = make_uint2(pack_h2(r.x, r.y), pack_h2(r.z, r.w));
            }
        }
        {  // weight tile: one unit of one row per thread
            float v[32];
            if (r0 + tid < rows) {
                unit_f<QT>(w + (size_t)(r0 + tid) * row_bytes, k0 / 32, v);
            } else {
#pragma unroll
                for (int i = 0; i < 32; i++) v[i] = 0.f;
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
                *(uint4 *)&ws[tid][8 * i] = make_uint4(pack_h2(v[8 * i], v[8 * i + 1]), pack_h2(v[8 * i + 2], v[8 * i + 3]),
                                                       pack_h2(v[8 * i + 4], v[8 * i + 5]), pack_h2(v[8 * i + 6], v[8 * i + 7]));
        }
        __syncthreads();
#pragma unroll
        for (int ks = 0; ks < TILE_K; ks += 16) {
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
            // Same output mapping as the mma fragments, computed with plain FMAs.
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int ni = 0; ni < 8; ni++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int tr = wm + 16 * mi + g + 8 * (e >> 1), rr = wn + 8 * ni + 2 * tq + (e & 1);
                        float s = 0.f;
                        for (int kk = 0; kk < 16; kk++) {
                            float xv = h2f(xs[tr][ks + kk]);
                            if constexpr (QFLOAT) xv += h2f(xs_lo[tr][ks + kk]);
                            s += xv * h2f(ws[rr][ks + kk]);
                        }
                        acc[mi][ni][e] += s;
                    }
#else
#pragma unroll
            for (int part = 0; part < (QFLOAT ? 2 : 1); part++) {
                u16(*xt)[TILE_LD] = part == 0 ? xs : xs_lo;
                u32 af[2][4];
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    const int tr = wm + 16 * mi + g, c = ks + 2 * tq;
                    af[mi][0] = *(const u32 *)&xt[tr][c];
                    af[mi][1] = *(const u32 *)&xt[tr + 8][c];
                    af[mi][2] = *(const u32 *)&xt[tr][c + 8];
                    af[mi][3] = *(const u32 *)&xt[tr + 8][c + 8];
                }
#pragma unroll
                for (int ni = 0; ni < 8; ni++) {
                    const int rr = wn + 8 * ni + g, c = ks + 2 * tq;
                    const u32 b0 = *(const u32 *)&ws[rr][c], b1 = *(const u32 *)&ws[rr][c + 8];
#pragma unroll
                    for (int mi = 0; mi < 2; mi++) mma_16816(acc[mi][ni], af[mi], b0, b1);
                }
            }
#endif
        }
        __syncthreads();
    }

    // c0, c1: token g, rows 2tq, 2tq+1; c2, c3: token g+8.
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 8; ni++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int t = t0 + wm + 16 * mi + g + 8 * (e >> 1), rr = r0 + wn + 8 * ni + 2 * tq + (e & 1);
                if (t < n && rr < rows) y[(size_t)t * rows + rr] = acc[mi][ni][e];
            }
}

// out (n, cols) = rows ids (n,) of W (rows, cols) as f32; ids outside [0, rows) give zeros.
extern "C" __global__ void __launch_bounds__(128)
    get_rows(const u8 *__restrict__ w, i64 row_bytes, int rows, int cols, const int *__restrict__ ids,
             float *__restrict__ out) {
    const int u = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (u >= cols / 32) return;
    const int id = ids[t];
    float v[32];
    if (id >= 0 && id < rows) {
        unit_f<QT>(w + (size_t)id * row_bytes, u, v);
    } else {
#pragma unroll
        for (int i = 0; i < 32; i++) v[i] = 0.f;
    }
    float4 *dst = (float4 *)(out + (size_t)t * cols + 32 * u);
#pragma unroll
    for (int i = 0; i < 8; i++) dst[i] = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
}
