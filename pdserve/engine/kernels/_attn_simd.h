/* Helpers shared by the in-place decode attention loops (pdserve/engine/kernels/_attn_bf16.c,
 * pdserve/engine/kernels/_attn_q8.c) and pdserve/engine/kernels/_cpu_kernels.c. The vector ones are AVX-512F only, so
 * either loop's wider target may inline them; the scalar bf16 conversions carry no
 * target, so every target_clones clone of a caller inlines them too. */
#ifndef PD_ATTN_SIMD_H
#define PD_ATTN_SIMD_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PD_SIMD_INLINE __attribute__((always_inline, target("avx512f"))) static inline

/* bf16 bits -> float32 (exact). */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 -> bf16 bits, rounded to nearest even. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN stays a (quiet) NaN */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 16 bf16 at p as float32 (exact). */
PD_SIMD_INLINE __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* sum16's tree, one level at a time: each level adds two vectors' partials lane-wise after
 * a shuffle, so lane i of the last level holds vector i's sum. Level 1 (two vectors a, b):
 * per 128-bit block a0+a2, b0+b2, a1+a3, b1+b3. */
PD_SIMD_INLINE __m512 sum_level1(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

/* Level 2 (two level-1 results): per 128-bit block, vectors 4j..4j+3's lane partials. */
PD_SIMD_INLINE __m512 sum_level2(__m512 s0, __m512 s1) {
    __m512d a = _mm512_castps_pd(s0), b = _mm512_castps_pd(s1);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

/* Levels 3 and 4 (two results of the level below): 128-bit blocks paired across them. */
PD_SIMD_INLINE __m512 sum_level34(__m512 u0, __m512 u1) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* r[i] = the sum of v[i]'s 16 lanes, for 16 vectors. */
PD_SIMD_INLINE __m512 sum16(const __m512 *v) {
    __m512 u[4];
    for (int j = 0; j < 4; j++)
        u[j] = sum_level2(sum_level1(v[4 * j], v[4 * j + 1]), sum_level1(v[4 * j + 2], v[4 * j + 3]));
    return sum_level34(sum_level34(u[0], u[1]), sum_level34(u[2], u[3]));
}

/* e^x for x <= 0 (Cephes expf's reduction and polynomial; 2^n applied by scalef). */
PD_SIMD_INLINE __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Softmax in place over each of G rows of L scores (`sc`, L apart). */
PD_SIMD_INLINE void softmax_rows(float *sc, int64_t G, int64_t L) {
    for (int64_t g = 0; g < G; g++) {
        float *s = sc + g * L;
        __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t t0 = 0; t0 < L; t0 += 16) {
            __mmask16 m = (__mmask16)(L - t0 >= 16 ? 0xFFFF : (1u << (L - t0)) - 1u);
            mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, s + t0));
        }
        __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        for (int64_t t0 = 0; t0 < L; t0 += 16) {
            __mmask16 m = (__mmask16)(L - t0 >= 16 ? 0xFFFF : (1u << (L - t0)) - 1u);
            __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t0), mv)));
            sum = _mm512_add_ps(sum, e);
            _mm512_mask_storeu_ps(s + t0, m, e);
        }
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        for (int64_t t0 = 0; t0 < L; t0 += 16) {
            __mmask16 m = (__mmask16)(L - t0 >= 16 ? 0xFFFF : (1u << (L - t0)) - 1u);
            _mm512_mask_storeu_ps(s + t0, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t0), inv));
        }
    }
}

/* p . V runs in passes over the query heads: GB heads a pass, each with DV = D / 16
 * float32 accumulators, GB x DV = 16 of them held in registers over the whole context.
 * Zeroes a pass's accumulators; returns how many heads the pass starting at head g0 of
 * G covers (GB, or fewer in the last pass). */
PD_SIMD_INLINE int64_t pv_pass_begin(__m512 *acc, int64_t G, int64_t g0, int GB) {
    for (int i = 0; i < 16; i++)
        acc[i] = _mm512_setzero_ps();
    return G - g0 < GB ? G - g0 : GB;
}

/* Key t of the pass from head g0: acc[g][j] += (sc[(g0 + g) * L + t] x w) x row[j] for
 * its gn heads, where sc holds every head's L probabilities, w is the V row's scale (1
 * for a plain pool) and row the key's V row as DV vectors. */
PD_SIMD_INLINE void pv_accumulate(__m512 *acc, const __m512 *row, const float *sc, int64_t L, int64_t t,
                                  int64_t g0, int64_t gn, int GB, int DV, float w) {
    for (int g = 0; g < GB; g++) {
        if (g >= gn)
            break;
        __m512 pg = _mm512_set1_ps(sc[(g0 + g) * L + t] * w);
        for (int j = 0; j < DV; j++)
            acc[g * DV + j] = _mm512_fmadd_ps(pg, row[j], acc[g * DV + j]);
    }
}

#endif
