// Grouped expert products of a mixture-of-experts layer, for weights of type QT (quant.cuh).
//
// W (n_expert, m, k) stacked in GGUF blocks; ids (n_sel,) the expert of each selection (a token's
// choice: selection s = t * n_used + u); y (n_sel, m): y[s] = W[ids[s]] @ x[s / x_div] (x_div = n_used:
// a token's input shared by its experts; 1: a row each), plus b[ids[s]] where the stack has biases b
// (n_expert, m) f32 (gpt-oss; null: none). The expert ids are read on the device: no
// host round trip, and every launch has a shape fixed by the step's size (capturable).
//
// Quantized types read x quantized by quant_x (ops.cu): xq (n_x, k) int8, then (n_x, k/32) float4
// (d, d * sum of q[0..15], d * sum of q[16..31], 0) -- the dense decode products' format. A unit
// of 32 weights decodes to int8 q with a scale a and offset b per half (unit_q), so a half's part
// of a dot product is  a * d * (q . xq) + b * (d * sum xq):  one integer dot product of 16 bytes.
//
//   expert_mv   (decode: a few tokens) a block per (rows, chosen expert) lists the selections of
//               its expert, stages their quantized x in shared memory once, and each warp decodes
//               its rows' slices once for all of them (dp4a).
//   expert_group + expert_tile (prompts, many tokens) the selections sorted by expert on the device
//               and cut into tiles of ET_TOK; a block computes ET_ROWS rows of one expert for one
//               tile, its weight units decoded once into shared memory (int8 + scales), the tile's
//               x staged beside them, int8 tensor-core products (mma.sync; dp4a on HIP and GPUs
//               before sm_80), each unit's integer sums scaled into f32.
//   expert_matmul (float types) a warp per row, float dot products.

#define EXP_ROWS 8     // expert_matmul: rows per block, one a warp
#define EXP_LIST 1024  // expert_matmul, expert_mv: selections listed at a time

// The selections s in [base, end) that chose expert e (ids[s] == e), listed in shared memory by the
// whole block (in no fixed order); returns how many, to every thread. count: a shared counter.
DEVI int list_selections(const int *__restrict__ ids, int base, int end, int e, int *list, int *count) {
    if (threadIdx.x == 0) *count = 0;
    __syncthreads();
    for (int s = base + threadIdx.x; s < end; s += blockDim.x)
        if (ids[s] == e) list[atomicAdd(count, 1)] = s;
    __syncthreads();
    return *count;
}

// The slot-th smallest expert id among ids[0, n_sel) (each chosen expert counted once), or -1 where
// fewer than slot + 1 experts were chosen; to every thread of the block. Ids outside [0, n_expert)
// count for none. chosen: EXP_MAX_EXPERTS / 32 shared words; picked: a shared int.
#define EXP_MAX_EXPERTS 1024  // as EG_MAX_EXPERTS: the backend takes no stack of more
DEVI int chosen_expert(const int *__restrict__ ids, int n_sel, int n_expert, int slot, unsigned *chosen,
                       int *picked) {
    if (threadIdx.x < EXP_MAX_EXPERTS / 32) chosen[threadIdx.x] = 0u;
    if (threadIdx.x == 0) *picked = -1;
    __syncthreads();
    for (int s = threadIdx.x; s < n_sel; s += blockDim.x) {
        const int e = ids[s];
        if (e >= 0 && e < n_expert && e < EXP_MAX_EXPERTS) atomicOr(&chosen[e >> 5], 1u << (e & 31));
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // at most 32 words: one thread counts its way to the slot
        for (int w = 0, before = 0; w < EXP_MAX_EXPERTS / 32; w++) {
            const unsigned bits = chosen[w];
            const int here = __popc(bits);
            if (slot < before + here) {
                unsigned b = bits;
                for (int skip = slot - before; skip > 0; skip--) b &= b - 1;  // drop the lower set bits
                *picked = 32 * w + __ffs((int)b) - 1;
                break;
            }
            before += here;
        }
    }
    __syncthreads();
    return *picked;
}

// ---- float weights (F32, F16, BF16) ----
extern "C" __global__ void expert_matmul(const u8 *__restrict__ w, i64 row_bytes, i64 expert_bytes, int m, int k,
                                         const float *__restrict__ x, int x_div, const int *__restrict__ ids,
                                         int n_sel, float *__restrict__ y, const float *__restrict__ bias) {
    PDL_ENTER();
    __shared__ int list[EXP_LIST];
    __shared__ int count;
    const int e = blockIdx.y, lane = threadIdx.x & 31;
    const int r = blockIdx.x * EXP_ROWS + (threadIdx.x >> 5);
    const u8 *row = w + (i64)e * expert_bytes + (i64)r * row_bytes;
    for (int base = 0; base < n_sel; base += EXP_LIST) {
        const int listed = list_selections(ids, base, min(n_sel, base + EXP_LIST), e, list, &count);
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
            if (lane == 0) y[(i64)s * m + r] = acc + (bias ? bias[(i64)e * m + r] : 0.f);
        }
        __syncthreads();  // the list is refilled
    }
}

#if !(QT == T_F32 || QT == T_F16 || QT == T_BF16)
constexpr int EXP_SPL = QT == T_Q4_K || QT == T_Q5_K ? 2 : 1;  // slices a lane step (slice2_q)

