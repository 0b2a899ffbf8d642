/* The bf16 inner loop of the in-place paged decode attention (`attend` in _cpu_kernels.c
 * calls it for one (sequence, KV head) when it applies): head size 64 or 128, a CPU with
 * AVX-512 BF16. The G query heads sharing the KV head read each K and V row once between
 * them, from the pool in place, as the generic loop does; what changes is the arithmetic:
 *
 * - q . k: `_mm512_dpbf16_ps` over the bf16 q and k rows as stored (products exact in
 *   float32, float32 sums), the scale applied to the sum. Sixteen keys' partial vectors
 *   are summed across lanes together (one transposing tree, ~3 instructions a score)
 *   instead of one horizontal sum per score.
 * - softmax: max, exp and sum 16 scores at a time; exp is a degree-6 polynomial after
 *   range reduction (relative error ~2e-7, as expf's float32 result is within rounding).
 * - p . V: up to 16 float32 accumulators (4 heads x 64, or 2 x 128) stay in registers
 *   over the whole context; each V row is widened from bf16 once per head group.
 *
 * A prefill (pd_paged_prefill in _cpu_kernels.c) runs a few consecutive query rows of one KV
 * head together (`attend_rows_d`): each row's scores, softmax and p . V are computed in
 * exactly the order above, so a prefill row has the bits of the decode at its position; only
 * the K row loads (one per key for every row and head of the tile) and the V rows' widening
 * (one per key for up to 6 (row, head) pairs of accumulators) are shared.
 *
 * The output is rounded to bf16 once, to nearest even. Returns PD_OK, PD_ERR_BLOCK for a
 * block id outside the pool, or PD_ATTN_UNHANDLED (the caller runs its generic loop).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "_attn_bf16.h"
#include "_attn_simd.h"

#define TARGET __attribute__((target("avx512f,avx512dq,avx512bf16,avx512bw,avx512vl")))
#define INLINE __attribute__((always_inline)) static inline

#include "_pd_cpu.h"
#define PREFETCH_KEYS 8 /* how far ahead p.V prefetches V rows */

static int enabled = 1;

int pd_attn_bf16_set(int on) {
    int was = enabled;
    enabled = on != 0;
    return was;
}

static int bf16_ok(void) { return pd_cpu_has(PD_NEEDS_AVX512_BF16); }

TARGET INLINE __m512 dot(__m512 acc, __m512 a, __m512 b) { /* see _bf16_gemv.c: GCC 12 */
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* 16 bf16 at p as float32 (exact). */
TARGET INLINE __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

TARGET INLINE int attend_d(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           const int64_t *table, int64_t L, int64_t num_blocks, int64_t h, int64_t G,
                           int64_t KVH, int64_t bs, float scale, uint16_t *out, float *sc,
                           const int D) {
    const int DV = D / 32, GB = 16 / (D / 16); /* k vectors per row; heads per p.V pass */
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t += bs) { /* every block id, before any is read */
        int64_t blk = table[t / bs];
        if (blk < 0 || blk >= num_blocks)
            return PD_ERR_BLOCK;
    }
    const int64_t row_stride = KVH * D; /* elements between a block's consecutive keys */
    for (int64_t t0 = 0; t0 < L; t0 += 16) { /* 16 keys at a time, every head over them */
        const uint16_t *kr[16];
        int64_t bi = t0 / bs, off = t0 % bs, n = L - t0 < 16 ? L - t0 : 16;
        for (int i = 0; i < 16; i++) {
            kr[i] = i < n ? k + (table[bi] * bs + off) * row_stride + h * D : NULL;
            if (++off == bs)
                off = 0, bi++;
        }
        if (t0 + 16 < L) { /* the next 16 keys' rows: a block jump the hardware cannot guess */
            int64_t nbi = (t0 + 16) / bs, noff = (t0 + 16) % bs, nn = L - t0 - 16 < 16 ? L - t0 - 16 : 16;
            for (int i = 0; i < nn; i++) {
                const char *p = (const char *)(k + (table[nbi] * bs + noff) * row_stride + h * D);
                for (int line = 0; line < D * 2; line += 64)
                    _mm_prefetch(p + line, _MM_HINT_T0);
                if (++noff == bs)
                    noff = 0, nbi++;
            }
        }
        for (int64_t g = 0; g < G; g++) {
            __m512 qv[4], part[16];
            for (int j = 0; j < DV; j++)
                qv[j] = _mm512_loadu_ps(q + g * D + 32 * j);
            for (int i = 0; i < 16; i++) {
                if (i >= n) {
                    part[i] = zero;
                    continue;
                }
                __m512 a = dot(zero, qv[0], _mm512_loadu_ps(kr[i]));
                for (int j = 1; j < DV; j++)
                    a = dot(a, qv[j], _mm512_loadu_ps(kr[i] + 32 * j));
                part[i] = a;
            }
            __m512 r = _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(sc + g * L + t0, (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1u), r);
        }
    }
    softmax_rows(sc, G, L);
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
        __m512 acc[16];
        int64_t gn = pv_pass_begin(acc, G, g0, GB);
        int64_t bi = 0, off = 0, pbi = PREFETCH_KEYS / bs, poff = PREFETCH_KEYS % bs;
        for (int64_t t = 0; t < L; t++) {
            const uint16_t *vr = v + (table[bi] * bs + off) * row_stride + h * D;
            if (++off == bs)
                off = 0, bi++;
            if (t + PREFETCH_KEYS < L) { /* the V row PREFETCH_KEYS keys ahead */
                const char *p = (const char *)(v + (table[pbi] * bs + poff) * row_stride + h * D);
                for (int line = 0; line < D * 2; line += 64)
                    _mm_prefetch(p + line, _MM_HINT_T0);
                if (++poff == bs)
                    poff = 0, pbi++;
            }
            __m512 row[8];
            for (int j = 0; j < D / 16; j++)
                row[j] = widen16(vr + 16 * j);
            pv_accumulate(acc, row, sc, L, t, g0, gn, GB, D / 16, 1.0f);
        }
        for (int64_t g = 0; g < gn; g++)
            for (int j = 0; j < D / 16; j++)
                _mm256_storeu_si256((__m256i *)(out + (g0 + g) * D + 16 * j),
                                    (__m256i)_mm512_cvtneps_pbh(acc[g * (D / 16) + j]));
    }
    return PD_OK;
}

