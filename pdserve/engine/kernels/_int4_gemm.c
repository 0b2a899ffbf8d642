/* Weight-only int4 GEMM for bf16 activations and many rows (pdserve/engine/quant/int4_kernel.py loads
 * it through pdserve/engine/kernels/native.py; built into pdserve.engine.kernels._cpu_kernels).
 *
 *   y[m, n] = bf16( sum_k x[m, k] * bf16((q[n, k] - 8) * scale[g, n] + offset[g, n]) )
 *   g = k / group
 *
 * The codes stay in the layout torch's CPU int4 kernel packs them in, the one copy the
 * layer holds (`_convert_weight_to_int4pack_for_cpu(q, 1)`, N a multiple of 64; the decode
 * path's `_weight_int4pack_mm_for_cpu` reads the same bytes):
 *   packed [N/64, K, 32] uint8: the byte for (block nb, column k, lane d) holds channel
 *          nb*64+d in its low nibble and nb*64+32+d in its high nibble;
 *   sz     [K/group, N, 2] bf16 or float32: scale, offset;
 *   x      [M, K] bf16, y [M, N] bf16 (C-contiguous), K a multiple of 32 and of `group`.
 * Each weight is widened exactly as `pd_int4_dequant` does it (float32 (q - 8) * scale +
 * offset, one FMA, rounded to nearest even bf16), so the result is F.linear over that
 * dense weight up to the order of the float32 sums, without ever writing the dense weight.
 *
 * Work unit: one 64-channel block. Its codes are widened once per call into a per-thread
 * buffer of AMX B tiles (4 tiles of 16 channels x 32 k per 32 k: 96 KiB for K = 768, in
 * L2); then each block of 32 rows of x multiplies against it, channels 0-31 then 32-63 (the
 * rows' second pass hits the cache): A tiles are the rows read in place, C tiles 32 rows x
 * 32 channels of float32 sums, rounded once to bf16. The next unit's codes are widened into
 * a second buffer a few pairs at a time between this unit's tile multiplies, so the vector
 * units widen while the tile unit multiplies. Row blocks past the last full one run from a
 * zero-padded copy (one tile configuration per call). Past 1 MiB of x the rows run in panels
 * of that size, so a panel's rows stay in L2 while every unit passes over them (each panel
 * widens the codes again: cheaper than streaming x from memory once per unit). Each OpenMP
 * thread (torch's pool, see _cpu_kernels.c) takes a contiguous range of units. Needs AMX-BF16
 * and AVX-512 VBMI, checked at run time (`pd_int4_gemm_supported`); without them the caller
 * keeps its dequantize + matmul path.
 * Tile registers: 0-3 = C (rows 0-15 / 16-31 x channels 0-15 / 16-31), 4, 5 = A, 6, 7 = B.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "_pd_cpu.h"

#define UNIT 64  /* output channels per work unit: one block of the packed layout */
#define HALF 32  /* channels per pass of a row block (2 C tiles wide) */
#define ROWS 32  /* rows per pass over a unit's widened codes */
#define CHUNK 32 /* k per tile multiply */
#ifndef PANEL_BYTES /* x bytes per row panel (pd_int4_gemm_bf16); -D to try another */
#define PANEL_BYTES (1 << 20)
#endif

#define INT4_TARGET \
    __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl,avx512vbmi,amx-tile,amx-bf16")))
/* GCC's tile intrinsics are asm without memory operands: keep buffer writes before tile
 * loads and reads after tile stores. */
#define MEMORY_BARRIER() __asm__ volatile("" ::: "memory")


int pd_int4_gemm_supported(void) { return pd_cpu_has(PD_NEEDS_AMX); }

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

INT4_TARGET static void configure(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
    }
    /* the configuration's stores must happen: GCC's builtin does not say it reads them */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* Byte indices for `_mm512_maskz_permutexvar_epi8` over the 64 bytes of columns k, k+1 of a
 * block (32 + 32): dword e of vector (t, h) gets, in its low byte, the byte of column k + e%2
 * for lane 16t + 8h + e/2 -- the B tile row's order (channel, then k). Its low nibble is
 * channel 16t + 8h + e/2 of the block, its high nibble channel 32 + 16t + 8h + e/2. */