// A 16-value half's share of a dot product: int8 weights q (4 words) against int8 x (4 words),
// weight scale a and offset b, x scale d and d * sum(x half).
DEVI float half_dot(const int *q, int4 xv, float a, float b, float d, float xs) {
    int s = dp4a(q[0], xv.x, 0);
    s = dp4a(q[1], xv.y, s);
    s = dp4a(q[2], xv.z, s);
    s = dp4a(q[3], xv.w, s);
    return d * a * (float)s + b * xs;
}

// ---- decode: expert_mv ----
//
// Grid (ceil(m / rows a block), min(n_expert, n_sel), 1 or 2), EMV_WARPS warps: blocks of z = 1 take the second
// matrix (w_b, y_b, bias_b: a stack of the same type and shape, as gate and up), so a step's two latency-bound
// products share one launch. Block (tile, slot) takes the
// slot-th chosen expert e (chosen_expert, where fewer selections than experts leave most experts
// unchosen; past the chosen ones it returns), else expert slot; lists the selections that chose e
// (none: it returns, e's weights untouched), then, group by group of at most `group` (<= EMV_NMAX)
// selections: stages their rows of xq in dynamic shared memory (group * (k + k/32 * 16)
// bytes: the values, then the float4s), and each team of 2^team_log2 lanes (a warp, or less for short
// rows: experts.py mv_team_log2) takes EMV_RW rows, a lane per lane step of slices as the dense decode
// products (slice_q / slice2_q), each slice decoded once and dotted with every staged row; a block
// covers EMV_WARPS * (32 >> team_log2) * EMV_RW rows. x_rows: the rows of xq (its float4s follow them).
#define EMV_WARPS 8
#define EMV_RW 2  // rows a warp: two rows' loads in flight together
#define EMV_NMAX 8
// Blocks a multiprocessor keeps resident (registers capped to fit them): as many as each type's kernel
// had before the teams' run-time width added registers (Q4_K 80 -> 92: two blocks where it had three;
// a compile-time width, four instances, took more). Q6_K at three spills 8 bytes (88 registers uncapped).
#define EMV_MIN_BLOCKS (QT == T_Q5_K || QT == T_TQ1_0 ? 2 : QT == T_Q2_K || QT == T_Q3_K || QT == T_Q4_K || QT == T_Q6_K ? 3 : 4)

