/* The capability state behind pdserve/engine/kernels/_pd_cpu.h: detection (the only
 * `__builtin_cpu_supports` calls in the library), the mask Python sets at load, and the
 * one request for AMX tile permission. */
#include "_pd_cpu.h"

#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int pd_cpu_caps_now = -1;
static int mask = PD_CPU_ALL;
static int amx_permitted = -1; /* per process: asked once */

int pd_cpu_detected(void) {
    static int detected = -1;
    if (detected < 0) {
        __builtin_cpu_init();
        int caps = 0;
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
            caps |= PD_CPU_AVX2;
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
            && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
            caps |= PD_CPU_AVX512F;
        if (__builtin_cpu_supports("avx512bf16"))
            caps |= PD_CPU_AVX512_BF16;
        if (__builtin_cpu_supports("avx512vnni"))
            caps |= PD_CPU_AVX512_VNNI;
        if (__builtin_cpu_supports("avx512vbmi"))
            caps |= PD_CPU_AVX512_VBMI;
        if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16"))
            caps |= PD_CPU_AMX_BF16;
        if (__builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8"))
            caps |= PD_CPU_AMX_INT8;
        detected = caps;
    }
    return detected;
}

int pd_cpu_caps(void) {
    int caps = pd_cpu_detected() & mask;
    if (caps & (PD_CPU_AMX_BF16 | PD_CPU_AMX_INT8)) {
        if (amx_permitted < 0)
            amx_permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        if (!amx_permitted)
            caps &= ~(PD_CPU_AMX_BF16 | PD_CPU_AMX_INT8);
    }
    pd_cpu_caps_now = caps;
    return caps;
}

int pd_cpu_set_mask(int m) {
    mask = m & PD_CPU_ALL;
    pd_cpu_caps_now = -1;
    return pd_cpu_caps();
}

/* Bit `i`'s value, for pdserve/engine/kernels/cpu_features.py's check that its table matches this one. */
int pd_cpu_feature_bit(int i) {
    static const int bits[] = {PD_CPU_AVX2, PD_CPU_AVX512F, PD_CPU_AVX512_BF16, PD_CPU_AVX512_VNNI,
                               PD_CPU_AVX512_VBMI, PD_CPU_AMX_BF16, PD_CPU_AMX_INT8};
    return i >= 0 && i < (int)(sizeof bits / sizeof bits[0]) ? bits[i] : 0;
}
