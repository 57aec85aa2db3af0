/* Mixture-of-experts layers: routing, grouped expert products, and the weighted sum of the experts.
 *
 * A step's selections (token t, slot u: row s = t * n_used + u) are sorted by expert (a counting sort),
 * their activation rows quantized into that order, and every selected expert becomes one part of a
 * product job (matmul.h) over its own contiguous run of rows: each expert's weights are read once per
 * step whatever the number of its tokens, and the experts nobody chose are never touched (their pages
 * of the mapped file stay out of memory). The outputs come back in expert order and are scattered to
 * the selections' rows. Each stack may come with a byte map of its experts, where a call marks the ones it
 * reads (0 -> 1, never cleared here): the backend moves those experts' bytes onto huge pages
 * (resident.py) without learning the ids on the host. */
#include <math.h>

#include "matmul.h"

#include "api_ops.h"
#include "api_plan.h"

typedef struct {
    int32_t *order;      /* (rows,): selection rows sorted by expert, stable */
    int64_t off[EMBER_EXPERTS_MAX + 1];  /* order[off[e] .. off[e + 1]) chose expert e */
    uint8_t *act;        /* (rows, a_stride): their activations in that order */
    const float *x;      /* (*, k) */
    int64_t k, rows, x_div, a_stride;  /* selection s reads row s / x_div of x */
    ember_quantize_fn quantize;        /* NULL: f32 activations, copied */
    int count;
    float *grouped[EMBER_EXPERTS_MAX_MATS];  /* (rows, ms[i]) in expert order */
    float *const *ys;                        /* (rows, ms[i]) in selection order */
    const int64_t *ms;
} experts_job;

static int64_t part_bytes(int count, int64_t n_expert) {
    return ember_align64(count * n_expert * (int64_t)sizeof(matmul_part));
}

int64_t ember_experts_scratch_size(int type, int64_t k, int64_t rows, int64_t m_sum, int count, int64_t n_expert) {
    const ember_qtype *t = ember_qtype_get(type);
    if (!t || k <= 0 || rows < 0 || k % t->block_size || count < 1 || count > EMBER_EXPERTS_MAX_MATS ||
        n_expert < 1 || n_expert > EMBER_EXPERTS_MAX)
        return -1;
    const int64_t a_stride = t->act == EMBER_ACT_F32 ? k * (int64_t)sizeof(float) : ember_act_row_bytes(t->act, k);
    return part_bytes(count, n_expert) + ember_align64(rows * (int64_t)sizeof(int32_t)) +
           ember_align64(rows * a_stride) + rows * m_sum * (int64_t)sizeof(float);
}

/* Share ith of nth of the sorted rows: activations gathered (and quantized) into expert order. */
static void gather_task(void *ctx, int ith, int nth) {
    const experts_job *e = ctx;
    int64_t lo, hi;
    ember_split(e->rows, ith, nth, &lo, &hi);
    for (int64_t g = lo; g < hi; g++) {
        const float *src = e->x + (int64_t)(e->order[g] / e->x_div) * e->k;
        uint8_t *dst = e->act + g * e->a_stride;
        if (e->quantize) e->quantize(src, dst, e->k);
        else memcpy(dst, src, (size_t)e->k * sizeof(float));
    }
}

/* Share ith of nth of the sorted rows: outputs back to their selections' rows. */
static void scatter_task(void *ctx, int ith, int nth) {
    const experts_job *e = ctx;
    int64_t lo, hi;
    ember_split(e->rows, ith, nth, &lo, &hi);
    for (int i = 0; i < e->count; i++)
        for (int64_t g = lo; g < hi; g++)
            memcpy(e->ys[i] + (int64_t)e->order[g] * e->ms[i], e->grouped[i] + g * e->ms[i],
                   (size_t)e->ms[i] * sizeof(float));
}

/* Counting sort of the selections by expert; -1 when an id is out of range. */
static int sort_by_expert(experts_job *e, const int32_t *ids, int64_t n_expert) {
    int64_t *off = e->off;
    memset(off, 0, sizeof(int64_t) * (size_t)(n_expert + 1));
    for (int64_t s = 0; s < e->rows; s++) {
        if (ids[s] < 0 || ids[s] >= n_expert) return -1;
        off[ids[s] + 1]++;
    }
    for (int64_t x = 0; x < n_expert; x++) off[x + 1] += off[x];
    int64_t next[EMBER_EXPERTS_MAX];
    memcpy(next, off, sizeof(int64_t) * (size_t)n_expert);
    for (int64_t s = 0; s < e->rows; s++) e->order[next[ids[s]]++] = (int32_t)s;
    return 0;
}