extern "C" __global__ void __launch_bounds__(32 * EMV_WARPS, EMV_MIN_BLOCKS)
    expert_mv(const u8 *__restrict__ w, i64 row_bytes, i64 expert_bytes, int m, int k, const u8 *__restrict__ xq,
              int x_rows, int x_div, const int *__restrict__ ids, int n_sel, int n_expert, int group,
              float *__restrict__ y, const float *__restrict__ bias, const u8 *__restrict__ w_b,
              float *__restrict__ y_b, const float *__restrict__ bias_b, int team_log2) {
    PDL_ENTER();
    if (blockIdx.z) w = w_b, y = y_b, bias = bias_b;
    extern __shared__ __align__(16) u8 xs_s[];  // (group, k) int8, then (group, k/32) float4
    __shared__ int list[EXP_LIST];
    __shared__ int count;
    __shared__ unsigned chosen[EXP_MAX_EXPERTS / 32];
    __shared__ int picked;  // apart from count: a thread may list selections while others still read it
    // a slot per expert (as many selections as experts or more): block y takes expert y, as a grid over
    // every expert did, without the search (which cost ~10% at 16 tokens of Qwen3-30B-A3B)
    const int e = n_sel < n_expert ? chosen_expert(ids, n_sel, n_expert, blockIdx.y, chosen, &picked) : (int)blockIdx.y;
    if (e < 0) return;  // the whole block: fewer experts were chosen than the grid has slots
    // the expert's bias row (null: none), kept in shared memory: registers held through the loop below
    // would cost blocks a multiprocessor; lane 0's sums start from it
    __shared__ const float *bias_s;
    if (threadIdx.x == 0) bias_s = bias ? bias + (i64)e * m : nullptr;
    const int TW = 1 << team_log2, lane = threadIdx.x & (TW - 1), team = threadIdx.x >> team_log2;
    const int r0 = (blockIdx.x * (blockDim.x >> team_log2) + team) * EMV_RW, S = k / 32;
    const u8 *rows[EMV_RW];
    bool ok[EMV_RW];
#pragma unroll
    for (int i = 0; i < EMV_RW; i++) {
        ok[i] = r0 + i < m;
        rows[i] = w + (i64)e * expert_bytes + (i64)(ok[i] ? r0 + i : 0) * row_bytes;
    }
    const float4 *meta_g = (const float4 *)(xq + (size_t)x_rows * k);
    float4 *meta_s = (float4 *)(xs_s + (size_t)group * k);
    for (int base = 0; base < n_sel; base += EXP_LIST) {
        const int listed = list_selections(ids, base, min(n_sel, base + EXP_LIST), e, list, &count);
        for (int j0 = 0; j0 < listed; j0 += group) {
            const int nl = min(group, listed - j0);
            // the group's x rows: k / 16 uint4 of values and k / 32 float4 each
            for (int i = threadIdx.x; i < nl * (k / 16); i += blockDim.x) {
                const int j = i / (k / 16), c = i % (k / 16);
                const size_t xr = (size_t)(list[j0 + j] / x_div);
                ((uint4 *)(xs_s + (size_t)j * k))[c] = ((const uint4 *)(xq + xr * k))[c];
            }
            for (int i = threadIdx.x; i < nl * S; i += blockDim.x) {
                const int j = i / S, c = i % S;
                meta_s[(size_t)j * S + c] = meta_g[(size_t)(list[j0 + j] / x_div) * S + c];
            }
            __syncthreads();
            float acc[EMV_RW][EMV_NMAX];
            const float *bias_e = bias_s;  // (written before the staging's barrier)
#pragma unroll
            for (int i = 0; i < EMV_RW; i++) {
                const float b = lane == 0 && ok[i] && bias_e ? bias_e[r0 + i] : 0.f;
#pragma unroll
                for (int j = 0; j < EMV_NMAX; j++) acc[i][j] = b;
            }
            for (int p = lane; p < S / EXP_SPL; p += TW) {
                QSlice q[EMV_RW][EXP_SPL];
#pragma unroll
                for (int i = 0; i < EMV_RW; i++) {
                    if (!ok[i]) continue;
                    if constexpr (EXP_SPL == 2) slice2_q<QT>(rows[i], p, q[i][0], q[i][1]);
                    else slice_q<QT>(rows[i], p, q[i][0]);
                }
#pragma unroll
                for (int sp = 0; sp < EXP_SPL; sp++) {
                    int xo[2];
                    slice_offsets<QT>(EXP_SPL * p + sp, xo);
#pragma unroll
                    for (int j = 0; j < EMV_NMAX; j++) {
                        if (j >= nl) break;
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            const int at = j * k + xo[h];
                            const int4 xv = *(const int4 *)(xs_s + at);
                            const float4 mt = meta_s[at >> 5];
                            const float xsum = (xo[h] & 16) ? mt.z : mt.y;
#pragma unroll
                            for (int i = 0; i < EMV_RW; i++) {
                                const QSlice &qs = q[i][sp];
                                if (ok[i]) acc[i][j] += half_dot(&qs.q[4 * h], xv, qs.a[h], qs.b[h], mt.x, xsum);
                            }
                        }
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < EMV_RW; i++)
#pragma unroll
                for (int j = 0; j < EMV_NMAX; j++) {
                    if (j >= nl) break;
                    float v = acc[i][j];  // the team's sum (its lanes are neighbours in the warp)
                    for (int o = TW >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
                    if (lane == 0 && ok[i]) y[(i64)list[j0 + j] * m + r0 + i] = v;
                }
            __syncthreads();  // the staged rows are overwritten by the next group
        }
    }
}

// ---- prompts: expert_group, expert_tile ----
//
// expert_group (one block of EG_THREADS): order (n_sel,) = the selections sorted by expert (within
// an expert in no set order: each output is one thread's sum either way, the same bits); tiles
// (bound, 4) = (expert, first position in order, count <= ET_TOK, 0) for each ET_TOK selections of
// an expert; *n_tiles = how many. Ids outside [0, n_expert) are left out (their rows unwritten).
// n_expert <= EG_MAX_EXPERTS.
#define EG_THREADS 1024
#define EG_MAX_EXPERTS 1024
#define ET_ROWS 64  // weight rows of a tile
#define ET_TOK 32   // selections of a tile
#define ET_CH 8     // 32-value units staged at a time (one K-quant super-block)
#define ET_LD (32 * ET_CH + 16)  // bytes of a staged row: 272 (68 words) puts 8 rows' 16-byte loads on 32 banks
#define ET_THREADS 128
// Types whose units have one scale and offset for both halves (unit_q's set_ab): expert_tile sums a
// unit's 32 products in one integer before scaling (the others: each half apart).
// Types whose units have no offset (b = 0): their sums take no x-sum term.
constexpr bool ET_NO_OFFSET = QT == T_Q8_0 || QT == T_IQ4_NL || QT == T_IQ4_XS || QT == T_MXFP4;
constexpr bool ET_UNIT_SCALE = QT == T_Q4_0 || QT == T_Q4_1 || QT == T_Q5_0 || QT == T_Q5_1 || QT == T_Q8_0 ||
                               QT == T_Q4_K || QT == T_Q5_K || QT == T_IQ4_NL || QT == T_IQ4_XS || QT == T_MXFP4;

extern "C" __global__ void __launch_bounds__(EG_THREADS)
    expert_group(const int *__restrict__ ids, int n_sel, int n_expert, int *__restrict__ order,
                 int4 *__restrict__ tiles, int *__restrict__ n_tiles) {
    PDL_ENTER();
    __shared__ int cnt[EG_MAX_EXPERTS], off[EG_MAX_EXPERTS], toff[EG_MAX_EXPERTS], fill[EG_MAX_EXPERTS];
    const int tid = threadIdx.x;
    for (int e = tid; e < n_expert; e += blockDim.x) cnt[e] = 0, fill[e] = 0;
    __syncthreads();
    for (int s = tid; s < n_sel; s += blockDim.x) {
        const int e = ids[s];
        if (e >= 0 && e < n_expert) atomicAdd(&cnt[e], 1);
    }
    __syncthreads();
    if (tid < 32) {  // exclusive sums of the counts and of the tiles, each lane a run of experts
        const int per = (n_expert + 31) / 32, e0 = tid * per, e1 = min(n_expert, e0 + per);
        int c = 0, t = 0;
        for (int e = e0; e < e1; e++) c += cnt[e], t += (cnt[e] + ET_TOK - 1) / ET_TOK;
        int cs = c, ts = t;  // inclusive over lanes
        for (int o = 1; o < 32; o <<= 1) {
            const int cu = __shfl_up_sync(FULL_MASK, cs, o), tu = __shfl_up_sync(FULL_MASK, ts, o);
            if (tid >= o) cs += cu, ts += tu;
        }
        c = cs - c, t = ts - t;
        for (int e = e0; e < e1; e++) {
            off[e] = c, toff[e] = t;
            c += cnt[e], t += (cnt[e] + ET_TOK - 1) / ET_TOK;
        }
        if (tid == 31) *n_tiles = ts;
    }
    __syncthreads();
    for (int s = tid; s < n_sel; s += blockDim.x) {
        const int e = ids[s];
        if (e >= 0 && e < n_expert) order[off[e] + atomicAdd(&fill[e], 1)] = s;
    }
    for (int e = tid; e < n_expert; e += blockDim.x)
        for (int i = 0; i * ET_TOK < cnt[e]; i++)
            tiles[toff[e] + i] = make_int4(e, off[e] + i * ET_TOK, min(ET_TOK, cnt[e] - i * ET_TOK), 0);
}

// The sums of a staged chunk (nu units) into acc, by one of two paths:
//   mma.sync (CUDA, sm_80+): warp w takes rows 16 w .. 16 w + 15 and the tile's selections in four
//     fragments of 8; m16n8k32 int8 products (lane = 4 g + q: acc[f][e] = row 16 w + g + 8 (e / 2),
//     selection 8 f + 2 q + e % 2); types of a scale per half take a product per half, the other
//     half's weights zero.
//   dp4a (HIP, older GPUs): thread (tid % 16, tid / 16) takes rows tid % 16 + 16 i and selections
//     tid / 16 + 8 j (acc[i][j]).
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800) || \
    defined(ET_DP4A)
#define ET_MMA 0
#else
#define ET_MMA 1
#endif

// The row and selection (within the tile) of acc[i][j].
DEVI void et_place(int i, int j, int &r, int &t) {
#if ET_MMA
    const int lane = threadIdx.x & 31;
    r = 16 * (threadIdx.x >> 5) + (lane >> 2) + 8 * (j >> 1);
    t = 8 * i + 2 * (lane & 3) + (j & 1);
#else
    r = (threadIdx.x & 15) + 16 * i;
    t = (threadIdx.x >> 4) + 8 * j;
#endif
}

#if ET_MMA && !defined(EMBER_HOST_TEST)
// c += a (16 x 32 int8, row-major fragments) * b (32 x 8 int8, column-major): mma.sync m16n8k32.
// a0 = A[g][4q .. 4q+3], a1 = A[g+8][4q ..], a2 = A[g][16+4q ..], a3 = A[g+8][16+4q ..];
// b0 = B[4q .. 4q+3][g], b1 = B[16+4q ..][g]; c0, c1 = C[g][2q], C[g][2q+1]; c2, c3 = C[g+8][2q], C[g+8][2q+1].
DEVI void mma_s8_16832(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

// acc + d * a * s + b * xs (a unit's integer sum s, its weight scale a and offset b, the x scale d and x sum xs),
// as two fused multiply-adds
DEVI float add_scaled(float acc, int s, float d, float a, float b, float xs) { return fmaf(d * a, (float)s, fmaf(b, xs, acc)); }

DEVI void et_sum(const u8 (*w_s)[ET_LD], const float4 (*ab_s)[ET_CH + 1], const u8 (*x_s)[ET_LD],
                 const float4 (*xm_s)[ET_CH], int nu, int cnt, float (&acc)[4][4]) {
#if ET_MMA
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, ra = 16 * (threadIdx.x >> 5) + g, rb = ra + 8;
    for (int u = 0; u < nu; u++) {
        const u8 *pa = &w_s[ra][32 * u + 4 * q], *pb = &w_s[rb][32 * u + 4 * q];
        const u32 a0 = *(const u32 *)pa, a1 = *(const u32 *)pb;
        const u32 a2 = *(const u32 *)(pa + 16), a3 = *(const u32 *)(pb + 16);
        const float4 sa = ab_s[ra][u], sb = ab_s[rb][u];  // (a0, a1, b0, b1) of rows ra and rb
#pragma unroll
        for (int f = 0; f < 4; f++) {
            if (8 * f >= cnt) break;  // alike in the whole warp
            const u8 *px = &x_s[8 * f + g][32 * u + 4 * q];
            const u32 b0 = *(const u32 *)px, b1 = *(const u32 *)(px + 16);
            const float4 m0 = xm_s[8 * f + 2 * q][u], m1 = xm_s[8 * f + 2 * q + 1][u];
            if constexpr (ET_UNIT_SCALE && ET_NO_OFFSET) {  // one scale product a weight row and selection
                int c[4] = {0, 0, 0, 0};
                mma_s8_16832(c, a0, a1, a2, a3, b0, b1);
                acc[f][0] = fmaf(m0.x * sa.x, (float)c[0], acc[f][0]);
                acc[f][1] = fmaf(m1.x * sa.x, (float)c[1], acc[f][1]);
                acc[f][2] = fmaf(m0.x * sb.x, (float)c[2], acc[f][2]);
                acc[f][3] = fmaf(m1.x * sb.x, (float)c[3], acc[f][3]);
            } else if constexpr (ET_UNIT_SCALE) {
                int c[4] = {0, 0, 0, 0};
                mma_s8_16832(c, a0, a1, a2, a3, b0, b1);
                const float x0 = m0.y + m0.z, x1 = m1.y + m1.z;
                acc[f][0] = add_scaled(acc[f][0], c[0], m0.x, sa.x, sa.z, x0);
                acc[f][1] = add_scaled(acc[f][1], c[1], m1.x, sa.x, sa.z, x1);
                acc[f][2] = add_scaled(acc[f][2], c[2], m0.x, sb.x, sb.z, x0);
                acc[f][3] = add_scaled(acc[f][3], c[3], m1.x, sb.x, sb.z, x1);
            } else {
                int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
                mma_s8_16832(lo, a0, a1, 0u, 0u, b0, b1);
                mma_s8_16832(hi, 0u, 0u, a2, a3, b0, b1);
                acc[f][0] = add_scaled(add_scaled(acc[f][0], lo[0], m0.x, sa.x, sa.z, m0.y), hi[0], m0.x, sa.y, sa.w, m0.z);
                acc[f][1] = add_scaled(add_scaled(acc[f][1], lo[1], m1.x, sa.x, sa.z, m1.y), hi[1], m1.x, sa.y, sa.w, m1.z);
                acc[f][2] = add_scaled(add_scaled(acc[f][2], lo[2], m0.x, sb.x, sb.z, m0.y), hi[2], m0.x, sb.y, sb.w, m0.z);
                acc[f][3] = add_scaled(add_scaled(acc[f][3], lo[3], m1.x, sb.x, sb.z, m1.y), hi[3], m1.x, sb.y, sb.w, m1.z);
            }
        }
    }
#else
    const int rg = threadIdx.x & 15, tg = threadIdx.x >> 4;
    for (int u = 0; u < nu; u++) {
        if constexpr (ET_UNIT_SCALE) {
            int wq[4][8];
            float wa[4], wb[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int4 *p = (const int4 *)&w_s[rg + 16 * i][32 * u];
                const int4 v0 = p[0], v1 = p[1];
                wq[i][0] = v0.x, wq[i][1] = v0.y, wq[i][2] = v0.z, wq[i][3] = v0.w;
                wq[i][4] = v1.x, wq[i][5] = v1.y, wq[i][6] = v1.z, wq[i][7] = v1.w;
                const float4 ab = ab_s[rg + 16 * i][u];
                wa[i] = ab.x, wb[i] = ab.z;
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int t = tg + 8 * j;
                if (t >= cnt) break;  // selections past the tile's: nothing staged, nothing stored
                const int4 *px = (const int4 *)&x_s[t][32 * u];
                const int4 x0 = px[0], x1 = px[1];
                const float4 mt = xm_s[t][u];
                const float xsum = mt.y + mt.z;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int sum = dp4a(wq[i][0], x0.x, 0);
                    sum = dp4a(wq[i][1], x0.y, sum);
                    sum = dp4a(wq[i][2], x0.z, sum);
                    sum = dp4a(wq[i][3], x0.w, sum);
                    sum = dp4a(wq[i][4], x1.x, sum);
                    sum = dp4a(wq[i][5], x1.y, sum);
                    sum = dp4a(wq[i][6], x1.z, sum);
                    sum = dp4a(wq[i][7], x1.w, sum);
                    acc[i][j] += mt.x * wa[i] * (float)sum + wb[i] * xsum;
                }
            }
            continue;
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int wq[4][4];
            float wa[4], wb[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int4 v = *(const int4 *)&w_s[rg + 16 * i][32 * u + 16 * h];
                wq[i][0] = v.x, wq[i][1] = v.y, wq[i][2] = v.z, wq[i][3] = v.w;
                const float4 ab = ab_s[rg + 16 * i][u];
                wa[i] = h ? ab.y : ab.x;
                wb[i] = h ? ab.w : ab.z;
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int t = tg + 8 * j;
                if (t >= cnt) break;
                const int4 xv = *(const int4 *)&x_s[t][32 * u + 16 * h];
                const float4 mt = xm_s[t][u];
                const float xsum = h ? mt.z : mt.y;
#pragma unroll
                for (int i = 0; i < 4; i++) acc[i][j] += half_dot(wq[i], xv, wa[i], wb[i], mt.x, xsum);
            }
        }
    }
#endif
}

// A unit's 32 int8 values (QUnit / QUnitSB q) into a staged row at dst (16-byte aligned).
DEVI void et_put_q(u8 *dst, const int (&q)[8]) {
    uint4 *d = (uint4 *)dst;
    d[0] = make_uint4((u32)q[0], (u32)q[1], (u32)q[2], (u32)q[3]);
    d[1] = make_uint4((u32)q[4], (u32)q[5], (u32)q[6], (u32)q[7]);
}

// The tile's x rows (xq rows xr_s[t], t < cnt), units u0 .. u0 + nu - 1, into x_s, 16 bytes at a time.
DEVI void et_stage_x(u8 (*x_s)[ET_LD], const u8 *__restrict__ xq, const int *xr_s, int cnt, int k, int u0, int nu) {
    for (int i = threadIdx.x; i < cnt * 2 * nu; i += ET_THREADS) {
        const int t = i / (2 * nu), c = i % (2 * nu);
        *(uint4 *)&x_s[t][16 * c] = *(const uint4 *)(xq + (size_t)xr_s[t] * k + 32 * u0 + 16 * c);
    }
}

// A thread's 16 outputs (places: et_place) into y rows yr_s[t] (t < cnt, rows r0 + r < m), plus the bias row.
DEVI void et_store(const float (&acc)[4][4], int cnt, int r0, int m, const int *yr_s, float *__restrict__ y,
                   const float *__restrict__ bias_e) {
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r, t;
            et_place(i, j, r, t);
            if (t < cnt && r0 + r < m) y[(i64)yr_s[t] * m + r0 + r] = acc[i][j] + (bias_e ? bias_e[r0 + r] : 0.f);
        }
}

