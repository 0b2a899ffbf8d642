/* The bf16 GEMV / small GEMM for decode (pdserve/engine/kernels/bf16_gemv.py loads it through
 * pdserve/engine/kernels/native.py; built into pdserve.engine.kernels._cpu_kernels):
 *
 *   y[m, n] = bf16( sum_k x[m, k] * w[n, k] (+ bias[n]) )     1 <= M <= PD_BF16_GEMV_ROWS
 *
 * Layouts: x [M, K] bf16 with row stride ldx (elements, unit column stride); w [N, K] bf16
 * C-contiguous, the model's own weight as loaded (no packed copy); bias [N] bf16 or NULL;
 * y [M, N] bf16 C-contiguous.
 *
 * Decode runs a handful of rows through each linear, so the matmul is a stream over the
 * weight: it must read w once, at memory speed. oneDNN's bf16 matmul reaches ~8-12 GB/s
 * on one core at 1-16 rows here (bench/bf16_gemv.py). This kernel walks a block of NB
 * output channels (NB consecutive weight rows: one contiguous range of memory) 32 k at a
 * time: one 64-byte load per channel, one `_mm512_dpbf16_ps` per (channel, row) into that
 * pair's own float32 accumulator, the rows' x chunks loaded once per step and reused for
 * every channel of the block. More than ROW_BLOCK rows run as row blocks over the same
 * channel block, whose weights are then read from L1. The K tail is a masked load (zeros
 * on both sides). Each accumulator is summed across its 16 lanes by one fixed tree, the
 * bias added in float32 and the result rounded to bf16 once (nearest even): a row's
 * output does not depend on how many rows share the call, or on the thread count.
 * Channel blocks are spread over OpenMP threads (torch's pool, see _cpu_kernels.c).
 * Needs AVX-512 BF16, checked at run time (`pd_bf16_gemv_supported`).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_pd_cpu.h"

#define TARGET __attribute__((target("avx512f,avx512dq,avx512bf16,avx512bw,avx512vl")))
#define INLINE __attribute__((always_inline)) static inline

#define PD_BF16_GEMV_ROWS 16 /* rows of one AMX C tile: more run 16 at a time */
#define ROW_BLOCK 8
#define MAX_NB 8
int pd_bf16_gemv_supported(void) { return pd_cpu_has(PD_NEEDS_AVX512_BF16); }

int pd_bf16_gemv_rows(void) { return PD_BF16_GEMV_ROWS; }

/* float32 -> bf16, round to nearest even (torch's rounding); NaN stays a quiet NaN. */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0;
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* acc + the pairwise products of a and b's bf16 pairs. Inline asm: GCC 12 moves every
 * __m512bh cast of a loaded vector through the stack (a store and a reload per use). */
TARGET INLINE __m512 dot(__m512 acc, __m512 a, __m512 b) {
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

static inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The lane sums of a, b, c, d, each by the same tree: halves, quarters, then pairs. */
TARGET INLINE __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
#define HALF(v) _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))
#define QUARTER(v) _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
    __m128 qa = QUARTER(HALF(a)), qb = QUARTER(HALF(b)), qc = QUARTER(HALF(c)), qd = QUARTER(HALF(d));
#undef HALF
#undef QUARTER
    return _mm_hadd_ps(_mm_hadd_ps(qa, qb), _mm_hadd_ps(qc, qd));
}

/* acc[i] holds the lanes of output (rows[i], cols[i]); write them all to y. */
TARGET INLINE void finish(__m512 *acc, const int64_t *rows, const int64_t *cols, int count,
                          const uint16_t *bias, uint16_t *y, int64_t ldy) {
    float s[4];
    for (int i = 0; i < count; i += 4) {
        __m512 z = _mm512_setzero_ps();
        _mm_storeu_ps(s, sum4(acc[i], i + 1 < count ? acc[i + 1] : z, i + 2 < count ? acc[i + 2] : z,
                              i + 3 < count ? acc[i + 3] : z));
        for (int j = 0; j < 4 && i + j < count; j++) {
            int64_t n = cols[i + j];
            float v = s[j] + (bias != NULL ? from_bf16(bias[n]) : 0.0f);
            y[rows[i + j] * ldy + n] = to_bf16(v);
        }
    }
}

