/* y (n, m) = x (n, k) @ W^T for quantized W, straight from its GGUF blocks.
 *
 * The activations are quantized once into the caller's scratch (by the caller for a few tokens, else
 * in a pass over the pool of its own: shares of a pass must not wait for each other, since the pool
 * may run a descheduled worker's share on another thread), by default in two levels: each token's
 * int8 row and, after it, the int8 rounding of what that row missed (see quant.h). The kernels read
 * both rows in one pass over W, so the weights are streamed once. Then the threads take contiguous
 * runs of W rows (output columns; with several W sharing x, of their rows one after another) from a
 * shared counter (for prompts about 8 runs per thread, for decoding one), each computed in one of
 * two ways:
 *  - microtiles (few tokens, or no panel kernel): a W row (or a few short ones) against up to 4
 *    activation rows at a time (4 tokens, or 2 with their residual rows), each weight block unpacked
 *    once for them; tokens go in chunks whose quantized rows fit in L2, and the row stays in L1
 *    while the chunk's tokens sweep it;
 *  - packed panels (many tokens): 16 rows at a time unpacked and interleaved, then swept by every
 *    token (see quant_avx512.c). */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "quant.h"

/* Quantized activations of one token chunk stay within this many bytes (L2 is 1 MiB or more). */
#define CHUNK_ACT_BYTES (256 * 1024)
#define EMBER_MATMUL_MAX_PARTS 8
/* Up to this many activation values the caller quantizes them alone: cheaper than a pass. */
#define SERIAL_QUANTIZE_VALUES 8192
/* Runs of rows each thread takes, on average, when the product is bound by compute: enough to even out
 * a thread that falls behind. Up to STREAM_TOKENS tokens it is bound by streaming W from memory, and a
 * thread keeps one long run (short runs cost the prefetchers their stride: 3-13% slower decoding). */
#define MATMUL_CLAIMS_PER_THREAD 8
#define STREAM_TOKENS 4

/* ---- dispatch ---- */

/* The kernel tables to try for the active ISA, widest first; NULL-terminated. */
static const ember_kernels *const *kernel_order(void) {
    static const ember_kernels *const avx512[] = {&ember_kernels_avx512, &ember_kernels_avx2, &ember_kernels_scalar, NULL};
    static const ember_kernels *const avx2[] = {&ember_kernels_avx2, &ember_kernels_scalar, NULL};
    static const ember_kernels *const neon[] = {&ember_kernels_neon, &ember_kernels_scalar, NULL};
    static const ember_kernels *const scalar[] = {&ember_kernels_scalar, NULL};
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
    return (ember_tile){NULL, 0, 0, 0};
}

ember_panel ember_panel_for(int type) {
    for (const ember_kernels *const *k = kernel_order(); *k; k++)
        if ((*k)->panel[type].fn) return (*k)->panel[type];
    return (ember_panel){NULL, 0, {0, 0}};
}

ember_quantize_fn ember_quantize_for(int act) {
    for (const ember_kernels *const *k = kernel_order(); *k; k++)
        if ((*k)->quantize[act]) return (*k)->quantize[act];
    return NULL;
}

/* ---- activation precision ---- */

/* Activation rows per token: 2 (the default: int8 and the int8 rounding of its residual, near 16-bit
 * accuracy) or 1 (EMBER_ACT_BITS=8: a single int8 rounding, as llama.cpp; faster prompts). Process-wide
 * like the ISA; scratch is always sized for 2, so a change between calls is safe. */
#define MAX_ACT_LEVELS 2
static atomic_int act_levels = MAX_ACT_LEVELS;

int ember_matmul_set_act_bits(int bits) {
    if (bits != 8 && bits != 16) return -1;
    atomic_store_explicit(&act_levels, bits / 8, memory_order_relaxed);
    return 0;
}

int ember_matmul_act_bits(void) { return 8 * atomic_load_explicit(&act_levels, memory_order_relaxed); }

__attribute__((constructor)) static void read_act_bits(void) {
    const char *s = getenv("EMBER_ACT_BITS");
    char *end;
    if (!s || !*s) return;
    long bits = strtol(s, &end, 10);
    if (*end || ember_matmul_set_act_bits((int)bits) != 0)
        fprintf(stderr, "ember: EMBER_ACT_BITS=%s is not 8 or 16; using %d\n", s, ember_matmul_act_bits());
}

