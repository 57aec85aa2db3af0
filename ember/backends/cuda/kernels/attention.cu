// Causal attention over the paged f16 KV cache: grouped-query heads, sliding window, softcap.
//
// q (n_tok, n_head, hd_k) f32; out (n_tok, n_head, hd_v) f32.
// k_cache (n_slots, n_kv, hd_k), v_cache (n_slots, n_kv, hd_v): f16 bits.
// Token t belongs to the sequence whose page table is row seq_rows[t] of tables (n_seq, max_pages);
// position p of it lives in slot tables[s][p / page_size] * page_size + p % page_size. Token t at
// position pos[t] attends to positions max(0, pos[t] - window + 1) .. pos[t] (window <= 0: from 0).
//
// One block per (token, kv head, chunk of <= 8 of the query heads sharing it: decode steps take one
// head a block, split of the key range):
// keys in chunks of 128 / kpt (kpt threads per key for the scores: 4 for decode steps, whose
// splits hold few keys; online softmax; then threads over value dimensions). With n_split > 1 (flash-decoding), each split writes (max, sum, partial output) and
// attn_combine merges them. The key range is read from pos on the device, so one launch shape
// serves every step of a recorded graph.
//
// Folded qkv_post (k_new set; steps where every token is the only one of its sequence): q holds
// the product's values, and each block normalises (q_norm, k_norm, eps: weights (hd_k,) or null),
// rotates (the rope parameters) and scales its own query heads. The block whose split holds the
// token's own position p_t (one per head chunk: the last non-empty split) also makes kv head g's
// new key from k_new (n_tok, n_kv, hd_k) the same way and writes it, with v_new's (n_tok, n_kv,
// hd_v) value, to cache row slots[t] before reading any key: a block sees its own global writes
// after a barrier. No other block reads that row (other splits hold other positions, other tokens
// other sequences' slots); the head chunks of one kv head write the same bytes.

#define ATT_THREADS 128
#define ATT_CHUNK 128
#define ATT_HEADS 8
#define ATT_MAX_D 256
#define ATT_VPRE 8  // values a thread loads with the first chunk's keys

// Attention sinks (gpt-oss): a learned logit per query head that joins each softmax's denominator
// and no value: exp(sinks[h] - m) beside the sum of exp(s - m) over the keys (m the scores' max).
// sinks null: no term.
__device__ __forceinline__ float sink_term(const float *sinks, int h, float m) {
    return sinks ? expf(sinks[h] - m) : 0.f;
}

// The folded qkv_post of one block: qs (gh, hd) = rotated, normalised q rows qt (gh, hd) * scale;
// with kt set (the block that writes token t's cache row), kv head g's key kt (hd,) normalised and
// rotated through ks (hd,) into k_row, and v_row = vt (hd_v,). cs, sn: the token's rope table.
__device__ __forceinline__ void fold_qkv_post(float *qs, float *ks, const float *cs, const float *sn,
                                              const float *qt, const float *kt, const float *vt, u16 *k_row,
                                              u16 *v_row, const float *q_norm, const float *k_norm, float eps,
                                              const RopeP &rp, int gh, int hd, int hd_v, float scale) {
    const int tid = threadIdx.x, warp = tid >> 5, own = kt != nullptr;
    if ((hd & 3) == 0 && ((unsigned long long)qt & 15) == 0) {  // 16-byte loads: fewer round trips
        for (int i = tid; i < gh * hd / 4; i += ATT_THREADS) ((float4 *)qs)[i] = ((const float4 *)qt)[i];
    } else {
        for (int i = tid; i < gh * hd; i += ATT_THREADS) qs[i] = qt[i];
    }
    if (own) {
        for (int i = tid; i < hd; i += ATT_THREADS) ks[i] = kt[i];
        for (int i = tid; i < hd_v; i += ATT_THREADS) v_row[i] = f2h(vt[i]);
    }
    __syncthreads();  // the rope table too
    if (q_norm) {  // one warp per row: the query heads, then the key
        for (int r = warp; r < gh + own; r += ATT_THREADS / 32)
            warp_rms_norm(r < gh ? qs + r * hd : ks, r < gh ? q_norm : k_norm, hd, eps);
        __syncthreads();
    }
    rope_rotate(qs, gh, hd, rp, cs, sn);
    if (own) rope_rotate(ks, 1, hd, rp, cs, sn);
    __syncthreads();
    for (int i = tid; i < gh * hd; i += ATT_THREADS) qs[i] *= scale;
    if (own)
        for (int i = tid; i < hd; i += ATT_THREADS) k_row[i] = f2h(ks[i]);
}