INT4_TARGET static __m512i pair_index(int t, int h) {
    uint8_t idx[64] __attribute__((aligned(64)));
    memset(idx, 0, sizeof idx);
    for (int e = 0; e < 16; e++)
        idx[4 * e] = (uint8_t)((e % 2) * 32 + 16 * t + 8 * h + e / 2);
    return _mm512_load_si512(idx);
}

static inline float sz_at(const void *sz, int sz_dtype, int64_t i) {
    if (sz_dtype == 1) {
        uint32_t u = (uint32_t)((const uint16_t *)sz)[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return ((const float *)sz)[i];
}

/* One unit's widening: its codes, per group the scale and offset of each dword's channel in
 * B tile row order (vector v = 2t + h: channel 16t + 8h + e/2, t = 0..3), and how far it
 * has got. */
struct unit_src {
    const uint8_t *codes; /* the block's [K, 32] bytes */
    float (*scale)[8][16], (*offset)[8][16];
    uint16_t (*b)[32];    /* [K/32][4 tiles][16 rows][32]: the B tiles */
    int64_t next, pairs;  /* pairs widened so far, of K/2 */
};

static void unit_scales(const void *sz, int sz_dtype, int64_t N, int64_t K, int64_t group, int64_t u,
                        struct unit_src *src) {
    for (int64_t g = 0; g < K / group; g++) {
        const int64_t at = (g * N + u * UNIT) * 2;
        for (int v = 0; v < 8; v++)
            for (int e = 0; e < 16; e++) {
                src->scale[g][v][e] = sz_at(sz, sz_dtype, at + 2 * (8 * v + e / 2));
                src->offset[g][v][e] = sz_at(sz, sz_dtype, at + 2 * (8 * v + e / 2) + 1);
            }
    }
}

/* Pairs [src->next, src->next + count) of a unit into its B tiles: row p % 16 of chunk
 * p / 16's four tiles is the pair (k, k+1), k = 2p; column 2j + i = channel j, k + i. */
INT4_TARGET static void widen_pairs(struct unit_src *src, int64_t group, int64_t count,
                                    const __m512i index[4]) {
    const __mmask64 low_bytes = 0x1111111111111111ull;
    const __m512i nibble = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
    const int64_t end = src->next + count < src->pairs ? src->next + count : src->pairs;
    for (int64_t p = src->next; p < end;) {
        const int64_t g = 2 * p / group, seg_end = (g + 1) * group / 2 < end ? (g + 1) * group / 2 : end;
        __m512 sv[8], ov[8]; /* this group's: held in registers across its pairs */
        for (int v = 0; v < 8; v++) {
            sv[v] = _mm512_load_ps(src->scale[g][v]);
            ov[v] = _mm512_load_ps(src->offset[g][v]);
        }
        for (; p < seg_end; p++) {
            const int64_t k = 2 * p, row = (p / 16) * 64 + p % 16;
            const __m512i cols = _mm512_loadu_si512(src->codes + k * 32); /* columns k, k+1 */
            for (int t = 0; t < 2; t++) {
                __m512 lo[2], hi[2];
                for (int h = 0; h < 2; h++) {
                    __m512i q = _mm512_maskz_permutexvar_epi8(low_bytes, index[2 * t + h], cols);
                    __m512i ql = _mm512_sub_epi32(_mm512_and_si512(q, nibble), eight); /* exact */
                    __m512i qh = _mm512_sub_epi32(_mm512_srli_epi32(q, 4), eight);
                    lo[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ql), sv[2 * t + h], ov[2 * t + h]);
                    hi[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qh), sv[4 + 2 * t + h], ov[4 + 2 * t + h]);
                }
                _mm512_store_si512(src->b[row + 16 * t], (__m512i)_mm512_cvtne2ps_pbh(lo[1], lo[0]));
                _mm512_store_si512(src->b[row + 16 * (2 + t)], (__m512i)_mm512_cvtne2ps_pbh(hi[1], hi[0]));
            }
        }
    }
    src->next = end;
}

