/* Inner loops of the ops in api_ops.h, one table per instruction set.
 * ops.c holds the drivers (threading, paging, online softmax) and the portable table;
 * ops_avx2.c and ops_avx512.c fill the same table with intrinsics. */
#ifndef EMBER_OPS_KERNELS_H
#define EMBER_OPS_KERNELS_H

#include "ember_cpu.h"

#define EMBER_KT_STRIDE 64 /* columns (keys) of a transposed key chunk */

typedef struct ember_op_kernels {
    /* out (n,) = silu(gate) * up */
    void (*silu_mul)(const float *gate, const float *up, float *out, int64_t n);
    /* out (n,) = gelu_tanh(gate) * up */
    void (*gelu_mul)(const float *gate, const float *up, float *out, int64_t n);
    /* dst (n,) f16 bits = src (n,) rounded to nearest even */
    void (*f32_to_f16)(const float *src, uint16_t *dst, int64_t n);
    /* dst (n_rows, width) f32 = rows of f16 bits at byte offsets offs[r] from base */
    void (*gather_f16_rows)(const void *base, const int64_t *offs, int64_t n_rows, int64_t width, float *dst);
    /* s (n_q, n_k) with row stride s_stride = scale * q (n_q, d; row stride q_stride) @ k (n_k, d)^T */
    void (*dot_rows)(const float *q, int64_t q_stride, int64_t n_q, const float *k, int64_t n_k, int64_t d,
                     float scale, float *s, int64_t s_stride);
    /* Many-row scores from keys transposed once (NULL where a table has none): transpose_keys writes
     * kt (d, EMBER_KT_STRIDE) = k (n_k <= EMBER_KT_STRIDE, d)^T; dot_rows_kt s (n_q, n_k) with row stride
     * s_stride = scale * q (n_q, d; row stride q_stride) @ kt's columns [0, n_k) (kt may point past a
     * column offset). d a multiple of 16. */
    void (*transpose_keys)(const float *k, int64_t n_k, int64_t d, float *kt);
    /* transpose_keys of n_k rows of f16 bits at byte offsets offs[r] from base (gather_f16_rows, transposed) */
    void (*gather_f16_keys_t)(const void *base, const int64_t *offs, int64_t n_k, int64_t d, float *kt);
    void (*dot_rows_kt)(const float *q, int64_t q_stride, int64_t n_q, const float *kt, int64_t n_k, int64_t d,
                        float scale, float *s, int64_t s_stride);
    /* x (n,) = cap * tanh(x / cap) */
    void (*softcap)(float *x, int64_t n, float cap);
    /* max of x (n,), n >= 1 */
    float (*max)(const float *x, int64_t n);
    /* x (n,) = exp(x - m); returns the sum of the new x */
    float (*exp_sum)(float *x, int64_t n, float m);
    /* acc (n_q, d; row stride acc_stride) += p (n_q, n_k; row stride p_stride) @ v (n_k, d) */
    void (*weighted_sum)(const float *p, int64_t p_stride, int64_t n_q, const float *v, int64_t n_k, int64_t d,
                         float *acc, int64_t acc_stride);
} ember_op_kernels;

extern const ember_op_kernels ember_op_kernels_scalar;
#if defined(EMBER_X86)
extern const ember_op_kernels ember_op_kernels_avx2;
extern const ember_op_kernels ember_op_kernels_avx512;
#endif

#endif
