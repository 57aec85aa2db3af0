/* y (n, m) = x (n, k) @ W^T for quantized W, straight from its GGUF blocks.
 *
 * The activations are quantized once into the caller's scratch (by the caller for a few tokens, else
 * in a pass over the pool of its own: shares of a pass must not wait for each other, since the pool
 * may run a descheduled worker's share on another thread), rounded as llama.cpp rounds them for the
 * weight type (see quant.h). Then the rows of W (output columns; with several W sharing x, their rows
 * one after another) are shared out:
 *  - decoding (a few tokens): the product streams W from memory once, so each share takes one
 *    contiguous run of rows holding an equal part of W's bytes, fixed by its index (no counter shared
 *    between threads; runs start on 64-byte lines of y, so no two threads write one line), and walks
 *    it with microtiles: a W row (or a few short ones) against up to 4 tokens, each weight block
 *    unpacked once for them;
 *  - prompts: the product is bound by compute, and threads take short runs of rows from a shared
 *    counter (about 8 per thread), so one that falls behind leaves its work to the others; runs go to
 *    packed panels (16 rows unpacked and interleaved once, then swept by every token, see
 *    quant_avx512.c) where the ISA has them, else to microtiles over token chunks that fit in L2. */
#include <stdint.h>

#include "matmul.h"
#include "quant_iq.h"

/* Quantized activations of one token chunk stay within this many bytes (L2 is 1 MiB or more). */
#define CHUNK_ACT_BYTES (256 * 1024)
#define EMBER_MATMUL_MAX_PARTS 8
/* Runs of rows each thread takes, on average, when the product is bound by compute: enough to even out
 * a thread that falls behind. Up to STREAM_TOKENS tokens it is bound by streaming W from memory: one
 * fixed run per share (short runs cost the prefetchers their stride: 3-13% slower decoding), and so are
 * products of fewer than STREAM_TILE_TOKENS on microtiles (speculative steps); both are in matmul.h. */
#define MATMUL_CLAIMS_PER_THREAD 8
/* Products of fewer tokens than this go to the int8 microtiles where they apply and the ISA has no int8
 * panels for the type (ember_part_init; against the int8 panels, their own min_tokens). */
#define INT8_TILE_TOKENS 12

/* ---- dispatch ---- */

/* The kernel tables to try for the active ISA, widest first; NULL-terminated. */
static const ember_kernels *const *kernel_order(void) {
    static const ember_kernels *const avx512[] = {&ember_kernels_avx512, &ember_kernels_iq_avx512, &ember_kernels_avx2,
                                                  &ember_kernels_iq_avx2, &ember_kernels_scalar, &ember_kernels_iq_scalar, NULL};
    static const ember_kernels *const avx2[] = {&ember_kernels_avx2, &ember_kernels_iq_avx2, &ember_kernels_scalar,
                                                &ember_kernels_iq_scalar, NULL};
    static const ember_kernels *const neon[] = {&ember_kernels_neon, &ember_kernels_iq_neon, &ember_kernels_scalar,
                                                &ember_kernels_iq_scalar, NULL};
    static const ember_kernels *const scalar[] = {&ember_kernels_scalar, &ember_kernels_iq_scalar, NULL};
    switch (ember_isa_active) {
    case EMBER_ISA_AVX512: return avx512;
    case EMBER_ISA_AVX2: return avx2;
    case EMBER_ISA_NEON: return neon;
    default: return scalar;
    }
}

ember_tile ember_tile_for(int type) {
    for (const ember_kernels *const *k = kernel_order(); *k; k++)
        if ((*k)->tile[type].fn) return (*k)->tile[type];
    return (ember_tile){0};
}

ember_tile ember_tile8_for(int type, int rounding) {
    if (rounding == EMBER_ROUND_LLAMA && ember_qtype_get(type)->act == EMBER_ACT_Q16)
        for (const ember_kernels *const *k = kernel_order(); *k; k++)
            if ((*k)->tile8[type].fn) return (*k)->tile8[type];
    return (ember_tile){0};
}