/* ---- public entry points ---- */

int ember_matmul_act_kind(int type) {
    const ember_qtype *t = ember_qtype_get(type);
    return t ? t->act : -1;
}

int64_t ember_matmul_scratch_size(int type, int64_t k, int64_t n) {
    const ember_qtype *t = ember_qtype_get(type);
    if (!t || k <= 0 || n < 0 || k % t->block_size) return -1;
    return n * MAX_ACT_LEVELS * ember_act_row_bytes(t->act, k);
}

/* One weight matrix of a job: W (m, k) and its output y (n, m), with the kernels chosen for it. */
typedef struct {
    int type;
    ember_tile tile;
    ember_panel panel;  /* .fn NULL: microtiles */
    const uint8_t *w;   /* (m, w_stride) */
    int64_t m, w_stride;
    float *y;           /* (n, m) */
    int unit;           /* rows handed out together: a panel, or a microtile's rows */
} matmul_part;

typedef struct {
    matmul_part part[EMBER_MATMUL_MAX_PARTS];
    int n_parts;
    int64_t k, n, units;        /* units: the parts' rows in units, all together */
    int64_t claim;              /* units a thread takes at a time */
    atomic_int_fast64_t next;   /* first unit not yet taken */
    ember_quantize_fn quantize; /* NULL for float weights: x is used as it is */
    const float *x;             /* (n, k) */
    const uint8_t *act;         /* (n, a_stride): quantized x (levels rows per token), or x itself */
    uint8_t *scratch;           /* (n, a_stride) when quantizing */
    int64_t a_stride, a_res;    /* a_res: bytes from a token's row to its residual row (0: one level) */
    int levels;
} matmul_job;

/* Share ith of nth of the activation rows -> scratch. */
static void quantize_task(void *ctx, int ith, int nth) {
    matmul_job *j = ctx;
    int64_t lo, hi;
    ember_split(j->n, ith, nth, &lo, &hi);
    for (int64_t t = lo; t < hi; t++) {
        uint8_t *row = j->scratch + t * j->a_stride;
        j->quantize(j->x + t * j->k, row, j->a_res ? row + j->a_res : NULL, j->k);
    }
}

/* W rows [r0, r1) of part p against tokens [t0, t1): microtiles of p->unit rows x tile.cols activation
 * rows (tile.cols / levels tokens). */
static void product_block(const matmul_job *j, const matmul_part *p, int64_t r0, int64_t r1, int64_t t0, int64_t t1) {
    const int R = p->unit, C = EMBER_MAX(1, p->tile.cols / j->levels);
    for (int64_t r = r0; r < r1;) {
        int nr = r1 - r >= R ? R : 1;
        const uint8_t *wr = p->w + r * p->w_stride;
        for (int64_t t = t0; t < t1; t += C) {
            int nc = (int)EMBER_MIN((int64_t)C, t1 - t);
            p->tile.fn(j->k, wr, p->w_stride, j->act + t * j->a_stride, j->a_stride, j->a_res, p->y + t * p->m + r,
                       p->m, nr, nc);
        }
        r += nr;
    }
}

/* Rows [r0, r1) of part p, all tokens. */
static void product_rows(const matmul_job *j, const matmul_part *p, int64_t r0, int64_t r1) {
    if (p->panel.fn) {
        p->panel.fn(p->type, j->k, p->w + r0 * p->w_stride, p->w_stride, r1 - r0, j->act, j->a_stride, j->a_res,
                    j->n, p->y + r0, p->m);
        return;
    }
    int64_t chunk = EMBER_MAX((int64_t)p->tile.cols, CHUNK_ACT_BYTES / j->a_stride / p->tile.cols * p->tile.cols);
    for (int64_t t0 = 0; t0 < j->n; t0 += chunk) product_block(j, p, r0, r1, t0, EMBER_MIN(t0 + chunk, j->n));
}

