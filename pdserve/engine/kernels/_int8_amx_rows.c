/* The int8 weight GEMM for 1 to 16 rows of bf16 activations on AMX (batched decode;
 * dispatched from pd_int8_gemm_bf16 in _int8_gemm.c, same packed layout):
 *
 *   y[m, n] = bf16( scale[n] * sum_k x[m, k] * q[n, k] )     M <= 16
 *
 * At a few rows the int8 model can only win by reading its codes at memory speed, half the
 * bf16 weight's bytes. `gemm_amx` in _int8_gemm.c widens a 16-channel tile's whole K into a
 * buffer first and multiplies after, so the code stream stops while the tile unit runs and
 * the 2*K-byte buffer (24-64 KiB) leaves L1. Here each 32-k chunk of a tile (16 pairs x 16
 * channels, 512 codes) is widened into a ring of RING 1 KiB B tiles in L1 and multiplied at
 * once (one C tile, one A tile of the rows' 32 k read in place): the out-of-order core
 * widens chunk c + 1 while the tile unit multiplies chunk c, and the codes PREFETCH bytes
 * ahead are requested every chunk, across tile boundaries (a thread's tiles are
 * contiguous), so the memory stream never pauses. The rows' K tail (K % 32) is copied
 * zero-padded once per call. Per-channel scales are applied to the float32 sums.
 */
#include "_int8_gemm.h"

#include <stdlib.h>
#include <string.h>

#define RING 4 /* B tiles in flight: the one being multiplied, the next ones being widened */
#ifndef PD_AMX_ROWS_PREFETCH
#define PD_AMX_ROWS_PREFETCH 1024 /* bytes of codes ahead of the chunk being widened */
#endif

/* One 16-channel tile's `pairs` code pairs against the M configured rows. */
AMX_TARGET static void rows_tile(const uint16_t *x, int64_t K, const uint16_t *xtail,
                                 const int8_t *tile, int64_t pairs, uint16_t (*ring)[32],
                                 __m512 scale, uint16_t *y, int64_t M, int64_t N, int64_t valid) {
    float c[16][16] __attribute__((aligned(64)));
    int64_t chunks = (pairs + 15) / 16;
    _tile_zero(0);
    for (int64_t ch = 0; ch < chunks; ch++) {
        uint16_t (*b)[32] = ring + (ch % RING) * 16;
        const int8_t *src = tile + ch * 16 * 32;
        for (int line = 0; line < 8; line++) /* 512 bytes of codes a chunk */
            _mm_prefetch((const char *)(src + PD_AMX_ROWS_PREFETCH + 64 * line), _MM_HINT_T0);
        int64_t n = pairs - ch * 16 < 16 ? pairs - ch * 16 : 16;
        for (int64_t i = 0; i < n; i++)
            _mm512_store_si512(b[i], (__m512i)widen(src + i * 32));
        for (int64_t i = n; i < 16; i++)
            _mm512_store_si512(b[i], _mm512_setzero_si512());
        MEMORY_BARRIER();
        _tile_loadd(4, b[0], 64);
        if (32 * ch + 32 <= K)
            _tile_loadd(2, x + 32 * ch, K * 2);
        else
            _tile_loadd(2, xtail, 64);
        _tile_dpbf16ps(0, 2, 4);
    }
    _tile_stored(0, c[0], 64);
    MEMORY_BARRIER();
    for (int64_t m = 0; m < M; m++)
        store_row(y + m * N, _mm512_load_ps(c[m]), scale, valid);
}

AMX_TARGET int pd_int8_amx_rows(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                                const float *scales, int64_t N, uint16_t *y, int threads) {
    if (M < 1 || M > 16)
        return PD_ERR_LEN;
    int64_t tiles = (N + 15) / 16, pairs = (K + 1) / 2, tile_bytes = pairs * 32;
    /* the rows' last 32 k, zero-padded, when K is not a multiple of 32 */
    uint16_t xtail[16][32] __attribute__((aligned(64)));
    memset(xtail, 0, sizeof xtail);
    int64_t k0 = K / 32 * 32;
    for (int64_t m = 0; m < M && k0 < K; m++)
        memcpy(xtail[m], x + m * K + k0, (size_t)(K - k0) * 2);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint16_t (*ring)[32] = aligned_alloc(64, RING * 16 * 64);
        if (ring == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            pd_int8_amx_configure(M, 0);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (ring == NULL)
                continue;
            int64_t n0 = t * 16, valid = N - n0 < 16 ? N - n0 : 16;
            rows_tile(x, K, xtail[0], packed + t * tile_bytes, pairs, ring,
                      load_scales(scales + n0, valid), y + n0, M, N, valid);
        }
        if (ring != NULL) {
            _tile_release();
            free(ring);
        }
    }
    return failed ? PD_ERR_MEM : PD_OK;
}