/* Channels [n0, n0 + NB) against rows [m0, m0 + MB); NB and MB are constants at every call
 * site, so the NB * MB accumulators live in registers. */
TARGET INLINE void tile(const uint16_t *x, int64_t ldx, int64_t m0, const uint16_t *w, int64_t K,
                        int64_t n0, const uint16_t *bias, uint16_t *y, int64_t ldy, const int MB,
                        const int NB) {
    __m512 acc[MAX_NB * ROW_BLOCK];
    for (int i = 0; i < NB * MB; i++)
        acc[i] = _mm512_setzero_ps();
    const uint16_t *wr = w + n0 * K, *xr = x + m0 * ldx;
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512 wv[MAX_NB];
        for (int c = 0; c < NB; c++)
            wv[c] = _mm512_loadu_ps(wr + c * K + k);
        for (int r = 0; r < MB; r++) {
            __m512 xv = _mm512_loadu_ps(xr + r * ldx + k);
            for (int c = 0; c < NB; c++)
                acc[c * MB + r] = dot(acc[c * MB + r], xv, wv[c]);
        }
    }
    if (k < K) {
        __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1ull);
        for (int c = 0; c < NB; c++) {
            __m512 wv = (__m512)_mm512_maskz_loadu_epi16(mask, wr + c * K + k);
            for (int r = 0; r < MB; r++) {
                __m512 xv = (__m512)_mm512_maskz_loadu_epi16(mask, xr + r * ldx + k);
                acc[c * MB + r] = dot(acc[c * MB + r], xv, wv);
            }
        }
    }
    int64_t rows[MAX_NB * ROW_BLOCK], cols[MAX_NB * ROW_BLOCK];
    for (int c = 0; c < NB; c++)
        for (int r = 0; r < MB; r++) {
            rows[c * MB + r] = m0 + r;
            cols[c * MB + r] = n0 + c;
        }
    finish(acc, rows, cols, NB * MB, bias, y, ldy);
}

/* Channels [n0, n0 + NB) against every row, in row blocks of at most ROW_BLOCK. */
TARGET INLINE void channels(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t K,
                            int64_t n0, const uint16_t *bias, uint16_t *y, int64_t ldy, const int NB) {
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        int64_t mb = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
        switch (mb) {
#define ROWS(R) case R: tile(x, ldx, m0, w, K, n0, bias, y, ldy, R, NB); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
        }
    }
}

/* Channels per block: as many as keep NB * rows accumulators (+ NB weight vectors) in the
 * 32 vector registers. */
static int block_for(int64_t M) { return M == 1 ? 8 : M == 2 ? 6 : M <= 4 ? 4 : 3; }

TARGET static void run_block(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t K,
                             int64_t n0, int64_t nb, int NB, const uint16_t *bias, uint16_t *y, int64_t ldy) {
    if (nb == NB) {
        switch (NB) {
            case 8: channels(x, M, ldx, w, K, n0, bias, y, ldy, 8); return;
            case 6: channels(x, M, ldx, w, K, n0, bias, y, ldy, 6); return;
            case 4: channels(x, M, ldx, w, K, n0, bias, y, ldy, 4); return;
            default: channels(x, M, ldx, w, K, n0, bias, y, ldy, 3); return;
        }
    }
    for (int64_t n = n0; n < n0 + nb; n++) /* the last, partial block: one channel at a time */
        channels(x, M, ldx, w, K, n, bias, y, ldy, 1);
}

/* Channels [0, N) of w into columns [0, N) of y (row stride ldy), for up to PANEL rows. */
TARGET static void gemv_avx_panel(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                                  int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy, int threads) {
    int NB = block_for(M);
    int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * NB, nb = N - n0 < NB ? N - n0 : NB;
        run_block(x, M, ldx, w, K, n0, nb, NB, bias, y, ldy);
    }
}

/* Rows per pass over the weight: as many as keep x's panel (~PANEL_BYTES) in L2, so a
 * prefill reads each channel block's weights from L1 once per panel, not once per row. */
