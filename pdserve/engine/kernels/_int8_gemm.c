/* Weight-only int8 GEMM for bf16 activations (pdserve/engine/quant/int8_kernel.py loads it through
 * pdserve/engine/kernels/native.py; built into pdserve.engine.kernels._cpu_kernels with _int8_gemv.c).
 *
 *   y[m, n] = bf16( scale[n] * sum_k x[m, k] * q[n, k] )     any M
 *
 * Layouts (C-contiguous):
 *   x       [M, K] bf16
 *   packed  [Np/16, Kp/2, 16, 2] int8   Np = N rounded up to 16, Kp = K rounded up to 2,
 *                                       padding is 0; one 32-byte load holds 16 output
 *                                       channels x 2 consecutive k: the pairs
 *                                       `_mm512_dpbf16_ps` multiplies
 *   scales  [N] float32                 per output channel
 *   y       [M, N] bf16, rounded to nearest even once, from the float32 sum
 *
 * The paths over that layout, one chosen per call by `choose_path`:
 * - VNNI (_int8_vnni.c), up to PD_GEMV_ROWS rows (decode): codes sign-extended to int16,
 *   integer dot products against the rows in 15-bit fixed point per group of 64 k.
 * - GEMV (_int8_gemv.c), up to PD_GEMV_ROWS rows: codes widened to float32, FMA (exact in
 *   the rows; a forced path only).
 * - DPBF16 (`gemm_avx`): each 16-channel tile streams its int8 weights once per block of
 *   <= 16 rows: 32 codes widen to bf16 (exact: |q| <= 128 fits bf16's 8-bit significand)
 *   and each row of the block accumulates into its own float32 register with one
 *   dot-product instruction whose x operand is that row's (x[k], x[k+1]) pair broadcast.
 * - AMX (`gemm_amx`), where the CPU and kernel allow it: tile multiplies over codes widened
 *   to bf16 once per call (prefill); AMX_ROWS (_int8_amx_rows.c) widens chunk by chunk, and
 *   AMX_Q8 (_int8_amx_q8.c, batched decode) multiplies the codes as int8 against the rows
 *   in fixed point, split into two bytes.
 * Tiles are spread over OpenMP threads (torch's pool, see _cpu_kernels.c). No Python API:
 * ctypes calls it without the GIL. Needs AVX-512 BF16, checked at run time
 * (`pd_int8_gemm_supported`); without it the caller keeps torch's path.
 */
#include "_int8_gemm.h"

#include <stdlib.h>
#include <string.h>

#define ROW_BLOCK 16
#define AMX_ROWS 32 /* rows per pass over a tile's widened codes: two 16-row A/C tile pairs */
#define PATH_AUTO 0
#define PATH_GEMV 1
#define PATH_DPBF16 2
#define PATH_AMX 3
#define PATH_AMX_ROWS 4
#define PATH_VNNI 5
#define PATH_AMX_Q8 6

int pd_int8_gemm_supported(void) { return pd_cpu_has(PD_NEEDS_INT8); }

/* x[m, k], x[m, k+1] as one 32-bit lane value; the odd tail pairs x[K-1] with 0. */
static inline int32_t pair(const uint16_t *row, int64_t k, int64_t K) {
    if (k + 1 < K) {
        int32_t v;
        memcpy(&v, row + k, sizeof v);
        return v;
    }
    return (int32_t)row[k];
}

/* Rows [0, MB) of x (already offset to the block) against one tile. MB is a constant at
 * every call site, so `acc` lives in registers. Small blocks keep several sets of
 * accumulators (consecutive k pairs) so consecutive dot products do not wait on each
 * other. */
TARGET __attribute__((always_inline)) static inline void tile_rows(
    const uint16_t *x, int64_t K, const int8_t *tile, __m512 scale, uint16_t *y, int64_t N,
    int64_t valid, const int MB) {
    const int SETS = MB <= 2 ? 4 : MB <= 8 ? 2 : 1;
    __m512 acc[4][ROW_BLOCK];
#pragma GCC unroll 4 /* register moves, not a `rep stos` of a stack copy (_bf16_tiles.c's tile) */
    for (int s = 0; s < SETS; s++)
#pragma GCC unroll 16
        for (int m = 0; m < MB; m++)
            acc[s][m] = _mm512_setzero_ps();
    int64_t pairs = (K + 1) / 2, p = 0;
    for (; p + SETS <= pairs; p += SETS) {
        for (int s = 0; s < SETS; s++) {
            __m512bh w = widen(tile + (p + s) * 32);
            for (int m = 0; m < MB; m++) {
                __m512bh xv = (__m512bh)_mm512_set1_epi32(pair(x + m * K, 2 * (p + s), K));
                acc[s][m] = _mm512_dpbf16_ps(acc[s][m], xv, w);
            }
        }
    }
    for (; p < pairs; p++) {
        __m512bh w = widen(tile + p * 32);
        for (int m = 0; m < MB; m++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32(pair(x + m * K, 2 * p, K));
            acc[0][m] = _mm512_dpbf16_ps(acc[0][m], xv, w);
        }
    }
    for (int m = 0; m < MB; m++) {
        __m512 a = acc[0][m];
        for (int s = 1; s < SETS; s++)
            a = _mm512_add_ps(a, acc[s][m]);
        store_row(y + m * N, a, scale, valid);
    }
}

