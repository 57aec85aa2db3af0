// Units of the low-bit types (IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S TQ1_0 TQ2_0) for
// quant.cuh's unit_q: 32 signed int8 values q and value = a[h] * q (b = 0), with q and a as the CPU
// kernels define them (csrc/quant_iq.h): grid values times their signs (IQ1: 8 grid +- 1; TQ: the
// trit minus 1) and a = the block's factor times the odd scale of the half. a * q rounds once, to
// exactly the numpy reference's value. The grids are ember/quant/grids.py's compact codes: 2- or
// 3-bit fields indexing a few levels, expanded four values at a time by a byte permute.

#ifdef EMBER_HOST_TEST
#define IQ_TABLE static const
static inline int iq_popc(u32 x) { return __builtin_popcount(x); }
#else
#define IQ_TABLE static __device__ const
DEVI int iq_popc(u32 x) { return __popc(x); }
#endif

// iq2_xxs_codes ... iq1_s_codes: the tables of ember/quant/grids.py, inserted here by
// _kernels.low_bit_source (IQ_TABLE u16 NAME_codes[entries]).
// @grid tables@


// Levels as bytes for the byte permute: IQ2 {8, 25, 43}, IQ1 8 * {-1, 0, 1}, IQ3_XXS and IQ3_S 8 each.
#define IQ2_LEVELS 0x002B1908u
#define IQ1_LEVELS 0x000800F8u
#define IQ3XXS_LO 0x1C140C04u
#define IQ3XXS_HI 0x3E342C24u
#define IQ3S_LO 0x07050301u
#define IQ3S_HI 0x0F0D0B09u

DEVI u16 ld_u16(const u8 *p) { return *(const u16 *)p; }  // p 2-byte aligned
DEVI u32 ld_u32_a2(const u8 *p) { return (u32)ld_u16(p) | ((u32)ld_u16(p + 2) << 16); }

// Four fields of `bits` bits of code (from field f0) -> the byte-permute selector picking their levels.
template <int BITS>
DEVI u32 iq_selector(u32 code, int f0) {
    u32 sel = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) sel |= ((code >> (BITS * (f0 + j))) & ((1u << BITS) - 1)) << (4 * j);
    return sel;
}

// Bytes of g negated where bit j of the 4-bit m is set.
DEVI u32 iq_signs4(u32 g, u32 m) {
    u32 r = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int v = (int)(i8)(g >> (8 * j));
        r |= ((u32)((m >> j) & 1u ? -v : v) & 0xFFu) << (8 * j);
    }
    return r;
}

// Bytes of g plus delta (+-1; results stay within -9..9).
DEVI u32 iq_add4(u32 g, int delta) {
    u32 r = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) r |= ((u32)((int)(i8)(g >> (8 * j)) + delta) & 0xFFu) << (8 * j);
    return r;
}

// The eight signs of 7 stored bits, the eighth making the count of minus signs even.
DEVI u32 iq_ksigns(u32 s7) { return s7 | ((u32)(iq_popc(s7) & 1) << 7); }

// 8 values of a 2-bit grid entry with an 8-bit sign mask -> q[0], q[1].
DEVI void iq2_put(u16 code, u32 mask, int *q) {
    q[0] = (int)iq_signs4(bperm(IQ2_LEVELS, 0u, iq_selector<2>(code, 0)), mask & 15u);
    q[1] = (int)iq_signs4(bperm(IQ2_LEVELS, 0u, iq_selector<2>(code, 4)), mask >> 4);
}

DEVI u32 iq3xxs_word(u16 code) { return bperm(IQ3XXS_LO, IQ3XXS_HI, iq_selector<3>(code, 0)); }
DEVI u32 iq3s_word(u16 code) { return bperm(IQ3S_LO, IQ3S_HI, iq_selector<3>(code, 0)); }

DEVI void iq1_put(u16 code, int delta, int *q) {
    q[0] = (int)iq_add4(bperm(IQ1_LEVELS, 0u, iq_selector<2>(code, 0)), delta);
    q[1] = (int)iq_add4(bperm(IQ1_LEVELS, 0u, iq_selector<2>(code, 4)), delta);
}

