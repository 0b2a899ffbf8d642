/* The AVX-512 BF16 inner loop of the paged decode attention (pdserve/engine/kernels/_attn_bf16.c). */
#ifndef PD_ATTN_BF16_H
#define PD_ATTN_BF16_H

#include <stdint.h>

#define PD_ATTN_UNHANDLED (-1)

/* Floats of scratch a call needs for `units` (query row, head) units over L keys (G units and
 * L keys for pd_attend_bf16, R * G and L0 + R - 1 for pd_attend_bf16_rows): each unit's scores
 * (L rounded up to 16), its softmax sum, the L keys' V-row pointers, and alignment slack. */
#define PD_ATTN_BF16_SCRATCH(units, L) ((units) * (((L) + 15) / 16 * 16) + (units) + 2 * (L) + 18)

/* One (sequence, KV head) in bf16: q and out point at its G query heads' rows (D apart),
 * sc at PD_ATTN_BF16_SCRATCH(G, L) floats of scratch. PD_ATTN_UNHANDLED: not this head size, CPU or setting. */
int pd_attend_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *table,
                   int64_t L, int64_t num_blocks, int64_t h, int64_t G, int64_t KVH, int64_t D,
                   int64_t bs, float scale, uint16_t *out, float *sc);

/* R consecutive query rows of one sequence (a prefill: row r at q + r * q_stride, its output
 * at out + r * out_stride, both at KV head h's first query head) attending its first L0 + r
 * keys, each row with the bits pd_attend_bf16 gives it alone; sc: PD_ATTN_BF16_SCRATCH(R * G,
 * L0 + R - 1) floats. PD_ATTN_UNHANDLED as pd_attend_bf16. */
int pd_attend_bf16_rows(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                        const int64_t *table, int64_t L0, int64_t R, int64_t num_blocks, int64_t h, int64_t G,
                        int64_t KVH, int64_t D, int64_t bs, float scale, uint16_t *out, int64_t out_stride,
                        float *sc);

/* Turns the loop on (default) or off for the process (A/B benchmarks and tests); returns
 * the previous setting. */
int pd_attn_bf16_set(int on);

#endif
