/* Native CPU kernels of the bf16 hot path (pdserve/engine/kernels/native.py loads them):
 * (also the int4 weight unpacking of pdserve/engine/quant/linear.py, at the end of the file)
 * paged decode attention read in place from the KV pool, the residual add fused with
 * RMSNorm, and the rotary embedding in place (the last two at the end of the file).
 *
 * The torch backend (pdserve/engine/attention/paged.py) gathers every decoding sequence's
 * whole context out of the pool, per layer per step, into a padded tensor and
 * then runs SDPA over it: the KV bytes are read, written and read again. Here
 * each (sequence, KV head) walks its own block table and reads each K and V row
 * once, straight from the pool, with no padding and no mask.
 *
 * Layouts (element strides, C-contiguous):
 *   q, out        [B, H, D]                       H = KVH * G query heads; heads
 *                                                 h*G .. h*G+G-1 share KV head h;
 *                                                 q's rows may be `q_stride` apart
 *                                                 (a view into the qkv projection)
 *   k, v (a pool) [num_blocks, bs, KVH, D]
 *   tables        [B, table_stride] int64         block ids; only the first
 *                                                 ceil(ctx_len / bs) are read
 *   ctx_lens      [B] int64                       keys each sequence attends to
 * dtype 0 = float32, 1 = bfloat16 (q, k, v and out alike). Scores, softmax and
 * the weighted sum accumulate in float32; a bf16 output is rounded to nearest
 * even once, at the end.
 *
 * Work items are (sequence, KV head) pairs, spread over OpenMP threads. The
 * library is loaded after torch, so `libgomp.so.1` resolves to the runtime torch
 * already loaded: the same thread pool, sized by the caller (torch's setting).
 * No Python API: loaded with ctypes, which releases the GIL for the call.
 * Every block id and length is checked here before it is used as an address.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_attn_bf16.h"
#include "_attn_simd.h"

#include "_pd_cpu.h"

/* float32 -> the nearest bf16, as float32 (a bf16 op's rounding of its result). */
static inline float rbf(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* dst[0..D) = row `idx` (element offset) of `base` as float32. */
static inline void load_row(const void *base, int dtype, int64_t idx, int64_t D, float *dst) {
    if (dtype == 1) {
        const uint16_t *p = (const uint16_t *)base + idx;
        for (int64_t j = 0; j < D; j++)
            dst[j] = bf16_to_f32(p[j]);
    } else {
        memcpy(dst, (const float *)base + idx, (size_t)D * sizeof(float));
    }
}

/* One (sequence, KV head): the G query heads sharing it attend to its L keys.
 * `work` holds G*D (queries) + D (one K/V row) + G*D (accumulators) + G*L
 * (scores) floats. */
PD_CLONES(int, attend, (int dtype, const void *q, int64_t q_stride, const void *k, const void *v,
          const int64_t *table, int64_t L, int64_t num_blocks, int64_t b, int64_t h, int64_t G,
          int64_t KVH, int64_t D, int64_t bs, float scale, void *out, float *work),
          (dtype, q, q_stride, k, v, table, L, num_blocks, b, h, G, KVH, D, bs, scale, out, work)) {
    float *qf = work, *row = qf + G * D, *acc = row + D, *sc = acc + G * D;
    int64_t q0 = (b * KVH * G + h * G) * D;
    if (dtype == 1) { /* pdserve/engine/kernels/_attn_bf16.c where the head size and CPU allow */
        int rc = pd_attend_bf16((const uint16_t *)q + b * q_stride + h * G * D, k, v, table, L,
                                num_blocks, h, G, KVH, D, bs, scale, (uint16_t *)out + q0, sc);
        if (rc != PD_ATTN_UNHANDLED)
            return rc;
    }
    for (int64_t g = 0; g < G; g++) {
        load_row(q, dtype, b * q_stride + (h * G + g) * D, D, qf + g * D);
        for (int64_t j = 0; j < D; j++)
            qf[g * D + j] *= scale;
    }
    for (int64_t t = 0; t < L; t++) {
        int64_t blk = table[t / bs];
        if (blk < 0 || blk >= num_blocks)
            return PD_ERR_BLOCK;
        load_row(k, dtype, ((blk * bs + t % bs) * KVH + h) * D, D, row);
        for (int64_t g = 0; g < G; g++) {
            const float *qg = qf + g * D;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t j = 0; j < D; j++)
                s += qg[j] * row[j];
            sc[g * L + t] = s;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *s = sc + g * L, m = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < L; t++)
            m = s[t] > m ? s[t] : m;
        for (int64_t t = 0; t < L; t++) {
            s[t] = expf(s[t] - m);
            sum += s[t];
        }
        float inv = 1.0f / sum;
        for (int64_t t = 0; t < L; t++)
            s[t] *= inv;
    }
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    for (int64_t t = 0; t < L; t++) {
        int64_t blk = table[t / bs]; /* checked in the K pass */
        load_row(v, dtype, ((blk * bs + t % bs) * KVH + h) * D, D, row);
        for (int64_t g = 0; g < G; g++) {
            float p = sc[g * L + t], *a = acc + g * D;
            for (int64_t j = 0; j < D; j++)
                a[j] += p * row[j];
        }
    }
    for (int64_t i = 0; i < G * D; i++) {
        if (dtype == 1)
            ((uint16_t *)out)[q0 + i] = f32_to_bf16(acc[i]);
        else
            ((float *)out)[q0 + i] = acc[i];
    }
    return PD_OK;
}

