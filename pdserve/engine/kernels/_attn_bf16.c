/* The bf16 paged attention of one (sequence, KV head) on a CPU with AVX-512 BF16, head size 64
 * or 128 (`attend` and pd_paged_prefill in _cpu_kernels.c call it where it applies; elsewhere
 * their generic loop runs). A decode is a prefill of one row: every row, whichever call it is
 * in, is computed by `attend_rows_d` in the one order below, so a prefill row has the bits of
 * the decode at its position. K and V are read in place from the pool.
 *
 * - q . k: 32 keys at a time (two blocks of 16, one at the end), transposed by bf16 pair once
 *   per call (`keys_by_pair`); a score's lane sums, in pair order, one `vdpbf16ps` per pair of
 *   q and the key (products exact in float32) in two chains (pairs p mod 2), added, times the
 *   scale (`score_by_pair`: up to 6 (row, head) units a call share each K vector load, each q
 *   pair is broadcast once for both blocks, and up to 24 independent chains keep the two
 *   vdpbf16ps pipes busy, a decode's 3 heads 12).
 * - softmax: max, exp and sum 16 scores at a time, the exp a degree-6 polynomial after range
 *   reduction (relative error ~2e-7). e = exp(s - max) is rounded to bf16 (nearest even) in
 *   place and 1 / sum applied to p . V's sums (as FlashAttention does).
 * - p . V: `vdpbf16ps` over key pairs (t, t + 1), t even: the two bf16 weights broadcast as
 *   one dword against the two V rows interleaved by element (`v_pair`, one unpack per 32
 *   elements): half the float32 FMAs of widened rows. A context of odd length ends on a pair
 *   whose second weight and V half are zero. Up to 24 float32 accumulators (6 units x 64, or
 *   3 x 128) stay in registers over the whole context (`pv_units`); the V-row pointers are
 *   found once a call (`v_rows`).
 *
 * Against float32 weights, the bf16 ones add at most 2^-9 of sum_t p_t |v_t| to an output's
 * error, the order Hugging Face's eager attention rounds in too (tests/engine/test_attn_bf16.py
 * holds both loops to that bound against float64). A prefill call takes a tile of consecutive
 * rows (PREFILL_ROWS): its K transpositions and V pair loads serve every (row, head) of it.
 *
 * The output is rounded to bf16 once, to nearest even. Returns PD_OK, PD_ERR_BLOCK for a
 * block id outside the pool, or PD_ATTN_UNHANDLED (the caller runs its generic loop).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_attn_bf16.h"
#include "_attn_simd.h"

#define TARGET __attribute__((target("avx512f,avx512dq,avx512bf16,avx512bw,avx512vl")))
#define INLINE __attribute__((always_inline)) static inline

#include "_pd_cpu.h"
#define PREFETCH_KEYS 8 /* how far ahead p.V prefetches V rows */
#define PAIR_UNITS 6 /* (query row, head) units per score_by_pair call */
#define PV_ACCS 24 /* float32 accumulators a p . V pass holds in registers */
#define PV_UNITS (PV_ACCS / 4) /* (row, head) units a p . V pass takes at most (head size 64) */

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

/* The scaled scores q . k of NB blocks of 16 keys (block j transposed by pair at kt + j * D / 2,
 * keys_by_pair) for U query rows q[u], into dst[u][0 .. n[u]) (n[u] <= 16 NB): lane i of chain
 * c of (row u, block j) sums, in pair order, the products of the pairs p = c, c + 2, c + 4, ...
 * of q and key i (one vdpbf16ps each: the pair broadcast from q, key i's pair p in lane i); the
 * score is (c0 + c1) x scale. Each q pair is broadcast once for the NB blocks and each kt vector
 * loaded once for the U rows: 1 + NB / U loads per NB vdpbf16ps. A score's arithmetic is the
 * same whatever NB, U or the other rows: the one order every score has, decode or prefill. */
