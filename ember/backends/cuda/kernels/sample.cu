// Sampling reductions on the device: per row of logits (n, vocab) f32, its largest value (greedy)
// or its k largest values, so that only k candidates per row cross to the host.
//
// row_argmax: one block per row, the largest value and its id; equal values: the lowest id (as
//   numpy's argmax). NaNs are never chosen.
// row_topk (2 <= k <= TOPK_MAX): one block per row. The k-th largest value is found exactly by a
//   radix select over order-preserving 32-bit keys (three passes of 11, 11 and 10 bits, a shared
//   histogram each), then every value above it and as many values equal to it as still fit are
//   gathered and sorted (bitonic, descending; equal values by id). Which of several values equal
//   to the k-th largest are kept is not specified.
// row_top{1,2,4,8} (k <= 8, what greedy decoding with a few banned tokens needs): many blocks
//   per row, see below; equal values by the lower id.
// Outputs: ids (n, k) int32 and vals (n, k) f32, best first.

#define TOPK_THREADS 1024
#define TOPK_MAX 256
#define TOPK_BATCH 4

// Order-preserving unsigned keys of floats (larger float, larger key; -inf lowest of the numbers).
__device__ __forceinline__ u32 order_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

__device__ __forceinline__ bool better(float v, int i, float bv, int bi) { return v > bv || (v == bv && i < bi); }

// The best (value, id) over the warp, in every lane.
__device__ __forceinline__ void warp_best(float &v, int &i) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, v, o);
        const int oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (better(ov, oi, v, i)) v = ov, i = oi;
    }
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
    row_argmax(const float *__restrict__ x, int vocab, int k, int *__restrict__ ids, float *__restrict__ vals) {
    PDL_ENTER();
    __shared__ float sv[32];
    __shared__ int si[32];
    const float *row = x + (size_t)blockIdx.x * vocab;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nt = blockDim.x;
    float best = NEG_INF;
    int bi = 0x7FFFFFFF;
    for (int i0 = tid; i0 < vocab; i0 += TOPK_BATCH * nt) {
        float v[TOPK_BATCH];
#pragma unroll
        for (int r = 0; r < TOPK_BATCH; r++) v[r] = i0 + r * nt < vocab ? row[i0 + r * nt] : NEG_INF;
#pragma unroll
        for (int r = 0; r < TOPK_BATCH; r++) {
            const int i = i0 + r * nt;
            if (i < vocab && better(v[r], i, best, bi)) best = v[r], bi = i;
        }
    }
    warp_best(best, bi);
    if (lane == 0) sv[warp] = best, si[warp] = bi;
    __syncthreads();
    if (warp == 0) {
        best = lane < (nt >> 5) ? sv[lane] : NEG_INF;
        bi = lane < (nt >> 5) ? si[lane] : 0x7FFFFFFF;
        warp_best(best, bi);
        if (lane == 0) {
            // a row of NaNs only: no value compares; report id 0
            ids[blockIdx.x] = bi == 0x7FFFFFFF ? 0 : bi;
            vals[blockIdx.x] = bi == 0x7FFFFFFF ? row[0] : best;
        }
    }
}

