/* Paged decode attention over a quantized KV pool (`--kv-cache-dtype fp8|int8`), read in
 * place: each (sequence, KV head) walks its block table and reads the one-byte codes and
 * their per-block-per-head float32 scales straight from the pool (pdserve/engine/runner/kv_quant.py:
 * value = code x scale), dequantizing in registers. No gathered or dequantized copy of
 * the context is made, so a decode step moves about half the KV bytes of a bf16 pool.
 *
 * Layouts (pdserve/engine/attention/native.py checks them):
 *   q, out   [B, H, D] float32 or bfloat16 (dtype 0 / 1); q's rows `q_stride` apart
 *   k, v     codes: block b, slot s, KV head h at byte b*block_stride + s*slot_stride + h*D
 *   ks, vs   scales: block b, KV head h at float b*scale_stride + h
 *   tables   [B, table_stride] int64; ctx_lens [B] int64
 * kind 0 = fp8 e4m3fn, 1 = int8. The scale is applied per key: a score is
 * (q . codes) x k_scale x softmax scale, a V row's weight p x v_scale; codes decode to
 * float32 exactly (e4m3 through its bits, normals and subnormals alike; e4m3's NaN codes
 * are never written). Scores, softmax and the weighted sum accumulate in float32; a bf16
 * output is rounded to nearest even once.
 *
 * Two loops: AVX-512F for head size 32, 64 or 128 (16 keys' scores at a time, up to 16
 * accumulators held in registers over the whole context, as _attn_bf16.c), and a
 * portable one for every other case. Block ids and lengths are checked before use.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_attn_simd.h"

#include "_pd_cpu.h"
#define KIND_FP8 0
#define KIND_INT8 1
#define PREFETCH_KEYS 8 /* how far ahead p.V prefetches V rows */

#define TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define INLINE __attribute__((always_inline)) static inline

/* Where one (sequence, KV head)'s keys live. */
typedef struct {
    const uint8_t *k, *v;
    const float *ks, *vs;
    int64_t block_stride, slot_stride, scale_stride, bs;
    const int64_t *table;
} kv_src;

static int simd_enabled = 1;
static float fp8_values[256]; /* e4m3fn code -> value (NaN codes: never written) */

__attribute__((constructor)) static void build_fp8_table(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float x = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        fp8_values[c] = c & 0x80 ? -x : x;
    }
}

/* Turns the AVX-512 loop on (default) or off (tests of the portable loop); returns the
 * previous setting. */
int pd_attn_q8_simd_set(int on) {
    int was = simd_enabled;
    simd_enabled = on != 0;
    return was;
}

/* A key's place in the block table, walked forward without dividing (one 64-bit
 * division per key would cost more than the key's arithmetic). */
typedef struct {
    int64_t bi, off; /* table entry, slot in its block */
} cursor;

static inline cursor cursor_at(const kv_src *s, int64_t t) { return (cursor){t / s->bs, t % s->bs}; }

static inline void advance(const kv_src *s, cursor *c) {
    if (++c->off == s->bs)
        c->off = 0, c->bi++;
}

static inline const uint8_t *row_at(const kv_src *s, const uint8_t *base, cursor c, int64_t h,
                                    int64_t D) {
    return base + s->table[c.bi] * s->block_stride + c.off * s->slot_stride + h * D;
}

static inline float scale_at(const kv_src *s, const float *base, cursor c, int64_t h) {
    return base[s->table[c.bi] * s->scale_stride + h];
}

static inline void decode_row(const uint8_t *c, int kind, int64_t D, float *dst) {
    if (kind == KIND_INT8)
        for (int64_t j = 0; j < D; j++)
            dst[j] = (float)(int8_t)c[j];
    else
        for (int64_t j = 0; j < D; j++)
            dst[j] = fp8_values[c[j]];
}

