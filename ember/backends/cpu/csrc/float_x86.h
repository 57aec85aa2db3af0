/* Body of the prompt kernels for float weights (F16, BF16, F32) on x86, compiled by float_avx2.c and
 * float_avx512.c. The includer enables its instruction set, then defines:
 *   fvec, FP_LANES            its float vector and the floats it holds
 *   FP_VECS, FP_TOKENS        vectors of rows and tokens in a tile (FP_VECS * FP_TOKENS accumulators)
 *   fv_load(p), fv_loadu(p), fv_storeu(p, v), fv_set1(f), fv_fma(a, b, c), fv_add(a, b), fv_zero()
 *   fv_f16(p), fv_bf16(p)     FP_LANES halves (F16, BF16) at p widened to floats
 *   fv_transpose(v)           v[FP_LANES] transposed in place (v[j] lane i <- v[i] lane j)
 *
 * A panel of FP_ROWS rows is converted to floats once and stored transposed (p[i * FP_ROWS + r]: the
 * rows' value i side by side), so a tile is outer products: per value i, FP_VECS loads of the panel,
 * FP_TOKENS broadcasts of x and FP_VECS * FP_TOKENS FMAs into accumulators that each hold FP_LANES
 * outputs (no horizontal sums). The conversion is paid once for all the tokens. k is taken FP_KC
 * values at a time (the partial sums add up in y), and a chunk of tokens sweeps several panels while
 * its activations are in L2: 2048-token F16 products of MiniLM's shapes, one thread of a Xeon with
 * AVX-512: 105-140 -> 155-170 GFLOP/s with 64 rows of panels a chunk instead of one panel sweeping all
 * the tokens (128 rows: 5% more, twice the stack). */

#ifndef ALWAYS
#define ALWAYS static inline __attribute__((always_inline))
#endif
#define FP_UNROLL _Pragma("GCC unroll 16")
#define FP_ROWS (FP_VECS * FP_LANES)
#define FP_KC 512 /* values of k in a panel: FP_ROWS x FP_KC floats, 64 KiB at 32 rows */

