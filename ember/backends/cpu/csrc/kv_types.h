/* Rows of the KV cache in its storage types: F16 (the default), BF16, Q8_0 and Q4_0 (ggml's block
 * layouts, type ids as in quant.h). A cache row is one token's keys (or values) of every kv head; a
 * head's part starts on a block boundary (head sizes are multiples of 32 for the block types). */
#ifndef EMBER_KV_TYPES_H
#define EMBER_KV_TYPES_H

#include "ember_cpu.h"
#include "ops_kernels.h"

/* Bytes of n values stored as type t; -1 when t is not a KV type or n is not whole blocks. */
int64_t ember_kv_bytes(int t, int64_t n);

/* dst (ember_kv_bytes(t, n) bytes) = src (n,) f32 stored as type t (quantized blocks as ggml's
 * reference quantizers round them). */
void ember_kv_write_row(int t, const ember_op_kernels *kern, const float *src, void *dst, int64_t n);

/* dst (n_rows, width) f32 = the rows of type t at byte offsets offs (n_rows,) from base. */
void ember_kv_gather_rows(int t, const ember_op_kernels *kern, const void *base, const int64_t *offs,
                          int64_t n_rows, int64_t width, float *dst);

#endif
