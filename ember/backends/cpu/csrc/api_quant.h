/* Products with quantized weights, straight from GGUF blocks (weights are never dequantized into a copy).
 * A weight matrix W (m, k) is m rows of k values of ggml type `type`, rows contiguous, each row
 * k / block_size blocks. Type ids are ggml's (GGMLType in ember/quant/types.py). Supported: F32 F16 BF16
 * Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL IQ4_XS MXFP4 (and quant_iq.h's low-bit types).
 * Arguments are checked by the Python caller; the kernels return without writing on a bad type or shape. */

/* 1 if this build computes with ggml type `type`, else 0. */
int ember_type_supported(int type);

/* Bytes of caller-owned scratch ember_matmul needs for n rows of k activations: 0 for float weights (x is read directly), -1 when the type is unsupported
 * or k is not a multiple of its block size. */
int64_t ember_matmul_scratch_size(int type, int64_t k, int64_t n);

/* How the activations of the 32-value block types (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL MXFP4) are rounded:
 * EMBER_ROUND_EXACT: to int16 per block of 32, the products of float arithmetic; EMBER_ROUND_LLAMA: to
 * int8 as llama.cpp's Q8_0 / Q8_1 (f16 scales), which the decode kernels multiply twice as fast: for
 * models whose other products round as llama.cpp's K-quant ones do (mixing the two drifts from
 * llama.cpp's numbers more than either; the caller chooses: see Backend.rounding). The K-quants and
 * IQ4_XS always round as llama.cpp's Q8_K. */
enum { EMBER_ROUND_EXACT = 0, EMBER_ROUND_LLAMA = 1 };

/* y (n, m) = x (n, k) @ W^T.  x (n, k) f32 rows contiguous; y (n, m) f32 rows contiguous.
 * scratch: ember_matmul_scratch_size(type, k, n) bytes, 64-byte aligned (activations quantized once,
 * as `rounding` says), then multiplied with the weights in integers. Results do not depend on the
 * number of threads. */
void ember_matmul(ember_pool *pool, int type, const void *w, int64_t m, int64_t k,
                  const float *x, int64_t n, float *y, void *scratch, int rounding);

/* Several products with the same x in one pass over the pool (e.g. q, k, v; or gate, up), x quantized
 * once: y_i (n, ms[i]) = x (n, k) @ W_i^T for i < count <= 8, W_i of type types[i] at ws[i].
 * scratch as for ember_matmul (the size for types[0]). Returns 0, or -1 (nothing computed) when a
 * type is unsupported, k is not a multiple of its block size, count is out of range, or the types do
 * not share an activation kind (see ember_matmul_act_kind). */
int ember_matmul_multi(ember_pool *pool, int count, const int *types, const void *const *ws, const int64_t *ms,
                       int64_t k, const float *x, int64_t n, float *const *ys, void *scratch, int rounding);

/* Which quantization of x the products with W of `type` use (equal kinds can share one
 * ember_matmul_multi call); -1 unsupported. */
enum { EMBER_ACT_KIND_F32 = 0, EMBER_ACT_KIND_Q16 = 1, EMBER_ACT_KIND_Q8K = 2 };
int ember_matmul_act_kind(int type);

/* out (n, k) f32 = rows ids[0..n) of W (m, k); ids outside [0, m) are the caller's error (checked in Python).
 * Bit-exact with the reference dequantization. */
void ember_get_rows(ember_pool *pool, int type, const void *w, int64_t m, int64_t k,
                    const int32_t *ids, int64_t n, float *out);

/* dst (count,) f32 from count values of ggml type `type` in src (count a multiple of the block size). */
void ember_dequantize(int type, const void *src, float *dst, int64_t count);

/* dst = x (k,) quantized as the products with W of `type` quantize their activations with `rounding`
 * (the row format of its activation kind, ember_matmul_scratch_size(type, k, 1) bytes): for tests and
 * tools. Returns 0, or -1 for float or unsupported types and k not a multiple of the block size. */
int ember_matmul_quantize(int type, const float *x, int64_t k, void *dst, int rounding);

/* Grouped products of a mixture-of-experts layer. Each W_i (n_expert, ms[i], k) of type types[i] at ws[i] is
 * n_expert stacked matrices (expert e's rows start e * ms[i] rows in); ids (n_tok, n_used) the experts each
 * token chose, in [0, n_expert). Selection s = t * n_used + u gets row s of every y_i (n_tok * n_used, ms[i]):
 * y_i[s] = W_i[ids[s]] @ x_s, x_s = row t of x (n_tok, k) (x_per_row = 0: a token's input, shared by its
 * experts) or row s of x (n_tok * n_used, k) (x_per_row = 1). The selections are grouped by expert, so each
 * chosen expert's rows are read once per call and the others not at all. count <= EMBER_EXPERTS_MAX_MATS
 * matrices sharing one activation kind; n_expert <= EMBER_EXPERTS_MAX. scratch: ember_experts_scratch_size
 * bytes, 64-byte aligned. used: NULL, or per matrix NULL or a byte per expert, set to 1 for each expert read
 * (marks for the move onto huge pages). Returns 0, or -1 (nothing written) for a bad type, shape or id. */
int ember_experts_matmul(ember_pool *pool, int count, const int *types, const void *const *ws, const int64_t *ms,
                         int64_t n_expert, int64_t k, const float *x, int64_t n_tok, int64_t n_used, int x_per_row,
                         const int32_t *ids, float *const *ys, void *scratch, int rounding, uint8_t *const *used);

/* Bytes of scratch ember_experts_matmul needs for `rows` = n_tok * n_used selections of `count` matrices
 * whose row counts sum to m_sum; -1 for an unsupported type or shape. */
int64_t ember_experts_scratch_size(int type, int64_t k, int64_t rows, int64_t m_sum, int count, int64_t n_expert);
