/* Without AVX-512 BF16: the dot products' arithmetic, step for step, in plain float32 (one
 * of PD_CLONES' AVX-512F / AVX2 / baseline builds; none fuses or reorders). Each lane i of a
 * 32-k step adds x[2i+1] w[2i+1], then x[2i] w[2i] (exact products, each add rounded to
 * nearest even, denormals flushed: MXCSR FTZ and DAZ, as `vdpbf16ps` does), and the lanes
 * are summed by `sum4`'s tree. So this path gives the same bits as the AVX-512 BF16 one
 * (tests/engine/test_cpu_masks.py), at any M. */
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "_bf16_gemm.h"

/* One full 32-k step: the bf16 pairs as 32-bit lanes, the low half the even k. */
static inline void emul_step(float *lane, const uint16_t *xr, const uint16_t *wr) {
    uint32_t xp[16], wp[16];
    memcpy(xp, xr, sizeof xp);
    memcpy(wp, wr, sizeof wp);
    for (int i = 0; i < 16; i++) {
        uint32_t xe = xp[i] << 16, xo = xp[i] & 0xFFFF0000u, we = wp[i] << 16, wo = wp[i] & 0xFFFF0000u;
        float fxe, fxo, fwe, fwo;
        memcpy(&fxe, &xe, 4), memcpy(&fxo, &xo, 4), memcpy(&fwe, &we, 4), memcpy(&fwo, &wo, 4);
        lane[i] = (lane[i] + fxo * fwo) + fxe * fwe;
    }
}

/* The K tail (n < 32 k), zeros past it on both sides as the masked loads give. */
static inline void emul_tail(float *lane, const uint16_t *xr, const uint16_t *wr, int64_t n) {
    uint16_t x[32] = {0}, w[32] = {0};
    memcpy(x, xr, (size_t)n * 2);
    memcpy(w, wr, (size_t)n * 2);
    emul_step(lane, x, w);
}

/* Channel n against the panel's M rows (M <= the panel): their lanes with FTZ and DAZ on
 * (one MXCSR switch per channel), then each row's tree and rounding with it off. */
PD_CLONES(void, emul_channel, (const uint16_t *x, int64_t M, int64_t ldx, const uint16_t *w, int64_t K,
          int64_t n, const uint16_t *bias, uint16_t *y, int64_t ldy, float *lanes),
          (x, M, ldx, w, K, n, bias, y, ldy, lanes)) {
    const uint16_t *wr = w + n * K;
    int64_t full = K / 32 * 32;
    memset(lanes, 0, (size_t)M * 16 * sizeof(float));
    unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u); /* FTZ | DAZ, as vdpbf16ps computes */
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *xr = x + m * ldx;
        float *lane = lanes + m * 16;
        for (int64_t k = 0; k < full; k += 32)
            emul_step(lane, xr + k, wr + k);
        if (full < K)
            emul_tail(lane, xr + full, wr + full, K - full);
    }
    _mm_setcsr(csr);
    float b = bias != NULL ? from_bf16(bias[n]) : 0.0f;
    for (int64_t m = 0; m < M; m++) {
        const float *lane = lanes + m * 16;
        float h[4];
        for (int j = 0; j < 4; j++)
            h[j] = (lane[j] + lane[j + 8]) + (lane[j + 4] + lane[j + 12]);
        y[m * ldy + n] = to_bf16(((h[0] + h[1]) + (h[2] + h[3])) + b);
    }
}

int pd_bf16_emul(const uint16_t *x, int64_t M, int64_t K, int64_t ldx, const uint16_t *w, int64_t N,
                 const uint16_t *bias, uint16_t *y, int threads) {
    int64_t panel = pd_bf16_panel_rows(K);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float *lanes = malloc((size_t)(panel < M ? panel : M) * 16 * sizeof(float));
        for (int64_t m0 = 0; m0 < M; m0 += panel) {
            int64_t pm = M - m0 < panel ? M - m0 : panel;
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) {
                if (lanes == NULL) {
                    failed = 1;
                    continue;
                }
                emul_channel(x + m0 * ldx, pm, ldx, w, K, n, bias, y + m0 * N, N, lanes);
            }
        }
        free(lanes);
    }
    return failed ? PD_ERR_MEM : PD_OK;
}