ember_panel ember_panel_for(int type, int i8) {
    for (const ember_kernels *const *k = kernel_order(); *k; k++) {
        const ember_panel *table = i8 ? (*k)->panel8 : (*k)->panel;
        if (table[type].fn) return table[type];
    }
    return (ember_panel){NULL, 0, 0};
}

ember_quantize_fn ember_quantize_for(int act) {
    for (const ember_kernels *const *k = kernel_order(); *k; k++)
        if ((*k)->quantize[act]) return (*k)->quantize[act];
    return NULL;
}

/* ---- public entry points ---- */

int ember_matmul_act_kind(int type) {
    const ember_qtype *t = ember_qtype_get(type);
    return t ? t->act : -1;
}

int64_t ember_matmul_scratch_size(int type, int64_t k, int64_t n) {
    const ember_qtype *t = ember_qtype_get(type);
    if (!t || k <= 0 || n < 0 || k % t->block_size) return -1;
    return n * ember_act_row_bytes(t->act, k);
}

/* Share ith of nth of the activation rows -> scratch. */
static void quantize_task(void *ctx, int ith, int nth) {
    matmul_job *j = ctx;
    int64_t lo, hi;
    ember_split(j->n, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) j->quantize(j->x + t * j->k, j->scratch + t * j->a_stride, j->k);
}

/* W rows [r0, r1) of part p against tokens [t0, t1) in the tile's lanes kernel: passes of at most
 * EMBER_LANES_TOKENS tokens, evened out (9 tokens: 5 + 4). */
static void product_lanes(const matmul_job *j, const matmul_part *p, int64_t r0, int64_t r1, int64_t t0, int64_t t1) {
    const int64_t passes = (t1 - t0 + EMBER_LANES_TOKENS - 1) / EMBER_LANES_TOKENS;
    for (int64_t i = 0, t = t0; i < passes; i++) {
        const int64_t nc = (t1 - t + passes - i - 1) / (passes - i);
        p->tile.lanes(j->k, p->w + r0 * p->w_stride, p->w_stride, r1 - r0, p->act + t * j->a_stride, j->a_stride,
                      (int)nc, p->y + t * p->m + r0, p->m);
        t += nc;
    }
}

/* W rows [r0, r1) of part p against tokens [t0, t1): microtiles of p->unit rows x tile.cols tokens. */
static void product_block(const matmul_job *j, const matmul_part *p, int64_t r0, int64_t r1, int64_t t0, int64_t t1) {
    const int R = p->unit, C = p->tile.cols;
    if (p->tile.lanes && t1 - t0 >= p->tile.lanes_min) {
        product_lanes(j, p, r0, r1, t0, t1);
        return;
    }
    if (R == 1 && t1 - t0 == 1) { /* lone rows against one token: the type's run, or its tile a row at a time */
        if (p->tile.run) {
            p->tile.run(j->k, p->w + r0 * p->w_stride, p->w_stride, p->act + t0 * j->a_stride, p->y + t0 * p->m + r0, r1 - r0);
            return;
        }
        ROWS_IN_STREAMS(r1 - r0, i, p->tile.fn(j->k, p->w + (r0 + i) * p->w_stride, p->w_stride, p->act + t0 * j->a_stride,
                                              j->a_stride, p->y + t0 * p->m + r0 + i, p->m, 1, 1));
        return;
    }
    for (int64_t r = r0; r < r1;) {
        int nr = r1 - r >= R ? R : 1;
        const uint8_t *wr = p->w + r * p->w_stride;
        for (int64_t t = t0; t < t1; t += C) {
            int nc = (int)EMBER_MIN((int64_t)C, t1 - t);
            p->tile.fn(j->k, wr, p->w_stride, p->act + t * j->a_stride, j->a_stride, p->y + t * p->m + r, p->m, nr, nc);
        }
        r += nr;
    }
}

