/* Internal header of the quantized kernels: ggml block layouts, the quantized-activation formats,
 * and the per-instruction-set kernel tables that matmul.c dispatches through. */
#ifndef EMBER_QUANT_H
#define EMBER_QUANT_H

#include "ember_cpu.h"

#include "api_quant.h"

/* ---- ggml type ids (GGMLType in ember/quant/types.py) ---- */
enum {
    EMBER_T_F32 = 0, EMBER_T_F16 = 1, EMBER_T_Q4_0 = 2, EMBER_T_Q4_1 = 3, EMBER_T_Q5_0 = 6,
    EMBER_T_Q5_1 = 7, EMBER_T_Q8_0 = 8, EMBER_T_Q2_K = 10, EMBER_T_Q3_K = 11, EMBER_T_Q4_K = 12,
    EMBER_T_Q5_K = 13, EMBER_T_Q6_K = 14, EMBER_T_IQ4_NL = 20, EMBER_T_IQ4_XS = 23, EMBER_T_BF16 = 30,
    /* the low-bit types (quant_iq.h) */
    EMBER_T_IQ2_XXS = 16, EMBER_T_IQ2_XS = 17, EMBER_T_IQ3_XXS = 18, EMBER_T_IQ1_S = 19, EMBER_T_IQ3_S = 21,
    EMBER_T_IQ2_S = 22, EMBER_T_IQ1_M = 29, EMBER_T_TQ1_0 = 34, EMBER_T_TQ2_0 = 35,
    EMBER_T_MXFP4 = 39, /* OCP microscaling FP4: E2M1 values, an E8M0 scale per 32 */
    EMBER_T_COUNT = 40
};

#define QK 32      /* values per block of the legacy types */
#define QK_K 256   /* values per super-block of the K-quants */

/* ---- weight blocks (ggml's layouts; f16 fields kept as raw bits) ---- */
typedef struct { uint16_t d; uint8_t qs[16]; } blk_q4_0;                   /* q: low nibbles 0..15, high 16..31 */
typedef struct { uint16_t d, m; uint8_t qs[16]; } blk_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_0;    /* qh bit i: high bit of value i */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_1;
typedef struct { uint16_t d; int8_t qs[32]; } blk_q8_0;
typedef struct { uint16_t d; uint8_t qs[16]; } blk_iq4_nl;                 /* nibbles index ember_iq4nl_values */
typedef struct { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; } blk_q2_k;
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; } blk_q3_k;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } blk_q4_k;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_k;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } blk_q6_k;
typedef struct { uint16_t d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; } blk_iq4_xs;
typedef struct { uint8_t e; uint8_t qs[16]; } blk_mxfp4;                   /* nibbles index ember_mxfp4_values */

_Static_assert(sizeof(blk_q4_0) == 18 && sizeof(blk_q4_1) == 20 && sizeof(blk_q5_0) == 22 &&
               sizeof(blk_q5_1) == 24 && sizeof(blk_q8_0) == 34 && sizeof(blk_iq4_nl) == 18 &&
               sizeof(blk_mxfp4) == 17,
               "legacy block sizes");
_Static_assert(sizeof(blk_q2_k) == 84 && sizeof(blk_q3_k) == 110 && sizeof(blk_q4_k) == 144 &&
               sizeof(blk_q5_k) == 176 && sizeof(blk_q6_k) == 210 && sizeof(blk_iq4_xs) == 136,
               "k-quant block sizes");

/* The 16 non-linear levels of IQ4_NL / IQ4_XS. */
extern const int8_t ember_iq4nl_values[16];
/* MXFP4's 16 E2M1 values, doubled to integers (sign bit 3); a block's scale is then half its E8M0 power. */
extern const int8_t ember_mxfp4_values[16];

