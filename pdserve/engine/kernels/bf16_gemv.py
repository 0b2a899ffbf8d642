"""The native bf16 linear (pdserve/engine/kernels/_bf16_gemv.c) on CPU: every row count, one kernel.

`linear` is `F.linear` with one detour: a bf16 CPU call runs the kernel pdserve/engine/kernels/table.py
picked for op `bf16` at import (`kernel()`): AMX tiles where the CPU has AMX-BF16, else
AVX-512 BF16 dot products (`vdpbf16ps`; from 4 rows on in register tiles of 4 rows x 6
channels, the same bits), else those dot products' arithmetic emulated in
plain float32 (AVX2 or baseline x86-64; the same bits as the AVX-512 BF16 path). Each
streams the weight in its own row-major [N, K] layout (no second copy), sums in float32
and rounds to bf16 once, in an order that does not depend on how many rows share the call,
the panel they fall in or the thread count: decode's 1-16 rows, a chunk of a prefill and
a whole prompt give every row the same bits (docs/determinism.md). Every other call
(float32, CUDA, autograd, an input whose last dimension is strided, the library missing,
`PDSERVE_NATIVE_KERNELS=0`) is plain `F.linear`; so is every bf16 call where
`PDSERVE_BF16_GEMV=0` or `PDSERVE_DISABLED_KERNELS` removes the native entries (the table's
`bf16_aten`, not row-invariant: oneDNN's order changes with M). `python -m bench.bf16_gemv`
times each path per shape and row count; `python -m bench.invariance` the cost end to end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.common import envs
from pdserve.engine.kernels import native as native_kernels
from pdserve.engine.kernels import table as kernel_table

AUTO, AVX, AMX, EMUL = 0, 1, 2, 3  # `gemv` paths: pdserve/engine/kernels/_pd_cpu.h's PD_BF16_*
ROWS = 16
"""Rows of one AMX C tile (more run 16 at a time); the kernel itself takes any M >= 1."""
TILE_ROWS = 4
"""From these rows on the AVX-512 BF16 path runs its register tiles (_bf16_gemm.h's PD_BF16_TILE_ROWS)."""
NATIVE = ("bf16_amx", "bf16_avx512", "bf16_emulated")


def available() -> bool:
    """The library has the kernel (it runs on every x86-64 CPU: the emulated path needs nothing)."""
    lib = native_kernels.LIB
    return lib is not None and hasattr(lib, "pd_bf16_gemv")


_AVAILABLE = available()
SPEC = kernel_table.LinearSpec("bf16", "bfloat16")


def _plan() -> kernel_table.Plan:
    off = envs.disabled_kernels() | (frozenset() if envs.bf16_gemv() else frozenset(NATIVE))
    return kernel_table.plan(SPEC, disabled=off)


PLAN = _plan()
"""The bf16 routes of this process, decided once (one kernel for every row count unless a
setting removed the native ones)."""
_PATH = PLAN.kernel_for(1).path
_on = _AVAILABLE and _PATH != AUTO


def kernel() -> str:
    """The table entry bf16 CPU linears run (`bf16_aten` where the detour is off)."""
    return PLAN.kernel_for(1).name if _on else "bf16_aten"


def enabled() -> bool:
    """Whether `linear` routes bf16 CPU calls to the kernel."""
    return _on


def set_enabled(on: bool) -> bool:
    """Turn the kernel route on (where the table picked one) or off; returns the previous setting."""
    global _on
    previous, _on = _on, on and _AVAILABLE and _PATH != AUTO
    return previous


def set_tiles(on: bool) -> bool:
    """The AVX-512 BF16 path's register tiles (pdserve/engine/kernels/_bf16_tiles.c, from
    TILE_ROWS rows) on (default) or off, where every row count runs the decode tiles; the
    bits are the same either way (A/B benchmarks and tests). Returns the previous setting."""
    lib = native_kernels.LIB
    if lib is None or not hasattr(lib, "pd_bf16_tiles_set"):
        return False
    return bool(lib.pd_bf16_tiles_set(int(on)))


def amx_rows() -> int:
    """The fewest rows the library runs on AMX tiles (0: this CPU, as masked, has no AMX)."""
    return 1 if _AVAILABLE and "amx_bf16" in native_kernels.features() else 0


def paths() -> dict[str, int]:
    """The forced paths this CPU, as masked, runs: name -> `gemv` path code."""
    feats = native_kernels.features()
    return {name: code for name, code, need in (("avx", AVX, "avx512_bf16"), ("amx", AMX, "amx_bf16"),
                                                 ("emulated", EMUL, None))
            if _AVAILABLE and (need is None or need in feats)}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, path: int = AUTO) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) on the kernel: bf16 CPU tensors, M >= 1, x's
    columns contiguous (any row stride), weight C-contiguous. ValueError otherwise. AUTO:
    the library's best path for this CPU as masked (the table's `bf16` entry)."""
    check(x, weight, bias)
    return _run(x, weight, bias, path)


def check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """ValueError unless the kernel can take these operands (`gemv`'s docstring)."""
    if native_kernels.LIB is None or not _AVAILABLE:
        raise ValueError("the native bf16 GEMV is not available (library missing)")
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        raise ValueError("bf16 GEMV takes bfloat16 CPU tensors, got "
                         + ", ".join(f"{t.dtype} on {t.device}" for t in tensors))
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"bf16 GEMV takes x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if m < 1:
        raise ValueError(f"bf16 GEMV takes at least one row, got {m}")
    if x.stride(1) != 1 or (m > 1 and x.stride(0) < k) or not weight.is_contiguous():
        raise ValueError("bf16 GEMV needs x's columns and the weight contiguous, got strides "
                         f"{x.stride()} and {weight.stride()}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bf16 GEMV bias must be a contiguous [{n}], got {tuple(bias.shape)}")


def _run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, path: int = AUTO) -> torch.Tensor:
    """The kernel call with no checks: the caller has established everything `gemv` checks
    (`linear` does on its own route test)."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    rc = native_kernels.LIB.pd_bf16_gemv(  # type: ignore[union-attr]
        x.data_ptr(), m, k, x.stride(0) if m > 1 else k, weight.data_ptr(), n,
        None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads(), path)
    if rc != 0:
        raise ValueError(f"bf16 GEMV cannot run {m} x {k} @ {n} on path {path} (code {rc})")
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, through the kernel where it applies (module docstring).
    The route test below is every check `gemv` makes, so the kernel call is unchecked."""
    if (_on and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.is_cpu and weight.is_cpu
            and weight.dim() == 2 and not (x.requires_grad or weight.requires_grad)):
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if (x2.shape[0] >= 1 and x2.stride(-1) == 1 and (x2.shape[0] == 1 or x2.stride(0) >= x2.shape[1])
                and x2.shape[1] == weight.shape[1] and weight.is_contiguous()
                and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_cpu and bias.dim() == 1
                                      and bias.shape[0] == weight.shape[0] and bias.is_contiguous()))):
            y = _run(x2, weight, bias, _PATH)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