TARGET INLINE void score_by_pair(const uint16_t *const *q, const __m512 *kt, const int64_t *n, float scale,
                                 float *const *dst, const int U, const int NB, const int D) {
    __m512 a[PAIR_UNITS][2][2];
#pragma GCC unroll 8
    for (int u = 0; u < U; u++)
        for (int j = 0; j < NB; j++)
            a[u][j][0] = a[u][j][1] = _mm512_setzero_ps();
#pragma GCC unroll 64
    for (int p = 0; p < D / 2; p++) {
        __m512 kv[2];
        for (int j = 0; j < NB; j++)
            kv[j] = kt[j * (D / 2) + p];
#pragma GCC unroll 8
        for (int u = 0; u < U; u++) {
            int32_t pair;
            memcpy(&pair, q[u] + 2 * p, sizeof pair);
            const __m512 qp = _mm512_castsi512_ps(_mm512_set1_epi32(pair));
            for (int j = 0; j < NB; j++)
                a[u][j][p % 2] = dot(a[u][j][p % 2], qp, kv[j]);
        }
    }
#pragma GCC unroll 8
    for (int u = 0; u < U; u++)
        for (int j = 0; j < NB; j++) {
            int64_t m = n[u] - 16 * j;
            if (m <= 0)
                continue;
            __m512 sc = _mm512_mul_ps(_mm512_add_ps(a[u][j][0], a[u][j][1]), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(dst[u] + 16 * j, (__mmask16)(m >= 16 ? 0xFFFF : (1u << m) - 1u), sc);
        }
}

/* Query rows gathered for score_by_pair. */
typedef struct {
    const uint16_t *q[PAIR_UNITS];
    int64_t n[PAIR_UNITS];
    float *dst[PAIR_UNITS];
    int cnt;
} pair_batch;

/* score_by_pair for each unit count, block count and head size, each its own function: kt is
 * then read from memory, and its up to 24 accumulators stay in registers (inlined beside
 * keys_by_pair, GCC kept the transposed keys in registers and spilled the accumulators). */
#define SCORE_FN(U, NB, D)                                                                                      \
    __attribute__((noinline)) TARGET static void score_##U##_##NB##_##D(const uint16_t *const *q, const __m512 *kt, \
                                                                        const int64_t *n, float scale,            \
                                                                        float *const *dst) {                      \
        score_by_pair(q, kt, n, scale, dst, U, NB, D);                                                           \
    }
#define SCORE_FNS(NB, D) SCORE_FN(1, NB, D) SCORE_FN(2, NB, D) SCORE_FN(3, NB, D) SCORE_FN(4, NB, D) \
    SCORE_FN(5, NB, D) SCORE_FN(6, NB, D)
SCORE_FNS(1, 64) SCORE_FNS(2, 64) SCORE_FNS(1, 128) SCORE_FNS(2, 128)
#undef SCORE_FNS
#undef SCORE_FN

TARGET INLINE void pair_flush(pair_batch *b, const __m512 *kt, float scale, const int NB, const int D) {
    switch (b->cnt + 10 * NB + (D == 64 ? 0 : 100)) {
#define BATCH(U, NN, DD)                                                   \
    case U + 10 * NN + (DD == 64 ? 0 : 100):                               \
        score_##U##_##NN##_##DD(b->q, kt, b->n, scale, b->dst);            \
        break;
#define BATCHES(NN, DD) BATCH(1, NN, DD) BATCH(2, NN, DD) BATCH(3, NN, DD) BATCH(4, NN, DD) BATCH(5, NN, DD) \
    BATCH(6, NN, DD)
        BATCHES(1, 64) BATCHES(2, 64) BATCHES(1, 128) BATCHES(2, 128)
#undef BATCHES
#undef BATCH
    }
    b->cnt = 0;
}

TARGET INLINE void pair_add(pair_batch *b, const uint16_t *q, int64_t n, float *dst, const __m512 *kt, float scale,
                            const int NB, const int D) {
    b->q[b->cnt] = q, b->n[b->cnt] = n, b->dst[b->cnt] = dst;
    if (++b->cnt == PAIR_UNITS)
        pair_flush(b, kt, scale, NB, D);
}

/* Softmax of one unit's L scores at s (64-byte aligned), in place: e_t = exp(s_t - max) written
 * over the row's start as bf16 (nearest even), with a zero after the last when L is odd, so
 * every pair (t, t + 1), t even, is one dword for vdpbf16ps; returns 1 / sum_t e_t (the float32
 * e_t summed), which p . V applies to its sums (as FlashAttention does: the weights p_t =
 * bf16(e_t) / sum have the error of bf16(e_t / sum)). The bf16 store at t never reaches a float
 * not yet read (2t + 32 <= 4 (t + 16) bytes); L bf16 and the pad fit the row's 4L bytes.
 * Whole vectors unmasked, the tail masked. */
