/* The int4 weight GEMM for bf16 activations without AMX (batched decode, prefill; loaded
 * by pdserve/engine/quant/int4_kernel.py through pdserve/engine/kernels/native.py): the int4 GEMV's arithmetic
 * (pdserve/engine/kernels/_int4_q16.h) blocked for many rows, so every output has the GEMV's bits whatever
 * the row count, the thread count or the rows beside it.
 *
 * Per 64-channel block of the packed layout and chunk of min(group, 64) k, the chunk's codes
 * are unpacked once into byte vectors (4 KiB, in L1) and every row of a panel multiplies
 * against them in register tiles of TM rows x 64 channels: per 4 k, the 4 code vectors in
 * registers, each row's xh and xl bytes broadcast, 8 TM `vpdpbusd` into 8 TM int32
 * accumulators. After the chunk each accumulator pair is folded into its output's float32
 * sum (`pd_int4_chunk_sum`; the panel's sums stay in L1 across the chunks) in chunk order
 * from +0.0, as the GEMV folds its registers; the sums are rounded once to bf16. An integer
 * sum is exact in any order, so the blocking (rows per tile, rows per panel, threads)
 * changes no output's bits.
 *
 * Integer dot products rather than `vdpbf16ps`: the GEMV's bits need each 15-bit xq times
 * its code exactly. bf16 holds 8 significant bits, so `vdpbf16ps` could carry xq only as two
 * bf16 halves, one k per lane pair: 16 multiply-adds of x an instruction, where `vpdpbusd`
 * does 4 k per lane on the two byte halves, 32 an instruction, on the same 1 / cycle
 * (measured on Zen 4), over codes unpacked without conversion. Widening the weights to bf16
 * (the AMX kernel's numerics) would also do 32 an instruction, after a convert and an FMA
 * per code, and give another answer than the GEMV's.
 *
 * Rows run in panels of PANEL (their fixed-point bytes stay in L2 across the blocks); blocks
 * are spread over OpenMP threads (torch's pool, see _cpu_kernels.c) in contiguous runs, as
 * the GEMV spreads them. Needs what the GEMV needs: AVX-512 VBMI, VNNI and BF16.
 */
#include "_int4_q16.h"

#define TARGET PD_INT4_Q16_TARGET
#define TM 2          /* rows of a register tile: 8 accumulators a row (3 rows: 7-10% slower, spills) */
#define STEPS 16      /* 4-k steps of the largest chunk (64 k) */
#ifndef PANEL
#define PANEL 48      /* rows per pass over a chunk's codes (a multiple of TM; 24-96 measured alike) */
#endif

int pd_int4_tiles_supported(void) { return pd_cpu_has(PD_NEEDS_INT4_GEMV); }

/* acc + the dot products of q's unsigned bytes with x's 4 signed bytes in every lane. Inline
 * asm, not the intrinsic: GCC 12 otherwise reloads the code vectors for every row or spills
 * accumulators (the register tile needs 16 + 4 + 2 of the 32 vector registers). */
TARGET __attribute__((always_inline)) static inline __m512i dot(__m512i acc, __m512i q, __m512i x) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(q), "v"(x));
    return acc;
}

/* What a block's pass shares: the rows, the chunk being run and its unpacked codes, the
 * group's scale and zero vectors, and the panel's float32 sums acc[row][channel]. */
struct pass {
    const struct pd_int4_rows *r;
    int64_t c, k0, a, steps;
    const __m512i (*codes)[4];
    __m512 scale[4], zero[4];
    float (*acc)[PD_INT4_UNIT];
};

/* Rows [m, m + MB) of the panel (row m0 + m of x) against the chunk (MB a constant at each
 * call site, so the accumulators stay in registers). */
