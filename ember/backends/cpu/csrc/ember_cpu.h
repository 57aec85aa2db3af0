/* Internal header shared by the CPU kernels. */
#ifndef EMBER_CPU_H
#define EMBER_CPU_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "api_core.h"

#if defined(__x86_64__) || defined(_M_X64)
#define EMBER_X86 1
#endif
#if defined(__aarch64__)
#define EMBER_ARM64 1
#endif

#define EMBER_MIN(a, b) ((a) < (b) ? (a) : (b))
#define EMBER_MAX(a, b) ((a) > (b) ? (a) : (b))

/* ---- instruction-set dispatch ---- */
enum ember_isa { EMBER_ISA_SCALAR = 0, EMBER_ISA_AVX2 = 1, EMBER_ISA_AVX512 = 2, EMBER_ISA_NEON = 3 };
/* The path chosen at load (best available, or EMBER_CPU_ISA from the environment). */
extern int ember_isa_active;
/* 1 where the AVX-512 kernels may use GFNI (the CPU has it; ember_cpu_set_gfni turns it off for tests). */
extern int ember_x86_gfni;

/* ---- floating-point state ---- */
/* The kernels run with subnormal floats flushed to zero (inputs and results): a product of two small
 * scales (a weight block's and an activation block's) can land below 2^-126, where the processor
 * takes a slow assist on every operation (measured: a 2048 x 8192 Q4_K decode product 0.37 ms with
 * normal activations, 5.5 ms with activations near 1e-34, which a synthetic model's silu gave). Values
 * that small change no logit. The pool's workers set it once; the caller's thread for the time of
 * a call into the kernels (ember_fp_enter / ember_fp_leave), so Python's own arithmetic is untouched. */
#if defined(EMBER_X86)
#include <xmmintrin.h>
typedef unsigned int ember_fp_state;
static inline ember_fp_state ember_fp_enter(void) {
    const unsigned int old = _mm_getcsr();
    _mm_setcsr(old | 0x8040u); /* FTZ (bit 15) and DAZ (bit 6) */
    return old;
}
static inline void ember_fp_leave(ember_fp_state old) { _mm_setcsr(old); }
#elif defined(EMBER_ARM64)
typedef uint64_t ember_fp_state;
static inline ember_fp_state ember_fp_enter(void) {
    uint64_t old;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(old));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(old | (1ull << 24))); /* FZ */
    return old;
}
static inline void ember_fp_leave(ember_fp_state old) { __asm__ __volatile__("msr fpcr, %0" : : "r"(old)); }
#else
typedef int ember_fp_state;
static inline ember_fp_state ember_fp_enter(void) { return 0; }
static inline void ember_fp_leave(ember_fp_state old) { (void)old; }
#endif

/* ---- threads ---- */
/* fn runs once for each share index ith in [0, nth), nth = the pool's thread count, each on whichever
 * thread claims it first (the caller takes part): a share must never wait for another, which may be
 * run later by the same thread. Returns when every share has finished. */
typedef void (*ember_task_fn)(void *ctx, int ith, int nth);
void ember_parallel(ember_pool *pool, ember_task_fn fn, void *ctx);

/* A pause in the work (the end of a whole step): idle workers go to sleep at once instead of spinning
 * for the next job, leaving the cores to the caller's own work until ember_parallel wakes them. */
void ember_pool_rest(ember_pool *pool);

/* Split [0, n) into nth nearly equal contiguous ranges; range ith is [*lo, *hi). */
static inline void ember_split(int64_t n, int ith, int nth, int64_t *lo, int64_t *hi) {
    int64_t per = n / nth, extra = n % nth;
    *lo = ith * per + (ith < extra ? ith : extra);
    *hi = *lo + per + (ith < extra ? 1 : 0);
}

/* ---- half and bfloat16 conversion ---- */
extern float ember_f16_table[65536];

static inline float ember_f16_to_f32(uint16_t h) { return ember_f16_table[h]; }

/* Round to nearest even; infinities and NaN preserved. */
static inline uint16_t ember_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow to inf */
    if (ax < 0x38800000u) { /* subnormal or zero in half */
        if (ax < 0x33000000u) return (uint16_t)sign;
        uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        int shift = 126 - (int)(ax >> 23); /* 14..24: half subnormals count units of 2^-24 */
        uint32_t r = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((ax >> 13) - (112u << 10));
    uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) r++;
    return (uint16_t)(sign | r);
}

static inline float ember_bf16_to_f32(uint16_t h) {
    uint32_t x = (uint32_t)h << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

#endif