/* Decode attention for B sequences; returns PD_OK or the first error met
 * (the output is then unspecified). num_threads <= 0 means one thread. */
int pd_paged_decode(int dtype, const void *q, int64_t q_stride, const void *k, const void *v,
                    const int64_t *tables,
                    int64_t table_stride, const int64_t *ctx_lens, int64_t B, int64_t H,
                    int64_t KVH, int64_t D, int64_t bs, int64_t num_blocks, float scale,
                    void *out, int num_threads) {
    if (KVH <= 0 || H % KVH || D <= 0 || bs <= 0)
        return PD_ERR_LEN;
    int64_t G = H / KVH, items = B * KVH, max_len = 0;
    if (items == 0)
        return PD_OK;
    for (int64_t b = 0; b < B; b++) {
        if (ctx_lens[b] < 1 || ctx_lens[b] > table_stride * bs)
            return PD_ERR_LEN;
        max_len = ctx_lens[b] > max_len ? ctx_lens[b] : max_len;
    }
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > items)
        threads = (int)items;
    int err = PD_OK;
#pragma omp parallel num_threads(threads) reduction(max : err)
    {
        /* Every thread must reach the `omp for`; one without scratch only reports it. */
        float *work = malloc((size_t)(2 * G * D + D + PD_ATTN_BF16_SCRATCH(G, max_len)) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (work == NULL) {
                err = PD_ERR_MEM;
                continue;
            }
            int64_t b = i / KVH, h = i % KVH;
            int rc = attend(dtype, q, q_stride, k, v, tables + b * table_stride, ctx_lens[b],
                            num_blocks, b, h, G, KVH, D, bs, scale, out, work);
            err = rc > err ? rc : err;
        }
        free(work);
    }
    return err;
}

#define PREFILL_ROWS 16 /* query rows a prefill work item attends together (_attn_bf16.c): 1.03-1.08x
                          * as fast as 8 at 1,500 rows on Zen 5 (each K block's transposition serves
                          * 48 (row, head) pairs); scratch 16 x G x context floats */

/* Prefill attention for one sequence: its n query rows q [n, H, D] (rows q_stride apart)
 * at positions start .. start + n - 1 of the block table (table_len ids), row i attending
 * keys [0, start + i] of the pool (already written), into out [n, H, D]. Each row has the
 * bits of pd_paged_decode at its position, whatever n, start or the thread count: work
 * items are (PREFILL_ROWS consecutive rows, KV head), each row computed in its own order
 * (_attn_bf16.c's row tiles share only the loads; elsewhere `attend`, row by row). Items
 * run KV head by KV head, so one head's K and V (~200 KB at 1,500 tokens) stay in L2 across
 * its row tiles instead of all heads' taking turns through L3 (~10% of the attention). */