int ember_experts_matmul(ember_pool *pool, int count, const int *types, const void *const *ws, const int64_t *ms,
                         int64_t n_expert, int64_t k, const float *x, int64_t n_tok, int64_t n_used, int x_per_row,
                         const int32_t *ids, float *const *ys, void *scratch, int rounding, uint8_t *const *used) {
    if (count < 1 || count > EMBER_EXPERTS_MAX_MATS || n_expert < 1 || n_expert > EMBER_EXPERTS_MAX || n_tok <= 0 ||
        n_used < 1 || n_used > n_expert || k <= 0 || !ember_qtype_get(types[0]))
        return -1;
    const int act = ember_qtype_get(types[0])->act;
    for (int i = 0; i < count; i++)
        if (!ember_qtype_get(types[i]) || ember_qtype_get(types[i])->act != act || ms[i] <= 0) return -1;
    experts_job e = {.x = x, .k = k, .rows = n_tok * n_used, .x_div = x_per_row ? 1 : n_used, .count = count,
                     .ys = ys, .ms = ms};
    e.a_stride = act == EMBER_ACT_F32 ? k * (int64_t)sizeof(float) : ember_act_row_bytes(act, k);
    e.quantize = act == EMBER_ACT_F32 ? NULL : ember_quantizer(act, rounding);
    uint8_t *base = scratch;
    matmul_part *parts = (matmul_part *)base;
    e.order = (int32_t *)(base += part_bytes(count, n_expert));
    e.act = base += ember_align64(e.rows * (int64_t)sizeof(int32_t));
    float *y = (float *)(base + ember_align64(e.rows * e.a_stride));
    for (int i = 0; i < count; i++) {
        e.grouped[i] = y;
        y += e.rows * ms[i];
    }
    if (sort_by_expert(&e, ids, n_expert) != 0) return -1;

    matmul_job j = {.part = parts, .k = k, .n = n_tok, .a_stride = e.a_stride};
    for (int64_t x_id = 0; x_id < n_expert; x_id++) {
        const int64_t lo = e.off[x_id], n = e.off[x_id + 1] - lo;
        if (n == 0) continue;
        for (int i = 0; i < count; i++) {
            const int64_t w_stride = k / ember_qtype_get(types[i])->block_size * ember_qtype_get(types[i])->type_size;
            const uint8_t *w = (const uint8_t *)ws[i] + x_id * ms[i] * w_stride;
            matmul_part *p = &parts[j.n_parts++];
            if (ember_part_init(p, types[i], w, ms[i], k, n, e.grouped[i] + lo * ms[i], e.act + lo * e.a_stride, rounding) != 0)
                return -1;
            j.units += p->units;
        }
    }
    for (int i = 0; used && i < count; i++) /* marked only once the call is sure to run */
        for (int64_t x_id = 0; used[i] && x_id < n_expert; x_id++)
            if (e.off[x_id + 1] > e.off[x_id] && !used[i][x_id]) used[i][x_id] = 1;
    const int big = e.rows * k > SERIAL_QUANTIZE_VALUES;
    if (big) ember_parallel(pool, gather_task, &e);
    else gather_task(&e, 0, 1);
    ember_job_run(pool, &j, n_tok <= STREAM_TOKENS);
    if (big) ember_parallel(pool, scatter_task, &e);
    else scatter_task(&e, 0, 1);
    return 0;
}

/* ---- routing and the weighted sum ---- */

/* One token: probabilities p (n_expert,) = softmax(logits); its n_used best, best first (the lower id
 * among equal ones). */
static void route_row(const float *logits, int64_t n_expert, int64_t n_used, int norm, float *p, int32_t *ids,
                      float *w) {
    float max = -INFINITY;
    for (int64_t x = 0; x < n_expert; x++) max = logits[x] > max ? logits[x] : max;
    float sum = 0.0f;
    for (int64_t x = 0; x < n_expert; x++) sum += p[x] = expf(logits[x] - max);
    for (int64_t x = 0; x < n_expert; x++) p[x] /= sum;
    float chosen = 0.0f;
    for (int64_t u = 0; u < n_used; u++) {
        int64_t best = -1;
        for (int64_t x = 0; x < n_expert; x++)
            if (p[x] >= 0.0f && (best < 0 || p[x] > p[best])) best = x;
        if (best < 0) { /* NaN logits: no weight */
            ids[u] = 0;
            w[u] = 0.0f;
            continue;
        }
        ids[u] = (int32_t)best;
        chosen += w[u] = p[best];
        p[best] = -1.0f; /* taken */
    }
    if (!norm) return;
    /* the sum is kept from 0 (the smallest normal half, as llama.cpp clamps it) */
    const float div = chosen > 6.103515625e-5f ? chosen : 6.103515625e-5f;
    for (int64_t u = 0; u < n_used; u++) w[u] /= div;
}

void ember_experts_route(const float *logits, int64_t n_tok, int64_t n_expert, int64_t n_used, int norm,
                         int32_t *ids, float *weights) {
    float p[EMBER_EXPERTS_MAX];
    if (n_expert > EMBER_EXPERTS_MAX || n_used > n_expert) return;
    for (int64_t t = 0; t < n_tok; t++)
        route_row(logits + t * n_expert, n_expert, n_used, norm, p, ids + t * n_used, weights + t * n_used);
}

void ember_experts_sum(const float *y, const float *weights, float *out, int64_t n_tok, int64_t n_used, int64_t d) {
    for (int64_t t = 0; t < n_tok; t++) {
        float *o = out + t * d;
        const float *w = weights + t * n_used;
        for (int64_t j = 0; j < d; j++) o[j] = w[0] * y[t * n_used * d + j];
        for (int64_t u = 1; u < n_used; u++) {
            const float *yu = y + (t * n_used + u) * d;
            for (int64_t j = 0; j < d; j++) o[j] += w[u] * yu[j];
        }
    }
}

void ember_experts_bias(float *y, const float *b, const int32_t *ids, int64_t rows, int64_t d) {
    for (int64_t s = 0; s < rows; s++) {
        const float *bs = b + (int64_t)ids[s] * d;
        for (int64_t j = 0; j < d; j++) y[s * d + j] += bs[j];
    }
}

void ember_swiglu_oai(const float *gate, const float *up, float *out, int64_t n, float alpha, float limit) {
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i] < limit ? gate[i] : limit;
        const float u = up[i] < -limit ? -limit : up[i] > limit ? limit : up[i];
        out[i] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
    }
}