#define PANEL_BYTES (96 * 1024)

static int64_t panel_rows(int64_t K) {
    int64_t rows = PANEL_BYTES / (K * 2) / ROW_BLOCK * ROW_BLOCK;
    return rows < 2 * ROW_BLOCK ? 2 * ROW_BLOCK : rows;
}

/* Any number of rows, panel by panel. Every (row, channel) pair has its own accumulator
 * over the same k steps and lane tree, so a row's bits do not depend on M or the panels. */
TARGET static void gemv_avx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                            int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy, int threads) {
    int64_t panel = panel_rows(K);
    for (int64_t m0 = 0; m0 < M; m0 += panel)
        gemv_avx_panel(x + m0 * ldx, M - m0 < panel ? M - m0 : panel, K, ldx, w, N, bias, y + m0 * ldy, ldy,
                       threads);
}

/* AMX, from AMX_MIN_ROWS rows: the weight is the A operand, loaded in place. A 16-channel
 * block's next 32 k are 16 weight rows x 64 bytes at stride K: exactly an A tile of the
 * row-major weight. B is x transposed into bf16 pairs (B[p][m] = x[m][2p], x[m][2p + 1]),
 * built once per call, zero past K; C = 16 channels x M rows of float32 sums. One tile
 * multiply per 1 KiB of weights, whatever M is: the step reads weights at memory speed
 * where the dot products above run out of issue slots. A K tail reads its 16 weight rows
 * through a zero-padded copy (a tile load past K would read the next row, or past the
 * end); the last, partial block of channels runs on the dot products.
 * Tile registers: 0 = C, 1 = A, 2 = B. */
#define AMX_TARGET __attribute__((target("avx512f,avx512dq,avx512bf16,avx512bw,avx512vl,amx-tile,amx-bf16")))
#define AMX_MIN_ROWS 1
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
AMX_TARGET static int gemv_amx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                               int64_t N, const uint16_t *bias, uint16_t *y, int threads) {
    int64_t full = N / 16 * 16;
    if (full > 0) {
        int rc = M <= PD_BF16_GEMV_ROWS ? gemv_amx_few(x, M, K, ldx, w, N, bias, y, threads)
                                        : gemv_amx_many(x, M, K, ldx, w, N, bias, y, threads);
        if (rc != PD_OK)
            return rc;
    }
    if (full < N)
        gemv_avx(x, M, K, ldx, w + full * K, N - full, bias != NULL ? bias + full : NULL, y + full, N, threads);
    return PD_OK;
}

/* Without AVX-512 BF16: the dot products' arithmetic, step for step, in plain float32 (one
 * of PD_CLONES' AVX-512F / AVX2 / baseline builds; none fuses or reorders). Each lane i of a
 * 32-k step adds x[2i+1] w[2i+1], then x[2i] w[2i] (exact products, each add rounded to
 * nearest even, denormals flushed: MXCSR FTZ and DAZ, as `vdpbf16ps` does), and the lanes
 * are summed by `sum4`'s tree. So this path gives the same bits as the AVX-512 BF16 one
 * (tests/engine/test_bf16_masks.py), at any M. */
/* One full 32-k step: the bf16 pairs as 32-bit lanes, the low half the even k. */
static inline void emul_step(float *lane, const uint16_t *xr, const uint16_t *wr) {
    uint32_t xp[16], wp[16];
    memcpy(xp, xr, sizeof xp);
    memcpy(wp, wr, sizeof wp);
    for (int i = 0; i < 16; i++) {
        uint32_t xe = xp[i] << 16, xo = xp[i] & 0xFFFF0000u, we = wp[i] << 16, wo = wp[i] & 0xFFFF0000u;
        float fxe, fxo, fwe, fwo;
        memcpy(&fxe, &xe, 4), memcpy(&fxo, &xo, 4), memcpy(&fwe, &we, 4), memcpy(&fwo, &wo, 4);
        lane[i] = (lane[i] + fxo * fwo) + fxe * fwe;
    }
}

