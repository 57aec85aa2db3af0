/* Body of the x86 kernels, compiled twice: by quant_avx2.c and by quant_avx512.c (with 256-bit VNNI).
 * The includer enables its instruction set, then defines:
 *   dot2w_acc(acc, a, b)      acc + per int32 lane, the sum of 2 products i16 * i16
 *   dot_u8_s8(u, s)           per int32 lane of 8, the sum of 4 products of the unsigned bytes u with the
 *                             signed bytes s (|u| <= 128, |s| <= 127: no saturation)
 *   dot_u8_s8_acc(acc, u, s)  acc + dot_u8_s8(u, s)
 *   dot_w8_c16(w, c)          per int32 lane of 8, the sum of 4 products of the signed bytes w (32)
 *                             widened to int16 with the int16 c[0..32) (lane j: values 4j .. 4j + 3, or
 *                             any other grouping: only the total of the lanes counts)
 *   q5_high_bits(qh)          32 bytes: 0x10 where bit i of qh is set, else 0
 *   block_scales8(bs, mn, p, g, &m)   the f16 d (and m when mn) that start each of g <= 8 blocks of
 *                             bs bytes at p, as floats (lanes past g: 0)
 *
 * Every kernel computes, per block, exactly the integer sums of quant_scalar.c and multiplies them by
 * the same float factors; only the order of the float additions differs. */

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
    /* the 16 bytes in both halves (a load), the high half shifted by 4: no lane insert */
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)), bytes(0x0f));
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

/* Pairs of u8 * s8 summed into int16 (|u| <= 128 and |s| <= 127 cannot saturate). */
ALWAYS __m256i pairs16(__m256i u, __m256i s) { return _mm256_maddubs_epi16(u, s); }

/* ---- activation quantizers (the same arithmetic as quant_scalar.c, so the same bytes) ---- */

/* max |x| over `count` vectors of 8 */
ALWAYS float absmax(const float *x, int count) {
    __m256 m = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < count; i++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 values times f -> 32 int8 at q, rounded to even (like nearbyintf) and saturated to [-128, 127];
 * returns them. */
ALWAYS __m256i round32(const float *x, __m256 f, int8_t *q) {
    __m256i i[4];
    for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), f));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
    return p;
}

/* Per int32 lane, the sum of 4 consecutive int8 of q. */
ALWAYS __m256i sums4(__m256i q) { return _mm256_madd_epi16(_mm256_maddubs_epi16(bytes(1), q), _mm256_set1_epi16(1)); }

ALWAYS float f16_round(float v) { return _cvtsh_ss(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT)); }

/* x (k,) -> EMBER_ACT_Q16 row: c (k,) | d (k/32,) | s (k/32,), with `top` steps up to amax: 32767 (exact),
 * or 127 with f16 scales (llama.cpp's Q8_0 / Q8_1), then also q (k,) int8 and qsum (k/32,) int32 */
ALWAYS void quantize_q16_steps(const float *x, void *dst, int64_t k, const int top) {
    int16_t *c = dst;
    float *d = (float *)(c + k), *s = d + k / QK;
    int8_t *q = (int8_t *)dst + ember_q16_q8_offset(k);
    int32_t *qsum = (int32_t *)((uint8_t *)dst + ember_q16_qsum_offset(k));
    for (int64_t b = 0; b < k / QK; b++, x += QK, c += QK, q += QK) {
        const float amax = absmax(x, 4);
        const __m256 f = _mm256_set1_ps(amax != 0.0f ? (float)top / amax : 0.0f);
        __m256i i[4];
        for (int j = 0; j < 4; j++) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), f));
        for (int j = 0; j < 4; j += 2) /* packs interleaves the 128-bit halves; the permute undoes it */
            _mm256_storeu_si256((__m256i *)(c + 8 * j),
                                _mm256_permute4x64_epi64(_mm256_packs_epi32(i[j], i[j + 1]), 0xd8));
        if (top == 127) {
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
            _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
        const int sum = hsum8i(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
        if (top == 127) qsum[b] = sum;
        const float step = amax / (float)top;
        d[b] = top == 127 ? f16_round(step) : step;
        s[b] = top == 127 ? f16_round(step * (float)sum) : d[b] * (float)sum;
    }
}

static void quantize_q16(const float *x, void *dst, int64_t k) { quantize_q16_steps(x, dst, k, 32767); }

static void quantize_q16_llama(const float *x, void *dst, int64_t k) { quantize_q16_steps(x, dst, k, 127); }

/* The first value of largest magnitude amax among x (n,), for Q8_K's sign: the larger of max(x) and
 * -min(x), or on a tie between them the one that comes first. */
