/* Weight-only int8 GEMM for a few rows of bf16 activations (engine/quant/int8_kernel.py
 * loads it through engine/native_kernels.py; built into engine._cpu_kernels).
 *
 *   y[m, n] = bf16( scale[n] * sum_k x[m, k] * q[n, k] )     m < M <= 32
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
 * Each 16-channel tile streams its int8 weights once per block of <= 16 rows: 32 codes
 * widen to bf16 (exact: |q| <= 128 fits bf16's 8-bit significand) and each row of the
 * block accumulates into its own float32 register with one dot-product instruction whose
 * x operand is that row's (x[k], x[k+1]) pair broadcast. Tiles are spread over OpenMP
 * threads (torch's pool, see _cpu_kernels.c). No Python API: ctypes calls it without
 * the GIL. Needs AVX-512 BF16, checked at run time (`pd_int8_gemm_supported`); without
 * it the caller keeps torch's path.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PD_OK 0
#define PD_ERR_LEN 3
#define PD_ERR_CPU 4
#define ROW_BLOCK 16
#define MAX_ROWS 32

int pd_int8_gemm_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

#define TARGET __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))

/* The 32 codes at `w` (16 channels x 2 k) as 32 bf16 in the same order. */
TARGET static inline __m512bh widen(const int8_t *w) {
    __m256i b = _mm256_loadu_si256((const __m256i *)w);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* x[m, k], x[m, k+1] as one 32-bit lane value; the odd tail pairs x[K-1] with 0. */
static inline int32_t pair(const uint16_t *row, int64_t k, int64_t K) {
    if (k + 1 < K) {
        int32_t v;
        memcpy(&v, row + k, sizeof v);
        return v;
    }
    return (int32_t)row[k];
}

TARGET static inline void store_row(uint16_t *dst, __m512 acc, __m512 scale, int64_t valid) {
    __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc, scale));
    if (valid >= 16)
        _mm256_storeu_si256((__m256i *)dst, v);
    else
        _mm256_mask_storeu_epi16(dst, (__mmask16)((1u << valid) - 1u), v);
}

/* Rows [0, MB) of x (already offset to the block) against one tile. MB is a constant at
 * every call site, so `acc` lives in registers. Blocks of <= 8 rows keep two sets of
 * accumulators (even and odd k pairs) so consecutive dot products do not wait on each
 * other. */
TARGET __attribute__((always_inline)) static inline void tile_rows(
    const uint16_t *x, int64_t K, const int8_t *tile, __m512 scale, uint16_t *y, int64_t N,
    int64_t valid, const int MB) {
    const int SETS = MB <= 8 ? 2 : 1;
    __m512 acc[2][ROW_BLOCK];
    for (int s = 0; s < SETS; s++)
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
        __m512 a = SETS == 2 ? _mm512_add_ps(acc[0][m], acc[1][m]) : acc[0][m];
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
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n0 = t * 16, valid = N - n0 < 16 ? N - n0 : 16;
        float s[16] = {0};
        memcpy(s, scales + n0, (size_t)valid * sizeof(float));
        __m512 scale = _mm512_loadu_ps(s);
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            int64_t mb = M - m0 < ROW_BLOCK ? M - m0 : ROW_BLOCK;
            tile_block(x + m0 * K, K, packed + t * tile_bytes, scale, y + m0 * N + n0, N,
                       valid, mb);
        }
    }
}

/* AMX: one tile multiply does 16 rows x 16 channels x 32 k. Per 32 k of a 16-channel
 * tile the 16 x 32 codes widen (as above) into a 1 KiB bf16 buffer that is exactly the B
 * tile's pair layout; A is the x rows' next 32 k, loaded in place (a zero-padded copy for
 * a K tail), C the float32 sums. Rows past 16 use a second A/C tile pair over the same B.
 * Tile registers: 0, 1 = C for rows 0-15, 16-31; 2, 3 = A; 4 = B. */
#define AMX_TARGET __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl,amx-tile,amx-bf16")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* GCC's tile load/store intrinsics are asm with no memory operand: a barrier keeps the
 * buffers' writes before a tile load and their reads after a tile store. */