/* The portable loop. `work`: G*D (queries) + D (a row) + G*D (accumulators) + G*L floats. */
PD_CLONES(void, attend_generic, (int dtype, int kind, const void *q, const kv_src *s, int64_t L,
          int64_t h, int64_t G, int64_t D, float scale, void *out, float *work),
          (dtype, kind, q, s, L, h, G, D, scale, out, work)) {
    float *qf = work, *row = qf + G * D, *acc = row + D, *sc = acc + G * D;
    for (int64_t i = 0; i < G * D; i++)
        qf[i] = (dtype == 1 ? bf16_to_f32(((const uint16_t *)q)[i]) : ((const float *)q)[i]) * scale;
    cursor c = {0, 0};
    for (int64_t t = 0; t < L; t++, advance(s, &c)) {
        decode_row(row_at(s, s->k, c, h, D), kind, D, row);
        float ksc = scale_at(s, s->ks, c, h);
        for (int64_t g = 0; g < G; g++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t j = 0; j < D; j++)
                dot += qf[g * D + j] * row[j];
            sc[g * L + t] = dot * ksc;
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float *p = sc + g * L, m = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < L; t++)
            m = p[t] > m ? p[t] : m;
        for (int64_t t = 0; t < L; t++)
            sum += p[t] = expf(p[t] - m);
        for (int64_t t = 0; t < L; t++)
            p[t] /= sum;
    }
    memset(acc, 0, (size_t)(G * D) * sizeof(float));
    c = (cursor){0, 0};
    for (int64_t t = 0; t < L; t++, advance(s, &c)) {
        decode_row(row_at(s, s->v, c, h, D), kind, D, row);
        float vsc = scale_at(s, s->vs, c, h);
        for (int64_t g = 0; g < G; g++) {
            float p = sc[g * L + t] * vsc;
            for (int64_t j = 0; j < D; j++)
                acc[g * D + j] += p * row[j];
        }
    }
    for (int64_t i = 0; i < G * D; i++) {
        if (dtype == 1)
            ((uint16_t *)out)[i] = f32_to_bf16(acc[i]);
        else
            ((float *)out)[i] = acc[i];
    }
}

/* e4m3 codes with exponent 0 (zero and subnormals, M x 2^-9), by their mantissa M. */
static const float SUB_F32[16] = {0.0f, 1.0f / 512, 2.0f / 512, 3.0f / 512, 4.0f / 512, 5.0f / 512,
                                  6.0f / 512, 7.0f / 512};
static const uint16_t SUB_BF16[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};

/* 16 codes at p as float32, exactly. e4m3: sign, exponent and mantissa moved into a
 * float32's, the exponent re-biased (7 -> 127); exponent 0 looked up by mantissa. */
TARGET INLINE __m512 dec16(const uint8_t *p, int kind) {
    __m512i x = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); /* sign-extended */
    if (kind == KIND_INT8)
        return _mm512_cvtepi32_ps(x);
    __m512i bits = _mm512_add_epi32(_mm512_and_si512(_mm512_slli_epi32(x, 20), _mm512_set1_epi32((int)0x87F00000u)),
                                    _mm512_set1_epi32(120 << 23));
    __mmask16 sub = _mm512_testn_epi32_mask(x, _mm512_set1_epi32(0x78));
    __m512 r = _mm512_mask_permutexvar_ps(_mm512_castsi512_ps(bits), sub, x, _mm512_loadu_ps(SUB_F32));
    /* r | (x & sign): the lookup dropped the sign of the subnormal lanes */
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(r), x,
                                                         _mm512_set1_epi32((int)0x80000000u), 0xF8));
}

/* 32 codes at p as bf16 pairs (exact: e4m3 and int8 fit bf16's 8 significant bits). */
TARGET INLINE __m512 dec32_bf16(const uint8_t *p, int kind) {
    if (kind == KIND_INT8) { /* |code| <= 127: a float32's top half is the exact bf16 */
        __m512i lo = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
        __m512i hi = _mm512_castps_si512(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)))));
        __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                       31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        return _mm512_castsi512_ps(_mm512_permutex2var_epi16(lo, odd, hi));
    }
    __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p)); /* sign-extended */
    __m512i bits = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(x, 4), _mm512_set1_epi16((short)0x87F0)),
                                    _mm512_set1_epi16(120 << 7));
    __mmask32 sub = _mm512_testn_epi16_mask(x, _mm512_set1_epi16(0x78));
    __m512i r = _mm512_mask_permutexvar_epi16(bits, sub, x, _mm512_loadu_si512(SUB_BF16));
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(r, x, _mm512_set1_epi16((short)0x8000), 0xF8));
}

TARGET INLINE __m512 dot(__m512 acc, __m512 a, __m512 b) { /* see _bf16_gemv.c: GCC 12 */
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* 16 query floats of row `q` (float32 or bf16) at element j. */
TARGET INLINE __m512 load_q16(const void *q, int dtype, int64_t j) {
    if (dtype == 0)
        return _mm512_loadu_ps((const float *)q + j);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)q + j));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 accumulators to `out` at element j: float32, or bf16 rounded to nearest even. */
