/* x86 products of the low-bit types with Q8_K activations, included by quant_iq_avx2.c and
 * quant_iq_avx512.c after each enables its instruction set (IQ_TOKENS: activation rows per tile).
 *
 * A 32-value sub-block is unpacked into magnitudes u (unsigned bytes: grid values, or |v|) and sign
 * carriers s (a byte whose sign is the value's), so that each token's product is one
 * maddubs(u, sign(q, s)) (pairs of bytes into int16, at most 2 * 62 * 127), then one madd with the
 * int16 scales of the two 16-value halves. The grid lookups are the cost, and a tile pays them once
 * for all its tokens. Integer sums per super-block are the scalar kernel's exactly; the float factor
 * (quant_iq.h) then scales them. */
#include <immintrin.h>

#define ALWAYS static inline __attribute__((always_inline))

typedef struct {
    __m256i u, s, sc; /* sc: 16 int16, lanes 0-7 the scale of values 0-15, lanes 8-15 of 16-31 */
} iq_sub;

ALWAYS __m256i scales2(int lo, int hi) { return _mm256_setr_m128i(_mm_set1_epi16((short)lo), _mm_set1_epi16((short)hi)); }

ALWAYS __m256i grid4(const uint64_t *g, int i0, int i1, int i2, int i3) {
    return _mm256_set_epi64x((long long)g[i3], (long long)g[i2], (long long)g[i1], (long long)g[i0]);
}

/* Four sign bytes (bit j of byte l: value 8l + j) -> 32 bytes of +1 / -1: each byte spread over its
 * 8 lanes, its bit picked by the lane's mask; cheaper than four table rows. */
ALWAYS __m256i signs32(uint32_t m) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)m), spread), bit);
    return _mm256_or_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(1));
}

/* A signed sub-block v as u = |v|, s = v. */
ALWAYS iq_sub from_signed(__m256i v, __m256i sc) { return (iq_sub){_mm256_abs_epi8(v), v, sc}; }

ALWAYS iq_sub sub_iq2_xxs(const uint8_t *blk, int ib) {
    const blk_iq2_xxs *x = (const blk_iq2_xxs *)blk;
    const uint32_t a0 = iq_u32(x->qs + 8 * ib), a1 = iq_u32(x->qs + 8 * ib + 4);
    const uint64_t *g = ember_iq2xxs_grid, *sg = ember_iq_sign7;
    const int sc = 2 * (int)(a1 >> 28) + 1;
    return (iq_sub){grid4(g, a0 & 255, (a0 >> 8) & 255, (a0 >> 16) & 255, a0 >> 24),
                    grid4(sg, a1 & 127, (a1 >> 7) & 127, (a1 >> 14) & 127, (a1 >> 21) & 127), scales2(sc, sc)};
}

ALWAYS iq_sub sub_iq2_xs(const uint8_t *blk, int ib) {
    const blk_iq2_xs *x = (const blk_iq2_xs *)blk;
    const uint16_t *q = x->qs + 4 * ib;
    const uint64_t *g = ember_iq2xs_grid, *sg = ember_iq_sign7;
    const int s = x->scales[ib];
    return (iq_sub){grid4(g, q[0] & 511, q[1] & 511, q[2] & 511, q[3] & 511),
                    grid4(sg, q[0] >> 9, q[1] >> 9, q[2] >> 9, q[3] >> 9), scales2(2 * (s & 15) + 1, 2 * (s >> 4) + 1)};
}

ALWAYS iq_sub sub_iq2_s(const uint8_t *blk, int ib) {
    const blk_iq2_s *x = (const blk_iq2_s *)blk;
    const uint8_t *q = x->qs + 4 * ib, *sn = x->signs + 4 * ib;
    const int h = x->qh[ib], s = x->scales[ib];
    const uint64_t *g = ember_iq2s_grid;
    return (iq_sub){grid4(g, q[0] | (h & 3) << 8, q[1] | (h & 12) << 6, q[2] | (h & 48) << 4, q[3] | (h & 192) << 2),
                    signs32(iq_u32(sn)), scales2(2 * (s & 15) + 1, 2 * (s >> 4) + 1)};
}

ALWAYS iq_sub sub_iq3_xxs(const uint8_t *blk, int ib) {
    const blk_iq3_xxs *x = (const blk_iq3_xxs *)blk;
    const uint8_t *q = x->qs + 8 * ib;
    const uint32_t aux = iq_u32(x->ss + 4 * ib), *g = ember_iq3xxs_grid;
    const int sc = 2 * (int)(aux >> 28) + 1;
    __m256i u = _mm256_set_epi32((int)g[q[7]], (int)g[q[6]], (int)g[q[5]], (int)g[q[4]], (int)g[q[3]], (int)g[q[2]],
                                 (int)g[q[1]], (int)g[q[0]]);
    const uint64_t *sg = ember_iq_sign7;
    return (iq_sub){u, grid4(sg, aux & 127, (aux >> 7) & 127, (aux >> 14) & 127, (aux >> 21) & 127), scales2(sc, sc)};
}

