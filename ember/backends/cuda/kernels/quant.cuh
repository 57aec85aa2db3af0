// GGUF block decoding, one "unit" of 32 consecutive values of a row at a time.
//
// Every supported type splits a row into units of 32 values (one block, or one eighth of a
// 256-value super-block). unit_q decodes a unit of a quantized type to 32 small integers
// (int8, packed four to a word: byte j of q[i] is value 4i+j) with a scale and an offset per
// half of 16 values:  value = a[h] * q + b[h]  (h = 0 for values 0..15, 1 for 16..31).
// The matrix-vector kernels use that form directly in int8 dot products; unit_f gives floats.
// Block layouts: see ember/quant/*.py, the numpy references these decoders are tested against.

#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ4_NL 20
#define T_IQ4_XS 23
#define T_BF16 30
#define T_MXFP4 39
#define MXFP4_RUN_BYTES 272  // 16 units of MXFP4 in the device layout (unit_q)
// the low-bit types: quant_iq.cuh (concatenated after this file)
#define T_IQ2_XXS 16
#define T_IQ2_XS 17
#define T_IQ3_XXS 18
#define T_IQ1_S 19
#define T_IQ3_S 21
#define T_IQ2_S 22
#define T_IQ1_M 29
#define T_TQ1_0 34
#define T_TQ2_0 35

#define IS_LOWBIT(t)                                                                                         \
    ((t) == T_IQ2_XXS || (t) == T_IQ2_XS || (t) == T_IQ3_XXS || (t) == T_IQ1_S || (t) == T_IQ3_S ||             \
     (t) == T_IQ2_S || (t) == T_IQ1_M || (t) == T_TQ1_0 || (t) == T_TQ2_0)

struct QUnit {
    int q[8];
    float a[2];
    float b[2];
};

// N words of the byte run p (2-byte aligned): out[i] = bytes p+4i .. p+4i+3. Reads N+1 aligned
// words when p is not 4-byte aligned (the weight buffers carry padding past their end).
template <int N>
DEVI void ld_words_a2(const u8 *p, u32 *out) {
    const u32 *base = (const u32 *)((size_t)p & ~(size_t)3);
    const bool odd = ((size_t)p & 2) != 0;
    u32 w[N + 1];
#pragma unroll
    for (int i = 0; i <= N; i++) w[i] = (i < N || odd) ? base[i] : 0u;
#pragma unroll
    for (int i = 0; i < N; i++) out[i] = odd ? fshr(w[i], w[i + 1], 16) : w[i];
}

// The bytes of a 2-byte aligned block at p through 16-byte loads: NC chunks from p rounded down to
// 16 (the weight buffers carry padding past their end), as words w[0 .. 4 NC - 1]; returns p's
// offset in the first. A warp's lanes read Q8_0's 34-byte blocks side by side: word loads at
// 2-byte offsets take ten loads a block, each touching every cache line the warp's blocks span;
// three 16-byte loads take the same lines in fewer passes.
template <int NC>
DEVI int ld_chunks16(const u8 *p, u32 (&w)[4 * NC]) {
    const uint4 *base = (const uint4 *)((size_t)p & ~(size_t)15);
#pragma unroll
    for (int c = 0; c < NC; c++) {
        const uint4 v = base[c];
        w[4 * c] = v.x, w[4 * c + 1] = v.y, w[4 * c + 2] = v.z, w[4 * c + 3] = v.w;
    }
    return (int)((size_t)p & 15);
}

// w[j] := the word at byte off + 4 j of w (off even, 0..15, run time): a shifter of two select
// stages and a funnel shift, no indexed array (which would go to local memory). Words past the
// end of w come out as 0.
template <int N>
DEVI void align_words(u32 (&w)[N], int off) {
#pragma unroll
    for (int b = 1; b <= 2; b <<= 1) {
        const bool take = (off >> 2) & b;
#pragma unroll
        for (int j = 0; j < N; j++) w[j] = take ? (j + b < N ? w[j + b] : 0u) : w[j];
    }
    const u32 sh = (u32)(off & 2) << 3;  // 0 or 16
#pragma unroll
    for (int j = 0; j < N; j++) w[j] = fshr(w[j], j + 1 < N ? w[j + 1] : 0u, sh);
}