ALWAYS float signed_peak(const float *x, int n, float amax) {
    __m256 hi = _mm256_loadu_ps(x), lo = hi;
    for (int i = 8; i < n; i += 8) {
        hi = _mm256_max_ps(hi, _mm256_loadu_ps(x + i));
        lo = _mm256_min_ps(lo, _mm256_loadu_ps(x + i));
    }
    float h[8], l[8];
    _mm256_storeu_ps(h, hi);
    _mm256_storeu_ps(l, lo);
    float top = h[0], bottom = l[0];
    for (int j = 1; j < 8; j++) top = h[j] > top ? h[j] : top, bottom = l[j] < bottom ? l[j] : bottom;
    if (top != -bottom) return top == amax ? top : bottom;
    for (int i = 0; i < n; i++)
        if (x[i] == amax || x[i] == -amax) return x[i];
    return top;
}

/* x (k,) -> EMBER_ACT_Q8K row: q (k,) | d (k/256,) | bsums (k/16,) | the panels' sums */
static void quantize_q8k(const float *x, void *dst, int64_t k) {
    int8_t *q = dst;
    float *d = (float *)(q + k);
    int16_t *bsums = (int16_t *)(d + k / QK_K);
    for (int64_t b = 0; b < k / QK_K; b++, x += QK_K, q += QK_K) {
        const float amax = absmax(x, QK_K / 8);
        const float iscale = amax != 0.0f ? -127.0f / signed_peak(x, QK_K, amax) : 0.0f;
        __m256i s[8];
        for (int j = 0; j < 8; j++) s[j] = sums4(round32(x + 32 * j, _mm256_set1_ps(iscale), q + 32 * j));
        /* lanes 0-3 of s[j] sum values 32j .. 32j + 15, lanes 4-7 the next 16 */
        for (int j = 0; j < 8; j += 4) {
            __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(s[j], s[j + 1]), _mm256_hadd_epi32(s[j + 2], s[j + 3]));
            __m128i lo = _mm256_castsi256_si128(h), hi = _mm256_extracti128_si256(h, 1);
            __m128i sums = _mm_packs_epi32(_mm_unpacklo_epi32(lo, hi), _mm_unpackhi_epi32(lo, hi));
            _mm_storeu_si128((__m128i *)(bsums + 16 * b + 2 * j), sums);
        }
        d[b] = amax != 0.0f ? 1.0f / iscale : 0.0f;
    }
    ember_q8k_sums(dst, k);
}

/* Decode products stream each thread's rows front to back; on the Xeon the CI runs on, the hardware
 * prefetchers alone keep a 2-thread decode far below the read bandwidth (llama-1b 14.7 tok/s, gemma2-2b
 * 7.5). Each super-block asks for the lines 2 KB ahead: with the weights on huge pages, 27.7 / 16.8
 * at 1 KB, 29.1 / 17.7 at 2 KB, 29.7 / 17.9 at 3 KB, 26.4 / 16.1 at 4 KB (bench/NOTES.md). The 32-value
 * types ask per group of 8 blocks of each row, PF32_BYTES ahead (with int8 activations, SmolLM2 / Gemma 3
 * tg: none 136 / -, 2 KB 188 / 89, 4 KB 204-217 / 95, 6 KB 209-212 / 92 tok/s). */
#define PF_BYTES 2048
#define PF32_BYTES 4096
#define PF32_ROW_BYTES 1024

/* How far ahead a microtile of the 32-value types prefetches: PF32_BYTES where short rows go side by
 * side, PF32_ROW_BYTES along a lone row (Q5_0 Q5_1 Q8_0 IQ4_NL MXFP4; Q4_0 / Q4_1 keep PF32_BYTES). */
ALWAYS int64_t pf32_bytes(int type, int nr) {
    return nr == 1 && type != EMBER_T_Q4_0 && type != EMBER_T_Q4_1 ? PF32_ROW_BYTES : PF32_BYTES;
}

ALWAYS void prefetch_ahead(const uint8_t *p, int lines) {
    for (int l = 0; l < lines; l++) __builtin_prefetch(p + PF_BYTES + 64 * l);
}

/* ---- microtiles: W rows x up to TILE_C activation rows ----
 * Mostly one row, walked from start to end: rows walked side by side defeat the hardware
 * prefetchers once rows pass ~450 bytes (measured here: one core streams 26 GB/s along one row,
 * 8-11 GB/s along 2-4 rows of 550+ bytes in lockstep). Short rows of the 32-value types go 4 at a
 * time, which shares each activation load (about 25% faster there). Each weight block is reused
 * across the tile's activation rows (tokens); a lone row keeps two accumulators per token (even and
 * odd blocks) so that the FMA latency hides. */

/* y[c * ys] = sum of the lanes of acc[c][0] + acc[c][1] */
#define STORE_TILE(acc, y, ys, nc) \
    UNROLL for (int c_ = 0; c_ < (nc); c_++) (y)[c_ * (ys)] = hsum8(_mm256_add_ps((acc)[c_][0], (acc)[c_][1]))

