/* Body of the x86 kernels, compiled twice: by quant_avx2.c and by quant_avx512.c (with 256-bit VNNI).
 * The includer enables its instruction set, then defines:
 *   X86_VNNI                  1 when dpbusd/dpwssd exist
 *   dot4_acc(acc, u, s)       acc + per int32 lane, the sum of 4 products u8 * s8
 *                             (without VNNI u must stay <= 128 so pairs of products fit int16)
 *   dot2w_acc(acc, a, b)      acc + per int32 lane, the sum of 2 products i16 * i16
 *   q5_high_bits(qh)          32 bytes: 0x10 where bit i of qh is set, else 0
 *   block_scales8(bs, mn, p, g, &m)   the f16 d (and m when mn) that start each of g <= 8 blocks of
 *                             bs bytes at p, as floats (lanes past g: 0)
 *
 * Every kernel computes, per block and activation level, exactly the integer sums of quant_scalar.c
 * and multiplies them by the same float factors; only the order of the float additions differs.
 * Weights are used as unsigned bytes u = w + off, and the offset is taken back in integers:
 * sum(u * q) - off * sum(q). */

#ifndef ALWAYS
#define ALWAYS static inline __attribute__((always_inline))
#endif
#define UNROLL _Pragma("GCC unroll 8")

/* ---- small helpers ---- */

ALWAYS float f16_to_f32(uint16_t h) { return _cvtsh_ss(h); }

ALWAYS __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

ALWAYS __m256i bytes(int v) { return _mm256_set1_epi8((char)v); }

/* 16 bytes of nibbles -> 32 values: the low nibbles, then the high nibbles (the legacy block order). */
ALWAYS __m256i nibbles32(const uint8_t *qs) {
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1);
    return _mm256_and_si256(v, bytes(0x0f));
}

/* Each byte of v shifted by s bits (left when s > 0, right when s < 0) and masked: the shifts are
 * 16-bit, but the masks keep only bits that came from the same byte. */
ALWAYS __m256i shift_mask(__m256i v, int s, int mask) {
    if (s > 0) v = _mm256_slli_epi16(v, s);
    if (s < 0) v = _mm256_srli_epi16(v, -s);
    return _mm256_and_si256(v, bytes(mask));
}

ALWAYS float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

ALWAYS int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* Signed weights times signed activations: |w| * (q with w's sign), 4 products per lane. */
ALWAYS __m256i dot4_signed(__m256i acc, __m256i w, __m256i q) {
    return dot4_acc(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(q, w));
}

/* Pairs of u8 * s8 summed into int16 (|u| <= 128 and |s| <= 127 cannot saturate). */
ALWAYS __m256i pairs16(__m256i u, __m256i s) { return _mm256_maddubs_epi16(u, s); }

/* ---- activation quantizers (same arithmetic as quant_scalar.c, so the same bytes) ---- */

/* 8 values per vector; max |x| over `count` vectors */
ALWAYS float absmax(const float *x, int count) {
    __m256 m = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < count; i++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 values -> 32 int8 at q (rounded to even, like nearbyintf); the four int32 vectors in i[4]. */
ALWAYS void round32(const float *x, __m256 inv, int8_t *q, __m256i *i) {
    for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), inv));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
}

/* n values (a multiple of 32) times inv -> q (n,) and the sums of each 16 q -> sum16 (n/16,) */
ALWAYS void round_run(const float *x, int n, float inv, int8_t *q, int32_t *sum16) {
    const __m256 iv = _mm256_set1_ps(inv);
    for (int j = 0; j < n / 32; j++) {
        __m256i i[4];
        round32(x + 32 * j, iv, q + 32 * j, i);
        sum16[2 * j] = hsum8i(_mm256_add_epi32(i[0], i[1]));
        sum16[2 * j + 1] = hsum8i(_mm256_add_epi32(i[2], i[3]));
    }
}

/* n values (a multiple of 32) with one scale -> q (n,) and the sums of each 16 q -> sum16 (n/16,);
 * returns d = amax / 127, and the factor used, 127 / amax (0 for a zero block), in *inv. */
ALWAYS float quantize_run(const float *x, int n, int8_t *q, int32_t *sum16, float *inv) {
    float amax = absmax(x, n / 8);
    *inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    round_run(x, n, *inv, q, sum16);
    return amax / 127.0f;
}

/* r (n,) = x - q d, rounded once (as quant_scalar.c's fmaf), clamped to the residual's range in steps
 * of d / RESIDUAL_STEPS (inv2 = RESIDUAL_STEPS / d): the rounding of r then never passes +-127. */
ALWAYS void residual(const float *x, const int8_t *q, float d, float inv2, int n, float *r) {
    const __m256 dv = _mm256_set1_ps(d), lim = _mm256_set1_ps(127.0f / inv2);
    for (int i = 0; i < n; i += 8) {
        __m256 qf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i))));
        __m256 v = _mm256_fnmadd_ps(qf, dv, _mm256_loadu_ps(x + i));
        _mm256_storeu_ps(r + i, inv2 > 0.0f ? _mm256_min_ps(lim, _mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), lim), v)) : v);
    }
}

