/* The k largest logits of each row (greedy choices reduced in C, so only ids reach Python). */
#include <math.h>

#include "ember_cpu.h"
#include "api_plan.h"

#define TOPK_PARTS 16 /* most pieces one row is split into */

/* A running list of the best values seen, best first; among equal values the lower id first (the
 * ids arrive in increasing order, so a later equal value never displaces an earlier one). */
typedef struct {
    int32_t id[EMBER_TOPK_MAX];
    float val[EMBER_TOPK_MAX];
    int count;
} best_list;

static void best_add(best_list *b, int k, int32_t id, float v) {
    int i;
    if (b->count < k) i = b->count++;
    else if (v > b->val[k - 1]) i = k - 1; /* displaces the last */
    else return;
    while (i > 0 && v > b->val[i - 1]) {
        b->val[i] = b->val[i - 1];
        b->id[i] = b->id[i - 1];
        i--;
    }
    b->val[i] = v;
    b->id[i] = id;
}

/* Whether any of x[0..SCAN_BLOCK) is above thr (NaN never is): a branch-free loop the compiler
 * vectorizes, so that the blocks holding none of the k best cost a few vector compares each. */
#define SCAN_BLOCK 64
static int any_above(const float *x, float thr) {
    int any = 0;
    for (int i = 0; i < SCAN_BLOCK; i++) any |= x[i] > thr;
    return any;
}

/* ids [lo, hi) of row x into b: past the first k values, only the blocks holding a value above the
 * current k-th are looked at one value at a time */
static void best_scan(best_list *b, int k, const float *x, int64_t lo, int64_t hi) {
    int64_t j = lo;
    for (; j < hi && b->count < k; j++)
        if (!isnan(x[j])) best_add(b, k, (int32_t)j, x[j]);
    float thr = b->count == k ? b->val[k - 1] : -INFINITY;
    while (j < hi) {
        const int64_t end = hi - j >= SCAN_BLOCK ? j + SCAN_BLOCK : hi;
        if (end - j == SCAN_BLOCK && !any_above(x + j, thr)) {
            j = end;
            continue;
        }
        for (; j < end; j++) {
            if (x[j] > thr) {
                best_add(b, k, (int32_t)j, x[j]);
                thr = b->val[k - 1];
            }
        }
    }
}

typedef struct {
    const float *x;      /* (n, vocab) */
    int64_t n, vocab;
    int k, parts;        /* parts > 1: one row, split into that many pieces */
    int32_t *ids;        /* (n, k) */
    float *vals;         /* (n, k) */
    best_list part[TOPK_PARTS];
} topk_job;

static void write_row(const best_list *b, int k, int32_t *ids, float *vals) {
    for (int i = 0; i < k; i++) {
        ids[i] = i < b->count ? b->id[i] : -1;
        vals[i] = i < b->count ? b->val[i] : -INFINITY;
    }
}

static void topk_task(void *ctx, int ith, int nth) {
    topk_job *j = ctx;
    if (j->parts > 1) { /* piece ith of the one row */
        if (ith >= j->parts) return;
        int64_t lo, hi;
        ember_split(j->vocab, ith, j->parts, &lo, &hi);
        j->part[ith].count = 0;
        best_scan(&j->part[ith], j->k, j->x, lo, hi);
        return;
    }
    int64_t lo, hi;
    ember_split(j->n, ith, nth, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        best_list b = {.count = 0};
        best_scan(&b, j->k, j->x + r * j->vocab, 0, j->vocab);
        write_row(&b, j->k, j->ids + r * j->k, j->vals + r * j->k);
    }
}

void ember_top_k(ember_pool *pool, const float *x, int64_t n, int64_t vocab, int k, int32_t *ids, float *vals) {
    if (n <= 0 || vocab <= 0 || k < 1 || k > EMBER_TOPK_MAX) return;
    topk_job j = {.x = x, .n = n, .vocab = vocab, .k = k, .parts = 1, .ids = ids, .vals = vals};
    const int threads = ember_pool_threads(pool);
    if (n == 1 && threads > 1 && vocab >= 4096) j.parts = threads < TOPK_PARTS ? threads : TOPK_PARTS;
    ember_parallel(pool, topk_task, &j);
    if (j.parts == 1) return;
    best_list merged = {.count = 0};
    for (int p = 0; p < j.parts; p++) /* pieces in id order: ties keep the lower id */
        for (int i = 0; i < j.part[p].count; i++) {
            const float v = j.part[p].val[i];
            best_add(&merged, k, j.part[p].id[i], v);
        }
    write_row(&merged, k, ids, vals);
}