#define TILE_C 4 /* activation rows (tokens) of a tile */

/* Calls BODY specialized for the run-time nc. Every body takes (type, k, w, ws, a, as, y, ys, nr, nc). */
#define TILE_DISPATCH(BODY, TYPE, NR)                                         \
    do {                                                                      \
        switch (nc) {                                                         \
        case 1: BODY(TYPE, k, w, ws, a, as, y, ys, NR, 1); return;            \
        case 2: BODY(TYPE, k, w, ws, a, as, y, ys, NR, 2); return;            \
        case 3: BODY(TYPE, k, w, ws, a, as, y, ys, NR, 3); return;            \
        default: BODY(TYPE, k, w, ws, a, as, y, ys, NR, 4); return;           \
        }                                                                     \
    } while (0)

/* A tile function over one W row for BODY. */
#define DEFINE_TILE(fname, BODY, TYPE)                                                                        \
    __attribute__((unused)) static void fname(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, float *y, int64_t ys, \
                      int nr, int nc) {                                                                       \
        (void)nr;                                                                                             \
        TILE_DISPATCH(BODY, TYPE, 1);                                                                         \
    }

/* ================= 32-value blocks: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL MXFP4 ================= */

ALWAYS int has_min(int type) { return type == EMBER_T_Q4_1 || type == EMBER_T_Q5_1; }

ALWAYS int block_bytes(int type) {
    switch (type) {
    case EMBER_T_Q4_0: return sizeof(blk_q4_0);
    case EMBER_T_Q4_1: return sizeof(blk_q4_1);
    case EMBER_T_Q5_0: return sizeof(blk_q5_0);
    case EMBER_T_Q5_1: return sizeof(blk_q5_1);
    case EMBER_T_Q8_0: return sizeof(blk_q8_0);
    case EMBER_T_MXFP4: return sizeof(blk_mxfp4);
    default: return sizeof(blk_iq4_nl);
    }
}

/* IQ4_NL levels as a pshufb table (signed bytes) */
ALWAYS __m256i iq4nl_table(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)ember_iq4nl_values));
}

/* MXFP4's doubled E2M1 values as a pshufb table */
ALWAYS __m256i mxfp4_table(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)ember_mxfp4_values));
}

/* Half the E8M0 scales of g <= 8 consecutive MXFP4 blocks at p (17 bytes each: no f16 field to gather),
 * lanes past g 0. */
ALWAYS __m256 mxfp4_scales8(const uint8_t *p, int g) {
    _Alignas(32) float d[8] = {0};
    for (int i = 0; i < g; i++) d[i] = ember_e8m0_half(p[i * sizeof(blk_mxfp4)]);
    return _mm256_load_ps(d);
}

ALWAYS uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