TARGET __attribute__((always_inline)) static inline void tile(const struct pass *p, int64_t m0, int64_t m,
                                                              const int MB) {
    const struct pd_int4_rows *r = p->r;
    const int8_t *xh = r->xh + (m0 + m) * r->stride + p->k0, *xl = r->xl + (m0 + m) * r->stride + p->k0;
    __m512i high[4][TM], low[4][TM];
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < MB; i++)
            high[j][i] = low[j][i] = _mm512_setzero_si512();
    for (int64_t s = 0; s < p->steps; s++) {
        __m512i q[4];
        for (int j = 0; j < 4; j++) {
            q[j] = _mm512_load_si512(&p->codes[s][j]);
            __asm__("" : "+v"(q[j])); /* held in a register for the tile's rows, not reloaded per row */
        }
        for (int i = 0; i < MB; i++) {
            int32_t h, l;
            memcpy(&h, xh + i * r->stride + 4 * s, sizeof h);
            memcpy(&l, xl + i * r->stride + 4 * s, sizeof l);
            const __m512i hb = _mm512_set1_epi32(h), lb = _mm512_set1_epi32(l);
            for (int j = 0; j < 4; j++) {
                high[j][i] = dot(high[j][i], q[j], hb);
                low[j][i] = dot(low[j][i], q[j], lb);
            }
        }
    }
    for (int i = 0; i < MB; i++) {
        const float xs = r->xs[(m0 + m + i) * r->groups + p->a], xsum = r->xsum[(m0 + m + i) * r->chunks + p->c];
        float *acc = p->acc[m + i];
        for (int j = 0; j < 4; j++)
            _mm512_store_ps(acc + 16 * j, pd_int4_chunk_sum(_mm512_load_ps(acc + 16 * j), high[j][i], low[j][i],
                                                            p->scale[j], p->zero[j], xs, xsum));
    }
}

/* Rows [m0, m0 + rows) against block u (channels n0 = 64 u ..), into y. */
TARGET static void block(const struct pd_int4_rows *r, int64_t m0, int64_t rows, const uint8_t *codes,
                         const void *sz, int sz_dtype, int64_t N, int64_t group, int64_t n0, uint16_t *y,
                         float (*acc)[PD_INT4_UNIT], __m512i (*buf)[4]) {
    const __m512i lo_idx = pd_int4_gather_index(0), hi_idx = pd_int4_gather_index(1);
    struct pass p = {.r = r, .steps = r->chunk / 4, .codes = (const __m512i (*)[4])buf, .acc = acc};
    memset(acc, 0, (size_t)rows * sizeof acc[0]); /* +0.0: the GEMV's accumulators start there */
    for (p.c = 0; p.c < r->chunks; p.c++) {
        p.k0 = p.c * r->chunk;
        p.a = p.k0 / PD_ACT_GROUP;
        for (int64_t s = 0; s < p.steps; s++)
            pd_int4_codes4(codes + (p.k0 + 4 * s) * 32, lo_idx, hi_idx, buf[s]);
        for (int j = 0; j < 4; j++)
            pd_int4_group_vectors(sz, sz_dtype, N, p.k0 / group, n0 + 16 * j, &p.scale[j], &p.zero[j]);
        int64_t m = 0;
        for (; m + TM <= rows; m += TM)
            tile(&p, m0, m, TM);
        if (m < rows) /* an odd last row */
            tile(&p, m0, m, 1);
    }
    for (int64_t m = 0; m < rows; m++)
        for (int j = 0; j < 4; j++)
            _mm256_storeu_si256((__m256i *)(y + (m0 + m) * N + n0 + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc[m] + 16 * j)));
}

/* y[M, N] = x @ dequant(packed, sz)^T for any M >= 1, the GEMV's bits (`pd_int4_gemv_bf16`);
 * PD_ERR_LEN for shapes outside the layout (`pd_int4_q16_shape`), PD_ERR_CPU where this CPU
 * cannot run it. */
TARGET int pd_int4_tiles_bf16(const uint16_t *x, int64_t M, int64_t K, const uint8_t *packed, const void *sz,
                              int sz_dtype, int64_t N, int64_t group, uint16_t *y, int num_threads) {
    if (M < 1 || !pd_int4_q16_shape(K, N, group, sz_dtype))
        return PD_ERR_LEN;
    if (!pd_int4_tiles_supported())
        return PD_ERR_CPU;
    struct pd_int4_rows rows;
    if (pd_int4_rows_init(&rows, x, M, K, group) != PD_OK)
        return PD_ERR_MEM;
    const int64_t units = N / PD_INT4_UNIT;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > units)
        threads = (int)units;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float acc[PANEL][PD_INT4_UNIT] __attribute__((aligned(64)));
        __m512i buf[STEPS][4];
        for (int64_t m0 = 0; m0 < M; m0 += PANEL) {
            const int64_t panel = M - m0 < PANEL ? M - m0 : PANEL;
#pragma omp for schedule(static)
            for (int64_t u = 0; u < units; u++)
                block(&rows, m0, panel, packed + u * K * 32, sz, sz_dtype, N, group, u * PD_INT4_UNIT, y, acc, buf);
        }
    }
    pd_int4_rows_free(&rows);
    return PD_OK;
}