/* The K tail (n < 32 k), zeros past it on both sides as the masked loads give. */
static inline void emul_tail(float *lane, const uint16_t *xr, const uint16_t *wr, int64_t n) {
    uint16_t x[32] = {0}, w[32] = {0};
    memcpy(x, xr, (size_t)n * 2);
    memcpy(w, wr, (size_t)n * 2);
    emul_step(lane, x, w);
}

/* Channel n against the panel's M rows (M <= the panel): their lanes with FTZ and DAZ on
 * (one MXCSR switch per channel), then each row's tree and rounding with it off. */
PD_CLONES(void, emul_channel, (const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t K,
          int64_t n, const uint16_t *bias, uint16_t *y, int64_t ldy, float *lanes),
          (x, M, ldx, w, K, n, bias, y, ldy, lanes)) {
    const uint16_t *wr = w + n * K;
    int64_t full = K / 32 * 32;
    memset(lanes, 0, (size_t)M * 16 * sizeof(float));
    unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u); /* FTZ | DAZ, as vdpbf16ps computes */
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xr = x + m * ldx;
        float *lane = lanes + m * 16;
        for (int64_t k = 0; k < full; k += 32)
            emul_step(lane, xr + k, wr + k);
        if (full < K)
            emul_tail(lane, xr + full, wr + full, K - full);
    }
    _mm_setcsr(csr);
    float b = bias != NULL ? from_bf16(bias[n]) : 0.0f;
    for (int64_t m = 0; m < M; m++) {
        const float *lane = lanes + m * 16;
        float h[4];
        for (int j = 0; j < 4; j++)
            h[j] = (lane[j] + lane[j + 8]) + (lane[j + 4] + lane[j + 12]);
        y[m * ldy + n] = to_bf16(((h[0] + h[1]) + (h[2] + h[3])) + b);
    }
}

static int gemv_emul(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                     const uint16_t *bias, uint16_t *y, int threads) {
    int64_t panel = panel_rows(K);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float *lanes = malloc((size_t)(panel < M ? panel : M) * 16 * sizeof(float));
        for (int64_t m0 = 0; m0 < M; m0 += panel) {
            int64_t pm = M - m0 < panel ? M - m0 : panel;
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) {
                if (lanes == NULL) {
                    failed = 1;
                    continue;
                }
                emul_channel(x + m0 * ldx, pm, ldx, w, K, n, bias, y + m0 * N, N, lanes);
            }
        }
        free(lanes);
    }
    return failed ? PD_ERR_MEM : PD_OK;
}

int pd_bf16_gemv_amx_rows(void) { return pd_cpu_has(PD_NEEDS_AMX_BF16) ? AMX_MIN_ROWS : 0; }

/* `path`: PD_BF16_AUTO (AMX where the CPU has it, else the AVX-512 BF16 dot products, else
 * their emulation), or one forced (tests and benchmarks run each). Any M >= 1: every path is
 * row-invariant, so the route never changes with the row count. */
int pd_bf16_gemv(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                 int64_t N, const uint16_t *bias, uint16_t *y, int threads, int path) {
    if (M < 1 || K < 1 || N < 1 || ldx < K || path < PD_BF16_AUTO || path > PD_BF16_EMUL)
        return PD_ERR_LEN;
    if (path == PD_BF16_AUTO)
        path = pd_cpu_has(PD_NEEDS_AMX_BF16) ? PD_BF16_AMX : pd_cpu_has(PD_NEEDS_AVX512_BF16) ? PD_BF16_AVX
                                                                                               : PD_BF16_EMUL;
    if ((path == PD_BF16_AMX && !pd_cpu_has(PD_NEEDS_AMX_BF16))
        || (path == PD_BF16_AVX && !pd_cpu_has(PD_NEEDS_AVX512_BF16)))
        return PD_ERR_CPU;
    threads = threads < 1 ? 1 : threads;
    if (path == PD_BF16_AMX)
        return gemv_amx(x, M, K, ldx, w, N, bias, y, threads);
    if (path == PD_BF16_AVX)
        gemv_avx(x, M, K, ldx, w, N, bias, y, N, threads);
    else
        return gemv_emul(x, M, K, ldx, w, N, bias, y, threads);
    return PD_OK;
}