// One block's tile: rows r0 .. r0 + ET_ROWS - 1 of the matrix at we (m rows of row_bytes) against
// cnt <= ET_TOK rows of xq (x_rows rows, k values): tile row t reads xq row xr_s[t] and writes y
// row yr_s[t] (y (.., m)), plus the expert's bias row bias_e where not null; both lists in shared
// memory, set before a barrier by the caller. Per chunk of
// ET_CH units: the rows' units decoded (unit_q) into w_s (int8, natural order) with their scales
// and offsets, the tile's x rows copied from xq into x_s with their float4s, then summed into each
// thread's 16 outputs (et_sum; which outputs: et_place).
DEVI void et_block(const u8 *we, i64 row_bytes, int m, int k, const u8 *__restrict__ xq, int x_rows, int r0, int cnt,
                   const int *xr_s, const int *yr_s, float *__restrict__ y, const float *__restrict__ bias_e) {
    __shared__ __align__(16) u8 w_s[ET_ROWS][ET_LD];
    __shared__ float4 ab_s[ET_ROWS][ET_CH + 1];  // (a0, a1, b0, b1) of a unit; 36 words a row: 8 rows on 32 banks
    __shared__ __align__(16) u8 x_s[ET_TOK][ET_LD];
    __shared__ float4 xm_s[ET_TOK][ET_CH];
    const int tid = threadIdx.x, S = k / 32;
    const float4 *meta_g = (const float4 *)(xq + (size_t)x_rows * k);
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.f;
    for (int u0 = 0; u0 < S; u0 += ET_CH) {
        const int nu = min(ET_CH, S - u0);
        // weights: consecutive threads take consecutive units of a row (its bytes side by side)
        for (int i = tid; i < ET_ROWS * nu; i += ET_THREADS) {
            const int r = i / nu, u = i % nu;
            if (r0 + r >= m) continue;  // never summed into a stored output
            QUnit o;
            unit_q<QT>(we + (i64)(r0 + r) * row_bytes, u0 + u, o);
            et_put_q(&w_s[r][32 * u], o.q);
            ab_s[r][u] = make_float4(o.a[0], o.a[1], o.b[0], o.b[1]);
        }
        // x: the tile's rows and their float4s
        et_stage_x(x_s, xq, xr_s, cnt, k, u0, nu);
        for (int i = tid; i < cnt * nu; i += ET_THREADS) {
            const int t = i / nu, u = i % nu;
            xm_s[t][u] = meta_g[(size_t)xr_s[t] * S + u0 + u];
        }
        __syncthreads();
        et_sum(w_s, ab_s, x_s, xm_s, nu, cnt, acc);
        __syncthreads();  // w_s and x_s are staged again
    }
    et_store(acc, cnt, r0, m, yr_s, y, bias_e);
}