// Four 4-bit codes (one per byte, each below 16) -> their four int8 levels of a 16-entry table held as
// four words of four bytes (t0: levels 0-3 ... t3: levels 12-15): the codes' low three bits packed
// into one selector, a byte permute of each half of the table, and each byte taken from the upper
// half where its code's bit 3 is set.
DEVI u32 levels16(u32 codes, u32 t0, u32 t1, u32 t2, u32 t3) {
    const u32 t = codes | (codes >> 4);                 // byte 0: c0 | c1 << 4; byte 2: c2 | c3 << 4
    const u32 sel = bperm(t, 0u, 0x4420u) & 0x7777u;   // nibble j: code j's low three bits
    const u32 lo = bperm(t0, t1, sel), hi = bperm(t2, t3, sel);
    const u32 upper = ((codes >> 3) & 0x01010101u) * 0xFFu;  // 0xFF in the bytes of codes 8..15
    return (lo & ~upper) | (hi & upper);
}

// ggml's IQ4 levels -127 -104 -83 -65 | -49 -35 -22 -10 | 1 13 25 38 | 53 69 89 113
DEVI u32 iq4_levels(u32 codes) { return levels16(codes, 0xBFAD9881u, 0xF6EADDCFu, 0x26190D01u, 0x71594535u); }

// MXFP4's levels, E2M1 values doubled (bit 3: sign): 0 1 2 3 | 4 6 8 12 | 0 -1 -2 -3 | -4 -6 -8 -12
DEVI u32 mxfp4_levels(u32 codes) { return levels16(codes, 0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu); }

// Bits 0..3 of x -> bit 4 of bytes 0..3 (the fifth bit of four 5-bit values).
DEVI u32 spread4_to_bit4(u32 x) {
    return ((x & 1u) << 4) | ((x & 2u) << 11) | ((x & 4u) << 18) | ((x & 8u) << 25);
}

DEVI void set_ab(QUnit &o, float a, float b) {
    o.a[0] = o.a[1] = a;
    o.b[0] = o.b[1] = b;
}

// The 6-bit scale and min of sub-block s (0..7) of a Q4_K/Q5_K super-block; sc12: its 12 scale bytes.
DEVI void k4_scale_min(const u8 *sc12, int s, int &sc, int &m) {
    if (s < 4) {
        sc = sc12[s] & 63;
        m = sc12[s + 4] & 63;
    } else {
        sc = (sc12[s + 4] & 15) | ((sc12[s - 4] >> 6) << 4);
        m = (sc12[s + 4] >> 4) | ((sc12[s] >> 6) << 4);
    }
}

