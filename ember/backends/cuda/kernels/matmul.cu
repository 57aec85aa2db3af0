// Matrix products with GGUF-block weights of one type QT (defined by the loader), and get_rows.
//
//   y (n, rows) = x (n, k) @ W.T      W: rows of k values, each row k/32 slices of GGUF blocks
//
// mv_n{1,2,4,8}: decode (n <= 8; more rows: mv_n8 over groups of 8, see mv_body). Memory-bound:
//   one pass over the weights. A team of T lanes
//   (T a power of two, 4..128; more than a warp for long rows of few rows) streams two weight rows, lane by lane over consecutive slices
//   (32 values: see slice_q; 16-byte loads where the block layout allows), so a warp reads
//   contiguous runs of each row. Quantized types read x already quantized (int8 per value,
//   (scale, half-sums) per 32: q8_store_warp), written once per step by whoever produced x
//   (quant_x, attention, a gated product, a product's tail); each weight slice is decoded once
//   and dotted with all n activation rows (eight dp4a each); with several rows the block stages x
//   in shared memory first, a chunk at a time (mv_stage_chunk). Float types read x as f32.
//   Epilogues (recorded steps): add into a residual, or a gated activation of two matrices'
//   rows, optionally quantized for the next product (blocks of 32 rows, 256 threads). A tail
//   run by the block that finishes last (a counter) does the row-wide work that needs every
//   output: optional norm of y added into the residual, then the next RMS norm of the residual,
//   quantized for the next product -- so a layer's norms cost no launch of their own.
// mv_xs: one activation row over large matrices (Q8_0, Q4_K, Q5_K): gate and up, or products that
//   normalise x themselves (q/k/v, the output head). x-stationary teams, a lane per lane step of
//   a row, streaming pairs of rows (see its comment below).
// mm_tile, mm_tile64: prefill / batched. 64 tokens x 128 (64) rows per block; units dequantized to
//   f16 tiles in shared memory; tensor-core mma.sync m16n8k16 with f32 accumulation.
// mm_split: batched decode (9..64 rows, quantized types): mm_tile64's tiles with k split over
//   blocks, raw weight bytes staged by cp.async, partial sums added by each tile's last block.

#ifndef QT
#error "QT (the ggml type id) must be defined"
#endif

constexpr bool QFLOAT = QT == T_F32 || QT == T_F16 || QT == T_BF16;
constexpr int SPL = QT == T_Q4_K || QT == T_Q5_K ? 2 : 1;  // slices per lane step (slice2_q)

#define MV_THREADS 128
#define MVQ_THREADS 256  // gated products quantizing their output: 32 rows x 8 lanes
#define MODE_STORE 0
#define MODE_RESIDUAL 1
#define MODE_SILU 2
#define MODE_GELU 3

// The kernels' arguments, one small struct per stage (the launch passes them flat: MV_PARAMS).
struct MvMats {  // the matrices of one launch, all of type QT and k columns
    const u8 *w[4];  // (rows_m, row_bytes)
    float *y[4];     // outputs (n, rows_m)
    int rows[4];
    int n_mat;
    i64 row_bytes;
};
struct MvRun {  // the activation rows and the teams' layout
    int k, n;
    const float *x;  // (n, k) f32: read by float weight types
    const u8 *xq;    // (n, k) int8, then (n, k/32) float4 (d, d*sum lo16, d*sum hi16, 0): quantized types
    int team_log2;
    int n_tblocks;   // blocks of teams: gridDim.x / groups of them, or more (the grid walks them)
    int pre_dec;     // one activation row: a lane's first pre_dec steps of slices decoded before the wait
    i64 pf_row;      // bytes at the start of each of a team's rows prefetched into L2 (whole rows where
                     // the resident blocks' rows fit in L2; past that, a prefetch would evict itself)
    int kc;          // several activation rows (NMAX > 1), quantized: values of x a chunk staged in shared
                     // memory (a multiple of 512; mv_stage_chunk); 0: x read from xq where it lies
};
struct MvEpi {  // what the product does with y beside storing it
    int mode;
    float *aux;  // MODE_RESIDUAL: (n, rows_0) += y_0; gated modes: (n, rows_0) = act(y_0) * y_1
    u8 *act_q;   // gated modes, or null: act(y_0) * y_1 also quantized here ((n, rows_0) + meta)
};
// The prologue, when w is set (quantized types): each block computes its rows of x itself,
// x = RMS norm of src rows (rows idx[j] when set) by w, quantized into dynamic shared memory
// instead of read from xq; the first block of teams also writes x to h.
// The residual prologue, when y is set too (no idx): src is the residual r, and the blocks first
// form r + RMS norm of y by post_w (a post-norm, as gemma's layers end their halves), then
// normalise that. The last block through its prologue (counter) writes the new r, h, and the
// post-normed y to yout when set: every block has read r and y by then. Replaces the tail of the
// product that wrote y.
struct MvPro {
    const float *src;
    const int *idx;
    const float *w;
    float eps;
    float *h;
    const float *y;
    float *yout;
    const float *post_w;
    float post_eps;
    unsigned *counter;
};
// The tail, run by the last block to finish when counter is set; rows of d = rows_0 values.
struct MvTail {
    unsigned *counter;
    float *res;  // residual (n, d)
    int add;     // res += y_0 (normalised by post_w first, y_0 overwritten with that) in the tail
    const float *post_w;
    float post_eps;
    const float *pre_w;  // then res normalised by pre_w into pre_h (n, d) f32 and pre_q (quantized)
    float pre_eps;
    float *pre_h;
    u8 *pre_q;  // or null (a float-typed next product reads pre_h)
};

// Element i (0..3) of a 4-array with a run-time index, without sending the array to local memory.
template <typename T>
__device__ __forceinline__ T pick4(const T *arr, int i) {
    return i == 0 ? arr[0] : i == 1 ? arr[1] : i == 2 ? arr[2] : arr[3];
}

// Which matrix and row job `v` of the concatenated rows is; false past the end.
__device__ __forceinline__ bool mv_job(const MvMats &mt, int v, int &m, int &r) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        if (i >= mt.n_mat) break;
        if (v < mt.rows[i]) {
            m = i, r = v;
            return true;
        }
        v -= mt.rows[i];
    }
    m = 0, r = 0;
    return false;
}

// Lane step p's slices of both rows (SPL slices each).
template <int TT>
__device__ __forceinline__ void mv_decode_step(const u8 *__restrict__ w0, const u8 *__restrict__ w1, bool ok0,
                                               bool ok1, int p, QSlice (&q0)[SPL], QSlice (&q1)[SPL]) {
    if constexpr (SPL == 2) {
        if (ok0) slice2_q<TT>(w0, p, q0[0], q0[1]);
        if (ok1) slice2_q<TT>(w1, p, q1[0], q1[1]);
    } else {
        if (ok0) slice_q<TT>(w0, p, q0[0]);
        if (ok1) slice_q<TT>(w1, p, q1[0]);
    }
}

// Half h (16 values) of one slice of both rows against those 16 values of an activation row (xv),
// m the metadata of their block of x, xs the half's sum (m.y or m.z).
__device__ __forceinline__ void half_dot(const QSlice &s0, const QSlice &s1, bool ok0, bool ok1, int h, int4 xv,
                                         float4 m, float xs, float &acc0, float &acc1) {
    if (ok0) {
        int d = dp4a(s0.q[4 * h], xv.x, 0);
        d = dp4a(s0.q[4 * h + 1], xv.y, d);
        d = dp4a(s0.q[4 * h + 2], xv.z, d);
        d = dp4a(s0.q[4 * h + 3], xv.w, d);
        acc0 += m.x * s0.a[h] * (float)d + s0.b[h] * xs;
    }
    if (ok1) {
        int d = dp4a(s1.q[4 * h], xv.x, 0);
        d = dp4a(s1.q[4 * h + 1], xv.y, d);
        d = dp4a(s1.q[4 * h + 2], xv.z, d);
        d = dp4a(s1.q[4 * h + 3], xv.w, d);
        acc1 += m.x * s1.a[h] * (float)d + s1.b[h] * xs;
    }
}

// Q4_K/Q5_K lane step p (slices 2p and 2p + 1: slice2_decode) of both rows against one activation
// row, half h: both slices' 16 values of that half lie in one 32-value sub-block of the weights (one
// scale and min) and in one block of x, values 64p + 32h .. + 31 (xa, xb: its two 16-byte halves;
// m: its metadata). So the 32 products are summed as integers, and the min is taken against the
// block's whole sum: one conversion and three float operations a row instead of two of each.
__device__ __forceinline__ void k4_dot(const QSlice (&q0)[2], const QSlice (&q1)[2], bool ok0, bool ok1, int h,
                                       int4 xa, int4 xb, float4 m, float &acc0, float &acc1) {
    const float xsum = m.y + m.z;
    if (ok0) {
        int d = dp4a(q0[0].q[4 * h], xa.x, 0);
        d = dp4a(q0[0].q[4 * h + 1], xa.y, d);
        d = dp4a(q0[0].q[4 * h + 2], xa.z, d);
        d = dp4a(q0[0].q[4 * h + 3], xa.w, d);
        d = dp4a(q0[1].q[4 * h], xb.x, d);
        d = dp4a(q0[1].q[4 * h + 1], xb.y, d);
        d = dp4a(q0[1].q[4 * h + 2], xb.z, d);
        d = dp4a(q0[1].q[4 * h + 3], xb.w, d);
        acc0 += m.x * q0[0].a[h] * (float)d + q0[0].b[h] * xsum;
    }
    if (ok1) {
        int d = dp4a(q1[0].q[4 * h], xa.x, 0);
        d = dp4a(q1[0].q[4 * h + 1], xa.y, d);
        d = dp4a(q1[0].q[4 * h + 2], xa.z, d);
        d = dp4a(q1[0].q[4 * h + 3], xa.w, d);
        d = dp4a(q1[1].q[4 * h], xb.x, d);
        d = dp4a(q1[1].q[4 * h + 1], xb.y, d);
        d = dp4a(q1[1].q[4 * h + 2], xb.z, d);
        d = dp4a(q1[1].q[4 * h + 3], xb.w, d);
        acc1 += m.x * q1[0].a[h] * (float)d + q1[0].b[h] * xsum;
    }
}

// A lane's first steps of slices (lane steps p = lane, lane + T), loaded before the kernel waits
// for x: weights are constants, so their round trip overlaps the kernel before (see mv_body).
// Compiled into mv_n1 for the types of 32-value blocks, decoded at once, and into mv_n1_store for
// Q4_K and Q5_K too, whose step (two slices, a scale decode) is held as its raw bytes (RawK) and
// decoded after the wait; in mv_n1 for those, in the other types, and in mv_n1_occ's 80 registers,
// the registers they hold make the kernel spill.
#define MV_PRE_STEPS 2
constexpr bool MV_PRE_RAW = SPL == 2;
#define MV_PRE_RAW_STEPS 1
constexpr int MV_PRE_HELD = MV_PRE_RAW ? MV_PRE_RAW_STEPS : MV_PRE_STEPS;  // lane steps held
#ifdef MV_OCC
constexpr bool MV_PRE_OK = false;
#else
#ifdef MV_STORE
constexpr bool MV_PRE_STORE = true;
#else
constexpr bool MV_PRE_STORE = false;
#endif
constexpr bool MV_PRE_OK = QT == T_Q4_0 || QT == T_Q4_1 || QT == T_Q5_0 || QT == T_Q5_1 || QT == T_Q8_0 ||
                           (MV_PRE_STORE && (QT == T_Q4_K || QT == T_Q5_K));