// TQ1_0 value v (0..255) of a block: its trit (0..2) minus 1.
DEVI int tq1_value(const u8 *b, int v) {
    int byte, trit;
    if (v < 160) byte = b[v % 32], trit = v / 32;
    else if (v < 240) byte = b[32 + (v - 160) % 16], trit = (v - 160) / 16;
    else byte = b[48 + (v - 240) % 4], trit = (v - 240) / 4;
    const u32 pow3 = trit == 0 ? 1u : trit == 1 ? 3u : trit == 2 ? 9u : trit == 3 ? 27u : 81u;
    return (int)((((u32)byte * pow3) & 0xFFu) * 3u >> 8) - 1;
}

template <int TT>
DEVI void lowbit_unit_q(const u8 *__restrict__ row, int u, QUnit &o) {
    const int ib = u & 7;
    if constexpr (TT == T_IQ2_XXS) {  // 66 bytes: f16 d | (u32 grid bytes, u32 signs + scale) x 8
        const u8 *sb = row + (size_t)(u >> 3) * 66;
        const u32 a0 = ld_u32_a2(sb + 2 + 8 * ib), a1 = ld_u32_a2(sb + 6 + 8 * ib);
#pragma unroll
        for (int l = 0; l < 4; l++) iq2_put(iq2_xxs_codes[(a0 >> (8 * l)) & 255u], iq_ksigns((a1 >> (7 * l)) & 127u), o.q + 2 * l);
        const float a = ld_f16(sb) * 0.125f * (float)(2 * (int)(a1 >> 28) + 1);
        o.a[0] = o.a[1] = a;
    } else if constexpr (TT == T_IQ2_XS) {  // 74 bytes: f16 d | u16 qs[32] | scales[8]
        const u8 *sb = row + (size_t)(u >> 3) * 74;
#pragma unroll
        for (int l = 0; l < 4; l++) {
            const u32 q = ld_u16(sb + 2 + 2 * (4 * ib + l));
            iq2_put(iq2_xs_codes[q & 511u], iq_ksigns(q >> 9), o.q + 2 * l);
        }
        const float f = ld_f16(sb) * 0.125f;
        const int s = sb[66 + ib];
        o.a[0] = f * (float)(2 * (s & 15) + 1), o.a[1] = f * (float)(2 * (s >> 4) + 1);
    } else if constexpr (TT == T_IQ2_S) {  // 82 bytes: f16 d | qs[32] | signs[32] | qh[8] | scales[8]
        const u8 *sb = row + (size_t)(u >> 3) * 82;
        const int h = sb[66 + ib];
#pragma unroll
        for (int l = 0; l < 4; l++) {
            const int idx = sb[2 + 4 * ib + l] | (((h >> (2 * l)) & 3) << 8);
            iq2_put(iq2_s_codes[idx], sb[34 + 4 * ib + l], o.q + 2 * l);
        }
        const float f = ld_f16(sb) * 0.125f;
        const int s = sb[74 + ib];
        o.a[0] = f * (float)(2 * (s & 15) + 1), o.a[1] = f * (float)(2 * (s >> 4) + 1);
    } else if constexpr (TT == T_IQ3_XXS) {  // 98 bytes: f16 d | qs[64] | u32 signs + scale x 8
        const u8 *sb = row + (size_t)(u >> 3) * 98;
        const u32 aux = ld_u32_a2(sb + 66 + 4 * ib);
#pragma unroll
        for (int l = 0; l < 4; l++) {
            const u32 m = iq_ksigns((aux >> (7 * l)) & 127u);
            o.q[2 * l] = (int)iq_signs4(iq3xxs_word(iq3_xxs_codes[sb[2 + 8 * ib + 2 * l]]), m & 15u);
            o.q[2 * l + 1] = (int)iq_signs4(iq3xxs_word(iq3_xxs_codes[sb[3 + 8 * ib + 2 * l]]), m >> 4);
        }
        const float a = ld_f16(sb) * 0.25f * (float)(2 * (int)(aux >> 28) + 1);
        o.a[0] = o.a[1] = a;
    } else if constexpr (TT == T_IQ3_S) {  // 110 bytes: f16 d | qs[64] | qh[8] | signs[32] | scales[4]
        const u8 *sb = row + (size_t)(u >> 3) * 110;
        const int h = sb[66 + ib];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int idx = sb[2 + 8 * ib + j] | (((h >> j) & 1) << 8);
            o.q[j] = (int)iq_signs4(iq3s_word(iq3_s_codes[idx]), ((u32)sb[74 + 4 * ib + j / 2] >> (4 * (j & 1))) & 15u);
        }
        const float a = ld_f16(sb) * (float)(2 * ((sb[106 + ib / 2] >> (4 * (ib & 1))) & 15) + 1);
        o.a[0] = o.a[1] = a;
    } else if constexpr (TT == T_IQ1_S) {  // 50 bytes: f16 d | qs[32] | u16 qh[8]
        const u8 *sb = row + (size_t)(u >> 3) * 50;
        const int h = ld_u16(sb + 34 + 2 * ib), delta = h & 0x8000 ? -1 : 1;
#pragma unroll
        for (int l = 0; l < 4; l++) iq1_put(iq1_s_codes[sb[2 + 4 * ib + l] | (((h >> (3 * l)) & 7) << 8)], delta, o.q + 2 * l);
        const float a = ld_f16(sb) * 0.125f * (float)(2 * ((h >> 12) & 7) + 1);
        o.a[0] = o.a[1] = a;
    } else if constexpr (TT == T_IQ1_M) {  // 56 bytes: qs[32] | qh[16] | u16 scales[4] (d: their top nibbles)
        const u8 *sb = row + (size_t)(u >> 3) * 56;
        u32 sc[4];
#pragma unroll
        for (int j = 0; j < 4; j++) sc[j] = ld_u16(sb + 48 + 2 * j);
        const u16 dbits = (u16)((sc[0] >> 12) | ((sc[1] >> 8) & 0xF0u) | ((sc[2] >> 4) & 0xF00u) | (sc[3] & 0xF000u));
#pragma unroll
        for (int l = 0; l < 4; l++) {
            const int nib = (sb[32 + 2 * ib + l / 2] >> (4 * (l & 1))) & 15;
            iq1_put(iq1_s_codes[sb[4 * ib + l] | ((nib & 7) << 8)], nib & 8 ? -1 : 1, o.q + 2 * l);
        }
        const float f = h2f(dbits) * 0.125f;
        const u32 w = sc[ib / 2] >> (6 * (ib & 1));
        o.a[0] = f * (float)(2 * (int)(w & 7u) + 1), o.a[1] = f * (float)(2 * (int)((w >> 3) & 7u) + 1);
    } else if constexpr (TT == T_TQ1_0) {  // 54 bytes: qs[48] | qh[4] | f16 d
        const u8 *sb = row + (size_t)(u >> 3) * 54;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 r = 0;
#pragma unroll
            for (int j = 0; j < 4; j++) r |= ((u32)tq1_value(sb, 32 * ib + 4 * i + j) & 0xFFu) << (8 * j);
            o.q[i] = (int)r;
        }
        o.a[0] = o.a[1] = ld_f16(sb + 52);
    } else if constexpr (TT == T_TQ2_0) {  // 66 bytes: qs[64] | f16 d; value 128 h + 32 i + m: bits 2i of qs[32 h + m]
        const u8 *sb = row + (size_t)(u >> 3) * 66;
        const int sh = 2 * (ib & 3);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 t = (ld_u32_a2(sb + 32 * (ib >> 2) + 4 * i) >> sh) & 0x03030303u;
            o.q[i] = (int)(((t | 0x80808080u) - 0x01010101u) ^ 0x80808080u);  // each byte minus 1, no borrows
        }
        o.a[0] = o.a[1] = ld_f16(sb + 64);
    }
    o.b[0] = o.b[1] = 0.f;
}