// The last block of a (token, head chunk) to finish its split merges the chunk's splits itself
// (counters: one per (token, grid y), zero between launches), instead of an attn_combine launch.
// Each block's partial form is in part before it counts in (its fence orders the writes first);
// the last one reads the others' from L2: a lane's pair of values of every split (PRE >= n_used)
// is loaded with the splits' (max, sum), one round trip for all, and a decode block's head (up
// to 256 values) takes one pass of its threads (a value a thread took two at head size 256).
// wgt: shared, ATT_HEADS * 32 floats.
template <int PRE>
__device__ void merge_splits(const float *part, float *out, u8 *xq, int t, int h0, int gh, int n_head, int hd_v,
                             int n_split, int n_used, float *wgt, const float *sinks) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, stride = hd_v + 2;
    const float *chunk = part + ((size_t)t * n_head + h0) * n_split * stride;  // head h: + h * n_split * stride
    float2 v[PRE];
    const int n_p = gh * hd_v / 2;  // value pairs (hd_v even: a split's values start 8-byte aligned)
    auto load = [&](int p) {
        const float *base = chunk + (size_t)(2 * p / hd_v) * n_split * stride + 2 + 2 * p % hd_v;
#pragma unroll
        for (int s = 0; s < PRE; s++)
            v[s] = s < n_used && p < n_p ? ld_l2((const float2 *)(base + (size_t)s * stride)) : make_float2(0.f, 0.f);
    };
    load(tid);
    for (int h = warp; h < gh; h += ATT_THREADS / 32) {  // each head's split weights, one warp per head
        const float *base = chunk + (size_t)h * n_split * stride;
        const float ms = lane < n_used ? ld_l2(base + (size_t)lane * stride) : NEG_INF;
        const float ls = lane < n_used ? ld_l2(base + (size_t)lane * stride + 1) : 0.f;
        const float m = warp_max(ms);  // finite: the first split is never empty
        const float e = lane < n_used ? expf(ms - m) : 0.f;
        wgt[h * 32 + lane] = e / (warp_sum(e * ls) + sink_term(sinks, h0 + h, m));  // 0 past n_used
    }
    __syncthreads();
    for (int p = tid; p < (n_p + 31) / 32 * 32; p += ATT_THREADS) {  // whole warps (q8_store_pair's shuffles)
        if (p != tid) load(p);
        const bool in = p < n_p;
        const int h = in ? 2 * p / hd_v : 0;
        float2 num = make_float2(0.f, 0.f);
#pragma unroll
        for (int s = 0; s < PRE; s++) {
            const float w = wgt[h * 32 + s];
            num.x += w * v[s].x;
            num.y += w * v[s].y;
        }
        const size_t at = ((size_t)t * n_head + h0 + h) * hd_v + 2 * p % hd_v;
        if (in) *(float2 *)(out + at) = num;
        if (xq) q8_store_pair(num, at, xq, (float4 *)(xq + (size_t)gridDim.z * n_head * hd_v), in);
    }
}

// Counts the block in; true for the last of the n_split blocks of its (token, grid y), which then
// resets the counter for the next launch (no other block of that launch touches it again).
__device__ __forceinline__ bool last_split(unsigned *counters, int t, int n_split, int *last_s) {
    const size_t c = (size_t)t * gridDim.y + blockIdx.y;
    __syncthreads();  // the block's partial writes are issued
    if (threadIdx.x == 0) {
        __threadfence();
        const bool last = atomicAdd(counters + c, 1u) == (unsigned)n_split - 1;
        if (last) {
            counters[c] = 0u;
            __threadfence();  // what every block published is visible from here on
        }
        *last_s = last;
    }
    __syncthreads();
    return *last_s;
}

// Splits of a short key range in one thread-block cluster (attn_cluster<CL>, CL > 0; Hopper): each
// block keeps its partial form in its own shared memory (red: gh rows of hd_v sums, m_s, l_s),
// and after a cluster barrier the warps of its n_used blocks merge them from there, a 32-value
// slice of the output a warp in turn (lane q fetches split q's max and sum): no global partials,
// counter or second round trip to L2. The second barrier keeps every block's shared memory until
// the reads are done. Blocks past n_used (red null) only take part in the barriers. hd_v % 32 == 0.
template <int CL>
__device__ void cluster_merge(const float *red, const float *m_s, const float *l_s, float *out, u8 *xq, int t, int h0,
                              int gh, int n_head, int hd_v, int n_used, int rank, const float *sinks) {
    cluster_sync();
    if constexpr (CL > 0) {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = ATT_THREADS / 32;
        for (int sl = rank * n_warps + warp; red && sl < gh * hd_v / 32; sl += n_used * n_warps) {
            const int h = sl * 32 / hd_v, d = sl * 32 % hd_v + lane;
            float v[CL];
#pragma unroll
            for (int s = 0; s < CL; s++) v[s] = s < n_used ? ld_cluster(red + h * hd_v + d, s) : 0.f;
            const float ms = lane < n_used ? ld_cluster(m_s + h, lane) : NEG_INF;
            const float ls = lane < n_used ? ld_cluster(l_s + h, lane) : 0.f;
            const float m = warp_max(ms);  // finite: the first split is never empty
            const float e = lane < n_used ? expf(ms - m) : 0.f;
            const float w = e / (warp_sum(e * ls) + sink_term(sinks, h0 + h, m));
            float num = 0.f;
#pragma unroll
            for (int s = 0; s < CL; s++) num += __shfl_sync(FULL_MASK, w, s) * v[s];
            const size_t at = ((size_t)t * n_head + h0 + h) * hd_v + d;
            out[at] = num;
            if (xq) q8_store_warp(num, at, xq, (float4 *)(xq + (size_t)gridDim.z * n_head * hd_v));
        }
    }
    cluster_sync();
}

// Modules: "attention" (ATT_TILE_HD 0: attn and attn_combine*) and "attention_tile<HD>" (one
// attn_tile instance alone): a model's first token compiles only the tile size it uses, beside the rest.
#if ATT_TILE_HD == 0
// k_cache and v_cache are written by the folded form and read back in the same launch: neither
// const nor __restrict__ (a read-only-cache load would not see the writes).
#define ATTN_PARAMS                                                                                            \
    const float *__restrict__ q, u16 *k_cache, u16 *v_cache, float *__restrict__ out, float *__restrict__ part, \
        const int *__restrict__ pos, const int *__restrict__ seq_rows, const int *__restrict__ tables,           \
        int max_pages, int page_size, int n_head, int n_kv, int hd_k, int hd_v, int window, float scale,        \
        float softcap, int n_split, u8 *__restrict__ xq, int kpt_log2, int min_keys,                             \
        const float *__restrict__ k_new, const float *__restrict__ v_new, const float *__restrict__ q_norm,       \
        const float *__restrict__ k_norm, float eps, ROPE_PARAMS, const i64 *__restrict__ slots,                 \
        unsigned *__restrict__ counters, const float *__restrict__ sinks