ALWAYS uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The 32 weights of a block as signed bytes (Q4_0 and Q5_0 less their offsets 8 and 16). */
ALWAYS __m256i weights32(int type, const uint8_t *p) {
    switch (type) {
    case EMBER_T_Q4_0: return _mm256_sub_epi8(nibbles32(((const blk_q4_0 *)p)->qs), bytes(8));
    case EMBER_T_Q4_1: return nibbles32(((const blk_q4_1 *)p)->qs);
    case EMBER_T_Q5_0: {
        const blk_q5_0 *b = (const blk_q5_0 *)p;
        return _mm256_sub_epi8(_mm256_or_si256(nibbles32(b->qs), q5_high_bits(load_u32(b->qh))), bytes(16));
    }
    case EMBER_T_Q5_1: {
        const blk_q5_1 *b = (const blk_q5_1 *)p;
        return _mm256_or_si256(nibbles32(b->qs), q5_high_bits(load_u32(b->qh)));
    }
    case EMBER_T_Q8_0: return load256(((const blk_q8_0 *)p)->qs);
    case EMBER_T_MXFP4: return _mm256_shuffle_epi8(mxfp4_table(), nibbles32(((const blk_mxfp4 *)p)->qs));
    default: return _mm256_shuffle_epi8(iq4nl_table(), nibbles32(((const blk_iq4_nl *)p)->qs));
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
 * latency, several rows one. */
ALWAYS int chain32(const int nr, int p) { return nr == 1 ? p : 0; }

/* Q4_0 and Q5_0 against int8 activations: their unsigned values u = w + offset (the nibbles as stored),
 * the offset taken back once per block and token for all the tile's rows (-offset * sum(q), the
 * starting value of the rows' integer sums); 0 for the other types. */
ALWAYS int u8_offset(int type) { return type == EMBER_T_Q4_0 ? 8 : type == EMBER_T_Q5_0 ? 16 : 0; }

/* The 32 weights of a block as bytes that dpbusd can take unsigned: u8_offset's u, the raw values of
 * the types with a min, else weights32's signed ones (whose signs then go to the activations). */
ALWAYS __m256i weights32_i8(int type, const uint8_t *p) {
    if (type == EMBER_T_Q4_0) return nibbles32(((const blk_q4_0 *)p)->qs);
    if (type == EMBER_T_Q5_0) {
        const blk_q5_0 *b = (const blk_q5_0 *)p;
        return _mm256_or_si256(nibbles32(b->qs), q5_high_bits(load_u32(b->qh)));
    }
    return weights32(type, p);
}

/* Per int32 lane, base plus the sum of 4 products of the weights w (weights32_i8) with the int8
 * activations q; aw: the magnitudes of signed weights (their signs go to q). */
ALWAYS __m256i dot_w8_q8(int type, __m256i base, __m256i w, __m256i aw, __m256i q) {
    if (has_min(type) || u8_offset(type)) return dot_u8_s8_acc(base, w, q);
    return dot_u8_s8_acc(base, aw, _mm256_sign_epi8(q, w));
}

/* How a microtile takes the activations (its i8 argument): their int16 values c against the weights
 * as signed bytes widened by dot_w8_c16, their int8 values q (rows rounded as llama.cpp), or c against
 * Q4_0 / Q4_1 nibbles zero-extended to 16-bit words (one widening load per block, the high nibbles a
 * shift away) in 256-bit multiply-adds: SmolLM2's exact Q4_1 decode products were bound by vector
 * instructions, and on AVX-512 dot_w8_c16's 512-bit ones close a vector port to the whole loop on
 * Intel cores (bench/NOTES.md). */
enum { ACT_C16 = 0, ACT_Q8 = 1, ACT_W16 = 2 };

/* A Q4_0 / Q4_1 block's weights as 16-bit words: values 0-15 in lo, 16-31 in hi (Q4_0 less its 8) */
ALWAYS void nibble_words(int type, const uint8_t *blk, __m256i *lo, __m256i *hi) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(blk + block_bytes(type) - 16)));
    const __m256i off = _mm256_set1_epi16(type == EMBER_T_Q4_0 ? 8 : 0);
    *lo = _mm256_sub_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x0f)), off);
    *hi = _mm256_sub_epi16(_mm256_srli_epi16(v, 4), off);
}

/* Block b of nr rows against nc tokens: the integer sum of w * c scaled by scale[j] = d_w * d_a of the
 * row and token, into acc[r][c][chain32(nr, p)]. i8 (ACT_*): how the tokens' values are taken; their
 * int8 values q start q8 bytes into each row. */
ALWAYS void block32(const int type, const int i8, const uint8_t *w, int64_t ws, const uint8_t *a, int64_t as,
                    int64_t q8, int64_t b, const float *scale, const int nr, const int nc, __m256 acc[][TILE_C][2],
                    const int p) {
    __m256i u[TILE32_R], au[TILE32_R], wl[TILE32_R], wh[TILE32_R];
    UNROLL for (int r = 0; r < nr; r++) {
        const uint8_t *blk = w + r * ws + b * block_bytes(type);
        if (i8 == ACT_W16) {
            nibble_words(type, blk, &wl[r], &wh[r]);
        } else {
            u[r] = i8 == ACT_Q8 ? weights32_i8(type, blk) : weights32(type, blk);
            au[r] = i8 == ACT_Q8 && !has_min(type) && !u8_offset(type) ? _mm256_abs_epi8(u[r]) : u[r];
        }
    }
    UNROLL for (int c = 0; c < nc; c++) {
        const int16_t *ca = (const int16_t *)(a + c * as) + b * QK;
        const __m256i qa = i8 == ACT_Q8 ? load256(a + c * as + q8 + b * QK) : _mm256_setzero_si256();
        const __m256i base = i8 == ACT_Q8 && u8_offset(type)
                                 ? _mm256_sub_epi32(_mm256_setzero_si256(), dot_u8_s8(bytes(u8_offset(type)), qa))
                                 : _mm256_setzero_si256();
        UNROLL for (int r = 0; r < nr; r++) {
            __m256 sc = _mm256_broadcast_ss(scale + 8 * (r * TILE_C + c));
            __m256i dot = i8 == ACT_W16   ? dot2w_acc(_mm256_madd_epi16(wl[r], load256(ca)), wh[r], load256(ca + 16))
                          : i8 == ACT_Q8  ? dot_w8_q8(type, base, u[r], au[r], qa)
                                          : dot_w8_c16(u[r], ca);
            acc[r][c][chain32(nr, p)] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc, acc[r][c][chain32(nr, p)]);
        }
    }
}

/* Blocks [b0, b0 + g) of the rows (g <= 8): the products d_w * d_a of the group are formed 8 at a
 * time and read back as broadcast operands; the Q4_1/Q5_1 terms m * s take one FMA per group. Called
 * with g = 8 as a constant for all but the last group, so masks fold away. */
