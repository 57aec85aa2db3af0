/* Elementwise ops, norms, rotary embedding and paged attention.
 * All activations are row-major float32; "(a, b)" shapes list the slowest dimension first. */

/* x (n, d) -> out (n, d) = x / sqrt(mean(x^2) + eps) * w;  w (d,) or NULL for no weight. out may alias x. */
void ember_rms_norm(ember_pool *pool, const float *x, const float *w, float *out,
                    int64_t n, int64_t d, float eps);

/* Rotary embedding in place on x (n_tok, n_head, head_dim): rotates the first n_rot dims of each head
 * by angle pos[t] * theta_i, theta_i = freq_base^(-2i/n_rot), with ggml's YaRN/linear scaling
 * (freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, n_ctx_orig) and optional per-pair
 * divisors freq_factors (n_rot/2,) or NULL.
 * neox = 0: pairs (x[2i], x[2i+1]); neox = 1: pairs (x[i], x[i + n_rot/2]). n_rot even, <= head_dim;
 * dims past n_rot are left as they are. Angles are formed and reduced in double: float accuracy at
 * any position. */
void ember_rope(ember_pool *pool, float *x, int64_t n_tok, int64_t n_head, int64_t head_dim,
                const int32_t *pos, int64_t n_rot, int neox, float freq_base, float freq_scale,
                const float *freq_factors, float ext_factor, float attn_factor,
                float beta_fast, float beta_slow, int64_t n_ctx_orig);
/* The same for x (n_tok, n_head, head_dim) and x2 (n_tok, n_head2, head_dim) at the same positions
 * (queries and keys), each token's angles computed once for both; x2 NULL: x alone. */
void ember_rope_pair(ember_pool *pool, float *x, int64_t n_head, float *x2, int64_t n_head2, int64_t n_tok,
                     int64_t head_dim, const int32_t *pos, int64_t n_rot, int neox, float freq_base,
                     float freq_scale, const float *freq_factors, float ext_factor, float attn_factor,
                     float beta_fast, float beta_slow, int64_t n_ctx_orig);

/* out (n,) = silu(gate) * up */
void ember_silu_mul(ember_pool *pool, const float *gate, const float *up, float *out, int64_t n);
/* out (n,) = gelu_tanh(gate) * up   (tanh approximation of GELU) */
void ember_gelu_mul(ember_pool *pool, const float *gate, const float *up, float *out, int64_t n);
/* out (n,) = a + b   (out may alias a or b) */
void ember_add(ember_pool *pool, const float *a, const float *b, float *out, int64_t n);
/* x (n,) *= s */
void ember_scale(ember_pool *pool, float *x, float s, int64_t n);
/* x (n,) = cap * tanh(x / cap)   (cap > 0: logit soft-capping) */
void ember_softcap(ember_pool *pool, float *x, float cap, int64_t n);
/* Row t of x (n_tok, d) *= 1 + scale * log(floor((pos[t] + offset) / length) + 1): queries tempered by
 * their position (length >= 1), as Llama 4 and Mistral 3 do beyond the original context. */
void ember_pos_scale(float *x, const int32_t *pos, int64_t n_tok, int64_t d, int64_t length, float scale,
                     float offset);

/* Bytes of a KV-cache row of n values stored as `type` (ggml type ids: F16 1, BF16 30, Q8_0 8, Q4_0 2;
 * the block types need n a multiple of 32); -1 for any other type or a partial block. */
int64_t ember_kv_row_bytes(int type, int64_t n);

/* The caches' layout. A cache holds n_slots rows, in pages of page_size slots; a slot's row of keys
 * (values) is cut into `parts` equal parts (1, or one a kv head), and within a page each part's rows lie
 * together: part j of slot s is at byte ((s / page_size * parts + j) * page_size + s % page_size) *
 * part_bytes. parts = 1 is plain rows (slot s at s * row_bytes); one part a kv head puts a head's keys of
 * a page in one run, which the hardware prefetchers follow (decode attention reads one head at a time).
 * A page is page_size rows' bytes either way, so whole pages copy as rows. */

/* Write this step's keys and values into the paged cache, converting to the cache's types
 * (quantized blocks rounded as ggml's reference quantizers do).
 * k (n_tok, k_dim), v (n_tok, v_dim) f32; k_cache (n_slots, ember_kv_row_bytes(k_type, k_dim)),
 * v_cache (n_slots, ember_kv_row_bytes(v_type, v_dim)) bytes, laid out in `parts` (above; k_dim and
 * v_dim divide into parts of whole blocks); slots (n_tok,): destination slot of each token, in
 * [0, n_slots) (the caller checks). */
