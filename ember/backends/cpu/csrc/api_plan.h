/* A forward pass recorded as a list of ops and replayed in one call, so Python is not on the
 * per-op path. Every op reads and writes caller-owned buffers whose addresses stay fixed
 * between replays; what changes from step to step (token ids, positions, page tables) is
 * written into those buffers before the replay. */

enum ember_op_kind {
    EMBER_OP_MATMUL = 1,       /* p: w, x, y, scratch; i: m, k, n, rounding; type */
    EMBER_OP_MATMUL_MULTI = 2, /* p: types (int*), ws, ms (int64*), x, ys, scratch; i: count, k, n, rounding */
    EMBER_OP_GET_ROWS = 3,     /* p: w, ids, out; i: m, k, n; type */
    EMBER_OP_RMS_NORM = 4,     /* p: x, w (or NULL), out; i: n, d; f: eps */
    EMBER_OP_ROPE = 5,         /* p: x, pos, freq_factors, x2 (or NULL); i: n_tok, n_head, head_dim, n_rot, neox,
                                  n_ctx_orig, n_head2; f: freq_base, freq_scale, ext_factor, attn_factor,
                                  beta_fast, beta_slow -- x2: rotated at the same positions (fused) */
    EMBER_OP_SILU_MUL = 6,     /* p: gate, up, out; i: n */
    EMBER_OP_GELU_MUL = 7,     /* p: gate, up, out; i: n */
    EMBER_OP_ADD = 8,          /* p: a, b, out; i: n */
    EMBER_OP_SCALE = 9,        /* p: x; i: n; f: s */
    EMBER_OP_KV_STORE = 10,    /* p: k, v, k_cache, v_cache, slots; i: n_tok, k_dim, v_dim, k_type, v_type,
                                  page_size, parts */
    EMBER_OP_ATTENTION = 11,   /* p: q, k_cache, v_cache, out, tok_pos, tok_seq, block_tables, sinks;
                                  i: n_tok, n_head, n_kv_head, hd_k, hd_v, max_pages, page_size, window,
                                     k_type, v_type, parts;
                                  f: scale, softcap */
    EMBER_OP_GATHER_ROWS = 12, /* p: x, rows (int32*), out; i: n_out, d   -- out[r] = x[rows[r]] */
    EMBER_OP_ADD_ROW = 13,     /* p: x, b; i: n, d                        -- x[r] += b for every row */
    EMBER_OP_TOP_K = 14,       /* p: x, ids, vals; i: n, vocab, k         -- each row's k largest */
    EMBER_OP_SOFTCAP = 15,     /* p: x; i: n; f: cap                      -- x = cap * tanh(x / cap) */
    EMBER_OP_POS_SCALE = 16,   /* p: x, pos; i: n_tok, d, length; f: scale, offset -- attention temperature */
    EMBER_OP_LAYER_NORM = 17,  /* p: x, w (or NULL), b (or NULL), out; i: n, d; f: eps */
    EMBER_OP_GELU = 18,        /* p: x, out; i: n                         -- out = gelu_tanh(x) */
    EMBER_OP_TANH = 19,        /* p: x; i: n                              -- x = tanh(x) */
    EMBER_OP_HADAMARD = 20,    /* p: x, out; i: n, d, block                -- Walsh-Hadamard rotation */
    EMBER_OP_EXPERTS_MATMUL = 21, /* p: types, ws, ms, x, ids, ys, scratch; i: count, n_expert, k, n_tok, n_used,
                                     x_per_row, rounding */
    EMBER_OP_EXPERTS_ROUTE = 22,  /* p: logits, ids, weights; i: n_tok, n_expert, n_used, norm */
    EMBER_OP_EXPERTS_SUM = 23,    /* p: y, weights, out; i: n_tok, n_used, d */
    EMBER_OP_EXPERTS_BIAS = 24,   /* p: y, b, ids; i: rows, d */
    EMBER_OP_SWIGLU_OAI = 25      /* p: gate, up, out; i: n; f: alpha, limit */
};

#define EMBER_TOPK_MAX 64
#define EMBER_EXPERTS_MAX 256     /* experts of one layer */
#define EMBER_EXPERTS_MAX_MATS 3  /* stacked matrices of one grouped product */

typedef struct ember_op {
    int32_t kind;
    int32_t type;
    void *p[8];
    int64_t i[12];
    float f[8];
} ember_op;

/* Run ops[0..n_ops) in order. Returns -1, or the index of an op that could not run (bad kind). */
int64_t ember_run_ops(ember_pool *pool, const ember_op *ops, int64_t n_ops);

/* The same, adding each op's wall time in nanoseconds to ns[k] (for profiles). */
int64_t ember_run_ops_timed(ember_pool *pool, const ember_op *ops, int64_t n_ops, int64_t *ns);

/* ids (n, k) int32 and vals (n, k) = the k <= EMBER_TOPK_MAX largest values of each row of x (n, vocab),
 * best first, the lower id first among equal values; NaN never chosen (a row with fewer than k others
 * ends in id -1, value -inf). */
void ember_top_k(ember_pool *pool, const float *x, int64_t n, int64_t vocab, int k, int32_t *ids, float *vals);

/* The two small ops that have no kernel of their own. */
void ember_gather_rows(const float *x, const int32_t *rows, float *out, int64_t n_out, int64_t d);
void ember_add_row(float *x, const float *b, int64_t n, int64_t d);