int pd_paged_prefill(int dtype, const void *q, int64_t q_stride, const void *k, const void *v,
                     const int64_t *table, int64_t table_len, int64_t start, int64_t n, int64_t H,
                     int64_t KVH, int64_t D, int64_t bs, int64_t num_blocks, float scale, void *out,
                     int num_threads) {
    if (KVH <= 0 || H % KVH || D <= 0 || bs <= 0 || start < 0 || n < 1 || start + n > table_len * bs)
        return PD_ERR_LEN;
    int64_t G = H / KVH, tiles = (n + PREFILL_ROWS - 1) / PREFILL_ROWS, items = tiles * KVH, max_len = start + n;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > items)
        threads = (int)items;
    int64_t scratch = 2 * G * D + D + PD_ATTN_BF16_SCRATCH(G, max_len);
    if (PD_ATTN_BF16_SCRATCH(PREFILL_ROWS * G, max_len) > scratch)
        scratch = PD_ATTN_BF16_SCRATCH(PREFILL_ROWS * G, max_len);
    int err = PD_OK;
#pragma omp parallel num_threads(threads) reduction(max : err)
    {
        float *work = malloc((size_t)scratch * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (work == NULL) {
                err = PD_ERR_MEM;
                continue;
            }
            int64_t r0 = i % tiles * PREFILL_ROWS, h = i / tiles, rows = n - r0 < PREFILL_ROWS ? n - r0 : PREFILL_ROWS;
            int rc = PD_ATTN_UNHANDLED;
            if (dtype == 1)
                rc = pd_attend_bf16_rows((const uint16_t *)q + r0 * q_stride + h * G * D, q_stride, k, v, table,
                                         start + r0 + 1, rows, num_blocks, h, G, KVH, D, bs, scale,
                                         (uint16_t *)out + (r0 * H + h * G) * D, H * D, work);
            for (int64_t r = r0; rc == PD_ATTN_UNHANDLED && r < r0 + rows; r++) {
                int row_rc = attend(dtype, q, q_stride, k, v, table, start + r + 1, num_blocks, r, h, G, KVH, D,
                                    bs, scale, out, work);
                err = row_rc > err ? row_rc : err;
            }
            err = rc > err ? rc : err;
        }
        free(work);
    }
    return err;
}

/* The residual add fused with the next RMSNorm, bfloat16 in and out, rounded where
 * Hugging Face's Llama rounds (so bf16 output stays within its HF tolerance):
 *   h   <- bf16(h + delta)                       (in place; delta NULL: h as it is)
 *   out  = bf16(w * bf16(h * rsqrt(mean(h^2) + eps)))   mean and rsqrt in float32
 * One pass over h per row instead of ~9 torch ops (add, cast, pow, mean, add, rsqrt,
 * mul, cast, mul), each a dispatch and a full pass over the row. On AVX-512 the elementwise
 * loops run 16 lanes at a time (add_rms_norm_row16, below), with the same bits. */

/* sum_j h[j]^2 of a row in float32, the order GCC's `omp simd` reduction gives each clone (the
 * same bits on every kind: tests/engine/test_fused_ops.py). */
PD_CLONES(float, sum_squares, (const uint16_t *h, int64_t dim), (h, dim)) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < dim; j++) {
        float x = bf16_to_f32(h[j]);
        ss += x * x;
    }
    return ss;
}

static void add_rms_norm_row(uint16_t *h, const uint16_t *delta, const uint16_t *w, int64_t dim, float eps,
                             uint16_t *out) {
    if (delta != NULL) {
        for (int64_t j = 0; j < dim; j++)
            h[j] = f32_to_bf16(bf16_to_f32(h[j]) + bf16_to_f32(delta[j]));
    }
    float inv = 1.0f / sqrtf(sum_squares(h, dim) / (float)dim + eps);
    for (int64_t j = 0; j < dim; j++) {
        float n = bf16_to_f32(f32_to_bf16(bf16_to_f32(h[j]) * inv));
        out[j] = f32_to_bf16(bf16_to_f32(w[j]) * n);
    }
}