/* One 32-value block of x -> block b of an EMBER_ACT_Q8 row (q, d, s, nq): with its own scale when
 * inv < 0 (returns the factor it used), else rounded with factor inv at scale d (the residual level). */
ALWAYS float quantize_q8_block(const float *x, void *row, int64_t k, int64_t b, float inv, float d_fixed) {
    int8_t *q = row;
    float *d = (float *)(q + k), *s = d + k / QK;
    int32_t *nq = (int32_t *)(s + k / QK), sum16[2];
    if (inv < 0.0f) {
        d[b] = quantize_run(x, QK, q + b * QK, sum16, &inv);
    } else {
        round_run(x, QK, inv, q + b * QK, sum16);
        d[b] = d_fixed;
    }
    s[b] = d[b] * (float)(sum16[0] + sum16[1]);
    nq[b] = -(sum16[0] + sum16[1]);
    return inv;
}

/* x (k,) -> EMBER_ACT_Q8 rows: q (k,) | d (k/32,) | s (k/32,) | nq (k/32,) at dst (and the residual at res) */
static void quantize_q8(const float *x, void *dst, void *res, int64_t k) {
    const float *d = (const float *)((const int8_t *)dst + k);
    int32_t *nls = (int32_t *)((uint8_t *)dst + ember_act_q8_nls_offset(k));
    const __m256i ones = bytes(1), zero = _mm256_setzero_si256();
    for (int64_t b = 0; b < k / QK; b++) {
        float inv = quantize_q8_block(x + b * QK, dst, k, b, -1.0f, 0.0f);
        __m256i sums = dot4_acc(zero, ones, load256((const int8_t *)dst + b * QK));
        if (res) {
            float r[QK], inv2 = inv * RESIDUAL_STEPS;
            residual(x + b * QK, (const int8_t *)dst + b * QK, d[b], inv2, QK, r);
            quantize_q8_block(r, res, k, b, inv2, d[b] * (1.0f / RESIDUAL_STEPS));
            sums = dot4_acc(_mm256_slli_epi32(sums, RESIDUAL_SHIFT), ones, load256((const int8_t *)res + b * QK));
        }
        _mm256_storeu_si256((__m256i *)(nls + 8 * b), _mm256_sub_epi32(zero, sums));
    }
    if (res) ember_q8_combine(dst, res, k);
}

/* One 256-value block of x -> block b of an EMBER_ACT_Q8K row (q, d, bsums); own scale or fixed as
 * quantize_q8_block */
ALWAYS float quantize_q8k_block(const float *x, void *row, int64_t k, int64_t b, float inv, float d_fixed) {
    int8_t *q = row;
    float *d = (float *)(q + k);
    int16_t *bsums = (int16_t *)(d + k / QK_K);
    int32_t sum16[16];
    if (inv < 0.0f) {
        d[b] = quantize_run(x, QK_K, q + b * QK_K, sum16, &inv);
    } else {
        round_run(x, QK_K, inv, q + b * QK_K, sum16);
        d[b] = d_fixed;
    }
    for (int g = 0; g < 16; g++) bsums[16 * b + g] = (int16_t)sum16[g];
    return inv;
}

/* x (k,) -> EMBER_ACT_Q8K rows at dst (and res): q (k,) | d (k/256,) | bsums (k/16,) | chunk sums */
ALWAYS void quantize_q8k(const float *x, void *dst, void *res, int64_t k, int ch) {
    const float *d = (const float *)((const int8_t *)dst + k);
    for (int64_t b = 0; b < k / QK_K; b++) {
        float inv = quantize_q8k_block(x + b * QK_K, dst, k, b, -1.0f, 0.0f);
        if (res) {
            float r[QK_K], inv2 = inv * RESIDUAL_STEPS;
            residual(x + b * QK_K, (const int8_t *)dst + b * QK_K, d[b], inv2, QK_K, r);
            quantize_q8k_block(r, res, k, b, inv2, d[b] * (1.0f / RESIDUAL_STEPS));
        }
    }
    ember_q8k_chunk_sums(dst, k, ch);
    if (res) ember_q8k_chunk_sums(res, k, ch);
}

static void quantize_q8k16(const float *x, void *dst, void *res, int64_t k) { quantize_q8k(x, dst, res, k, 16); }

static void quantize_q8k32(const float *x, void *dst, void *res, int64_t k) { quantize_q8k(x, dst, res, k, 32); }

/* ---- microtiles: W rows x up to TILE_C activation rows ----
 * Mostly one row, walked from start to end: rows walked side by side defeat the hardware
 * prefetchers once rows pass ~450 bytes (measured here: one core streams 26 GB/s along one row,
 * 8-11 GB/s along 2-4 rows of 550+ bytes in lockstep). Short rows of the 32-value types go 4 at a
 * time, which shares each activation load (about 25% faster there). Each weight block is reused
 * across the tile's activation rows (with residual rows: 2 tokens, each with its two rows, whose
 * products go to the token's accumulators); a lone row keeps two accumulators per token (even and
 * odd blocks) so that the FMA latency hides. */

