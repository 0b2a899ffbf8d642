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
 * exactly the order above, so a prefill row has the bits of the decode at its position. What
 * the tile shares: each block of 16 keys is transposed once by bf16 pair (`keys_by_pair`),
 * so every (row, head) of the tile gets its 16 scores from the same vdpbf16ps per lane and
 * the same tree of adds as the decode's, done across registers with no shuffle
 * (`score_by_pair`: ~2 instead of ~4.5 cycles a score, each block's K vectors loaded once
 * for 4 (row, head) pairs); and each V row's load, once per key for up to 6 (row, head) pairs
 * of accumulators, split into its bf16 pairs' even and odd elements (a shift and a mask, not
 * a widening shuffle: `v_row_pairs`; each element's sum is the decode's, in another lane),
 * with no per-key context check over the keys every row of the pass reads (`pv_keys`).
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

/* Where a sequence's key rows lie in the pool: its block table, the block size, the elements
 * between a block's consecutive keys and the offset of KV head h in a row. */
typedef struct {
    const int64_t *table;
    int64_t bs, row_stride, hD;
} pool_rows;

/* A walk over a sequence's keys in order: the block-table index and offset of the next key. */
typedef struct {
    int64_t bi, off;
} key_cursor;

INLINE key_cursor cursor_at(const pool_rows *pr, int64_t t) { return (key_cursor){t / pr->bs, t % pr->bs}; }

/* The row of the cursor's key in `base` (the K or V pool); moves the cursor to the next key. */
INLINE const uint16_t *next_row(const uint16_t *base, const pool_rows *pr, key_cursor *c) {
    const uint16_t *r = base + (pr->table[c->bi] * pr->bs + c->off) * pr->row_stride + pr->hD;
    if (++c->off == pr->bs)
        c->off = 0, c->bi++;
    return r;
}

INLINE void prefetch_row(const uint16_t *row, const int D) {
    for (int line = 0; line < D * 2; line += 64)
        _mm_prefetch((const char *)row + line, _MM_HINT_T0);
}

/* PD_ERR_BLOCK if the block id of any of the first L keys lies outside the pool: checked
 * for every block before any is read. */
INLINE int check_blocks(const pool_rows *pr, int64_t L, int64_t num_blocks) {
    for (int64_t t = 0; t < L; t += pr->bs) {
        int64_t blk = pr->table[t / pr->bs];
        if (blk < 0 || blk >= num_blocks)
            return PD_ERR_BLOCK;
    }
    return PD_OK;
}

/* The K rows of keys t0 .. t0 + 15 of L into kr (past L, the last key's row again); prefetches the next 16 keys'
 * rows (a block jump the hardware cannot guess). Returns how many of the 16 keys exist. */
INLINE int64_t key_rows(const uint16_t **kr, const uint16_t *k, const pool_rows *pr, int64_t t0, int64_t L,
                        const int D) {
    int64_t n = L - t0 < 16 ? L - t0 : 16;
    key_cursor c = cursor_at(pr, t0);
    for (int i = 0; i < 16; i++)
        kr[i] = i < n ? next_row(k, pr, &c) : kr[n - 1];
    if (t0 + 16 < L) {
        int64_t nn = L - t0 - 16 < 16 ? L - t0 - 16 : 16;
        for (int i = 0; i < nn; i++)
            prefetch_row(next_row(k, pr, &c), D);
    }
    return n;
}

/* The scaled scores q . k of the first n (<= 16) of 16 keys' rows kr into dst[0 .. n): each
 * key's dpbf16 partial vector over the D / 32 q vectors, the 16 summed across lanes together. */
TARGET INLINE void score16(const uint16_t *q, const uint16_t *const *kr, int64_t n, float scale, float *dst,
                           const int D) {
    const __m512 zero = _mm512_setzero_ps();
    __m512 qv[4], part[16];
    for (int j = 0; j < D / 32; j++)
        qv[j] = _mm512_loadu_ps(q + 32 * j);
    for (int i = 0; i < 16; i++) {
        if (i >= n) {
            part[i] = zero;
            continue;
        }
        __m512 a = dot(zero, qv[0], _mm512_loadu_ps(kr[i]));
        for (int j = 1; j < D / 32; j++)
            a = dot(a, qv[j], _mm512_loadu_ps(kr[i] + 32 * j));
        part[i] = a;
    }
    __m512 r = _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(dst, (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1u), r);
}

/* vdpbf16ps with a's pair (two bf16, one dword) broadcast to every lane from memory. A lane's
 * arithmetic does not depend on which operand holds which factor, so this is `dot`'s. */