// Q3_K's signed 6-bit scale of 16-value sub-block i (0..15); sc12: its 12 scale bytes.
DEVI int q3_scale(const u8 *sc12, int i) {
    const int low = (sc12[i % 8] >> (4 * (i / 8))) & 15;
    const int high = (sc12[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (low | (high << 4)) - 32;
}

// The K-quants (256-value super-blocks of 8 units).
#define IS_KQ(t) ((t) == T_Q2_K || (t) == T_Q3_K || (t) == T_Q4_K || (t) == T_Q5_K || (t) == T_Q6_K)
#define KQ_BYTES(t) \
    ((t) == T_Q2_K ? 84 : (t) == T_Q3_K ? 110 : (t) == T_Q4_K ? 144 : (t) == T_Q5_K ? 176 : 210)

// The codes of unit s (0..7) of the K-quant super-block sb as stored (unsigned, int8 packed four
// to a word as in QUnit):
//   Q2_K, 84 bytes: scales[16] | qs[64] | f16 d | f16 dmin            (codes 0..3)
//   Q3_K, 110 bytes: hmask[32] | qs[64] | scales[12] | f16 d          (codes 0..7)
//   Q4_K, 144 bytes: f16 d | f16 dmin | scales[12] | qs[128]          (codes 0..15)
//   Q5_K, 176 bytes: f16 d | f16 dmin | scales[12] | qh[32] | qs[128] (codes 0..31)
//   Q6_K, 210 bytes: ql[128] | qh[64] | i8 scales[16] | f16 d         (codes 0..63)
template <int TT>
DEVI void kq_codes(const u8 *__restrict__ sb, int s, int (&q)[8]) {
    if constexpr (TT == T_Q2_K) {
        const int c = s >> 2, j = s & 3;
#pragma unroll
        for (int i = 0; i < 8; i++) q[i] = (int)((ld_u32_a4(sb + 16 + 32 * c + 4 * i) >> (2 * j)) & 0x03030303u);
    } else if constexpr (TT == T_Q3_K) {
        const int c = s >> 2, j = s & 3;
        u32 hm[8], w[8];
        ld_words_a2<8>(sb, hm);
        ld_words_a2<8>(sb + 32 + 32 * c, w);
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = (int)(((w[i] >> (2 * j)) & 0x03030303u) | (((hm[i] >> s) & 0x01010101u) << 2));
    } else if constexpr (TT == T_Q4_K || TT == T_Q5_K) {
        constexpr int qs_at = TT == T_Q4_K ? 16 : 48;
        const uint4 *qs = (const uint4 *)(sb + qs_at + 32 * (s >> 1));  // 16-byte aligned
        const uint4 l0 = qs[0], l1 = qs[1];
        const u32 w[8] = {l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, l1.z, l1.w};
        const int shift = 4 * (s & 1);
#pragma unroll
        for (int i = 0; i < 8; i++) q[i] = (int)((w[i] >> shift) & 0x0F0F0F0Fu);
        if constexpr (TT == T_Q5_K) {
            const uint4 *qh = (const uint4 *)(sb + 16);
            const uint4 h0 = qh[0], h1 = qh[1];
            const u32 hb[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
            for (int i = 0; i < 8; i++) q[i] |= (int)(((hb[i] >> s) & 0x01010101u) << 4);
        }
    } else if constexpr (TT == T_Q6_K) {
        const int c = s >> 2, k = s & 3;
        u32 ql[8], qh[8];
        ld_words_a2<8>(sb + 64 * c + 32 * (k & 1), ql);
        ld_words_a2<8>(sb + 128 + 32 * c, qh);
#pragma unroll
        for (int i = 0; i < 8; i++)
            q[i] = (int)(((ql[i] >> (4 * (k >> 1))) & 0x0F0F0F0Fu) | (((qh[i] >> (2 * k)) & 0x03030303u) << 4));
    }
}

// Four bytes each less c (0 < c <= 128; each byte >= 0 and < 128): int8 results, no borrow between bytes.
DEVI u32 bytes_minus(u32 w, u32 c) { return ((w | 0x80808080u) - c * 0x01010101u) ^ 0x80808080u; }

// Unit s of a K-quant super-block in integers, for sums over a whole super-block (expert_tile_sb):
// value = d * sc[h] * q - dmin * mn[h] for half h, q int8. Q3_K and Q6_K (no mins) give their codes
// less their midpoint (4, 32), mn = 0 and dmin = 0.
struct QUnitSB {
    int q[8];
    int sc[2];
    int mn[2];
    float d, dmin;
};

template <int TT>
DEVI void unit_sb(const u8 *__restrict__ sb, int s, QUnitSB &o) {
    kq_codes<TT>(sb, s, o.q);
    if constexpr (TT == T_Q2_K) {
        const u32 dd = ld_u32_a4(sb + 80);
        o.d = h2f((u16)(dd & 0xFFFFu)), o.dmin = h2f((u16)(dd >> 16));
#pragma unroll
        for (int h = 0; h < 2; h++) o.sc[h] = sb[2 * s + h] & 15, o.mn[h] = sb[2 * s + h] >> 4;
    } else if constexpr (TT == T_Q3_K) {
#pragma unroll
        for (int i = 0; i < 8; i++) o.q[i] = (int)bytes_minus((u32)o.q[i], 4);
        o.d = ld_f16(sb + 108), o.dmin = 0.f;
#pragma unroll
        for (int h = 0; h < 2; h++) o.sc[h] = q3_scale(sb + 96, 2 * s + h), o.mn[h] = 0;
    } else if constexpr (TT == T_Q4_K || TT == T_Q5_K) {
        const u32 dd = ld_u32_a4(sb);
        o.d = h2f((u16)(dd & 0xFFFFu)), o.dmin = h2f((u16)(dd >> 16));
        int sc, m;
        k4_scale_min(sb + 4, s, sc, m);
        o.sc[0] = o.sc[1] = sc, o.mn[0] = o.mn[1] = m;
    } else if constexpr (TT == T_Q6_K) {
#pragma unroll
        for (int i = 0; i < 8; i++) o.q[i] = (int)bytes_minus((u32)o.q[i], 32);
        o.d = ld_f16(sb + 208), o.dmin = 0.f;
#pragma unroll
        for (int h = 0; h < 2; h++) o.sc[h] = (i8)sb[192 + 2 * s + h], o.mn[h] = 0;
    }
}

template <int TT>
DEVI void lowbit_unit_q(const u8 *__restrict__ row, int u, QUnit &o);

// Unit u (values 32u .. 32u+31) of a quantized row.
template <int TT>
DEVI void unit_q(const u8 *__restrict__ row, int u, QUnit &o) {
    if constexpr (TT == T_MXFP4) {  // the device layout (ops.cu mxfp4_regroup): runs of 16 units of
        // 272 bytes, u8 e (E8M0) x 16 | qs[16] x 16; rows start 16-byte aligned
        const u8 *g = row + (size_t)(u >> 4) * MXFP4_RUN_BYTES;
        const u32 e = g[u & 15];
        const float d = as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);  // 2^(e - 128)
        const uint4 qv = *(const uint4 *)(g + 16 + 16 * (u & 15));
        const u32 ws[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 w = ws[i];
            o.q[i] = (int)mxfp4_levels(w & 0x0F0F0F0Fu);
            o.q[i + 4] = (int)mxfp4_levels((w >> 4) & 0x0F0F0F0Fu);
        }
        set_ab(o, d, 0.f);
    } else if constexpr (TT == T_Q4_0 || TT == T_IQ4_NL) {  // 18 bytes: f16 d | qs[16]
        const u8 *b = row + (size_t)u * 18;
        const float d = ld_f16(b);
        u32 w[4];
        ld_words_a2<4>(b + 2, w);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 lo = w[i] & 0x0F0F0F0Fu, hi = (w[i] >> 4) & 0x0F0F0F0Fu;
            o.q[i] = (int)(TT == T_Q4_0 ? lo : iq4_levels(lo));
            o.q[i + 4] = (int)(TT == T_Q4_0 ? hi : iq4_levels(hi));
        }
        set_ab(o, d, TT == T_Q4_0 ? -8.f * d : 0.f);
    } else if constexpr (TT == T_Q4_1) {  // 20 bytes: f16 d | f16 m | qs[16]
        const u8 *b = row + (size_t)u * 20;
        const u32 dm = ld_u32_a4(b);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 w = ld_u32_a4(b + 4 + 4 * i);
            o.q[i] = (int)(w & 0x0F0F0F0Fu);
            o.q[i + 4] = (int)((w >> 4) & 0x0F0F0F0Fu);
        }
        set_ab(o, h2f((u16)(dm & 0xFFFFu)), h2f((u16)(dm >> 16)));
    } else if constexpr (TT == T_Q5_0) {  // 22 bytes: f16 d | u32 qh | qs[16]
        const u8 *b = row + (size_t)u * 22;
        const float d = ld_f16(b);
        u32 w[5];
        ld_words_a2<5>(b + 2, w);
        const u32 qh = w[0];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            o.q[i] = (int)((w[1 + i] & 0x0F0F0F0Fu) | spread4_to_bit4(qh >> (4 * i)));
            o.q[i + 4] = (int)(((w[1 + i] >> 4) & 0x0F0F0F0Fu) | spread4_to_bit4(qh >> (16 + 4 * i)));
        }
        set_ab(o, d, -16.f * d);
    } else if constexpr (TT == T_Q5_1) {  // 24 bytes: f16 d | f16 m | u32 qh | qs[16]
        const u8 *b = row + (size_t)u * 24;
        const u32 dm = ld_u32_a4(b), qh = ld_u32_a4(b + 4);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 w = ld_u32_a4(b + 8 + 4 * i);
            o.q[i] = (int)((w & 0x0F0F0F0Fu) | spread4_to_bit4(qh >> (4 * i)));
            o.q[i + 4] = (int)(((w >> 4) & 0x0F0F0F0Fu) | spread4_to_bit4(qh >> (16 + 4 * i)));
        }
        set_ab(o, h2f((u16)(dm & 0xFFFFu)), h2f((u16)(dm >> 16)));
    } else if constexpr (TT == T_Q8_0) {  // 34 bytes: f16 d | i8 qs[32]
        const u8 *b = row + (size_t)u * 34;
        u32 w[8];
        ld_words_a2<8>(b + 2, w);
#pragma unroll
        for (int i = 0; i < 8; i++) o.q[i] = (int)w[i];
        set_ab(o, ld_f16(b), 0.f);
    } else if constexpr (TT == T_IQ4_XS) {  // 136 bytes: f16 d | u16 scales_h | scales_l[4] | qs[128]
        const u8 *sb = row + (size_t)(u >> 3) * 136;
        const int ib = u & 7;
        const u32 head = ld_u32_a4(sb);
        const int ls = ((sb[4 + ib / 2] >> (4 * (ib & 1))) & 15) | ((((head >> 16) >> (2 * ib)) & 3) << 4);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 w = ld_u32_a4(sb + 8 + 16 * ib + 4 * i);
            o.q[i] = (int)iq4_levels(w & 0x0F0F0F0Fu);
            o.q[i + 4] = (int)iq4_levels((w >> 4) & 0x0F0F0F0Fu);
        }
        set_ab(o, h2f((u16)(head & 0xFFFFu)) * (float)(ls - 32), 0.f);
    } else if constexpr (IS_KQ(TT)) {
        const u8 *sb = row + (size_t)(u >> 3) * KQ_BYTES(TT);
        const int s = u & 7;
        kq_codes<TT>(sb, s, o.q);
        if constexpr (TT == T_Q2_K) {
            const u32 dd = ld_u32_a4(sb + 80);
            const float d = h2f((u16)(dd & 0xFFFFu)), dmin = h2f((u16)(dd >> 16));
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int sc = sb[2 * s + h];
                o.a[h] = d * (float)(sc & 15);
                o.b[h] = -dmin * (float)(sc >> 4);
            }
        } else if constexpr (TT == T_Q3_K) {
            const float d = ld_f16(sb + 108);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                o.a[h] = d * (float)q3_scale(sb + 96, 2 * s + h);
                o.b[h] = -4.f * o.a[h];
            }
        } else if constexpr (TT == T_Q4_K || TT == T_Q5_K) {
            const u32 dd = ld_u32_a4(sb);
            int sc, m;
            k4_scale_min(sb + 4, s, sc, m);
            set_ab(o, h2f((u16)(dd & 0xFFFFu)) * (float)sc, -(h2f((u16)(dd >> 16)) * (float)m));
        } else {  // Q6_K
            const float d = ld_f16(sb + 208);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                o.a[h] = d * (float)(i8)sb[192 + 2 * s + h];
                o.b[h] = -32.f * o.a[h];
            }
        }
    } else if constexpr (IS_LOWBIT(TT)) {
        lowbit_unit_q<TT>(row, u, o);
    }
}