/* y[c * ys] = sum of the lanes of acc[c][0] + acc[c][1] */
#define STORE_TILE(acc, y, ys, nc) \
    UNROLL for (int c_ = 0; c_ < (nc); c_++) (y)[c_ * (ys)] = hsum8(_mm256_add_ps((acc)[c_][0], (acc)[c_][1]))

#define TILE_C 4 /* activation rows of a tile */
#define LEVELS 2 /* activation rows of a token at most: its rounding and the rounding of the residual */

/* Calls BODY specialized for the run-time nc and level count (ar != 0: two levels): one level, nc <= 4
 * tokens at once; two levels, tokens two at a time. Every body takes
 * (type, k, w, ws, a, as, ar, y, ys, nr, nc, levels) and returns nothing. */
#define TILE_DISPATCH(BODY, TYPE, NR)                                                                        \
    do {                                                                                                     \
        if (ar) {                                                                                            \
            for (int c0 = 0; c0 < nc; c0 += 2) {                                                             \
                const uint8_t *a0 = (const uint8_t *)a + c0 * as;                                            \
                if (nc - c0 >= 2) BODY(TYPE, k, w, ws, a0, as, ar, y + c0 * ys, ys, NR, 2, 2);               \
                else BODY(TYPE, k, w, ws, a0, as, ar, y + c0 * ys, ys, NR, 1, 2);                            \
            }                                                                                                \
            return;                                                                                          \
        }                                                                                                    \
        switch (nc) {                                                                                        \
        case 1: BODY(TYPE, k, w, ws, a, as, 0, y, ys, NR, 1, 1); return;                                     \
        case 2: BODY(TYPE, k, w, ws, a, as, 0, y, ys, NR, 2, 1); return;                                     \
        case 3: BODY(TYPE, k, w, ws, a, as, 0, y, ys, NR, 3, 1); return;                                     \
        default: BODY(TYPE, k, w, ws, a, as, 0, y, ys, NR, 4, 1); return;                                    \
        }                                                                                                    \
    } while (0)

/* A tile function over one W row for BODY. */
#define DEFINE_TILE(fname, BODY, TYPE)                                                                      \
    static void fname(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, int64_t ar, float *y, \
                      int64_t ys, int nr, int nc) {                                                         \
        (void)nr;                                                                                           \
        TILE_DISPATCH(BODY, TYPE, 1);                                                                       \
    }

/* ================= 32-value blocks: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL ================= */

ALWAYS int signed_weights(int type) { return !X86_VNNI && (type == EMBER_T_Q8_0 || type == EMBER_T_IQ4_NL); }

/* The offset added to the weights to make them unsigned bytes (0 for the sign-trick path). */
ALWAYS int weight_offset(int type) {
    switch (type) {
    case EMBER_T_Q4_0: return 8;
    case EMBER_T_Q5_0: return 16;
    case EMBER_T_Q8_0:
    case EMBER_T_IQ4_NL: return X86_VNNI ? 128 : 0;
    default: return 0;
    }
}

/* log2 of weight_offset(type) (where it is not 0) */
ALWAYS int offset_shift(int type) { return type == EMBER_T_Q4_0 ? 3 : type == EMBER_T_Q5_0 ? 4 : 7; }

ALWAYS int has_min(int type) { return type == EMBER_T_Q4_1 || type == EMBER_T_Q5_1; }

ALWAYS int block_bytes(int type) {
    switch (type) {
    case EMBER_T_Q4_0: return sizeof(blk_q4_0);
    case EMBER_T_Q4_1: return sizeof(blk_q4_1);
    case EMBER_T_Q5_0: return sizeof(blk_q5_0);
    case EMBER_T_Q5_1: return sizeof(blk_q5_1);
    case EMBER_T_Q8_0: return sizeof(blk_q8_0);
    default: return sizeof(blk_iq4_nl);
    }
}

/* IQ4_NL levels as a pshufb table: signed, or shifted by +128 when the weights go unsigned. */
ALWAYS __m256i iq4nl_table(int shifted) {
    __m128i t = _mm_loadu_si128((const __m128i *)ember_iq4nl_values);
    if (shifted) t = _mm_xor_si128(t, _mm_set1_epi8((char)0x80));
    return _mm256_broadcastsi128_si256(t);
}

ALWAYS uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The 32 weights of a block as bytes: w + weight_offset(type), or signed (the sign-trick types). */
ALWAYS __m256i weights32(int type, const uint8_t *p) {
    switch (type) {
    case EMBER_T_Q4_0: return nibbles32(((const blk_q4_0 *)p)->qs);
    case EMBER_T_Q4_1: return nibbles32(((const blk_q4_1 *)p)->qs);
    case EMBER_T_Q5_0: {
        const blk_q5_0 *b = (const blk_q5_0 *)p;
        return _mm256_or_si256(nibbles32(b->qs), q5_high_bits(load_u32(b->qh)));
    }
    case EMBER_T_Q5_1: {
        const blk_q5_1 *b = (const blk_q5_1 *)p;
        return _mm256_or_si256(nibbles32(b->qs), q5_high_bits(load_u32(b->qh)));
    }
    case EMBER_T_Q8_0: {
        __m256i u = load256(((const blk_q8_0 *)p)->qs);
        return X86_VNNI ? _mm256_xor_si256(u, bytes(0x80)) : u;
    }
    default: return _mm256_shuffle_epi8(iq4nl_table(X86_VNNI), nibbles32(((const blk_iq4_nl *)p)->qs));
    }
}

