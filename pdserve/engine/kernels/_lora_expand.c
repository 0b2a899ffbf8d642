/* The expand of a step's stacked LoRA update (pdserve/engine/lora/batch.py), each row over its
 * own adapter's rank columns only:
 *
 *   out[t, n] = bf16( out[t, n] + bf16( sum_{j = lo[t]}^{hi[t]-1} h[t, j] * bt[j, n] ) )
 *
 * h [T, R] bf16 (row stride ldh), bt [R, N] bf16 C-contiguous (B of every adapter,
 * transposed), lo/hi [T] int32 column ranges (lo == hi: a base row, left untouched), out
 * [T, N] bf16 C-contiguous, updated in place.
 *
 * The masked GEMM it replaces multiplied every row by every adapter's columns (zeros
 * outside its own) and reduced each output across 16 lanes: at LoRA's small K that
 * reduction, not the products, was the cost. Here each row walks its own columns j in
 * ascending order, adding h[t, j] * bt[j, n] to a float32 accumulator per output that
 * starts at 0 (bf16 products are exact in float32, so a multiply and an add are one
 * rounding, as an FMA would be): a row's bits depend on its adapter's columns alone, not
 * on which other adapters share the stack, where its block lies in it, the other rows,
 * their count or the thread count. The three PD_CLONES builds neither fuse nor reorder,
 * so every CPU mask gives the same bits. Rows are spread over OpenMP threads.
 */
#include <stdint.h>
#include <string.h>

#include "_bf16_gemm.h"

#define NB 64 /* output channels per accumulator block (float32, in registers or L1) */

/* Channels [n0, n0 + nb) of one row; `nb` is NB at every full block's call site, so the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void expand_block(const uint16_t *h, int32_t lo, int32_t hi,
                                                               const uint16_t *bt, int64_t N, int64_t n0,
                                                               const int64_t nb, uint16_t *out) {
    float acc[NB];
    for (int64_t i = 0; i < nb; i++)
        acc[i] = 0.0f;
    for (int32_t j = lo; j < hi; j++) {
        float hv = from_bf16(h[j]);
        const uint16_t *b = bt + (int64_t)j * N + n0;
        for (int64_t i = 0; i < nb; i++)
            acc[i] += hv * from_bf16(b[i]);
    }
    for (int64_t i = 0; i < nb; i++)
        out[n0 + i] = to_bf16(from_bf16(out[n0 + i]) + from_bf16(to_bf16(acc[i])));
}

PD_CLONES(void, expand_row, (const uint16_t *h, int32_t lo, int32_t hi, const uint16_t *bt, int64_t N,
          uint16_t *out), (h, lo, hi, bt, N, out)) {
    int64_t n0 = 0;
    for (; n0 + NB <= N; n0 += NB)
        expand_block(h, lo, hi, bt, N, n0, NB, out);
    if (n0 < N)
        expand_block(h, lo, hi, bt, N, n0, N - n0, out);
}

int pd_lora_expand_bf16(const uint16_t *h, int64_t T, int64_t R, int64_t ldh, const uint16_t *bt, int64_t N,
                        const int32_t *lo, const int32_t *hi, uint16_t *out, int threads) {
    if (T < 0 || R < 1 || N < 1 || ldh < R)
        return PD_ERR_LEN;
    for (int64_t t = 0; t < T; t++)
        if (lo[t] < 0 || hi[t] < lo[t] || hi[t] > R)
            return PD_ERR_LEN;
    threads = threads < 1 ? 1 : threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && T > 1)
    for (int64_t t = 0; t < T; t++)
        if (hi[t] > lo[t])
            expand_row(h + t * ldh, lo[t], hi[t], bt, N, out + t * N);
    return PD_OK;
}