// Float rows read 16 bytes at a time: vector p of a row is values VEC * p .. VEC * p + VEC - 1
// (FLOAT_VEC: 4 of F32, 8 of F16 or BF16), one 16-byte load, so that neighbouring lanes read neighbouring bytes.
template <int TT>
constexpr int FLOAT_VEC = TT == T_F32 ? 4 : 8;
template <int TT>
DEVI void vec_f(const u8 *__restrict__ row, int p, float *v) {
    if constexpr (TT == T_F32) {
        const float4 f = ((const float4 *)row)[p];
        v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
    } else {
        const uint4 h = ((const uint4 *)row)[p];
        const u32 w[4] = {h.x, h.y, h.z, h.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const u16 lo = (u16)(w[j] & 0xFFFFu), hi = (u16)(w[j] >> 16);
            v[2 * j] = TT == T_F16 ? h2f(lo) : bf2f(lo);
            v[2 * j + 1] = TT == T_F16 ? h2f(hi) : bf2f(hi);
        }
    }
}

// The 32 values of unit u as floats, for every supported type.
template <int TT>
DEVI void unit_f(const u8 *__restrict__ row, int u, float *v) {
    if constexpr (TT == T_F32 || TT == T_F16 || TT == T_BF16) {  // the unit's 16-byte vectors
        constexpr int VEC = FLOAT_VEC<TT>;
#pragma unroll
        for (int i = 0; i < 32 / VEC; i++) vec_f<TT>(row, (32 / VEC) * u + i, v + VEC * i);
    } else {
        QUnit o;
        unit_q<TT>(row, u, o);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int h = i >> 2;
#pragma unroll
            for (int j = 0; j < 4; j++) v[4 * i + j] = o.a[h] * (float)(i8)(o.q[i] >> (8 * j)) + o.b[h];
        }
    }
}