/* Rows [r0, r1) of part p, all tokens. */
static void product_rows(const matmul_job *j, const matmul_part *p, int64_t r0, int64_t r1) {
    if (p->panel.fn) {
        p->panel.fn(p->type, j->k, p->w + r0 * p->w_stride, p->w_stride, r1 - r0, p->act, j->a_stride, p->n,
                    p->y + r0, p->m);
        return;
    }
    int64_t chunk = EMBER_MAX((int64_t)p->tile.cols, CHUNK_ACT_BYTES / j->a_stride / p->tile.cols * p->tile.cols);
    for (int64_t t0 = 0; t0 < p->n; t0 += chunk) product_block(j, p, r0, r1, t0, EMBER_MIN(t0 + chunk, p->n));
}

/* Units [lo, hi) of the parts' rows, taken one after another (only the end of each part can be ragged). */
static void matmul_units(const matmul_job *j, int64_t lo, int64_t hi) {
    int64_t base = 0;
    for (int i = 0; i < j->n_parts; i++) {
        const matmul_part *p = &j->part[i];
        const int64_t u0 = EMBER_MAX(lo, base) - base, u1 = EMBER_MIN(hi, base + p->units) - base;
        if (u0 < u1) product_rows(j, p, u0 * p->unit, EMBER_MIN(u1 * p->unit, p->m));
        base += p->units;
    }
}

/* Prompts: threads take contiguous runs of units from a shared counter until none are left: a thread
 * that starts late or runs slower (another process on its core) leaves its work to the others instead
 * of making them wait for it at the end. */
static void claim_task(void *ctx, int ith, int nth) {
    matmul_job *j = ctx;
    (void)ith, (void)nth;
    for (;;) {
        int64_t lo = atomic_fetch_add_explicit(&j->next, j->claim, memory_order_relaxed);
        if (lo >= j->units) return;
        matmul_units(j, lo, EMBER_MIN(lo + j->claim, j->units));
    }
}

/* The first unit of share ith of nth when the parts' bytes are shared out evenly: the unit where the
 * running total of bytes reaches ith / nth of all, moved down to a unit whose output starts a 64-byte
 * line of y (when one is near), so that neighbouring shares never write the same line. */
static int64_t share_start(const matmul_job *j, int ith, int nth) {
    if (ith == 0) return 0;
    if (ith == nth) return j->units;
    int64_t total = 0;
    for (int i = 0; i < j->n_parts; i++) total += j->part[i].m * j->part[i].w_stride;
    const int64_t target = (int64_t)((double)total * ith / nth);
    int64_t base = 0, bytes = 0;
    for (int i = 0; i < j->n_parts; i++) {
        const matmul_part *p = &j->part[i];
        const int64_t unit_bytes = p->unit * p->w_stride, part_bytes = p->m * p->w_stride;
        if (bytes + part_bytes <= target && i + 1 < j->n_parts) {
            bytes += part_bytes, base += p->units;
            continue;
        }
        int64_t u = EMBER_MIN(p->units, (target - bytes + unit_bytes / 2) / unit_bytes);
        const int64_t line_rows = 64 / sizeof(float);
        for (int64_t back = 0; back < line_rows && u - back > 0; back++) {
            if (((uintptr_t)(p->y + (u - back) * p->unit) & 63) == 0) return base + u - back;
        }
        return base + u;
    }
    return j->units;
}

/* [lo, hi) of gap g taken from its front (front = 1) or back, a chunk at most; 0 when it is empty. */
static int gap_take(stream_gap *g, int64_t chunk, int front, int64_t *lo, int64_t *hi) {
    uint64_t s = atomic_load_explicit(&g->span, memory_order_relaxed);
    for (;;) {
        const int64_t f = (int64_t)(s & 0xffffffffu), b = (int64_t)(s >> 32);
        if (f >= b) return 0;
        *lo = front ? f : EMBER_MAX(f, b - chunk);
        *hi = front ? EMBER_MIN(b, f + chunk) : b;
        const uint64_t next = front ? (uint64_t)*hi | ((uint64_t)b << 32) : (uint64_t)f | ((uint64_t)*lo << 32);
        if (atomic_compare_exchange_weak_explicit(&g->span, &s, next, memory_order_relaxed, memory_order_relaxed))
            return 1;
    }
}