#if IS_KQ(QT)
// ---- expert_tile_sb: K-quant tiles against x rounded in groups of 256 ----
//
// quant_x_llama rounds x for the K-quants with one scale a 256 values (dx), so a staged chunk of
// ET_CH = 8 units is one super-block of each row and one x scale of each selection. The tile sums a
// super-block's units as integers times their sub-block scales and scales once per super-block:
//   y += dx * d * sum_u,h sc[u,h] * (q[u,h] . xq[u,h])  -  dmin * sum_u,h mn[u,h] * xs[u,h]
// (unit_sb; xs = dx * the sum of xq over a unit or half, from quant_x_llama's float4s, a float sum).
// That is an integer multiply-add per unit (or half) and output where expert_tile takes an
// int-to-float conversion and two fused multiply-adds. Q3_K and Q6_K have no mins: their codes
// are staged less their midpoint, and the min term is left out.
constexpr bool ET_SB_MIN = QT == T_Q2_K || QT == T_Q4_K || QT == T_Q5_K;
constexpr bool ET_SB_UNIT = QT == T_Q4_K || QT == T_Q5_K;  // a scale and min a unit (the others: a half)

// The integer and min sums of a super-block (nu = ET_CH units staged) into is and ms, by the paths
// and output places of et_sum. sc_s: a unit's (sc0, sc1, mn0, mn1); xs_s: a selection's float x sums
// of a unit (x, ET_SB_UNIT) or of its halves (x, y).
DEVI void et_sum_sb(const u8 (*w_s)[ET_LD], const int4 (*sc_s)[ET_CH + 1], const u8 (*x_s)[ET_LD],
                    const float2 (*xs_s)[ET_CH], int cnt, int (&is)[4][4], float (&ms)[4][4]) {
#if ET_MMA
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, ra = 16 * (threadIdx.x >> 5) + g, rb = ra + 8;
#pragma unroll 2
    for (int u = 0; u < ET_CH; u++) {
        const u8 *pa = &w_s[ra][32 * u + 4 * q], *pb = &w_s[rb][32 * u + 4 * q];
        const u32 a0 = *(const u32 *)pa, a1 = *(const u32 *)pb;
        const u32 a2 = *(const u32 *)(pa + 16), a3 = *(const u32 *)(pb + 16);
        const int4 sa = sc_s[ra][u], sb = sc_s[rb][u];
#pragma unroll
        for (int f = 0; f < 4; f++) {
            if (8 * f >= cnt) break;  // alike in the whole warp
            const u8 *px = &x_s[8 * f + g][32 * u + 4 * q];
            const u32 b0 = *(const u32 *)px, b1 = *(const u32 *)(px + 16);
            if constexpr (ET_SB_UNIT) {
                int c[4] = {0, 0, 0, 0};
                mma_s8_16832(c, a0, a1, a2, a3, b0, b1);
                is[f][0] += sa.x * c[0], is[f][1] += sa.x * c[1], is[f][2] += sb.x * c[2], is[f][3] += sb.x * c[3];
            } else {
                int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
                mma_s8_16832(lo, a0, a1, 0u, 0u, b0, b1);
                mma_s8_16832(hi, 0u, 0u, a2, a3, b0, b1);
                is[f][0] += sa.x * lo[0] + sa.y * hi[0], is[f][1] += sa.x * lo[1] + sa.y * hi[1];
                is[f][2] += sb.x * lo[2] + sb.y * hi[2], is[f][3] += sb.x * lo[3] + sb.y * hi[3];
            }
            if constexpr (ET_SB_MIN) {
                const float2 x0 = xs_s[8 * f + 2 * q][u], x1 = xs_s[8 * f + 2 * q + 1][u];
                if constexpr (ET_SB_UNIT) {
                    const float ma = (float)sa.z, mb = (float)sb.z;
                    ms[f][0] = fmaf(ma, x0.x, ms[f][0]), ms[f][1] = fmaf(ma, x1.x, ms[f][1]);
                    ms[f][2] = fmaf(mb, x0.x, ms[f][2]), ms[f][3] = fmaf(mb, x1.x, ms[f][3]);
                } else {
                    const float ma0 = (float)sa.z, ma1 = (float)sa.w, mb0 = (float)sb.z, mb1 = (float)sb.w;
                    ms[f][0] = fmaf(ma0, x0.x, fmaf(ma1, x0.y, ms[f][0]));
                    ms[f][1] = fmaf(ma0, x1.x, fmaf(ma1, x1.y, ms[f][1]));
                    ms[f][2] = fmaf(mb0, x0.x, fmaf(mb1, x0.y, ms[f][2]));
                    ms[f][3] = fmaf(mb0, x1.x, fmaf(mb1, x1.y, ms[f][3]));
                }
            }
        }
    }
#else
    const int rg = threadIdx.x & 15, tg = threadIdx.x >> 4;
    for (int u = 0; u < ET_CH; u++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {  // ET_SB_UNIT: the halves' sums added before scaling
            int wq[4][4], sc[4];
            float mn[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int4 v = *(const int4 *)&w_s[rg + 16 * i][32 * u + 16 * h];
                wq[i][0] = v.x, wq[i][1] = v.y, wq[i][2] = v.z, wq[i][3] = v.w;
                const int4 s4 = sc_s[rg + 16 * i][u];
                sc[i] = h ? s4.y : s4.x;
                mn[i] = (float)(h ? s4.w : s4.z);
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int t = tg + 8 * j;
                if (t >= cnt) break;
                const int4 xv = *(const int4 *)&x_s[t][32 * u + 16 * h];
                const float2 xs = xs_s[t][u];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int sum = dp4a(wq[i][0], xv.x, 0);
                    sum = dp4a(wq[i][1], xv.y, sum);
                    sum = dp4a(wq[i][2], xv.z, sum);
                    sum = dp4a(wq[i][3], xv.w, sum);
                    is[i][j] += sc[i] * sum;
                    if constexpr (ET_SB_MIN) {
                        if constexpr (ET_SB_UNIT) {
                            if (h == 0) ms[i][j] = fmaf(mn[i], xs.x, ms[i][j]);
                        } else {
                            ms[i][j] = fmaf(mn[i], h ? xs.y : xs.x, ms[i][j]);
                        }
                    }
                }
            }
        }
    }