#define ATTN_ARGS                                                                                               \
    q, k_cache, v_cache, out, part, pos, seq_rows, tables, max_pages, page_size, n_head, n_kv, hd_k, hd_v, window, \
        scale, softcap, n_split, xq, kpt_log2, min_keys, k_new, v_new, q_norm, k_norm, eps, n_rot, neox, base,    \
        freq_scale, ext_factor, mscale, corr_low, corr_high, freq_factors, slots, counters, sinks

// A block's place in the grid: token t (blockIdx.z), key-range split (blockIdx.x), and from
// blockIdx.y kv head g and its query heads h0 .. h0 + gh - 1: chunk hc of n_hc = gridDim.y / n_kv
// chunks of hpb = ceil(group / n_hc) <= ATT_HEADS heads (the host picks n_hc).
struct AttnBlock {
    int t, split, g, h0, gh;
};

__device__ __forceinline__ AttnBlock attn_block(int n_head, int n_kv) {
    const int group = n_head / n_kv, n_hc = gridDim.y / n_kv, hpb = (group + n_hc - 1) / n_hc;
    const int g = blockIdx.y / n_hc, hc = blockIdx.y % n_hc;
    return {(int)blockIdx.z, (int)blockIdx.x, g, g * group + hc * hpb, min(hpb, group - hc * hpb)};
}

// The key range [first, p_t] of a token in splits of per positions: n_used of the n_split hold
// keys. Splits merged by their last block (merged) hold at least min_keys positions: a short key
// range takes fewer blocks, the others leave at once, and a split alone writes the output itself
// (no merge); attn_combine reads every split's partial form, so there all n_split write one.
// in_cluster: the splits are re-cut to one pass of scores each and merged through the cluster.
struct AttnRange {
    int first, per, n_used;
    bool in_cluster;
};

template <int CL>
__device__ __forceinline__ AttnRange attn_range(int p_t, int window, int n_split, bool merged, int min_keys, int hd_v,
                                                int kpt_log2) {
    const int first = window > 0 ? max(0, p_t - window + 1) : 0;
    const int len = p_t + 1 - first;
    AttnRange r = {first, (len + n_split - 1) / n_split, n_split, false};
    if (merged) {
        r.per = max(r.per, min_keys);
        r.n_used = (len + r.per - 1) / r.per;
        if (CL > 0 && (hd_v & 31) == 0) {
            // a range that one cluster covers with one pass of scores a split: no global merge
            if (r.n_used > CL && (len + CL - 1) / CL <= (ATT_CHUNK >> kpt_log2)) {
                r.per = (len + CL - 1) / CL;
                r.n_used = (len + r.per - 1) / r.per;
            }
            r.in_cluster = r.n_used > 1 && r.n_used <= CL;
        }
    }
    return r;
}

// The scores of one chunk of keys c0 .. c0 + n_c - 1 for the block's gh heads (queries qs, hd_k
// values a row): kpt threads a key, each over a share of its dimensions, up to 8 loads in flight.
// Returns this thread's partial sums s (summed over the key's threads by the caller).
__device__ __forceinline__ void attn_key_scores(float (&s)[ATT_HEADS], const float *qs, const u16 *k_cache,
                                                size_t slot, int g, int hd_k, int kv_k, int kpart, int kpt, int gh) {
    const uint4 *kp = (const uint4 *)(k_cache + slot * kv_k + (size_t)g * hd_k);
    for (int d0 = kpart; d0 < hd_k / 8; d0 += 8 * kpt) {
        uint4 raw[8];
#pragma unroll
        for (int u = 0; u < 8; u++) raw[u] = d0 + u * kpt < hd_k / 8 ? kp[d0 + u * kpt] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int d8 = d0 + u * kpt;
            if (d8 >= hd_k / 8) break;
            const u32 w4[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
            float kf[8];
#pragma unroll
            for (int j = 0; j < 4; j++) kf[2 * j] = h2f((u16)(w4[j] & 0xFFFFu)), kf[2 * j + 1] = h2f((u16)(w4[j] >> 16));
#pragma unroll
            for (int h = 0; h < ATT_HEADS; h++) {
                if (h >= gh) break;
                const float4 *qv = (const float4 *)(qs + h * hd_k + 8 * d8);
                const float4 a = qv[0], b = qv[1];
                s[h] += a.x * kf[0] + a.y * kf[1] + a.z * kf[2] + a.w * kf[3] + b.x * kf[4] + b.y * kf[5] + b.z * kf[6] +
                        b.w * kf[7];
            }
        }
    }
}

// Online softmax over one chunk's scores sc (one warp per head): sc becomes probabilities, and
// each head's running max m_s, sum l_s and rescale alpha_s of the sums so far are updated.
__device__ __forceinline__ void attn_softmax(float (*sc)[ATT_CHUNK], float *m_s, float *l_s, float *alpha_s, int gh,
                                             int chunk) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int h = warp; h < gh; h += ATT_THREADS / 32) {
        float x[ATT_CHUNK / 32], cmax = NEG_INF;
#pragma unroll
        for (int i = 0; i < ATT_CHUNK / 32; i++) {
            x[i] = lane + 32 * i < chunk ? sc[h][lane + 32 * i] : NEG_INF;
            cmax = fmaxf(cmax, x[i]);
        }
        cmax = warp_max(cmax);  // finite: key c0 is always in range
        const float m_old = m_s[h], m_new = fmaxf(m_old, cmax);
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < ATT_CHUNK / 32; i++) {
            const float e = expf(x[i] - m_new);
            if (lane + 32 * i < chunk) sc[h][lane + 32 * i] = e;
            sum += e;
        }
        sum = warp_sum(sum);
        if (lane == 0) {
            const float alpha = expf(m_old - m_new);
            alpha_s[h] = alpha;
            m_s[h] = m_new;
            l_s[h] = l_s[h] * alpha + sum;
        }
    }
}