ALWAYS void group32(const int type, const int i8, int64_t k, const uint8_t *w, int64_t ws, const uint8_t *a,
                    int64_t as, int64_t b0, const int g, const int nr, const int nc, __m256 acc[][TILE_C][2]) {
    const int64_t q8 = ember_q16_q8_offset(k);
    const int64_t nb = k / QK;
    const int bs = block_bytes(type), last = chain32(nr, nr == 1);
    _Alignas(32) float scale[TILE32_R][TILE_C][8];
    UNROLL for (int r = 0; r < nr; r++) prefetch_ahead(w + r * ws + b0 * bs + (pf32_bytes(type, nr) - PF_BYTES), g * bs / 64 + 1);
    UNROLL for (int r = 0; r < nr; r++) {
        __m256 mw, dw = type == EMBER_T_MXFP4 ? mxfp4_scales8(w + r * ws + b0 * bs, g)
                                              : block_scales8(bs, has_min(type), w + r * ws + b0 * bs, g, &mw);
        UNROLL for (int c = 0; c < nc; c++) {
            const float *ad = (const float *)(a + c * as + ember_q16_d_offset(k)); /* d (nb,), s (nb,) */
            _mm256_store_ps(scale[r][c], _mm256_mul_ps(dw, load_floats(ad + b0, g)));
            if (has_min(type)) acc[r][c][last] = _mm256_fmadd_ps(mw, load_floats(ad + nb + b0, g), acc[r][c][last]);
        }
    }
    int j = 0;
    for (; j + 2 <= g; j += 2) { /* rolled: unrolled, GCC hoists every scale address into a register */
        block32(type, i8, w, ws, a, as, q8, b0 + j, &scale[0][0][j], nr, nc, acc, 0);
        block32(type, i8, w, ws, a, as, q8, b0 + j + 1, &scale[0][0][j + 1], nr, nc, acc, 1);
    }
    if (j < g) block32(type, i8, w, ws, a, as, q8, b0 + j, &scale[0][0][j], nr, nc, acc, 0);
}

#ifndef X86_Q8_0_ROW /* an includer with a wider kernel for lone Q8_0 rows defines it and X86_Q8_0_ROWS */
#define X86_Q8_0_ROW q8_0_row_q8
#define X86_Q8_0_ROWS rows_q8_0_8

/* Block b of a Q8_0 row against one token's int8 activations, scaled by d_w * d_a (a broadcast scalar) into f. */
ALWAYS __m256 q8_0_block_q8(const uint8_t *w, const uint8_t *a, int64_t q8, const float *ad, int64_t b, __m256 f) {
    const uint8_t *p = w + b * sizeof(blk_q8_0);
    const __m256i wq = load256(p + 2);
    const __m256i dot = dot_w8_q8(EMBER_T_Q8_0, _mm256_setzero_si256(), wq, _mm256_abs_epi8(wq), load256(a + q8 + b * QK));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(f16_to_f32(load_u16(p)) * ad[b]), f);
}

/* One Q8_0 row against one token's int8 activations: two blocks a step (two sums), the row's lines
 * asked for PF32_ROW_BYTES ahead at its start. */
ALWAYS void q8_0_row_q8(int64_t k, const uint8_t *w, const uint8_t *a, float *y) {
    const int64_t nb = k / QK, q8 = ember_q16_q8_offset(k);
    const float *ad = (const float *)(a + ember_q16_d_offset(k));
    for (int64_t o = 0; o < nb * (int64_t)sizeof(blk_q8_0); o += 64) __builtin_prefetch(w + PF32_ROW_BYTES + o);
    __m256 f0 = _mm256_setzero_ps(), f1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        f0 = q8_0_block_q8(w, a, q8, ad, b, f0);
        f1 = q8_0_block_q8(w, a, q8, ad, b + 1, f1);
    }
    if (b < nb) f0 = q8_0_block_q8(w, a, q8, ad, b, f0);
    *y = hsum8(_mm256_add_ps(f0, f1));
}

static void rows_q8_0_8(int64_t k, const void *w, int64_t ws, const void *a, float *y, int64_t n_rows) {
    ROWS_IN_STREAMS(n_rows, r, q8_0_row_q8(k, (const uint8_t *)w + r * ws, a, y + r));
}
#endif

#ifndef X86_Q5_0_ROWS /* an includer with a wider kernel for lone Q5_0 rows defines it */
#define X86_Q5_0_ROWS rows_q5_0_8

/* Blocks a Q5_0 run forms its activation terms for once (rows up to 8192 values). */
#define ROW_BASE_BLOCKS 256

/* -16 * (the sums of 4 consecutive q) of block b of a token's int8 activations: where a Q5_0 block's
 * integer sum over its stored values u = w + 16 starts. */