// Inclusive suffix sums over the block's threads (thread t gets the sum of c over threads >= t).
// tot: shared scratch of 32 words.
__device__ u32 block_suffix_sum(u32 c, u32 *tot) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u32 s = c;
    for (int o = 1; o < 32; o <<= 1) {
        const u32 v = __shfl_down_sync(FULL_MASK, s, o);
        if (lane + o < 32) s += v;
    }
    __syncthreads();  // tot may still be read from a previous call
    if (lane == 0) tot[warp] = s;
    __syncthreads();
    for (int w = warp + 1; w < nw; w++) s += tot[w];
    return s;
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
    row_topk(const float *__restrict__ x, int vocab, int k, int *__restrict__ ids, float *__restrict__ vals) {
    PDL_ENTER();
    __shared__ u32 hist[2048];
    __shared__ u32 tot[32];
    __shared__ u32 cand_key[TOPK_MAX];
    __shared__ int cand_id[TOPK_MAX];
    __shared__ u32 sel_bin, sel_above, n_gt, n_eq;
    const float *row = x + (size_t)blockIdx.x * vocab;
    const int tid = threadIdx.x, nt = blockDim.x;

    // radix select: prefix/mask describe the keys still in the running; need: how many of them
    // are wanted (the k-th largest overall is the need-th largest among them)
    u32 prefix = 0, mask = 0, need = (u32)k;
    for (int pass = 0; pass < 3; pass++) {
        const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
        const u32 bins = pass == 2 ? 1024u : 2048u;
        for (int b = tid; b < 2048; b += nt) hist[b] = 0;
        __syncthreads();
        for (int i0 = tid; i0 < vocab; i0 += TOPK_BATCH * nt) {
            u32 key[TOPK_BATCH];
#pragma unroll
            for (int r = 0; r < TOPK_BATCH; r++) key[r] = i0 + r * nt < vocab ? order_key(row[i0 + r * nt]) : 0u;
#pragma unroll
            for (int r = 0; r < TOPK_BATCH; r++)
                if (i0 + r * nt < vocab && (key[r] & mask) == prefix) atomicAdd(&hist[(key[r] >> shift) & (bins - 1)], 1u);
        }
        __syncthreads();
        // thread t owns bins 2t, 2t+1 (1024 threads x 2 = 2048 bins)
        const u32 lo = hist[2 * tid], hi = hist[2 * tid + 1];
        const u32 incl = block_suffix_sum(lo + hi, tot), above_pair = incl - lo - hi;
        if (above_pair < need && need <= incl) {
            if (above_pair + hi >= need) {
                sel_bin = 2 * tid + 1, sel_above = above_pair;
            } else {
                sel_bin = 2 * tid, sel_above = above_pair + hi;
            }
        }
        __syncthreads();
        need -= sel_above;
        prefix |= sel_bin << shift;
        mask |= (bins - 1) << shift;
        __syncthreads();  // sel_* are rewritten by the next pass
    }
    // prefix is now the k-th largest key; `need` values equal to it belong to the top k
    if (tid == 0) n_gt = 0, n_eq = 0;
    __syncthreads();
    const u32 n_above = (u32)k - need;
    for (int i0 = tid; i0 < vocab; i0 += TOPK_BATCH * nt) {
        u32 key[TOPK_BATCH];
#pragma unroll
        for (int r = 0; r < TOPK_BATCH; r++) key[r] = i0 + r * nt < vocab ? order_key(row[i0 + r * nt]) : 0u;
#pragma unroll
        for (int r = 0; r < TOPK_BATCH; r++) {
            const int i = i0 + r * nt;
            if (i >= vocab || key[r] < prefix) continue;
            u32 slot;
            if (key[r] > prefix) {
                slot = atomicAdd(&n_gt, 1u);
            } else {
                const u32 e = atomicAdd(&n_eq, 1u);
                if (e >= need) continue;
                slot = n_above + e;
            }
            cand_key[slot] = key[r];
            cand_id[slot] = i;
        }
    }
    int size = 2;
    while (size < k) size <<= 1;
    for (int s = k + tid; s < size; s += nt) cand_key[s] = 0u, cand_id[s] = 0x7FFFFFFF;  // sorted last
    __syncthreads();
    // bitonic sort of size entries: descending keys, equal keys by ascending id
    for (int len = 2; len <= size; len <<= 1) {
        for (int stride = len >> 1; stride > 0; stride >>= 1) {
            for (int t = tid; t < size / 2; t += nt) {
                const int i = 2 * t - (t & (stride - 1)), j = i + stride;
                const bool down = (i & len) == 0;  // this run ends up descending
                const u32 ki = cand_key[i], kj = cand_key[j];
                const int ii = cand_id[i], ij = cand_id[j];
                const bool j_first = kj > ki || (kj == ki && ij < ii);
                if (j_first == down) {
                    cand_key[i] = kj, cand_key[j] = ki;
                    cand_id[i] = ij, cand_id[j] = ii;
                }
            }
            __syncthreads();
        }
    }
    for (int s = tid; s < k; s += nt) {
        ids[(size_t)blockIdx.x * k + s] = cand_id[s];
        vals[(size_t)blockIdx.x * k + s] = key_value(cand_key[s]);
    }
}

// ---- small k (1..8): many blocks per row ----
// A row of 262,144 logits read by one block is a tenth of a one-token step. Here a row is cut
// into slices of TOPS_THREADS * TOPS_PER_THREAD values, one block each: every thread keeps its K best in
// registers (sorted, by value then lower id), the block merges them in K rounds of a block-wide
// best, and writes K candidates; the block that finishes its row last (a counter per row, zero
// between launches) merges the row's candidates the same way. Grid (slices, rows).
#define TOPS_THREADS 256
#define TOPS_PER_THREAD 8

// (v, id) into the sorted list (bv, bi) of K, if it belongs there. Walking up from the bottom,
// each slot is rewritten from its own and the slot above's old contents only.
template <int K>
__device__ __forceinline__ void tops_keep(float (&bv)[K], int (&bi)[K], float v, int id) {
#pragma unroll
    for (int j = K - 1; j >= 0; j--) {
        if (better(v, id, bv[j], bi[j])) {
            if (j > 0 && better(v, id, bv[j - 1], bi[j - 1])) {
                bv[j] = bv[j - 1], bi[j] = bi[j - 1];
            } else {
                bv[j] = v, bi[j] = id;
            }
        }
    }
}