TARGET INLINE float softmax_row_bf16(float *s, int64_t L) {
    uint16_t *pb = (uint16_t *)s;
    const int64_t whole = L & ~(int64_t)15;
    const __mmask16 m = (__mmask16)((1u << (L & 15)) - 1u);
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < whole; t0 += 16)
        mx = _mm512_max_ps(mx, _mm512_load_ps(s + t0));
    if (m)
        mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_load_ps(m, s + whole));
    const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (int64_t t0 = 0; t0 < whole; t0 += 16) {
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_load_ps(s + t0), mv));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(pb + t0), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (m) {
        __m512 e = _mm512_maskz_mov_ps(m, exp_ps(_mm512_sub_ps(_mm512_maskz_load_ps(m, s + whole), mv)));
        sum = _mm512_add_ps(sum, e);
        _mm256_mask_storeu_epi16(pb + whole, m, (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (L & 1)
        pb[L] = 0;
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* V rows a and b (keys t, t + 1) as bf16 pairs: vp[2c] lane 4j + i holds element 32c + 8j + i
 * of a (low half) and of b (high half), vp[2c + 1] the same for element 32c + 8j + 4 + i (one
 * unpack each). */
TARGET INLINE void v_pair(__m512i *vp, const uint16_t *a, const uint16_t *b, const int D) {
    for (int c = 0; c < D / 32; c++) {
        __m512i x = _mm512_loadu_si512((const void *)(a + 32 * c)), y = _mm512_loadu_si512((const void *)(b + 32 * c));
        vp[2 * c] = _mm512_unpacklo_epi16(x, y);
        vp[2 * c + 1] = _mm512_unpackhi_epi16(x, y);
    }
}

/* vp with each pair's high (key t + 1) half zeroed: the pair at a context's last key (its
 * weight pad is +0 too, so the product is +0 whatever the next row holds). */
TARGET INLINE void first_of_pair(__m512i *dst, const __m512i *vp, const int D) {
    for (int j = 0; j < D / 16; j++)
        dst[j] = _mm512_and_si512(vp[j], _mm512_set1_epi32(0xFFFF));
}

/* Accumulators lo, hi (v_pair's vp[2c], vp[2c + 1] lane order) times inv rounded to bf16 (nearest even)
 * at out in element order: 32 values (qword j of the low and high halves' bf16 interleaved).
 * By value, so the callers' accumulator arrays never have their address taken and stay in
 * registers. */
TARGET INLINE void store_pair_bf16(uint16_t *out, __m512 lo, __m512 hi, __m512 inv) {
    const __m512i idx = _mm512_set_epi64(11, 3, 10, 2, 9, 1, 8, 0);
    __m512i l = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(lo, inv)));
    __m512i h = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(hi, inv)));
    _mm512_storeu_si512((void *)out, _mm512_permutex2var_epi64(l, idx, h));
}

/* A call's scratch (PD_ATTN_BF16_SCRATCH floats at sc) for `units` (row, head) units over L keys:
 * unit u's scores, then its bf16 probabilities, at scores + u * stride (64-byte aligned, the
 * stride L rounded up to 16 floats, so each 16-key vector is one aligned line); 1 / its softmax
 * sum at inv[u]; the V-row pointers of the L keys at vr. */
typedef struct {
    float *scores, *inv;
    int64_t stride;
    const uint16_t **vr;
} tile_scratch;

INLINE tile_scratch tile_scratch_at(float *sc, int64_t units, int64_t L) {
    tile_scratch t;
    t.scores = (float *)(((uintptr_t)sc + 63) & ~(uintptr_t)63);
    t.stride = (L + 15) & ~(int64_t)15;
    t.inv = t.scores + units * t.stride;
    t.vr = (const uint16_t **)(((uintptr_t)(t.inv + units) + 7) & ~(uintptr_t)7);
    return t;
}

/* The V rows of keys [0, L) of the sequence: vr[t] is key t's (one block-table walk shared by
 * every p . V pass of a call, so a pass's loop holds only its pointers and t). */
INLINE void v_rows(const uint16_t **vr, const uint16_t *v, const pool_rows *pr, int64_t L) {
    key_cursor c = cursor_at(pr, 0);
    for (int64_t t = 0; t < L; t++)
        vr[t] = next_row(v, pr, &c);
}

