"""Builds the optional native kernels; all other metadata is in pyproject.toml.

`kv_transfer/pool/_hostcopy.c` uses no Python API (kv_transfer/pool/hostcopy.py loads it
with ctypes). It is optional: without a C compiler the install succeeds and
the transfer layer uses numpy instead (slower shared-memory transfers).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kv_transfer.pool._hostcopy",
            sources=["kv_transfer/pool/_hostcopy.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        # bf16 CPU kernels (pdserve/engine/kernels/native.py): in-place paged decode attention, fused
        # residual add + RMSNorm, int4 unpacking, the int8 weight GEMM, the many-row int4
        # weight GEMM, the bf16 decode GEMV (pdserve/engine/kernels/_bf16_gemv.c), decode attention over an
        # fp8/int8 KV pool (pdserve/engine/kernels/_attn_q8.c). OpenMP binds to the libgomp torch already
        # loaded, so it shares torch's thread pool.
        Extension(
            "pdserve.engine.kernels._cpu_kernels",
            sources=["pdserve/engine/kernels/_cpu_caps.c", "pdserve/engine/kernels/_cpu_kernels.c", "pdserve/engine/kernels/_int8_gemm.c", "pdserve/engine/kernels/_int8_gemv.c",
                     "pdserve/engine/kernels/_int8_vnni.c", "pdserve/engine/kernels/_int8_amx_rows.c", "pdserve/engine/kernels/_int8_amx_q8.c",
                     "pdserve/engine/kernels/_int4_gemm.c", "pdserve/engine/kernels/_int4_gemv.c", "pdserve/engine/kernels/_int4_tiles.c",
                     "pdserve/engine/kernels/_bf16_gemv.c", "pdserve/engine/kernels/_bf16_amx.c",
                     "pdserve/engine/kernels/_bf16_emul.c", "pdserve/engine/kernels/_bf16_tiles.c", "pdserve/engine/kernels/_lora_expand.c",
                     "pdserve/engine/kernels/_attn_bf16.c",
                     "pdserve/engine/kernels/_attn_q8.c"],
            depends=["pdserve/engine/kernels/_pd_cpu.h", "pdserve/engine/kernels/_bf16_gemm.h", "pdserve/engine/kernels/_int8_gemm.h", "pdserve/engine/kernels/_act_q16.h", "pdserve/engine/kernels/_int4_q16.h", "pdserve/engine/kernels/_attn_bf16.h", "pdserve/engine/kernels/_attn_simd.h"],
            extra_compile_args=["-O3", "-fopenmp"],
            extra_link_args=["-fopenmp"],
            libraries=["m"],
            optional=True,
        ),
    ]
)
