/* The one header every native kernel includes for its result codes and for what this CPU
 * (and process) may run. pdserve/engine/kernels/_cpu_caps.c holds the capability state; Python
 * (pdserve/engine/kernels/native.py) sets the mask of allowed features once, at load, from
 * pdserve/engine/kernels/cpu_features.py (`PDSERVE_CPU_FEATURES`), so a kernel sees exactly the CPU the
 * setting describes: a machine with AMX can run the code paths of one without it.
 *
 * Kernels ask `pd_cpu_has(bits)` at call time (a load and a compare); they never call
 * `__builtin_cpu_supports` or ask for AMX permission themselves. The bit values are
 * mirrored by name in pdserve/engine/kernels/cpu_features.py (FEATURES); tests check the two agree
 * through `pd_cpu_feature_bit`. */
#ifndef PD_CPU_H
#define PD_CPU_H

/* Result codes of every entry point. */
#define PD_OK 0
#define PD_ERR_MEM 1   /* an allocation failed */
#define PD_ERR_BLOCK 2 /* a block table names a block outside the pool */
#define PD_ERR_LEN 3   /* a shape, stride or argument the kernel does not take */
#define PD_ERR_CPU 4   /* this CPU (as masked) cannot run the path asked for */

/* `pd_bf16_gemv` paths (pdserve/engine/kernels/table.py names each). */
#define PD_BF16_AUTO 0
#define PD_BF16_AVX 1  /* AVX-512 BF16 dot products */
#define PD_BF16_AMX 2  /* AMX-BF16 tiles */
#define PD_BF16_EMUL 3 /* the dot products' arithmetic in plain float32 */

/* CPU capability bits. */
#define PD_CPU_AVX2 (1 << 0)       /* with FMA */
#define PD_CPU_AVX512F (1 << 1)    /* with BW, DQ, VL */
#define PD_CPU_AVX512_BF16 (1 << 2)
#define PD_CPU_AVX512_VNNI (1 << 3)
#define PD_CPU_AVX512_VBMI (1 << 4)
#define PD_CPU_AMX_BF16 (1 << 5)   /* AMX tiles + bf16, permission granted by the kernel */
#define PD_CPU_AMX_INT8 (1 << 6)
#define PD_CPU_ALL ((1 << 7) - 1)

/* Feature sets the kernels need. */
#define PD_NEEDS_AVX512_BF16 (PD_CPU_AVX512F | PD_CPU_AVX512_BF16)
#define PD_NEEDS_INT8 (PD_NEEDS_AVX512_BF16 | PD_CPU_AVX512_VNNI)
#define PD_NEEDS_INT4_GEMV (PD_NEEDS_INT8 | PD_CPU_AVX512_VBMI)
#define PD_NEEDS_AMX_BF16 (PD_NEEDS_AVX512_BF16 | PD_CPU_AMX_BF16)
#define PD_NEEDS_AMX (PD_NEEDS_AVX512_BF16 | PD_CPU_AMX_BF16 | PD_CPU_AMX_INT8 | PD_CPU_AVX512_VBMI)

/* The features this process may use: the hardware's, AND the mask, AMX only where Linux
 * granted tile data permission (asked once, the first time AMX survives the mask). */
int pd_cpu_caps(void);

/* Sets the mask (PD_CPU_* bits; PD_CPU_ALL by default) and returns the resulting caps. */
int pd_cpu_set_mask(int mask);

/* The hardware's features, unmasked (AMX permission not asked). */
int pd_cpu_detected(void);

extern int pd_cpu_caps_now; /* pd_cpu_caps()'s value once computed, -1 before */

static inline int pd_cpu_has(int bits) {
    int caps = pd_cpu_caps_now >= 0 ? pd_cpu_caps_now : pd_cpu_caps();
    return (caps & bits) == bits;
}

/* A loop compiled three times (AVX-512F, AVX2, baseline x86-64) and picked at each call
 * by the masked caps, in place of GCC's `target_clones`, whose resolver reads CPUID and so
 * would ignore the mask. None enables FMA or reassociation, so the three give the same bits. Usage:
 *     PD_CLONES(int, name, (int a, float *b), (a, b)) { body }
 * defines `static int name(int a, float *b)`. */
#define PD_TARGET_AVX512 __attribute__((target("avx512f"))) /* no FMA: a*b+c stays two roundings */
#define PD_TARGET_AVX2 __attribute__((target("avx2")))
#define PD_CLONES(ret, name, params, args)                                                          \
    static inline __attribute__((always_inline)) ret name##_body params;                           \
    PD_TARGET_AVX512 static ret name##_avx512 params { return name##_body args; }                 \
    PD_TARGET_AVX2 static ret name##_avx2 params { return name##_body args; }                     \
    static ret name##_base params { return name##_body args; }                                     \
    static ret name params {                                                                       \
        return pd_cpu_has(PD_CPU_AVX512F) ? name##_avx512 args                                     \
               : pd_cpu_has(PD_CPU_AVX2)  ? name##_avx2 args                                       \
                                          : name##_base args;                                      \
    }                                                                                              \
    static inline __attribute__((always_inline)) ret name##_body params

#endif