TARGET INLINE void store16(void *out, int dtype, int64_t j, __m512 a) {
    if (dtype == 0) {
        _mm512_storeu_ps((float *)out + j, a);
        return;
    }
    __m512i u = _mm512_castps_si512(a);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

/* The AVX-512 loop for head size D (32, 64 or 128). `work`: 16*D floats (16 decoded keys)
 * + G*L scores. */
TARGET INLINE void attend_d(int dtype, int kind, const void *q, const kv_src *s, int64_t L,
                            int64_t h, int64_t G, float scale, void *out, float *work, const int D,
                            const int bf) {
    const int DV = D / 16, GB = 16 / DV; /* vectors per row; heads per p.V pass */
    const size_t qsz = dtype == 1 ? 2 : 4;
    float *kf = work, *sc = kf + 16 * D;
    const __m512 zero = _mm512_setzero_ps();
    cursor kc = {0, 0}, pc = cursor_at(s, 16); /* this key; the key 16 ahead (prefetch) */
    for (int64_t t0 = 0; t0 < L; t0 += 16) { /* 16 keys at a time, every head over them */
        int64_t n = L - t0 < 16 ? L - t0 : 16;
        float ksc[16];
        for (int64_t i = 0; i < 16; i++) {
            if (i >= n) {
                ksc[i] = 0.0f;
                continue;
            }
            const uint8_t *kr = row_at(s, s->k, kc, h, D);
            ksc[i] = scale_at(s, s->ks, kc, h);
            advance(s, &kc);
            if (bf) /* bf16 pairs: D / 32 vectors a row */
                for (int j = 0; j < D / 32; j++)
                    _mm512_storeu_ps(kf + i * D + 16 * j, dec32_bf16(kr + 32 * j, kind));
            else
                for (int j = 0; j < DV; j++)
                    _mm512_storeu_ps(kf + i * D + 16 * j, dec16(kr + 16 * j, kind));
            if (t0 + 16 + i < L) { /* the same key of the next 16: a block jump ahead */
                for (int line = 0; line < D; line += 64)
                    _mm_prefetch((const char *)row_at(s, s->k, pc, h, D) + line, _MM_HINT_T0);
                advance(s, &pc);
            }
        }
        __m512 kscale = _mm512_mul_ps(_mm512_loadu_ps(ksc), _mm512_set1_ps(scale));
        for (int64_t g = 0; g < G; g++) {
            const char *qg = (const char *)q + g * D * qsz;
            __m512 qv[8], part[16];
            for (int j = 0; j < (bf ? D / 32 : DV); j++)
                qv[j] = bf ? _mm512_loadu_ps((const uint16_t *)qg + 32 * j) : load_q16(qg, dtype, 16 * j);
            for (int i = 0; i < 16; i++) {
                __m512 a = zero;
                if (i < n) {
                    if (bf)
                        for (int j = 0; j < D / 32; j++)
                            a = dot(a, qv[j], _mm512_loadu_ps(kf + i * D + 16 * j));
                    else
                        for (int j = 0; j < DV; j++)
                            a = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kf + i * D + 16 * j), a);
                }
                part[i] = a;
            }
            _mm512_mask_storeu_ps(sc + g * L + t0, (__mmask16)(n >= 16 ? 0xFFFF : (1u << n) - 1u),
                                  _mm512_mul_ps(sum16(part), kscale));
        }
    }
    softmax_rows(sc, G, L);
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
        __m512 acc[16];
        int64_t gn = pv_pass_begin(acc, G, g0, GB);
        cursor vc = {0, 0}, pv = cursor_at(s, PREFETCH_KEYS);
        for (int64_t t = 0; t < L; t++, advance(s, &vc)) {
            if (t + PREFETCH_KEYS < L) {
                for (int line = 0; line < D; line += 64)
                    _mm_prefetch((const char *)row_at(s, s->v, pv, h, D) + line, _MM_HINT_T0);
                advance(s, &pv);
            }
            const uint8_t *vr = row_at(s, s->v, vc, h, D);
            float vsc = scale_at(s, s->vs, vc, h);
            __m512 row[8];
            for (int j = 0; j < DV; j++)
                row[j] = dec16(vr + 16 * j, kind);
            pv_accumulate(acc, row, sc, L, t, g0, gn, GB, DV, vsc);
        }
        for (int64_t g = 0; g < gn; g++)
            for (int j = 0; j < DV; j++)
                store16((char *)out + (g0 + g) * D * qsz, dtype, 16 * j, acc[g * DV + j]);
    }
}

