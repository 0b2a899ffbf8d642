/* bf16 activation rows as 15-bit fixed point, per group of PD_ACT_GROUP consecutive k, for
 * the integer dot-product GEMVs (pdserve/engine/kernels/_int8_vnni.c, pdserve/engine/kernels/_int4_gemv.c):
 *
 *   x[m, k] ~= q[m, k] * scale[m, g]      g = k / PD_ACT_GROUP,  |q| <= PD_ACT_MAX
 *
 * scale[m, g] = max |x[m, g's k]| / PD_ACT_MAX and q = round-to-nearest-even(x / scale), so
 * each element's error is at most half a step, max |x in its group| / (2 * PD_ACT_MAX):
 * 2^-15 of the group's largest element, finer than bf16's own rounding of that element
 * (2^-9). A group holds 64 k, so one outlier coarsens only its own group. An all-zero group
 * gets scale 0; a group holding a NaN or an infinity gets scale NaN, so the outputs it
 * reaches are NaN as they would be in float arithmetic.
 *
 * Layout: x [M, K] bf16 with row stride K; q [M, groups * group] int16, zero past K;
 * scale [M, groups]; groups = ceil(K / group) (`pd_act_groups` for PD_ACT_GROUP).
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

/* Groups of `group` k (a multiple of 16; PD_ACT_GROUP unless a kernel says otherwise):
 * scale is [M, ceil(K / group)], q [M, that * group]. */
PD_ACT_TARGET static void pd_act_q16(const uint16_t *x, int64_t M, int64_t K, int64_t group, int16_t *q,
                                     float *scale) {
    const int64_t groups = (K + group - 1) / group, stride = groups * group;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *row = x + m * K;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t k0 = g * group;
            __m512 amax = _mm512_setzero_ps();
            __mmask16 special = 0;
            for (int64_t k = k0; k < k0 + group; k += 16) {
                __m512 v = pd_act_load16(row + k, K - k);
                amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, v));
                special |= _mm512_fpclass_ps_mask(v, 0x99); /* NaN or +-inf */
            }
            float top = _mm512_reduce_max_ps(amax);
            float inv = top > 0.0f && !special ? (float)PD_ACT_MAX / top : 0.0f;
            for (int64_t k = k0; k < k0 + group; k += 16) {
                __m512 v = pd_act_load16(row + k, K - k);
                __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(inv)));
                _mm256_storeu_si256((__m256i *)(q + m * stride + k), _mm512_cvtsepi32_epi16(qi));
            }
            scale[m * groups + g] = special ? NAN : top / (float)PD_ACT_MAX;
        }
    }
}

/* xq = 128 xh + xl with xh in [-128, 127] and xl in [0, 127]: two signed bytes each, for the
 * byte dot products (xh, xl [n] int8). */
static inline void pd_act_split(const int16_t *xq, int64_t n, int8_t *xh, int8_t *xl) {
    for (int64_t i = 0; i < n; i++) {
        xh[i] = (int8_t)(xq[i] >> 7); /* arithmetic: floor(xq / 128) */
        xl[i] = (int8_t)(xq[i] & 127);
    }
}

#endif