/* 2^(e - 128): half of an E8M0 scale (e = 0 and 1 are float subnormals, exact). */
static inline float ember_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- quantized activations (caller's scratch; our own planar layout) ----
 * Chosen per weight type by what it costs and what it changes against llama.cpp's reference outputs:
 * EMBER_ACT_Q16 (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL MXFP4), blocks of 32, in int16:
 *     c int16 (k,) | d f32 (k/32,) | s f32 (k/32,)      (s = d * sum(c), for the mins of Q4_1/Q5_1)
 *     EMBER_ROUND_EXACT: c = round_even(x * 32767 / amax), d = amax / 32767, s in f32: exact to 1/65534
 *     of a block's largest value, the products of float arithmetic. EMBER_ROUND_LLAMA (the quantizer of
 *     kind EMBER_ACT_Q16_LLAMA, same rows): c = round_even(x * 127 / amax), d = f16(amax / 127),
 *     s = f16(amax / 127 * sum(c)), llama.cpp's Q8_0 / Q8_1. The weights widen to int16 and meet c in
 *     16-bit multiply-adds in the panels. Rows rounded as llama.cpp also carry their values as int8
 *     after the sums, q int8 (k,) at ember_q16_q8_offset(k), which the decode microtiles multiply 4 at a
 *     time (vpdpbusd; the int16 values take twice the instructions, and a decode step of SmolLM2 or
 *     Gemma 3 was bound by them), then each block's sum of q as int32 (k/32,) at
 *     ember_q16_qsum_offset(k), the offset terms of the int8 panels (weights stored unsigned, u = w +
 *     offset). (llama.cpp's 8-bit rounding of SmolLM2's Q4_1 put its teacher-forced
 *     log-probabilities up to 0.31 away from llama.cpp's own, beyond the 0.3 the golden tests
 *     allow; exact ones stay within 0.21, and with only its Q4_1 rounded so 0.24; and a cached prompt's
 *     continuation parted from the uncached one's: files without K-quants round exactly. In a file
 *     with K-quants, exact 32-value products beside the K-quants' llama.cpp rounding drifted further
 *     (Gemma 3: 0.53) than llama.cpp's rounding throughout (0.25), so there every product rounds as
 *     llama.cpp does; see api_quant.h.)
 * EMBER_ACT_Q8K (the K-quants and IQ4_XS: llama.cpp's Q8_K, rounded as it rounds them), super-blocks of 256:
 *     q int8 (k,) | d f32 (k/256,) | bsums int16 (k/16,) | sum16 f32 (k/16,) | sum32 f32 (k/32,)
 *     | off16 int32 (k/16,) | off32 int32 (k/32,)
 *     q = min(127, round_even(x * -127 / m)) with m the value of largest magnitude, d = 1 / (-127 / m);
 *     bsums the sums of each 16 q; sum16, sum32 the sums of each 16 and 32 q as floats (for mins), and
 *     off16 = -32 sum16, off32 = -128 sum32 as integers: the weight offsets of the packed panels, which
 *     hold Q3_K and Q6_K as u = w + 32 and IQ4_XS as w + 128 (what the panel kernels read). One int8 level keeps the products of
 *     the K-quant files (the sizes people run) at twice the integer throughput, and rounding as llama.cpp
 *     does keeps ember on its numbers (Gemma 3's perplexity within 0.01%).
 * EMBER_ACT_F32: the caller's x itself, no scratch. */
enum { EMBER_ACT_F32 = 0, EMBER_ACT_Q16 = 1, EMBER_ACT_Q8K = 2, EMBER_ACT_Q16_LLAMA = 3, EMBER_ACT_KINDS = 4 };

static inline int64_t ember_align64(int64_t n) { return (n + 63) & ~(int64_t)63; }

/* Byte offsets of the fields after the values in a row of k values. */
static inline int64_t ember_q16_d_offset(int64_t k) { return 2 * k; }
static inline int64_t ember_q16_s_offset(int64_t k) { return 2 * k + 4 * (k / QK); }
static inline int64_t ember_q16_q8_offset(int64_t k) { return ember_align64(2 * k + 8 * (k / QK)); }
static inline int64_t ember_q16_qsum_offset(int64_t k) { return ember_q16_q8_offset(k) + k; }
static inline int64_t ember_q8k_d_offset(int64_t k) { return k; }
static inline int64_t ember_q8k_bsums_offset(int64_t k) { return k + 4 * (k / QK_K); }
static inline int64_t ember_q8k_sum16_offset(int64_t k) { return ember_q8k_bsums_offset(k) + 2 * (k / 16); }
static inline int64_t ember_q8k_sum32_offset(int64_t k) { return ember_q8k_sum16_offset(k) + 4 * (k / 16); }
static inline int64_t ember_q8k_off16_offset(int64_t k) { return ember_q8k_sum32_offset(k) + 4 * (k / 32); }
static inline int64_t ember_q8k_off32_offset(int64_t k) { return ember_q8k_off16_offset(k) + 4 * (k / 16); }

/* Bytes of one quantized activation row of k values (64-byte multiple so rows stay aligned). */
static inline int64_t ember_act_row_bytes(int act, int64_t k) {
    if (act == EMBER_ACT_Q16 || act == EMBER_ACT_Q16_LLAMA) return ember_align64(ember_q16_qsum_offset(k) + 4 * (k / QK));
    if (act == EMBER_ACT_Q8K) return ember_align64(ember_q8k_off32_offset(k) + 4 * (k / 32));
    return 0;
}

/* sum16, sum32, off16 and off32 of a Q8K row whose q, d and bsums are written (shared by every quantizer). */
static inline void ember_q8k_sums(void *row, int64_t k) {
    uint8_t *r = row;
    const int16_t *bsums = (const int16_t *)(r + ember_q8k_bsums_offset(k));
    float *sum16 = (float *)(r + ember_q8k_sum16_offset(k)), *sum32 = (float *)(r + ember_q8k_sum32_offset(k));
    int32_t *off16 = (int32_t *)(r + ember_q8k_off16_offset(k)), *off32 = (int32_t *)(r + ember_q8k_off32_offset(k));
    for (int64_t g = 0; g < k / 16; g++) {
        sum16[g] = (float)bsums[g];
        off16[g] = -32 * bsums[g];
    }
    for (int64_t g = 0; g < k / 32; g++) {
        sum32[g] = (float)(bsums[2 * g] + bsums[2 * g + 1]);
        off32[g] = -128 * (bsums[2 * g] + bsums[2 * g + 1]);
    }
}

/* ---- per-type facts ---- */
typedef void (*ember_dequant_fn)(const void *src, float *dst, int64_t n_blocks);

typedef struct {
    int block_size;           /* values per block */
    int type_size;            /* bytes per block */
    int act;                  /* EMBER_ACT_* the products use */
    ember_dequant_fn dequant; /* blocks -> f32 (bit-exact with the numpy reference) */
} ember_qtype;

/* Facts of ggml type `type`, or NULL when ember does not compute with it. */
const ember_qtype *ember_qtype_get(int type);

/* ---- kernels ---- */
/* Quantize one activation row: x (k,) f32 -> dst (ember_act_row_bytes(act, k) bytes). */
typedef void (*ember_quantize_fn)(const float *x, void *dst, int64_t k);

/* A microtile of the product: y[c * y_stride + r] = dot(W row r, activation row c)
 * for r < nr, c < nc, with nr = 1, or nr = rows when a row is at most short_row bytes (walking
 * several rows at once is only fast for short rows), and 1 <= nc <= cols of the kernel's entry.
 * w: nr rows of w_stride bytes; a: nc activation rows of a_stride bytes (format: the type's act). */
typedef void (*ember_tile_fn)(int64_t k, const void *w, int64_t w_stride, const void *a, int64_t a_stride,
                              float *y, int64_t y_stride, int nr, int nc);

/* n_rows consecutive rows of W against one activation row -> y[r]: a thread's run of long rows in one
 * call when decoding (a call per row costs a row loop ~10% of its read rate, bench/NOTES.md). */
typedef void (*ember_rows_fn)(int64_t k, const void *w, int64_t w_stride, const void *a, float *y, int64_t n_rows);

/* n_rows consecutive rows of W against 1 <= nc <= EMBER_LANES_TOKENS activation rows -> y[c * y_stride + r],
 * with rows in the lanes of a vector: each block of a group of rows is unpacked and transposed once, in
 * registers, for all nc tokens, and its float scaling serves all the group's rows at once (the few-token
 * steps of speculative decoding, where the microtiles pay a conversion and an FMA per row, token and block). */
typedef void (*ember_lanes_fn)(int64_t k, const void *w, int64_t w_stride, int64_t n_rows, const void *a,
                               int64_t a_stride, int nc, float *y, int64_t y_stride);
#define EMBER_LANES_TOKENS 16
#define EMBER_LANES_ROWS 16 /* rows a vector holds: products on lanes share rows out in multiples of it */

typedef struct {
    ember_tile_fn fn; /* NULL: this ISA has no kernel for the type */
    int rows, cols;   /* largest tile it computes */
    int short_row;    /* rows of at most this many bytes go `rows` at a time */
    ember_rows_fn run; /* NULL, or lone rows against one token (then short rows go alone too) */
    ember_lanes_fn lanes; /* NULL, or rows in lanes, taken from lanes_min tokens (products on microtiles) */
    int lanes_min;
} ember_tile;

/* The product for a range of W rows by packing `rows` rows at a time into an interleaved panel
 * (vector lanes = rows), then sweeping all tokens over it: for prompts, where the packing is
 * paid once per many tokens. w: nrows rows of w_stride bytes; a: n activation rows of a_stride
 * bytes (the type's act format); y[t * y_stride + r] for t < n, r < nrows. */
typedef void (*ember_panel_fn)(int type, int64_t k, const void *w, int64_t w_stride, int64_t nrows, const void *a,
                               int64_t a_stride, int64_t n, float *y, int64_t y_stride);

typedef struct {
    ember_panel_fn fn; /* NULL: none for the type */
    int rows;          /* panel height: thread ranges are split in multiples of it */
    int min_tokens;    /* below this many tokens the microtiles are faster */
} ember_panel;

typedef struct {
    ember_quantize_fn quantize[EMBER_ACT_KINDS]; /* by EMBER_ACT_*; [EMBER_ACT_F32] unused */
    ember_tile tile[EMBER_T_COUNT];
    ember_tile tile8[EMBER_T_COUNT]; /* the 32-value types against rows rounded as llama.cpp (their int8 q) */
    ember_panel panel[EMBER_T_COUNT];
    ember_panel panel8[EMBER_T_COUNT]; /* the 32-value types against rows rounded as llama.cpp (q and its block sums) */
} ember_kernels;

/* One table per instruction set; an ISA not built for this architecture has an empty table. */
extern const ember_kernels ember_kernels_scalar;
extern const ember_kernels ember_kernels_avx2;
extern const ember_kernels ember_kernels_avx512;
extern const ember_kernels ember_kernels_neon;

/* Prompt kernels for float weights (F16, BF16, F32), ember_panel_fn (float_avx2.c, float_avx512.c;
 * x86 only): panels of FLOAT_PANEL_ROWS_* rows. */
void ember_float_panel_avx2(int type, int64_t k, const void *w, int64_t w_stride, int64_t nrows, const void *a,
                            int64_t a_stride, int64_t n, float *y, int64_t y_stride);
void ember_float_panel_avx512(int type, int64_t k, const void *w, int64_t w_stride, int64_t nrows, const void *a,
                              int64_t a_stride, int64_t n, float *y, int64_t y_stride);
#define FLOAT_PANEL_ROWS_AVX2 16
#define FLOAT_PANEL_ROWS_AVX512 32

/* The tile kernel and activation quantizer for `type` on the active ISA, falling back
 * to narrower ISAs (avx512 -> avx2 -> scalar, neon -> scalar) where one is missing. */
ember_tile ember_tile_for(int type);
/* The int8 microtile (tile8) for `type` against rows rounded as `rounding` (api_quant.h) where one
 * exists for rows rounded as llama.cpp; else a tile without fn (ember_tile_for's takes the int16 values). */
ember_tile ember_tile8_for(int type, int rounding);
/* The panel kernel for `type`, or with i8 its int8 panel (a 32-value type against rows rounded as
 * llama.cpp); fn NULL where no ISA has one. */
ember_panel ember_panel_for(int type, int i8);
ember_quantize_fn ember_quantize_for(int act);

/* ---- scale unpacking shared by the scalar and SIMD kernels ---- */

/* Q4_K / Q5_K: 12 bytes -> 8 six-bit scales sc[0..8) and 8 six-bit mins m[0..8) (one per 32 values). */
static inline void ember_q4k_scales(const uint8_t *s12, uint8_t *sc, uint8_t *m) {
    uint32_t a0, a1, a2;
    memcpy(&a0, s12, 4);
    memcpy(&a1, s12 + 4, 4);
    memcpy(&a2, s12 + 8, 4);
    uint32_t sc_lo = a0 & 0x3f3f3f3fu, m_lo = a1 & 0x3f3f3f3fu;
    uint32_t sc_hi = (a2 & 0x0f0f0f0fu) | ((a0 >> 2) & 0x30303030u);
    uint32_t m_hi = ((a2 >> 4) & 0x0f0f0f0fu) | ((a1 >> 2) & 0x30303030u);
    memcpy(sc, &sc_lo, 4);
    memcpy(sc + 4, &sc_hi, 4);
    memcpy(m, &m_lo, 4);
    memcpy(m + 4, &m_hi, 4);
}

/* Q3_K: 12 bytes -> 16 signed scales (one per 16 values), six bits minus 32. */
static inline void ember_q3k_scales(const uint8_t *s12, int8_t *sc) {
    for (int j = 0; j < 16; j++) {
        int lo = j < 8 ? s12[j] & 0xf : s12[j - 8] >> 4;
        int hi = (s12[8 + (j & 3)] >> (2 * (j >> 2))) & 3;
        sc[j] = (int8_t)((lo | hi << 4) - 32);
    }
}

/* IQ4_XS: the signed scale (-32..31) of 32-value sub-block ib. */
static inline int ember_iq4xs_scale(const blk_iq4_xs *b, int ib) {
    int lo = (b->scales_l[ib / 2] >> (4 * (ib % 2))) & 0xf;
    int hi = (b->scales_h >> (2 * ib)) & 3;
    return (lo | hi << 4) - 32;
}

/* A thread's run of lone weight rows against one token, taken in ROW_STREAMS interleaved streams: rows
 * i, h + i, ... (h = n / ROW_STREAMS) one after the other, the rows past ROW_STREAMS * h at the end. One
 * sequential stream a core leaves too few of its reads in flight while a row's arithmetic runs between
 * them; two made Gemma 3's decode 1.15x faster, four no faster than two (bench/NOTES.md). */
#define ROW_STREAMS 2
#define ROWS_IN_STREAMS(n_rows, r, STMT)                             \
    do {                                                            \
        const int64_t h_ = (n_rows) / ROW_STREAMS;                  \
        for (int64_t i_ = 0; i_ < h_; i_++)                         \
            for (int s_ = 0; s_ < ROW_STREAMS; s_++) {              \
                const int64_t r = s_ * h_ + i_;                     \
                STMT;                                               \
            }                                                       \
        for (int64_t r = ROW_STREAMS * h_; r < (n_rows); r++) STMT; \
    } while (0)

#endif