/* bf: bf16 q and a CPU with AVX-512 BF16, so q . k runs `vdpbf16ps` over k decoded to bf16
 * (products exact in float32, as _attn_bf16.c); else float32 FMAs. */
TARGET static void attend_simd(int dtype, int kind, const void *q, const kv_src *s, int64_t L,
                               int64_t h, int64_t G, int64_t D, float scale, void *out, float *work,
                               int bf) {
#define PD_Q8_D(d)                                                                                  \
    (bf ? attend_d(dtype, kind, q, s, L, h, G, scale, out, work, d, 1)                            \
        : attend_d(dtype, kind, q, s, L, h, G, scale, out, work, d, 0))
    if (D == 32)
        PD_Q8_D(32);
    else if (D == 64)
        PD_Q8_D(64);
    else
        PD_Q8_D(128);
#undef PD_Q8_D
}

static int cpu_level(void) { /* 0: no AVX-512 loop; 1: AVX-512F/BW; 2: and AVX-512 BF16 */
    return pd_cpu_has(PD_CPU_AVX512F) + pd_cpu_has(PD_NEEDS_AVX512_BF16);
}

static int simd_ok(int64_t D) {
    return simd_enabled && cpu_level() > 0 && (D == 32 || D == 64 || D == 128);
}

/* Decode attention for B sequences over a quantized pool; returns PD_OK or the first error
 * met (the output is then unspecified). num_threads <= 0 means one thread. */
int pd_paged_decode_q8(int dtype, int kind, const void *q, int64_t q_stride, const uint8_t *k,
                       const float *ks, const uint8_t *v, const float *vs, int64_t block_stride,
                       int64_t slot_stride, int64_t scale_stride, const int64_t *tables,
                       int64_t table_stride, const int64_t *ctx_lens, int64_t B, int64_t H,
                       int64_t KVH, int64_t D, int64_t bs, int64_t num_blocks, float scale,
                       void *out, int num_threads) {
    if (KVH <= 0 || H % KVH || D <= 0 || bs <= 0 || (dtype != 0 && dtype != 1) ||
        (kind != KIND_FP8 && kind != KIND_INT8))
        return PD_ERR_LEN;
    int64_t G = H / KVH, items = B * KVH, max_len = 0;
    for (int64_t b = 0; b < B; b++) {
        if (ctx_lens[b] < 1 || ctx_lens[b] > table_stride * bs)
            return PD_ERR_LEN;
        max_len = ctx_lens[b] > max_len ? ctx_lens[b] : max_len;
        for (int64_t i = 0; i < (ctx_lens[b] + bs - 1) / bs; i++) { /* before any is read */
            int64_t blk = tables[b * table_stride + i];
            if (blk < 0 || blk >= num_blocks)
                return PD_ERR_BLOCK;
        }
    }
    if (items == 0)
        return PD_OK;
    int simd = simd_ok(D), bf = dtype == 1 && cpu_level() == 2, threads = num_threads < 1 ? 1 : num_threads;
    if (threads > items)
        threads = (int)items;
    size_t esz = dtype == 1 ? 2 : 4;
    size_t floats = (size_t)(simd ? 16 * D + G * max_len : 2 * G * D + D + G * max_len);
    int err = PD_OK;
#pragma omp parallel num_threads(threads) reduction(max : err)
    {
        float *work = malloc(floats * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            if (work == NULL) {
                err = PD_ERR_MEM;
                continue;
            }
            int64_t b = i / KVH, h = i % KVH;
            kv_src s = {k, v, ks, vs, block_stride, slot_stride, scale_stride, bs,
                        tables + b * table_stride};
            const char *qb = (const char *)q + (b * q_stride + h * G * D) * esz;
            char *ob = (char *)out + (b * H + h * G) * D * esz;
            if (simd)
                attend_simd(dtype, kind, qb, &s, ctx_lens[b], h, G, D, scale, ob, work, bf);
            else
                attend_generic(dtype, kind, qb, &s, ctx_lens[b], h, G, D, scale, ob, work);
        }
        free(work);
    }
    return err;
}
