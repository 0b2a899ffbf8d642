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
 */
#include "_act_q16.h"

#include <stdlib.h>
#include <string.h>

#include "_pd_cpu.h"

#define PD_INT4_GEMV_ROWS 4
#define UNIT 64       /* output channels per block of the packed layout */
#define ROW_BLOCK 2   /* rows per pass over a block's codes (accumulators: 12 per row) */
#ifndef PD_INT4_GEMV_PREFETCH
#define PD_INT4_GEMV_PREFETCH 8192 /* bytes ahead of the codes being read */
#endif

#define GEMV4_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512vnni,avx512bf16")))

int pd_int4_gemv_supported(void) { return pd_cpu_has(PD_NEEDS_INT4_GEMV); }

int pd_int4_gemv_rows(void) { return PD_INT4_GEMV_ROWS; }

/* What the rows are, once per call: xh, xl [M, stride] int8; per row and chunk the sum of
 * its xq times its group's xs; per row and activation group xs. */
struct rows_q {
    const int8_t *xh, *xl;
    const float *xsum, *xs;
    int64_t stride, chunks, groups;
};

/* Channels [n0, n0 + 16) of group g: scale, and offset - 8 scale. */
GEMV4_TARGET static inline void group_vectors(const void *sz, int sz_dtype, int64_t N, int64_t g,
                                              int64_t n0, __m512 *scale, __m512 *zero) {
    __m512 s, o;
    if (sz_dtype == 1) { /* bf16 (scale, offset) pairs: one dword each */
        __m512i v = _mm512_loadu_si512((const uint16_t *)sz + (g * N + n0) * 2);
        s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        o = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
    } else {
        const float *f = (const float *)sz + (g * N + n0) * 2;
        __m512 a = _mm512_loadu_ps(f), b = _mm512_loadu_ps(f + 16);
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        s = _mm512_permutex2var_ps(a, even, b);
        o = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
    }
    *scale = s;
    *zero = _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), s, o);
}

/* Byte 4d + j of the result: column k + j's byte for lane d + 16 half (two 64-byte loads:
 * columns k, k+1 then k+2, k+3). */
GEMV4_TARGET static __m512i gather_index(int half) {
    uint8_t idx[64] __attribute__((aligned(64)));
    for (int d = 0; d < 16; d++)
        for (int j = 0; j < 4; j++)
            idx[4 * d + j] = (uint8_t)(32 * j + 16 * half + d);
    return _mm512_load_si512(idx);
}

/* Rows [m0, m0 + MB) against block u (MB a constant at each call site). */
GEMV4_TARGET __attribute__((always_inline)) static inline void block_rows(
    const struct rows_q *r, int64_t m0, const uint8_t *codes, const void *sz, int sz_dtype, int64_t N,
    int64_t group, int64_t chunk, int64_t n0, uint16_t *y, const int MB) {
    const __m512i lo_idx = gather_index(0), hi_idx = gather_index(1), nibble = _mm512_set1_epi8(15);
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
            __m512i v0 = _mm512_loadu_si512(src), v1 = _mm512_loadu_si512(src + 64);
            __m512i A = _mm512_permutex2var_epi8(v0, lo_idx, v1), B = _mm512_permutex2var_epi8(v0, hi_idx, v1);
            __m512i q[4] = {_mm512_and_si512(A, nibble), _mm512_and_si512(B, nibble),
                            _mm512_and_si512(_mm512_srli_epi16(A, 4), nibble),
                            _mm512_and_si512(_mm512_srli_epi16(B, 4), nibble)};
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
            group_vectors(sz, sz_dtype, N, g, n0 + 16 * j, &scale, &zero);
            for (int m = 0; m < MB; m++) {
                __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(high[j][m], 7), low[j][m]);
                __m512 xs = _mm512_set1_ps(r->xs[(m0 + m) * r->groups + a]);
                acc[j][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, xs), acc[j][m]);
                acc[j][m] = _mm512_fmadd_ps(zero, _mm512_set1_ps(r->xsum[(m0 + m) * r->chunks + c]), acc[j][m]);
            }
        }
    }
    for (int m = 0; m < MB; m++)
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(y + (m0 + m) * N + n0 + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(acc[j][m]));
}

GEMV4_TARGET static void block(const struct rows_q *r, int64_t M, const uint8_t *codes, const void *sz,
                               int sz_dtype, int64_t N, int64_t group, int64_t chunk, int64_t n0, uint16_t *y) {
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        if (M - m0 >= 2)
            block_rows(r, m0, codes, sz, sz_dtype, N, group, chunk, n0, y, 2);
        else
            block_rows(r, m0, codes, sz, sz_dtype, N, group, chunk, n0, y, 1);
    }
}

/* y[M, N] = x @ dequant(packed, sz)^T for 1 <= M <= PD_INT4_GEMV_ROWS; PD_ERR_LEN for shapes
 * outside the layout (K a multiple of 32 and of the group, N of 64, the group 32 or a
 * multiple of 64), PD_ERR_CPU where this CPU cannot run it. */
GEMV4_TARGET int pd_int4_gemv_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed,
                                   const void *sz, int sz_dtype, int64_t N, int64_t group, uint16_t *y,
                                   int num_threads) {
    int supported = pd_int4_gemv_supported();
    if (M < 1 || M > PD_INT4_GEMV_ROWS || K < 32 || K % 32 != 0 || N < UNIT || N % UNIT != 0
        || (group != 32 && (group < 64 || group % 64 != 0)) || K % group != 0
        || (sz_dtype != 0 && sz_dtype != 1))
        return PD_ERR_LEN;
    if (!supported)
        return PD_ERR_CPU;
    const int64_t groups = pd_act_groups(K), stride = groups * PD_ACT_GROUP;
    const int64_t chunk = group < PD_ACT_GROUP ? group : PD_ACT_GROUP, chunks = K / chunk;
    int16_t *xq = aligned_alloc(64, ((size_t)(M * stride) * sizeof(int16_t) + 63) / 64 * 64);
    int8_t *xh = malloc((size_t)(2 * M * stride));
    float *xs = malloc((size_t)(M * groups) * sizeof(float)), *xsum = malloc((size_t)(M * chunks) * sizeof(float));
    if (xq == NULL || xh == NULL || xs == NULL || xsum == NULL) {
        free(xq);
        free(xh);
        free(xs);
        free(xsum);
        return PD_ERR_MEM;
    }
    pd_act_q16(x, M, K, PD_ACT_GROUP, xq, xs);
    int8_t *xl = xh + M * stride;
    pd_act_split(xq, M * stride, xh, xl);
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < chunks; c++) {
            int32_t s = 0;
            for (int64_t k = c * chunk; k < (c + 1) * chunk; k++)
                s += xq[m * stride + k];
            xsum[m * chunks + c] = (float)s * xs[m * groups + c * chunk / PD_ACT_GROUP];
        }
    const struct rows_q rows = {xh, xl, xsum, xs, stride, chunks, groups};
    const int64_t units = N / UNIT;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > units)
        threads = (int)units;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t u = 0; u < units; u++)
        block(&rows, M, packed + u * K * 32, sz, sz_dtype, N, group, chunk, u * UNIT, y);
    free(xq);
    free(xh);
    free(xs);
    free(xsum);
    return PD_OK;
}
