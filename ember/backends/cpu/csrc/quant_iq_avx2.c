/* AVX2 products of the low-bit types (quant_iq_x86.h); chosen at run time when the CPU has AVX2. */
#include "quant_iq.h"

#if defined(EMBER_X86)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c")
#endif

#define IQ_TOKENS 4
#define IQ_TILE_CASES(name, TYPE)                                                                             \
    case 1: tile_body(TYPE, sizeof(blk_##name), k, w, a, as, y, ys, 1); return;                               \
    case 2: tile_body(TYPE, sizeof(blk_##name), k, w, a, as, y, ys, 2); return;                               \
    case 3: tile_body(TYPE, sizeof(blk_##name), k, w, a, as, y, ys, 3); return;
#include "quant_iq_x86.h"

const ember_kernels ember_kernels_iq_avx2 = {IQ_X86_TILES};

#if defined(__clang__)
#pragma clang attribute pop
#endif

#else
const ember_kernels ember_kernels_iq_avx2 = {0};
#endif
