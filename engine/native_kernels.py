"""The optional native CPU kernels (engine/_cpu_kernels.c), loaded once with ctypes.

Like kv_transfer's native copy, the library is optional: `pip install` builds it
(setup.py) when a C compiler is there. `LIB` is None when it is missing or
`PDSERVE_NATIVE_KERNELS=0`; every caller then takes its torch path. The library
uses OpenMP and is loaded after torch, so its `libgomp.so.1` resolves to the
runtime torch already loaded: one thread pool, sized by torch's setting. ctypes
releases the GIL for each call.
"""

from __future__ import annotations

import ctypes
import importlib.util

import torch

from common import envs

P = ctypes.c_void_p
I64 = ctypes.c_int64
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _load() -> ctypes.CDLL | None:
    if not envs.native_kernels():
        return None
    spec = importlib.util.find_spec("engine._cpu_kernels")
    if spec is None or spec.origin is None:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)  # CDLL, not PyDLL: calls release the GIL
    except OSError:
        return None
    lib.pd_paged_decode.argtypes = [
        ctypes.c_int, P, I64, P, P, P, I64, P, I64, I64, I64, I64, I64, I64, ctypes.c_float, P,
        ctypes.c_int,
    ]
    lib.pd_paged_decode.restype = ctypes.c_int
    lib.pd_add_rms_norm_bf16.argtypes = [P, P, P, I64, I64, ctypes.c_float, P, ctypes.c_int]
    lib.pd_add_rms_norm_bf16.restype = None
    lib.pd_rope_bf16.argtypes = [P, I64, I64, I64, I64, P, P, ctypes.c_int]
    lib.pd_rope_bf16.restype = None
    if hasattr(lib, "pd_int4_dequant"):  # a library built before it had one goes without
        lib.pd_int4_dequant.argtypes = [P, P, ctypes.c_int, I64, I64, I64, ctypes.c_int, P,
                                        ctypes.c_int]
        lib.pd_int4_dequant.restype = ctypes.c_int
    if hasattr(lib, "pd_int8_gemm_bf16"):
        lib.pd_int8_gemm_bf16.argtypes = [P, I64, I64, P, P, I64, P, ctypes.c_int, ctypes.c_int]
        lib.pd_int8_gemm_bf16.restype = ctypes.c_int
        lib.pd_int8_gemm_supported.argtypes = []
        lib.pd_int8_gemm_supported.restype = ctypes.c_int
        lib.pd_int8_gemm_amx_supported.argtypes = []
        lib.pd_int8_gemm_amx_supported.restype = ctypes.c_int
    if hasattr(lib, "pd_bf16_gemv"):
        lib.pd_bf16_gemv.argtypes = [P, I64, I64, I64, P, I64, P, P, ctypes.c_int, ctypes.c_int]
        lib.pd_bf16_gemv.restype = ctypes.c_int
        lib.pd_bf16_gemv_supported.argtypes = []
        lib.pd_bf16_gemv_supported.restype = ctypes.c_int
        lib.pd_bf16_gemv_rows.argtypes = []
        lib.pd_bf16_gemv_rows.restype = ctypes.c_int
        lib.pd_bf16_gemv_amx_rows.argtypes = []
        lib.pd_bf16_gemv_amx_rows.restype = ctypes.c_int
    if hasattr(lib, "pd_attn_bf16_set"):
        lib.pd_attn_bf16_set.argtypes = [ctypes.c_int]
        lib.pd_attn_bf16_set.restype = ctypes.c_int
    if hasattr(lib, "pd_int8_gemm_path"):
        lib.pd_int8_gemm_path.argtypes = [I64]
        lib.pd_int8_gemm_path.restype = ctypes.c_int
    if hasattr(lib, "pd_int4_gemm_bf16"):
        lib.pd_int4_gemm_bf16.argtypes = [P, I64, I64, P, P, ctypes.c_int, I64, I64, P, ctypes.c_int]
        lib.pd_int4_gemm_bf16.restype = ctypes.c_int
        lib.pd_int4_gemm_supported.argtypes = []
        lib.pd_int4_gemm_supported.restype = ctypes.c_int
    return lib


LIB: ctypes.CDLL | None = _load()
