"""The LoRA expand kernel (pdserve/engine/kernels/_lora_expand.c): each row of a step's stacked
update over its own adapter's rank columns only, in an order fixed by those columns
(pdserve/engine/lora/batch.py). bf16 CPU tensors only; `available()` says whether the library
has it (without it the stack runs as a masked GEMM pair)."""

from __future__ import annotations

import torch

from pdserve.engine.kernels import native as native_kernels


def available() -> bool:
    lib = native_kernels.LIB
    return lib is not None and hasattr(lib, "pd_lora_expand_bf16")


def expand(h: torch.Tensor, bt: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, out: torch.Tensor) -> None:
    """out[t] += bf16(h[t, lo[t]:hi[t]] @ bt[lo[t]:hi[t]]), in place, rounded once per sum
    and once per add: h [T, R] (unit column stride), bt [R, N] and out [T, N] contiguous
    bf16, lo/hi [T] int32. ValueError on anything else."""
    t, r = h.shape
    n = bt.shape[1]
    if (any(x.dtype != torch.bfloat16 or not x.is_cpu for x in (h, bt, out)) or h.stride(1) != 1
            or not (bt.is_contiguous() and out.is_contiguous()) or bt.shape[0] != r or out.shape != (t, n)
            or lo.dtype != torch.int32 or hi.dtype != torch.int32 or lo.shape != (t,) or hi.shape != (t,)
            or not (lo.is_contiguous() and hi.is_contiguous())):
        raise ValueError(f"LoRA expand takes bf16 h [T, R], bt [R, N], out [T, N] and int32 ranges, got "
                         f"{tuple(h.shape)}, {tuple(bt.shape)}, {tuple(out.shape)}")
    lib = native_kernels.LIB
    assert lib is not None
    rc = lib.pd_lora_expand_bf16(h.data_ptr(), t, r, h.stride(0) if t > 1 else r, bt.data_ptr(), n,
                                 lo.data_ptr(), hi.data_ptr(), out.data_ptr(),
                                 torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"LoRA expand cannot run {t} x {r} @ {r} x {n} (code {rc})")
