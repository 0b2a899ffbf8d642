/* bf16 activation rows as 15-bit fixed point, per group of PD_ACT_GROUP consecutive k, for
 * the integer dot-product GEMVs (engine/_int8_vnni.c, engine/_int4_gemv.c):
 *
 *   x[m, k] ~= q[m, k] * scale[m, g]      g = k / PD_ACT_GROUP,  |q| <= PD_ACT_MAX
 *
 * scale[m, g] = max |x[m, g's k]| / PD_ACT_MAX and q = round-to-nearest-even(x / scale), so
 * each element's error is at most half a step, max |x in its group| / (2 * PD_ACT_MAX):
 * 2^-15 of the group's largest element, finer than bf16's own rounding of that element
 * (2^-9). A group holds 64 k, so one outlier coarsens only its own group. An all-zero group
 * gets scale 0; a group holding a NaN or an infinity gets scale NaN, so the outputs it
 * reaches are NaN as they would be in float arithmetic. `sum[m, g]` is the group's sum of q
 * (the int4 kernel's offset term needs it; NULL skips it).
 *
 * Layout: x [M, K] bf16 with row stride K; q [M, groups * PD_ACT_GROUP] int16, zero past K;
 * scale and sum [M, groups]; groups = pd_act_groups(K).
 */
#ifndef PD_ACT_Q16_H
#define PD_ACT_Q16_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define PD_ACT_GROUP 64
#define PD_ACT_MAX 16383 /* 2^14 - 1: a pair of products of int8 codes stays far from 2^31 */

#define PD_ACT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

static inline int64_t pd_act_groups(int64_t K) { return (K + PD_ACT_GROUP - 1) / PD_ACT_GROUP; }

/* 16 bf16 at p (the first `n` of them; zeros past) as float32. */
PD_ACT_TARGET static inline __m512 pd_act_load16(const uint16_t *p, int64_t n) {
    __mmask16 mask = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
    __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

PD_ACT_TARGET static void pd_act_q16(const uint16_t *x, int64_t M, int64_t K, int16_t *q,
                                     float *scale, int32_t *sum) {
    const int64_t groups = pd_act_groups(K), stride = groups * PD_ACT_GROUP;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *row = x + m * K;
        for (int64_t g = 0; g < groups; g++) {
            int64_t k0 = g * PD_ACT_GROUP;
            __m512 v[4];
            __m512 amax = _mm512_setzero_ps();
            __mmask16 special = 0;
            for (int j = 0; j < 4; j++) {
                v[j] = pd_act_load16(row + k0 + 16 * j, K - k0 - 16 * j);
                amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, v[j]));
                special |= _mm512_fpclass_ps_mask(v[j], 0x99); /* NaN or +-inf */
            }
            float top = _mm512_reduce_max_ps(amax);
            float inv = top > 0.0f ? (float)PD_ACT_MAX / top : 0.0f;
            float s = special ? NAN : top / (float)PD_ACT_MAX;
            if (special)
                inv = 0.0f;
            __m512i total = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++) {
                __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], _mm512_set1_ps(inv)));
                total = _mm512_add_epi32(total, qi);
                _mm256_storeu_si256((__m256i *)(q + m * stride + k0 + 16 * j), _mm512_cvtsepi32_epi16(qi));
            }
            scale[m * groups + g] = s;
            if (sum != NULL)
                sum[m * groups + g] = _mm512_reduce_add_epi32(total);
        }
    }
}

#endif