// ---- slices: what one lane of a decode product reads at a time ----
//
// A row of a quantized type is cut into k/32 slices of 32 values, as two halves of 16 values
// that lie at 16-aligned offsets xo[0], xo[1] of the row (not always next to each other):
// value = a[h] * q + b[h] for the 16 int8 q of half h (q[4h .. 4h+3], four to a word). For the
// 32-value block types a slice is one block (halves = its two 16-value halves). For the K
// types a slice is chosen so that its quants are 16 contiguous bytes (one 16-byte load where
// the block size allows): slice i of a super-block covers the same byte range in both halves.

struct QSlice {
    int q[8];
    float a[2];
    float b[2];
};

// Row offsets of the two halves of slice s.
template <int TT>
DEVI void slice_offsets(int s, int *xo) {
    if constexpr (TT == T_Q4_K || TT == T_Q5_K) {
        // slice i: qs bytes 16i .. 16i+15 of chunk c = i/2 (low nibbles: values 64c + 16(i&1) ..,
        // high nibbles: 32 values later)
        const int i = s & 7, base = 256 * (s >> 3) + 64 * (i >> 1) + 16 * (i & 1);
        xo[0] = base, xo[1] = base + 32;
    } else if constexpr (TT == T_Q2_K || TT == T_Q3_K || TT == T_Q6_K) {
        // slice i: half n = i/4 of 128 values, pair p = (i/2)&1, l-range lh = i&1: groups g = p and
        // g = p + 2 of 32 values (values 128n + 32g + 16lh ..)
        const int i = s & 7, base = 256 * (s >> 3) + 128 * (i >> 2) + 32 * ((i >> 1) & 1) + 16 * (i & 1);
        xo[0] = base, xo[1] = base + 64;
    } else {
        xo[0] = 32 * s, xo[1] = 32 * s + 16;
    }
}