/* d (and m for Q4_1/Q5_1) of g <= 8 consecutive blocks at p, as 8 floats (lanes past g: 0).
 * block_scales8 comes from the includer: a gather, or permutes of the loaded blocks. */
/* the first g of 8 floats at p (the rest 0) */
ALWAYS __m256 load_floats(const float *p, int g) {
    if (g == 8) return _mm256_loadu_ps(p);
    const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(g), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_ps(p, valid);
}

/* ---- 32-value block microtiles: nr = 1 row, or TILE32_R short rows side by side ---- */
#ifndef TILE32_R
#define TILE32_R 4
#endif
#define SHORT_ROW_BYTES 448 /* rows up to this long can be walked side by side (see above) */

/* Accumulator chains per (row, token): a lone row needs two (even and odd blocks) to hide the FMA
 * latency, several rows one. Two activation levels share a chain: their integer sums are combined
 * exactly (q1 * RESIDUAL_STEPS + q2, see quant.h) before the one float multiply. */
ALWAYS int chain32(const int nr, int p) { return nr == 1 ? p : 0; }

/* Block b of nr rows against nc tokens (L rows each): the integer sum sum(u * q) (L = 2: of both
 * levels combined), scaled by scale[j] = d_w * d_a of the row and token (L = 2: d_a of the residual
 * level), into acc[r][c][chain32(nr, p)]. The weight offset of the unsigned types is taken back in
 * integers (init). */
ALWAYS void block32(const int type, const uint8_t *w, int64_t ws, const uint8_t *a, int64_t as, int64_t ar,
                    int64_t nls_offset, int64_t b, const float *scale, const int nr, const int nc, const int L,
                    __m256 acc[][TILE_C][2], const int p) {
    __m256i u[TILE32_R];
    UNROLL for (int r = 0; r < nr; r++) u[r] = weights32(type, w + r * ws + b * block_bytes(type));
    const __m256i zero = _mm256_setzero_si256();
    UNROLL for (int c = 0; c < nc; c++) {
        __m256i qa[LEVELS];
        UNROLL for (int l = 0; l < L; l++) qa[l] = load256(a + c * as + l * ar + b * QK);
        /* -off * sum(q), per lane, in the units of the (combined) sum */
        __m256i init = zero;
        if (weight_offset(type))
            init = _mm256_slli_epi32(load256(a + c * as + nls_offset + 32 * b), offset_shift(type));
        UNROLL for (int r = 0; r < nr; r++) {
            __m256i isum;
            if (L == 2) {
                __m256i hi = signed_weights(type) ? dot4_signed(zero, u[r], qa[0]) : dot4_acc(zero, u[r], qa[0]);
                isum = signed_weights(type) ? dot4_signed(init, u[r], qa[1]) : dot4_acc(init, u[r], qa[1]);
                isum = _mm256_add_epi32(_mm256_slli_epi32(hi, RESIDUAL_SHIFT), isum);
            } else {
                isum = signed_weights(type) ? dot4_signed(init, u[r], qa[0]) : dot4_acc(init, u[r], qa[0]);
            }
            __m256 sc = _mm256_broadcast_ss(scale + 8 * (r * TILE_C + c));
            acc[r][c][chain32(nr, p)] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc[r][c][chain32(nr, p)]);
        }
    }
}

/* Blocks [b0, b0 + g) of the rows (g <= 8): the products d_w * d_a of the group are formed 8 at a
 * time and read back as broadcast operands, and the Q4_1/Q5_1 terms m * s take one FMA per group
 * and level. Called with g = 8 as a constant for all but the last group, so masks fold away. */
ALWAYS void group32(const int type, int64_t k, const uint8_t *w, int64_t ws, const uint8_t *a, int64_t as,
                    int64_t ar, int64_t b0, const int g, const int nr, const int nc, const int L,
                    __m256 acc[][TILE_C][2]) {
    const int64_t nb = k / QK, nls_offset = ember_act_q8_nls_offset(k);
    const int bs = block_bytes(type), last = chain32(nr, nr == 1);
    _Alignas(32) float scale[TILE32_R][TILE_C][8];
    UNROLL for (int r = 0; r < nr; r++) {
        __m256 mw, dw = block_scales8(bs, has_min(type), w + r * ws + b0 * bs, g, &mw);
        UNROLL for (int c = 0; c < nc; c++) {
            /* per level: d (nb,), then s (nb,) */
            const float *ad = (const float *)(a + c * as + k), *rd = (const float *)(a + c * as + ar + k);
            const __m256 sc = _mm256_mul_ps(dw, load_floats((L == 2 ? rd : ad) + b0, g));
            _mm256_store_ps(scale[r][c], sc);
            if (has_min(type)) {
                acc[r][c][last] = _mm256_fmadd_ps(mw, load_floats(ad + nb + b0, g), acc[r][c][last]);
                if (L == 2) acc[r][c][last] = _mm256_fmadd_ps(mw, load_floats(rd + nb + b0, g), acc[r][c][last]);
            }
        }
    }
    int j = 0;
    for (; j + 2 <= g; j += 2) { /* rolled: unrolled, GCC hoists every scale address into a register */
        block32(type, w, ws, a, as, ar, nls_offset, b0 + j, &scale[0][0][j], nr, nc, L, acc, 0);
        block32(type, w, ws, a, as, ar, nls_offset, b0 + j + 1, &scale[0][0][j + 1], nr, nc, L, acc, 1);
    }
    if (j < g) block32(type, w, ws, a, as, ar, nls_offset, b0 + j, &scale[0][0][j], nr, nc, L, acc, 0);
}