#endif
}

// et_block for the K-quants against x in groups of 256: per super-block, the rows' units decoded
// (unit_sb) into w_s with their integer scales and mins, the rows' d and dmin, the tile's x rows
// with their x sums and scale; summed (et_sum_sb), then scaled into acc once.
DEVI void et_block_sb(const u8 *we, i64 row_bytes, int m, int k, const u8 *__restrict__ xq, int x_rows, int r0,
                      int cnt, const int *xr_s, const int *yr_s, float *__restrict__ y,
                      const float *__restrict__ bias_e) {
    __shared__ __align__(16) u8 w_s[ET_ROWS][ET_LD];
    __shared__ int4 sc_s[ET_ROWS][ET_CH + 1];  // (sc0, sc1, mn0, mn1) of a unit; 36 words a row
    __shared__ float2 dd_s[ET_ROWS];           // (d, dmin) of the super-block
    __shared__ __align__(16) u8 x_s[ET_TOK][ET_LD];
    __shared__ float2 xs_s[ET_TOK][ET_CH];
    __shared__ float dx_s[ET_TOK];
    const int tid = threadIdx.x, S = k / 32;
    const float4 *meta_g = (const float4 *)(xq + (size_t)x_rows * k);
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) acc[i][j] = 0.f;
    for (int u0 = 0; u0 < S; u0 += ET_CH) {
        const u8 *sbp = we + (i64)(u0 / ET_CH) * KQ_BYTES(QT);
        for (int i = tid; i < ET_ROWS * ET_CH; i += ET_THREADS) {
            const int r = i / ET_CH, u = i % ET_CH;
            if (r0 + r >= m) continue;  // never summed into a stored output
            QUnitSB o;
            unit_sb<QT>(sbp + (i64)(r0 + r) * row_bytes, u, o);
            et_put_q(&w_s[r][32 * u], o.q);
            sc_s[r][u] = make_int4(o.sc[0], o.sc[1], o.mn[0], o.mn[1]);
            if (u == 0) dd_s[r] = make_float2(o.d, o.dmin);
        }
        et_stage_x(x_s, xq, xr_s, cnt, k, u0, ET_CH);
        for (int i = tid; i < cnt * ET_CH; i += ET_THREADS) {
            const int t = i / ET_CH, u = i % ET_CH;
            const float4 mt = meta_g[(size_t)xr_s[t] * S + u0 + u];
            xs_s[t][u] = ET_SB_UNIT ? make_float2(mt.y + mt.z, 0.f) : make_float2(mt.y, mt.z);
            if (u == 0) dx_s[t] = mt.x;
        }
        __syncthreads();
        int is[4][4];
        float ms[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) is[i][j] = 0, ms[i][j] = 0.f;
        et_sum_sb(w_s, sc_s, x_s, xs_s, cnt, is, ms);
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int r, t;
                et_place(i, j, r, t);
                const float2 dd = dd_s[r];
                acc[i][j] = fmaf(dx_s[t] * dd.x, (float)is[i][j], acc[i][j]);
                if constexpr (ET_SB_MIN) acc[i][j] = fmaf(-dd.y, ms[i][j], acc[i][j]);
            }
        __syncthreads();  // w_s and x_s are staged again
    }
    et_store(acc, cnt, r0, m, yr_s, y, bias_e);
}
#endif

