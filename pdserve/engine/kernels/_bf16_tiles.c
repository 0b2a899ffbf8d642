/* The AVX-512 BF16 linear from 4 rows (a prefill, a batched decode): register tiles of TM
 * rows x TN channels over a block of channels held in L2 (pdserve/engine/kernels/_bf16_gemv.c's `pd_bf16_avx`
 * calls it from PD_BF16_TILE_ROWS rows up; the same file runs calls of 1-3 rows and this
 * file's edges).
 *
 * The bits are the dot products' (_bf16_gemv.c), whatever the rows: output (m, n) has its
 * own 16-lane float32 accumulator, fed one `vdpbf16ps` per 32-k step in k order (the K
 * tail a masked load, zeros on both sides), summed across its lanes by `sum4`'s tree
 * ((l_j + l_j+8) + (l_j+4 + l_j+12), then pairs of those, then the pair sums), the bias
 * (or +0.0) added in float32, rounded to bf16 once, nearest even. Only the blocking
 * differs, and blocking over rows and channels changes no (row, channel) pair's order:
 *
 * - a channel block of CB channels (CB x K x 2 bytes <= TILE_L2_BYTES, the blocks a multiple
 *   of the threads and near-equal) is walked by every
 *   row, TM rows at a time: the TM rows' x (TM x K x 2 bytes) stays in L1 across the
 *   block's CB / TN tiles, the block's weights in L2 across the M / TM row blocks;
 * - each 32-k step loads TN weight vectors and TM x vectors for TM x TN `vdpbf16ps`
 *   (24 accumulators + 6 weights in the 32 vector registers);
 * - the TM x TN lane sums are done 16 (then 8) at a time with shuffles (`tree16`, `tree8`:
 *   the same adds as `sum4`), rounded in vector integer arithmetic (`round16`, the same
 *   bits as `to_bf16`), and stored a few channels per row: ~1.5 cycles an output, against
 *   ~7 for one `sum4` and scalar rounding per 4 outputs;
 * - the next row block's x is prefetched a few lines per tile, where it fits L1 beside the
 *   tile's own x and weights (not at the down projection's K = 2048).
 *
 * Channel blocks are spread over OpenMP threads; the rows left over after the last full
 * TM and the channels after the last full TN run through _bf16_gemv.c's tiles
 * (`pd_bf16_avx_rows`), the same arithmetic.
 */
#include <immintrin.h>
#include <stdint.h>

#include "_bf16_gemm.h"

#define TARGET __attribute__((target("avx512f,avx512dq,avx512bf16,avx512bw,avx512vl")))
#define INLINE __attribute__((always_inline)) static inline

#define TM 4 /* rows of a register tile (16 % TM == 0: the epilogue sums 16 or 8 at a time) */
#define TN 6 /* channels of a register tile */
#define TILE_L2_BYTES (512 * 1024) /* a channel block's weights, at most (half of Zen 4/5's L2) */
#define PREFETCH_L1_BYTES (40 * 1024) /* see channel_block */

TARGET INLINE __m512 dot(__m512 acc, __m512 a, __m512 b) { /* see _bf16_gemv.c: GCC 12 */
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* Level 1 of sum4's tree for two vectors: lanes j + j+8 of a in lanes 0..7, of b in 8..15. */
TARGET INLINE __m512 halves(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_mask_blend_ps(0xFF00, a, b), _mm512_shuffle_f32x4(a, b, 0x4E));
}

/* Level 2: + lanes j+4; the four vectors of h0, h1 (two each) one 128-bit block each. */
TARGET INLINE __m512 quarters(__m512 h0, __m512 h1) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(h0, h1, 0x88), _mm512_shuffle_f32x4(h0, h1, 0xDD));
}

/* Levels 3 and 4 within each 128-bit block: lanes 0 + 1 and 2 + 3 of each block's vector. */
TARGET INLINE __m512 pairs(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, 0x88), _mm512_shuffle_ps(a, b, 0xDD));
}