/* exp(x) in float32 for x in [-87, 89] (the caller clamps): x = n ln2 + r, |r| <= ln2/2,
 * exp(r) by its degree-6 Taylor polynomial (error under 2 ulp), times 2^n built in the
 * exponent bits. Plain multiplies and adds (no FMA in any clone, see PD_CLONES), so every
 * clone and every lane of a vector loop give the same bits. */
#pragma GCC push_options
/* No trapping math: lets GCC turn the selects below into vector blends. It allows no
 * reassociation or contraction, so the bits stay those of the scalar code. */
#pragma GCC optimize("no-trapping-math")
static inline float pd_expf(float x) {
    const float shift = 0x1.8p23f; /* adding it rounds to an integer (|x log2 e| < 2^22) */
    float t = x * 1.44269504088896341f + shift;
    float n = t - shift;
    float r = x - n * 0.693145751953125f; /* ln 2's high part: n * it is exact */
    r = r - n * 1.428606765330187e-06f;  /* ln 2's low part */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* One row of the MLP's activation, bfloat16: out[j] = bf16(bf16(silu(g[j])) * u[j]), where
 * torch's `F.silu(gate) * up` rounds (silu's result, then the product; a product of two
 * bf16 values is exact in float32, so it is rounded once). silu(g) = g / (1 + exp(-g)),
 * -g clamped to [-87, 89]: exp(-g) is then 1 + tiny or overflows to inf exactly where
 * the true value does for float32 (silu(-inf) is NaN, as torch's). Elementwise: a row's
 * bits never depend on its neighbours. */
PD_CLONES(void, silu_mul_row, (const uint16_t *g, const uint16_t *u, int64_t n, uint16_t *out),
          (g, u, n, out)) {
    /* Written without branches (selects only), so that it vectorizes; f32_to_bf16's
     * rounding spelled out per lane. */
    for (int64_t j = 0; j < n; j++) {
        uint32_t gb = (uint32_t)g[j] << 16, ub = (uint32_t)u[j] << 16;
        float x, y;
        memcpy(&x, &gb, sizeof x);
        memcpy(&y, &ub, sizeof y);
        float m = -x;
        m = m < -87.0f ? -87.0f : m;
        m = m > 89.0f ? 89.0f : m;
        float s = x / (1.0f + pd_expf(m));
        uint32_t sb;
        memcpy(&sb, &s, sizeof sb);
        uint32_t sr = (sb + 0x7fffu + ((sb >> 16) & 1u)) & 0xffff0000u;
        sb = (sb & 0x7fffffffu) > 0x7f800000u ? (sb | 0x400000u) & 0xffff0000u : sr;
        memcpy(&s, &sb, sizeof s);
        float p = s * y;
        uint32_t pb;
        memcpy(&pb, &p, sizeof pb);
        uint32_t pr = (pb + 0x7fffu + ((pb >> 16) & 1u)) >> 16;
        out[j] = (uint16_t)((pb & 0x7fffffffu) > 0x7f800000u ? (pb >> 16) | 0x40u : pr);
    }
}

#pragma GCC pop_options

/* silu_mul_row's arithmetic, 16 lanes at a time (lanes past `n` masked off): the same
 * operations in the same order, so the same bits. */
#define PD_AVX512_BW __attribute__((target("avx512f,avx512bw,avx512vl")))
#define PD_AVX512_BW_INLINE PD_AVX512_BW __attribute__((always_inline)) static inline

PD_AVX512_BW_INLINE __m512 pd_bf16x16(const uint16_t *p, __mmask16 k) {
    __m256i h = _mm256_maskz_loadu_epi16(k, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* float32 -> bf16 bits in the low half of each lane, rounded as f32_to_bf16. */
PD_AVX512_BW_INLINE __m512i pd_round_bf16x16(__m512 f) {
    __m512i b = _mm512_castps_si512(f);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    __m512i q = _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40));
    return _mm512_mask_mov_epi32(r, nan, q);
}

/* add_rms_norm_row's elementwise loops 16 lanes at a time (the tail masked), each rounding as
 * f32_to_bf16: the same bits as its scalar loops, ~10x fewer instructions on Zen 5. */
PD_AVX512_BW static void residual_add16(uint16_t *h, const uint16_t *delta, int64_t dim) {
    for (int64_t j = 0; j < dim; j += 16) {
        __mmask16 k = (__mmask16)(dim - j >= 16 ? 0xFFFF : (1u << (dim - j)) - 1u);
        __m512 sum = _mm512_add_ps(pd_bf16x16(h + j, k), pd_bf16x16(delta + j, k));
        _mm256_mask_storeu_epi16(h + j, k, _mm512_cvtepi32_epi16(pd_round_bf16x16(sum)));
    }
}

PD_AVX512_BW static void scale_row16(const uint16_t *h, const uint16_t *w, int64_t dim, float inv, uint16_t *out) {
    const __m512 s = _mm512_set1_ps(inv);
    for (int64_t j = 0; j < dim; j += 16) {
        __mmask16 k = (__mmask16)(dim - j >= 16 ? 0xFFFF : (1u << (dim - j)) - 1u);
        __m512 n = _mm512_castsi512_ps(_mm512_slli_epi32(pd_round_bf16x16(_mm512_mul_ps(pd_bf16x16(h + j, k), s)), 16));
        _mm256_mask_storeu_epi16(out + j, k, _mm512_cvtepi32_epi16(pd_round_bf16x16(_mm512_mul_ps(pd_bf16x16(w + j, k), n))));
    }
}

/* add_rms_norm_row with its elementwise loops 16 lanes at a time: the same bits. */
PD_AVX512_BW static void add_rms_norm_row16(uint16_t *h, const uint16_t *delta, const uint16_t *w, int64_t dim,
                                            float eps, uint16_t *out) {
    if (delta != NULL)
        residual_add16(h, delta, dim);
    scale_row16(h, w, dim, 1.0f / sqrtf(sum_squares(h, dim) / (float)dim + eps), out);
}

void pd_add_rms_norm_bf16(uint16_t *h, const uint16_t *delta, const uint16_t *w, int64_t rows,
                          int64_t dim, float eps, uint16_t *out, int num_threads) {
    /* A decode batch's few rows are not worth waking the thread team for. */
    int threads = rows * dim < (1 << 16) || num_threads < 1 ? 1 : num_threads;
    void (*row)(uint16_t *, const uint16_t *, const uint16_t *, int64_t, float, uint16_t *) =
        pd_cpu_has(PD_CPU_AVX512F) ? add_rms_norm_row16 : add_rms_norm_row;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        row(h + r * dim, delta == NULL ? NULL : delta + r * dim, w, dim, eps, out + r * dim);
}

/* silu(x) * y of 16 lanes, as silu_mul_row, bf16 bits in the low half of each lane. */
PD_AVX512_BW_INLINE __m512i silu_mul16(__m512 x, __m512 y) {
    const __m512 shift = _mm512_set1_ps(0x1.8p23f);
    const float c[7] = {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f};
    __m512 m = _mm512_sub_ps(_mm512_setzero_ps(), x);
    m = _mm512_max_ps(m, _mm512_set1_ps(-87.0f)); /* NaN: any finite m; x / ... stays NaN */
    m = _mm512_min_ps(m, _mm512_set1_ps(89.0f));
    __m512 t = _mm512_add_ps(_mm512_mul_ps(m, _mm512_set1_ps(1.44269504088896341f)), shift);
    __m512 nn = _mm512_sub_ps(t, shift);
    __m512 r = _mm512_sub_ps(m, _mm512_mul_ps(nn, _mm512_set1_ps(0.693145751953125f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(nn, _mm512_set1_ps(1.428606765330187e-06f)));
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < 7; i++)
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c[i]));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(nn), _mm512_set1_epi32(127)), 23);
    __m512 ex = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    __m512 sg = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), ex));
    __m512i sb = _mm512_slli_epi32(pd_round_bf16x16(sg), 16);
    return pd_round_bf16x16(_mm512_mul_ps(_mm512_castsi512_ps(sb), y));
}

