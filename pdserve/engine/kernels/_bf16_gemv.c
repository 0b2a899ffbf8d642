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

#define TARGET __attribute__((target("avx512f,avx512dq,avx512bf16,avx512bw,avx512vl")))
#define INLINE __attribute__((always_inline)) static inline

#define PD_BF16_GEMV_ROWS 16
#define ROW_BLOCK 8
#define MAX_NB 8
#define PD_OK 0
#define PD_ERR_LEN 3
#define PD_ERR_CPU 4
#define PD_ERR_MEM 5

int pd_bf16_gemv_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

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

/* Channels [0, N) of w into columns [0, N) of y (row stride ldy). */
TARGET static void gemv_avx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                             int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy, int threads) {
    int NB = block_for(M);
    int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * NB, nb = N - n0 < NB ? N - n0 : NB;
        run_block(x, M, ldx, w, K, n0, nb, NB, bias, y, ldy);
    }
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

int pd_int8_gemm_amx_supported(void); /* pdserve/engine/kernels/_int8_gemm.c: the CPU has AMX and we may use it */

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

AMX_TARGET static int gemv_amx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
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
    if (blocks * 16 < N) /* the last channels: fewer than a tile's 16 rows */
        gemv_avx(x, M, K, ldx, w + blocks * 16 * K, N - blocks * 16,
                 bias != NULL ? bias + blocks * 16 : NULL, y + blocks * 16, N, threads);
    return PD_OK;
}

int pd_bf16_gemv_amx_rows(void) { return pd_int8_gemm_amx_supported() ? AMX_MIN_ROWS : 0; }

/* `path`: 0 the library's choice (AMX from AMX_MIN_ROWS rows where the CPU has it), 1 the
 * AVX-512 dot products, 2 AMX (benchmarks and tests run each). */
TARGET int pd_bf16_gemv(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                        int64_t N, const uint16_t *bias, uint16_t *y, int threads, int path) {
    static int supported = -1;
    if (supported < 0)
        supported = pd_bf16_gemv_supported();
    if (!supported || (path == 2 && !pd_int8_gemm_amx_supported()))
        return PD_ERR_CPU;
    if (M < 1 || M > PD_BF16_GEMV_ROWS || K < 1 || N < 1 || ldx < K || path < 0 || path > 2)
        return PD_ERR_LEN;
    threads = threads < 1 ? 1 : threads;
    if (path == 2 || (path == 0 && M >= AMX_MIN_ROWS && pd_int8_gemm_amx_supported()))
        return gemv_amx(x, M, K, ldx, w, N, bias, y, threads);
    gemv_avx(x, M, K, ldx, w, N, bias, y, N, threads);
    return PD_OK;
}
