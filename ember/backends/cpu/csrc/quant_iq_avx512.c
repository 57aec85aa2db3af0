/* AVX-512 (BW, VL, VNNI) products of the low-bit types: quant_iq_x86.h's kernels on 32 vector
 * registers, 8 tokens to a tile, so that each block's grid lookups serve twice as many tokens. */
#include "quant_iq.h"

#if defined(EMBER_X86)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
#endif

#define IQ_TOKENS 8
#define IQ_TILE_CASES(name, TYPE)                                                                             \
    case 1: tile_body(TYPE, sizeof(blk_##name), k, w, a, as, y, ys, 1); return;                               \
    case 2: tile_body(TYPE, sizeof(blk_##name), k, w, a, as, y, ys, 2); return;                               \
    case 3: tile_body(TYPE, sizeof(blk_##name), k, w, a, as, y, ys, 3); return;                               \
    case 4: tile_body(TYPE, sizeof(blk_##name), k, w, a, as, y, ys, 4); return;                               \
    case 5: case 6: case 7: tile_body(TYPE, sizeof(blk_##name), k, w, a, as, y, ys, nc); return;
#include "quant_iq_x86.h"

const ember_kernels ember_kernels_iq_avx512 = {IQ_X86_TILES};

#if defined(__clang__)
#pragma clang attribute pop
#endif

#else
const ember_kernels ember_kernels_iq_avx512 = {0};
#endif
