/* CPU feature detection, the dispatch choice, and shared tables. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ember_cpu.h"

float ember_f16_table[65536];
int ember_isa_active = EMBER_ISA_SCALAR;
int ember_x86_gfni = 0;

static float f16_bits_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ffu, x;
    if (exp == 0) {
        if (man == 0) {
            x = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400u));
            x = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        x = sign | 0x7f800000u | (man << 13);
    } else {
        x = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static int isa_supported(int isa) {
    switch (isa) {
    case EMBER_ISA_SCALAR: return 1;
#if defined(EMBER_X86)
    case EMBER_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case EMBER_ISA_AVX512:
        return isa_supported(EMBER_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
#endif
#if defined(EMBER_ARM64)
    case EMBER_ISA_NEON: return 1;
#endif
    default: return 0;
    }
}

static const char *isa_names[] = {"scalar", "avx2", "avx512", "neon"};

const char *ember_cpu_isa(void) { return isa_names[ember_isa_active]; }

int ember_cpu_set_isa(const char *name) {
    for (int i = 0; i < 4; i++) {
        if (strcmp(name, isa_names[i]) == 0 && isa_supported(i)) {
            ember_isa_active = i;
            return 0;
        }
    }
    return -1;
}

static int gfni_supported(void) {
#if defined(EMBER_X86)
    return __builtin_cpu_supports("gfni");
#else
    return 0;
#endif
}

int ember_cpu_set_gfni(int on) {
    if (on && !gfni_supported()) return -1;
    ember_x86_gfni = on != 0;
    return 0;
}

const char *ember_cpu_features(void) {
    static char buf[256];
    buf[0] = 0;
#if defined(EMBER_X86)
    static const char *names[] = {"sse4.2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw",
                                  "avx512vl", "avx512dq", "avx512vnni", "avx512bf16", "avxvnni", "gfni"};
    int has[] = {__builtin_cpu_supports("sse4.2"), __builtin_cpu_supports("avx"),
                 __builtin_cpu_supports("avx2"), __builtin_cpu_supports("fma"),
                 __builtin_cpu_supports("f16c"), __builtin_cpu_supports("avx512f"),
                 __builtin_cpu_supports("avx512bw"), __builtin_cpu_supports("avx512vl"),
                 __builtin_cpu_supports("avx512dq"), __builtin_cpu_supports("avx512vnni"),
                 __builtin_cpu_supports("avx512bf16"), __builtin_cpu_supports("avxvnni"),
                 __builtin_cpu_supports("gfni")};
    _Static_assert(sizeof names / sizeof *names == sizeof has / sizeof *has, "a name for each feature");
    for (int i = 0; i < (int)(sizeof has / sizeof *has); i++) {
        if (has[i]) {
            strcat(buf, buf[0] ? " " : "");
            strcat(buf, names[i]);
        }
    }
#elif defined(EMBER_ARM64)
    strcpy(buf, "neon");
#endif
    return buf;
}

/* Runs when the shared library is loaded. */
__attribute__((constructor)) static void ember_cpu_init(void) {
    for (uint32_t i = 0; i < 65536; i++) ember_f16_table[i] = f16_bits_to_f32((uint16_t)i);
#if defined(EMBER_X86)
    __builtin_cpu_init();
#endif
    ember_x86_gfni = gfni_supported();
    for (int isa = 3; isa >= 0; isa--) {
        if (isa_supported(isa)) {
            ember_isa_active = isa;
            break;
        }
    }
    const char *forced = getenv("EMBER_CPU_ISA");
    if (forced && *forced && ember_cpu_set_isa(forced) != 0)
        fprintf(stderr, "ember: EMBER_CPU_ISA=%s is not available on this CPU; using %s\n", forced,
                ember_cpu_isa());
}

/* ---- memory read speed ---- */

typedef struct {
    const uint64_t *words;
    int64_t n_lines;
    atomic_uint_fast64_t x; /* each share's XOR folded in once, at its end */
} stream_job;

static void stream_task(void *ctx, int ith, int nth) {
    stream_job *j = ctx;
    int64_t lo, hi;
    ember_split(j->n_lines, ith, nth, &lo, &hi);
    uint64_t acc[8] = {0}; /* eight independent chains: the compiler makes them vector XORs */
    for (const uint64_t *p = j->words + 8 * lo, *end = j->words + 8 * hi; p < end; p += 8)
        for (int w = 0; w < 8; w++) acc[w] ^= p[w];
    for (int w = 1; w < 8; w++) acc[0] ^= acc[w];
    atomic_fetch_xor(&j->x, acc[0]);
}

uint64_t ember_stream_read(ember_pool *pool, const void *buf, int64_t bytes) {
    stream_job j = {.words = buf, .n_lines = bytes / 64};
    atomic_init(&j.x, 0);
    ember_parallel(pool, stream_task, &j);
    return atomic_load(&j.x);
}
