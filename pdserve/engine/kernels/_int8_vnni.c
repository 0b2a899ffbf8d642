/* The int8 weight GEMV on integer dot products, for 1 to PD_GEMV_ROWS rows of bf16
 * activations (dispatched from pd_int8_gemm_bf16 in _int8_gemm.c, same packed layout):
 *
 *   y[m, n] = bf16( scale[n] * sum_g xs[m, g] * sum_{k in g} xq[m, k] * q[n, k] )
 *
 * where xq, xs are x as 15-bit fixed point per group of 64 k (_act_q16.h: each element off
 * by at most 2^-15 of its group's largest). Decode is one row per sequence, and the int8
 * model only wins by streaming its codes at memory speed, so the loop spends as little as
 * it can per code byte: the float32 GEMV (_int8_gemv.c) needs six instructions per 32 codes
 * (two sign-extends, two converts, two FMAs) and on one core cannot keep up with memory.
 * Here 32 codes (16 channels x 2 k) sign-extend to int16 in one instruction and meet the
 * row's (xq[k], xq[k+1]) pair, broadcast from memory, in one `vpdpwssd` (int16 pairs summed
 * into int32 lanes, one lane per channel): exact integer sums, no horizontal reduction.
 * Each group's int32 sums are converted and scaled into float32 accumulators (|sum| <=
 * 64 * 16383 * 128 < 2^27: no overflow); the per-channel scale is applied once, to the final
 * sums. Several k pairs per step keep independent accumulators in flight; codes are
 * prefetched ahead; tiles are spread over OpenMP threads in contiguous runs.
 * Needs AVX-512 VNNI beside AVX-512 BF16 (`pd_int8_gemm_supported` checks both).
 */
#include "_act_q16.h"
#include "_int8_gemm.h"

#include <stdlib.h>
#include <string.h>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl,avx512dq,avx512vnni")))

#ifndef PD_VNNI_PREFETCH
#define PD_VNNI_PREFETCH 8192 /* bytes ahead of the codes being read */
#endif

#define PAIRS_PER_GROUP (PD_ACT_GROUP / 2)

/* One 16-channel tile against MB rows of xq ([MB, stride] int16, scales [MB, groups]); MB is
 * a constant at each call site so the accumulators live in registers. */
VNNI_TARGET __attribute__((always_inline)) static inline void vnni_tile(
    const int16_t *xq, int64_t stride, const float *xs, int64_t groups, const int8_t *tile,
    int64_t pairs, __m512 scale, uint16_t *y, int64_t N, int64_t valid, const int MB) {
    const int U = MB == 1 ? 4 : 2; /* k pairs per step: U * MB integer accumulators */
    __m512 acc[PD_GEMV_ROWS];
    for (int m = 0; m < MB; m++)
        acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        int64_t p0 = g * PAIRS_PER_GROUP, p1 = p0 + PAIRS_PER_GROUP < pairs ? p0 + PAIRS_PER_GROUP : pairs;
        __m512i sum[4][PD_GEMV_ROWS];
        for (int u = 0; u < U; u++)
            for (int m = 0; m < MB; m++)
                sum[u][m] = _mm512_setzero_si512();
        int64_t p = p0;
        for (; p + U <= p1; p += U) {
            for (int line = 0; line < (U * 32 + 63) / 64; line++)
                _mm_prefetch((const char *)(tile + p * 32 + PD_VNNI_PREFETCH + 64 * line), _MM_HINT_T0);
            for (int u = 0; u < U; u++) {
                __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(tile + (p + u) * 32)));
                for (int m = 0; m < MB; m++) {
                    int32_t xp;
                    memcpy(&xp, xq + m * stride + 2 * (p + u), sizeof xp);
                    sum[u][m] = _mm512_dpwssd_epi32(sum[u][m], w, _mm512_set1_epi32(xp));
                }
            }
        }
        for (; p < p1; p++) {
            __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(tile + p * 32)));
            for (int m = 0; m < MB; m++) {
                int32_t xp;
                memcpy(&xp, xq + m * stride + 2 * p, sizeof xp);
                sum[0][m] = _mm512_dpwssd_epi32(sum[0][m], w, _mm512_set1_epi32(xp));
            }
        }
        for (int m = 0; m < MB; m++) {
            __m512i s = sum[0][m];
            for (int u = 1; u < U; u++)
                s = _mm512_add_epi32(s, sum[u][m]);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(xs[m * groups + g]), acc[m]);
        }
    }
    for (int m = 0; m < MB; m++)
        store_row(y + m * N, acc[m], scale, valid);
}

VNNI_TARGET static void vnni_one(const int16_t *xq, int64_t M, int64_t stride, const float *xs,
                                 int64_t groups, const int8_t *tile, int64_t pairs, __m512 scale,
                                 uint16_t *y, int64_t N, int64_t valid) {
    switch (M) {
#define ROWS(R) case R: vnni_tile(xq, stride, xs, groups, tile, pairs, scale, y, N, valid, R); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#undef ROWS
    }
}

VNNI_TARGET int pd_int8_gemv_vnni(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                                  const float *scales, int64_t N, uint16_t *y, int threads) {
    if (M < 1 || M > PD_GEMV_ROWS)
        return PD_ERR_LEN;
    int64_t pairs = (K + 1) / 2, tiles = (N + 15) / 16, tile_bytes = pairs * 32;
    int64_t groups = pd_act_groups(K), stride = groups * PD_ACT_GROUP;
    size_t qbytes = ((size_t)(M * stride) * sizeof(int16_t) + 63) / 64 * 64;
    int16_t *xq = aligned_alloc(64, qbytes);
    float *xs = malloc((size_t)(M * groups) * sizeof(float));
    if (xq == NULL || xs == NULL) {
        free(xq);
        free(xs);
        return PD_ERR_MEM;
    }
    pd_act_q16(x, M, K, PD_ACT_GROUP, xq, xs);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n0 = t * 16, valid = N - n0 < 16 ? N - n0 : 16;
        vnni_one(xq, M, stride, xs, groups, packed + t * tile_bytes, pairs, load_scales(scales + n0, valid),
                 y + n0, N, valid);
    }
    free(xq);
    free(xs);
    return PD_OK;
}