#define MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static int amx_ready(void) {
    static int ready = -1; /* the permission is per process: asked once */
    if (ready < 0) {
        __builtin_cpu_init();
        ready = __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("amx-tile")
                && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return ready;
}

AMX_TARGET static void amx_configure(int64_t rows0, int64_t rows1) {
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
    _tile_loadconfig(&cfg);
}

/* Pairs [p0, p0 + n) of a tile's codes as B (zero past n); x's k range [2 p0, +32) as A. */
AMX_TARGET static void amx_chunk(const uint16_t *x, int64_t M, int64_t K, const int8_t *tile,
                                 int64_t p0, uint16_t (*b)[32]) {
    int64_t pairs = (K + 1) / 2, n = pairs - p0 < 16 ? pairs - p0 : 16, k0 = 2 * p0;
    for (int64_t i = 0; i < n; i++)
        _mm512_storeu_si512(b[i], (__m512i)widen(tile + (p0 + i) * 32));
    for (int64_t i = n; i < 16; i++)
        memset(b[i], 0, 64);
    MEMORY_BARRIER();
    _tile_loadd(4, b, 64);
    if (k0 + 32 <= K) {
        _tile_loadd(2, x + k0, K * 2);
        if (M > 16)
            _tile_loadd(3, x + 16 * K + k0, K * 2);
    } else { /* K tail: the rows' last k, zero-padded to 32 */
        uint16_t a[MAX_ROWS][32];
        memset(a, 0, sizeof a);
        for (int64_t m = 0; m < M; m++)
            memcpy(a[m], x + m * K + k0, (size_t)(K - k0) * 2);
        MEMORY_BARRIER();
        _tile_loadd(2, a[0], 64);
        if (M > 16)
            _tile_loadd(3, a[16], 64);
    }
    _tile_dpbf16ps(0, 2, 4);
    if (M > 16)
        _tile_dpbf16ps(1, 3, 4);
}

AMX_TARGET static void amx_store(const float (*c)[16], int64_t rows, __m512 scale, uint16_t *y,
                                 int64_t N, int64_t valid) {
    for (int64_t m = 0; m < rows; m++)
        store_row(y + m * N, _mm512_loadu_ps(c[m]), scale, valid);
}

AMX_TARGET static void gemm_amx(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                                const float *scales, int64_t N, uint16_t *y, int threads) {
    int64_t tiles = (N + 15) / 16, pairs = (K + 1) / 2, tile_bytes = pairs * 32;
    int64_t rows0 = M < 16 ? M : 16, rows1 = M - rows0;
#pragma omp parallel num_threads(threads)
    {
        amx_configure(rows0, rows1);
        uint16_t b[16][32] __attribute__((aligned(64)));
        float c[MAX_ROWS][16] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t n0 = t * 16, valid = N - n0 < 16 ? N - n0 : 16;
            float s[16] = {0};
            memcpy(s, scales + n0, (size_t)valid * sizeof(float));
            _tile_zero(0);
            if (rows1)
                _tile_zero(1);
            for (int64_t p0 = 0; p0 < pairs; p0 += 16)
                amx_chunk(x, M, K, packed + t * tile_bytes, p0, b);
            _tile_stored(0, c[0], 64);
            if (rows1)
                _tile_stored(1, c[16], 64);
            MEMORY_BARRIER();
            amx_store((const float (*)[16])c, M, _mm512_loadu_ps(s), y + n0, N, valid);
        }
        _tile_release();
    }
}


int pd_int8_gemm_amx_supported(void) { return amx_ready(); }

/* `use_amx` 0 keeps the AVX-512 BF16 loop even where AMX is there (tests run both). */
int pd_int8_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                      const float *scales, int64_t N, uint16_t *y, int num_threads, int use_amx) {
    if (M < 1 || M > MAX_ROWS || K < 1 || N < 1)
        return PD_ERR_LEN;
    if (!pd_int8_gemm_supported())
        return PD_ERR_CPU;
    int64_t tiles = (N + 15) / 16;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > tiles)
        threads = (int)tiles;
    if (use_amx && amx_ready())
        gemm_amx(x, M, K, packed, scales, N, y, threads);
    else
        gemm_avx(x, M, K, packed, scales, N, y, threads);
    return PD_OK;
}