/* Decoding: share ith computes its own run of units, fixed in advance; where the job has gaps, the run
 * stops short of its neighbours' by a gap on each side, and the share then takes chunks of the gap on its
 * right from the front (where its run ended: the same stream) and, once that is empty, of the gap on its
 * left from the back. A share slowed down (by the memory, another process) leaves the units near its ends
 * to a neighbour, and no counter is shared beyond two neighbours. */
static void stream_task(void *ctx, int ith, int nth) {
    const matmul_job *j = ctx;
    if (!j->gaps) {
        matmul_units(j, share_start(j, ith, nth), share_start(j, ith + 1, nth));
        return;
    }
    stream_gap *left = ith > 0 ? &j->gaps[ith - 1] : NULL, *right = ith + 1 < nth ? &j->gaps[ith] : NULL;
    matmul_units(j, left ? left->b : 0, right ? right->a : j->units);
    int64_t lo, hi;
    while (right && gap_take(right, j->chunk, 1, &lo, &hi)) matmul_units(j, lo, hi);
    while (left && gap_take(left, j->chunk, 0, &lo, &hi)) matmul_units(j, lo, hi);
}

/* The gaps of a decoding job over nth shares (NULL: fixed runs): only where each share reads at least
 * STEAL_SHARE_BYTES, so that a chunk is long enough for the prefetchers. Each gap reaches
 * STEAL_GAP_CHUNKS chunks into each neighbour's run (at most a quarter of it); a chunk is 1/64 of a
 * share's units, a whole number of 64-byte lines of y where a unit is a row. */
#define STEAL_SHARE_BYTES (2 << 20)
#define STEAL_GAP_CHUNKS 4
#define STEAL_MAX_THREADS 64
static void stream_gaps(matmul_job *j, stream_gap *gaps, int nth) {
    int64_t bytes = 0;
    int rows = 1;
    for (int i = 0; i < j->n_parts; i++) bytes += j->part[i].m * j->part[i].w_stride, rows &= j->part[i].unit == 1;
    j->gaps = NULL;
    if (nth < 2 || nth > STEAL_MAX_THREADS || bytes / nth < STEAL_SHARE_BYTES || j->units >= ((int64_t)1 << 31)) return;
    j->chunk = EMBER_MAX(1, j->units / nth / 64);
    if (rows && j->chunk >= 16) j->chunk &= ~(int64_t)15;
    int64_t prev = 0, cur = share_start(j, 1, nth);
    for (int i = 1; i < nth; i++) {
        const int64_t next = share_start(j, i + 1, nth);
        const int64_t h_lo = EMBER_MIN(STEAL_GAP_CHUNKS * j->chunk, (cur - prev) / 4);
        const int64_t h_hi = EMBER_MIN(STEAL_GAP_CHUNKS * j->chunk, (next - cur) / 4);
        stream_gap *g = &gaps[i - 1];
        g->a = cur - h_lo, g->b = cur + h_hi;
        atomic_init(&g->span, (uint64_t)g->a | ((uint64_t)g->b << 32));
        prev = cur, cur = next;
    }
    j->gaps = gaps;
}

int ember_part_init(matmul_part *p, int type, const void *w, int64_t m, int64_t k, int64_t n, float *y,
                    const uint8_t *act, int rounding) {
    const ember_qtype *t = ember_qtype_get(type);
    if (!t || m <= 0 || k % t->block_size) return -1;
    const ember_tile tile8 = ember_tile8_for(type, rounding);
    const int int8_tiles = tile8.fn != NULL;
    const ember_panel panel8 = int8_tiles ? ember_panel_for(type, 1) : (ember_panel){NULL, 0, 0};
    *p = (matmul_part){.type = type, .tile = int8_tiles ? tile8 : ember_tile_for(type),
                       .panel = panel8.fn ? panel8 : ember_panel_for(type, 0),
                       .w = w, .m = m, .w_stride = k / t->block_size * t->type_size, .y = y, .act = act, .n = n};
    /* Against int8 activations the microtiles stay ahead of the int16 panels up to about 12 tokens
     * (2 threads, weights in L3: Q4_1 1536 x 576, 8 tokens 144 us in panels, 2 x 61 us in tiles of 4;
     * 12 tokens 176 vs 3 x 61; Q5_0 2048 x 640, 8: 197 vs 2 x 75, 12: 248 vs 3 x 75). Rows in lanes, where
     * the tile has them, take every token count: faster than both (quant_avx512.c), and one token's
     * arithmetic whatever the shape of the step, so that a prefix-cached 1-row step and a prompt chunk's
     * row give the same bits. One token against a kernel with row runs: lone rows, short ones too
     * (Gemma 3's 440-byte Q5_0 rows). */
    const int lanes = p->tile.lanes && n >= p->tile.lanes_min;
    if (lanes || n < (int8_tiles && !panel8.fn ? INT8_TILE_TOKENS : p->panel.min_tokens)) p->panel.fn = NULL;
    const int lone = n == 1 && p->tile.run;
    p->unit = p->panel.fn ? p->panel.rows
              : lanes     ? EMBER_LANES_ROWS
              : p->w_stride <= p->tile.short_row && !lone ? p->tile.rows : 1;
    p->units = (m + p->unit - 1) / p->unit;
    return 0;
}