// The block's output rows after the last chunk: the key groups' partial sums red (kg, gh, hd_v)
// added up; written out (a split alone), kept in red for the cluster's merge, or written as this
// split's partial form (max, sum, values) to part.
__device__ __forceinline__ void attn_write(float *red, const AttnBlock &b, const AttnRange &r, const float *m_s,
                                           const float *l_s, float *__restrict__ out, float *__restrict__ part,
                                           u8 *__restrict__ xq, int n_head, int hd_v, int n_split, int n_kg,
                                           const float *__restrict__ sinks) {
    for (int i = threadIdx.x; i < b.gh * hd_v; i += ATT_THREADS) {  // whole warps when xq (hd_v % 32 == 0)
        const int h = i / hd_v, d = i % hd_v;
        float s = 0.f;
        for (int j = 0; j < n_kg; j++) s += red[(j * b.gh + h) * hd_v + d];
        if (r.n_used == 1) {
            const size_t at = ((size_t)b.t * n_head + b.h0 + h) * hd_v + d;
            const float o = s / (l_s[h] + sink_term(sinks, b.h0 + h, m_s[h]));
            out[at] = o;
            if (xq) q8_store_warp(o, at, xq, (float4 *)(xq + (size_t)gridDim.z * n_head * hd_v));
        } else if (r.in_cluster) {
            red[i] = s;  // in place: thread i alone reads red[i] (key group 0's value)
        } else {
            float *base = part + (((size_t)b.t * n_head + b.h0 + h) * n_split + b.split) * (hd_v + 2);
            base[2 + d] = s;
            if (d == 0) base[0] = m_s[h], base[1] = l_s[h];
        }
    }
}