/* Rows [0, 32) of x (stride K) against channels [32 half, 32 half + 32) of a widened unit;
 * the first `out_rows` are stored to y (stride N). `two`: rows 16-31 are real (else only the
 * first 16 are computed). After each 32 k, `per_step` pairs of the next unit are widened. */
INT4_TARGET static void half_block(const uint16_t *x, int64_t K, const uint16_t (*b)[32], int half,
                                   int two, uint16_t *y, int64_t N, int64_t out_rows,
                                   struct unit_src *next, int64_t per_step, int64_t group,
                                   const __m512i index[4]) {
    float c[ROWS][HALF] __attribute__((aligned(64)));
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
        _tile_zero(2);
        _tile_zero(3);
    }
    for (int64_t k0 = 0, ch = 0; k0 < K; k0 += CHUNK, ch++) {
        MEMORY_BARRIER();
        _tile_loadd(4, x + k0, K * 2);
        _tile_loadd(6, b[64 * ch + 32 * half], 64);
        _tile_loadd(7, b[64 * ch + 32 * half + 16], 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, x + 16 * K + k0, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (next != NULL && next->next < next->pairs)
            widen_pairs(next, group, per_step, index);
    }
    _tile_stored(0, c[0], HALF * 4);
    _tile_stored(1, c[0] + 16, HALF * 4);
    if (two) {
        _tile_stored(2, c[16], HALF * 4);
        _tile_stored(3, c[16] + 16, HALF * 4);
    }
    MEMORY_BARRIER();
    for (int64_t m = 0; m < out_rows; m++)
        _mm512_storeu_si512(y + m * N, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(c[m] + 16),
                                                                     _mm512_load_ps(c[m])));
}

struct problem {
    const uint16_t *x, *xpad; /* xpad: the ragged last rows, zero-padded to 32 (or NULL) */
    int64_t M, K, N, group;
    const uint8_t *packed;
    const void *sz;
    int sz_dtype;
    uint16_t *y;
};

static void unit_start(const struct problem *pr, int64_t u, struct unit_src *src) {
    src->codes = pr->packed + u * pr->K * 32;
    src->next = 0;
    src->pairs = pr->K / 2;
    unit_scales(pr->sz, pr->sz_dtype, pr->N, pr->K, pr->group, u, src);
}

/* All row blocks of unit `u` (widened in `cur`), widening `next` (or NULL) in between. */
INT4_TARGET static void unit_rows(const struct problem *pr, int64_t u, const struct unit_src *cur,
                                  struct unit_src *next, const __m512i index[4]) {
    const int64_t K = pr->K, N = pr->N, full = pr->M / ROWS, tail = pr->M % ROWS;
    const int64_t steps = (full + (tail > 0)) * 2 * (K / CHUNK);
    const int64_t per_step = (K / 2 + steps - 1) / steps;
    const uint16_t (*b)[32] = (const uint16_t (*)[32])cur->b;
    for (int64_t blk = 0; blk < full; blk++)
        for (int half = 0; half < 2; half++)
            half_block(pr->x + blk * ROWS * K, K, b, half, 1, pr->y + blk * ROWS * N + u * UNIT + half * HALF,
                       N, ROWS, next, per_step, pr->group, index);
    if (tail)
        for (int half = 0; half < 2; half++)
            half_block(pr->xpad, K, b, half, tail > 16, pr->y + full * ROWS * N + u * UNIT + half * HALF, N,
                       tail, next, per_step, pr->group, index);
}