// Scales and mins of sub-blocks 2c and 2c+1 (chunk c of 64 values) of a Q4_K/Q5_K super-block,
// from its 12 scale bytes in three words: all eight 6-bit fields a byte each, four to a word,
// then the two wanted bytes (k4_scale_min's layout, without per-byte branches).
DEVI void k4_scales_pair(u32 w0, u32 w1, u32 w2, int c, int *sc, int *m) {
    const u32 scw = c < 2 ? (w0 & 0x3F3F3F3Fu) : ((w2 & 0x0F0F0F0Fu) | ((w0 >> 2) & 0x30303030u));
    const u32 mw = c < 2 ? (w1 & 0x3F3F3F3Fu) : (((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 2) & 0x30303030u));
    const int sh = 16 * (c & 1);
    sc[0] = (int)((scw >> sh) & 0xFFu), sc[1] = (int)((scw >> (sh + 8)) & 0xFFu);
    m[0] = (int)((mw >> sh) & 0xFFu), m[1] = (int)((mw >> (sh + 8)) & 0xFFu);
}

// The bytes slice2_q decodes: the super-block's header (f16 d, f16 dmin, 12 scale bytes), the
// chunk's 32 quant bytes and, for Q5_K, the 32 bytes of fifth bits. Loaded apart from the decode
// so that a lane can hold them across a wait (mv_body's pre-loaded steps) in 12 (20) registers.
struct RawK {
    uint4 hd, qa, qb, ha, hb;
};
template <int TT>
DEVI void slice2_raw(const u8 *__restrict__ row, int p, RawK &r) {
    constexpr int size = TT == T_Q4_K ? 144 : 176, qs_at = TT == T_Q4_K ? 16 : 48;
    const u8 *sb = row + (size_t)(p >> 2) * size;
    const int c = p & 3;
    r.hd = *(const uint4 *)sb;
    r.qa = *(const uint4 *)(sb + qs_at + 32 * c), r.qb = *(const uint4 *)(sb + qs_at + 32 * c + 16);
    if constexpr (TT == T_Q5_K) r.ha = *(const uint4 *)(sb + 16), r.hb = *(const uint4 *)(sb + 32);
}