TARGET INLINE __m512 dot_pair(__m512 acc, __m512 b, const uint16_t *a) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(b), "m"(*(const uint32_t(*)[1])a));
    return acc;
}

/* The 16 x 16 dwords of rows[0 .. 16) transposed into out: out[l] lane i = rows[i] lane l. */
TARGET INLINE void transpose16(const __m512 *rows, __m512 *out) {
    __m512 t[16], u[16], v[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        __m512d a0 = _mm512_castps_pd(t[4 * i]), a1 = _mm512_castps_pd(t[4 * i + 1]);
        __m512d b0 = _mm512_castps_pd(t[4 * i + 2]), b1 = _mm512_castps_pd(t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, b0));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, b0));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, b1));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, b1));
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0x88);
        v[4 + i] = _mm512_shuffle_f32x4(u[i], u[4 + i], 0xDD);
        v[8 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0x88);
        v[12 + i] = _mm512_shuffle_f32x4(u[8 + i], u[12 + i], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        out[i] = _mm512_shuffle_f32x4(v[i], v[8 + i], 0x88);
        out[8 + i] = _mm512_shuffle_f32x4(v[i], v[8 + i], 0xDD);
        out[4 + i] = _mm512_shuffle_f32x4(v[4 + i], v[12 + i], 0x88);
        out[12 + i] = _mm512_shuffle_f32x4(v[4 + i], v[12 + i], 0xDD);
    }
}

/* Sixteen keys' K rows kr transposed by dword (bf16 pair): kt[j * 16 + l] lane i is pair l
 * of 32-element chunk j of key i's row. */
TARGET INLINE void keys_by_pair(const uint16_t *const *kr, __m512 *kt, const int D) {
    for (int j = 0; j < D / 32; j++) {
        __m512 rows[16];
        for (int i = 0; i < 16; i++)
            rows[i] = _mm512_loadu_ps(kr[i] + 32 * j);
        transpose16(rows, kt + 16 * j);
    }
}

/* score16 with the keys transposed (kt, keys_by_pair) for U query rows q[u], into
 * dst[u][0 .. n[u]): the same bits, as the same adds of sum16's tree are made one lane of
 * all 16 keys at a time, with no shuffle. Lane l's partial (score16's `part[i]` lane l: the
 * same D / 32 vdpbf16ps in the same order) has the keys across its lanes; block c's share
 * is (l0 + l2) + (l1 + l3) of its lanes 4c .. 4c + 3 (sum16's levels 1 and 2), the blocks
 * then (b0 + b1) + (b2 + b3). Each block's K vectors are loaded once for all U rows, so a
 * vdpbf16ps costs one broadcast load and 1 / U of a K load. The transposition is shared by
 * every row of a tile. */
TARGET INLINE void score_by_pair(const uint16_t *const *q, const __m512 *kt, const int64_t *n, float scale,
                                 float *const *dst, const int U, const int D) {
    const __m512 zero = _mm512_setzero_ps();
    __m512 low[4], mid[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        __m512 kl[4][4];
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < D / 32; j++)
                kl[i][j] = kt[16 * j + 4 * c + i];
#pragma GCC unroll 4
        for (int u = 0; u < U; u++) {
            __m512 lp[4];
            for (int i = 0; i < 4; i++) {
                const int l = 4 * c + i;
                __m512 a = dot_pair(zero, kl[i][0], q[u] + 2 * l);
                for (int j = 1; j < D / 32; j++)
                    a = dot_pair(a, kl[i][j], q[u] + 32 * j + 2 * l);
                lp[i] = a;
            }
            __m512 bs = _mm512_add_ps(_mm512_add_ps(lp[0], lp[2]), _mm512_add_ps(lp[1], lp[3]));
            if (c == 0)
                low[u] = bs;
            else if (c == 1)
                low[u] = _mm512_add_ps(low[u], bs);
            else if (c == 2)
                mid[u] = bs;
            else
                _mm512_mask_storeu_ps(dst[u], (__mmask16)(n[u] >= 16 ? 0xFFFF : (1u << n[u]) - 1u),
                                      _mm512_mul_ps(_mm512_add_ps(low[u], _mm512_add_ps(mid[u], bs)),
                                                    _mm512_set1_ps(scale)));
        }
    }
}

#define PAIR_UNITS 4 /* query rows per score_by_pair call */