ALWAYS __m256i q5_0_base(const uint8_t *a, int64_t q8, int64_t b) {
    return _mm256_sub_epi32(_mm256_setzero_si256(), dot_u8_s8(bytes(16), load256(a + q8 + b * QK)));
}

/* Block b of a Q5_0 row against one token, from the integer start base, scaled by d_w * d_a into f. */
ALWAYS __m256 q5_0_block_q8(const uint8_t *w, const uint8_t *a, int64_t q8, const float *ad, int64_t b,
                            __m256i base, __m256 f) {
    const blk_q5_0 *x = (const blk_q5_0 *)(w + b * sizeof(blk_q5_0));
    const __m256i u = _mm256_or_si256(nibbles32(x->qs), q5_high_bits(load_u32(x->qh)));
    const __m256i dot = dot_u8_s8_acc(base, u, load256(a + q8 + b * QK));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(f16_to_f32(x->d) * ad[b]), f);
}

/* One Q5_0 row against one token's int8 activations, as q8_0_row_q8: two blocks a step, d_w * d_a as a
 * broadcast scalar, the row's lines asked for PF_BYTES ahead at its start (Gemma 3's 440-byte rows, 2
 * threads: 1 KB and 4 KB ahead ~5% slower, as are 4 such rows side by side); base: the blocks'
 * q5_0_base, or NULL to form them here. */
ALWAYS void q5_0_row_q8(int64_t k, const uint8_t *w, const uint8_t *a, const __m256i *base, float *y) {
    const int64_t nb = k / QK, q8 = ember_q16_q8_offset(k);
    const float *ad = (const float *)(a + ember_q16_d_offset(k));
    for (int64_t o = 0; o < nb * (int64_t)sizeof(blk_q5_0); o += 64) __builtin_prefetch(w + PF_BYTES + o);
    __m256 f0 = _mm256_setzero_ps(), f1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        f0 = q5_0_block_q8(w, a, q8, ad, b, base ? base[b] : q5_0_base(a, q8, b), f0);
        f1 = q5_0_block_q8(w, a, q8, ad, b + 1, base ? base[b + 1] : q5_0_base(a, q8, b + 1), f1);
    }
    if (b < nb) f0 = q5_0_block_q8(w, a, q8, ad, b, base ? base[b] : q5_0_base(a, q8, b), f0);
    *y = hsum8(_mm256_add_ps(f0, f1));
}

static void rows_q5_0_8(int64_t k, const void *w, int64_t ws, const void *a, float *y, int64_t n_rows) {
    const int64_t nb = k / QK, q8 = ember_q16_q8_offset(k);
    __m256i base[ROW_BASE_BLOCKS];
    const int keep = nb <= ROW_BASE_BLOCKS;
    if (keep)
        for (int64_t b = 0; b < nb; b++) base[b] = q5_0_base(a, q8, b);
    ROWS_IN_STREAMS(n_rows, r, q5_0_row_q8(k, (const uint8_t *)w + r * ws, a, keep ? base : NULL, y + r));
}
#endif

/* W rows (nr, k/32 blocks) x activation rows (nc, EMBER_ACT_Q16 taken as i8 says) -> y[c * ys + r] */
ALWAYS void tile32_body(const int type, const int i8, int64_t k, const uint8_t *w, int64_t ws, const uint8_t *a, int64_t as,
                        float *y, int64_t ys, const int nr, const int nc) {
    if (type == EMBER_T_Q8_0 && i8 == ACT_Q8 && nr == 1 && nc == 1) {
        X86_Q8_0_ROW(k, w, a, y);
        return;
    }
    const int64_t nb = k / QK, chains = nr == 1 ? 2 : 1;
    __m256 acc[TILE32_R][TILE_C][2];
    UNROLL for (int r = 0; r < nr; r++) UNROLL for (int c = 0; c < nc; c++) UNROLL for (int h = 0; h < chains; h++)
        acc[r][c][h] = _mm256_setzero_ps();
    int64_t b0 = 0;
    for (; b0 + 8 <= nb; b0 += 8) group32(type, i8, k, w, ws, a, as, b0, 8, nr, nc, acc);
    if (b0 < nb) group32(type, i8, k, w, ws, a, as, b0, (int)(nb - b0), nr, nc, acc);
    UNROLL for (int c = 0; c < nc; c++) UNROLL for (int r = 0; r < nr; r++) {
        __m256 sum = acc[r][c][0];
        UNROLL for (int h = 1; h < chains; h++) sum = _mm256_add_ps(sum, acc[r][c][h]);
        y[c * ys + r] = hsum8(sum);
    }
}

#define TILE32_INT16(type, ...) tile32_body(type, ACT_C16, __VA_ARGS__)
#define TILE32_INT8(type, ...) tile32_body(type, ACT_Q8, __VA_ARGS__)
#define TILE32_W16(type, ...) tile32_body(type, ACT_W16, __VA_ARGS__)