// K rounds of a block-wide best over the threads' list heads: out_v/out_i (K) in shared memory,
// best first; the winning thread drops its head each round. Ids are unique, so one thread wins.
template <int K>
__device__ __forceinline__ void tops_block_merge(float (&bv)[K], int (&bi)[K], float *out_v, int *out_i,
                                                 float *sv, int *si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int r = 0; r < K; r++) {
        float b = bv[0];
        int i = bi[0];
        warp_best(b, i);
        if (lane == 0) sv[warp] = b, si[warp] = i;
        __syncthreads();
        b = lane < nw ? sv[lane] : NEG_INF;
        i = lane < nw ? si[lane] : 0x7FFFFFFF;
        warp_best(b, i);
        if (threadIdx.x == 0) out_v[r] = b, out_i[r] = i;
        if (bi[0] == i && i != 0x7FFFFFFF) {  // this thread's head won: pop it
#pragma unroll
            for (int j = 0; j < K - 1; j++) bv[j] = bv[j + 1], bi[j] = bi[j + 1];
            bv[K - 1] = NEG_INF, bi[K - 1] = 0x7FFFFFFF;
        }
        __syncthreads();  // sv/si are rewritten next round
    }
}

template <int K>
__device__ void tops_body(const float *__restrict__ x, int vocab, int k, int *__restrict__ ids,
                          float *__restrict__ vals, float *cand_v, int *cand_i, unsigned *counter) {
    __shared__ float sv[32], best_v[K];
    __shared__ int si[32], best_i[K];
    __shared__ int last_s;
    const int row = blockIdx.y, slice = blockIdx.x, n_slices = gridDim.x, tid = threadIdx.x;
    const float *x_row = x + (size_t)row * vocab;
    float bv[K];
    int bi[K];
#pragma unroll
    for (int j = 0; j < K; j++) bv[j] = NEG_INF, bi[j] = 0x7FFFFFFF;
    const int base = slice * TOPS_THREADS * TOPS_PER_THREAD + tid;
    float v[TOPS_PER_THREAD];
#pragma unroll
    for (int r = 0; r < TOPS_PER_THREAD; r++) {
        const int i = base + r * TOPS_THREADS;
        v[r] = i < vocab ? x_row[i] : NEG_INF;
    }
#pragma unroll
    for (int r = 0; r < TOPS_PER_THREAD; r++) {
        const int i = base + r * TOPS_THREADS;
        if (i < vocab) tops_keep<K>(bv, bi, v[r], i);
    }
    tops_block_merge<K>(bv, bi, best_v, best_i, sv, si);
    float *cv = cand_v + ((size_t)row * n_slices + slice) * K;
    int *ci = cand_i + ((size_t)row * n_slices + slice) * K;
    if (tid < K) cv[tid] = best_v[tid], ci[tid] = best_i[tid];
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        const bool last = atomicAdd(counter + row, 1u) == (unsigned)n_slices - 1;
        if (last) __threadfence();
        last_s = last;
    }
    __syncthreads();
    if (!last_s) return;
    // the row's n_slices * K candidates, read through L2 (other blocks wrote them)
    const float *rv = cand_v + (size_t)row * n_slices * K;
    const int *ri = cand_i + (size_t)row * n_slices * K;
#pragma unroll
    for (int j = 0; j < K; j++) bv[j] = NEG_INF, bi[j] = 0x7FFFFFFF;
    for (int c = tid; c < n_slices * K; c += TOPS_THREADS) tops_keep<K>(bv, bi, ld_l2(rv + c), ld_l2(ri + c));
    tops_block_merge<K>(bv, bi, best_v, best_i, sv, si);
    if (tid < k) {
        // a row of NaNs only: no value compares; report id 0 (as row_argmax)
        const int id = best_i[tid];
        ids[(size_t)row * k + tid] = id == 0x7FFFFFFF ? 0 : id;
        vals[(size_t)row * k + tid] = id == 0x7FFFFFFF ? x_row[0] : best_v[tid];
    }
    if (tid == 0) atomicExch(counter + row, 0u);  // ready for the next launch
}

#define TOPS_PARAMS                                                                                     \
    const float *__restrict__ x, int vocab, int k, int *__restrict__ ids, float *__restrict__ vals, \
        float *cand_v, int *cand_i, unsigned *counter
#define TOPS_KERNEL(K)                                                                  \
    extern "C" __global__ void __launch_bounds__(TOPS_THREADS) row_top##K(TOPS_PARAMS) { \
        PDL_ENTER();                                                                    \
        tops_body<K>(x, vocab, k, ids, vals, cand_v, cand_i, counter);                  \
    }
TOPS_KERNEL(1)
TOPS_KERNEL(2)
TOPS_KERNEL(4)
TOPS_KERNEL(8)