/* W rows (nr, k/32 blocks) x activation rows (nc, EMBER_ACT_Q8; L levels) -> y[c * ys + r] */
ALWAYS void tile32_body(const int type, int64_t k, const uint8_t *w, int64_t ws, const uint8_t *a, int64_t as,
                        int64_t ar, float *y, int64_t ys, const int nr, const int nc, const int L) {
    const int64_t nb = k / QK, chains = nr == 1 ? 2 : 1;
    __m256 acc[TILE32_R][TILE_C][2];
    UNROLL for (int r = 0; r < nr; r++) UNROLL for (int c = 0; c < nc; c++) UNROLL for (int h = 0; h < chains; h++)
        acc[r][c][h] = _mm256_setzero_ps();
    int64_t b0 = 0;
    for (; b0 + 8 <= nb; b0 += 8) group32(type, k, w, ws, a, as, ar, b0, 8, nr, nc, L, acc);
    if (b0 < nb) group32(type, k, w, ws, a, as, ar, b0, (int)(nb - b0), nr, nc, L, acc);
    UNROLL for (int c = 0; c < nc; c++) UNROLL for (int r = 0; r < nr; r++) {
        __m256 sum = acc[r][c][0];
        UNROLL for (int h = 1; h < chains; h++) sum = _mm256_add_ps(sum, acc[r][c][h]);
        y[c * ys + r] = hsum8(sum);
    }
}

/* nr is 1 or TILE32_R */
#define DEFINE_TILE32(fname, TYPE)                                                                           \
    static void fname(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, int64_t ar, float *y,  \
                      int64_t ys, int nr, int nc) {                                                          \
        if (nr == TILE32_R) TILE_DISPATCH(tile32_body, TYPE, TILE32_R);                                      \
        TILE_DISPATCH(tile32_body, TYPE, 1);                                                                 \
    }

DEFINE_TILE32(tile_q4_0, EMBER_T_Q4_0)
DEFINE_TILE32(tile_q4_1, EMBER_T_Q4_1)
DEFINE_TILE32(tile_q5_0, EMBER_T_Q5_0)
DEFINE_TILE32(tile_q5_1, EMBER_T_Q5_1)
DEFINE_TILE32(tile_q8_0, EMBER_T_Q8_0)
DEFINE_TILE32(tile_iq4_nl, EMBER_T_IQ4_NL)

/* ================= super-blocks with 32-value sub-blocks: Q4_K Q5_K IQ4_XS ================= */

/* pshufb pattern picking int16 element j of each 128-bit lane into all 8 of its slots */
ALWAYS __m256i pick16(int j) { return _mm256_set1_epi16((short)((2 * j) | (2 * j + 1) << 8)); }

/* One row's super-block: sub-block scales (int16, both lanes), mins as 16 int16 matching the bsums
 * (one per 16 values), and the float factors d and dmin. */
typedef struct {
    __m256i scales, mins16;
    __m256 d, dmin;
    const uint8_t *blk;
} ksuper32;

ALWAYS ksuper32 prepare_k32(int type, const uint8_t *p) {
    ksuper32 s;
    s.blk = p;
    if (type == EMBER_T_IQ4_XS) {
        const blk_iq4_xs *b = (const blk_iq4_xs *)p;
        int16_t ls[8];
        for (int ib = 0; ib < 8; ib++) ls[ib] = (int16_t)ember_iq4xs_scale(b, ib);
        s.scales = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)ls));
        s.mins16 = _mm256_setzero_si256();
        s.d = _mm256_set1_ps(f16_to_f32(b->d));
        s.dmin = _mm256_setzero_ps();
        return s;
    }
    const blk_q4_k *b = (const blk_q4_k *)p; /* Q5_K begins the same way */
    uint8_t sc[8], m[8];
    ember_q4k_scales(b->scales, sc, m);
    s.scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)sc)));
    __m128i mv = _mm_loadl_epi64((const __m128i *)m);
    s.mins16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mv, mv));
    s.d = _mm256_set1_ps(f16_to_f32(b->d));
    s.dmin = _mm256_set1_ps(f16_to_f32(b->dmin));
    return s;
}