// Slices 2p and 2p+1 of a Q4_K/Q5_K row from their bytes (slice2_raw): chunk c = p % 4 of
// super-block p / 4, one scale decode for both.
template <int TT>
DEVI void slice2_decode(const RawK &r, int p, QSlice &o0, QSlice &o1) {
    const int c = p & 3;
    const u32 wa[4] = {r.qa.x, r.qa.y, r.qa.z, r.qa.w}, wb[4] = {r.qb.x, r.qb.y, r.qb.z, r.qb.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        o0.q[j] = (int)(wa[j] & 0x0F0F0F0Fu);
        o0.q[4 + j] = (int)((wa[j] >> 4) & 0x0F0F0F0Fu);
        o1.q[j] = (int)(wb[j] & 0x0F0F0F0Fu);
        o1.q[4 + j] = (int)((wb[j] >> 4) & 0x0F0F0F0Fu);
    }
    if constexpr (TT == T_Q5_K) {
        const u32 xa[4] = {r.ha.x, r.ha.y, r.ha.z, r.ha.w}, xb[4] = {r.hb.x, r.hb.y, r.hb.z, r.hb.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            o0.q[j] |= (int)(((xa[j] >> (2 * c)) & 0x01010101u) << 4);
            o0.q[4 + j] |= (int)(((xa[j] >> (2 * c + 1)) & 0x01010101u) << 4);
            o1.q[j] |= (int)(((xb[j] >> (2 * c)) & 0x01010101u) << 4);
            o1.q[4 + j] |= (int)(((xb[j] >> (2 * c + 1)) & 0x01010101u) << 4);
        }
    }
    const float d = h2f((u16)(r.hd.x & 0xFFFFu)), dmin = h2f((u16)(r.hd.x >> 16));
    int sc[2], m[2];
    k4_scales_pair(r.hd.y, r.hd.z, r.hd.w, c, sc, m);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        o0.a[h] = o1.a[h] = d * (float)sc[h];
        o0.b[h] = o1.b[h] = -dmin * (float)m[h];
    }
}

// Slices 2p and 2p+1 of a Q4_K/Q5_K row at once: their 32 quant bytes in two 16-byte loads and
// one scale decode for both (decode products take K-quant rows two slices per lane step).
template <int TT>
DEVI void slice2_q(const u8 *__restrict__ row, int p, QSlice &o0, QSlice &o1) {
    RawK r;
    slice2_raw<TT>(row, p, r);
    slice2_decode<TT>(r, p, o0, o1);
}