/* The p . V of UN units over V rows vr[0 .. L) into out[i] (D bf16 each, the sums times
 * inv[i]), L the longest unit's context (len[UN - 1]), len[0] the shortest: unit i adds, for
 * each key pair (t, t + 1) of its context in order, one vdpbf16ps per accumulator of its bf16
 * weights p[i] + t and the two V rows, whichever other units share the pass; the pair at a
 * unit's last key has its second half zeroed (past L, key t's row stands in), so a unit's bits
 * do not depend on which rows follow it. The pairs every unit reads whole need no per-unit
 * check. One loop with acc local to it, fully unrolled: every accumulator stays a register.
 * Prefetches the pair PREFETCH_KEYS keys ahead. */
TARGET INLINE void pv_units(uint16_t *const *out, const uint16_t *const *vr, const uint16_t *const *p,
                            const float *inv, const int64_t *len, const int UN, const int D) {
    const int DV = D / 16;
    const int64_t L = len[UN - 1], whole = len[0] & ~(int64_t)1;
    __m512 acc[PV_ACCS];
    __m512i vp[8], vz[8];
#pragma GCC unroll 24 /* register moves, not a `rep stos` of a stack copy (_bf16_tiles.c's tile) */
    for (int i = 0; i < UN * DV; i++)
        acc[i] = _mm512_setzero_ps();
    for (int64_t t = 0; t < L; t += 2) {
        if (t + PREFETCH_KEYS + 1 < L) {
            prefetch_row(vr[t + PREFETCH_KEYS], D);
            prefetch_row(vr[t + PREFETCH_KEYS + 1], D);
        }
        v_pair(vp, vr[t], vr[t + 1 < L ? t + 1 : t], D);
        if (t < whole) {
#pragma GCC unroll 8 /* whole, so every accumulator is a register (not an indexed stack slot) */
            for (int i = 0; i < UN; i++)
#pragma GCC unroll 8
                for (int j = 0; j < DV; j++)
                    acc[i * DV + j] = dot_pair(acc[i * DV + j], _mm512_castsi512_ps(vp[j]), p[i] + t);
            continue;
        }
        first_of_pair(vz, vp, D);
#pragma GCC unroll 8
        for (int i = 0; i < UN; i++) {
            if (t >= len[i])
                continue;
            const int last = t + 1 == len[i];
#pragma GCC unroll 8
            for (int j = 0; j < DV; j++)
                acc[i * DV + j] = dot_pair(acc[i * DV + j], _mm512_castsi512_ps(last ? vz[j] : vp[j]), p[i] + t);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < UN; i++)
#pragma GCC unroll 4
        for (int c = 0; c < D / 32; c++)
            store_pair_bf16(out[i] + 32 * c, acc[i * DV + 2 * c], acc[i * DV + 2 * c + 1], _mm512_set1_ps(inv[i]));
}

/* p . V of `UN` (query row, head) units u0.. of a row tile (attend_rows_d): unit u = r * G + g
 * reads row r's bf16 weights for head g (its scratch row) over its L0 + r keys (pv_units). */
TARGET INLINE void pv_rows(const tile_scratch *ts, int64_t L0, int64_t G, int64_t u0, uint16_t *out,
                           int64_t out_stride, const int UN, const int D) {
    const uint16_t *p[PV_UNITS];
    int64_t len[PV_UNITS];
    uint16_t *o[PV_UNITS];
    for (int i = 0; i < UN; i++) {
        int64_t r = (u0 + i) / G, g = (u0 + i) % G;
        len[i] = L0 + r;
        p[i] = (const uint16_t *)(ts->scores + (u0 + i) * ts->stride);
        o[i] = out + r * out_stride + g * D;
    }
    pv_units(o, ts->vr, p, ts->inv + u0, len, UN, D);
}

/* pv_rows for each unit count and head size, each its own function: its loop's 24
 * accumulators then stay in registers (inlined into attend_rows_d, GCC spilled 4 of them to
 * keep the caller's constants live). */
#define PV_ROWS_FN(U, D)                                                                                  \
    __attribute__((noinline)) TARGET static void pv_rows_##U##_##D(const tile_scratch *ts, int64_t L0, int64_t G,  \
                                                                   int64_t u0, uint16_t *out, int64_t out_stride) { \
        pv_rows(ts, L0, G, u0, out, out_stride, U, D);                                                    \
    }
PV_ROWS_FN(1, 64) PV_ROWS_FN(2, 64) PV_ROWS_FN(3, 64) PV_ROWS_FN(4, 64) PV_ROWS_FN(5, 64) PV_ROWS_FN(6, 64)
PV_ROWS_FN(1, 128) PV_ROWS_FN(2, 128) PV_ROWS_FN(3, 128)
#undef PV_ROWS_FN