/* p . V of `UN` (query row, head) units u0.. of a row tile (attend_rows_d): unit u = r * G + g
 * reads row r's probabilities for head g and adds each V row of its L0 + r keys, in key
 * order, into its own D / 16 accumulators, exactly as attend_d's pass does for that row;
 * each V row is widened once for all UN units. */
TARGET INLINE void pv_rows(const uint16_t *v, const int64_t *table, int64_t bs, int64_t row_stride, int64_t h,
                           const float *sc, int64_t Lmax, int64_t L0, int64_t G, int64_t u0, uint16_t *out,
                           int64_t out_stride, const int UN, const int D) {
    const int DV = D / 16;
    __m512 acc[24];
    const float *p[6];
    int64_t len[6];
    uint16_t *o[6];
    for (int i = 0; i < UN; i++) {
        int64_t r = (u0 + i) / G, g = (u0 + i) % G;
        len[i] = L0 + r;
        p[i] = sc + r * G * Lmax + g * len[i];
        o[i] = out + r * out_stride + g * D;
    }
    for (int i = 0; i < UN * DV; i++)
        acc[i] = _mm512_setzero_ps();
    int64_t L = len[UN - 1], bi = 0, off = 0, pbi = PREFETCH_KEYS / bs, poff = PREFETCH_KEYS % bs;
    for (int64_t t = 0; t < L; t++) {
        const uint16_t *vr = v + (table[bi] * bs + off) * row_stride + h * D;
        if (++off == bs)
            off = 0, bi++;
        if (t + PREFETCH_KEYS < L) {
            const char *pf = (const char *)(v + (table[pbi] * bs + poff) * row_stride + h * D);
            for (int line = 0; line < D * 2; line += 64)
                _mm_prefetch(pf + line, _MM_HINT_T0);
            if (++poff == bs)
                poff = 0, pbi++;
        }
        __m512 row[8];
        for (int j = 0; j < DV; j++)
            row[j] = widen16(vr + 16 * j);
        for (int i = 0; i < UN; i++) {
            if (t >= len[i])
                continue;
            __m512 pg = _mm512_set1_ps(p[i][t] * 1.0f); /* pv_accumulate's weight of a plain pool */
            for (int j = 0; j < DV; j++)
                acc[i * DV + j] = _mm512_fmadd_ps(pg, row[j], acc[i * DV + j]);
        }
    }
    for (int i = 0; i < UN; i++)
        for (int j = 0; j < DV; j++)
            _mm256_storeu_si256((__m256i *)(o[i] + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[i * DV + j]));
}

/* R consecutive query rows of one sequence and KV head: row r (q + r * q_stride, out + r *
 * out_stride) attends its first L0 + r keys, each row's scores, softmax and p . V computed
 * exactly as attend_d computes that row alone (so a prefill row has the bits of the decode
 * of its position), but each K row is loaded once for the R x G (row, head) pairs and each V
 * row widened once per pass of up to 24 / (D / 16) pairs. sc: R * G * (L0 + R - 1) floats. */
