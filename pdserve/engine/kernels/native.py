"""The optional native CPU kernels (pdserve/engine/kernels/_cpu_kernels.c), loaded once with ctypes.

Like kv_transfer's native copy, the library is optional: `pip install` builds it
(setup.py) when a C compiler is there. `LIB` is None when it is missing or
`PDSERVE_NATIVE_KERNELS=0`; every caller then takes its torch path. At load it gets the
CPU features this process may use (`PDSERVE_CPU_FEATURES`, pdserve/engine/kernels/cpu_features.py): its
kernels then run as on a CPU that has only those (pdserve/engine/kernels/_pd_cpu.h). The library
uses OpenMP and is loaded after torch, so its `libgomp.so.1` resolves to the
runtime torch already loaded: one thread pool, sized by torch's setting. ctypes
releases the GIL for each call.
"""

from __future__ import annotations

import ctypes
import importlib.util
from typing import NamedTuple

import torch

from pdserve.common import envs
from pdserve.engine.kernels import cpu_features

P = ctypes.c_void_p
I64 = ctypes.c_int64
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


C_INT = ctypes.c_int


class Symbol(NamedTuple):
    """One C function's ctypes signature."""

    name: str
    argtypes: tuple[type, ...]
    restype: type | None
    required: bool = False


SYMBOLS: tuple[Symbol, ...] = (
    Symbol("pd_cpu_set_mask", (C_INT,), C_INT, required=True),
    Symbol("pd_cpu_caps", (), C_INT, required=True),
    Symbol("pd_cpu_detected", (), C_INT, required=True),
    Symbol("pd_cpu_feature_bit", (C_INT,), C_INT, required=True),
    Symbol("pd_paged_decode", (C_INT, P, I64, P, P, P, I64, P, I64, I64, I64, I64, I64, I64,
                               ctypes.c_float, P, C_INT), C_INT, required=True),
    Symbol("pd_paged_prefill", (C_INT, P, I64, P, P, P, I64, I64, I64, I64, I64, I64, I64, I64,
                                ctypes.c_float, P, C_INT), C_INT),
    Symbol("pd_add_rms_norm_bf16", (P, P, P, I64, I64, ctypes.c_float, P, C_INT), None, required=True),
    Symbol("pd_rope_bf16", (P, I64, I64, I64, I64, P, P, C_INT), None, required=True),
    Symbol("pd_silu_mul_bf16", (P, I64, I64, I64, P, C_INT), None, required=True),
    Symbol("pd_int4_dequant", (P, P, C_INT, I64, I64, I64, C_INT, P, C_INT), C_INT),
    Symbol("pd_int8_gemm_bf16", (P, I64, I64, P, P, I64, P, C_INT, C_INT), C_INT),
    Symbol("pd_int8_gemm_supported", (), C_INT),
    Symbol("pd_int8_gemm_amx_supported", (), C_INT),
    Symbol("pd_int8_gemm_path", (I64,), C_INT),
    Symbol("pd_bf16_gemv", (P, I64, I64, I64, P, I64, P, P, C_INT, C_INT), C_INT),
    Symbol("pd_bf16_gemv_supported", (), C_INT),
    Symbol("pd_bf16_gemv_rows", (), C_INT),
    Symbol("pd_bf16_gemv_amx_rows", (), C_INT),
    Symbol("pd_lora_expand_bf16", (P, I64, I64, I64, P, I64, P, P, P, C_INT), C_INT),
    Symbol("pd_attn_bf16_set", (C_INT,), C_INT),
    Symbol("pd_bf16_tiles_set", (C_INT,), C_INT),
    Symbol("pd_paged_decode_q8", (C_INT, C_INT, P, I64, P, P, P, P, I64, I64, I64, P, I64, P, I64,
                                  I64, I64, I64, I64, I64, ctypes.c_float, P, C_INT), C_INT),
    Symbol("pd_attn_q8_simd_set", (C_INT,), C_INT),
    Symbol("pd_int4_gemm_bf16", (P, I64, I64, P, P, C_INT, I64, I64, P, C_INT), C_INT),
    Symbol("pd_int4_gemm_supported", (), C_INT),
    Symbol("pd_int4_gemv_bf16", (P, I64, I64, P, P, C_INT, I64, I64, P, C_INT), C_INT),
    Symbol("pd_int4_gemv_supported", (), C_INT),
    Symbol("pd_int4_gemv_rows", (), C_INT),
    Symbol("pd_int4_tiles_bf16", (P, I64, I64, P, P, C_INT, I64, I64, P, C_INT), C_INT),
    Symbol("pd_int4_tiles_supported", (), C_INT),
)
"""Every entry point's signature. A library built before an optional one existed goes
without it (callers test `hasattr(LIB, name)`); one that lacks a required one is stale
and not loaded at all, so every caller takes its torch path."""


def declare(lib: ctypes.CDLL, symbols: tuple[Symbol, ...] = SYMBOLS) -> bool:
    """Set the signatures of the symbols `lib` has; False when a required one is missing."""
    for sym in symbols:
        if not hasattr(lib, sym.name):
            if sym.required:
                return False
            continue
        fn = getattr(lib, sym.name)
        fn.argtypes, fn.restype = list(sym.argtypes), sym.restype
    return True


def _load() -> ctypes.CDLL | None:
    if not envs.native_kernels():
        return None
    spec = importlib.util.find_spec("pdserve.engine.kernels._cpu_kernels")
    if spec is None or spec.origin is None:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)  # CDLL, not PyDLL: calls release the GIL
    except OSError:
        return None
    if not declare(lib):
        return None
    lib.pd_cpu_set_mask(cpu_features.bits(cpu_features.effective()))
    return lib


LIB: ctypes.CDLL | None = _load()
"""The library, its CPU mask set once from `PDSERVE_CPU_FEATURES` (pdserve/engine/kernels/cpu_features.py)."""


def features() -> frozenset[str]:
    """The features the library's kernels use now (pdserve/engine/kernels/_pd_cpu.h's caps, as names)."""
    if LIB is None:
        return frozenset()
    caps = int(LIB.pd_cpu_caps())
    return frozenset(f.name for f in cpu_features.FEATURES if caps & f.bit)


def set_features(names: frozenset[str]) -> frozenset[str]:
    """Narrow (or restore) the library's features to `names` in this process; returns the
    previous set. Tests and benches that run one kernel under several masks use it; the
    layers' routes (pdserve/engine/kernels/table.py) are chosen once, at load, from
    `cpu_features.effective()`."""
    previous = features()
    if LIB is not None:
        LIB.pd_cpu_set_mask(cpu_features.bits(names))
    return previous
