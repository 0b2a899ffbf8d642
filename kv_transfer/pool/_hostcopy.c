/* Host KV-block copies fused with the transfer checksum's row sums.
 *
 * A "row" is one (layer, K/V, block) of a KV pool: a contiguous run of
 * `row_bytes` bytes (a multiple of 8). Every function walks a list of rows
 * given as byte offsets and returns, per row, the sum of its little-endian
 * uint64 words modulo 2^64 -- the same value as numpy's
 * `np.add.reduce(row.view(np.uint64), dtype=np.uint64)`, which is the
 * fallback when this library is not built (kv_transfer/pool/hostcopy.py).
 *
 * Why C: the copy and the sum then touch each byte once, and the copy uses
 * non-temporal (streaming) stores, which skip reading the destination lines
 * into the cache first. numpy does neither, and the shared-memory transport is
 * bound by exactly these bytes-touched-per-byte-moved.
 *
 * x86-64 gets an AVX2 loop when the CPU has it (checked at run time) and an
 * SSE2 loop otherwise; other CPUs get portable C that compilers vectorize.
 * No Python API is used: the library is loaded with ctypes, which releases
 * the GIL for the duration of each call. Callers validate every offset.
 */
#include <stdint.h>
#include <string.h>

/* -DPD_PORTABLE builds the portable loops on x86-64 too, and -DPD_NO_AVX2 the SSE2
 * ones: tests/kv_transfer/test_hostcopy.py checks every variant against numpy. */
#if defined(__x86_64__) && !defined(PD_PORTABLE)
#include <immintrin.h>
#define PD_X86 1
#endif

/* Rows are copied GROUP at a time, interleaved cache line by cache line: four
 * sequential streams keep more lines in flight to DRAM than one, which is what
 * bounds a single core here (bench/hostcopy.py, 2-vCPU Xeon VM, 256 MiB of
 * 32 KiB rows at shuffled offsets into a shared-memory pool: 7.9-8.1 -> 9.3-10.8
 * GB/s copied, 10.5-10.7 -> 12.0-13.6 GB/s summed, against 11-11.7 GB/s for one
 * large memcpy; software prefetch added nothing on top). A group of fewer rows (the tail of the list) runs the same
 * loop with fewer streams. */
#define GROUP 4

static uint64_t sum_tail(const uint8_t *p, int64_t n) {
    uint64_t s = 0, w;
    for (int64_t i = 0; i + 8 <= n; i += 8) {
        memcpy(&w, p + i, 8);
        s += w;
    }
    return s;
}

/* m (<= GROUP) rows of n bytes: copy src[k] -> dst[k] (streaming stores when
 * `stream`), sums[k] = the row's word sum. */
typedef void (*copy_fn)(const uint8_t *const *src, uint8_t *const *dst, int m, int64_t n,
                        int stream, uint64_t *sums);
/* m (<= GROUP) rows of n bytes: sums[k] = word sum of p[k]. */
typedef void (*sum_fn)(const uint8_t *const *p, int m, int64_t n, uint64_t *sums);

#ifndef PD_X86
static void copy_sum_c(const uint8_t *const *src, uint8_t *const *dst, int m, int64_t n,
                       int stream, uint64_t *sums) {
    (void)stream;
    for (int k = 0; k < m; k++) {
        memcpy(dst[k], src[k], (size_t)n);
        sums[k] = sum_tail(src[k], n);
    }
}

static void sum_c(const uint8_t *const *p, int m, int64_t n, uint64_t *sums) {
    for (int k = 0; k < m; k++)
        sums[k] = sum_tail(p[k], n);
}
#endif

