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

extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
    row_argmax(const float *__restrict__ x, int vocab, int k, int *__restrict__ ids, float *__restrict__ vals) {
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
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, best, o);
        const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (better(ov, oi, best, bi)) best = ov, bi = oi;
    }
    if (lane == 0) sv[warp] = best, si[warp] = bi;
    __syncthreads();
    if (warp == 0) {
        best = lane < (nt >> 5) ? sv[lane] : NEG_INF;
        bi = lane < (nt >> 5) ? si[lane] : 0x7FFFFFFF;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, best, o);
            const int oi = __shfl_xor_sync(FULL_MASK, bi, o);
            if (better(ov, oi, best, bi)) best = ov, bi = oi;
        }
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