/* Query rows gathered for score_by_pair. */
typedef struct {
    const uint16_t *q[PAIR_UNITS];
    int64_t n[PAIR_UNITS];
    float *dst[PAIR_UNITS];
    int cnt;
} pair_batch;

TARGET INLINE void pair_flush(pair_batch *b, const __m512 *kt, float scale, const int D) {
    switch (b->cnt) {
#define BATCH(U) case U: score_by_pair(b->q, kt, b->n, scale, b->dst, U, D); break;
        BATCH(1) BATCH(2) BATCH(3) BATCH(4)
#undef BATCH
    }
    b->cnt = 0;
}

TARGET INLINE void pair_add(pair_batch *b, const uint16_t *q, int64_t n, float *dst, const __m512 *kt, float scale,
                            const int D) {
    b->q[b->cnt] = q, b->n[b->cnt] = n, b->dst[b->cnt] = dst;
    if (++b->cnt == PAIR_UNITS)
        pair_flush(b, kt, scale, D);
}

/* Key t's V row of L widened into row[0 .. D / 16); prefetches the row PREFETCH_KEYS keys
 * ahead. `at` walks the keys, `ahead` the keys PREFETCH_KEYS later. */
TARGET INLINE void v_row(__m512 *row, const uint16_t *v, const pool_rows *pr, int64_t t, int64_t L, key_cursor *at,
                         key_cursor *ahead, const int D) {
    const uint16_t *vr = next_row(v, pr, at);
    if (t + PREFETCH_KEYS < L)
        prefetch_row(next_row(v, pr, ahead), D);
    for (int j = 0; j < D / 16; j++)
        row[j] = widen16(vr + 16 * j);
}

/* n accumulators rounded to bf16 (nearest even) at out, 16 values each. */
TARGET INLINE void store_bf16(uint16_t *out, const __m512 *acc, int n) {
    for (int j = 0; j < n; j++)
        _mm256_storeu_si256((__m256i *)(out + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[j]));
}

TARGET INLINE int attend_d(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           const int64_t *table, int64_t L, int64_t num_blocks, int64_t h, int64_t G,
                           int64_t KVH, int64_t bs, float scale, uint16_t *out, float *sc,
                           const int D) {
    const int GB = 16 / (D / 16); /* heads per p.V pass */
    const pool_rows pr = {table, bs, KVH * D, h * D};
    if (check_blocks(&pr, L, num_blocks) != PD_OK)
        return PD_ERR_BLOCK;
    for (int64_t t0 = 0; t0 < L; t0 += 16) { /* 16 keys at a time, every head over them */
        const uint16_t *kr[16];
        int64_t n = key_rows(kr, k, &pr, t0, L, D);
        for (int64_t g = 0; g < G; g++)
            score16(q + g * D, kr, n, scale, sc + g * L + t0, D);
    }
    softmax_rows(sc, G, L);
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
        __m512 acc[16], row[8];
        int64_t gn = pv_pass_begin(acc, G, g0, GB);
        key_cursor at = cursor_at(&pr, 0), ahead = cursor_at(&pr, PREFETCH_KEYS);
        for (int64_t t = 0; t < L; t++) {
            v_row(row, v, &pr, t, L, &at, &ahead, D);
            pv_accumulate(acc, row, sc, L, t, g0, gn, GB, D / 16, 1.0f);
        }
        for (int64_t g = 0; g < gn; g++)
            store_bf16(out + (g0 + g) * D, acc + g * (D / 16), D / 16);
    }
    return PD_OK;
}

/* Key t's V row of L as float32 in deinterleaved order into row[0 .. D / 16): row[2c] lane i
 * is element 32c + 2i, row[2c + 1] lane i element 32c + 2i + 1 (the bf16 pair's low and high
 * halves, one shift or mask each, no widening shuffle); prefetches as v_row. */