ALWAYS float fp_scalar(const int type, const uint8_t *row, int64_t i) {
    if (type == EMBER_T_F32) return ((const float *)row)[i];
    const uint16_t h = ((const uint16_t *)row)[i];
    if (type == EMBER_T_F16) return _cvtsh_ss(h);
    const uint32_t u = (uint32_t)h << 16; /* BF16 */
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

ALWAYS fvec fp_widen(const int type, const uint8_t *row, int64_t i) {
    if (type == EMBER_T_F32) return fv_loadu((const float *)row + i);
    if (type == EMBER_T_F16) return fv_f16((const uint16_t *)row + i);
    return fv_bf16((const uint16_t *)row + i);
}

/* One row's values [k0, k0 + kc) from i on -> column r of p (kc, FP_ROWS), zeros for a row past nr. */
ALWAYS void fp_pack_row(const int type, const uint8_t *row, int live, int64_t k0, int i, int kc, float *p, int r) {
    for (; i < kc; i++) p[i * FP_ROWS + r] = live ? fp_scalar(type, row, k0 + i) : 0.0f;
}

/* Values [k0, k0 + kc) of W's rows [0, nr) (w: rows of ws bytes) -> p (kc, FP_ROWS) floats, zeros in
 * the rows from nr: FP_LANES x FP_LANES blocks transposed in registers, the edges one value at a time. */
ALWAYS void fp_pack(const int type, const uint8_t *w, int64_t ws, int nr, int64_t k0, int kc, float *p) {
    int r = 0;
    for (; r + FP_LANES <= nr; r += FP_LANES) {
        int i = 0;
        for (; i + FP_LANES <= kc; i += FP_LANES) {
            fvec v[FP_LANES];
            FP_UNROLL for (int j = 0; j < FP_LANES; j++) v[j] = fp_widen(type, w + (r + j) * ws, k0 + i);
            fv_transpose(v);
            FP_UNROLL for (int j = 0; j < FP_LANES; j++) fv_storeu(p + (i + j) * FP_ROWS + r, v[j]);
        }
        for (int j = 0; j < FP_LANES; j++) fp_pack_row(type, w + (r + j) * ws, 1, k0, i, kc, p, r + j);
    }
    for (; r < FP_ROWS; r++) fp_pack_row(type, w + r * ws, r < nr, k0, 0, kc, p, r);
}

/* y (nt, FP_ROWS) = x (nt, kc) @ p^T, plus y where add: FP_VECS x NT accumulators over the panel. */
ALWAYS void fp_tile(const float *p, int kc, const float *x, int64_t xs, float *y, int64_t ys, int add, const int NT) {
    fvec acc[FP_TOKENS][FP_VECS];
    FP_UNROLL for (int t = 0; t < NT; t++) FP_UNROLL for (int v = 0; v < FP_VECS; v++) acc[t][v] = fv_zero();
    for (int i = 0; i < kc; i++) {
        fvec wv[FP_VECS];
        FP_UNROLL for (int v = 0; v < FP_VECS; v++) wv[v] = fv_load(p + i * FP_ROWS + v * FP_LANES);
        FP_UNROLL for (int t = 0; t < NT; t++) {
            const fvec b = fv_set1(x[t * xs + i]);
            FP_UNROLL for (int v = 0; v < FP_VECS; v++) acc[t][v] = fv_fma(wv[v], b, acc[t][v]);
        }
    }
    FP_UNROLL for (int t = 0; t < NT; t++) FP_UNROLL for (int v = 0; v < FP_VECS; v++) {
        float *o = y + t * ys + v * FP_LANES;
        fv_storeu(o, add ? fv_add(fv_loadu(o), acc[t][v]) : acc[t][v]);
    }
}

static void fp_tile_nt(const float *p, int kc, const float *x, int64_t xs, float *y, int64_t ys, int add, int nt) {
    switch (nt) {
#define FP_CASE(N) case N: fp_tile(p, kc, x, xs, y, ys, add, N); return;
    FP_CASE(1) FP_CASE(2) FP_CASE(3) FP_CASE(4) FP_CASE(5) FP_CASE(6)
#if FP_TOKENS > 6
    FP_CASE(7) FP_CASE(8)
#endif
#undef FP_CASE
    }
}

/* Tokens [0, n) against one packed panel of nr rows: y[t * ys + r] for r < nr (set, or added to where
 * add). A panel cut short by the end of W goes through a buffer, so y is never written past nr. */
static void fp_sweep(const float *p, int kc, const float *x, int64_t xs, int64_t n, float *y, int64_t ys, int nr,
                     int add) {
    float part[FP_TOKENS * FP_ROWS];
    for (int64_t t = 0; t < n; t += FP_TOKENS) {
        const int nt = (int)EMBER_MIN((int64_t)FP_TOKENS, n - t);
        if (nr == FP_ROWS) {
            fp_tile_nt(p, kc, x + t * xs, xs, y + t * ys, ys, add, nt);
            continue;
        }
        fp_tile_nt(p, kc, x + t * xs, xs, part, FP_ROWS, 0, nt);
        for (int c = 0; c < nt; c++)
            for (int r = 0; r < nr; r++) y[(t + c) * ys + r] = (add ? y[(t + c) * ys + r] : 0.0f) + part[c * FP_ROWS + r];
    }
}

#define FP_GROUP (64 / FP_ROWS) /* panels packed together (128 KiB on the stack), swept by each chunk of tokens */
#define FP_TC 128                 /* tokens in a chunk: FP_TC x FP_KC floats of x (256 KiB) stay in L2 */

/* y (n, nrows) = x (n, k) @ W^T for W rows [0, nrows) of ws bytes: per FP_KC values of k, FP_GROUP
 * panels are packed, then each chunk of FP_TC tokens sweeps them all. */
ALWAYS void fp_panels(const int type, int64_t k, const uint8_t *w, int64_t ws, int64_t nrows, const float *x,
                      int64_t xs, int64_t n, float *y, int64_t ys) {
    float p[FP_GROUP][FP_KC * FP_ROWS] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < nrows; r0 += FP_GROUP * FP_ROWS) {
        const int np = (int)EMBER_MIN((int64_t)FP_GROUP, (nrows - r0 + FP_ROWS - 1) / FP_ROWS);
        for (int64_t k0 = 0; k0 < k; k0 += FP_KC) {
            const int kc = (int)EMBER_MIN((int64_t)FP_KC, k - k0);
            for (int g = 0; g < np; g++) {
                const int64_t r = r0 + g * FP_ROWS;
                fp_pack(type, w + r * ws, ws, (int)EMBER_MIN((int64_t)FP_ROWS, nrows - r), k0, kc, p[g]);
            }
            for (int64_t t0 = 0; t0 < n; t0 += FP_TC) {
                const int64_t tn = EMBER_MIN((int64_t)FP_TC, n - t0);
                for (int g = 0; g < np; g++) {
                    const int64_t r = r0 + g * FP_ROWS;
                    fp_sweep(p[g], kc, x + t0 * xs + k0, xs, tn, y + t0 * ys + r, ys,
                             (int)EMBER_MIN((int64_t)FP_ROWS, nrows - r), k0 > 0);
                }
            }
        }
    }
}

/* The ember_panel_fn: a holds the n tokens' floats (a_stride bytes apart). */
#define FLOAT_PANEL_FN(name)                                                                                   \
    void name(int type, int64_t k, const void *w, int64_t ws, int64_t nrows, const void *a, int64_t as,       \
              int64_t n, float *y, int64_t ys) {                                                             \
        const int64_t xs = as / (int64_t)sizeof(float);                                                      \
        switch (type) {                                                                                      \
        case EMBER_T_F16: fp_panels(EMBER_T_F16, k, w, ws, nrows, a, xs, n, y, ys); return;                   \
        case EMBER_T_BF16: fp_panels(EMBER_T_BF16, k, w, ws, nrows, a, xs, n, y, ys); return;                 \
        default: fp_panels(EMBER_T_F32, k, w, ws, nrows, a, xs, n, y, ys); return;                            \
        }                                                                                                    \
    }