/* Lane i: the sum of v[i]'s 16 lanes by sum4's tree (the file's docstring), for 16 vectors. */
TARGET INLINE __m512 tree16(const __m512 *v) {
    __m512 h[8], q[4];
    for (int i = 0; i < 8; i++)
        h[i] = halves(v[2 * i], v[2 * i + 1]);
    for (int i = 0; i < 4; i++) /* vectors 4i..4i+3 */
        q[i] = quarters(h[2 * i], h[2 * i + 1]);
    /* block b: vectors b, 4 + b, 8 + b, 12 + b */
    __m512 s = pairs(pairs(q[0], q[1]), pairs(q[2], q[3]));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);
}

/* The same for 8 vectors, in lanes 0..7 (8..15 repeat them). */
TARGET INLINE __m512 tree8(const __m512 *v) {
    __m512 q0 = quarters(halves(v[0], v[1]), halves(v[2], v[3]));
    __m512 q1 = quarters(halves(v[4], v[5]), halves(v[6], v[7]));
    __m512 p = pairs(q0, q1);
    /* block b: vectors b, 4 + b, b, 4 + b */
    __m512 s = pairs(p, p);
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 4, 8, 12, 1, 5, 9, 13), s);
}

/* to_bf16 of 16 floats: NaN -> 0x7FC0, else round to nearest even. */
TARGET INLINE __m256i round16(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)),
                                           _mm512_set1_epi32(0x7F800000));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0)));
}

/* bf16 x[0..n) widened to float32 (exact), n <= 4, in the low lanes. */
TARGET INLINE __m128 widen4(const uint16_t *x, int n) {
    uint64_t bits = 0;
    memcpy(&bits, x, (size_t)n * 2);
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(_mm_cvtsi64_si128((long long)bits)), 16));
}

/* The tile's sums s (lane r * cw + c: row r, channel c0 + c) + bias, rounded, into y. */
TARGET INLINE void store_sums(__m512 s, __m512 b, int c0, int cw, uint16_t *y, int64_t ldy) {
    uint16_t out[16];
    _mm256_storeu_si256((__m256i *)out, round16(_mm512_add_ps(s, b)));
    for (int r = 0; r < TM; r++)
        memcpy(y + r * ldy + c0, out + r * cw, (size_t)cw * 2);
}

/* The bias of channels c0.. in lane i's channel, c0 + i % cw (cw = 4, 2 or 1), as float32. */
TARGET INLINE __m512 bias_lanes(const uint16_t *bias, int cw) {
    __m128 b = widen4(bias, cw);
    return cw == 4 ? _mm512_broadcast_f32x4(b)
           : cw == 2 ? _mm512_castpd_ps(_mm512_broadcastsd_pd(_mm_castps_pd(b)))
                     : _mm512_broadcastss_ps(b);
}

/* The TM x TN outputs of acc (row-major) into y, 16 (or a last 8) sums at a time: channels
 * c0..c0 + cw of every row. The bias (or +0.0, as the other paths add) per lane, in float32. */
TARGET INLINE void store_tile(const __m512 *acc, const uint16_t *bias, uint16_t *y, int64_t ldy) {
    _Static_assert(16 % TM == 0 && (TN % (16 / TM) == 0 || TN % (16 / TM) == 8 / TM), "16 or 8 sums a group");
#pragma GCC unroll 8
    for (int c0 = 0; c0 < TN; c0 += 16 / TM) {
        const int cw = TN - c0 >= 16 / TM ? 16 / TM : 8 / TM;
        __m512 v[16], b = bias != NULL ? bias_lanes(bias + c0, cw) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int r = 0; r < TM; r++)
#pragma GCC unroll 16
            for (int c = 0; c < cw; c++)
                v[r * cw + c] = acc[r * TN + c0 + c];
        store_sums(cw * TM == 16 ? tree16(v) : tree8(v), b, c0, cw, y, ldy);
    }
}