/* The scores of keys [t0, t0 + 16 NB) for every (row, head) unit of a tile whose context
 * reaches them: the NB blocks transposed once, then score_by_pair PAIR_UNITS units a call. */
TARGET INLINE void score_keys(const uint16_t *q, int64_t q_stride, const uint16_t *k, const pool_rows *pr,
                              const tile_scratch *ts, int64_t t0, int64_t L0, int64_t R, int64_t G, float scale,
                              const int NB, const int D) {
    const int64_t Lmax = L0 + R - 1;
    const uint16_t *kr[16];
    __m512 kt[2 * 64];
    for (int j = 0; j < NB; j++) {
        key_rows(kr, k, pr, t0 + 16 * j, Lmax, D);
        keys_by_pair(kr, kt + j * (D / 2), D);
    }
    pair_batch b = {.cnt = 0};
    for (int64_t r = 0; r < R; r++) {
        int64_t L = L0 + r, nr = L - t0 < 16 * NB ? L - t0 : 16 * NB;
        for (int64_t g = 0; nr > 0 && g < G; g++)
            pair_add(&b, q + r * q_stride + g * D, nr, ts->scores + (r * G + g) * ts->stride + t0, kt, scale, NB, D);
    }
    pair_flush(&b, kt, scale, NB, D);
}

/* R consecutive query rows of one sequence and KV head: row r (q + r * q_stride, out + r *
 * out_stride) attends its first L0 + r keys, each row's scores, softmax and p . V in the one
 * order of the file's comment (R = 1 is a decode, so a prefill row has the bits of the decode
 * of its position); each K block is transposed once for the R x G (row, head) units and each V
 * pair loaded once per pass of up to PV_ACCS / (D / 16) units. sc: PD_ATTN_BF16_SCRATCH(R * G,
 * L0 + R - 1) floats. */
TARGET INLINE int attend_rows_d(const uint16_t *q, int64_t q_stride, const uint16_t *k, const uint16_t *v,
                                const int64_t *table, int64_t L0, int64_t R, int64_t num_blocks, int64_t h,
                                int64_t G, int64_t KVH, int64_t bs, float scale, uint16_t *out,
                                int64_t out_stride, float *sc, const int D) {
    const int64_t Lmax = L0 + R - 1, units = R * G;
    const pool_rows pr = {table, bs, KVH * D, h * D};
    if (check_blocks(&pr, Lmax, num_blocks) != PD_OK)
        return PD_ERR_BLOCK;
    const tile_scratch ts = tile_scratch_at(sc, units, Lmax);
    for (int64_t t0 = 0; t0 < Lmax; t0 += 32) { /* two blocks of 16 keys a pass (one at the end) */
        if (t0 + 16 < Lmax)
            score_keys(q, q_stride, k, &pr, &ts, t0, L0, R, G, scale, 2, D);
        else
            score_keys(q, q_stride, k, &pr, &ts, t0, L0, R, G, scale, 1, D);
    }
    for (int64_t u = 0; u < units; u++)
        ts.inv[u] = softmax_row_bf16(ts.scores + u * ts.stride, L0 + u / G);
    v_rows(ts.vr, v, &pr, Lmax);
    const int64_t UP = PV_ACCS / (D / 16);
    for (int64_t u0 = 0; u0 < units; u0 += UP) {
        int64_t un = units - u0 < UP ? units - u0 : UP;
        switch (D == 64 ? un : 10 + un) {
#define UNITS(U, DD) case (DD == 64 ? U : 10 + U): pv_rows_##U##_##DD(&ts, L0, G, u0, out, out_stride); break;
            UNITS(1, 64) UNITS(2, 64) UNITS(3, 64) UNITS(4, 64) UNITS(5, 64) UNITS(6, 64)
            UNITS(1, 128) UNITS(2, 128) UNITS(3, 128)
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
    /* a decode is a prefill of one row: the same scores, softmax and p . V, so the same bits */
    if (D == 64)
        return attend_rows_d(q, 0, k, v, table, L, 1, num_blocks, h, G, KVH, bs, scale, out, 0, sc, 64);
    if (D == 128)
        return attend_rows_d(q, 0, k, v, table, L, 1, num_blocks, h, G, KVH, bs, scale, out, 0, sc, 128);
    return PD_ATTN_UNHANDLED;
}