template <int TT>
DEVI void slice_q(const u8 *__restrict__ row, int s, QSlice &o) {
    if constexpr (TT == T_Q4_K || TT == T_Q5_K) {
        constexpr int size = TT == T_Q4_K ? 144 : 176, qs_at = TT == T_Q4_K ? 16 : 48;
        const u8 *sb = row + (size_t)(s >> 3) * size;  // super-blocks are 16-byte aligned
        const int i = s & 7, c = i >> 1;
        const uint4 hd = *(const uint4 *)sb;  // f16 d | f16 dmin | scales[12]
        const uint4 qv = *(const uint4 *)(sb + qs_at + 16 * i);
        const u32 w[4] = {qv.x, qv.y, qv.z, qv.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            o.q[j] = (int)(w[j] & 0x0F0F0F0Fu);
            o.q[4 + j] = (int)((w[j] >> 4) & 0x0F0F0F0Fu);
        }
        if constexpr (TT == T_Q5_K) {
            const uint4 hv = *(const uint4 *)(sb + 16 + 16 * (i & 1));  // qh bytes of the same l-range
            const u32 h[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                o.q[j] |= (int)(((h[j] >> (2 * c)) & 0x01010101u) << 4);
                o.q[4 + j] |= (int)(((h[j] >> (2 * c + 1)) & 0x01010101u) << 4);
            }
        }
        const float d = h2f((u16)(hd.x & 0xFFFFu)), dmin = h2f((u16)(hd.x >> 16));
        int sc[2], m[2];
        k4_scales_pair(hd.y, hd.z, hd.w, c, sc, m);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            o.a[h] = d * (float)sc[h];
            o.b[h] = -dmin * (float)m[h];
        }
    } else if constexpr (TT == T_Q6_K) {  // 210 bytes: ql[128] | qh[64] | i8 scales[16] | f16 d
        const u8 *sb = row + (size_t)(s >> 3) * 210;
        const int i = s & 7, n = i >> 2, p = (i >> 1) & 1, lh = i & 1;
        u32 ql[4], qh[4];
        ld_words_a2<4>(sb + 64 * n + 32 * p + 16 * lh, ql);
        ld_words_a2<4>(sb + 128 + 32 * n + 16 * lh, qh);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            o.q[j] = (int)((ql[j] & 0x0F0F0F0Fu) | (((qh[j] >> (2 * p)) & 0x03030303u) << 4));
            o.q[4 + j] = (int)(((ql[j] >> 4) & 0x0F0F0F0Fu) | (((qh[j] >> (2 * p + 4)) & 0x03030303u) << 4));
        }
        const float d = ld_f16(sb + 208);
        const int is = 8 * n + 2 * p + lh;  // scale of 16 values: (value offset in the super-block) / 16
        o.a[0] = d * (float)(i8)sb[192 + is];
        o.a[1] = d * (float)(i8)sb[192 + is + 4];
        o.b[0] = -32.f * o.a[0];
        o.b[1] = -32.f * o.a[1];
    } else if constexpr (TT == T_Q2_K) {  // 84 bytes: scales[16] | qs[64] | f16 d | f16 dmin
        const u8 *sb = row + (size_t)(s >> 3) * 84;
        const int i = s & 7, n = i >> 2, p = (i >> 1) & 1, lh = i & 1;
        const u32 *qw = (const u32 *)(sb + 16 + 32 * n + 16 * lh);  // 4-byte aligned
        const u32 dd = ld_u32_a4(sb + 80);
        const float d = h2f((u16)(dd & 0xFFFFu)), dmin = h2f((u16)(dd >> 16));
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const u32 w = qw[j];
            o.q[j] = (int)((w >> (2 * p)) & 0x03030303u);
            o.q[4 + j] = (int)((w >> (2 * p + 4)) & 0x03030303u);
        }
        const int is = 8 * n + 2 * p + lh;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int sc = sb[is + 4 * h];
            o.a[h] = d * (float)(sc & 15);
            o.b[h] = -dmin * (float)(sc >> 4);
        }
    } else if constexpr (TT == T_Q3_K) {  // 110 bytes: hmask[32] | qs[64] | scales[12] | f16 d
        const u8 *sb = row + (size_t)(s >> 3) * 110;
        const int i = s & 7, n = i >> 2, p = (i >> 1) & 1, lh = i & 1;
        u32 hm[4], w[4];
        ld_words_a2<4>(sb + 16 * lh, hm);
        ld_words_a2<4>(sb + 32 + 32 * n + 16 * lh, w);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            o.q[j] = (int)(((w[j] >> (2 * p)) & 0x03030303u) | (((hm[j] >> (4 * n + p)) & 0x01010101u) << 2));
            o.q[4 + j] = (int)(((w[j] >> (2 * p + 4)) & 0x03030303u) | (((hm[j] >> (4 * n + p + 2)) & 0x01010101u) << 2));
        }
        const float d = ld_f16(sb + 108);
        const int is = 8 * n + 2 * p + lh;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            o.a[h] = d * (float)q3_scale(sb + 96, is + 4 * h);
            o.b[h] = -4.f * o.a[h];
        }
    } else if constexpr (TT == T_Q8_0) {  // 34 bytes, 2-byte aligned: f16 d | i8 qs[32]
        // (Q4_0 and Q5_0 so measured no faster: bench/NOTES.md)
        u32 w[12];
        align_words(w, ld_chunks16<3>(row + (size_t)s * 34, w));  // w[0]: f16 d | qs[0..1]
        const float d = h2f((u16)(w[0] & 0xFFFFu));
#pragma unroll
        for (int i = 0; i < 8; i++) o.q[i] = (int)fshr(w[i], w[i + 1], 16);
        o.a[0] = o.a[1] = d, o.b[0] = o.b[1] = 0.f;
    } else {  // one 32-value block (or IQ4_XS sub-block) per slice
        QUnit u;
        unit_q<TT>(row, s, u);
#pragma unroll
        for (int j = 0; j < 8; j++) o.q[j] = u.q[j];
        o.a[0] = u.a[0], o.a[1] = u.a[1], o.b[0] = u.b[0], o.b[1] = u.b[1];
    }
}