#endif
struct MvPre {
    QSlice q0[MV_PRE_RAW ? 1 : MV_PRE_HELD][SPL], q1[MV_PRE_RAW ? 1 : MV_PRE_HELD][SPL];
    RawK r0[MV_PRE_RAW ? MV_PRE_HELD : 1], r1[MV_PRE_RAW ? MV_PRE_HELD : 1];
    bool have[MV_PRE_STEPS];
};

// acc[jb][j] += (lane's share of) row jb . x row j, for this lane's slices s = lane, lane + T, ...
// Quantized types read rows jx .. jx + nl - 1 of xq, a buffer of nx rows; float types rows j0.. of x.
// use_pre: the lane's first use_pre steps are in pre.
template <int NMAX>
__device__ __forceinline__ void mv_dot_rows(const MvRun &run, const u8 *__restrict__ w0, const u8 *__restrict__ w1,
                                            bool ok0, bool ok1, int lane, int T, int j0, int nl,
                                            const u8 *__restrict__ xq, int jx, int nx, float (&acc)[2][NMAX],
                                            const MvPre &pre, int use_pre) {
    const int k = run.k, S = k / 32;
    if constexpr (QFLOAT) {
        // lane steps of one 16-byte vector of each row (FLOAT_VEC), lane p, p + T, ...: a warp's loads
        // are 512 contiguous bytes; both rows' vectors loaded before either is summed
        constexpr int VEC = FLOAT_VEC<QT>;
        const int P = k / VEC;
#pragma unroll 4
        for (int p = lane; p < P; p += T) {
            float wv[2][VEC];
            if (ok0) vec_f<QT>(w0, p, wv[0]);
            if (ok1) vec_f<QT>(w1, p, wv[1]);
#pragma unroll
            for (int j = 0; j < NMAX; j++) {
                if (j >= nl) break;
                const float4 *xv = (const float4 *)(run.x + (size_t)(j0 + j) * k + VEC * p);
                float xs[VEC];
#pragma unroll
                for (int i = 0; i < VEC / 4; i++) {
                    const float4 f = xv[i];
                    xs[4 * i] = f.x, xs[4 * i + 1] = f.y, xs[4 * i + 2] = f.z, xs[4 * i + 3] = f.w;
                }
#pragma unroll
                for (int jb = 0; jb < 2; jb++) {
                    if (!(jb == 0 ? ok0 : ok1)) continue;
                    float sum = 0.f;
#pragma unroll
                    for (int i = 0; i < VEC; i++) sum += wv[jb][i] * xs[i];
                    acc[jb][j] += sum;
                }
            }
        }
    } else {
        const float4 *__restrict__ meta = (const float4 *)(xq + (size_t)nx * k);
        // lane step p: slices SPL*p .. SPL*p + SPL-1 of both rows, dotted with the activation rows
        auto step = [&](int p, const QSlice (&q0)[SPL], const QSlice (&q1)[SPL]) {
            if constexpr (SPL == 2) {
#pragma unroll
                for (int j = 0; j < NMAX; j++) {
                    if (j >= nl) break;
                    const u8 *xr = xq + (size_t)(jx + j) * k;
                    const float4 *mr = meta + (size_t)(jx + j) * (k >> 5);
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int o = 64 * p + 32 * h;
                        k4_dot(q0, q1, ok0, ok1, h, *(const int4 *)(xr + o), *(const int4 *)(xr + o + 16), mr[o >> 5],
                               acc[0][j], acc[1][j]);
                    }
                }
                return;
            }
#pragma unroll
            for (int e = 0; e < SPL; e++) {
                int xo[2];
                slice_offsets<QT>(SPL * p + e, xo);
#pragma unroll
                for (int j = 0; j < NMAX; j++) {
                    if (j >= nl) break;
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const size_t at = (size_t)(jx + j) * k + xo[h];
                        const int4 xv = *(const int4 *)(xq + at);
                        const float4 m = meta[at >> 5];
                        half_dot(q0[e], q1[e], ok0, ok1, h, xv, m, (xo[h] & 16) ? m.z : m.y, acc[0][j], acc[1][j]);
                    }
                }
            }
        };
        int p0 = lane;
        if constexpr (MV_PRE_OK) {
#pragma unroll
            for (int i = 0; i < MV_PRE_HELD; i++) {  // the first steps' slices were loaded before the wait
                if (i >= use_pre) break;
                if (pre.have[i]) {
                    if constexpr (MV_PRE_RAW) {
                        QSlice q0[SPL], q1[SPL];
                        if (ok0) slice2_decode<QT>(pre.r0[i], lane + i * T, q0[0], q0[1]);
                        if (ok1) slice2_decode<QT>(pre.r1[i], lane + i * T, q1[0], q1[1]);
                        step(lane + i * T, q0, q1);
                    } else {
                        step(lane + i * T, pre.q0[i], pre.q1[i]);
                    }
                }
                p0 += T;
            }
        }
#pragma unroll 2
        for (int p = p0; p < S / SPL; p += T) {
            QSlice q0[SPL], q1[SPL];
            mv_decode_step<QT>(w0, w1, ok0, ok1, p, q0, q1);
            step(p, q0, q1);
        }
    }
}

// ---- several activation rows: x staged in shared memory ----
// A lane step's x is read 16 bytes at a time, by lanes at consecutive lane steps: for Q4_K, lanes
// of a warp 64 bytes apart. Read from where it lies (L1), each such load touches four times the
// 128-byte lines it uses. Staging alone did not speed mv_n8 up (its instructions and registers bound
// it, not DRAM: k4_dot and its register bound did that); with them it took the 8B shapes' 8-row
// gate/up and down products 0.72-0.85x (bench/mv_micro.py, bench/NOTES.md). So a block stages its
// rows' x a chunk of run.kc values at a time in shared memory, each run of eight 16-byte units of a row
// permuted (x_slot) so that the eight lanes of a quarter-warp, at eight consecutive lane steps,
// read eight different groups of banks; the chunk's float4 metadata likewise (meta_slot). Layout:
// nl rows of kc int8 values, then nl rows of kc / 32 float4.

// The slot of 16-byte unit u of a staged row. Q4_K/Q5_K lane step p reads units 4p + 2h + e;
// Q2_K/Q3_K/Q6_K slice s units 16(s >> 3) + 8((s & 7) >> 2) + 2((s >> 1) & 1) + (s & 1) + 4h; the
// 32-value types slice s units 2s + h (slice_offsets).
__device__ __forceinline__ int x_slot(int u) {
    if constexpr (QT == T_Q4_K || QT == T_Q5_K) return u ^ ((u >> 3) & 3);
    else if constexpr (QT == T_Q2_K || QT == T_Q3_K || QT == T_Q6_K) return u ^ ((u >> 1) & 4);
    else return u ^ ((u >> 3) & 1);
}
// The slot of 32-value block b's metadata: Q4_K/Q5_K lane step p reads blocks 2p + h; the others'
// eight lanes read at most eight different blocks of a run of sixteen already.
__device__ __forceinline__ int meta_slot(int b) {
    if constexpr (QT == T_Q4_K || QT == T_Q5_K) return b ^ ((b >> 3) & 1);
    else return b;
}

#define STAGE_BATCH 4  // 16-byte loads a thread has in flight while staging
// Values c0 .. c0 + kn - 1 of x rows jx .. jx + nl - 1 (of nx in xq, k a row) into xs (rows kc apart).
__device__ __forceinline__ void mv_stage_chunk(const u8 *__restrict__ xq, int nx, int jx, int k, int nl, int c0,
                                               int kn, int kc, u8 *xs) {
    const float4 *gmeta = (const float4 *)(xq + (size_t)nx * k);
    float4 *smeta = (float4 *)(xs + (size_t)nl * kc);
    const int units = kn >> 4, blocks = kn >> 5, n_x = nl * units, total = n_x + nl * blocks;
    for (int i0 = threadIdx.x; i0 < total; i0 += STAGE_BATCH * blockDim.x) {
        int4 v[STAGE_BATCH];
        int4 *dst[STAGE_BATCH];
#pragma unroll
        for (int t = 0; t < STAGE_BATCH; t++) {
            const int i = i0 + t * blockDim.x;
            dst[t] = nullptr;
            if (i >= total) continue;
            if (i < n_x) {
                const int j = i / units, u = i - j * units;
                v[t] = *(const int4 *)(xq + (size_t)(jx + j) * k + c0 + 16 * u);
                dst[t] = (int4 *)(xs + (size_t)j * kc + 16 * x_slot(u));
            } else {
                const int j = (i - n_x) / blocks, b = i - n_x - j * blocks;
                v[t] = *(const int4 *)(gmeta + (size_t)(jx + j) * (k >> 5) + (c0 >> 5) + b);
                dst[t] = (int4 *)(smeta + (size_t)j * (kc >> 5) + meta_slot(b));
            }
        }
#pragma unroll
        for (int t = 0; t < STAGE_BATCH; t++)
            if (dst[t]) *dst[t] = v[t];
    }
}

// mv_dot_rows for the lane steps of one staged chunk (values c0 .. c0 + kn - 1) of nl rows.
template <int NMAX>
__device__ __forceinline__ void mv_dot_staged(const u8 *__restrict__ w0, const u8 *__restrict__ w1, bool ok0,
                                              bool ok1, int lane, int T, int nl, const u8 *xs, int c0, int kn,
                                              int kc, float (&acc)[2][NMAX]) {
    const float4 *meta = (const float4 *)(xs + (size_t)nl * kc);
    const int p_end = (c0 + kn) / (32 * SPL);
#pragma unroll 2
    for (int p = c0 / (32 * SPL) + lane; p < p_end; p += T) {
        QSlice q0[SPL], q1[SPL];
        mv_decode_step<QT>(w0, w1, ok0, ok1, p, q0, q1);
        if constexpr (SPL == 2) {
#pragma unroll
            for (int j = 0; j < NMAX; j++) {
                if (j >= nl) break;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int u = (64 * p + 32 * h - c0) >> 4;  // units u, u + 1: one block of x
                    const u8 *xr = xs + (size_t)j * kc;
                    k4_dot(q0, q1, ok0, ok1, h, *(const int4 *)(xr + 16 * x_slot(u)),
                           *(const int4 *)(xr + 16 * x_slot(u + 1)), meta[j * (kc >> 5) + meta_slot(u >> 1)],
                           acc[0][j], acc[1][j]);
                }
            }
            continue;
        }
#pragma unroll
        for (int e = 0; e < SPL; e++) {
            int xo[2];
            slice_offsets<QT>(SPL * p + e, xo);
#pragma unroll
            for (int j = 0; j < NMAX; j++) {
                if (j >= nl) break;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int off = xo[h] - c0;
                    const int4 xv = *(const int4 *)(xs + (size_t)j * kc + 16 * x_slot(off >> 4));
                    const float4 m = meta[j * (kc >> 5) + meta_slot(off >> 5)];
                    half_dot(q0[e], q1[e], ok0, ok1, h, xv, m, (off & 16) ? m.z : m.y, acc[0][j], acc[1][j]);
                }
            }
        }
    }
}