/* Full vectors with plain loads and stores, the tail masked: masking every vector took
 * 1.5-1.7x the time a row on Zen 5 (the same bits). */
PD_AVX512_BW static void silu_mul_row16(const uint16_t *g, const uint16_t *u, int64_t n, uint16_t *out) {
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        _mm256_storeu_si256((__m256i *)(out + j),
                            _mm512_cvtepi32_epi16(silu_mul16(widen16(g + j), widen16(u + j))));
    if (j < n) {
        __mmask16 k = (__mmask16)((1u << (n - j)) - 1u);
        _mm256_mask_storeu_epi16(out + j, k,
                                 _mm512_cvtepi32_epi16(silu_mul16(pd_bf16x16(g + j, k), pd_bf16x16(u + j, k))));
    }
}

/* act [rows, inter] = silu(gate) * up of gate_up [rows, 2 inter] (gate first, as the fused
 * gate/up projection lays them out; rows `stride` elements apart), bfloat16. */
void pd_silu_mul_bf16(const uint16_t *gate_up, int64_t rows, int64_t inter, int64_t stride,
                      uint16_t *out, int num_threads) {
    int threads = rows * inter < (1 << 16) || num_threads < 1 ? 1 : num_threads;
    void (*row)(const uint16_t *, const uint16_t *, int64_t, uint16_t *) =
        pd_cpu_has(PD_CPU_AVX512F) ? silu_mul_row16 : silu_mul_row;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        row(gate_up + r * stride, gate_up + r * stride + inter, inter, out + r * inter);
}

