"""Builds the optional native kernels; all other metadata is in pyproject.toml.

`kv_transfer/_hostcopy.c` uses no Python API (kv_transfer/hostcopy.py loads it
with ctypes). It is optional: without a C compiler the install succeeds and
the transfer layer uses numpy instead (slower shared-memory transfers).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kv_transfer._hostcopy",
            sources=["kv_transfer/_hostcopy.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        # bf16 CPU kernels (engine/native_kernels.py): in-place paged decode attention, fused
        # residual add + RMSNorm, int4 unpacking, the int8 weight GEMM, the many-row int4
        # weight GEMM, the bf16 decode GEMV (engine/_bf16_gemv.c), decode attention over an
        # fp8/int8 KV pool (engine/_attn_q8.c). OpenMP binds to the libgomp torch already
        # loaded, so it shares torch's thread pool.
        Extension(
            "engine._cpu_kernels",
            sources=["engine/_cpu_kernels.c", "engine/_int8_gemm.c", "engine/_int8_gemv.c",
                     "engine/_int8_vnni.c", "engine/_int8_amx_rows.c", "engine/_int8_amx_q8.c",
                     "engine/_int4_gemm.c", "engine/_int4_gemv.c", "engine/_bf16_gemv.c", "engine/_attn_bf16.c",
                     "engine/_attn_q8.c"],
            depends=["engine/_int8_gemm.h", "engine/_act_q16.h", "engine/_attn_bf16.h", "engine/_attn_simd.h"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            libraries=["m"],
            optional=True,
        ),
    ]
)