// The tail, in the block that finishes last: rows of the residual (see MvTail). What other blocks
// wrote is read through L2 (ld_l2), after the counter says they all wrote it. A thread handles the
// values c = base + tid + nt*i of a row, TAIL_REG of them per chunk: rows of up to TAIL_REG * nt
// values stay in registers between the passes (one round trip to L2 per row), longer ones are
// read again chunk by chunk.
#define TAIL_REG 16

__device__ __forceinline__ void tail_load(float (&v)[TAIL_REG], const float *p, int base, int d) {
#pragma unroll
    for (int i = 0; i < TAIL_REG; i++) {
        const int c = base + threadIdx.x + blockDim.x * i;
        v[i] = c < d ? ld_l2(p + c) : 0.f;
    }
}

// Pass 2 of a chunk: x += y (normalised by ps * post_w first) when adding; returns the sum of squares.
__device__ __forceinline__ float tail_add_chunk(const MvTail &tail, float (&xv)[TAIL_REG], const float (&yv)[TAIL_REG],
                                                float *y, float *x, int base, int d, float ps) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < TAIL_REG; i++) {
        const int c = base + threadIdx.x + blockDim.x * i;
        if (c >= d) break;
        if (tail.add) {
            float t = yv[i];
            if (tail.post_w) {
                t = t * ps * tail.post_w[c];
                y[c] = t;
            }
            xv[i] += t;
            x[c] = xv[i];
        }
        ss += xv[i] * xv[i];
    }
    return ss;
}

// Pass 3 of a chunk: the next norm of x, written as f32 and quantized (whole warps: d % 32 == 0).
__device__ __forceinline__ void tail_pre_chunk(const MvTail &tail, int n, const float (&xv)[TAIL_REG], int j, int base, int d,
                                               float sc) {
    float4 *meta = (float4 *)(tail.pre_q + (size_t)n * d);
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int i = 0; i < TAIL_REG; i++) {
        if (base + (int)blockDim.x * i + 32 * warp >= d) break;
        const int c = base + threadIdx.x + blockDim.x * i;
        const size_t at = (size_t)j * d + c;
        const float t = xv[i] * sc * tail.pre_w[c];
        tail.pre_h[at] = t;
        if (tail.pre_q) q8_store_warp(t, at, tail.pre_q, meta);
    }
}

__device__ void mv_tail(const MvTail &tail, float *y0, int d, int n, float *red, int *last_s) {
    // The block's outputs, ordered by the barrier, are published by thread 0's fence before it
    // counts (fences are cumulative; the pattern of a cooperative grid barrier).
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const bool last = atomicAdd(tail.counter, 1u) == gridDim.x - 1;
        if (last) __threadfence();  // what every block published is visible from here on
        *last_s = last;
    }
    __syncthreads();
    if (!*last_s) return;
    const int chunk = TAIL_REG * blockDim.x;
    const bool one = d <= chunk;  // the whole row in registers
    for (int j = 0; j < n; j++) {
        float *y = y0 + (size_t)j * d, *x = tail.res + (size_t)j * d;
        float xv[TAIL_REG], yv[TAIL_REG];
        if (one) {
            tail_load(xv, x, 0, d);
            if (tail.add) tail_load(yv, y, 0, d);
        }
        float ps = 1.f;
        if (tail.add && tail.post_w) {
            float s0 = 0.f;
            for (int base = 0; base < d; base += chunk) {
                if (!one) tail_load(yv, y, base, d);
#pragma unroll
                for (int i = 0; i < TAIL_REG; i++) s0 += yv[i] * yv[i];
            }
            ps = rsqrtf(block_sum(s0, red) / (float)d + tail.post_eps);
        }
        float ss = 0.f;
        for (int base = 0; base < d; base += chunk) {
            if (!one) {
                tail_load(xv, x, base, d);
                if (tail.add) tail_load(yv, y, base, d);
            }
            ss += tail_add_chunk(tail, xv, yv, y, x, base, d, ps);
        }
        if (tail.pre_w) {
            const float sc = rsqrtf(block_sum(ss, red) / (float)d + tail.pre_eps);
            for (int base = 0; base < d; base += chunk) {
                if (!one) tail_load(xv, x, base, d);  // this thread's own writes of pass 2
                tail_pre_chunk(tail, n, xv, j, base, d, sc);
            }
        }
        __syncthreads();  // the next row's block_sum reuses red
    }
    if (threadIdx.x == 0) atomicExch(tail.counter, 0u);  // ready for the next launch
}

// The prologues' work is latency (a row is a few KB, every block waits for it). A thread's values
// of a row are loaded at once into registers with their norm weights, then summed, scaled and
// quantized from there: one round trip to memory per row. Layout: pass i of warp w holds the
// 32-value blocks b = 4 (w + nw i) + lane / 8, eight lanes a block and four values a lane (one
// float4), so that a warp quantizes four blocks at once with shuffles among eight lanes instead
// of one block per warp in turn (ten dependent shuffles each, half the prologue's time). Rows of
// more than 4 PRO_PASS blocks per warp (longer than the host lets a prologue take) take the
// strided loops.
#define PRO_PASS 2
#define PRO_REG (4 * PRO_PASS)  // values a lane holds