#ifdef PD_X86
/* Inlined with a constant m for full groups, so the k loops unroll. */
__attribute__((target("avx2"), always_inline))
static inline void copy_sum_avx2_m(const uint8_t *const *src, uint8_t *const *dst, int m,
                                   int64_t n, int stream, uint64_t *sums) {
    __m256i a[GROUP][2];
    int nt = stream;
    for (int k = 0; k < m; k++) {
        a[k][0] = a[k][1] = _mm256_setzero_si256();
        nt &= ((uintptr_t)dst[k] & 31) == 0;
    }
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        for (int k = 0; k < m; k++) {
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(src[k] + i));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(src[k] + i + 32));
            if (nt) {
                _mm256_stream_si256((__m256i *)(dst[k] + i), x0);
                _mm256_stream_si256((__m256i *)(dst[k] + i + 32), x1);
            } else {
                _mm256_storeu_si256((__m256i *)(dst[k] + i), x0);
                _mm256_storeu_si256((__m256i *)(dst[k] + i + 32), x1);
            }
            a[k][0] = _mm256_add_epi64(a[k][0], x0);
            a[k][1] = _mm256_add_epi64(a[k][1], x1);
        }
    }
    for (int k = 0; k < m; k++) {
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(a[k][0], a[k][1]));
        memcpy(dst[k] + i, src[k] + i, (size_t)(n - i));
        sums[k] = lanes[0] + lanes[1] + lanes[2] + lanes[3] + sum_tail(src[k] + i, n - i);
    }
}

__attribute__((target("avx2")))
static void copy_sum_avx2(const uint8_t *const *src, uint8_t *const *dst, int m, int64_t n,
                          int stream, uint64_t *sums) {
    if (m == GROUP)
        copy_sum_avx2_m(src, dst, GROUP, n, stream, sums);
    else
        copy_sum_avx2_m(src, dst, m, n, stream, sums);
}

__attribute__((target("avx2"), always_inline))
static inline void sum_avx2_m(const uint8_t *const *p, int m, int64_t n, uint64_t *sums) {
    __m256i a[GROUP][2];
    for (int k = 0; k < m; k++)
        a[k][0] = a[k][1] = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        for (int k = 0; k < m; k++) {
            a[k][0] = _mm256_add_epi64(a[k][0], _mm256_loadu_si256((const __m256i *)(p[k] + i)));
            a[k][1] = _mm256_add_epi64(a[k][1],
                                       _mm256_loadu_si256((const __m256i *)(p[k] + i + 32)));
        }
    }
    for (int k = 0; k < m; k++) {
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(a[k][0], a[k][1]));
        sums[k] = lanes[0] + lanes[1] + lanes[2] + lanes[3] + sum_tail(p[k] + i, n - i);
    }
}

__attribute__((target("avx2")))
static void sum_avx2(const uint8_t *const *p, int m, int64_t n, uint64_t *sums) {
    if (m == GROUP)
        sum_avx2_m(p, GROUP, n, sums);
    else
        sum_avx2_m(p, m, n, sums);
}

/* SSE2 is part of x86-64 itself: one row at a time, 64 bytes per step. */
static uint64_t copy_sum_sse2_row(const uint8_t *src, uint8_t *dst, int64_t n, int stream) {
    int64_t i = 0;
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    int nt = stream && ((uintptr_t)dst & 15) == 0;
    for (; i + 64 <= n; i += 64) {
        __m128i x0 = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i x1 = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i x2 = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i x3 = _mm_loadu_si128((const __m128i *)(src + i + 48));
        if (nt) {
            _mm_stream_si128((__m128i *)(dst + i), x0);
            _mm_stream_si128((__m128i *)(dst + i + 16), x1);
            _mm_stream_si128((__m128i *)(dst + i + 32), x2);
            _mm_stream_si128((__m128i *)(dst + i + 48), x3);
        } else {
            _mm_storeu_si128((__m128i *)(dst + i), x0);
            _mm_storeu_si128((__m128i *)(dst + i + 16), x1);
            _mm_storeu_si128((__m128i *)(dst + i + 32), x2);
            _mm_storeu_si128((__m128i *)(dst + i + 48), x3);
        }
        a0 = _mm_add_epi64(a0, x0);
        a1 = _mm_add_epi64(a1, x1);
        a2 = _mm_add_epi64(a2, x2);
        a3 = _mm_add_epi64(a3, x3);
    }
    uint64_t lanes[2];
    _mm_storeu_si128((__m128i *)lanes, _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3)));
    memcpy(dst + i, src + i, (size_t)(n - i));
    return lanes[0] + lanes[1] + sum_tail(src + i, n - i);
}

