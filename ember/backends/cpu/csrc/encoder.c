/* Encoder ops (api_encoder.h): small, memory-bound, threaded by rows. */
#include <math.h>

#include "ember_cpu.h"
#include "api_encoder.h"

#define ROWS_PER_SHARE_MIN 8192 /* elements below which one thread does it all */

typedef struct {
    const float *x, *w, *b;
    float *out;
    int64_t n, d;
    float eps;
} norm_job;

/* Mean and variance in double: a row's sums stay exact enough for any width. */
static void layer_norm_row(const norm_job *j, int64_t r) {
    const float *x = j->x + r * j->d; /* (d,) */
    float *y = j->out + r * j->d;     /* (d,) */
    double sum = 0, sq = 0;
    for (int64_t i = 0; i < j->d; i++) sum += x[i];
    const double mean = sum / (double)j->d;
    for (int64_t i = 0; i < j->d; i++) sq += ((double)x[i] - mean) * ((double)x[i] - mean);
    const float inv = (float)(1.0 / sqrt(sq / (double)j->d + j->eps)), m = (float)mean;
    for (int64_t i = 0; i < j->d; i++) {
        float v = (x[i] - m) * inv;
        if (j->w) v *= j->w[i];
        if (j->b) v += j->b[i];
        y[i] = v;
    }
}

static void layer_norm_share(void *p, int ith, int nth) {
    const norm_job *j = p;
    int64_t lo, hi;
    ember_split(j->n, ith, nth, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) layer_norm_row(j, r);
}

void ember_layer_norm(ember_pool *pool, const float *x, const float *w, const float *b, float *out,
                      int64_t n, int64_t d, float eps) {
    if (d <= 0 || n <= 0) return;
    norm_job j = {x, w, b, out, n, d, eps};
    if (n * d < ROWS_PER_SHARE_MIN || ember_pool_threads(pool) == 1) {
        for (int64_t r = 0; r < n; r++) layer_norm_row(&j, r);
        return;
    }
    ember_parallel(pool, layer_norm_share, &j);
}

void ember_tanh(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = tanhf(x[i]);
}
