/* The int8 weight GEMM for 1 to 16 rows on AMX's int8 tile multiply (batched decode;
 * dispatched from pd_int8_gemm_bf16 in _int8_gemm.c, same packed layout):
 *
 *   y[m, n] = bf16( scale[n] * sum_g xs[m, g] * sum_{k in g} xq[m, k] * q[n, k] )
 *
 * with x as 15-bit fixed point per group of Q8_GROUP k (_act_q16.h: each element off by at
 * most 2^-15 of its group's largest). `pd_int8_amx_rows` widens every code to bf16 before
 * its tile multiply (five instructions per 32 codes), which on one core costs more than
 * reading them. Here the codes are never widened: `tdpbssd` multiplies signed bytes. xq
 * does not fit a byte, so it is split, xq = 128 xh + xl (_act_q16.h), and each B tile of
 * codes meets two A tiles, xh's and xl's rows, read in place, into two int32 C tiles. A
 * B tile is 64 k x 16 channels in AMX's 4-byte groups: each 64 bytes of the packed layout
 * (two k pairs x 16 channels) is one byte permute away from a B tile row (one channel's 4
 * consecutive k), written into a ring of RING 1 KiB tiles in L1 while the tile unit works
 * on the previous ones. Every Q8_GROUP k the C tiles are stored, combined (128 h + l,
 * |.| < 2^30: no overflow), converted and scaled into float32 rows, and zeroed; the
 * per-channel scale is applied once, to the final sums. Codes are prefetched ahead across
 * tiles (each thread's tiles are contiguous). Needs AMX-INT8 and AVX-512 VBMI beside the
 * rest (`pd_int8_gemm_amx_supported` checks both).
 */
#include "_act_q16.h"
#include "_int8_gemm.h"

#include <stdlib.h>
#include <string.h>

#define Q8_TARGET \
    __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl,avx512dq,avx512vbmi,amx-tile,amx-int8")))

#define Q8_GROUP 256 /* k per activation scale: 4 tile multiplies between C tile flushes */
#define CHUNK 64     /* k per tile multiply: 32 pairs, 1 KiB of codes */
#define RING 4       /* B tiles in flight */
#ifndef PD_AMX_Q8_PREFETCH
#define PD_AMX_Q8_PREFETCH 4096 /* bytes of codes ahead of the chunk being permuted */
#endif

/* The rows, once per call: xh, xl [M, stride] int8 (zero past K), xs [M, groups]. */
struct q8_rows {
    const int8_t *xh, *xl;
    const float *xs;
    int64_t stride, groups;
};

/* Byte 4c + j of a B tile row pair: channel c's k = j of the two pairs (32 + 32 bytes). */
Q8_TARGET static __m512i quad_index(void) {
    uint8_t idx[64] __attribute__((aligned(64)));
    for (int c = 0; c < 16; c++)
        for (int j = 0; j < 4; j++)
            idx[4 * c + j] = (uint8_t)((j / 2) * 32 + 2 * c + j % 2);
    return _mm512_load_si512(idx);
}

/* One 16-channel tile's `pairs` code pairs against the M configured rows. */
Q8_TARGET static void q8_tile(const struct q8_rows *r, const int8_t *tile, int64_t pairs, int8_t (*ring)[64],
                              __m512i idx, __m512 scale, uint16_t *y, int64_t M, int64_t N, int64_t valid) {
    int32_t high[16][16] __attribute__((aligned(64))), low[16][16] __attribute__((aligned(64)));
    __m512 acc[16];
    for (int64_t m = 0; m < M; m++)
        acc[m] = _mm512_setzero_ps();
    const int64_t chunks = (pairs + 31) / 32, per_group = Q8_GROUP / CHUNK;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t c = 0; c < chunks; c++) {
        int8_t (*b)[64] = ring + (c % RING) * 16;
        const int8_t *src = tile + c * 32 * 32;
        for (int line = 0; line < 16; line++)
            _mm_prefetch((const char *)(src + PD_AMX_Q8_PREFETCH + 64 * line), _MM_HINT_T0);
        for (int64_t row = 0; row < 16; row++) {
            int64_t left = pairs - (c * 32 + 2 * row); /* pairs of this tile from here */
            __mmask64 mask = left >= 2 ? ~(__mmask64)0 : left == 1 ? (__mmask64)0xFFFFFFFFu : 0;
            __m512i v = _mm512_maskz_loadu_epi8(mask, src + 64 * row);
            _mm512_store_si512(b[row], _mm512_permutexvar_epi8(idx, v));
        }
        MEMORY_BARRIER();
        _tile_loadd(4, b[0], 64);
        _tile_loadd(2, r->xh + c * CHUNK, r->stride);
        _tile_loadd(3, r->xl + c * CHUNK, r->stride);
        _tile_dpbssd(0, 2, 4);
        _tile_dpbssd(1, 3, 4);
        if ((c + 1) % per_group == 0 || c == chunks - 1) {
            _tile_stored(0, high, 64);
            _tile_stored(1, low, 64);
            MEMORY_BARRIER();
            const int64_t g = c / per_group;
            for (int64_t m = 0; m < M; m++) {
                __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(high[m]), 7),
                                               _mm512_load_si512(low[m]));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(r->xs[m * r->groups + g]), acc[m]);
            }
            _tile_zero(0);
            _tile_zero(1);
        }
    }
    for (int64_t m = 0; m < M; m++)
        store_row(y + m * N, acc[m], scale, valid);
}

Q8_TARGET int pd_int8_amx_q8(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                             const float *scales, int64_t N, uint16_t *y, int threads) {
    if (M < 1 || M > 16)
        return PD_ERR_LEN;
    const int64_t tiles = (N + 15) / 16, pairs = (K + 1) / 2, tile_bytes = pairs * 32;
    const int64_t groups = (K + Q8_GROUP - 1) / Q8_GROUP, stride = groups * Q8_GROUP;
    int16_t *xq = aligned_alloc(64, ((size_t)(M * stride) * sizeof(int16_t) + 63) / 64 * 64);
    int8_t *xh = aligned_alloc(64, ((size_t)(2 * M * stride) + 63) / 64 * 64);
    float *xs = malloc((size_t)(M * groups) * sizeof(float));
    if (xq == NULL || xh == NULL || xs == NULL) {
        free(xq);
        free(xh);
        free(xs);
        return PD_ERR_MEM;
    }
    pd_act_q16(x, M, K, Q8_GROUP, xq, xs);
    pd_act_split(xq, M * stride, xh, xh + M * stride);
    const struct q8_rows rows = {xh, xh + M * stride, xs, stride, groups};
    const __m512i idx = quad_index();
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int8_t (*ring)[64] = aligned_alloc(64, RING * 16 * 64);
        if (ring == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            pd_int8_amx_configure(M, M);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (ring == NULL)
                continue;
            int64_t n0 = t * 16, valid = N - n0 < 16 ? N - n0 : 16;
            q8_tile(&rows, packed + t * tile_bytes, pairs, ring, idx, load_scales(scales + n0, valid),
                    y + n0, M, N, valid);
        }
        if (ring != NULL) {
            _tile_release();
            free(ring);
        }
    }
    free(xq);
    free(xh);
    free(xs);
    return failed ? PD_ERR_MEM : PD_OK;
}