ALWAYS iq_sub sub_iq3_s(const uint8_t *blk, int ib) {
    const blk_iq3_s *x = (const blk_iq3_s *)blk;
    const uint8_t *q = x->qs + 8 * ib, *sn = x->signs + 4 * ib;
    const int h = x->qh[ib], sc = 2 * ((x->scales[ib / 2] >> 4 * (ib % 2)) & 15) + 1;
    const uint32_t *g = ember_iq3s_grid;
#define IQ3S_AT(j) (int)g[q[j] | ((h << (8 - (j))) & 256)]
    __m256i u = _mm256_set_epi32(IQ3S_AT(7), IQ3S_AT(6), IQ3S_AT(5), IQ3S_AT(4), IQ3S_AT(3), IQ3S_AT(2), IQ3S_AT(1), IQ3S_AT(0));
#undef IQ3S_AT
    return (iq_sub){u, signs32(iq_u32(sn)), scales2(sc, sc)};
}

ALWAYS iq_sub sub_iq1_s(const uint8_t *blk, int ib) {
    const blk_iq1_s *x = (const blk_iq1_s *)blk;
    const uint8_t *q = x->qs + 4 * ib;
    const int h = x->qh[ib], sc = 2 * ((h >> 12) & 7) + 1;
    const uint64_t *g = ember_iq1s_grid;
    __m256i v = grid4(g, q[0] | (h & 7) << 8, q[1] | (h & 56) << 5, q[2] | (h & 448) << 2, q[3] | (h & 3584) >> 1);
    return from_signed(_mm256_add_epi8(v, _mm256_set1_epi8(h & 0x8000 ? -1 : 1)), scales2(sc, sc));
}

ALWAYS iq_sub sub_iq1_m(const uint8_t *blk, int ib) {
    const blk_iq1_m *x = (const blk_iq1_m *)blk;
    const uint8_t *q = x->qs + 4 * ib;
    const int h0 = x->qh[2 * ib], h1 = x->qh[2 * ib + 1], sw = x->scales[ib / 2] >> 6 * (ib % 2);
    const uint64_t *g = ember_iq1s_grid;
    __m256i v = grid4(g, q[0] | (h0 & 7) << 8, q[1] | (h0 & 0x70) << 4, q[2] | (h1 & 7) << 8, q[3] | (h1 & 0x70) << 4);
    const long long plus = 0x0101010101010101LL, minus = -1LL;
    __m256i delta = _mm256_set_epi64x(h1 & 0x80 ? minus : plus, h1 & 0x08 ? minus : plus, h0 & 0x80 ? minus : plus,
                                      h0 & 0x08 ? minus : plus);
    return from_signed(_mm256_add_epi8(v, delta), scales2(2 * (sw & 7) + 1, 2 * ((sw >> 3) & 7) + 1));
}

ALWAYS iq_sub sub_tq2_0(const uint8_t *blk, int ib) {
    const blk_tq2_0 *x = (const blk_tq2_0 *)blk;
    __m256i t = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * (ib / 4)));
    t = _mm256_and_si256(_mm256_srli_epi16(t, 2 * (ib % 4)), _mm256_set1_epi8(3));
    return from_signed(_mm256_sub_epi8(t, _mm256_set1_epi8(1)), scales2(1, 1));
}

/* TQ1_0: the trits of bytes x with per-byte powers of 3 p, minus 1: the top trit of (x * p mod 256)
 * is 0, 1 or 2 as that byte is below 86, below 171, or above. */
ALWAYS __m256i trits_minus1(__m256i x, __m256i p) {
    const __m256i low = _mm256_set1_epi16(0x00ff);
    __m256i even = _mm256_and_si256(_mm256_mullo_epi16(x, p), low);
    __m256i odd = _mm256_slli_epi16(_mm256_mullo_epi16(_mm256_srli_epi16(x, 8), _mm256_srli_epi16(p, 8)), 8);
    __m256i y = _mm256_or_si256(even, odd);
    __m256i ge86 = _mm256_cmpeq_epi8(_mm256_max_epu8(y, _mm256_set1_epi8(86)), y);
    __m256i ge171 = _mm256_cmpeq_epi8(_mm256_max_epu8(y, _mm256_set1_epi8((char)171)), y);
    return _mm256_sub_epi8(_mm256_sub_epi8(_mm256_set1_epi8(-1), ge86), ge171);
}