/* nr is 1 or TILE32_R; BODY TILE32_INT16, TILE32_INT8 or TILE32_W16 */
#define DEFINE_TILE32(fname, BODY, TYPE)                                                                      \
    static void fname(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, float *y, int64_t ys,  \
                      int nr, int nc) {                                                                       \
        if (nr == TILE32_R) TILE_DISPATCH(BODY, TYPE, TILE32_R);                                              \
        TILE_DISPATCH(BODY, TYPE, 1);                                                                         \
    }

DEFINE_TILE32(tile_q4_0, TILE32_W16, EMBER_T_Q4_0)
DEFINE_TILE32(tile_q4_1, TILE32_W16, EMBER_T_Q4_1)
DEFINE_TILE32(tile_q5_0, TILE32_INT16, EMBER_T_Q5_0)
DEFINE_TILE32(tile_q5_1, TILE32_INT16, EMBER_T_Q5_1)
DEFINE_TILE32(tile_q8_0, TILE32_INT16, EMBER_T_Q8_0)
DEFINE_TILE32(tile_iq4_nl, TILE32_INT16, EMBER_T_IQ4_NL)
DEFINE_TILE32(tile_mxfp4, TILE32_INT16, EMBER_T_MXFP4)
DEFINE_TILE32(tile_q4_0_8, TILE32_INT8, EMBER_T_Q4_0)
DEFINE_TILE32(tile_q4_1_8, TILE32_INT8, EMBER_T_Q4_1)
DEFINE_TILE32(tile_q5_0_8, TILE32_INT8, EMBER_T_Q5_0)
DEFINE_TILE32(tile_q5_1_8, TILE32_INT8, EMBER_T_Q5_1)
DEFINE_TILE32(tile_q8_0_8, TILE32_INT8, EMBER_T_Q8_0)
DEFINE_TILE32(tile_iq4_nl_8, TILE32_INT8, EMBER_T_IQ4_NL)
DEFINE_TILE32(tile_mxfp4_8, TILE32_INT8, EMBER_T_MXFP4)

/* ================= super-blocks with 32-value sub-blocks: Q4_K Q5_K IQ4_XS ================= */
/* (these and the 16-value ones below multiply int8 weights with the int8 Q8_K activations: maddubs
 * pairs them into int16, and dpwssd (madd without VNNI) applies the sub-block scales) */

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
        return _mm256_shuffle_epi8(iq4nl_table(), nibbles32(b->qs + 16 * j));
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

/* The row's integer super-block sums sum_j scale_j * sum(u * q) go to iacc (int32 lanes; per token,
 * two chains: even and odd sub-blocks); at the end of each super-block they are scaled by d * d_a, and
 * mins * bsums by dmin * d_a. */
