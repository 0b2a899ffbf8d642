/* Shared by the int8 weight kernels (pdserve/engine/kernels/_int8_gemm.c, pdserve/engine/kernels/_int8_gemv.c): the packed
 * layout's helpers. See _int8_gemm.c for the layout. */
#ifndef PD_INT8_GEMM_H
#define PD_INT8_GEMM_H

#include <immintrin.h>
#include <stdint.h>

#include "_pd_cpu.h"

#define TARGET __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl")))

/* Rounds y = bf16(acc * scale) to nearest even and stores its first `valid` channels. */
TARGET static inline void store_row(uint16_t *dst, __m512 acc, __m512 scale, int64_t valid) {
    __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc, scale));
    if (valid >= 16)
        _mm256_storeu_si256((__m256i *)dst, v);
    else
        _mm256_mask_storeu_epi16(dst, (__mmask16)((1u << valid) - 1u), v);
}

/* The float32 scales of channels [n0, n0 + 16), zero past `valid`. */
TARGET static inline __m512 load_scales(const float *scales, int64_t valid) {
    return _mm512_maskz_loadu_ps((__mmask16)(valid >= 16 ? 0xFFFFu : (1u << valid) - 1u), scales);
}

/* The 32 codes at `w` (16 channels x 2 k) as 32 bf16 in the same order (exact: |q| <= 128
 * fits bf16's 8-bit significand). */
TARGET static inline __m512bh widen(const int8_t *w) {
    /* two 16-byte loads that sign-extend straight from memory (no lane extract) */
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

#define AMX_TARGET __attribute__((target("avx512f,avx512bf16,avx512bw,avx512vl,amx-tile,amx-bf16")))

/* GCC's tile load/store intrinsics are asm with no memory operand: a barrier keeps the
 * buffers' writes before a tile load and their reads after a tile store. */
#define MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0, 1 (C) and 2, 3 (A): rows0 / rows1 rows of 64 bytes (0: unused); 4 (B): 16. */
void pd_int8_amx_configure(int64_t rows0, int64_t rows1);

/* y[M, N] for 1 <= M <= 16 on AMX, codes widened chunk by chunk as they stream in
 * (pdserve/engine/kernels/_int8_amx_rows.c; the caller has checked AMX is usable). */
int pd_int8_amx_rows(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                     const float *scales, int64_t N, uint16_t *y, int threads);

/* The same rows on AMX int8 tile multiplies over 15-bit fixed-point x, per group of 256 k
 * (pdserve/engine/kernels/_int8_amx_q8.c; the caller has checked AMX is usable). */
int pd_int8_amx_q8(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                   const float *scales, int64_t N, uint16_t *y, int threads);

/* y[M, N] = x[M, K] @ (packed * scales)^T for M <= PD_GEMV_ROWS (pdserve/engine/kernels/_int8_gemv.c). */
#define PD_GEMV_ROWS 4
int pd_int8_gemv_fp32(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                      const float *scales, int64_t N, uint16_t *y, int threads);

/* The same rows on integer dot products over 15-bit fixed-point x (pdserve/engine/kernels/_int8_vnni.c). */
int pd_int8_gemv_vnni(const uint16_t *x, int64_t M, int64_t K, const int8_t *packed,
                      const float *scales, int64_t N, uint16_t *y, int threads);

#endif