TARGET INLINE int attend_rows_d(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                                const int64_t *table, int64_t L0, int64_t R, int64_t num_blocks, int64_t h,
                                int64_t G, int64_t KVH, int64_t bs, float scale, uint16_t *out,
                                int64_t out_stride, float *sc, const int D) {
    const int DV = D / 32;
    const __m512 zero = _mm512_setzero_ps();
    const int64_t Lmax = L0 + R - 1, row_stride = KVH * D;
    for (int64_t t = 0; t < Lmax; t += bs) {
        int64_t blk = table[t / bs];
        if (blk < 0 || blk >= num_blocks)
            return PD_ERR_BLOCK;
    }
    for (int64_t t0 = 0; t0 < Lmax; t0 += 16) {
        const uint16_t *kr[16];
        int64_t bi = t0 / bs, off = t0 % bs, n = Lmax - t0 < 16 ? Lmax - t0 : 16;
        for (int i = 0; i < 16; i++) {
            kr[i] = i < n ? k + (table[bi] * bs + off) * row_stride + h * D : NULL;
            if (++off == bs)
                off = 0, bi++;
        }
        if (t0 + 16 < Lmax) {
            int64_t nbi = (t0 + 16) / bs, noff = (t0 + 16) % bs, nn = Lmax - t0 - 16 < 16 ? Lmax - t0 - 16 : 16;
            for (int i = 0; i < nn; i++) {
                const char *pf = (const char *)(k + (table[nbi] * bs + noff) * row_stride + h * D);
                for (int line = 0; line < D * 2; line += 64)
                    _mm_prefetch(pf + line, _MM_HINT_T0);
                if (++noff == bs)
                    noff = 0, nbi++;
            }
        }
        for (int64_t r = 0; r < R; r++) {
            int64_t L = L0 + r, nr = L - t0 < 16 ? L - t0 : 16;
            if (nr <= 0)
                continue;
            for (int64_t g = 0; g < G; g++) {
                __m512 qv[4], part[16];
                for (int j = 0; j < DV; j++)
                    qv[j] = _mm512_loadu_ps(q + r * q_stride + g * D + 32 * j);
                for (int i = 0; i < 16; i++) {
                    if (i >= nr) {
                        part[i] = zero;
                        continue;
                    }
                    __m512 a = dot(zero, qv[0], _mm512_loadu_ps(kr[i]));
                    for (int j = 1; j < DV; j++)
                        a = dot(a, qv[j], _mm512_loadu_ps(kr[i] + 32 * j));
                    part[i] = a;
                }
                __m512 sv = _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(sc + r * G * Lmax + g * L + t0, (__mmask16)(nr >= 16 ? 0xFFFF : (1u << nr) - 1u),
                                      sv);
            }
        }
    }
    for (int64_t r = 0; r < R; r++)
        softmax_rows(sc + r * G * Lmax, G, L0 + r);
    const int64_t UP = 24 / (D / 16), units = R * G;
    for (int64_t u0 = 0; u0 < units; u0 += UP) {
        int64_t un = units - u0 < UP ? units - u0 : UP;
        switch (un) {
#define UNITS(U) case U: pv_rows(v, table, bs, row_stride, h, sc, Lmax, L0, G, u0, out, out_stride, U, D); break;
            UNITS(1) UNITS(2) UNITS(3) UNITS(4) UNITS(5) UNITS(6)
#undef UNITS
        }
    }
    return PD_OK;
}

TARGET int pd_attend_bf16_rows(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                               const int64_t *table, int64_t L0, int64_t R, int64_t num_blocks, int64_t h,
                               int64_t G, int64_t KVH, int64_t D, int64_t bs, float scale, uint16_t *out,
                               int64_t out_stride, float *sc) {
    if (!enabled || !bf16_ok() || L0 < 1 || R < 1)
        return PD_ATTN_UNHANDLED;
    if (D == 64)
        return attend_rows_d(q, q_stride, k, v, table, L0, R, num_blocks, h, G, KVH, bs, scale, out, out_stride,
                             sc, 64);
    if (D == 128)
        return attend_rows_d(q, q_stride, k, v, table, L0, R, num_blocks, h, G, KVH, bs, scale, out, out_stride,
                             sc, 128);
    return PD_ATTN_UNHANDLED;
}

TARGET int pd_attend_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v, const int64_t *table,
                          int64_t L, int64_t num_blocks, int64_t h, int64_t G, int64_t KVH, int64_t D,
                          int64_t bs, float scale, uint16_t *out, float *sc) {
    if (!enabled || !bf16_ok() || L < 1)
        return PD_ATTN_UNHANDLED;
    if (D == 64)
        return attend_d(q, k, v, table, L, num_blocks, h, G, KVH, bs, scale, out, sc, 64);
    if (D == 128)
        return attend_d(q, k, v, table, L, num_blocks, h, G, KVH, bs, scale, out, sc, 128);
    return PD_ATTN_UNHANDLED;
}