/* Units [lo, hi) of the parts' rows, taken one after another (only the end of each part can be ragged). */
static void matmul_units(const matmul_job *j, int64_t lo, int64_t hi) {
    int64_t base = 0;
    for (int i = 0; i < j->n_parts; i++) {
        const matmul_part *p = &j->part[i];
        const int64_t units = (p->m + p->unit - 1) / p->unit;
        const int64_t u0 = EMBER_MAX(lo, base) - base, u1 = EMBER_MIN(hi, base + units) - base;
        if (u0 < u1) product_rows(j, p, u0 * p->unit, EMBER_MIN(u1 * p->unit, p->m));
        base += units;
    }
}

/* Threads take contiguous runs of units from a shared counter until none are left: a thread that
 * starts late or runs slower (another process on its core) leaves its work to the others instead of
 * making them wait for it at the end. */
static void matmul_task(void *ctx, int ith, int nth) {
    matmul_job *j = ctx;
    (void)ith, (void)nth;
    for (;;) {
        int64_t lo = atomic_fetch_add_explicit(&j->next, j->claim, memory_order_relaxed);
        if (lo >= j->units) return;
        matmul_units(j, lo, EMBER_MIN(lo + j->claim, j->units));
    }
}

/* The part's kernels for n tokens of `levels` activation rows; 0, or -1 for an unsupported type or shape. */
static int init_part(matmul_part *p, int type, const void *w, int64_t m, int64_t k, int64_t n, int levels, float *y) {
    const ember_qtype *t = ember_qtype_get(type);
    if (!t || m <= 0 || k % t->block_size) return -1;
    *p = (matmul_part){.type = type, .tile = ember_tile_for(type), .panel = ember_panel_for(type), .w = w, .m = m,
                       .w_stride = k / t->block_size * t->type_size, .y = y};
    if (n < p->panel.min_tokens[levels - 1]) p->panel.fn = NULL;
    p->unit = p->panel.fn ? p->panel.rows : p->w_stride <= p->tile.short_row ? p->tile.rows : 1;
    return 0;
}

int ember_matmul_multi(ember_pool *pool, int count, const int *types, const void *const *ws, const int64_t *ms,
                       int64_t k, const float *x, int64_t n, float *const *ys, void *scratch) {
    if (count < 1 || count > EMBER_MATMUL_MAX_PARTS || n <= 0 || k <= 0) return -1;
    const int act = ember_qtype_get(types[0]) ? ember_qtype_get(types[0])->act : -1;
    const int levels = act == EMBER_ACT_F32 ? 1 : atomic_load_explicit(&act_levels, memory_order_relaxed);
    matmul_job j = {.n_parts = count, .k = k, .n = n, .x = x, .levels = levels};
    for (int i = 0; i < count; i++) {
        if (init_part(&j.part[i], types[i], ws[i], ms[i], k, n, levels, ys[i]) != 0) return -1;
        if (ember_qtype_get(types[i])->act != act) return -1; /* one quantization of x serves all */
        j.units += (ms[i] + j.part[i].unit - 1) / j.part[i].unit;
    }
    if (act == EMBER_ACT_F32) {
        j.act = (const uint8_t *)x;
        j.a_stride = k * (int64_t)sizeof(float);
    } else {
        j.quantize = ember_quantize_for(act);
        j.scratch = scratch;
        j.act = scratch;
        j.a_res = levels > 1 ? ember_act_row_bytes(act, k) : 0;
        j.a_stride = j.levels * ember_act_row_bytes(act, k);
        if (n * k <= SERIAL_QUANTIZE_VALUES) quantize_task(&j, 0, 1);
        else ember_parallel(pool, quantize_task, &j);
    }
    const int nth = ember_pool_threads(pool);
    const int claims = n <= STREAM_TOKENS ? 1 : MATMUL_CLAIMS_PER_THREAD;
    j.claim = EMBER_MAX(1, j.units / (nth * claims));
    atomic_init(&j.next, 0);
    ember_parallel(pool, matmul_task, &j);
    return 0;
}

void ember_matmul(ember_pool *pool, int type, const void *w, int64_t m, int64_t k, const float *x, int64_t n,
                  float *y, void *scratch) {
    ember_matmul_multi(pool, 1, &type, &w, &m, k, x, n, &y, scratch);
}