ember_quantize_fn ember_quantizer(int act, int rounding) {
    return ember_quantize_for(act == EMBER_ACT_Q16 && rounding == EMBER_ROUND_LLAMA ? EMBER_ACT_Q16_LLAMA : act);
}

void ember_job_run(ember_pool *pool, matmul_job *j, int stream) {
    if (stream) {
        const int nth = ember_pool_threads(pool);
        stream_gap gaps[STEAL_MAX_THREADS - 1];
        stream_gaps(j, gaps, nth);
        ember_parallel(pool, stream_task, j);
        return;
    }
    j->claim = EMBER_MAX(1, j->units / (ember_pool_threads(pool) * MATMUL_CLAIMS_PER_THREAD));
    atomic_init(&j->next, 0);
    ember_parallel(pool, claim_task, j);
}

int ember_matmul_multi(ember_pool *pool, int count, const int *types, const void *const *ws, const int64_t *ms,
                       int64_t k, const float *x, int64_t n, float *const *ys, void *scratch, int rounding) {
    if (count < 1 || count > EMBER_MATMUL_MAX_PARTS || n <= 0 || k <= 0) return -1;
    const int act = ember_qtype_get(types[0]) ? ember_qtype_get(types[0])->act : -1;
    const uint8_t *a = act == EMBER_ACT_F32 ? (const uint8_t *)x : scratch;
    matmul_part parts[EMBER_MATMUL_MAX_PARTS];
    matmul_job j = {.part = parts, .n_parts = count, .k = k, .n = n, .x = x};
    int panels = 0;
    for (int i = 0; i < count; i++) {
        if (ember_part_init(&parts[i], types[i], ws[i], ms[i], k, n, ys[i], a, rounding) != 0) return -1;
        if (ember_qtype_get(types[i])->act != act) return -1; /* one quantization of x serves all */
        j.units += parts[i].units;
        panels |= parts[i].panel.fn != NULL;
    }
    if (act == EMBER_ACT_F32) {
        j.a_stride = k * (int64_t)sizeof(float);
    } else {
        j.quantize = ember_quantizer(act, rounding);
        j.scratch = scratch;
        j.a_stride = ember_act_row_bytes(act, k);
        if (n * k <= SERIAL_QUANTIZE_VALUES) quantize_task(&j, 0, 1);
        else ember_parallel(pool, quantize_task, &j);
    }
    ember_job_run(pool, &j, n <= STREAM_TOKENS || (!panels && n < STREAM_TILE_TOKENS));
    return 0;
}

void ember_matmul(ember_pool *pool, int type, const void *w, int64_t m, int64_t k, const float *x, int64_t n,
                  float *y, void *scratch, int rounding) {
    ember_matmul_multi(pool, 1, &type, &w, &m, k, x, n, &y, scratch, rounding);
}

int ember_matmul_quantize(int type, const float *x, int64_t k, void *dst, int rounding) {
    const ember_qtype *t = ember_qtype_get(type);
    if (!t || t->act == EMBER_ACT_F32 || k <= 0 || k % t->block_size) return -1;
    ember_quantizer(t->act, rounding)(x, dst, k);
    return 0;
}
