/* The int4 weight GEMV for 1 to PD_INT4_GEMV_ROWS rows of bf16 activations (decode; loaded
 * by pdserve/engine/quant/int4_kernel.py through pdserve/engine/kernels/native.py), over the codes in the
 * layout the layer already holds (aten's CPU int4pack, see _int4_gemm.c):
 *
 *   y[m, n] = bf16( sum_k x[m, k] * ((q[n, k] - 8) * scale[g, n] + offset[g, n]) )
 *
 * with x as 15-bit fixed point per group of 64 k (_act_q16.h: xq * xs, each element off by
 * at most 2^-15 of its group's largest) and the weights exact in float32 (not rounded to
 * bf16 as the prefill kernel widens them). Per chunk of C = min(group, 64) k (one weight
 * group, one activation group):
 *
 *   sum_k x w = xs * (scale * sum_k xq q + (offset - 8 scale) * sum_k xq)
 *
 * The codes never widen: `vpdpbusd` multiplies four unsigned bytes by four signed ones and
 * adds them into an int32 lane, so each code nibble (0-15) is a byte lane against x. xq
 * (|xq| <= 16383) does not fit a signed byte, so it is split, xq = 128 xh + xl with xh in
 * [-128, 127] and xl in [0, 127], and each code vector takes two dot products. Per 4 k of a
 * 64-channel block (128 bytes: columns k..k+3, 32 bytes each) two byte permutes put each
 * channel's 4 codes in one dword (channels 0-15 and 16-31), a mask and a shift split the
 * low nibbles (channels 0-31) from the high (32-63): 4 code vectors, 8 dot products per row,
 * no conversion. Each chunk's int32 sums (|sum| < 2^24) are converted, scaled and added into
 * float32 accumulators; the result is rounded once to bf16. Blocks of 64 channels are
 * spread over OpenMP threads (torch's pool, see _cpu_kernels.c) in contiguous runs; the
 * codes are prefetched ahead. Needs AVX-512 VBMI, VNNI and BF16 (`pd_int4_gemv_supported`).
 * The rows' preparation, the code permutes and the chunk's float32 step live in _int4_q16.h,
 * shared with _int4_tiles.c (the same arithmetic over many rows: the same bits per row).
 */
#include "_int4_q16.h"

#define PD_INT4_GEMV_ROWS 4
#define UNIT PD_INT4_UNIT
#define ROW_BLOCK 2   /* rows per pass over a block's codes (accumulators: 12 per row) */
#ifndef PD_INT4_GEMV_PREFETCH
#define PD_INT4_GEMV_PREFETCH 8192 /* bytes ahead of the codes being read */
#endif

#define GEMV4_TARGET PD_INT4_Q16_TARGET

int pd_int4_gemv_supported(void) { return pd_cpu_has(PD_NEEDS_INT4_GEMV); }

int pd_int4_gemv_rows(void) { return PD_INT4_GEMV_ROWS; }

/* Rows [m0, m0 + MB) against block u (MB a constant at each call site). */
GEMV4_TARGET __attribute__((always_inline)) static inline void block_rows(
    const struct pd_int4_rows *r, int64_t m0, const uint8_t *codes, const void *sz, int sz_dtype, int64_t N,
    int64_t group, int64_t n0, uint16_t *y, const int MB) {
    const __m512i lo_idx = pd_int4_gather_index(0), hi_idx = pd_int4_gather_index(1);
    const int64_t chunk = r->chunk;
    __m512 acc[4][ROW_BLOCK];
    for (int j = 0; j < 4; j++)
        for (int m = 0; m < MB; m++)
            acc[j][m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < r->chunks; c++) {
        const int64_t k0 = c * chunk, g = k0 / group, a = k0 / PD_ACT_GROUP;
        __m512i high[4][ROW_BLOCK], low[4][ROW_BLOCK];
        for (int j = 0; j < 4; j++)
            for (int m = 0; m < MB; m++)
                high[j][m] = low[j][m] = _mm512_setzero_si512();
        for (int64_t k = k0; k < k0 + chunk; k += 4) {
            const uint8_t *src = codes + k * 32;
            _mm_prefetch((const char *)(src + PD_INT4_GEMV_PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)(src + PD_INT4_GEMV_PREFETCH + 64), _MM_HINT_T0);
            __m512i q[4];
            pd_int4_codes4(src, lo_idx, hi_idx, q);
            for (int m = 0; m < MB; m++) {
                int32_t h, l;
                memcpy(&h, r->xh + (m0 + m) * r->stride + k, sizeof h);
                memcpy(&l, r->xl + (m0 + m) * r->stride + k, sizeof l);
                __m512i hb = _mm512_set1_epi32(h), lb = _mm512_set1_epi32(l);
                for (int j = 0; j < 4; j++) {
                    high[j][m] = _mm512_dpbusd_epi32(high[j][m], q[j], hb);
                    low[j][m] = _mm512_dpbusd_epi32(low[j][m], q[j], lb);
                }
            }
        }
        for (int j = 0; j < 4; j++) {
            __m512 scale, zero;
            pd_int4_group_vectors(sz, sz_dtype, N, g, n0 + 16 * j, &scale, &zero);
            for (int m = 0; m < MB; m++)
                acc[j][m] = pd_int4_chunk_sum(acc[j][m], high[j][m], low[j][m], scale, zero,
                                              r->xs[(m0 + m) * r->groups + a], r->xsum[(m0 + m) * r->chunks + c]);
        }
    }
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(y + (m0 + m) * N + n0 + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(acc[j][m]));
}

GEMV4_TARGET static void block(const struct pd_int4_rows *r, int64_t M, const uint8_t *codes, const void *sz,
                               int sz_dtype, int64_t N, int64_t group, int64_t n0, uint16_t *y) {
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        if (M - m0 >= 2)
            block_rows(r, m0, codes, sz, sz_dtype, N, group, n0, y, 2);
        else
            block_rows(r, m0, codes, sz, sz_dtype, N, group, n0, y, 1);
    }
}

/* y[M, N] = x @ dequant(packed, sz)^T for 1 <= M <= PD_INT4_GEMV_ROWS; PD_ERR_LEN for shapes
 * outside the layout (`pd_int4_q16_shape`), PD_ERR_CPU where this CPU cannot run it. */
GEMV4_TARGET int pd_int4_gemv_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed,
                                   const void *sz, int sz_dtype, int64_t N, int64_t group, uint16_t *y,
                                   int num_threads) {
    if (M < 1 || M > PD_INT4_GEMV_ROWS || !pd_int4_q16_shape(K, N, group, sz_dtype))
        return PD_ERR_LEN;
    if (!pd_int4_gemv_supported())
        return PD_ERR_CPU;
    struct pd_int4_rows rows;
    if (pd_int4_rows_init(&rows, x, M, K, group) != PD_OK)
        return PD_ERR_MEM;
    const int64_t units = N / UNIT;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > units)
        threads = (int)units;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t u = 0; u < units; u++)
        block(&rows, M, packed + u * K * 32, sz, sz_dtype, N, group, u * UNIT, y);
    pd_int4_rows_free(&rows);
    return PD_OK;
}