ALWAYS void tilek32_body(const int type, int64_t k, const uint8_t *w, int64_t ws, const uint8_t *a, int64_t as,
                         float *y, int64_t ys, const int nr, const int nc) {
    (void)ws, (void)nr;
    const int64_t nb = k / QK_K;
    __m256 acc[TILE_C][2];
    UNROLL for (int c = 0; c < nc; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_ahead(w + b * k_block_bytes(type), (k_block_bytes(type) + 63) / 64);
        const ksuper32 s = prepare_k32(type, w + b * k_block_bytes(type));
        __m256i iacc[TILE_C][2];
        UNROLL for (int c = 0; c < nc; c++) iacc[c][0] = iacc[c][1] = _mm256_setzero_si256();
        UNROLL for (int j = 0; j < 8; j++) {
            const __m256i u = unpack_k32(type, s.blk, j), sc = _mm256_shuffle_epi8(s.scales, pick16(j));
            UNROLL for (int c = 0; c < nc; c++) {
                __m256i qa = load256(a + c * as + b * QK_K + 32 * j);
                __m256i p = type == EMBER_T_IQ4_XS ? pairs16(_mm256_abs_epi8(u), _mm256_sign_epi8(qa, u)) : pairs16(u, qa);
                iacc[c][j & 1] = dot2w_acc(iacc[c][j & 1], p, sc);
            }
        }
        UNROLL for (int c = 0; c < nc; c++) {
            const float *ad = (const float *)(a + c * as + k);
            const int16_t *bsums = (const int16_t *)(ad + nb);
            __m256 da = _mm256_set1_ps(ad[b]);
            __m256i isum = _mm256_add_epi32(iacc[c][0], iacc[c][1]);
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
                         float *y, int64_t ys, const int nr, const int nc) {
    (void)ws, (void)nr;
    const int64_t nb = k / QK_K;
    __m256 acc[TILE_C][2];
    UNROLL for (int c = 0; c < nc; c++) acc[c][0] = acc[c][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        prefetch_ahead(w + b * k_block_bytes(type), (k_block_bytes(type) + 63) / 64);
        const ksuper16 s = prepare_k16(type, w + b * k_block_bytes(type));
        __m256i iacc[TILE_C][2];
        UNROLL for (int c = 0; c < nc; c++) iacc[c][0] = iacc[c][1] = _mm256_setzero_si256();
        UNROLL for (int j = 0; j < 8; j++) {
            const __m256i u = unpack_k16(type, s.blk, j);
            const __m256i sc = _mm256_shuffle_epi8(j < 4 ? s.sc_lo : s.sc_hi, pick16_pair(2 * (j % 4)));
            UNROLL for (int c = 0; c < nc; c++) {
                __m256i qa = load256(a + c * as + b * QK_K + 32 * j);
                iacc[c][j & 1] = dot2w_acc(iacc[c][j & 1], pairs16(u, qa), sc);
            }
        }
        UNROLL for (int c = 0; c < nc; c++) {
            const float *ad = (const float *)(a + c * as + k);
            const int16_t *bsums = (const int16_t *)(ad + nb);
            __m256 da = _mm256_set1_ps(ad[b]);
            __m256i bs = load256(bsums + 16 * b), isum = _mm256_add_epi32(iacc[c][0], iacc[c][1]);
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
                       float *y, int64_t ys, const int nr, const int nc) {
    (void)ws, (void)nr;
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

/* Float weights take x itself. */
#define DEFINE_TILE_F(fname, TYPE) DEFINE_TILE(fname, tilef_body, TYPE)

DEFINE_TILE_F(tile_f32, EMBER_T_F32)
DEFINE_TILE_F(tile_f16, EMBER_T_F16)
DEFINE_TILE_F(tile_bf16, EMBER_T_BF16)

/* ================= the table entries (the includer defines the table) ================= */

#define T32(name) {tile_##name, TILE32_R, TILE_C, SHORT_ROW_BYTES}
#define TK(name) {tile_##name, 1, TILE_C, 0}
#define TF(name) {tile_##name, 1, TILE_C, 0}
/* An includer with wider kernels for these types defines them before including this file. */
#ifndef X86_TILE_Q4_0
#define X86_TILE_Q4_0 T32(q4_0)
#define X86_TILE_Q4_1 T32(q4_1)
#define X86_TILE_Q8_0 T32(q8_0)
#endif
#ifndef X86_TILE_Q4_K
#define X86_TILE_Q4_K TK(q4_k)
#define X86_TILE_Q5_K TK(q5_k)
#define X86_TILE_Q6_K TK(q6_k)
#endif

#define X86_QUANTIZE_AND_TILES                                                                                 \
    .quantize = {[EMBER_ACT_Q16] = quantize_q16, [EMBER_ACT_Q16_LLAMA] = quantize_q16_llama,                    \
                 [EMBER_ACT_Q8K] = quantize_q8k},                                                             \
    .tile = {                                                                                                   \
        [EMBER_T_Q4_0] = X86_TILE_Q4_0, [EMBER_T_Q4_1] = X86_TILE_Q4_1, [EMBER_T_Q5_0] = T32(q5_0),            \
        [EMBER_T_Q5_1] = T32(q5_1), [EMBER_T_IQ4_NL] = T32(iq4_nl), [EMBER_T_MXFP4] = T32(mxfp4),               \
        [EMBER_T_Q8_0] = X86_TILE_Q8_0,                                                                        \
        [EMBER_T_Q2_K] = TK(q2_k), [EMBER_T_Q3_K] = TK(q3_k), [EMBER_T_Q4_K] = X86_TILE_Q4_K,                  \
        [EMBER_T_Q5_K] = X86_TILE_Q5_K, [EMBER_T_Q6_K] = X86_TILE_Q6_K, [EMBER_T_IQ4_XS] = TK(iq4_xs),         \
        [EMBER_T_F32] = TF(f32), [EMBER_T_F16] = TF(f16), [EMBER_T_BF16] = TF(bf16),                           \
    },                                                                                                          \
    .tile8 = {                                                                                                  \
        [EMBER_T_Q4_0] = T32(q4_0_8), [EMBER_T_Q4_1] = T32(q4_1_8),                                            \
        [EMBER_T_Q5_0] = {tile_q5_0_8, TILE32_R, TILE_C, SHORT_ROW_BYTES, X86_Q5_0_ROWS},                       \
        [EMBER_T_Q5_1] = T32(q5_1_8), [EMBER_T_IQ4_NL] = T32(iq4_nl_8), [EMBER_T_MXFP4] = T32(mxfp4_8),         \
        [EMBER_T_Q8_0] = {tile_q8_0_8, TILE32_R, TILE_C, SHORT_ROW_BYTES, X86_Q8_0_ROWS},                       \
    }