/* The 32 weights of sub-block j as bytes: unsigned for Q4_K/Q5_K, signed levels for IQ4_XS. */
ALWAYS __m256i unpack_k32(int type, const uint8_t *p, int j) {
    if (type == EMBER_T_IQ4_XS) {
        const blk_iq4_xs *b = (const blk_iq4_xs *)p;
        return _mm256_shuffle_epi8(iq4nl_table(0), nibbles32(b->qs + 16 * j));
    }
    const uint8_t *qs = type == EMBER_T_Q5_K ? ((const blk_q5_k *)p)->qs : ((const blk_q4_k *)p)->qs;
    __m256i u = shift_mask(load256(qs + 32 * (j / 2)), (j & 1) ? -4 : 0, 0x0f);
    if (type == EMBER_T_Q5_K) u = _mm256_or_si256(u, shift_mask(load256(((const blk_q5_k *)p)->qh), 4 - j, 0x10));
    return u;
}

ALWAYS int k_block_bytes(int type) {
    switch (type) {
    case EMBER_T_Q2_K: return sizeof(blk_q2_k);
    case EMBER_T_Q3_K: return sizeof(blk_q3_k);
    case EMBER_T_Q4_K: return sizeof(blk_q4_k);
    case EMBER_T_Q5_K: return sizeof(blk_q5_k);
    case EMBER_T_Q6_K: return sizeof(blk_q6_k);
    default: return sizeof(blk_iq4_xs);
    }
}

/* The row's integer super-block sums sum_j scale_j * sum(u * q) go to iacc (int32 lanes; per token and
 * level, two chains: even and odd sub-blocks); at the end of each super-block they are scaled by
 * d * d_a of their level, and mins * bsums by dmin * d_a. */
ALWAYS void tilek32_body(const int type, int64_t k, const uint8_t *w, int64_t ws, const uint8_t *a, int64_t as,
                         int64_t ar, float *y, int64_t ys, const int nr, const int nc, const int L) {
    (void)ws, (void)nr;
    const int64_t nb = k / QK_K;
    __m256 acc[TILE_C][2];
    UNROLL for (int c = 0; c < nc; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const ksuper32 s = prepare_k32(type, w + b * k_block_bytes(type));
        __m256i iacc[TILE_C][LEVELS][2];
        UNROLL for (int c = 0; c < nc; c++) UNROLL for (int l = 0; l < L; l++)
            iacc[c][l][0] = iacc[c][l][1] = _mm256_setzero_si256();
        UNROLL for (int j = 0; j < 8; j++) {
            const __m256i u = unpack_k32(type, s.blk, j), sc = _mm256_shuffle_epi8(s.scales, pick16(j));
            UNROLL for (int c = 0; c < nc; c++) UNROLL for (int l = 0; l < L; l++) {
                __m256i qa = load256(a + c * as + l * ar + b * QK_K + 32 * j);
                __m256i p = type == EMBER_T_IQ4_XS ? pairs16(_mm256_abs_epi8(u), _mm256_sign_epi8(qa, u)) : pairs16(u, qa);
                iacc[c][l][j & 1] = dot2w_acc(iacc[c][l][j & 1], p, sc);
            }
        }
        UNROLL for (int c = 0; c < nc; c++) UNROLL for (int l = 0; l < L; l++) {
            const float *ad = (const float *)(a + c * as + l * ar + k);
            const int16_t *bsums = (const int16_t *)(ad + nb);
            __m256 da = _mm256_set1_ps(ad[b]);
            __m256i isum = _mm256_add_epi32(iacc[c][l][0], iacc[c][l][1]);
            acc[c][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(s.d, da), acc[c][0]);
            if (type != EMBER_T_IQ4_XS) {
                __m256 msum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s.mins16, load256(bsums + 16 * b)));
                acc[c][1] = _mm256_fnmadd_ps(msum, _mm256_mul_ps(s.dmin, da), acc[c][1]);
            }
        }
    }
    STORE_TILE(acc, y, ys, nc);
}

DEFINE_TILE(tile_q4_k, tilek32_body, EMBER_T_Q4_K)
DEFINE_TILE(tile_q5_k, tilek32_body, EMBER_T_Q5_K)
DEFINE_TILE(tile_iq4_xs, tilek32_body, EMBER_T_IQ4_XS)

/* ================= super-blocks with 16-value sub-blocks: Q2_K Q3_K Q6_K ================= */

