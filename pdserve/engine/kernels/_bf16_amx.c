/* The bf16 linear on AMX tiles (pdserve/engine/kernels/_bf16_gemv.c dispatches here where the CPU, as
 * masked, has AMX-BF16). From one row: the weight is the A operand, loaded in place. A
 * 16-channel block's next 32 k are 16 weight rows x 64 bytes at stride K: exactly an A tile of the
 * row-major weight. B is x transposed into bf16 pairs (B[p][m] = x[m][2p], x[m][2p + 1]),
 * built once per call, zero past K; C = 16 channels x M rows of float32 sums. One tile
 * multiply per 1 KiB of weights, whatever M is: the step reads weights at memory speed
 * where the dot products (pdserve/engine/kernels/_bf16_gemv.c) run out of issue slots. A K tail reads its 16 weight rows
 * through a zero-padded copy (a tile load past K would read the next row, or past the
 * end); the last, partial block of channels runs on the dot products.
 * Tile registers: 0 = C, 1 = A, 2 = B. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "_bf16_gemm.h"

#define AMX_TARGET __attribute__((target("avx512f,avx512dq,avx512bf16,avx512bw,avx512vl,amx-tile,amx-bf16")))
#define MEMORY_BARRIER() __asm__ volatile("" ::: "memory") /* GCC's tile intrinsics are asm */

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

AMX_TARGET static void amx_configure(int64_t M) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = 16, cfg.colsb[0] = (uint16_t)(M * 4);
    cfg.rows[1] = 16, cfg.colsb[1] = 64;
    cfg.rows[2] = 16, cfg.colsb[2] = (uint16_t)(M * 4);
    _tile_loadconfig(&cfg);
}

/* Channels [n0, n0 + 16) against all M rows; xt is B for every 32 k (16 x M pairs each). */
AMX_TARGET static void amx_block(const uint32_t *xt, int64_t M, const uint16_t *w, int64_t K, int64_t n0,
                                 const uint16_t *bias, uint16_t *y, int64_t N) {
    float c[16][PD_BF16_GEMV_ROWS] __attribute__((aligned(64)));
    const uint16_t *wr = w + n0 * K;
    int64_t chunks = (K + 31) / 32, full = K / 32;
    _tile_zero(0);
    for (int64_t ch = 0; ch < full; ch++) {
        _tile_loadd(1, wr + ch * 32, K * 2);
        _tile_loadd(2, xt + ch * 16 * M, M * 4);
        _tile_dpbf16ps(0, 1, 2);
    }
    if (chunks > full) {
        uint16_t a[16][32] __attribute__((aligned(64)));
        memset(a, 0, sizeof a);
        for (int i = 0; i < 16; i++)
            memcpy(a[i], wr + i * K + full * 32, (size_t)(K - full * 32) * 2);
        MEMORY_BARRIER();
        _tile_loadd(1, a[0], 64);
        _tile_loadd(2, xt + full * 16 * M, M * 4);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c[0], PD_BF16_GEMV_ROWS * 4);
    MEMORY_BARRIER();
    for (int i = 0; i < 16; i++) {
        float b = bias != NULL ? from_bf16(bias[n0 + i]) : 0.0f;
        for (int64_t m = 0; m < M; m++)
            y[m * N + n0 + i] = to_bf16(c[i][m] + b);
    }
}

/* Up to 16 rows: C is 16 channels x M rows (the decode step's tile, `amx_block`). */
AMX_TARGET static int gemv_amx_few(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                                   int64_t N, const uint16_t *bias, uint16_t *y, int threads) {
    int64_t pairs = (K + 31) / 32 * 16, blocks = N / 16;
    uint32_t *xt = aligned_alloc(64, ((size_t)(pairs * M) * 4 + 63) / 64 * 64);
    if (xt == NULL)
        return PD_ERR_MEM;
    for (int64_t p = 0; p < pairs; p++)
        for (int64_t m = 0; m < M; m++) {
            const uint16_t *row = x + m * ldx;
            uint32_t lo = 2 * p < K ? row[2 * p] : 0, hi = 2 * p + 1 < K ? row[2 * p + 1] : 0;
            xt[p * M + m] = lo | hi << 16;
        }
    MEMORY_BARRIER();
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        amx_configure(M);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            amx_block(xt, M, w, K, b * 16, bias, y, N);
        _tile_release();
    }
    free(xt);
    return PD_OK;
}