TARGET INLINE void v_row_pairs(__m512 *row, const uint16_t *v, const pool_rows *pr, int64_t t, int64_t L,
                               key_cursor *at, key_cursor *ahead, const int D) {
    const uint16_t *vr = next_row(v, pr, at);
    if (t + PREFETCH_KEYS < L)
        prefetch_row(next_row(v, pr, ahead), D);
    for (int c = 0; c < D / 32; c++) {
        __m512i x = _mm512_loadu_si512((const void *)(vr + 32 * c));
        row[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        row[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
    }
}

/* acc in v_row_pairs' order rounded to bf16 (nearest even) at out in element order: D values. */
TARGET INLINE void store_pairs_bf16(uint16_t *out, const __m512 *acc, const int D) {
    for (int c = 0; c < D / 32; c++) {
        __m512i lo = _mm512_castps_si512(acc[2 * c]), hi = _mm512_castps_si512(acc[2 * c + 1]);
        __m256i l16 = (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(lo));
        __m256i h16 = (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(hi));
        __m512i both = _mm512_or_si512(_mm512_cvtepu16_epi32(l16), _mm512_slli_epi32(_mm512_cvtepu16_epi32(h16), 16));
        _mm512_storeu_si512((void *)(out + 32 * c), both);
    }
}

/* Keys [t0, t1) of a p . V pass into acc (v_row_pairs' order): unit i adds p[i][t] x V row t
 * for each key in order, one float32 FMA per element, as attend_d's pass does for that row.
 * ALL: every unit's context covers [t0, t1) (no per-key check). */
TARGET INLINE void pv_keys(__m512 *acc, const uint16_t *v, const pool_rows *pr, const float *const *p,
                           const int64_t *len, int64_t t0, int64_t t1, int64_t L, const int UN, const int D,
                           const int ALL) {
    const int DV = D / 16;
    __m512 row[8];
    key_cursor at = cursor_at(pr, t0), ahead = cursor_at(pr, t0 + PREFETCH_KEYS);
    for (int64_t t = t0; t < t1; t++) {
        v_row_pairs(row, v, pr, t, L, &at, &ahead, D);
        for (int i = 0; i < UN; i++) {
            if (!ALL && t >= len[i])
                continue;
            __m512 pg = _mm512_set1_ps(p[i][t] * 1.0f); /* pv_accumulate's weight of a plain pool */
            for (int j = 0; j < DV; j++)
                acc[i * DV + j] = _mm512_fmadd_ps(pg, row[j], acc[i * DV + j]);
        }
    }
}

/* p . V of `UN` (query row, head) units u0.. of a row tile (attend_rows_d): unit u = r * G + g
 * reads row r's probabilities for head g and adds each V row of its L0 + r keys, in key
 * order, into its own D / 16 accumulators, exactly as attend_d's pass does for that row
 * (each output element's sum is the same; only its lane differs, v_row_pairs); each V row
 * is loaded once for all UN units, the keys every unit reads without a per-key check. */
TARGET INLINE void pv_rows(const uint16_t *v, const pool_rows *pr, const float *sc, int64_t Lmax, int64_t L0,
                           int64_t G, int64_t u0, uint16_t *out, int64_t out_stride, const int UN, const int D) {
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
#pragma GCC unroll 24 /* register moves, not a `rep stos` of a stack copy (_bf16_tiles.c's tile) */
    for (int i = 0; i < UN * DV; i++)
        acc[i] = _mm512_setzero_ps();
    int64_t L = len[UN - 1];
    pv_keys(acc, v, pr, p, len, 0, len[0], L, UN, D, 1);
    pv_keys(acc, v, pr, p, len, len[0], L, L, UN, D, 0);
    for (int i = 0; i < UN; i++)
        store_pairs_bf16(o[i], acc + i * DV, D);
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
    const int64_t Lmax = L0 + R - 1;
    const pool_rows pr = {table, bs, KVH * D, h * D};
    if (check_blocks(&pr, Lmax, num_blocks) != PD_OK)
        return PD_ERR_BLOCK;
    for (int64_t t0 = 0; t0 < Lmax; t0 += 16) {
        const uint16_t *kr[16];
        __m512 kt[64];
        key_rows(kr, k, &pr, t0, Lmax, D);
        keys_by_pair(kr, kt, D);
        pair_batch b = {.cnt = 0};
        for (int64_t r = 0; r < R; r++) {
            int64_t L = L0 + r, nr = L - t0 < 16 ? L - t0 : 16;
            for (int64_t g = 0; nr > 0 && g < G; g++)
                pair_add(&b, q + r * q_stride + g * D, nr, sc + r * G * Lmax + g * L + t0, kt, scale, D);
        }
        pair_flush(&b, kt, scale, D);
    }
    for (int64_t r = 0; r < R; r++)
        softmax_rows(sc + r * G * Lmax, G, L0 + r);
    const int64_t UP = 24 / (D / 16), units = R * G;
    for (int64_t u0 = 0; u0 < units; u0 += UP) {
        int64_t un = units - u0 < UP ? units - u0 : UP;
        switch (un) {
#define UNITS(U) case U: pv_rows(v, &pr, sc, Lmax, L0, G, u0, out, out_stride, U, D); break;
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