/* Rotary embedding in place on the first `nheads` heads of each row of x (bf16):
 * row t at x + t * row_stride, head h at + h * D; cos/sin rows [T, D], sin with the
 * rotate_half sign folded in (pdserve/engine/models/rope.py). Rounded as HF's
 * `x * cos + rotate_half(x) * sin` in bf16: each product, then the sum. */
PD_CLONES(void, rope_row, (uint16_t *x, int64_t nheads, int64_t D, const uint16_t *c,
          const uint16_t *s),
          (x, nheads, D, c, s)) {
    int64_t half = D / 2;
    for (int64_t h = 0; h < nheads; h++) {
        uint16_t *p = x + h * D;
        for (int64_t j = 0; j < half; j++) {
            float a = bf16_to_f32(p[j]), b = bf16_to_f32(p[j + half]);
            float lo = rbf(rbf(a * bf16_to_f32(c[j])) + rbf(b * bf16_to_f32(s[j])));
            float hi = rbf(rbf(b * bf16_to_f32(c[j + half])) + rbf(a * bf16_to_f32(s[j + half])));
            p[j] = f32_to_bf16(lo);
            p[j + half] = f32_to_bf16(hi);
        }
    }
}

/* 16 lanes of rope_row's rounded products and sum: bf16(bf16(a * c) + bf16(b * s)), each
 * rounding as f32_to_bf16 (no FMA), so the same bits. */
PD_AVX512_BW_INLINE __m512 rope16(__m512 a, __m512 c, __m512 b, __m512 s) {
    __m512 ac = _mm512_castsi512_ps(_mm512_slli_epi32(pd_round_bf16x16(_mm512_mul_ps(a, c)), 16));
    __m512 bs = _mm512_castsi512_ps(_mm512_slli_epi32(pd_round_bf16x16(_mm512_mul_ps(b, s)), 16));
    return _mm512_add_ps(ac, bs);
}

/* rope_row 16 elements of each half at a time (the tail masked): 12x fewer instructions
 * than the scalar loop's per-element rounding on Zen 5, the same bits. */
PD_AVX512_BW static void rope_row16(uint16_t *x, int64_t nheads, int64_t D, const uint16_t *c,
                                    const uint16_t *s) {
    int64_t half = D / 2;
    for (int64_t h = 0; h < nheads; h++) {
        uint16_t *p = x + h * D;
        for (int64_t j = 0; j < half; j += 16) {
            __mmask16 k = (__mmask16)(half - j >= 16 ? 0xFFFF : (1u << (half - j)) - 1u);
            __m512 a = pd_bf16x16(p + j, k), b = pd_bf16x16(p + j + half, k);
            __m512 lo = rope16(a, pd_bf16x16(c + j, k), b, pd_bf16x16(s + j, k));
            __m512 hi = rope16(b, pd_bf16x16(c + j + half, k), a, pd_bf16x16(s + j + half, k));
            _mm256_mask_storeu_epi16(p + j, k, _mm512_cvtepi32_epi16(pd_round_bf16x16(lo)));
            _mm256_mask_storeu_epi16(p + j + half, k, _mm512_cvtepi32_epi16(pd_round_bf16x16(hi)));
        }
    }
}

