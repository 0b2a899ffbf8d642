/* The int8 weight GEMV for 1 to PD_GEMV_ROWS rows of bf16 activations (dispatched from
 * pd_int8_gemm_bf16 in _int8_gemm.c, same packed layout):
 *
 *   y[m, n] = bf16( scale[n] * sum_k x[m, k] * q[n, k] )     M <= 4
 *
 * Decode runs one row per sequence, where the int8 model's whole point is to read half the
 * bf16 model's bytes: the loop must stream the codes at memory speed, so it spends as few
 * instructions per code byte as it can. The rows are widened to float32 once per call
 * (zero-padded to an even K). Each 32-byte (16 channels x 2 k) group of codes becomes two
 * float32 vectors (sign-extend 16 codes + convert, twice), each multiplied with the row's
 * (x[k], x[k+1]) pair broadcast to every 64-bit lane and added into its own accumulator:
 * lane 2c + j of the low half holds channel c's partial sum over k of parity j (channels
 * 8-15 in the high half). Two instructions widen 16 codes, one FMA per row uses them;
 * the dot-product route (`tile_rows` in _int8_gemm.c) needs five to widen 32 codes into
 * bf16 pairs plus one per row, and is faster only from a few rows up. Several k pairs
 * per step keep 8 independent accumulators in flight per tile; the next codes are
 * prefetched; the per-channel scale is applied once, to the final sums. Tiles are spread
 * over OpenMP threads in contiguous runs (each thread streams its own range).
 */
#include "_int8_gemm.h"

#include <stdlib.h>
#include <string.h>

#ifndef PD_GEMV_PREFETCH
#define PD_GEMV_PREFETCH 512 /* bytes ahead of the codes being read */
#endif

/* x's row at `row`, pair p = (x[2p], x[2p + 1]) in every 64-bit lane. */
TARGET static inline __m512 pair_bcast(const float *row, int64_t p) {
    double d;
    memcpy(&d, row + 2 * p, sizeof d);
    return _mm512_castpd_ps(_mm512_set1_pd(d));
}

/* 16 codes as 16 float32 (exact). */
TARGET static inline __m512 codes_ps(const int8_t *w) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
}

/* One 16-channel tile against MB rows of xf ([MB, Kp] float32); MB is a constant at each
 * call site so the accumulators live in registers. */
TARGET __attribute__((always_inline)) static inline void gemv_tile(
    const float *xf, int64_t Kp, const int8_t *tile, int64_t pairs, __m512 scale, uint16_t *y,
    int64_t N, int64_t valid, const int MB) {
    const int U = MB == 1 ? 4 : MB == 2 ? 2 : 1; /* k pairs per step: 2 U MB accumulators */
    __m512 lo[4][PD_GEMV_ROWS], hi[4][PD_GEMV_ROWS];
    for (int u = 0; u < U; u++)
        for (int m = 0; m < MB; m++)
            lo[u][m] = hi[u][m] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + U <= pairs; p += U) {
        for (int line = 0; line < (U * 32 + 63) / 64; line++)
            _mm_prefetch((const char *)(tile + p * 32 + PD_GEMV_PREFETCH + 64 * line), _MM_HINT_T0);
        for (int u = 0; u < U; u++) {
            __m512 wl = codes_ps(tile + (p + u) * 32), wh = codes_ps(tile + (p + u) * 32 + 16);
            for (int m = 0; m < MB; m++) {
                __m512 xv = pair_bcast(xf + m * Kp, p + u);
                lo[u][m] = _mm512_fmadd_ps(wl, xv, lo[u][m]);
                hi[u][m] = _mm512_fmadd_ps(wh, xv, hi[u][m]);
            }
        }
    }
    for (; p < pairs; p++) {
        __m512 wl = codes_ps(tile + p * 32), wh = codes_ps(tile + p * 32 + 16);
        for (int m = 0; m < MB; m++) {
            __m512 xv = pair_bcast(xf + m * Kp, p);
            lo[0][m] = _mm512_fmadd_ps(wl, xv, lo[0][m]);
            hi[0][m] = _mm512_fmadd_ps(wh, xv, hi[0][m]);
        }
    }
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int m = 0; m < MB; m++) {
        __m512 l = lo[0][m], h = hi[0][m];
        for (int u = 1; u < U; u++) {
            l = _mm512_add_ps(l, lo[u][m]);
            h = _mm512_add_ps(h, hi[u][m]);
        }
        /* channel c < 8: l[2c] + l[2c + 1]; channel 8 + c: h[2c] + h[2c + 1] */
        __m512 sum = _mm512_add_ps(_mm512_permutex2var_ps(l, even, h), _mm512_permutex2var_ps(l, odd, h));
        store_row(y + m * N, sum, scale, valid);
    }
}

TARGET static void gemv_one(const float *xf, int64_t M, int64_t Kp, const int8_t *tile,
                            int64_t pairs, __m512 scale, uint16_t *y, int64_t N, int64_t valid) {
    switch (M) {
#define ROWS(R) case R: gemv_tile(xf, Kp, tile, pairs, scale, y, N, valid, R); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#undef ROWS
    }
}

TARGET int pd_int8_gemv_fp32(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                             const float *scales, int64_t N, uint16_t *y, int threads) {
    if (M < 1 || M > PD_GEMV_ROWS)
        return PD_ERR_LEN;
    int64_t pairs = (K + 1) / 2, Kp = 2 * pairs, tiles = (N + 15) / 16, tile_bytes = pairs * 32;
    size_t bytes = ((size_t)(M * Kp) * sizeof(float) + 63) / 64 * 64;
    float *xf = aligned_alloc(64, bytes);
    if (xf == NULL)
        return PD_ERR_MEM;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k++) {
            uint32_t bits = (uint32_t)x[m * K + k] << 16;
            memcpy(xf + m * Kp + k, &bits, sizeof bits);
        }
        if (Kp > K)
            xf[m * Kp + K] = 0.0f;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n0 = t * 16, valid = N - n0 < 16 ? N - n0 : 16;
        gemv_one(xf, M, Kp, packed + t * tile_bytes, pairs, load_scales(scales + n0, valid),
                 y + n0, N, valid);
    }
    free(xf);
    return PD_OK;
}