__device__ __forceinline__ int pro_block(int i) {
    return 4 * ((threadIdx.x >> 5) + (blockDim.x >> 5) * i) + ((threadIdx.x & 31) >> 3);
}
// Whether pass i of this warp holds any of the kb blocks (the same for the whole warp).
__device__ __forceinline__ bool pro_pass(int i, int kb) {
    return 4 * ((threadIdx.x >> 5) + (blockDim.x >> 5) * i) < kb;
}
// v[i] = this lane's four values of block pro_block(i) of row p (zeros past kb); p 16-byte aligned
__device__ __forceinline__ void pro_load(float4 (&v)[PRO_PASS], const float *p, int kb) {
    const int l8 = threadIdx.x & 7;
#pragma unroll
    for (int i = 0; i < PRO_PASS; i++) {
        const int b = pro_block(i);
        v[i] = b < kb ? *(const float4 *)(p + 32 * b + 4 * l8) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}
__device__ __forceinline__ bool al16(const void *p) { return ((size_t)p & 15) == 0; }
__device__ __forceinline__ float sq4(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }
__device__ __forceinline__ float4 mul4(float4 v, float s, float4 w) {
    return make_float4(v.x * s * w.x, v.y * s * w.y, v.z * s * w.z, v.w * s * w.w);
}
// q8_store_warp's format for block b held by eight lanes, four values each (lane & 7 = which four):
// the same values, scales and sums, written at row offset `at` (the row's start in xq) when `store`
// (every lane of the warp takes part in the shuffles: a group of eight past the row stores nothing).
__device__ __forceinline__ void q8_store_oct(float4 t, int b, size_t at, u8 *xq, float4 *meta, bool store) {
    const int l8 = threadIdx.x & 7;
    float amax = fmaxf(fmaxf(fabsf(t.x), fabsf(t.y)), fmaxf(fabsf(t.z), fabsf(t.w)));
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const int q0 = __float2int_rn(t.x * id), q1 = __float2int_rn(t.y * id), q2 = __float2int_rn(t.z * id),
              q3 = __float2int_rn(t.w * id);
    int s = q0 + q1 + q2 + q3;
    s += __shfl_xor_sync(FULL_MASK, s, 2);
    s += __shfl_xor_sync(FULL_MASK, s, 1);  // each half of 16 values: four lanes
    const int s_hi = __shfl_xor_sync(FULL_MASK, s, 4);
    if (!store) return;
    const size_t i0 = at + 32 * (size_t)b;
    *(u32 *)(xq + i0 + 4 * l8) = (u32)(q0 & 0xFF) | (u32)(q1 & 0xFF) << 8 | (u32)(q2 & 0xFF) << 16 | (u32)(q3 & 0xFF) << 24;
    if (l8 == 0) meta[i0 >> 5] = make_float4(d, d * (float)s, d * (float)s_hi, 0.f);
}

// The prologue (see MvPro): rows j0 .. j0 + nl - 1 of x into xq_s (nl rows, q8_store_warp's format).
__device__ void mv_prologue(const MvPro &pro, int k, int j0, int nl, bool write_h, u8 *xq_s, float *red) {
    const int kb = k / 32, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    float4 *meta = (float4 *)(xq_s + (size_t)nl * k);
    const bool regs = kb <= PRO_REG * nw && al16(pro.src) && al16(pro.w) && al16(pro.h);
    float4 wv[PRO_PASS];
    if (regs) pro_load(wv, pro.w, kb);
    for (int j = 0; j < nl; j++) {
        const int r = j0 + j;
        const float *xr = pro.src + (size_t)(pro.idx ? pro.idx[r] : r) * k;
        if (regs) {
            float4 v[PRO_PASS];
            float ss = 0.f;
            pro_load(v, xr, kb);
#pragma unroll
            for (int i = 0; i < PRO_PASS; i++) ss += sq4(v[i]);
            const float sc = rsqrtf(block_sum(ss, red) / (float)k + pro.eps);
#pragma unroll
            for (int i = 0; i < PRO_PASS; i++) {
                if (!pro_pass(i, kb)) break;  // whole warps
                const int b = pro_block(i);
                const float4 t = mul4(v[i], sc, wv[i]);
                if (write_h && b < kb) *(float4 *)(pro.h + (size_t)r * k + 32 * b + 4 * (lane & 7)) = t;
                q8_store_oct(t, b, (size_t)j * k, xq_s, meta, b < kb);
            }
            continue;
        }
        float ss = 0.f;
        for (int c = threadIdx.x; c < k; c += blockDim.x) ss += xr[c] * xr[c];
        const float sc = rsqrtf(block_sum(ss, red) / (float)k + pro.eps);
        for (int b = warp; b < kb; b += nw) {  // whole warps: b depends on the warp only
            const int c = 32 * b + lane;
            const float t = xr[c] * sc * pro.w[c];
            if (write_h) pro.h[(size_t)r * k + c] = t;
            q8_store_warp(t, (size_t)j * k + c, xq_s, meta);
        }
    }
    __syncthreads();
}

// The residual prologue (pro.y set): f_s (nl, 3, k) keeps each row's post-normed y, new r and
// normalised x for the block that writes them back.
__device__ void mv_prologue_res(const MvPro &pro, int k, int j0, int nl, u8 *xq_s, float *f_s, float *red, int *last_s) {
    const int kb = k / 32, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    float4 *meta = (float4 *)(xq_s + (size_t)nl * k);
    const bool regs = kb <= PRO_REG * nw && al16(pro.src) && al16(pro.y) && al16(pro.w) && al16(pro.post_w);
    float4 pw[PRO_PASS], wv[PRO_PASS];
    if (regs) {
        pro_load(pw, pro.post_w, kb);
        pro_load(wv, pro.w, kb);
    }
    for (int j = 0; j < nl; j++) {
        const size_t row = (size_t)(j0 + j) * k;
        const float *y = pro.y + row, *res = pro.src + row;
        float *yn = f_s + (size_t)j * 3 * k, *xn = yn + k, *hn = xn + k;
        if (regs) {
            float4 yv[PRO_PASS], rv[PRO_PASS];
            float ss = 0.f;
            pro_load(yv, y, kb);
            pro_load(rv, res, kb);
#pragma unroll
            for (int i = 0; i < PRO_PASS; i++) ss += sq4(yv[i]);
            const float ps = rsqrtf(block_sum(ss, red) / (float)k + pro.post_eps);
            float sx = 0.f;
#pragma unroll
            for (int i = 0; i < PRO_PASS; i++) {  // past the row: y, r and the weights are 0
                yv[i] = make_float4(yv[i].x * (ps * pw[i].x), yv[i].y * (ps * pw[i].y), yv[i].z * (ps * pw[i].z),
                                    yv[i].w * (ps * pw[i].w));
                rv[i] = make_float4(rv[i].x + yv[i].x, rv[i].y + yv[i].y, rv[i].z + yv[i].z, rv[i].w + yv[i].w);
                sx += sq4(rv[i]);
            }
            const float sc = rsqrtf(block_sum(sx, red) / (float)k + pro.eps);
#pragma unroll
            for (int i = 0; i < PRO_PASS; i++) {
                if (!pro_pass(i, kb)) break;  // whole warps
                const int b = pro_block(i), c = 32 * b + 4 * (lane & 7);
                const float4 t = mul4(rv[i], sc, wv[i]);
                if (b < kb) {
                    *(float4 *)(yn + c) = yv[i];
                    *(float4 *)(xn + c) = rv[i];
                    *(float4 *)(hn + c) = t;
                }
                q8_store_oct(t, b, (size_t)j * k, xq_s, meta, b < kb);
            }
            continue;
        }
        float ss = 0.f;
        for (int c = threadIdx.x; c < k; c += blockDim.x) ss += y[c] * y[c];
        const float ps = rsqrtf(block_sum(ss, red) / (float)k + pro.post_eps);
        float sx = 0.f;
        for (int c = threadIdx.x; c < k; c += blockDim.x) {
            const float t = y[c] * ps * pro.post_w[c], v = res[c] + t;
            yn[c] = t;
            xn[c] = v;
            sx += v * v;
        }
        const float sc = rsqrtf(block_sum(sx, red) / (float)k + pro.eps);  // its barriers order xn
        for (int b = warp; b < kb; b += nw) {
            const int c = 32 * b + lane;
            const float t = xn[c] * sc * pro.w[c];
            hn[c] = t;
            q8_store_warp(t, (size_t)j * k + c, xq_s, meta);
        }
    }
    __syncthreads();
    // Every block has read r and y once it has counted in (its fence orders those reads first).
    if (threadIdx.x == 0) {
        __threadfence();
        *last_s = atomicAdd(pro.counter, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!*last_s) return;
    for (int j = 0; j < nl; j++) {
        const size_t row = (size_t)(j0 + j) * k;
        const float *yn = f_s + (size_t)j * 3 * k, *xn = yn + k, *hn = xn + k;
        for (int c = threadIdx.x; c < k; c += blockDim.x) {
            ((float *)pro.src)[row + c] = xn[c];
            if (pro.h) pro.h[row + c] = hn[c];
            if (pro.yout) pro.yout[row + c] = yn[c];
        }
    }
    if (threadIdx.x == 0) atomicExch(pro.counter, 0u);  // ready for the next launch
}

// Bytes of one row of x quantized (q8_store_warp's format: values, then a float4 per 32).
__device__ __forceinline__ size_t k_xq_bytes(int k) { return (size_t)k + (size_t)(k / 32) * 16; }

// A team's two rows in block of teams tbk: matrix m, row r, whether in range, and their weights.
struct MvTeamRows {
    int m[2], r[2];
    bool ok[2];
    const u8 *w0, *w1;
};

__device__ __forceinline__ void mv_team_rows(MvTeamRows &t, const MvMats &mt, bool gated, int tbk, int tl, int tb) {
    const int team = tbk * (blockDim.x >> tl) + tb;
    if (gated) {  // a team computes gate row `team` and up row `team`
        t.m[0] = 0, t.m[1] = 1, t.r[0] = t.r[1] = team;
        t.ok[0] = t.ok[1] = team < mt.rows[0];
    } else {
        t.ok[0] = mv_job(mt, 2 * team, t.m[0], t.r[0]);
        t.ok[1] = mv_job(mt, 2 * team + 1, t.m[1], t.r[1]);
    }
    t.w0 = pick4(mt.w, t.m[0]) + (size_t)t.r[0] * mt.row_bytes;
    t.w1 = pick4(mt.w, t.m[1]) + (size_t)t.r[1] * mt.row_bytes;
}

__device__ __forceinline__ void mv_prefetch_rows(const MvTeamRows &t, i64 row_bytes, int lane, int T) {
    if (row_bytes <= 0) return;
    if (t.ok[0]) prefetch_range_l2(t.w0, row_bytes, lane, T);
    if (t.ok[1]) prefetch_range_l2(t.w1, row_bytes, lane, T);
}

// Before the wait (one activation row, MV_PRE_OK): a lane's first steps of slices into pre;
// returns how many the dot product takes from there.
template <int NMAX>
__device__ __forceinline__ int mv_load_pre(const MvRun &run, const MvTeamRows &t, int lane, int T, MvPre &pre) {
    int use_pre = 0;
    if constexpr (NMAX == 1 && MV_PRE_OK) {
        use_pre = min(run.pre_dec, MV_PRE_HELD);
#pragma unroll
        for (int i = 0; i < MV_PRE_HELD; i++) {
            pre.have[i] = i < use_pre && lane + i * T < run.k / 32 / SPL;
            if (!pre.have[i]) continue;
            if constexpr (MV_PRE_RAW) {
                if (t.ok[0]) slice2_raw<QT>(t.w0, lane + i * T, pre.r0[i]);
                if (t.ok[1]) slice2_raw<QT>(t.w1, lane + i * T, pre.r1[i]);
            } else {
                mv_decode_step<QT>(t.w0, t.w1, t.ok[0], t.ok[1], lane + i * T, pre.q0[i], pre.q1[i]);
            }
        }
    }
    return use_pre;
}

// The team's partial sums into its first lane: shuffles within a warp, then, for a team of
// several warps (tall k), the warps' partials through shared memory part_s.
template <int NMAX>
__device__ __forceinline__ void mv_team_sum(float (&acc)[2][NMAX], int T, int lane, float (*part_s)[2][8]) {
#pragma unroll
    for (int jb = 0; jb < 2; jb++)
#pragma unroll
        for (int j = 0; j < NMAX; j++) acc[jb][j] = group_sum(acc[jb][j], T < 32 ? T : 32);
    if (T > 32) {
        const int warp = threadIdx.x >> 5;
        if ((threadIdx.x & 31) == 0) {
#pragma unroll
            for (int jb = 0; jb < 2; jb++)
#pragma unroll
                for (int j = 0; j < NMAX; j++) part_s[warp][jb][j] = acc[jb][j];
        }
        __syncthreads();
        if (lane == 0) {
#pragma unroll
            for (int jb = 0; jb < 2; jb++)
#pragma unroll
                for (int j = 0; j < NMAX; j++) {
                    float sum = 0.f;
                    for (int w = 0; w < T / 32; w++) sum += part_s[warp + w][jb][j];
                    acc[jb][j] = sum;
                }
        }
    }
}

// The epilogue, in a team's first lane: y stored, added into the residual, or gate and up stored
// with act(gate) * up (kept in act_s for the activation's quantization).
template <int NMAX>
__device__ __forceinline__ void mv_epilogue(const MvMats &mt, const MvEpi &epi, const MvTeamRows &t,
                                            const float (&acc)[2][NMAX], const float (&res_old)[2], int j0, int nl,
                                            int tb, float (*act_s)[32]) {
    if (epi.mode == MODE_SILU || epi.mode == MODE_GELU) {
        const int rows = mt.rows[0];
#pragma unroll
        for (int j = 0; j < NMAX; j++) {
            if (j >= nl) break;
            const float g = acc[0][j], up = acc[1][j];
            const float act = (epi.mode == MODE_SILU ? silu_f(g) : gelu_tanh_f(g)) * up;
            if (t.ok[0]) {
                const size_t at = (size_t)(j0 + j) * rows + t.r[0];
                mt.y[0][at] = g;
                mt.y[1][at] = up;
                epi.aux[at] = act;
            }
            if (epi.act_q) act_s[j][tb] = t.ok[0] ? act : 0.f;
        }
        return;
    }
#pragma unroll
    for (int jb = 0; jb < 2; jb++) {
        if (!t.ok[jb]) continue;
        const int rows = pick4(mt.rows, t.m[jb]);
        float *y = pick4(mt.y, t.m[jb]);
#pragma unroll
        for (int j = 0; j < NMAX; j++) {
            if (j >= nl) break;
            const size_t at = (size_t)(j0 + j) * rows + t.r[jb];
            y[at] = acc[jb][j];
            if (epi.mode == MODE_RESIDUAL) epi.aux[at] = (NMAX == 1 ? res_old[jb] : epi.aux[at]) + acc[jb][j];
        }
    }
}

// The gated activation of this block's 32 rows quantized (256 threads, teams of 8): one warp per
// activation row.
__device__ __forceinline__ void mv_act_quant(const MvEpi &epi, int rows, int n, int j0, int nl, int tblock,
                                             float (*act_s)[32]) {
    const int warp = threadIdx.x >> 5, ln = threadIdx.x & 31;
    float4 *meta = (float4 *)(epi.act_q + (size_t)n * rows);
    for (int j = warp; j < nl; j += blockDim.x >> 5)
        q8_store_warp(act_s[j][ln], (size_t)(j0 + j) * rows + (size_t)tblock * 32 + ln, epi.act_q, meta);
}

// The activation rows the product reads: the producer's xq, or (a prologue) rows made by the
// block itself in shared memory xq_s; jx, nx: the first row and the rows of that buffer.
__device__ __forceinline__ const u8 *mv_stage_x(const MvRun &run, const MvPro &pro, int j0, int nl, int tblock,
                                                u8 *xq_s, float *red, int *last_pro_s, int &jx, int &nx) {
    jx = j0, nx = run.n;
    if (pro.y) {
        mv_prologue_res(pro, run.k, j0, nl, xq_s, (float *)(xq_s + (size_t)nl * k_xq_bytes(run.k)), red, last_pro_s);
    } else if (pro.w) {
        mv_prologue(pro, run.k, j0, nl, tblock == 0, xq_s, red);
    } else {
        return run.xq;
    }
    jx = 0, nx = nl;
    return xq_s;
}

// One launch of the matrix-vector kernels: early loads, the prologue, then per block of teams
// the dot products (the core), their sums and the epilogue; the tail last.
template <int NMAX>
__device__ __forceinline__ void mv_body(const MvMats &mt, const MvRun &run, const MvEpi &epi, const MvPro &pro,
                                        const MvTail &tail) {
    extern __shared__ __align__(16) u8 xq_s[];  // prologue: nl rows of x quantized (nl * k * 1.5 bytes)
    __shared__ float red[32];
    __shared__ float act_s[8][32];
    __shared__ int last_s, last_pro_s;
    __shared__ float part_s[8][2][8];  // teams wider than a warp: per-warp partial sums (256 threads)
    // More than NMAX activation rows (batched decode): groups of NMAX rows, the groups of one
    // block of teams on neighbouring blocks, so that they read the same weights at about the same
    // time (from L2 but for the first).
    const int n_groups = (run.n + NMAX - 1) / NMAX, group = blockIdx.x % n_groups;
    const int j0 = group * NMAX, nl = min(NMAX, run.n - j0);
    const int tl = run.team_log2, T = 1 << tl, lane = threadIdx.x & (T - 1), tb = threadIdx.x >> tl;
    const bool gated = epi.mode == MODE_SILU || epi.mode == MODE_GELU;
    // Blocks of teams tblock = blockIdx.x / n_groups, + stride, ... < n_tblocks: a grid of fewer
    // blocks than blocks of teams (one that fits on the GPU at once) walks the rest, its prologue
    // done once and the next rows prefetched while it works on these.
    const int stride = gridDim.x / n_groups;
    int tblock = blockIdx.x / n_groups;
    MvTeamRows t;
    mv_team_rows(t, mt, gated, tblock, tl, tb);
    // The weights depend on no earlier kernel: the team's two rows go into L2 while the kernel
    // before this one still runs (launched early inside a captured step), then wait for x.
    pdl_launch_next();
    mv_prefetch_rows(t, run.pf_row, lane, T);
    MvPre pre;
    int use_pre = mv_load_pre<NMAX>(run, t, lane, T, pre);
    pdl_wait();
    // Teams past the end still take part in the shuffles below (whole warps), computing nothing.
    int jx, nx;
    const u8 *xq = mv_stage_x(run, pro, j0, nl, tblock, xq_s, red, &last_pro_s, jx, nx);
    for (;;) {
        // One activation row adding into the residual: each row's old value is read now, its load in
        // flight beside the product's, not after it (one round trip less). One matrix in this mode.
        float res_old[2] = {0.f, 0.f};
        if constexpr (NMAX == 1) {
            if (epi.mode == MODE_RESIDUAL && lane == 0) {
                if (t.ok[0]) res_old[0] = epi.aux[(size_t)j0 * mt.rows[0] + t.r[0]];
                if (t.ok[1]) res_old[1] = epi.aux[(size_t)j0 * mt.rows[0] + t.r[1]];
            }
        }
        const int next = tblock + stride;
        float acc[2][NMAX];
#pragma unroll
        for (int jb = 0; jb < 2; jb++)
#pragma unroll
            for (int j = 0; j < NMAX; j++) acc[jb][j] = 0.f;
        if (next < run.n_tblocks) {  // this block's next rows go into L2 while it works on these
            mv_team_rows(t, mt, gated, next, tl, tb);
            mv_prefetch_rows(t, run.pf_row, lane, T);
            mv_team_rows(t, mt, gated, tblock, tl, tb);
        }
        if (NMAX > 1 && !QFLOAT && run.kc && xq == run.xq) {
            for (int c0 = 0; c0 < run.k; c0 += run.kc) {  // whole blocks: every thread reaches each barrier
                const int kn = min(run.kc, run.k - c0);
                if (c0) __syncthreads();  // the last chunk's reads are done
                mv_stage_chunk(xq, nx, jx, run.k, nl, c0, kn, run.kc, xq_s);
                __syncthreads();
                mv_dot_staged<NMAX>(t.w0, t.w1, t.ok[0], t.ok[1], lane, T, nl, xq_s, c0, kn, run.kc, acc);
            }
        } else {
            mv_dot_rows<NMAX>(run, t.w0, t.w1, t.ok[0], t.ok[1], lane, T, j0, nl, xq, jx, nx, acc, pre, use_pre);
        }
        use_pre = 0;  // a walking grid's later rows are decoded in the loop
        mv_team_sum<NMAX>(acc, T, lane, part_s);
        if (lane == 0) mv_epilogue<NMAX>(mt, epi, t, acc, res_old, j0, nl, tb, act_s);
        if (epi.act_q) {
            __syncthreads();
            mv_act_quant(epi, mt.rows[0], run.n, j0, nl, tblock, act_s);
        }
        if (next >= run.n_tblocks) break;
        __syncthreads();  // part_s and act_s are written again
        tblock = next;
        mv_team_rows(t, mt, gated, tblock, tl, tb);
    }
    if (tail.counter) mv_tail(tail, mt.y[0], mt.rows[0], run.n, red, &last_s);
}

// The kernels' parameters, flat, in the order of the structs above; MV_ARGS gathers them into one
// MvArgs (one aggregate: split into five locals, mv_n1_occ's 80 registers spilled).
struct MvArgs {
    MvMats mt;
    MvRun run;
    MvEpi epi;
    MvPro pro;
    MvTail tail;
};
#define MV_PARAMS                                                                                                  \
    const u8 *w0, const u8 *w1, const u8 *w2, const u8 *w3, float *y0, float *y1, float *y2, float *y3,        \
        int rows0, int rows1, int rows2, int rows3, int n_mat, i64 row_bytes, int k, int n, const float *x,        \
        const u8 *xq, int team_log2, int n_tblocks, int pre_dec, i64 pf_row, int kc, int mode, float *aux,         \
        u8 *act_q,                                                                                                 \
        const float *pro_src, const int *pro_idx, const float *pro_w, float pro_eps, float *pro_h,                 \
        const float *pro_y, float *pro_yout, const float *pro_post_w, float pro_post_eps, unsigned *pro_counter,    \
        unsigned *counter, float *res, int tail_add, const float *post_w, float post_eps, const float *pre_w,      \
        float pre_eps, float *pre_h, u8 *pre_q
#define MV_ARGS                                                                                                    \
    MvArgs a = {{{w0, w1, w2, w3}, {y0, y1, y2, y3}, {rows0, rows1, rows2, rows3}, n_mat, row_bytes},             \
                {k, n, x, xq, team_log2, n_tblocks, pre_dec, pf_row, kc},                                          \
                {mode, aux, act_q},                                                                                \
                {pro_src, pro_idx, pro_w, pro_eps, pro_h, pro_y, pro_yout, pro_post_w, pro_post_eps, pro_counter}, \
                {counter, res, tail_add, post_w, post_eps, pre_w, pre_eps, pre_h, pre_q}}
#define MV_BODY(NMAX) mv_body<NMAX>(a.mt, a.run, a.epi, a.pro, a.tail)

// The module matmul_<type> holds mv_n1 and the other kernels below; matmul_<type>_batch (MV_BATCH
// defined) holds mv_n2, mv_n4 and mv_n8 alone, matmul_<type>_occ (MV_OCC) mv_n1_occ alone,
// matmul_<type>_store (MV_STORE) mv_n1_store alone, matmul_<type>_xs (MV_XS) mv_xs alone. Each mv_body instance is most of a module's
// compile time: a first token waits for the modules it needs, which compile side by side, and the
// batch module compiles later.
#if defined(MV_OCC)
// mv_n1 held to 80 registers (a few spills in the prologue and tail): three blocks of 256 threads
// (six of 128) a multiprocessor instead of two (four), for products of more blocks than fit at once
extern "C" __global__ void __launch_bounds__(MVQ_THREADS, 3) mv_n1_occ(MV_PARAMS) {
    MV_ARGS;
    MV_BODY(1);
}
#elif defined(MV_XS)
// mv_xs: gate and up of one activation row over large matrices (matmul_<type>_xs), the gated
// activation optionally quantized. x-stationary: a team of T lanes (whole warps) covers a whole
// row, lane l taking lane step l (SPL slices) of every row, so that each lane loads its slices of x
// once, into registers, and then streams rows, a gate/up pair per iteration, the next pair's
// loads issued before the current pair's dot products (their addresses run on from lane to lane).
// mv_n1's teams of a few lanes read x again for every pair of rows; at Llama-3.1-8B's size (448
// blocks of 32 rows) this kernel reads gate and up 1.3-1.45x as fast (bench/NOTES.md). A block
// takes 32 pairs (teams of a block share them) and quantizes its 32 activations at the end.
// Products that only store y take it too where they normalise x themselves: each lane quantizes
// its own slices of x (whole 32-value blocks) in registers, so the norm needs no launch of its
// own and no shared memory, the row's sum of squares a block reduction (xs_prologue).

// A lane step's raw bytes, loaded apart from its decode so that the next rows' loads are in
// flight while the current ones are used: Q4_K/Q5_K as RawK; Q8_0 as the three aligned 16-byte
// chunks covering its block. (Q6_K, whose slices load as they decode, was slower here than on
// mv_n1 within a step: bench/NOTES.md.)
struct XsRaw {
    RawK r;
    int off;
};
template <int TT>
__device__ __forceinline__ void xs_load(const u8 *__restrict__ row, int p, XsRaw &x) {
    if constexpr (TT == T_Q4_K || TT == T_Q5_K) {
        slice2_raw<TT>(row, p, x.r);
    } else if constexpr (TT == T_Q8_0) {
        const u8 *b = row + (size_t)p * 34;
        const uint4 *base = (const uint4 *)((size_t)b & ~(size_t)15);
        x.r.hd = base[0], x.r.qa = base[1], x.r.qb = base[2];
        x.off = (int)((size_t)b & 15);
    }
}
template <int TT>
__device__ __forceinline__ void xs_decode(const XsRaw &x, const u8 *__restrict__ row, int p, QSlice (&q)[SPL]) {
    if constexpr (TT == T_Q4_K || TT == T_Q5_K) {
        slice2_decode<TT>(x.r, p, q[0], q[SPL - 1]);
    } else if constexpr (TT == T_Q8_0) {  // as slice_q: the block's words aligned, then its levels
        u32 w[12] = {x.r.hd.x, x.r.hd.y, x.r.hd.z, x.r.hd.w, x.r.qa.x, x.r.qa.y,
                     x.r.qa.z, x.r.qa.w, x.r.qb.x, x.r.qb.y, x.r.qb.z, x.r.qb.w};
        align_words(w, x.off);
        const float d = h2f((u16)(w[0] & 0xFFFFu));
#pragma unroll
        for (int i = 0; i < 8; i++) q[0].q[i] = (int)fshr(w[i], w[i + 1], 16);
        q[0].a[0] = q[0].a[1] = d, q[0].b[0] = q[0].b[1] = 0.f;
    } else {
        static_assert(TT == T_Q4_K || TT == T_Q5_K || TT == T_Q8_0, "mv_xs takes Q4_K, Q5_K and Q8_0");
    }
}

// One iteration's pair (ok: job < the block's end) and its raw bytes: gated, gate and up row
// `job`; storing, rows 2 job and 2 job + 1 of the matrices' rows taken one after the other.
struct XsPair {
    int job;
    bool ok;
    const u8 *w[2];
    float *y[2];
    XsRaw raw[2];
};
__device__ __forceinline__ void xs_pair(XsPair &x, const MvMats &mt, bool gated, int job, int j_end, bool has,
                                        int lane) {
    x.job = job, x.ok = job < j_end;
#pragma unroll
    for (int q = 0; q < 2; q++) {
        int m = q, r = job;
        if (!gated) mv_job(mt, 2 * job + q, m, r);
        x.w[q] = pick4(mt.w, m) + (size_t)r * mt.row_bytes;
        x.y[q] = pick4(mt.y, m) + r;
        if (x.ok && has) xs_load<QT>(x.w[q], lane, x.raw[q]);
    }
}

// The prologue of mv_xs (nw set): x = RMS norm of src by nw, quantized (q8_store_warp's values,
// scales and half-sums) straight into the lane's registers. The block holds the row in shared
// memory row_s (k floats): the norm weights, copied before the kernel waits (constants), then
// x * w, every thread loading its share of src at once (one round trip to L2 after the wait) and
// summing its squares. Lane `lane` then takes the values [32 SPL lane, 32 SPL (lane + 1)) of the
// row -- whole 32-value blocks, so it quantizes them alone. In slice e, half hh of the product's
// lane step: Q8_0 (one block) half hh of it; Q4_K/Q5_K (two blocks, see slice_offsets) half e of
// block hh. write_h: the lane's values of x also stored to h.
#define XS_PRO_BATCH 8  // float4 loads of src in flight a thread

__device__ __forceinline__ void xs_norm_weights(const float *__restrict__ nw, int k, float *row_s) {
    for (int i = threadIdx.x; i < k / 4; i += blockDim.x) ((float4 *)row_s)[i] = ((const float4 *)nw)[i];
}

__device__ __forceinline__ void xs_prologue(const float *__restrict__ src, float eps, float *h, int k, bool has,
                                            bool write_h, int lane, float *row_s, float *red, int4 (&xv)[SPL][2],
                                            float (&xd)[SPL][2], float (&xs)[SPL][2]) {
    const int n4 = k / 4;
    float ss = 0.f;
    float4 *r4 = (float4 *)row_s;
    for (int i0 = threadIdx.x; i0 < n4; i0 += XS_PRO_BATCH * blockDim.x) {
        float4 v[XS_PRO_BATCH];
#pragma unroll
        for (int j = 0; j < XS_PRO_BATCH; j++) {
            const int i = i0 + j * blockDim.x;
            v[j] = i < n4 ? ((const float4 *)src)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < XS_PRO_BATCH; j++) {
            const int i = i0 + j * blockDim.x;
            if (i >= n4) break;
            const float4 w = r4[i];
            ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
            r4[i] = make_float4(v[j].x * w.x, v[j].y * w.y, v[j].z * w.z, v[j].w * w.w);
        }
    }
    const float sc = rsqrtf(block_sum(ss, red) / (float)k + eps);  // its barriers order row_s
    if (!has) return;
    const int c0 = 32 * SPL * lane;
#pragma unroll
    for (int b = 0; b < SPL; b++) {
        const float4 *p = (const float4 *)(row_s + c0 + 32 * b);
        float t[32];
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float4 v = p[i];
            t[4 * i] = v.x * sc, t[4 * i + 1] = v.y * sc, t[4 * i + 2] = v.z * sc, t[4 * i + 3] = v.w * sc;
            if (write_h)
                *(float4 *)(h + c0 + 32 * b + 4 * i) = make_float4(t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
        }
#pragma unroll
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(t[i]));
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int q[8], s[2] = {0, 0};
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 word = 0;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int v = __float2int_rn(t[4 * i + j] * id);
                s[i >> 2] += v;
                word |= (u32)(v & 0xFF) << (8 * j);
            }
            q[i] = (int)word;
        }
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int e = SPL == 2 ? half : 0, hh = SPL == 2 ? b : half;
            xv[e][hh] = make_int4(q[4 * half], q[4 * half + 1], q[4 * half + 2], q[4 * half + 3]);
            xd[e][hh] = d;
            xs[e][hh] = d * (float)s[half];
        }
    }
}