/* Rows [0, TM) of x against channels [0, TN) of w into y (all three at the tile's corner). */
TARGET INLINE void tile(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t K, const uint16_t *bias,
                        uint16_t *y, int64_t ldy) {
    __m512 acc[TM * TN];
#pragma GCC unroll 24 /* register moves: as a loop, GCC zeroes a stack copy with `rep stos` every tile */
    for (int i = 0; i < TM * TN; i++)
        acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512 wv[TN];
        for (int c = 0; c < TN; c++)
            wv[c] = _mm512_loadu_ps(w + c * K + k);
        for (int r = 0; r < TM; r++) {
            __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
            for (int c = 0; c < TN; c++)
                acc[r * TN + c] = dot(acc[r * TN + c], xv, wv[c]);
        }
    }
    if (k < K) {
        __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1ull);
        __m512 wv[TN];
        for (int c = 0; c < TN; c++)
            wv[c] = (__m512)_mm512_maskz_loadu_epi16(mask, w + c * K + k);
        for (int r = 0; r < TM; r++) {
            __m512 xv = (__m512)_mm512_maskz_loadu_epi16(mask, x + r * ldx + k);
            for (int c = 0; c < TN; c++)
                acc[r * TN + c] = dot(acc[r * TN + c], xv, wv[c]);
        }
    }
    store_tile(acc, bias, y, ldy);
}

/* Channels [n0, n1) against every row. */
TARGET static void channel_block(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                                 int64_t n0, int64_t n1, const uint16_t *bias, uint16_t *y, int64_t ldy) {
    int64_t full = n0 + (n1 - n0) / TN * TN, m = 0;
    int64_t line_per_row = (K * 2 + 63) / 64, tiles = (full - n0) / TN;
    int64_t per_tile = tiles > 0 ? (TM * line_per_row + tiles - 1) / tiles : 0;
    /* Only where both row blocks' x and a tile's weights fit L1 together: past that (the down
     * projection's K = 2048) the prefetched lines evict the x and weights the tile is reading
     * (0.66 -> 0.77x aten's rate at K = 2048 without it, one thread, Zen 5). */
    const int prefetch = (2 * TM + TN) * K * 2 <= PREFETCH_L1_BYTES;
    for (; m + TM <= M; m += TM) {
        const uint16_t *xr = x + m * ldx;
        int64_t line = 0;
        for (int64_t n = n0; n < full; n += TN) {
            if (prefetch && m + 2 * TM <= M) /* the next row block's x, a few lines per tile */
                for (int64_t i = 0; i < per_tile && line < TM * line_per_row; i++, line++)
                    _mm_prefetch((const char *)(xr + (TM + line / line_per_row) * ldx) + 64 * (line % line_per_row),
                                 _MM_HINT_T0);
            tile(xr, ldx, w + n * K, K, bias != NULL ? bias + n : NULL, y + m * ldy + n, ldy);
        }
        if (full < n1)
            pd_bf16_avx_rows(xr, TM, ldx, w, K, full, n1, bias, y + m * ldy, ldy);
    }
    if (m < M)
        pd_bf16_avx_rows(x + m * ldx, M - m, ldx, w, K, n0, n1, bias, y + m * ldy, ldy);
}

TARGET void pd_bf16_avx_tiles(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w,
                              int64_t N, const uint16_t *bias, uint16_t *y, int64_t ldy, int threads) {
    /* As many channels a block as fit TILE_L2_BYTES, then evened out so that the blocks
     * are a multiple of the threads, of near-equal size: on 2 threads the down projection's
     * 7 blocks of 126 channels (4 on one thread, 3 on the other) ran at 0.58-0.66x aten's
     * rate, its 8 of 96 at 0.84-0.88x (Zen 5). */
    int64_t cb = TILE_L2_BYTES / (K * 2) / TN * TN;
    cb = cb < TN ? TN : cb;
    int64_t blocks = (N + cb - 1) / cb;
    blocks = (blocks + threads - 1) / threads * threads;
    cb = ((N + blocks - 1) / blocks + TN - 1) / TN * TN;
    blocks = (N + cb - 1) / cb;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * cb, n1 = n0 + cb < N ? n0 + cb : N;
        channel_block(x, M, K, ldx, w, n0, n1, bias, y, ldy);
    }
}