static uint64_t sum_sse2_row(const uint8_t *p, int64_t n) {
    int64_t i = 0;
    __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
    for (; i + 64 <= n; i += 64) {
        a0 = _mm_add_epi64(a0, _mm_loadu_si128((const __m128i *)(p + i)));
        a1 = _mm_add_epi64(a1, _mm_loadu_si128((const __m128i *)(p + i + 16)));
        a2 = _mm_add_epi64(a2, _mm_loadu_si128((const __m128i *)(p + i + 32)));
        a3 = _mm_add_epi64(a3, _mm_loadu_si128((const __m128i *)(p + i + 48)));
    }
    uint64_t lanes[2];
    _mm_storeu_si128((__m128i *)lanes, _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3)));
    return lanes[0] + lanes[1] + sum_tail(p + i, n - i);
}

static void copy_sum_sse2(const uint8_t *const *src, uint8_t *const *dst, int m, int64_t n,
                          int stream, uint64_t *sums) {
    for (int k = 0; k < m; k++)
        sums[k] = copy_sum_sse2_row(src[k], dst[k], n, stream);
}

static void sum_sse2(const uint8_t *const *p, int m, int64_t n, uint64_t *sums) {
    for (int k = 0; k < m; k++)
        sums[k] = sum_sse2_row(p[k], n);
}
#endif

#ifdef PD_X86
static int has_avx2(void) {
#ifdef PD_NO_AVX2
    return 0;
#else
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#endif
}

static copy_fn pick_copy(void) { return has_avx2() ? copy_sum_avx2 : copy_sum_sse2; }
static sum_fn pick_sum(void) { return has_avx2() ? sum_avx2 : sum_sse2; }
const char *pd_kernel_name(void) { return has_avx2() ? "avx2" : "sse2"; }
#else
static copy_fn pick_copy(void) { return copy_sum_c; }
static sum_fn pick_sum(void) { return sum_c; }
const char *pd_kernel_name(void) { return "c"; }
#endif
/* pd_kernel_name: which loop this CPU runs ("avx2", "sse2" or "c"), for benchmark output. */

/* For each row r: copy row_bytes from src + src_off[r] to dst + dst_off[r]
 * and store the row's word sum in sums[r]. `stream` != 0 uses non-temporal
 * stores (for destinations this core will not read again soon); the fence at
 * the end orders them before anything the caller does next, such as telling
 * another process that the bytes are there. */
void pd_copy_rows(const uint8_t *src, uint8_t *dst, const int64_t *src_off,
                  const int64_t *dst_off, int64_t nrows, int64_t row_bytes,
                  uint64_t *sums, int stream) {
    copy_fn copy = pick_copy();
    for (int64_t r = 0; r < nrows; r += GROUP) {
        int m = nrows - r < GROUP ? (int)(nrows - r) : GROUP;
        const uint8_t *s[GROUP];
        uint8_t *d[GROUP];
        for (int k = 0; k < m; k++) {
            s[k] = src + src_off[r + k];
            d[k] = dst + dst_off[r + k];
        }
        copy(s, d, m, row_bytes, stream, sums + r);
    }
#ifdef PD_X86
    _mm_sfence();
#else
    __sync_synchronize();
#endif
}

/* For each row r: sums[r] = word sum of row_bytes at base + off[r]. */
void pd_sum_rows(const uint8_t *base, const int64_t *off, int64_t nrows, int64_t row_bytes,
                 uint64_t *sums) {
    sum_fn sum = pick_sum();
    for (int64_t r = 0; r < nrows; r += GROUP) {
        int m = nrows - r < GROUP ? (int)(nrows - r) : GROUP;
        const uint8_t *p[GROUP];
        for (int k = 0; k < m; k++)
            p[k] = base + off[r + k];
        sum(p, m, row_bytes, sums + r);
    }
}