ALWAYS iq_sub sub_tq1_0(const uint8_t *blk, int ib) {
    const blk_tq1_0 *x = (const blk_tq1_0 *)blk;
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    if (ib < 5)
        return from_signed(trits_minus1(_mm256_loadu_si256((const __m256i *)x->qs), _mm256_set1_epi8((char)pow3[ib])),
                           scales2(1, 1));
    const __m128i tail = _mm_loadu_si128((const __m128i *)(x->qs + 32));
    __m256i v, p;
    if (ib < 7) { /* values 160 + 32 (ib - 5) ..: trits 2 (ib - 5) and 2 (ib - 5) + 1 of qs[32..48) */
        v = _mm256_setr_m128i(tail, tail);
        p = _mm256_setr_m128i(_mm_set1_epi8((char)pow3[2 * (ib - 5)]), _mm_set1_epi8((char)pow3[2 * (ib - 5) + 1]));
    } else { /* values 224..: trit 4 of qs[32..48), then trit i of qh[m] as value 240 + 4i + m */
        v = _mm256_setr_m128i(tail, _mm_set1_epi32((int)iq_u32(x->qh)));
        p = _mm256_setr_m128i(_mm_set1_epi8(81), _mm_setr_epi8(1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27));
    }
    return from_signed(trits_minus1(v, p), scales2(1, 1));
}

ALWAYS float block_factor(int type, const uint8_t *blk) {
    switch (type) {
    case EMBER_T_IQ2_XXS: case EMBER_T_IQ2_XS: case EMBER_T_IQ2_S:
        return ember_f16_to_f32(*(const uint16_t *)blk) * 0.125f;
    case EMBER_T_IQ3_XXS: return ember_f16_to_f32(*(const uint16_t *)blk) * 0.25f;
    case EMBER_T_IQ3_S: case EMBER_T_IQ1_S: return ember_f16_to_f32(*(const uint16_t *)blk) * (type == EMBER_T_IQ1_S ? 0.125f : 1.0f);
    case EMBER_T_IQ1_M: return ember_f16_to_f32(iq1m_d((const blk_iq1_m *)blk)) * 0.125f;
    case EMBER_T_TQ1_0: return ember_f16_to_f32(((const blk_tq1_0 *)blk)->d);
    default: return ember_f16_to_f32(((const blk_tq2_0 *)blk)->d);
    }
}

ALWAYS iq_sub unpack_sub(int type, const uint8_t *blk, int ib) {
    switch (type) {
    case EMBER_T_IQ2_XXS: return sub_iq2_xxs(blk, ib);
    case EMBER_T_IQ2_XS: return sub_iq2_xs(blk, ib);
    case EMBER_T_IQ2_S: return sub_iq2_s(blk, ib);
    case EMBER_T_IQ3_XXS: return sub_iq3_xxs(blk, ib);
    case EMBER_T_IQ3_S: return sub_iq3_s(blk, ib);
    case EMBER_T_IQ1_S: return sub_iq1_s(blk, ib);
    case EMBER_T_IQ1_M: return sub_iq1_m(blk, ib);
    case EMBER_T_TQ1_0: return sub_tq1_0(blk, ib);
    default: return sub_tq2_0(blk, ib);
    }
}

ALWAYS float hsum8f(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* One W row (k/256 blocks of `type`, `bytes` each) . NC activation rows a + c as -> y[c ys]. */
ALWAYS void tile_body(int type, int bytes, int64_t k, const uint8_t *w, const uint8_t *a, int64_t as, float *y,
                      int64_t ys, int NC) {
    __m256 accf[IQ_TOKENS];
    for (int c = 0; c < NC; c++) accf[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < k / QK_K; i++) {
        const uint8_t *blk = w + i * bytes;
        __m256i acc[IQ_TOKENS];
        for (int c = 0; c < NC; c++) acc[c] = _mm256_setzero_si256();
        for (int ib = 0; ib < 8; ib++) {
            const iq_sub sb = unpack_sub(type, blk, ib);
            for (int c = 0; c < NC; c++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(a + c * as + i * QK_K + 32 * ib));
                __m256i p = _mm256_maddubs_epi16(sb.u, _mm256_sign_epi8(q, sb.s));
                acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(p, sb.sc));
            }
        }
        const float f = block_factor(type, blk);
        for (int c = 0; c < NC; c++) {
            const float yd = ((const float *)(a + c * as + k))[i];
            accf[c] = _mm256_fmadd_ps(_mm256_set1_ps(f * yd), _mm256_cvtepi32_ps(acc[c]), accf[c]);
        }
    }
    for (int c = 0; c < NC; c++) y[c * ys] = hsum8f(accf[c]);
}