void pd_rope_bf16(uint16_t *x, int64_t T, int64_t row_stride, int64_t nheads, int64_t D,
                  const uint16_t *cos, const uint16_t *sin, int num_threads) {
    int threads = T * nheads * D < (1 << 16) || num_threads < 1 ? 1 : num_threads;
    void (*row)(uint16_t *, int64_t, int64_t, const uint16_t *, const uint16_t *) =
        pd_cpu_has(PD_CPU_AVX512F) ? rope_row16 : rope_row;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; t++)
        row(x + t * row_stride, nheads, D, cos + t * D, sin + t * D);
}

/* int4 weights in the layout torch's CPU int4 kernel packs them in
 * (`_convert_weight_to_int4pack_for_cpu(q, 1)` with N a multiple of 64):
 *   packed [N/64, K, 32] uint8: the byte for (block nb, column k, lane d) holds row
 *   nb*64+d in its low nibble and row nb*64+32+d in its high nibble;
 *   sz [K/group, N, 2] (float32 or bf16): scale and offset, w = (q - 8) * scale + offset
 * -> out [N, K] dense, float32 or bf16 (rounded to nearest even). The aten kernel is a
 * small-M kernel: past a few dozen rows a dense matmul over this is several times faster
 * (pdserve/engine/quant/linear.py). */
/* One 64-row block, 16 columns at a time: the 16 x 32 bytes are first split into a
 * [64 rows][16 columns] tile of codes (in L1), then each row's 16 values are scaled and
 * stored contiguously (one vector). `group` is a multiple of 16 (checked by the caller).
 * Codes, scales and offsets are finite, so bf16 rounding needs no NaN case. */
PD_CLONES(void, int4_block, (const uint8_t *packed, const void *sz, int sz_dtype, int64_t nb,
          int64_t N, int64_t K, int64_t group, int out_dtype, void *out),
          (packed, sz, sz_dtype, nb, N, K, group, out_dtype, out)) {
    const uint8_t *src = packed + nb * K * 32;
    uint8_t tile[64][16];
    for (int64_t k0 = 0; k0 < K; k0 += 16) {
        for (int kk = 0; kk < 16; kk++) {
            const uint8_t *row = src + (k0 + kk) * 32;
            for (int d = 0; d < 32; d++) {
                tile[d][kk] = row[d] & 15;
                tile[32 + d][kk] = row[d] >> 4;
            }
        }
        int64_t g = k0 / group;
        for (int r = 0; r < 64; r++) {
            int64_t n = nb * 64 + r, at = (g * N + n) * 2;
            float s, o;
            if (sz_dtype == 1) {
                s = bf16_to_f32(((const uint16_t *)sz)[at]);
                o = bf16_to_f32(((const uint16_t *)sz)[at + 1]);
            } else {
                s = ((const float *)sz)[at];
                o = ((const float *)sz)[at + 1];
            }
            float w[16];
            for (int kk = 0; kk < 16; kk++)
                w[kk] = (float)((int)tile[r][kk] - 8) * s + o;
            if (out_dtype == 1) {
                uint16_t *dst = (uint16_t *)out + n * K + k0;
                for (int kk = 0; kk < 16; kk++) {
                    uint32_t u;
                    memcpy(&u, &w[kk], sizeof u);
                    dst[kk] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
                }
            } else {
                memcpy((float *)out + n * K + k0, w, sizeof w);
            }
        }
    }
}

int pd_int4_dequant(const uint8_t *packed, const void *sz, int sz_dtype, int64_t N, int64_t K,
                    int64_t group, int out_dtype, void *out, int num_threads) {
    if (N % 64 != 0 || group <= 0 || group % 16 != 0 || K % group != 0)
        return PD_ERR_LEN;
    int threads = num_threads < 1 ? 1 : num_threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t nb = 0; nb < N / 64; nb++)
        int4_block(packed, sz, sz_dtype, nb, N, K, group, out_dtype, out);
    return PD_OK;
}