// gated (mode SILU/GELU): gate w0 and up w1, y0 = gate, y1 = up, aux = act(gate) * up (quantized
// into act_q when set), 32 pairs a block (unit). Storing (mode STORE): y_m = W_m x for up to four
// matrices, their rows taken in pairs (an even count in all), `unit` pairs a block.
// nw set: the block makes x itself (xs_prologue) from src, block 0 writing it to h, in k floats of
// dynamic shared memory; else it reads xq.
extern "C" __global__ void __launch_bounds__(512)
    mv_xs(const u8 *w0, const u8 *w1, const u8 *w2, const u8 *w3, float *y0, float *y1, float *y2, float *y3,
          int rows0, int rows1, int rows2, int rows3, int n_mat, i64 row_bytes, int k, const u8 *xq, int team,
          int unit, int mode, float *aux, u8 *act_q, const float *src, const float *nw, float eps, float *h) {
    __shared__ float part_s[2][16][2];  // a team of several warps: per-warp sums (by iteration parity)
    __shared__ float act_s[32];
    __shared__ float red[32];
    extern __shared__ __align__(16) float row_s[];  // the prologue's row (k floats)
    const MvMats mt = {{w0, w1, w2, w3}, {y0, y1, y2, y3}, {rows0, rows1, rows2, rows3}, n_mat, row_bytes};
    const bool gated = mode == MODE_SILU || mode == MODE_GELU;
    const int pairs = gated ? rows0 : (rows0 + rows1 + rows2 + rows3) / 2;
    const int T = team, lane = threadIdx.x % T, tb = threadIdx.x / T, nt = blockDim.x / T;
    const int warp = threadIdx.x >> 5, wl = threadIdx.x & 31;
    const bool has = lane < k / 32 / SPL;  // lane steps of a row: lane `lane` takes step `lane`
    const int u0 = blockIdx.x * unit, u_end = min(pairs, u0 + unit), iters = (unit + nt - 1) / nt;
    XsPair cur, nxt;
    pdl_launch_next();
    xs_pair(nxt, mt, gated, u0 + tb, u_end, has, lane);  // weights: loaded while the kernel before still runs
    if (nw) xs_norm_weights(nw, k, row_s);
    pdl_wait();
    int4 xv[SPL][2];
    float xd[SPL][2], xs[SPL][2];
    if (nw) {
        __syncthreads();  // the norm weights
        xs_prologue(src, eps, h, k, has, h && blockIdx.x == 0 && tb == 0, lane, row_s, red, xv, xd, xs);
    } else if (has) {
        const float4 *meta = (const float4 *)(xq + (size_t)k);
#pragma unroll
        for (int e = 0; e < SPL; e++) {
            int xo[2];
            slice_offsets<QT>(SPL * lane + e, xo);
#pragma unroll
            for (int hh = 0; hh < 2; hh++) {
                xv[e][hh] = *(const int4 *)(xq + xo[hh]);
                const float4 m = meta[xo[hh] >> 5];
                xd[e][hh] = m.x;
                xs[e][hh] = (xo[hh] & 16) ? m.z : m.y;
            }
        }
    }
    for (int it = 0; it < iters; it++) {
        cur = nxt;
        if (it + 1 < iters) xs_pair(nxt, mt, gated, u0 + tb + nt * (it + 1), u_end, has, lane);
        float acc[2] = {0.f, 0.f};
#pragma unroll
        for (int q = 0; q < 2; q++) {
            if (!cur.ok || !has) continue;
            QSlice wq[SPL];
            xs_decode<QT>(cur.raw[q], cur.w[q], lane, wq);
#pragma unroll
            for (int e = 0; e < SPL; e++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    int d = dp4a(wq[e].q[4 * hh], xv[e][hh].x, 0);
                    d = dp4a(wq[e].q[4 * hh + 1], xv[e][hh].y, d);
                    d = dp4a(wq[e].q[4 * hh + 2], xv[e][hh].z, d);
                    d = dp4a(wq[e].q[4 * hh + 3], xv[e][hh].w, d);
                    acc[q] += xd[e][hh] * wq[e].a[hh] * (float)d + wq[e].b[hh] * xs[e][hh];
                }
        }
        acc[0] = warp_sum(acc[0]), acc[1] = warp_sum(acc[1]);
        if (T > 32) {  // teams of several warps: their sums through shared memory, to each team's first warp
            if (wl == 0) part_s[it & 1][warp][0] = acc[0], part_s[it & 1][warp][1] = acc[1];
            __syncthreads();
            if (lane < 32) {
                acc[0] = acc[1] = 0.f;
                for (int w = 0; w < T / 32; w++)
                    acc[0] += part_s[it & 1][warp + w][0], acc[1] += part_s[it & 1][warp + w][1];
            }
        }
        if (lane == 0) {  // the team's first lane: the epilogue
            if (!gated) {
                if (cur.ok) *cur.y[0] = acc[0], *cur.y[1] = acc[1];
                continue;
            }
            const float g = acc[0], up = acc[1];
            const float act = (mode == MODE_SILU ? silu_f(g) : gelu_tanh_f(g)) * up;
            if (cur.ok) {
                *cur.y[0] = g;
                *cur.y[1] = up;
                aux[cur.job] = act;
            }
            if (cur.job - u0 < 32) act_s[cur.job - u0] = cur.ok ? act : 0.f;
        }
    }
    if (gated && act_q) {  // the block's 32 activations quantized by its first warp
        __syncthreads();
        if (warp == 0) {
            const int c = u0 + wl;
            q8_store_warp(c < rows0 ? act_s[wl] : 0.f, (size_t)c, act_q, (float4 *)(act_q + (size_t)rows0));
        }
    }
}
#elif defined(MV_STORE)
// mv_n1 for products that only store y (no prologue, epilogue or tail), those paths left out: a
// fifth of mv_n1's code, so that a step's products of several types, each type with its own
// kernels, compete less for the instruction caches.
extern "C" __global__ void __launch_bounds__(MVQ_THREADS) mv_n1_store(MV_PARAMS) {
    MV_ARGS;
    a.pro.w = a.pro.y = nullptr;
    a.pro.idx = nullptr;
    a.epi.act_q = nullptr;
    a.tail.counter = nullptr;
    a.epi.mode = MODE_STORE;
    MV_BODY(1);
}
#elif !defined(MV_BATCH)
extern "C" __global__ void __launch_bounds__(MVQ_THREADS) mv_n1(MV_PARAMS) {
    MV_ARGS;
    MV_BODY(1);
}
#else
extern "C" __global__ void __launch_bounds__(MVQ_THREADS) mv_n2(MV_PARAMS) {
    MV_ARGS;
    MV_BODY(2);
}
extern "C" __global__ void __launch_bounds__(MVQ_THREADS) mv_n4(MV_PARAMS) {
    MV_ARGS;
    MV_BODY(4);
}
extern "C" __global__ void __launch_bounds__(MVQ_THREADS, 2) mv_n8(MV_PARAMS) {
    MV_ARGS;
    MV_BODY(8);
}
#endif
#if !defined(MV_BATCH) && !defined(MV_OCC) && !defined(MV_STORE) && !defined(MV_XS)

