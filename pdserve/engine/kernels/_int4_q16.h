/* The arithmetic the int4 integer dot-product kernels share (pdserve/engine/kernels/_int4_gemv.c for 1-4
 * rows, pdserve/engine/kernels/_int4_tiles.c for more), so that both compute every output with the
 * same operations in the same order and give the same bits at any row count:
 *
 *   y[m, n] = bf16( sum_c xs * (scale * sum_k xq q + (offset - 8 scale) * sum_k xq) )
 *
 * per chunk c of C = min(group, 64) k (one weight group, one activation group of
 * _act_q16.h), over the codes in aten's CPU int4pack layout (see _int4_gemm.c). A chunk's
 * integer sums are exact in int32 (|sum| < 2^24) whatever order a kernel adds them in;
 * `pd_int4_chunk_sum` is the one float32 step that folds them into the output's
 * accumulator (two FMAs, in chunk order, from +0.0), `_mm512_cvtneps_pbh` the one rounding.
 *
 * Codes: per 4 k of a 64-channel block (128 bytes: columns k..k+3, 32 bytes each) two byte
 * permutes put each channel's 4 codes in one dword (channels 0-15 and 16-31), a mask and a
 * shift split the low nibbles (channels 0-31) from the high (32-63): 4 vectors of 16
 * channels x 4 k unsigned bytes for `vpdpbusd`. Rows: 15-bit fixed point split into two
 * signed bytes, xq = 128 xh + xl (`pd_act_split`), each code vector meets xh and xl.
 */
#ifndef PD_INT4_Q16_H
#define PD_INT4_Q16_H

#include "_act_q16.h"

#include <stdlib.h>
#include <string.h>

#include "_pd_cpu.h"

#define PD_INT4_UNIT 64 /* output channels per block of the packed layout */

#define PD_INT4_Q16_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512vnni,avx512bf16")))

/* The rows, once per call: xh, xl [M, stride] int8; per row and chunk the sum of its xq
 * times its group's xs; per row and activation group xs. */
struct pd_int4_rows {
    int8_t *xh, *xl;
    float *xsum, *xs;
    int64_t stride, chunk, chunks, groups;
    int16_t *xq; /* scratch, freed with the rest */
};

/* Whether a kernel over these rows takes this shape: K a multiple of 32 and of the group,
 * the group 32 or a multiple of 64 (a chunk is one weight group and one activation
 * group), N a multiple of 64, scales float32 (0) or bf16 (1). */
static inline int pd_int4_q16_shape(int64_t K, int64_t N, int64_t group, int sz_dtype) {
    return K >= 32 && K % 32 == 0 && N >= PD_INT4_UNIT && N % PD_INT4_UNIT == 0
           && (group == 32 || (group >= 64 && group % 64 == 0)) && K % group == 0
           && (sz_dtype == 0 || sz_dtype == 1);
}

static inline void pd_int4_rows_free(struct pd_int4_rows *r) {
    free(r->xq);
    free(r->xh);
    free(r->xs);
    free(r->xsum);
}

/* x [M, K] bf16 as the kernels' rows; PD_ERR_MEM when an allocation fails. */
static inline int pd_int4_rows_init(struct pd_int4_rows *r, const uint16_t *x, int64_t M, int64_t K,
                                    int64_t group) {
    const int64_t groups = pd_act_groups(K), stride = groups * PD_ACT_GROUP;
    const int64_t chunk = group < PD_ACT_GROUP ? group : PD_ACT_GROUP, chunks = K / chunk;
    r->xq = aligned_alloc(64, ((size_t)(M * stride) * sizeof(int16_t) + 63) / 64 * 64);
    r->xh = malloc((size_t)(2 * M * stride));
    r->xs = malloc((size_t)(M * groups) * sizeof(float));
    r->xsum = malloc((size_t)(M * chunks) * sizeof(float));
    if (r->xq == NULL || r->xh == NULL || r->xs == NULL || r->xsum == NULL) {
        pd_int4_rows_free(r);
        return PD_ERR_MEM;
    }
    pd_act_q16(x, M, K, PD_ACT_GROUP, r->xq, r->xs);
    r->xl = r->xh + M * stride;
    pd_act_split(r->xq, M * stride, r->xh, r->xl);
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < chunks; c++) {
            int32_t s = 0;
            for (int64_t k = c * chunk; k < (c + 1) * chunk; k++)
                s += r->xq[m * stride + k];
            r->xsum[m * chunks + c] = (float)s * r->xs[m * groups + c * chunk / PD_ACT_GROUP];
        }
    r->stride = stride;
    r->chunk = chunk;
    r->chunks = chunks;
    r->groups = groups;
    return PD_OK;
}

/* Channels [n0, n0 + 16) of group g: scale, and offset - 8 scale. */
PD_INT4_Q16_TARGET static inline void pd_int4_group_vectors(const void *sz, int sz_dtype, int64_t N, int64_t g,
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
PD_INT4_Q16_TARGET static inline __m512i pd_int4_gather_index(int half) {
    uint8_t idx[64] __attribute__((aligned(64)));
    for (int d = 0; d < 16; d++)
        for (int j = 0; j < 4; j++)
            idx[4 * d + j] = (uint8_t)(32 * j + 16 * half + d);
    return _mm512_load_si512(idx);
}

/* The 4 code vectors of columns k..k+3 at `src` (a block's bytes + 32 k): channels 0-15,
 * 16-31, 32-47, 48-63, each dword a channel's 4 codes. */
PD_INT4_Q16_TARGET static inline void pd_int4_codes4(const uint8_t *src, __m512i lo_idx, __m512i hi_idx,
                                                     __m512i q[4]) {
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512i v0 = _mm512_loadu_si512(src), v1 = _mm512_loadu_si512(src + 64);
    __m512i A = _mm512_permutex2var_epi8(v0, lo_idx, v1), B = _mm512_permutex2var_epi8(v0, hi_idx, v1);
    q[0] = _mm512_and_si512(A, nibble);
    q[1] = _mm512_and_si512(B, nibble);
    q[2] = _mm512_and_si512(_mm512_srli_epi16(A, 4), nibble);
    q[3] = _mm512_and_si512(_mm512_srli_epi16(B, 4), nibble);
}

/* One chunk's exact integer sums of a row (high: against xh, low: against xl) for 16
 * channels into their float32 accumulator. */
PD_INT4_Q16_TARGET static inline __m512 pd_int4_chunk_sum(__m512 acc, __m512i high, __m512i low, __m512 scale,
                                                          __m512 zero, float xs, float xsum) {
    __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(high, 7), low);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(xs)), acc);
    return _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum), acc);
}

#endif
