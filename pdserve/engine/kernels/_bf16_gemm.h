/* Shared by the bf16 linear's three paths (pdserve/engine/kernels/_bf16_gemv.c: the AVX-512 BF16 dot
 * products and the entry point, pdserve/engine/kernels/_bf16_tiles.c: their prefill tiles; pdserve/engine/kernels/_bf16_amx.c: AMX tiles; pdserve/engine/kernels/_bf16_emul.c: the dot
 * products' arithmetic in plain float32): roundings, the row panel, each path's entry. */
#ifndef PD_BF16_GEMM_H
#define PD_BF16_GEMM_H

#include <stdint.h>
#include <string.h>

#include "_pd_cpu.h"

#define PD_BF16_GEMV_ROWS 16 /* rows of one AMX C tile: more run 16 at a time */
#define PD_BF16_ROW_BLOCK 8  /* rows per register block of the dot products */
#define PD_BF16_TILE_ROWS 4 /* from these rows on (a tile's), the dot products run in _bf16_tiles.c's
                             * tiles: ~0.75-0.85x the GEMV's time already at 4-12 rows */

/* float32 -> bf16, round to nearest even (torch's rounding); NaN stays a quiet NaN. */
static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u)
        return 0x7FC0;
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Rows per pass over the weight: as many as keep x's panel (~PANEL_BYTES) in cache, so a
 * prefill reads each channel block's weights from L1 once per panel, not once per row.
 * (96 KiB measured best here; 256 KiB halved the dot products' rate past 64 rows.) */
#define PANEL_BYTES (96 * 1024)

static inline int64_t pd_bf16_panel_rows(int64_t K) {
    int64_t rows = PANEL_BYTES / (K * 2) / PD_BF16_ROW_BLOCK * PD_BF16_ROW_BLOCK;
    return rows < 2 * PD_BF16_ROW_BLOCK ? 2 * PD_BF16_ROW_BLOCK : rows;
}

/* y[M, N] (row stride ldy) = x[M, K] (row stride ldx) @ w[N, K]^T (+ bias), any M >= 1;
 * each checks nothing (pd_bf16_gemv does) and needs its CPU features (the caller asks). */
void pd_bf16_avx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                 const uint16_t *bias, uint16_t *y, int64_t ldy, int threads);
/* The tiles on (default) or off for the process (A/B benchmarks and tests: off, every M runs
 * the decode tiles); returns the previous setting. The bits are the same either way. */
int pd_bf16_tiles_set(int on);
void pd_bf16_avx_tiles(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                       const uint16_t *bias, uint16_t *y, int64_t ldy, int threads);
void pd_bf16_avx_rows(const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t K, int64_t n0,
                      int64_t n1, const uint16_t *bias, uint16_t *y, int64_t ldy);
int pd_bf16_amx(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                const uint16_t *bias, uint16_t *y, int threads);
int pd_bf16_emul(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                 const uint16_t *bias, uint16_t *y, int threads);

#endif