// ---- prefill: tensor-core tiles ----

#define TILE_M 64    // tokens per block
#define TILE_K 32    // one unit
#define TILE_LD 40   // shared row stride in halves: 80 bytes, conflict-free fragment loads

// 32 floats as f16 at dst (16-byte aligned): one unit of a weight tile.
__device__ __forceinline__ void store_unit_f16(u16 *dst, const float *v) {
#pragma unroll
    for (int i = 0; i < 4; i++)
        *(uint4 *)(dst + 8 * i) = make_uint4(pack_h2(v[8 * i], v[8 * i + 1]), pack_h2(v[8 * i + 2], v[8 * i + 3]),
                                             pack_h2(v[8 * i + 4], v[8 * i + 5]), pack_h2(v[8 * i + 6], v[8 * i + 7]));
}

// mma_16816's a fragment of rows r, r + 8 and columns c, c + 8 (c = k offset + 2 * (lane & 3)) of a
// row-major f16 tile of row stride LD halves; and its b fragment of row r (a weight row: B is W.T).
template <int LD>
__device__ __forceinline__ void frag_a(u32 *a, const u16 (*t)[LD], int r, int c) {
    a[0] = *(const u32 *)&t[r][c];
    a[1] = *(const u32 *)&t[r + 8][c];
    a[2] = *(const u32 *)&t[r][c + 8];
    a[3] = *(const u32 *)&t[r + 8][c + 8];
}
template <int LD>
__device__ __forceinline__ void frag_b(u32 &b0, u32 &b1, const u16 (*t)[LD], int r, int c) {
    b0 = *(const u32 *)&t[r][c];
    b1 = *(const u32 *)&t[r][c + 8];
}