TARGET static void tile_block(const uint16_t *x, int64_t K, const int8_t *tile, __m512 scale,
                              uint16_t *y, int64_t N, int64_t valid, int64_t mb) {
    switch (mb) {
#define ROWS(R) case R: tile_rows(x, K, tile, scale, y, N, valid, R); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
        ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
    }
}

TARGET static void gemm_avx(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                            const float *scales, int64_t N, uint16_t *y, int threads) {
    int64_t tiles = (N + 15) / 16, tile_bytes = (K + 1) / 2 * 32;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n0 = t * 16, valid = N - n0 < 16 ? N - n0 : 16;
        __m512 scale = load_scales(scales + n0, valid);
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            int64_t mb = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
            tile_block(x + m0 * K, K, packed + t * tile_bytes, scale, y + m0 * N + n0, N,
                       valid, mb);
        }
    }
}

/* AMX: one tile multiply does 16 rows x 16 channels x 32 k. A 16-channel tile's codes are
 * widened (as above) once per call into a per-thread buffer of B tiles, 1 KiB of bf16
 * pairs per 32 k (exactly the B tile's layout); then every block of <= 32 rows runs over
 * it: A is the rows' next 32 k, loaded in place (a zero-padded copy for a K tail), C the
 * float32 sums. Widening all of K first keeps the buffer's stores well ahead of the tile
 * loads that read them, and a prefill of many rows widens each code once per call, not
 * once per 32 rows. Past 32 rows, blocks are 32 rows and the ragged last one runs from a
 * zero-padded copy (one tile configuration per call).
 * Tile registers: 0, 1 = C for rows 0-15, 16-31; 2, 3 = A; 4 = B. */
static int amx_ready(void) { return pd_cpu_has(PD_NEEDS_AMX); } /* _pd_cpu.h asks permission once */

AMX_TARGET void pd_int8_amx_configure(int64_t rows0, int64_t rows1) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    int64_t rows[4] = {rows0, rows1, rows0, rows1};
    for (int i = 0; i < 4; i++) {
        cfg.rows[i] = (uint8_t)rows[i];
        cfg.colsb[i] = rows[i] ? 64 : 0;
    }
    cfg.rows[4] = 16;
    cfg.colsb[4] = 64;
    MEMORY_BARRIER(); /* the stores above must reach cfg: ldtilecfg reads it behind the compiler's back */
    _tile_loadconfig(&cfg);
}

/* One tile's `pairs` code pairs as bf16 B tiles b[chunks * 16][32], zero past `pairs`. */
AMX_TARGET static void amx_widen(const int8_t *tile, int64_t pairs, int64_t chunks, uint16_t (*b)[32]) {
    for (int64_t i = 0; i < pairs; i++)
        _mm512_store_si512(b[i], (__m512i)widen(tile + i * 32));
    for (int64_t i = pairs; i < chunks * 16; i++)
        _mm512_store_si512(b[i], _mm512_setzero_si512());
    MEMORY_BARRIER();
}

/* `rows` rows of x (stride K; the configured rows: <= 16 uses tiles 0/2 only) against a
 * widened tile; the first `out_rows` of them are stored. */
AMX_TARGET static void amx_block(const uint16_t *x, int64_t rows, int64_t K, const uint16_t (*b)[32],
                                 int64_t chunks, __m512 scale, uint16_t *y, int64_t N, int64_t valid,
                                 int64_t out_rows) {
    float c[AMX_ROWS][16] __attribute__((aligned(64)));
    _tile_zero(0);
    if (rows > 16)
        _tile_zero(1);
    for (int64_t ch = 0; ch < chunks; ch++) {
        int64_t k0 = 32 * ch;
        _tile_loadd(4, b[16 * ch], 64);
        if (k0 + 32 <= K) {
            _tile_loadd(2, x + k0, K * 2);
            if (rows > 16)
                _tile_loadd(3, x + 16 * K + k0, K * 2);
        } else { /* K tail: the rows' last k, zero-padded to 32 */
            uint16_t a[AMX_ROWS][32] __attribute__((aligned(64)));
            memset(a, 0, sizeof a);
            for (int64_t m = 0; m < rows; m++)
                memcpy(a[m], x + m * K + k0, (size_t)(K - k0) * 2);
            MEMORY_BARRIER();
            _tile_loadd(2, a[0], 64);
            if (rows > 16)
                _tile_loadd(3, a[16], 64);
        }
        _tile_dpbf16ps(0, 2, 4);
        if (rows > 16)
            _tile_dpbf16ps(1, 3, 4);
    }
    _tile_stored(0, c[0], 64);
    if (rows > 16)
        _tile_stored(1, c[16], 64);
    MEMORY_BARRIER();
    for (int64_t m = 0; m < out_rows; m++)
        store_row(y + m * N, _mm512_load_ps(c[m]), scale, valid);
}