void ember_kv_store(ember_pool *pool, const float *k, const float *v, void *k_cache, void *v_cache,
                    const int64_t *slots, int64_t n_tok, int64_t k_dim, int64_t v_dim, int k_type, int v_type,
                    int64_t page_size, int64_t parts);

/* out (n, d) = x (n, d) rotated in blocks of `block` values (a power of two dividing d): each block times the
 * orthonormal Walsh-Hadamard matrix H (H[i][j] = (-1)^popcount(i & j) / sqrt(block), H H = I). A quantized
 * KV cache stores keys (and values) rotated so that outliers spread over a block: queries get the same
 * rotation (dot products keep), attention outputs the inverse (H itself). out may alias x. */
void ember_hadamard(ember_pool *pool, const float *x, float *out, int64_t n, int64_t d, int64_t block);

/* Causal attention over a paged KV cache, with grouped-query heads and an optional sliding window.
 * q (n_tok, n_head, hd_k) f32; out (n_tok, n_head, hd_v) f32.
 * k_cache (n_slots, n_kv_head, hd_k) and v_cache (n_slots, n_kv_head, hd_v) values stored as k_type and
 * v_type (see ember_kv_row_bytes; the block types need hd a multiple of 32), laid out in `parts` (1 or
 * n_kv_head; see ember_kv_store): read in place, a chunk of keys converted to f32 at a time.
 * Query token t belongs to the sequence whose page table is row tok_seq[t] of block_tables
 * (n_seq, max_pages); position p of that sequence lives in slot
 * block_tables[s][p / page_size] * page_size + p % page_size. Token t at position tok_pos[t] attends
 * to positions max(0, tok_pos[t] - window + 1) .. tok_pos[t] (window <= 0: from 0).
 * Head h reads kv head h / (n_head / n_kv_head). scores = scale * q.k, then, if softcap > 0,
 * softcap * tanh(scores / softcap); softmax (with sinks (n_head,) not NULL: head h's denominator also
 * holds exp(sinks[h]), a score with no value, as gpt-oss's attention sinks); weighted sum of v.
 * Sequences whose tables begin with the same page ids (a prefix cache's shared prompt) have those keys
 * read once for all their tokens (up to 512 tokens a call), each row's result merged with its own keys'.
 * Caller's contract (checked in Python, not here): n_head % n_kv_head == 0; hd_k, hd_v <= 8192;
 * tok_pos[t] >= 0 and < max_pages * page_size; the page ids used address slots inside the caches.
 * No allocation: each thread uses ~180 KB of stack, the calling thread up to 170 KB more. */
void ember_attention(ember_pool *pool, const float *q, const void *k_cache, const void *v_cache,
                     float *out, int64_t n_tok, int64_t n_head, int64_t n_kv_head, int64_t hd_k, int64_t hd_v,
                     const int32_t *tok_pos, const int32_t *tok_seq, const int32_t *block_tables,
                     int64_t max_pages, int64_t page_size, int64_t window, float scale, float softcap,
                     int k_type, int v_type, const float *sinks, int64_t parts);

/* Mixture-of-experts routing: ids (n_tok, n_used) int32 and weights (n_tok, n_used) = each token's n_used
 * most probable experts under softmax(logits (n_tok, n_expert)), best first (the lower id among equal
 * ones), with their probabilities, divided by their sum (kept from 0) when norm. n_used <= n_expert
 * <= EMBER_EXPERTS_MAX (else nothing is written). */
void ember_experts_route(const float *logits, int64_t n_tok, int64_t n_expert, int64_t n_used, int norm,
                         int32_t *ids, float *weights);

/* y (rows, d) += row ids[s] of b (n_expert, d) for each row s: the chosen experts' biases (gpt-oss). */
void ember_experts_bias(float *y, const float *b, const int32_t *ids, int64_t rows, int64_t d);

/* out (n,) = g * sigmoid(alpha * g) * (clamp(up, -limit, limit) + 1), g = min(gate, limit): gpt-oss's
 * clamped SwiGLU. out may alias gate or up. */
void ember_swiglu_oai(const float *gate, const float *up, float *out, int64_t n, float alpha, float limit);

/* out (n_tok, d) = sum over u of weights[t, u] * y[t * n_used + u]   (y (n_tok * n_used, d)) */
void ember_experts_sum(const float *y, const float *weights, float *out, int64_t n_tok, int64_t n_used, int64_t d);