// CL > 0 (attn_cluster): the blocks of CL consecutive splits form a thread-block cluster (see
// cluster_merge). Stages: the block's place and key range, the first chunk's cache slots (before
// the wait), the queries (the folded qkv_post, or q scaled), then per chunk of keys the scores,
// the online softmax and the values; the output or partial form; the merge of the splits.
template <int CL>
__device__ __forceinline__ void attn_body(ATTN_PARAMS) {
    __shared__ __align__(16) float qs[ATT_HEADS * ATT_MAX_D];  // scaled queries; reused for the reduction
    __shared__ float sc[ATT_HEADS][ATT_CHUNK];                 // scores, then probabilities
    __shared__ int slot_s[ATT_CHUNK];
    __shared__ float m_s[ATT_HEADS], l_s[ATT_HEADS], alpha_s[ATT_HEADS];
    __shared__ int last_s;
    // The folded form's rope table and new key live in sc until the first scores are written.
    float *const cs = &sc[0][0], *const sn = cs + 256, *const ks = cs + 512;

    const int tid = threadIdx.x;
    const AttnBlock b = attn_block(n_head, n_kv);
    const int t = b.t, g = b.g, h0 = b.h0, gh = b.gh;

    // Positions are step inputs, written by no kernel (see pdl_launch_next): the folded form's
    // rope table is made while the kernel before this one still runs.
    pdl_launch_next();
    const int p_t = pos[t];
    const RopeP rp = ROPE_ARGS;
    if (k_new)
        for (int i = tid; i < n_rot / 2; i += ATT_THREADS) rope_cos_sin(rp, p_t, i, cs[i], sn[i]);
    // so are the key range and the page tables: the first chunk's cache slots are looked up now
    const AttnRange r = attn_range<CL>(p_t, window, n_split, counters != nullptr, min_keys, hd_v, kpt_log2);
    if (counters && b.split >= r.n_used) {
        if (r.in_cluster && b.split < CL)  // the cluster's barriers only
            cluster_merge<CL>(nullptr, nullptr, nullptr, out, xq, t, 0, 0, n_head, hd_v, 0, 0, nullptr);
        return;
    }
    const int s0 = r.first + b.split * r.per, s1 = min(s0 + r.per, p_t + 1);
    const int *table = tables + (size_t)seq_rows[t] * max_pages;
    const int kv_k = n_kv * hd_k, kv_v = n_kv * hd_v;
    const int kpt = 1 << kpt_log2, chunk = ATT_CHUNK >> kpt_log2;
    const int key = tid >> kpt_log2, kpart = tid & (kpt - 1);
    const int slot_first = s0 + key < s1 ? table[(s0 + key) / page_size] * page_size + (s0 + key) % page_size : 0;
    if (kpart == 0) slot_s[key] = slot_first;  // read by the value loads of the first chunk
    pdl_wait();

    if (k_new) {
        // splits are [first + i * per, ...) clipped to p_t + 1: p_t lies in exactly one, and every
        // (token, kv head, head chunk) has a block of it
        const bool own = s0 <= p_t && p_t < s1;
        const i64 slot = own ? slots[t] : 0;
        fold_qkv_post(qs, ks, cs, sn, q + ((size_t)t * n_head + h0) * hd_k,
                      own ? k_new + (size_t)t * kv_k + (size_t)g * hd_k : nullptr,
                      v_new + (size_t)t * kv_v + (size_t)g * hd_v, k_cache + slot * kv_k + (size_t)g * hd_k,
                      v_cache + slot * kv_v + (size_t)g * hd_v, q_norm, k_norm, eps, rp, gh, hd_k, hd_v, scale);
    } else {
        for (int i = tid; i < gh * hd_k; i += ATT_THREADS)
            qs[i] = q[((size_t)t * n_head + h0 + i / hd_k) * hd_k + i % hd_k] * scale;
    }
    if (tid < ATT_HEADS) m_s[tid] = NEG_INF, l_s[tid] = 0.f;

    // value-phase layout: thread = (key group kg, value pair dp)
    const int n_pairs = hd_v / 2, n_kg = max(1, ATT_THREADS / n_pairs);
    const int kg = tid / n_pairs, dp = tid % n_pairs;
    const bool pv_active = kg < n_kg;
    float acc[ATT_HEADS][2];
#pragma unroll
    for (int h = 0; h < ATT_HEADS; h++) acc[h][0] = acc[h][1] = 0.f;
    __syncthreads();

    for (int c0 = s0; c0 < s1; c0 += chunk) {
        const int n_c = min(chunk, s1 - c0);
        // The first chunk's values (its slots known since before the wait) are loaded with its keys,
        // not after the scores: one round trip to memory less (decode splits are one chunk).
        const bool first_chunk = c0 == s0;
        u32 vpre[ATT_VPRE];
        if (first_chunk && pv_active) {
#pragma unroll
            for (int i = 0; i < ATT_VPRE; i++) {
                const int j = kg + i * n_kg;
                vpre[i] = j < n_c ? *(const u32 *)(v_cache + (size_t)slot_s[j] * kv_v + (size_t)g * hd_v + 2 * dp) : 0u;
            }
        }
        float s[ATT_HEADS];
#pragma unroll
        for (int h = 0; h < ATT_HEADS; h++) s[h] = 0.f;
        if (key < n_c) {  // scores of key c0 + key for each head
            const int p = c0 + key;
            const int slot = first_chunk ? slot_first : table[p / page_size] * page_size + p % page_size;
            if (kpart == 0 && !first_chunk) slot_s[key] = slot;
            attn_key_scores(s, qs, k_cache, (size_t)slot, g, hd_k, kv_k, kpart, kpt, gh);
        }
        for (int o = 1; o < kpt; o <<= 1)  // the key's threads are adjacent lanes
#pragma unroll
            for (int h = 0; h < ATT_HEADS; h++) s[h] += __shfl_xor_sync(FULL_MASK, s[h], o);
        if (kpart == 0) {
#pragma unroll
            for (int h = 0; h < ATT_HEADS; h++) {
                if (h >= gh) break;
                sc[h][key] = key >= n_c ? NEG_INF : softcap > 0.f ? softcap * tanhf(s[h] / softcap) : s[h];
            }
        }
        __syncthreads();
        attn_softmax(sc, m_s, l_s, alpha_s, gh, chunk);
        __syncthreads();
        if (pv_active) {
#pragma unroll
            for (int h = 0; h < ATT_HEADS; h++) {
                if (h >= gh) break;
                acc[h][0] *= alpha_s[h];
                acc[h][1] *= alpha_s[h];
            }
            auto add_value = [&](int j, u32 vv) {
                const float v0 = h2f((u16)(vv & 0xFFFFu)), v1 = h2f((u16)(vv >> 16));
#pragma unroll
                for (int h = 0; h < ATT_HEADS; h++) {
                    if (h >= gh) break;
                    const float pr = sc[h][j];
                    acc[h][0] += pr * v0;
                    acc[h][1] += pr * v1;
                }
            };
            int j = kg;
            if (first_chunk) {
#pragma unroll
                for (int i = 0; i < ATT_VPRE; i++, j += n_kg) {
                    if (j >= n_c) break;
                    add_value(j, vpre[i]);
                }
            }
#pragma unroll 8
            for (; j < n_c; j += n_kg)
                add_value(j, *(const u32 *)(v_cache + (size_t)slot_s[j] * kv_v + (size_t)g * hd_v + 2 * dp));
        }
        __syncthreads();
    }

    // Sum the key groups' partial outputs (qs is free now): red[(kg * gh + h) * hd_v + d].
    float *red = qs;
    if (pv_active) {
#pragma unroll
        for (int h = 0; h < ATT_HEADS; h++) {
            if (h >= gh) break;
            red[(kg * gh + h) * hd_v + 2 * dp] = acc[h][0];
            red[(kg * gh + h) * hd_v + 2 * dp + 1] = acc[h][1];
        }
    }
    __syncthreads();
    attn_write(red, b, r, m_s, l_s, out, part, xq, n_head, hd_v, n_split, n_kg, sinks);
    if (r.in_cluster) {
        cluster_merge<CL>(red, m_s, l_s, out, xq, t, h0, gh, n_head, hd_v, r.n_used, b.split, sinks);
        return;
    }
    if (r.n_used > 1 && counters && last_split(counters, t, r.n_used, &last_s)) {
        if (r.n_used <= 8)
            merge_splits<8>(part, out, xq, t, h0, gh, n_head, hd_v, n_split, r.n_used, &sc[0][0], sinks);
        else
            merge_splits<32>(part, out, xq, t, h0, gh, n_head, hd_v, n_split, r.n_used, &sc[0][0], sinks);
    }
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn(ATTN_PARAMS) { attn_body<0>(ATTN_ARGS); }

#if CLUSTERS_OK
extern "C" __global__ void __cluster_dims__(8, 1, 1) __launch_bounds__(ATT_THREADS) attn_cluster8(ATTN_PARAMS) {
    attn_body<8>(ATTN_ARGS);
}
// 16 blocks a cluster is past the portable size: the host allows it on the function first
extern "C" __global__ void __cluster_dims__(16, 1, 1) __launch_bounds__(ATT_THREADS) attn_cluster16(ATTN_PARAMS) {
    attn_body<16>(ATTN_ARGS);
}
#endif

// A thread's values of the first PRE splits, loaded at once (past n_split or hd_v: 0).
template <int PRE>
__device__ __forceinline__ void combine_load(float (&v)[PRE], const float *base, int stride, int n_split, int d,
                                             int hd_v) {
#pragma unroll
    for (int s = 0; s < PRE; s++) v[s] = s < n_split && d < hd_v ? base[(size_t)s * stride + 2 + d] : 0.f;
}

// Merge the splits of attn: part (n_tok, n_head, n_split, 2 + hd_v) -> out (n_tok, n_head, hd_v),
// and quantized into xq when set (hd_v % 32 == 0; q8_store_warp's format over rows of n_head * hd_v).
// grid (n_head, n_tok), n_split <= 32. Empty splits carry max -inf and sum 0. The first warp turns
// the splits' (max, sum) into weights; then every output value is one pass over the splits.
// attn_combine: PRE = 8 (batched decode steps, whose tile splits are at most 8: the block per
// (head, token) is short work, and more predicated loads cost more than they hide);
// attn_combine32: PRE = 32 (one sequence's many splits of a long key range).
template <int PRE>
__device__ __forceinline__ void combine_body(const float *__restrict__ part, float *__restrict__ out, int n_head,
                                             int hd_v, int n_split, u8 *__restrict__ xq,
                                             const float *__restrict__ sinks) {
    PDL_ENTER();
    __shared__ float wgt[32];
    const int h = blockIdx.x, t = blockIdx.y, stride = hd_v + 2;
    const float *base = part + ((size_t)t * n_head + h) * n_split * stride;
    // the thread's first value of the first PRE splits, loaded before the weights are known (one
    // round trip for both)
    float v[PRE];
    combine_load<PRE>(v, base, stride, n_split, threadIdx.x, hd_v);
    if (threadIdx.x < 32) {
        const int s = threadIdx.x;
        const float ms = s < n_split ? base[(size_t)s * stride] : NEG_INF;
        const float ls = s < n_split ? base[(size_t)s * stride + 1] : 0.f;
        const float m = warp_max(ms);  // finite: the first split is never empty
        const float e = s < n_split ? expf(ms - m) : 0.f;
        const float den = warp_sum(e * ls) + sink_term(sinks, h, m);
        wgt[s] = e / den;
    }
    __syncthreads();
    for (int d = threadIdx.x; d < hd_v; d += blockDim.x) {
        if (d != threadIdx.x) combine_load<PRE>(v, base, stride, n_split, d, hd_v);
        float num = 0.f;
#pragma unroll
        for (int s = 0; s < PRE; s++)
            if (s < n_split) num += wgt[s] * v[s];
#pragma unroll 8
        for (int s = PRE; s < n_split; s++) num += wgt[s] * base[(size_t)s * stride + 2 + d];
        const size_t at = ((size_t)t * n_head + h) * hd_v + d;
        out[at] = num;
        if (xq) q8_store_warp(num, at, xq, (float4 *)(xq + (size_t)gridDim.y * n_head * hd_v));
    }
}

extern "C" __global__ void attn_combine(const float *__restrict__ part, float *__restrict__ out, int n_head,
                                        int hd_v, int n_split, u8 *__restrict__ xq,
                                        const float *__restrict__ sinks) {
    combine_body<8>(part, out, n_head, hd_v, n_split, xq, sinks);
}

extern "C" __global__ void attn_combine32(const float *__restrict__ part, float *__restrict__ out, int n_head,
                                          int hd_v, int n_split, u8 *__restrict__ xq,
                                          const float *__restrict__ sinks) {
    combine_body<32>(part, out, n_head, hd_v, n_split, xq, sinks);
}

#endif  // ATT_TILE_HD == 0

// ---- steps of many tokens per sequence: tensor-core tiles (flash attention) ----
//
// attn_tile<HD> (hd_k == hd_v == HD): one block per (query tile, kv head and head chunk, split of
// the key range: with n_split > 1 each writes attn's partial form to part, merged by attn_combine); 4 warps,
// each owning 16 query rows. A tile is a run of up to AT_ROWS / min(group, 8) consecutive tokens of
// one sequence, so its rows (token, query head) share one page table and kv head: the step's
// tokens are cut where the sequence changes and at multiples of that length, and block x takes
// the x-th piece (blocks past the last piece return). Each sequence's tokens must be contiguous
// in the step (the host checks). Keys and values stream through shared memory in chunks of BK
// (cp.async, two stages); scores and outputs are mma.sync m16n8k16 with f32 accumulation. Keys and
// values are f16 already; q * scale is split into f16 high and low parts (two products, so that
// large scores keep f32-like accuracy), the probabilities are rounded to f16. Online softmax in
// registers.
// Dynamic shared memory: attn_tile_smem(HD) bytes. CUDA only (sm_80+): ROCm takes attn.

#if !defined(__HIP_PLATFORM_AMD__) && !defined(__HIPCC__) && ATT_TILE_HD > 0
#define AT_ROWS 64

// Four 8x8 f16 matrices from shared memory, transposed: lanes 8i..8i+7 give matrix i's rows.
__device__ __forceinline__ void ldsm_x4_t(u32 *r, const void *p) {
    const u32 s = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

// The block's piece of the step: tokens [*t0, *t1); false when there is none.
__device__ __forceinline__ bool tile_of_block(const int *__restrict__ seq_rows, int n, int per_tile, int *t0,
                                              int *t1, int *scan) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int per = (n + ATT_THREADS - 1) / ATT_THREADS, a0 = min(n, tid * per), a1 = min(n, a0 + per);
    int c = 0;
    for (int t = a0; t < a1; t++) c += t == 0 || t % per_tile == 0 || seq_rows[t] != seq_rows[t - 1];
    int incl = c;
    for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += v;
    }
    if (lane == 31) scan[warp] = incl;
    __syncthreads();
    int before = incl - c, total = 0;
    for (int w = 0; w < ATT_THREADS / 32; w++) {
        before += w < warp ? scan[w] : 0;
        total += scan[w];
    }
    const int b = blockIdx.x;
    if (b >= total) return false;
    // the thread whose share holds cut b (and the one holding cut b + 1) writes it
    if (b + 1 >= before && b < before + c + 1) {
        int k = before;
        for (int t = a0; t < a1; t++) {
            if (t == 0 || t % per_tile == 0 || seq_rows[t] != seq_rows[t - 1]) {
                if (k == b) *t0 = t;
                if (k == b + 1) *t1 = t;
                k++;
            }
        }
    }
    if (tid == 0 && b + 1 == total) *t1 = n;
    __syncthreads();
    return true;
}