// Grid (ceil(m / ET_ROWS), tile bound), ET_THREADS: block (rt, i) computes rows rt * ET_ROWS ..
// of tile i's expert for its selections (tiles past *n_tiles return); x row of selection s: s / x_div.
// expert_tile_sb (the K-quants, x rounded in groups of 256) takes the same arguments.
template <bool SB>
DEVI void et_tile(const u8 *__restrict__ w, i64 row_bytes, i64 expert_bytes, int m, int k, const u8 *__restrict__ xq,
                  int x_rows, int x_div, const int *__restrict__ order, const int4 *__restrict__ tiles,
                  const int *__restrict__ n_tiles, float *__restrict__ y, const float *__restrict__ bias) {
    __shared__ int sel_s[ET_TOK], xr_s[ET_TOK];
    PDL_ENTER();
    if ((int)blockIdx.y >= *n_tiles) return;
    const int4 tile = tiles[blockIdx.y];
    const int tid = threadIdx.x;
    if (tid < ET_TOK) {
        const int s = tid < tile.z ? order[tile.y + tid] : -1;
        sel_s[tid] = s;
        xr_s[tid] = s < 0 ? 0 : s / x_div;
    }
    __syncthreads();  // sel_s, xr_s
    const u8 *we = w + (i64)tile.x * expert_bytes;
    const float *bias_e = bias ? bias + (i64)tile.x * m : nullptr;
#if IS_KQ(QT)
    if constexpr (SB) {
        et_block_sb(we, row_bytes, m, k, xq, x_rows, blockIdx.x * ET_ROWS, tile.z, xr_s, sel_s, y, bias_e);
        return;
    }
#endif
    et_block(we, row_bytes, m, k, xq, x_rows, blockIdx.x * ET_ROWS, tile.z, xr_s, sel_s, y, bias_e);
}

#define ET_PARAMS                                                                                                   \
    const u8 *__restrict__ w, i64 row_bytes, i64 expert_bytes, int m, int k, const u8 *__restrict__ xq, int x_rows, \
        int x_div, const int *__restrict__ order, const int4 *__restrict__ tiles, const int *__restrict__ n_tiles,  \
        float *__restrict__ y, const float *__restrict__ bias
extern "C" __global__ void __launch_bounds__(ET_THREADS) expert_tile(ET_PARAMS) {
    et_tile<false>(w, row_bytes, expert_bytes, m, k, xq, x_rows, x_div, order, tiles, n_tiles, y, bias);
}
#if IS_KQ(QT)
extern "C" __global__ void __launch_bounds__(ET_THREADS) expert_tile_sb(ET_PARAMS) {
    et_tile<true>(w, row_bytes, expert_bytes, m, k, xq, x_rows, x_div, order, tiles, n_tiles, y, bias);
}
#endif
#endif