// Activations beyond f16's range (65504: FFN inputs of some models reach 10^5) would turn the tiles'
// f16 copies of x into infinities. A product block notes whether any value of its x overflowed;
// if one did, it runs again with each token row divided by a power of two that brings the row's
// largest value to 2^15 or below, and multiplies its sums back (exact: powers of two). Rows of
// ordinary size pay one compare per value and a barrier.
#define F16_MAX 65504.f

__device__ __forceinline__ bool f16_overflows(float4 v) {
    return amax4(v) > F16_MAX;
}

__device__ __forceinline__ float4 mul4(float4 v, float s) { return make_float4(v.x * s, v.y * s, v.z * s, v.w * s); }

// inv[t] = 1 / the power of two for token row t0 + t of x (n, k), over columns [c0, c1) (multiples
// of 4), for t < n_rows; a warp a row. Called by every thread of the block, between barriers.
__device__ void f16_row_scales(const float *x, int n, int k, int t0, int n_rows, int c0, int c1, float *inv) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, n_warps = blockDim.x >> 5;
    for (int t = warp; t < n_rows; t += n_warps) {
        float m = 0.f;
        if (t0 + t < n)
            for (int c = c0 + 4 * lane; c < c1; c += 128) {
                const float4 v = *(const float4 *)(x + (size_t)(t0 + t) * k + c);
                m = fmaxf(m, amax4(v));
            }
        m = warp_max(m);
        if (lane == 0) inv[t] = f16_row_scale(m);
    }
}

// y_m (n, rows_m) = x (n, k) @ W_m.T for matrix m = blockIdx.z; grid (row tiles, token tiles, n_mat).
// TN: weight rows per block, 128 (mm_tile) or 64 (mm_tile64: twice the blocks, for products too
// small to fill the GPU); each of the 4 warps computes 32 tokens x TN/2 rows.
template <int TN>
__device__ __forceinline__ void mm_tile_body(const u8 *w0, const u8 *w1, const u8 *w2, const u8 *w3, float *y0,
                                             float *y1, float *y2, float *y3, int rows0, int rows1, int rows2,
                                             int rows3, i64 row_bytes, int k, int n, const float *__restrict__ x) {
    constexpr int NI = TN / 16;  // 8-row fragments per warp
    __shared__ __align__(16) u16 xs[TILE_M][TILE_LD];  // x tile as f16 (tokens, k)
    // Float weights are (nearly) exact in f16, so x's rounding would dominate their error: x is
    // split into f16 high and low parts, two products (quantized weights do not need it).
    __shared__ __align__(16) u16 xs_lo[QFLOAT ? TILE_M : 1][TILE_LD];
    __shared__ __align__(16) u16 ws[TN][TILE_LD];  // weight tile as f16 (rows, k)
    const int mi_ = blockIdx.z;
    const u8 *w = mi_ == 0 ? w0 : mi_ == 1 ? w1 : mi_ == 2 ? w2 : w3;
    float *y = mi_ == 0 ? y0 : mi_ == 1 ? y1 : mi_ == 2 ? y2 : y3;
    const int rows = mi_ == 0 ? rows0 : mi_ == 1 ? rows1 : mi_ == 2 ? rows2 : rows3;
    const int r0 = blockIdx.x * TN, t0 = blockIdx.y * TILE_M;
    if (r0 >= rows) return;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * (TN / 2);  // this warp's 32 tokens x TN/2 rows
    __shared__ float xinv[TILE_M];  // see f16_row_scales
    if (tid < TILE_M) xinv[tid] = 1.f;
    __syncthreads();
    float acc[2][NI][4];
    bool scaled = false;
    for (;;) {
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < NI; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
        bool over = false;

        for (int k0 = 0; k0 < k; k0 += TILE_K) {
#pragma unroll
            for (int i = 0; i < 4; i++) {  // x tile: 64 x 32 floats, 512 float4
                const int idx = tid + 128 * i, tr = idx >> 3, c4 = (idx & 7) * 4;
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (t0 + tr < n) v = *(const float4 *)(x + (size_t)(t0 + tr) * k + k0 + c4);
                if (scaled) v = mul4(v, xinv[tr]);
                over |= f16_overflows(v);
                const uint2 hi = make_uint2(pack_h2(v.x, v.y), pack_h2(v.z, v.w));
                *(uint2 *)&xs[tr][c4] = hi;
                if constexpr (QFLOAT) {
                    const float4 r = make_float4(v.x - h2f((u16)(hi.x & 0xFFFFu)), v.y - h2f((u16)(hi.x >> 16)),
                                                 v.z - h2f((u16)(hi.y & 0xFFFFu)), v.w - h2f((u16)(hi.y >> 16)));
                    *(uint2 *)&xs_lo[tr][c4] = make_uint2(pack_h2(r.x, r.y), pack_h2(r.z, r.w));
                }
            }
            if (tid < TN) {  // weight tile: one unit of one row per thread
                float v[32];
                if (r0 + tid < rows) {
                    unit_f<QT>(w + (size_t)(r0 + tid) * row_bytes, k0 / 32, v);
                } else {
#pragma unroll
                    for (int i = 0; i < 32; i++) v[i] = 0.f;
                }
                store_unit_f16(ws[tid], v);
            }
            __syncthreads();
#pragma unroll
            for (int ks = 0; ks < TILE_K; ks += 16) {
#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
                // Same output mapping as the mma fragments, computed with plain FMAs.
#pragma unroll
                for (int mi = 0; mi < 2; mi++)
#pragma unroll
                    for (int ni = 0; ni < NI; ni++)
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
                    for (int mi = 0; mi < 2; mi++) frag_a<TILE_LD>(af[mi], xt, wm + 16 * mi + g, ks + 2 * tq);
#pragma unroll
                    for (int ni = 0; ni < NI; ni++) {
                        u32 b0, b1;
                        frag_b<TILE_LD>(b0, b1, ws, wn + 8 * ni + g, ks + 2 * tq);
#pragma unroll
                        for (int mi = 0; mi < 2; mi++) mma_16816(acc[mi][ni], af[mi], b0, b1);
                    }
                }
#endif
            }
            __syncthreads();
        }
        if (!__syncthreads_or(over) || scaled) break;
        f16_row_scales(x, n, k, t0, TILE_M, 0, k, xinv);
        __syncthreads();
        scaled = true;
    }

    // c0, c1: token g, rows 2tq, 2tq+1; c2, c3: token g+8.
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int tl = wm + 16 * mi + g + 8 * (e >> 1), t = t0 + tl, rr = r0 + wn + 8 * ni + 2 * tq + (e & 1);
                if (t < n && rr < rows) y[(size_t)t * rows + rr] = scaled ? acc[mi][ni][e] / xinv[tl] : acc[mi][ni][e];
            }
}

#define MM_TILE_PARAMS                                                                                    \
    const u8 *w0, const u8 *w1, const u8 *w2, const u8 *w3, float *y0, float *y1, float *y2, float *y3, \
        int rows0, int rows1, int rows2, int rows3, i64 row_bytes, int k, int n, const float *__restrict__ x
extern "C" __global__ void __launch_bounds__(128) mm_tile(MM_TILE_PARAMS) {
    PDL_ENTER();
    mm_tile_body<128>(w0, w1, w2, w3, y0, y1, y2, y3, rows0, rows1, rows2, rows3, row_bytes, k, n, x);
}
extern "C" __global__ void __launch_bounds__(128) mm_tile64(MM_TILE_PARAMS) {
    PDL_ENTER();
    mm_tile_body<64>(w0, w1, w2, w3, y0, y1, y2, y3, rows0, rows1, rows2, rows3, row_bytes, k, n, x);
}

// ---- batched decode: split tensor-core tiles ----
//
// mm_split: y_m (n, rows_m) = x (n, k) @ W_m.T for 8 < n <= 64 activation rows of a quantized
// type (a decode step of many sequences). mm_tile's blocks each walk the whole of k, so a product
// of few row tiles is a long chain of memory waits on a few multiprocessors. Here the k units
// (32 values) are split over gridDim.y blocks of ups units each, and a block:
//   - copies its first chunk of weight blocks (MS_CH units of its 64 rows, as raw GGUF bytes)
//     into shared memory with cp.async before waiting on the kernel before it (the weights depend
//     on no kernel: launched early inside a captured step, the copy overlaps that kernel);
//   - converts its share of x to f16, decodes the chunk's units to f16 (unit_f on the shared copy,
//     which keeps the rows' alignment mod 16), and runs mma.sync m16n8k16 over it while the next
//     chunk's bytes arrive;
//   - with one split and no gate, writes y (and adds into aux in MODE_RESIDUAL) itself. Otherwise
//     it writes its partial tile to part, and the last block of the tile (a counter, as mv_tail)
//     sums the partials in split order, writes y, and does the epilogue: aux += y (residual), or
//     aux = act(y_0) * y_1 (gated: both matrices' blocks count on the tile's one counter).
// grid (row tiles of 64, splits, n_mat); 256 threads = 8 warps of 32 tokens x 16 rows.
// part: (n_mat, splits, n, gridDim.x * 64) f32; counters: gridDim.x * n_mat zeros, left zero.
// Dynamic shared memory: 2 * 64 * MS_LD * 2 + 64 * span bytes (span: one chunk of a row's raw
// bytes plus 15 of alignment, rounded up to 16). CUDA only (sm_80+).
#if !defined(__HIP_PLATFORM_AMD__) && !defined(__HIPCC__)
#define MS_ROWS 64
#define MS_TOK 64
#define MS_CH 8                 // units per chunk (256 values: one K-quant super-block)
#define MS_LD (32 * MS_CH + 8)  // shared row stride in halves (528 bytes: conflict-free fragments)
#define MS_THREADS 256

