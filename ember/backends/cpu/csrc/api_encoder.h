/* Ops of encoder models (BERT and its kin): layer norm with a bias, GELU without a gate, tanh.
 * Row-major float32 like api_ops.h. */

/* x (n, d) -> out (n, d) = (x - mean) / sqrt(var + eps) * w + b, mean and var over each row;
 * w, b (d,) or NULL. out may alias x. */
void ember_layer_norm(ember_pool *pool, const float *x, const float *w, const float *b, float *out,
                      int64_t n, int64_t d, float eps);
/* out (n,) = gelu_tanh(x)   (out may alias x) */
void ember_gelu(ember_pool *pool, const float *x, float *out, int64_t n);
/* x (n,) = tanh(x) */
void ember_tanh(float *x, int64_t n);
