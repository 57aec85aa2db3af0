/* Products with quantized weights, straight from GGUF blocks (weights are never dequantized into a copy).
 * A weight matrix W (m, k) is m rows of k values of ggml type `type`, rows contiguous, each row
 * k / block_size blocks. Type ids are ggml's (GGMLType in ember/quant/types.py). Supported: F32 F16 BF16
 * Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS.
 * Arguments are checked by the Python caller; the kernels return without writing on a bad type or shape. */

/* 1 if this build computes with ggml type `type`, else 0. */
int ember_type_supported(int type);

/* Bytes of caller-owned scratch ember_matmul needs for n rows of k activations (enough for either
 * activation precision): 0 for float weights (x is read directly), -1 when the type is unsupported
 * or k is not a multiple of its block size. */
int64_t ember_matmul_scratch_size(int type, int64_t k, int64_t n);

/* y (n, m) = x (n, k) @ W^T.  x (n, k) f32 rows contiguous; y (n, m) f32 rows contiguous.
 * scratch: ember_matmul_scratch_size(type, k, n) bytes, 64-byte aligned (activations quantized once).
 * Activations are rounded to int8 per block of 32 (256 for the K-quants and IQ4_XS), and by default
 * what that rounding missed is rounded to int8 again with scales of its own (16 activation bits: about
 * 1/254 of the 8-bit error); both are multiplied exactly in integers in one pass over W. Results do not
 * depend on the number of threads. */
void ember_matmul(ember_pool *pool, int type, const void *w, int64_t m, int64_t k,
                  const float *x, int64_t n, float *y, void *scratch);

/* Several products with the same x in one pass over the pool (e.g. q, k, v; or gate, up), x quantized
 * once: y_i (n, ms[i]) = x (n, k) @ W_i^T for i < count <= 8, W_i of type types[i] at ws[i].
 * scratch as for ember_matmul (the size for types[0]). Returns 0, or -1 (nothing computed) when a
 * type is unsupported, k is not a multiple of its block size, count is out of range, or the types do
 * not share an activation kind (see ember_matmul_act_kind). */
int ember_matmul_multi(ember_pool *pool, int count, const int *types, const void *const *ws, const int64_t *ms,
                       int64_t k, const float *x, int64_t n, float *const *ys, void *scratch);

/* Activation precision of the quantized products, process-wide: 16 (two int8 levels, the default) or 8
 * (one, as llama.cpp does; faster for prompts). The environment variable EMBER_ACT_BITS sets it at
 * load. set returns 0, or -1 (unchanged) for any other value. */
int ember_matmul_set_act_bits(int bits);
int ember_matmul_act_bits(void);

/* Which quantization of x the products with W of `type` use (equal kinds can share one
 * ember_matmul_multi call): 0 f32, 1 int8 per 32, 2 and 3 int8 per 256; -1 unsupported. */
int ember_matmul_act_kind(int type);

/* out (n, k) f32 = rows ids[0..n) of W (m, k); ids outside [0, m) are the caller's error (checked in Python).
 * Bit-exact with the reference dequantization. */
void ember_get_rows(ember_pool *pool, int type, const void *w, int64_t m, int64_t k,
                    const int32_t *ids, int64_t n, float *out);

/* dst (count,) f32 from count values of ggml type `type` in src (count a multiple of the block size). */
void ember_dequantize(int type, const void *src, float *dst, int64_t count);