extern "C" __global__ void __launch_bounds__(MS_THREADS, 2)
    mm_split(const u8 *w0, const u8 *w1, const u8 *w2, const u8 *w3, float *y0, float *y1, float *y2, float *y3,
             int rows0, int rows1, int rows2, int rows3, i64 row_bytes, int k, int n, const float *__restrict__ x,
             float *part, unsigned *counters, int ups, int mode, float *aux, int blk_vals, int blk_bytes,
             int span) {
    extern __shared__ __align__(16) u8 ms_smem[];
    u16(*xs)[MS_LD] = (u16(*)[MS_LD])ms_smem;
    u16(*ws)[MS_LD] = (u16(*)[MS_LD])(ms_smem + MS_TOK * MS_LD * 2);
    u8 *raw = ms_smem + (MS_TOK + MS_ROWS) * MS_LD * 2;
    __shared__ int last_s;

    const int mat = blockIdx.z, split = blockIdx.y, n_split = gridDim.y;
    const u8 *w = mat == 0 ? w0 : mat == 1 ? w1 : mat == 2 ? w2 : w3;
    const int rows = mat == 0 ? rows0 : mat == 1 ? rows1 : mat == 2 ? rows2 : rows3;
    const int r0 = blockIdx.x * MS_ROWS;
    pdl_launch_next();
    if (r0 >= rows) {  // a matrix with fewer row tiles than the grid: nothing here (no counter)
        pdl_wait();
        return;
    }
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
    const int units = k / 32, u0 = split * ups, u1 = min(units, u0 + ups);
    const int upb = blk_vals / 32;  // units per GGUF block (1, or 8 for the K types)

    // The raw bytes of units [uc, uc + nu) of the tile's rows into raw: row r at raw + r * span,
    // from the 16-byte boundary below its first byte.
    auto stage = [&](int uc, int nu) {
        const i64 b0 = (i64)(uc / upb) * blk_bytes, nb = (i64)((nu + upb - 1) / upb) * blk_bytes;
        const int per_row = span / 16;
        for (int i = tid; i < MS_ROWS * per_row; i += MS_THREADS) {
            const int r = i / per_row, c = i % per_row;
            if (r0 + r >= rows) continue;
            const size_t src = (size_t)(w + (size_t)(r0 + r) * row_bytes + b0);
            const size_t a0 = src & ~(size_t)15;
            if (a0 + 16 * c < src + nb) cp_async16(raw + r * span + 16 * c, (const void *)(a0 + 16 * c), 16);
        }
        cp_async_commit();
    };
    __shared__ float xinv[MS_TOK];  // see f16_row_scales
    if (tid < MS_TOK) xinv[tid] = 1.f;
    stage(u0, min(MS_CH, u1 - u0));
    pdl_wait();
    __syncthreads();

    const int wm = (warp >> 2) * 32, wn = (warp & 3) * 16;  // this warp's 32 tokens x 16 rows
    float acc[2][2][4];
    bool scaled = false;
    for (;;) {
        if (scaled) stage(u0, min(MS_CH, u1 - u0));
        bool over = false;
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 2; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

        for (int uc = u0; uc < u1; uc += MS_CH) {
            const int nu = min(MS_CH, u1 - uc), f4 = nu * 8;  // float4s of a token's share of x
            // x: tokens < n, values [32 uc, 32 (uc + nu)), as f16 (rows past n are never stored)
            {
                float4 v[16];
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    const int idx = tid + MS_THREADS * i, t = idx / f4, c = idx % f4;
                    if (t < n) v[i] = *(const float4 *)(x + (size_t)t * k + 32 * uc + 4 * c);
                    if (t < n && scaled) v[i] = mul4(v[i], xinv[t]);
                    if (t < n) over |= f16_overflows(v[i]);
                }
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    const int idx = tid + MS_THREADS * i, t = idx / f4, c = idx % f4;
                    if (t < n) *(uint2 *)&xs[t][4 * c] = make_uint2(pack_h2(v[i].x, v[i].y), pack_h2(v[i].z, v[i].w));
                }
            }
            cp_async_wait<0>();
            __syncthreads();
            // decode the chunk's units (rows past `rows` are never stored: their outputs are dropped)
            {
                const i64 b0 = (i64)(uc / upb) * blk_bytes;
                for (int i = tid; i < MS_ROWS * nu; i += MS_THREADS) {
                    const int r = i / nu, u = i % nu;
                    if (r0 + r >= rows) continue;
                    const size_t src = (size_t)(w + (size_t)(r0 + r) * row_bytes + b0);
                    float v[32];
                    unit_f<QT>(raw + r * span + (src & 15), u, v);
                    store_unit_f16(&ws[r][32 * u], v);
                }
            }
            __syncthreads();
            if (uc + MS_CH < u1) stage(uc + MS_CH, min(MS_CH, u1 - uc - MS_CH));  // raw is free again
            if (wm < n) {
                for (int ks = 0; ks < 32 * nu; ks += 16) {
                    u32 af[2][4];
#pragma unroll
                    for (int mi = 0; mi < 2; mi++) frag_a<MS_LD>(af[mi], xs, wm + 16 * mi + g, ks + 2 * tq);
#pragma unroll
                    for (int ni = 0; ni < 2; ni++) {
                        u32 b0, b1;
                        frag_b<MS_LD>(b0, b1, ws, wn + 8 * ni + g, ks + 2 * tq);
#pragma unroll
                        for (int mi = 0; mi < 2; mi++) mma_16816(acc[mi][ni], af[mi], b0, b1);
                    }
                }
            }
            __syncthreads();  // xs and ws are rewritten by the next chunk
        }
        if (!__syncthreads_or(over) || scaled) break;
        f16_row_scales(x, n, k, 0, MS_TOK, 32 * u0, 32 * u1, xinv);
        __syncthreads();
        scaled = true;
    }
    if (scaled) {
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int ni = 0; ni < 2; ni++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mi][ni][e] /= xinv[wm + 16 * mi + g + 8 * (e >> 1)];
    }

    const bool gated = mode == MODE_SILU || mode == MODE_GELU;
    float *y = mat == 0 ? y0 : mat == 1 ? y1 : mat == 2 ? y2 : y3;
    if (n_split == 1 && !gated) {
        // c0, c1: token g, rows 2tq, 2tq+1; c2, c3: token g+8
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int ni = 0; ni < 2; ni++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int t = wm + 16 * mi + g + 8 * (e >> 1), rr = r0 + wn + 8 * ni + 2 * tq + (e & 1);
                    if (t < n && rr < rows) {
                        const size_t at = (size_t)t * rows + rr;
                        y[at] = acc[mi][ni][e];
                        if (mode == MODE_RESIDUAL) aux[at] += acc[mi][ni][e];
                    }
                }
        return;
    }
    const int cap = gridDim.x * MS_ROWS;  // row stride of part
    float *my = part + ((size_t)mat * n_split + split) * n * cap;
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 2; ni++)
#pragma unroll
            for (int e = 0; e < 4; e += 2) {  // rows rr, rr + 1 (part has room up to cap)
                const int t = wm + 16 * mi + g + 8 * (e >> 1), rr = r0 + wn + 8 * ni + 2 * tq;
                if (t < n) *(float2 *)&my[(size_t)t * cap + rr] = make_float2(acc[mi][ni][e], acc[mi][ni][e + 1]);
            }
    // The block's partials, ordered by the barrier, are published by thread 0's fence before it
    // counts (as mv_tail).
    __syncthreads();
    unsigned *counter = counters + (gated ? blockIdx.x : mat * gridDim.x + blockIdx.x);
    if (tid == 0) {
        __threadfence();
        const unsigned expect = gated ? 2u * n_split : (unsigned)n_split;
        const bool last = atomicAdd(counter, 1u) == expect - 1;
        if (last) __threadfence();
        last_s = last;
    }
    __syncthreads();
    if (!last_s) return;
    // The tile's n x 64 sums, four rows (a float4 of each partial) per item, four items per thread
    // at a time, four splits' loads in flight together.
    const int items = n * (MS_ROWS / 4);
    const float *pbase = part + (gated ? 0 : (size_t)mat * n_split * n * cap);
    for (int i0 = 0; i0 < items; i0 += 4 * MS_THREADS) {
        float4 sum[2][4];
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int it = 0; it < 4; it++) sum[h][it] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int h = 0; h < 2; h++) {  // gated: the gate's splits, then the up's
            if (h == 1 && !gated) break;
            const float *ph = pbase + (size_t)h * n_split * n * cap;
            for (int s0 = 0; s0 < n_split; s0 += 4) {
                float4 v[4][4];
#pragma unroll
                for (int sj = 0; sj < 4; sj++)
#pragma unroll
                    for (int it = 0; it < 4; it++) {
                        const int i = i0 + tid + MS_THREADS * it, t = i / (MS_ROWS / 4), c = i % (MS_ROWS / 4);
                        v[sj][it] = make_float4(0.f, 0.f, 0.f, 0.f);
                        if (s0 + sj < n_split && i < items)
                            v[sj][it] = __ldcg((const float4 *)(ph + ((size_t)(s0 + sj) * n + t) * cap + r0 + 4 * c));
                    }
#pragma unroll
                for (int sj = 0; sj < 4; sj++)
#pragma unroll
                    for (int it = 0; it < 4; it++) {
                        sum[h][it].x += v[sj][it].x, sum[h][it].y += v[sj][it].y;
                        sum[h][it].z += v[sj][it].z, sum[h][it].w += v[sj][it].w;
                    }
            }
        }
#pragma unroll
        for (int it = 0; it < 4; it++) {
            const int i = i0 + tid + MS_THREADS * it, t = i / (MS_ROWS / 4), c = i % (MS_ROWS / 4);
            if (i >= items) break;
            const float gv[4] = {sum[0][it].x, sum[0][it].y, sum[0][it].z, sum[0][it].w};
            const float uv[4] = {sum[1][it].x, sum[1][it].y, sum[1][it].z, sum[1][it].w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int rr = r0 + 4 * c + j;
                if (rr >= rows) break;
                const size_t at = (size_t)t * rows + rr;
                if (gated) {
                    y0[at] = gv[j];
                    y1[at] = uv[j];
                    aux[at] = (mode == MODE_SILU ? silu_f(gv[j]) : gelu_tanh_f(gv[j])) * uv[j];
                } else {
                    y[at] = gv[j];
                    if (mode == MODE_RESIDUAL) aux[at] += gv[j];
                }
            }
        }
    }
    if (tid == 0) atomicExch(counter, 0u);  // ready for the next launch
}
#endif

// out (n, cols) = rows ids (n,) of W (rows, cols) as f32; ids outside [0, rows) give zeros.
// With prev set (a decode step launched before the host read the one before it): an id -r - 1
// stands for row r of prev (that step's best ids, prev_k a row, best first), the first of them
// that row t of bans (prev_k ids, -1 for none) does not hold.
extern "C" __global__ void __launch_bounds__(128)
    get_rows(const u8 *__restrict__ w, i64 row_bytes, int rows, int cols, const int *__restrict__ ids,
             float *__restrict__ out, const int *__restrict__ prev, int prev_k, const int *__restrict__ bans) {
    PDL_ENTER();
    const int u = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (u >= cols / 32) return;
    int id = ids[t];
    if (id < 0 && prev) {
        const int *best = prev + (size_t)(-id - 1) * prev_k, *ban = bans + (size_t)t * prev_k;
        id = -1;
        for (int j = 0; j < prev_k && id < 0; j++) {
            bool banned = false;
            for (int b = 0; b < prev_k; b++) banned |= ban[b] == best[j];
            if (!banned) id = best[j];
        }
    }
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

// out (rows, cols) f16 = rows [r0, r0 + rows) of W, for the products through the BLAS library (a
// whole matrix, or a run of its rows at a time, dequantized into one scratch buffer): a thread a
// 32-value unit, a warp's 32 units staged in shared memory (rows of 40 halves: conflict-free 16-byte
// stores) so that each store instruction of the warp writes 512 contiguous bytes of out (a unit a
// thread straight to out, 16 bytes at a 64-byte stride, took 1.5-1.9x as long on an H100).
// grid (unit groups of 128, rows).
extern "C" __global__ void __launch_bounds__(128)
    dequant_f16(const u8 *__restrict__ w, i64 row_bytes, int r0, int cols, u16 *__restrict__ out) {
    __shared__ __align__(16) u16 stage[4][32 * 40];
    PDL_ENTER();
    const int units = cols / 32, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r = blockIdx.y;
    const int ub = blockIdx.x * blockDim.x + 32 * warp;  // the warp's first unit
    if (ub >= units) return;
    u16 *st = stage[warp];
    if (ub + lane < units) {
        float v[32];
        unit_f<QT>(w + (size_t)(r0 + r) * row_bytes, ub + lane, v);
        store_unit_f16(st + 40 * lane, v);
    }
    __syncwarp();
    u16 *dst = out + (size_t)r * cols + 32 * (size_t)ub;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int un = 8 * i + (lane >> 2), part = 8 * (lane & 3);  // unit of the warp, its quarter
        if (ub + un < units) *(uint4 *)(dst + 32 * un + part) = *(const uint4 *)(st + 40 * un + part);
    }
}
#endif  // !MV_BATCH && !MV_OCC && !MV_STORE