/* Channels [n0, n0 + 16) against a panel of M rows held as 16-row blocks of B (zero
 * columns past M, `xt` block r at r * pairs * 16): the weight tile comes from L1 for every
 * block after the first. Each output is the same C element over the same 32-k chunks as
 * in `amx_block`, so a row's bits do not depend on M. */
AMX_TARGET static void amx_panel_block(const uint32_t *xt, int64_t M, int64_t first, int64_t pairs,
                                       const uint16_t *w, int64_t K, int64_t n0, const uint16_t *bias,
                                       uint16_t *y, int64_t N) {
    float c[16][16] __attribute__((aligned(64)));
    uint16_t a[16][32] __attribute__((aligned(64)));
    const uint16_t *wr = w + n0 * K;
    int64_t full = K / 32, tail = K - full * 32;
    if (tail) {
        memset(a, 0, sizeof a);
        for (int i = 0; i < 16; i++)
            memcpy(a[i], wr + i * K + full * 32, (size_t)tail * 2);
        MEMORY_BARRIER();
    }
    for (int64_t m0 = first; m0 < M; m0 += 16) {
        const uint32_t *xb = xt + m0 * pairs;
        _tile_zero(0);
        for (int64_t ch = 0; ch < full; ch++) {
            _tile_loadd(1, wr + ch * 32, K * 2);
            _tile_loadd(2, xb + ch * 16 * 16, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        if (tail) {
            _tile_loadd(1, a[0], 64);
            _tile_loadd(2, xb + full * 16 * 16, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, c[0], 64);
        MEMORY_BARRIER();
        int64_t mb = M - m0 < 16 ? M - m0 : 16;
        for (int i = 0; i < 16; i++) {
            float bv = bias != NULL ? from_bf16(bias[n0 + i]) : 0.0f;
            for (int64_t m = 0; m < mb; m++)
                y[(m0 + m) * N + n0 + i] = to_bf16(c[i][m] + bv);
        }
    }
}

/* C tile `c` (16 channels from n0 x 16 rows from m0, fewer than 16 valid past M) into y. */
AMX_TARGET static void amx_store(float c[16][16], int64_t M, int64_t m0, const uint16_t *bias, int64_t n0,
                                 uint16_t *y, int64_t N) {
    int64_t mb = M - m0 < 16 ? M - m0 : 16;
    for (int i = 0; i < 16; i++) {
        float bv = bias != NULL ? from_bf16(bias[n0 + i]) : 0.0f;
        for (int64_t m = 0; m < mb; m++)
            y[(m0 + m) * N + n0 + i] = to_bf16(c[i][m] + bv);
    }
}

/* Channels [n0, n0 + 32) against the panel's rows 32 at a time: four C tiles (0-3) from two
 * A (4, 5) and two B (6, 7) per 32-k chunk, each A and B used twice and four independent
 * sums in flight. Every C element is the one `amx_panel_block` computes (the same chunks in
 * the same order), so the bits are the same; a last single 16-row block goes to it. */
AMX_TARGET static void amx_panel_pair(const uint32_t *xt, int64_t M, int64_t pairs, const uint16_t *w, int64_t K,
                                      int64_t n0, const uint16_t *bias, uint16_t *y, int64_t N) {
    float c[16][16] __attribute__((aligned(64)));
    uint16_t a[2][16][32] __attribute__((aligned(64)));
    const uint16_t *w0 = w + n0 * K, *w1 = w + (n0 + 16) * K;
    int64_t full = K / 32, tail = K - full * 32, m0 = 0;
    if (tail) {
        memset(a, 0, sizeof a);
        for (int i = 0; i < 16; i++) {
            memcpy(a[0][i], w0 + i * K + full * 32, (size_t)tail * 2);
            memcpy(a[1][i], w1 + i * K + full * 32, (size_t)tail * 2);
        }
        MEMORY_BARRIER();
    }
    for (; m0 + 16 < M; m0 += 32) {
        const uint32_t *b0 = xt + m0 * pairs, *b1 = xt + (m0 + 16) * pairs;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ch = 0; ch < full; ch++) {
            _tile_loadd(4, w0 + ch * 32, K * 2);
            _tile_loadd(5, w1 + ch * 32, K * 2);
            _tile_loadd(6, b0 + ch * 256, 64);
            _tile_loadd(7, b1 + ch * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (tail) {
            _tile_loadd(4, a[0][0], 64);
            _tile_loadd(5, a[1][0], 64);
            _tile_loadd(6, b0 + full * 256, 64);
            _tile_loadd(7, b1 + full * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
#define STORE(t, mm, nn)                  \
    _tile_stored(t, c[0], 64);            \
    MEMORY_BARRIER();                     \
    amx_store(c, M, mm, bias, nn, y, N);
        STORE(0, m0, n0) STORE(1, m0 + 16, n0) STORE(2, m0, n0 + 16) STORE(3, m0 + 16, n0 + 16)
#undef STORE
    }
    if (m0 < M) {
        amx_panel_block(xt, M, m0, pairs, w, K, n0, bias, y, N);
        amx_panel_block(xt, M, m0, pairs, w, K, n0 + 16, bias, y, N);
    }
}

AMX_TARGET static void amx_configure_all(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++)
        cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* More than 16 rows, in panels whose B (~PANEL_BYTES) stays in L2 across the channel blocks. */
AMX_TARGET static int gemv_amx_many(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                                    int64_t N, const uint16_t *bias, uint16_t *y, int threads) {
    int64_t pairs = (K + 31) / 32 * 16, blocks = N / 16;
    int64_t panel = PANEL_BYTES / (pairs * 4) / 16 * 16;
    panel = panel < 32 ? 32 : panel;
    panel = panel > M ? (M + 15) / 16 * 16 : panel;
    uint32_t *xt = aligned_alloc(64, (size_t)(pairs * panel) * 4);
    if (xt == NULL)
        return PD_ERR_MEM;
    for (int64_t p0 = 0; p0 < M; p0 += panel) {
        int64_t pm = M - p0 < panel ? M - p0 : panel;
        for (int64_t r = 0; r < (pm + 15) / 16; r++)
            for (int64_t p = 0; p < pairs; p++)
                for (int64_t j = 0; j < 16; j++) {
                    int64_t m = r * 16 + j;
                    uint32_t lo = 0, hi = 0;
                    if (m < pm) {
                        const uint16_t *row = x + (p0 + m) * ldx;
                        lo = 2 * p < K ? row[2 * p] : 0, hi = 2 * p + 1 < K ? row[2 * p + 1] : 0;
                    }
                    xt[(r * pairs + p) * 16 + j] = lo | hi << 16;
                }
        MEMORY_BARRIER();
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
            amx_configure_all();
#pragma omp for schedule(static)
            for (int64_t b = 0; b < (blocks + 1) / 2; b++) {
                if (2 * b + 1 < blocks)
                    amx_panel_pair(xt, pm, pairs, w, K, 2 * b * 16, bias, y + p0 * N, N);
                else
                    amx_panel_block(xt, pm, 0, pairs, w, K, 2 * b * 16, bias, y + p0 * N, N);
            }
            _tile_release();
        }
    }
    free(xt);
    return PD_OK;
}

/* Any number of rows on AMX. The last channels (fewer than a tile's 16) run on the dot
 * products, for every M alike. */
AMX_TARGET int pd_bf16_amx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                           int64_t N, const uint16_t *bias, uint16_t *y, int threads) {
    int64_t full = N / 16 * 16;
    if (full > 0) {
        int rc = M <= PD_BF16_GEMV_ROWS ? gemv_amx_few(x, M, K, ldx, w, N, bias, y, threads)
                                        : gemv_amx_many(x, M, K, ldx, w, N, bias, y, threads);
        if (rc != PD_OK)
            return rc;
    }
    if (full < N)
        pd_bf16_avx(x, M, K, ldx, w + full * K, N - full, bias != NULL ? bias + full : NULL, y + full, N, threads);
    return PD_OK;
}

