// Grouped expert products of a mixture-of-experts layer, for weights of type QT (quant.cuh).
//
// W (n_expert, m, k) stacked in GGUF blocks; ids (n_sel,) the expert of each selection (a token's
// choice: selection s = t * n_used + u); y (n_sel, m): y[s] = W[ids[s]] @ x[s / x_div] (x_div = n_used:
// a token's input shared by its experts; 1: a row each). Grid (ceil(m / EXP_ROWS), n_expert): block
// (tile, e) lists the selections that chose expert e in shared memory (none: it returns, e's weights
// untouched); each warp takes one row of the tile and, for each listed selection, its dot product
// with that selection's x (the row's blocks come from memory once, from cache for the others). The
// expert ids are read on the device: no host round trip, and the launch shape is fixed (capturable).
#define EXP_ROWS 8     // rows per block, one a warp
#define EXP_LIST 1024  // selections listed at a time

extern "C" __global__ void expert_matmul(const u8 *__restrict__ w, i64 row_bytes, i64 expert_bytes, int m, int k,
                                         const float *__restrict__ x, int x_div, const int *__restrict__ ids,
                                         int n_sel, float *__restrict__ y) {
    PDL_ENTER();
    __shared__ int list[EXP_LIST];
    __shared__ int count;
    const int e = blockIdx.y, lane = threadIdx.x & 31;
    const int r = blockIdx.x * EXP_ROWS + (threadIdx.x >> 5);
    const u8 *row = w + (i64)e * expert_bytes + (i64)r * row_bytes;
    for (int base = 0; base < n_sel; base += EXP_LIST) {
        if (threadIdx.x == 0) count = 0;
        __syncthreads();
        const int end = min(n_sel, base + EXP_LIST);
        for (int s = base + threadIdx.x; s < end; s += blockDim.x)
            if (ids[s] == e) list[atomicAdd(&count, 1)] = s;
        __syncthreads();
        const int listed = count;
        for (int j = 0; j < listed && r < m; j++) {
            const int s = list[j];
            const float4 *xr = (const float4 *)(x + (i64)(s / x_div) * k);
            float acc = 0.f;
            for (int u = lane; u < k / 32; u += 32) {
                float v[32];
                unit_f<QT>(row, u, v);
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    const float4 xv = xr[8 * u + i];
                    acc += v[4 * i] * xv.x + v[4 * i + 1] * xv.y + v[4 * i + 2] * xv.z + v[4 * i + 3] * xv.w;
                }
            }
            acc = warp_sum(acc);
            if (lane == 0) y[(i64)s * m + r] = acc;
        }
        __syncthreads();  // the list is refilled
    }
}
