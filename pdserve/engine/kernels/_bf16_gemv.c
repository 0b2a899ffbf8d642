/* The bf16 linear, every row count: its entry point and the AVX-512 BF16 dot products
 * (pdserve/engine/kernels/_bf16_amx.c and pdserve/engine/kernels/_bf16_emul.c hold the other paths; pdserve/engine/kernels/bf16_gemv.py loads it through
 * pdserve/engine/kernels/native.py; built into pdserve.engine.kernels._cpu_kernels):
 *
 *   y[m, n] = bf16( sum_k x[m, k] * w[n, k] (+ bias[n]) )     any M >= 1
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
 * From PD_BF16_TILE_ROWS rows (a prefill, a batched decode) `pd_bf16_avx` runs
 * pdserve/engine/kernels/_bf16_tiles.c's 4 x 6 register tiles over an L2-sized channel block instead: the same per-(row, channel)
 * k order, lane tree and rounding, so the same bits at ~1.6x the rate at 1,500 rows
 * (~1.2-1.35x at 4-12 rows).
 * Needs AVX-512 BF16, checked at run time (`pd_bf16_gemv_supported`).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_bf16_gemm.h"

#define TARGET __attribute__((target("avx512f,avx512dq,avx512bf16,avx512bw,avx512vl")))
#define INLINE __attribute__((always_inline)) static inline

#define MAX_NB 8

int pd_bf16_gemv_supported(void) { return pd_cpu_has(PD_NEEDS_AVX512_BF16); }

int pd_bf16_gemv_rows(void) { return PD_BF16_GEMV_ROWS; }

/* acc + the pairwise products of a and b's bf16 pairs. Inline asm: GCC 12 moves every
 * __m512bh cast of a loaded vector through the stack (a store and a reload per use). */
TARGET INLINE __m512 dot(__m512 acc, __m512 a, __m512 b) {
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
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
    __m512 acc[MAX_NB * PD_BF16_ROW_BLOCK];
#pragma GCC unroll 64 /* register moves, not a `rep stos` of a stack copy (_bf16_tiles.c's tile) */
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
    int64_t rows[MAX_NB * PD_BF16_ROW_BLOCK], cols[MAX_NB * PD_BF16_ROW_BLOCK];
    for (int c = 0; c < NB; c++)
        for (int r = 0; r < MB; r++) {
            rows[c * MB + r] = m0 + r;
            cols[c * MB + r] = n0 + c;
        }
    finish(acc, rows, cols, NB * MB, bias, y, ldy);
}

/* Channels [n0, n0 + NB) against every row, in row blocks of at most PD_BF16_ROW_BLOCK. */
TARGET INLINE void channels(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t K,
                            int64_t n0, const uint16_t *bias, uint16_t *y, int64_t ldy, const int NB) {
    for (int64_t m0 = 0; m0 < M; m0 += PD_BF16_ROW_BLOCK) {
        int64_t mb = M - m0 < PD_BF16_ROW_BLOCK ? M - m0 : PD_BF16_ROW_BLOCK;
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


/* Channels [n0, n1) against M rows on one thread (pdserve/engine/kernels/_bf16_tiles.c's edges). */
TARGET void pd_bf16_avx_rows(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t K,
                             int64_t n0, int64_t n1, const uint16_t *bias, uint16_t *y, int64_t ldy) {
    int NB = block_for(M);
    for (int64_t n = n0; n < n1; n += NB)
        run_block(x, M, ldx, w, K, n, n1 - n < NB ? n1 - n : NB, NB, bias, y, ldy);
}

static int tiles_on = 1;

int pd_bf16_tiles_set(int on) {
    int was = tiles_on;
    tiles_on = on != 0;
    return was;
}

/* Any number of rows: from PD_BF16_TILE_ROWS on, _bf16_tiles.c's register tiles; below, panel
 * by panel here. Every (row, channel) pair has its own accumulator over the same k steps and
 * lane tree on both, so a row's bits do not depend on M, the route or the panels. */
TARGET void pd_bf16_avx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                        int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy, int threads) {
    if (tiles_on && M >= PD_BF16_TILE_ROWS) {
        pd_bf16_avx_tiles(x, M, K, ldx, w, N, bias, y, ldy, threads);
        return;
    }
    int64_t panel = pd_bf16_panel_rows(K);
    for (int64_t m0 = 0; m0 < M; m0 += panel)
        gemv_avx_panel(x + m0 * ldx, M - m0 < panel ? M - m0 : panel, K, ldx, w, N, bias, y + m0 * ldy, ldy,
                       threads);
}

int pd_bf16_gemv_amx_rows(void) { return pd_cpu_has(PD_NEEDS_AMX_BF16) ? 1 : 0; }

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
        return pd_bf16_amx(x, M, K, ldx, w, N, bias, y, threads);
    if (path == PD_BF16_AVX)
        pd_bf16_avx(x, M, K, ldx, w, N, bias, y, N, threads);
    else
        return pd_bf16_emul(x, M, K, ldx, w, N, bias, y, threads);
    return PD_OK;
}