template <int HD, int BK>
__device__ __forceinline__ void attn_tile_body(const float *__restrict__ q, const u16 *__restrict__ k_cache,
                                               const u16 *__restrict__ v_cache, float *__restrict__ out,
                                               const int *__restrict__ pos, const int *__restrict__ seq_rows,
                                               const int *__restrict__ tables, int max_pages, int page_size,
                                               int n, int n_head, int n_kv, int window, float scale,
                                               float softcap, float *__restrict__ part, int n_split,
                                               const float *__restrict__ sinks) {
    constexpr int LD = HD + 8;         // shared row stride in halves: conflict-free fragment loads
    constexpr int NB = BK / 8;         // score fragments per row
    constexpr int ND = HD / 8;         // output fragments per row
    constexpr int CH = HD / 8;         // 16-byte pieces per key row
    extern __shared__ __align__(16) u16 at_smem[];
    u16 *const qs = at_smem;                // (AT_ROWS, LD) q * scale, f16 high part
    u16 *const ql = qs + AT_ROWS * LD;      // (AT_ROWS, LD) the low part: q * scale - qs
    u16 *const ks = ql + AT_ROWS * LD;      // (2, BK, LD) keys, two stages
    u16 *const vs = ks + 2 * BK * LD;       // (2, BK, LD) values
    __shared__ int scan[ATT_THREADS / 32], tile_s[2], lo_s, hi_s, tok_pos[AT_ROWS];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g8 = lane >> 2, tq = lane & 3;
    const int group = n_head / n_kv, n_hc = (group + ATT_HEADS - 1) / ATT_HEADS;
    const int kvh = blockIdx.y / n_hc, hc = blockIdx.y % n_hc;
    const int h0 = kvh * group + hc * ATT_HEADS, gh = min(ATT_HEADS, group - hc * ATT_HEADS);
    const int per_tile = AT_ROWS / min(group, ATT_HEADS);

    // the step's positions, rows and page tables are inputs no kernel writes (see pdl_launch_next)
    pdl_launch_next();
    if (tid == 0) lo_s = 0x7fffffff, hi_s = -1;
    if (!tile_of_block(seq_rows, n, per_tile, &tile_s[0], &tile_s[1], scan)) return;
    const int t0 = tile_s[0], n_t = tile_s[1] - t0;
    if (tid < n_t) {
        const int p = pos[t0 + tid];
        tok_pos[tid] = p;
        atomicMin(&lo_s, window > 0 ? max(0, p - window + 1) : 0);
        atomicMax(&hi_s, p);
    }
    const int *table = tables + (size_t)seq_rows[t0] * max_pages;
    __syncthreads();
    const int k_lo = lo_s, k_hi = hi_s, n_rows = n_t * gh;
    const size_t kv_stride = (size_t)n_kv * HD;
    const u16 *kc = k_cache + (size_t)kvh * HD, *vc = v_cache + (size_t)kvh * HD;

    constexpr int PER = BK * CH / ATT_THREADS;  // 16-byte pieces of a chunk per thread (keys; values alike)
    auto load_kv = [&](int stage, int c0) {  // keys c0 .. c0 + BK - 1 (zeros past k_hi)
        // every page-table read first, then the copies: one trip to memory, not one per piece
        size_t at[PER];
        int bytes[PER];
#pragma unroll
        for (int m = 0; m < PER; m++) {
            const int i = tid + m * ATT_THREADS, p = c0 + i / CH, in = p <= k_hi;
            const size_t slot = in ? (size_t)table[p / page_size] * page_size + p % page_size : 0;
            at[m] = slot * kv_stride + 8 * (i % CH);
            bytes[m] = in ? 16 : 0;
        }
#pragma unroll
        for (int m = 0; m < PER; m++) {
            const int i = tid + m * ATT_THREADS, to = (stage * BK + i / CH) * LD + 8 * (i % CH);
            cp_async16(ks + to, kc + at[m], bytes[m]);
            cp_async16(vs + to, vc + at[m], bytes[m]);
        }
        cp_async_commit();
    };
    // this block's share of the key chunks (blockIdx.z of n_split; a share may be empty)
    const int all_chunks = (k_hi - k_lo) / BK + 1, share = (all_chunks + n_split - 1) / n_split;
    const int first_chunk = min(all_chunks, (int)blockIdx.z * share);
    const int n_chunks = min(all_chunks, first_chunk + share) - first_chunk, c_first = k_lo + first_chunk * BK;
    pdl_wait();
    if (n_chunks > 0) load_kv(0, c_first);
    for (int i = tid; i < AT_ROWS * CH; i += ATT_THREADS) {  // q rows (token, head), scaled, as f16 hi + lo
        const int r = i / CH, c = i % CH;
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (r < n_rows) {
            const float4 *src = (const float4 *)(q + ((size_t)(t0 + r / gh) * n_head + h0 + r % gh) * HD + 8 * c);
            const float4 a = src[0], b = src[1];
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        }
        u32 hi[4], lo[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float x0 = v[2 * j] * scale, x1 = v[2 * j + 1] * scale;
            hi[j] = pack_h2(x0, x1);
            lo[j] = pack_h2(x0 - h2f((u16)(hi[j] & 0xFFFFu)), x1 - h2f((u16)(hi[j] >> 16)));
        }
        *(uint4 *)(qs + r * LD + 8 * c) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        *(uint4 *)(ql + r * LD + 8 * c) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }

    // this thread's two rows: r_lo = 16 warp + g8 and r_lo + 8; a row past the tile sees no key
    const int r_lo = 16 * warp + g8;
    int p_r[2], f_r[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = r_lo + 8 * h;
        p_r[h] = r < n_rows ? tok_pos[r / gh] : -1;
        f_r[h] = window > 0 ? p_r[h] - window + 1 : 0;
    }
    float o[ND][4], m_r[2] = {NEG_INF, NEG_INF}, l_r[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < ND; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

    for (int it = 0; it < n_chunks; it++) {
        const int st = it & 1, c0 = c_first + it * BK;
        if (it + 1 < n_chunks) {
            load_kv(st ^ 1, c0 + BK);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const u16 *kt = ks + st * BK * LD, *vt = vs + st * BK * LD;

        float s[NB][4];
#pragma unroll
        for (int i = 0; i < NB; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < HD; kk += 16) {
            u32 a[4], al[4];
            const int q0 = r_lo * LD + kk + 2 * tq, q1 = q0 + 8 * LD;
            a[0] = *(const u32 *)(qs + q0), a[1] = *(const u32 *)(qs + q1);
            a[2] = *(const u32 *)(qs + q0 + 8), a[3] = *(const u32 *)(qs + q1 + 8);
            al[0] = *(const u32 *)(ql + q0), al[1] = *(const u32 *)(ql + q1);
            al[2] = *(const u32 *)(ql + q0 + 8), al[3] = *(const u32 *)(ql + q1 + 8);
#pragma unroll
            for (int nb = 0; nb < NB; nb++) {
                const u16 *kr = kt + (8 * nb + g8) * LD + kk + 2 * tq;
                const u32 b0 = *(const u32 *)kr, b1 = *(const u32 *)(kr + 8);
                mma_16816(s[nb], a, b0, b1);
                mma_16816(s[nb], al, b0, b1);
            }
        }

        // mask (causal, window), softcap, online softmax over the chunk
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1, key = c0 + 8 * nb + 2 * tq + (e & 1);
                float v = s[nb][e];
                if (softcap > 0.f) v = softcap * tanhf(v / softcap);
                v = key >= f_r[h] && key <= p_r[h] ? v : NEG_INF;
                s[nb][e] = v;
                mx[h] = fmaxf(mx[h], v);
            }
        float alpha[2], sum[2] = {0.f, 0.f}, ref[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL_MASK, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(FULL_MASK, mx[h], 2));
            const float m_new = fmaxf(m_r[h], mx[h]);
            ref[h] = m_new == NEG_INF ? 0.f : m_new;  // no key yet: exp(-inf - 0) = 0, never nan
            alpha[h] = __expf(m_r[h] - ref[h]);
            m_r[h] = m_new;
        }
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[nb][e] = __expf(s[nb][e] - ref[e >> 1]);
                sum[e >> 1] += s[nb][e];
            }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            sum[h] += __shfl_xor_sync(FULL_MASK, sum[h], 1);
            sum[h] += __shfl_xor_sync(FULL_MASK, sum[h], 2);
            l_r[h] = l_r[h] * alpha[h] + sum[h];
        }