/* One thread's units [u0, u1), two buffers: the current unit's and the next's. */
INT4_TARGET static int run_units(const struct problem *pr, int64_t u0, int64_t u1, const __m512i index[4]) {
    const int64_t K = pr->K, groups = K / pr->group;
    if (u0 >= u1)
        return PD_OK;
    struct unit_src src[2];
    void *mem[4] = {aligned_alloc(64, (size_t)K * UNIT * 2), aligned_alloc(64, (size_t)K * UNIT * 2),
                    aligned_alloc(64, (size_t)groups * 2 * 8 * 16 * 4),
                    aligned_alloc(64, (size_t)groups * 2 * 8 * 16 * 4)};
    int rc = mem[0] && mem[1] && mem[2] && mem[3] ? PD_OK : PD_ERR_MEM;
    if (rc == PD_OK) {
        configure();
        for (int i = 0; i < 2; i++) {
            src[i].b = mem[i];
            src[i].scale = (float (*)[8][16])mem[2 + i];
            src[i].offset = src[i].scale + groups;
        }
        unit_start(pr, u0, &src[0]);
        widen_pairs(&src[0], pr->group, K / 2, index);
        for (int64_t u = u0; u < u1; u++) {
            struct unit_src *cur = &src[(u - u0) % 2], *next = NULL;
            if (u + 1 < u1) {
                next = &src[(u + 1 - u0) % 2];
                unit_start(pr, u + 1, next);
            }
            unit_rows(pr, u, cur, next, index);
            if (next != NULL) /* what the steps left (none: they cover K/2 pairs) */
                widen_pairs(next, pr->group, K / 2, index);
        }
        _tile_release();
    }
    for (int i = 0; i < 4; i++)
        free(mem[i]);
    return rc;
}

INT4_TARGET static int gemm(const struct problem *pr, int threads) {
    int64_t units = pr->N / UNIT;
    __m512i index[4];
    for (int v = 0; v < 4; v++)
        index[v] = pair_index(v / 2, v % 2);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int nt = 1, tid = 0;
#ifdef _OPENMP
        nt = omp_get_num_threads();
        tid = omp_get_thread_num();
#endif
        if (run_units(pr, units * tid / nt, units * (tid + 1) / nt, index) != PD_OK) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? PD_ERR_MEM : PD_OK;
}

/* y[M, N] = x @ dequant(packed, sz)^T; PD_ERR_LEN for shapes outside the layout above,
 * PD_ERR_CPU where this CPU or process cannot run it. */
int pd_int4_gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed,
                      const void *sz, int sz_dtype, int64_t N, int64_t group, uint16_t *y,
                      int num_threads) {
    int supported = pd_int4_gemm_supported();
    if (M < 1 || K < CHUNK || N < 64 || N % 64 != 0 || K % CHUNK != 0 || group < 2
        || group % 2 != 0 || K % group != 0 || (sz_dtype != 0 && sz_dtype != 1))
        return PD_ERR_LEN;
    if (!supported)
        return PD_ERR_CPU;
    int64_t units = N / UNIT;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > units)
        threads = (int)units;
    /* Row panels whose x stays in L2 across the units (each panel widens the codes again) */
    int64_t panel = PANEL_BYTES / (K * 2) / ROWS * ROWS;
    if (panel < 8 * ROWS)
        panel = 8 * ROWS;
    int64_t full = M / ROWS, tail = M % ROWS;
    uint16_t *xpad = NULL;
    if (tail) {
        xpad = aligned_alloc(64, (size_t)(ROWS * K) * 2);
        if (xpad == NULL)
            return PD_ERR_MEM;
        memset(xpad, 0, (size_t)(ROWS * K) * 2);
        memcpy(xpad, x + full * ROWS * K, (size_t)(tail * K) * 2);
    }
    int rc = PD_OK;
    for (int64_t m0 = 0; m0 < M && rc == PD_OK; m0 += panel) {
        int64_t rows = M - m0 < panel ? M - m0 : panel;
        struct problem pr = {x + m0 * K, rows % ROWS ? xpad : NULL, rows, K, N, group, packed, sz,
                             sz_dtype, y + m0 * N};
        rc = gemm(&pr, threads);
    }
    free(xpad);
    return rc;
}
