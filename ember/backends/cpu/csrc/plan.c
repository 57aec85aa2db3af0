/* Replay of recorded forward passes (see api_plan.h). */
#include "ember_cpu.h"
#include "api_ops.h"
#include "api_plan.h"
#include "api_quant.h"
#include "api_encoder.h"

#include <time.h>

/* out (n_out, d) = rows `rows` of x (*, d) */
void ember_gather_rows(const float *x, const int32_t *rows, float *out, int64_t n_out, int64_t d) {
    for (int64_t r = 0; r < n_out; r++) memcpy(out + r * d, x + (int64_t)rows[r] * d, (size_t)d * sizeof(float));
}

/* x (n, d) += b (d) */
void ember_add_row(float *x, const float *b, int64_t n, int64_t d) {
    for (int64_t r = 0; r < n; r++)
        for (int64_t j = 0; j < d; j++) x[r * d + j] += b[j];
}

static int run_op(ember_pool *pool, const ember_op *o) {
    void *const *p = o->p;
    const int64_t *i = o->i;
    const float *f = o->f;
    switch (o->kind) {
    case EMBER_OP_MATMUL:
        ember_matmul(pool, o->type, p[0], i[0], i[1], p[1], i[2], p[2], p[3], (int)i[3]);
        return 0;
    case EMBER_OP_MATMUL_MULTI:
        return ember_matmul_multi(pool, (int)i[0], p[0], p[1], p[2], i[1], p[3], i[2], p[4], p[5], (int)i[3]) < 0 ? -1 : 0;
    case EMBER_OP_GET_ROWS:
        ember_get_rows(pool, o->type, p[0], i[0], i[1], p[1], i[2], p[2]);
        return 0;
    case EMBER_OP_RMS_NORM:
        ember_rms_norm(pool, p[0], p[1], p[2], i[0], i[1], f[0]);
        return 0;
    case EMBER_OP_ROPE:
        ember_rope_pair(pool, p[0], i[1], p[3], i[6], i[0], i[2], p[1], i[3], (int)i[4], f[0], f[1], p[2], f[2], f[3],
                        f[4], f[5], i[5]);
        return 0;
    case EMBER_OP_SILU_MUL:
        ember_silu_mul(pool, p[0], p[1], p[2], i[0]);
        return 0;
    case EMBER_OP_GELU_MUL:
        ember_gelu_mul(pool, p[0], p[1], p[2], i[0]);
        return 0;
    case EMBER_OP_ADD:
        ember_add(pool, p[0], p[1], p[2], i[0]);
        return 0;
    case EMBER_OP_SCALE:
        ember_scale(pool, p[0], f[0], i[0]);
        return 0;
    case EMBER_OP_KV_STORE:
        ember_kv_store(pool, p[0], p[1], p[2], p[3], p[4], i[0], i[1], i[2], (int)i[3], (int)i[4], i[5], i[6]);
        return 0;
    case EMBER_OP_ATTENTION:
        ember_attention(pool, p[0], p[1], p[2], p[3], i[0], i[1], i[2], i[3], i[4], p[4], p[5], p[6], i[5], i[6],
                        i[7], f[0], f[1], (int)i[8], (int)i[9], p[7], i[10]);
        return 0;
    case EMBER_OP_HADAMARD:
        ember_hadamard(pool, p[0], p[1], i[0], i[1], i[2]);
        return 0;
    case EMBER_OP_GATHER_ROWS:
        ember_gather_rows(p[0], p[1], p[2], i[0], i[1]);
        return 0;
    case EMBER_OP_ADD_ROW:
        ember_add_row(p[0], p[1], i[0], i[1]);
        return 0;
    case EMBER_OP_TOP_K:
        ember_top_k(pool, p[0], i[0], i[1], (int)i[2], p[1], p[2]);
        return 0;
    case EMBER_OP_SOFTCAP:
        ember_softcap(pool, p[0], f[0], i[0]);
        return 0;
    case EMBER_OP_POS_SCALE:
        if (i[2] < 1) return -1;
        ember_pos_scale(p[0], p[1], i[0], i[1], i[2], f[0], f[1]);
        return 0;
    case EMBER_OP_LAYER_NORM:
        ember_layer_norm(pool, p[0], p[1], p[2], p[3], i[0], i[1], f[0]);
        return 0;
    case EMBER_OP_GELU:
        ember_gelu(pool, p[0], p[1], i[0]);
        return 0;
    case EMBER_OP_TANH:
        ember_tanh(p[0], i[0]);
        return 0;
    case EMBER_OP_EXPERTS_MATMUL:
        return ember_experts_matmul(pool, (int)i[0], p[0], p[1], p[2], i[1], i[2], p[3], i[3], i[4], (int)i[5], p[4],
                                    p[5], p[6], (int)i[6], p[7]);
    case EMBER_OP_EXPERTS_ROUTE:
        if (i[1] > EMBER_EXPERTS_MAX || i[2] < 1 || i[2] > i[1]) return -1;
        ember_experts_route(p[0], i[0], i[1], i[2], (int)i[3], p[1], p[2]);
        return 0;
    case EMBER_OP_EXPERTS_SUM:
        ember_experts_sum(p[0], p[1], p[2], i[0], i[1], i[2]);
        return 0;
    case EMBER_OP_EXPERTS_BIAS:
        ember_experts_bias(p[0], p[1], p[2], i[0], i[1]);
        return 0;
    case EMBER_OP_SWIGLU_OAI:
        ember_swiglu_oai(p[0], p[1], p[2], i[0], f[0], f[1]);
        return 0;
    default:
        return -1;
    }
}

int64_t ember_run_ops(ember_pool *pool, const ember_op *ops, int64_t n_ops) {
    const ember_fp_state fp = ember_fp_enter(); /* for the ops' serial parts on this thread */
    int64_t failed = -1;
    for (int64_t k = 0; k < n_ops && failed < 0; k++)
        if (run_op(pool, &ops[k]) != 0) failed = k;
    if (n_ops > 1) ember_pool_rest(pool); /* a whole step: the caller's Python work comes next */
    ember_fp_leave(fp);
    return failed;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

int64_t ember_run_ops_timed(ember_pool *pool, const ember_op *ops, int64_t n_ops, int64_t *ns) {
    const ember_fp_state fp = ember_fp_enter();
    int64_t failed = -1;
    for (int64_t k = 0; k < n_ops && failed < 0; k++) {
        int64_t t0 = now_ns();
        if (run_op(pool, &ops[k]) != 0) failed = k;
        else ns[k] += now_ns() - t0;
    }
    if (n_ops > 1) ember_pool_rest(pool);
    ember_fp_leave(fp);
    return failed;
}