#pragma unroll
        for (int i = 0; i < ND; i++) o[i][0] *= alpha[0], o[i][1] *= alpha[0], o[i][2] *= alpha[1], o[i][3] *= alpha[1];

        // o += p v: the score fragments of keys 16kb.. are the A fragments of that k-step
#pragma unroll
        for (int kb = 0; kb < BK / 16; kb++) {
            const u32 a[4] = {pack_h2(s[2 * kb][0], s[2 * kb][1]), pack_h2(s[2 * kb][2], s[2 * kb][3]),
                              pack_h2(s[2 * kb + 1][0], s[2 * kb + 1][1]), pack_h2(s[2 * kb + 1][2], s[2 * kb + 1][3])};
            const u16 *vrow = vt + (16 * kb + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + 8 * (lane >> 4);
#pragma unroll
            for (int dp = 0; dp < ND / 2; dp++) {
                u32 b[4];
                ldsm_x4_t(b, vrow + 16 * dp);
                mma_16816(o[2 * dp], a, b[0], b[1]);
                mma_16816(o[2 * dp + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();  // the stage is refilled next
    }

    // n_split 1: the output; else this split's (max, sum, unnormalised output) for attn_combine
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = r_lo + 8 * h;
        if (r >= n_rows) continue;
        const size_t row = (size_t)(t0 + r / gh) * n_head + h0 + r % gh;
        float *dst, mul = 1.f;
        if (n_split == 1) {
            dst = out + row * HD + 2 * tq;
            const float den = l_r[h] + sink_term(sinks, h0 + r % gh, m_r[h]);
            mul = l_r[h] > 0.f ? 1.f / den : 0.f;
        } else {
            float *base = part + (row * n_split + blockIdx.z) * (HD + 2);
            if (tq == 0) base[0] = m_r[h], base[1] = l_r[h];
            dst = base + 2 + 2 * tq;
        }
#pragma unroll
        for (int i = 0; i < ND; i++) *(float2 *)(dst + 8 * i) = make_float2(o[i][2 * h] * mul, o[i][2 * h + 1] * mul);
    }
}

#define ATTN_TILE_PARAMS                                                                                          \
    const float *__restrict__ q, const u16 *__restrict__ k_cache, const u16 *__restrict__ v_cache,               \
        float *__restrict__ out, const int *__restrict__ pos, const int *__restrict__ seq_rows,                  \
        const int *__restrict__ tables, int max_pages, int page_size, int n, int n_head, int n_kv, int window, \
        float scale, float softcap, float *__restrict__ part, int n_split, const float *__restrict__ sinks
#define ATTN_TILE_ARGS \
    q, k_cache, v_cache, out, pos, seq_rows, tables, max_pages, page_size, n, n_head, n_kv, window, scale, softcap, part, \
        n_split, sinks
#if ATT_TILE_HD == 64
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_tile64(ATTN_TILE_PARAMS) {
    attn_tile_body<64, 64>(ATTN_TILE_ARGS);
}
#endif
#if ATT_TILE_HD == 128
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_tile128(ATTN_TILE_PARAMS) {
    attn_tile_body<128, 64>(ATTN_TILE_ARGS);
}
#endif
#if ATT_TILE_HD == 256
extern "C" __global__ void __launch_bounds__(ATT_THREADS) attn_tile256(ATTN_TILE_PARAMS) {
    attn_tile_body<256, 32>(ATTN_TILE_ARGS);
}
#endif
#endif