/* pshufb pattern: element j of each lane's 8 int16 to the low lane, element j + 1 to the high lane */
ALWAYS __m256i pick16_pair(int j) {
    __m128i lo = _mm_set1_epi16((short)((2 * j) | (2 * j + 1) << 8));
    __m128i hi = _mm_set1_epi16((short)((2 * j + 2) | (2 * j + 3) << 8));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

typedef struct {
    __m256i sc_lo, sc_hi; /* scales 0..7 and 8..15 as int16, in both lanes */
    __m256i corr16;       /* Q3_K/Q6_K: -off * scales (16 int16, bsums order); Q2_K: the 16 mins */
    __m256 d, dmin;
    const uint8_t *blk;
} ksuper16;

ALWAYS ksuper16 prepare_k16(int type, const uint8_t *p) {
    ksuper16 s;
    __m256i sc16;
    s.blk = p;
    s.dmin = _mm256_setzero_ps();
    if (type == EMBER_T_Q2_K) {
        const blk_q2_k *b = (const blk_q2_k *)p;
        __m128i v = _mm_loadu_si128((const __m128i *)b->scales);
        sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(v, _mm_set1_epi8(0x0f)));
        s.corr16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f)));
        s.d = _mm256_set1_ps(f16_to_f32(b->d));
        s.dmin = _mm256_set1_ps(f16_to_f32(b->dmin));
    } else {
        int8_t sc[16];
        const int8_t *scp = sc;
        if (type == EMBER_T_Q3_K) {
            ember_q3k_scales(((const blk_q3_k *)p)->scales, sc);
            s.d = _mm256_set1_ps(f16_to_f32(((const blk_q3_k *)p)->d));
        } else {
            scp = ((const blk_q6_k *)p)->scales;
            s.d = _mm256_set1_ps(f16_to_f32(((const blk_q6_k *)p)->d));
        }
        sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scp));
        s.corr16 = _mm256_mullo_epi16(sc16, _mm256_set1_epi16(type == EMBER_T_Q3_K ? -4 : -32));
    }
    s.sc_lo = _mm256_permute2x128_si256(sc16, sc16, 0x00);
    s.sc_hi = _mm256_permute2x128_si256(sc16, sc16, 0x11);
    return s;
}

/* The 32 weights 32j .. 32j + 31 (j = 4h + s) as unsigned bytes. */
ALWAYS __m256i unpack_k16(int type, const uint8_t *p, int j) {
    const int h = j / 4, s = j % 4;
    if (type == EMBER_T_Q2_K) return shift_mask(load256(((const blk_q2_k *)p)->qs + 32 * h), -2 * s, 0x03);
    if (type == EMBER_T_Q3_K) {
        const blk_q3_k *b = (const blk_q3_k *)p;
        __m256i lo = shift_mask(load256(b->qs + 32 * h), -2 * s, 0x03);
        return _mm256_or_si256(lo, shift_mask(load256(b->hmask), 2 - j, 0x04));
    }
    const blk_q6_k *b = (const blk_q6_k *)p;
    __m256i lo = shift_mask(load256(b->ql + 64 * h + 32 * (s & 1)), s >= 2 ? -4 : 0, 0x0f);
    return _mm256_or_si256(lo, shift_mask(load256(b->qh + 32 * h), 4 - 2 * s, 0x30));
}

/* Q3_K and Q6_K take their offset back from the bsums, in lanes other than those of the products: a
 * lane's integer sum is exact but carries the offset (u = w + off), and only the total of the lanes
 * sheds it, after the float scaling (rounding relative to the biased sums: ~1e-7, far below that of
 * the activations; folding the lanes in integers first cost 14% here). */
ALWAYS void tilek16_body(const int type, int64_t k, const uint8_t *w, int64_t ws, const uint8_t *a, int64_t as,
                         int64_t ar, float *y, int64_t ys, const int nr, const int nc, const int L) {
    (void)ws, (void)nr;
    const int64_t nb = k / QK_K;
    __m256 acc[TILE_C][2];
    UNROLL for (int c = 0; c < nc; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const ksuper16 s = prepare_k16(type, w + b * k_block_bytes(type));
        __m256i iacc[TILE_C][LEVELS][2];
        UNROLL for (int c = 0; c < nc; c++) UNROLL for (int l = 0; l < L; l++)
            iacc[c][l][0] = iacc[c][l][1] = _mm256_setzero_si256();
        UNROLL for (int j = 0; j < 8; j++) {
            const __m256i u = unpack_k16(type, s.blk, j);
            const __m256i sc = _mm256_shuffle_epi8(j < 4 ? s.sc_lo : s.sc_hi, pick16_pair(2 * (j % 4)));
            UNROLL for (int c = 0; c < nc; c++) UNROLL for (int l = 0; l < L; l++) {
                __m256i qa = load256(a + c * as + l * ar + b * QK_K + 32 * j);
                iacc[c][l][j & 1] = dot2w_acc(iacc[c][l][j & 1], pairs16(u, qa), sc);
            }
        }
        UNROLL for (int c = 0; c < nc; c++) UNROLL for (int l = 0; l < L; l++) {
            const float *ad = (const float *)(a + c * as + l * ar + k);
            const int16_t *bsums = (const int16_t *)(ad + nb);
            __m256 da = _mm256_set1_ps(ad[b]);
            __m256i bs = load256(bsums + 16 * b), isum = _mm256_add_epi32(iacc[c][l][0], iacc[c][l][1]);
            if (type == EMBER_T_Q2_K) {
                __m256 msum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s.corr16, bs));
                acc[c][1] = _mm256_fnmadd_ps(msum, _mm256_mul_ps(s.dmin, da), acc[c][1]);
            } else {
                isum = dot2w_acc(isum, s.corr16, bs);
            }
            acc[c][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(s.d, da), acc[c][0]);
        }
    }
    STORE_TILE(acc, y, ys, nc);
}

