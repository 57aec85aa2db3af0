/* A 16 x 16 block of floats transposed in registers (AVX-512), for the files compiled with AVX-512
 * targets (include after their target pragma and <immintrin.h>). */
#ifndef EMBER_TRANSPOSE_AVX512_H
#define EMBER_TRANSPOSE_AVX512_H

/* v[j] lane i <- v[i] lane j: pairs of rows interleaved, then quadruples; then lanes of 128 bits gathered
 * across them. */
static inline __attribute__((always_inline)) void ember_transpose16_ps(__m512 v[16]) {
    __m512 t[16], q[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int g = 0; g < 16; g += 4) { /* q[g + j], 128-bit lane L: rows g..g+3, value 4 L + j */
        q[g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[g]), _mm512_castps_pd(t[g + 2])));
        q[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[g]), _mm512_castps_pd(t[g + 2])));
        q[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[g + 1]), _mm512_castps_pd(t[g + 3])));
        q[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[g + 1]), _mm512_castps_pd(t[g + 3])));
    }
    for (int j = 0; j < 4; j++) {
        const __m512 a = _mm512_shuffle_f32x4(q[j], q[4 + j], 0x88), b = _mm512_shuffle_f32x4(q[8 + j], q[12 + j], 0x88);
        const __m512 c = _mm512_shuffle_f32x4(q[j], q[4 + j], 0xdd), d = _mm512_shuffle_f32x4(q[8 + j], q[12 + j], 0xdd);
        v[j] = _mm512_shuffle_f32x4(a, b, 0x88);
        v[8 + j] = _mm512_shuffle_f32x4(a, b, 0xdd);
        v[4 + j] = _mm512_shuffle_f32x4(c, d, 0x88);
        v[12 + j] = _mm512_shuffle_f32x4(c, d, 0xdd);
    }
}

#endif