AMX_TARGET static int gemm_amx(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                               const float *scales, int64_t N, uint16_t *y, int threads) {
    int64_t tiles = (N + 15) / 16, pairs = (K + 1) / 2, tile_bytes = pairs * 32;
    int64_t chunks = (pairs + 15) / 16;
    int64_t rows = M < AMX_ROWS ? M : AMX_ROWS, blocks = M <= AMX_ROWS ? 1 : M / AMX_ROWS;
    int64_t tail = M <= AMX_ROWS ? 0 : M % AMX_ROWS;
    uint16_t *xpad = NULL; /* the ragged last block past 32 rows, zero-padded to 32 rows */
    if (tail) {
        xpad = aligned_alloc(64, ((size_t)(AMX_ROWS * K) * 2 + 63) / 64 * 64);
        if (xpad == NULL)
            return PD_ERR_MEM;
        memset(xpad, 0, (size_t)(AMX_ROWS * K) * 2);
        memcpy(xpad, x + (M - tail) * K, (size_t)(tail * K) * 2);
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint16_t (*b)[32] = aligned_alloc(64, (size_t)chunks * 16 * 64);
        if (b == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            pd_int8_amx_configure(rows < 16 ? rows : 16, rows < 16 ? 0 : rows - 16);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (b == NULL)
                continue;
            int64_t n0 = t * 16, valid = N - n0 < 16 ? N - n0 : 16;
            __m512 scale = load_scales(scales + n0, valid);
            amx_widen(packed + t * tile_bytes, pairs, chunks, b);
            for (int64_t blk = 0; blk < blocks; blk++)
                amx_block(x + blk * AMX_ROWS * K, rows, K, (const uint16_t (*)[32])b, chunks, scale,
                          y + blk * AMX_ROWS * N + n0, N, valid, rows);
            if (tail)
                amx_block(xpad, AMX_ROWS, K, (const uint16_t (*)[32])b, chunks, scale,
                          y + (M - tail) * N + n0, N, valid, tail);
        }
        if (b != NULL) {
            _tile_release();
            free(b);
        }
    }
    free(xpad);
    return failed ? PD_ERR_MEM : PD_OK;
}

int pd_int8_gemm_amx_supported(void) { return amx_ready(); }

/* The path for M rows (the one place that chooses; `python -m bench.int8_gemm --step` times
 * each over a decode step's distinct weights, against the bf16 GEMV, one thread):
 * - up to PD_GEMV_ROWS rows the VNNI GEMV (_int8_vnni.c), fewest instructions per code byte:
 *   0.4-0.55x the bf16 GEMV's time at one row, where the float32 GEMV reads 0.7-0.9x;
 * - 5-16 rows, where the CPU allows AMX, int8 tile multiplies (_int8_amx_q8.c): 0.5-0.6x at
 *   8 rows and 0.55-0.65x at 16, where the widening `pd_int8_amx_rows` reads 0.65-0.75x;
 * - above that `gemm_amx` (widening amortised over 32-row blocks);
 * - without AMX the AVX-512 BF16 dot products. */
static int choose_path(int64_t M) {
    if (M <= PD_GEMV_ROWS)
        return PATH_VNNI;
    if (!amx_ready())
        return PATH_DPBF16;
    return M <= 16 ? PATH_AMX_Q8 : PATH_AMX;
}

int pd_int8_gemm_path(int64_t M) { return M < 1 ? PATH_AUTO : choose_path(M); }

/* `path`: PATH_AUTO (`choose_path`), or one forced (tests and the benchmark run each). */
int pd_int8_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                      const float *scales, int64_t N, uint16_t *y, int num_threads, int path) {
    int supported = pd_int8_gemm_supported();
    if (M < 1 || K < 1 || N < 1 || path < PATH_AUTO || path > PATH_AMX_Q8
        || ((path == PATH_AMX_ROWS || path == PATH_AMX_Q8) && M > 16) || (path == PATH_VNNI && M > PD_GEMV_ROWS))
        return PD_ERR_LEN;
    if (!supported || ((path == PATH_AMX || path == PATH_AMX_ROWS || path == PATH_AMX_Q8) && !amx_ready()))
        return PD_ERR_CPU;
    int64_t tiles = (N + 15) / 16;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > tiles)
        threads = (int)tiles;
    switch (path == PATH_AUTO ? choose_path(M) : path) {
    case PATH_GEMV:
        return pd_int8_gemv_fp32(x, M, K, packed, scales, N, y, threads);
    case PATH_VNNI:
        return pd_int8_gemv_vnni(x, M, K, packed, scales, N, y, threads);
    case PATH_AMX:
        return gemm_amx(x, M, K, packed, scales, N, y, threads);
    case PATH_AMX_ROWS:
        return pd_int8_amx_rows(x, M, K, packed, scales, N, y, threads);
    case PATH_AMX_Q8:
        return pd_int8_amx_q8(x, M, K, packed, scales, N, y, threads);
    default:
        gemm_avx(x, M, K, packed, scales, N, y, threads);
        return PD_OK;
    }
}