DEFINE_TILE(tile_q2_k, tilek16_body, EMBER_T_Q2_K)
DEFINE_TILE(tile_q3_k, tilek16_body, EMBER_T_Q3_K)
DEFINE_TILE(tile_q6_k, tilek16_body, EMBER_T_Q6_K)

/* ================= float weights (F32 F16 BF16) with f32 activations ================= */

ALWAYS __m256 load_w8(int type, const uint8_t *row, int64_t i) {
    if (type == EMBER_T_F32) return _mm256_loadu_ps((const float *)row + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
    if (type == EMBER_T_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

ALWAYS float load_w1(int type, const uint8_t *row, int64_t i) {
    if (type == EMBER_T_F32) return ((const float *)row)[i];
    uint16_t h = ((const uint16_t *)row)[i];
    return type == EMBER_T_F16 ? f16_to_f32(h) : ember_bf16_to_f32(h);
}

ALWAYS void tilef_body(const int type, int64_t k, const uint8_t *w, int64_t ws, const uint8_t *a, int64_t as,
                       int64_t ar, float *y, int64_t ys, const int nr, const int nc, const int L) {
    (void)ws, (void)ar, (void)nr, (void)L;
    __m256 acc[TILE_C][2];
    UNROLL for (int c = 0; c < nc; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
        const __m256 w0 = load_w8(type, w, i), w1 = load_w8(type, w, i + 8);
        UNROLL for (int c = 0; c < nc; c++) {
            const float *x = (const float *)(a + c * as) + i;
            acc[c][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc[c][0]);
            acc[c][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), acc[c][1]);
        }
    }
    STORE_TILE(acc, y, ys, nc);
    for (; i < k; i++) /* the last k % 16 values */
        for (int c = 0; c < nc; c++) y[c * ys] += load_w1(type, w, i) * ((const float *)(a + c * as))[i];
}

/* Float weights take x itself: one level. */
#define DEFINE_TILE_F(fname, TYPE)                                                                          \
    static void fname(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, int64_t ar, float *y, \
                      int64_t ys, int nr, int nc) {                                                         \
        (void)nr;                                                                                           \
        ar = 0;                                                                                             \
        TILE_DISPATCH(tilef_body, TYPE, 1);                                                                 \
    }

DEFINE_TILE_F(tile_f32, EMBER_T_F32)
DEFINE_TILE_F(tile_f16, EMBER_T_F16)
DEFINE_TILE_F(tile_bf16, EMBER_T_BF16)

/* ================= the table entries (the includer defines the table) ================= */

#define T32(name) {tile_##name, TILE32_R, TILE_C, SHORT_ROW_BYTES}
#ifdef X86_ROW_Q8_0_C16
/* The includer's kernel for one Q8_0 row against one token's c16 = 256 q1 + q2 (quant.h) -> *y. */
static void row_q8_0_c16(int64_t k, const uint8_t *w, const uint8_t *a, int64_t ar, float *y);

/* Lone rows with two levels (output heads at one token) take row_q8_0_c16; the rest (short rows side
 * by side, one level) the shared tile. */
static void tile_q8_0_c16(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, int64_t ar, float *y,
                          int64_t ys, int nr, int nc) {
    if (nr != 1 || !ar) {
        tile_q8_0(k, w, ws, a, as, ar, y, ys, nr, nc);
        return;
    }
    for (int c = 0; c < nc; c++) row_q8_0_c16(k, w, (const uint8_t *)a + c * as, ar, y + c * ys);
}
#define X86_TILE_Q8_0 tile_q8_0_c16
#else
#define X86_TILE_Q8_0 tile_q8_0
#endif
#define TK(name) {tile_##name, 1, TILE_C, 0}
#define TF(name) {tile_##name, 1, TILE_C, 0}

#define X86_QUANTIZE_AND_TILES                                                                                 \
    .quantize = {[EMBER_ACT_Q8] = quantize_q8, [EMBER_ACT_Q8K16] = quantize_q8k16,                            \
                 [EMBER_ACT_Q8K32] = quantize_q8k32},                                                         \
    .tile = {                                                                                                   \
        [EMBER_T_Q4_0] = T32(q4_0), [EMBER_T_Q4_1] = T32(q4_1), [EMBER_T_Q5_0] = T32(q5_0),                    \
        [EMBER_T_Q5_1] = T32(q5_1), [EMBER_T_IQ4_NL] = T32(iq4_nl),                                              \
        [EMBER_T_Q8_0] = {X86_TILE_Q8_0, TILE32_R, TILE_C, SHORT_ROW_BYTES},                                    \
        [EMBER_T_Q2_K] = TK(q2_k), [EMBER_T_Q3_K] = TK(q3_k), [EMBER_T_Q4_K] = TK(q4_k),                       \
        [EMBER_T_Q5_K] = TK(q5_k), [EMBER_T_Q6_K] = TK(q6_k), [EMBER_T_IQ4_XS] = TK(iq4_xs),                   \
        [EMBER_T_F32] = TF(f32), [EMBER_T_F16] = TF(f16), [EMBER_T_BF16] = TF(bf16),                           \
    }