#define IQ_TILE_FN(name, TYPE)                                                                                \
    static void tile_##name(int64_t k, const void *w, int64_t ws, const void *a, int64_t as, float *y,        \
                            int64_t ys, int nr, int nc) {                                                     \
        (void)ws, (void)nr;                                                                                   \
        switch (nc) {                                                                                         \
        IQ_TILE_CASES(name, TYPE)                                                                             \
        default: tile_body(TYPE, sizeof(blk_##name), k, w, a, as, y, ys, IQ_TOKENS); return;                  \
        }                                                                                                     \
    }

IQ_TILE_FN(iq2_xxs, EMBER_T_IQ2_XXS)
IQ_TILE_FN(iq2_xs, EMBER_T_IQ2_XS)
IQ_TILE_FN(iq2_s, EMBER_T_IQ2_S)
IQ_TILE_FN(iq3_xxs, EMBER_T_IQ3_XXS)
IQ_TILE_FN(iq3_s, EMBER_T_IQ3_S)
IQ_TILE_FN(iq1_s, EMBER_T_IQ1_S)
IQ_TILE_FN(iq1_m, EMBER_T_IQ1_M)
IQ_TILE_FN(tq1_0, EMBER_T_TQ1_0)
IQ_TILE_FN(tq2_0, EMBER_T_TQ2_0)

/* Prompts: the W rows of a share in blocks that stay in L2 (PANEL_W_BYTES), each block swept by every
 * tile of IQ_TOKENS tokens (their activations stay in L1). Walking each row against all tokens
 * instead re-reads every token's activations from L2 per row: 4-9x slower at 64-128 tokens. */
#define PANEL_W_BYTES (96 * 1024)

static ember_tile_fn tile_for(int type) {
    switch (type) {
    case EMBER_T_IQ2_XXS: return tile_iq2_xxs;
    case EMBER_T_IQ2_XS: return tile_iq2_xs;
    case EMBER_T_IQ2_S: return tile_iq2_s;
    case EMBER_T_IQ3_XXS: return tile_iq3_xxs;
    case EMBER_T_IQ3_S: return tile_iq3_s;
    case EMBER_T_IQ1_S: return tile_iq1_s;
    case EMBER_T_IQ1_M: return tile_iq1_m;
    case EMBER_T_TQ1_0: return tile_tq1_0;
    default: return tile_tq2_0;
    }
}

/* W rows (nrows, ws bytes each) . n activation rows a (as bytes each) -> y[t ys + r] */
static void panel_iq(int type, int64_t k, const void *w, int64_t ws, int64_t nrows, const void *a, int64_t as,
                     int64_t n, float *y, int64_t ys) {
    const ember_tile_fn tile = tile_for(type);
    const int64_t rb = ws >= PANEL_W_BYTES ? 1 : PANEL_W_BYTES / ws;
    for (int64_t r0 = 0; r0 < nrows; r0 += rb) {
        const int64_t r1 = r0 + rb < nrows ? r0 + rb : nrows;
        for (int64_t t = 0; t < n; t += IQ_TOKENS) {
            const int nc = n - t < IQ_TOKENS ? (int)(n - t) : IQ_TOKENS;
            for (int64_t r = r0; r < r1; r++)
                tile(k, (const uint8_t *)w + r * ws, ws, (const uint8_t *)a + t * as, as, y + t * ys + r, ys, 1, nc);
        }
    }
}

#define IQ_T(name) {tile_##name, 1, IQ_TOKENS, 0}
#define IQ_P {panel_iq, 16, 2 * IQ_TOKENS}
#define IQ_X86_TILES                                                                                          \
    .tile = {                                                                                                 \
        [EMBER_T_IQ2_XXS] = IQ_T(iq2_xxs), [EMBER_T_IQ2_XS] = IQ_T(iq2_xs), [EMBER_T_IQ2_S] = IQ_T(iq2_s),    \
        [EMBER_T_IQ3_XXS] = IQ_T(iq3_xxs), [EMBER_T_IQ3_S] = IQ_T(iq3_s),   [EMBER_T_IQ1_S] = IQ_T(iq1_s),    \
        [EMBER_T_IQ1_M] = IQ_T(iq1_m),     [EMBER_T_TQ1_0] = IQ_T(tq1_0),   [EMBER_T_TQ2_0] = IQ_T(tq2_0),    \
    },                                                                                                        \
    .panel = {                                                                                                \
        [EMBER_T_IQ2_XXS] = IQ_P, [EMBER_T_IQ2_XS] = IQ_P, [EMBER_T_IQ2_S] = IQ_P, [EMBER_T_IQ3_XXS] = IQ_P,  \
        [EMBER_T_IQ3_S] = IQ_P,   [EMBER_T_IQ1_S] = IQ_P,  [EMBER_T_IQ1_M] = IQ_P, [EMBER_T_TQ1_0] = IQ_P,    \
        [EMBER_T_TQ2_0] = IQ_P,                                                                               \
    }
