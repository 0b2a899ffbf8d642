"""The native bf16 GEMV (pdserve/engine/kernels/_bf16_gemv.c) for decode's small-row linears on CPU.

`linear` is `F.linear` with one detour: a bf16 CPU call with 1 to `route_rows()` rows (a
decode step's batch: up to 16 where the CPU has AMX, else 2) runs the native kernel,
which streams the weight in its own row-major [N, K] layout (no second copy) as AMX A
tiles (or AVX-512 BF16 dot products), float32 sums and one rounding to bf16; oneDNN's
matmul reads the same weights at well under the memory speed one core reaches
(`python -m bench.bf16_gemv` times both per shape and row count). Every
other call (float32, more rows, CUDA, autograd, an input whose last dimension is strided,
a CPU without AVX-512 BF16, the library missing or `PDSERVE_NATIVE_KERNELS=0`) is plain
`F.linear`. `PDSERVE_BF16_GEMV=0` (read once, at import: this is every decode linear's
path) turns the detour off alone; `set_enabled` does the same in one process (A/B
benches and tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.common import envs
from pdserve.engine.kernels import native as native_kernels


def available() -> bool:
    """The library has the kernel and this CPU can run it."""
    lib = native_kernels.LIB
    return lib is not None and hasattr(lib, "pd_bf16_gemv") and bool(lib.pd_bf16_gemv_supported())


_AVAILABLE = available()
ROWS = int(native_kernels.LIB.pd_bf16_gemv_rows()) if _AVAILABLE else 0  # type: ignore[union-attr]
"""The most rows the kernel takes in one call (0 where it is unavailable)."""

AVX_ROUTE_ROWS = 2
"""Without AMX, the dot-product path beats F.linear only at a row or two (bench/bf16_gemv.py)."""

_on = _AVAILABLE and envs.bf16_gemv()


def enabled() -> bool:
    """Whether `linear` routes small bf16 CPU calls to the kernel."""
    return _on


def set_enabled(on: bool) -> bool:
    """Turn the kernel route on (where available) or off; returns the previous setting."""
    global _on
    previous, _on = _on, on and _AVAILABLE
    return previous


AUTO, AVX, AMX = 0, 1, 2  # `gemv` paths: the library's choice, AVX-512 BF16 dot products, AMX tiles


def amx_rows() -> int:
    """The fewest rows the library runs on AMX tiles (0: this CPU or process has no AMX)."""
    lib = native_kernels.LIB
    return int(lib.pd_bf16_gemv_amx_rows()) if lib is not None and _AVAILABLE else 0


_ROUTE_ROWS = ROWS if amx_rows() else min(ROWS, AVX_ROUTE_ROWS)


def route_rows() -> int:
    """The most rows `linear` hands the kernel: all it takes on AMX, else AVX_ROUTE_ROWS
    (fixed for the process: AMX is asked for once, at import)."""
    return _ROUTE_ROWS


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, path: int = AUTO) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) on the kernel: bf16 CPU tensors, 1 <= M <= ROWS,
    x's columns contiguous (any row stride), weight C-contiguous. ValueError otherwise."""
    check(x, weight, bias)
    return _run(x, weight, bias, path)


def check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """ValueError unless the kernel can take these operands (`gemv`'s docstring)."""
    if native_kernels.LIB is None or not _AVAILABLE:
        raise ValueError("the native bf16 GEMV is not available (library missing or no AVX-512 BF16)")
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        raise ValueError("bf16 GEMV takes bfloat16 CPU tensors, got "
                         + ", ".join(f"{t.dtype} on {t.device}" for t in tensors))
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"bf16 GEMV takes x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= ROWS:
        raise ValueError(f"bf16 GEMV takes 1 to {ROWS} rows, got {m}")
    if x.stride(1) != 1 or (m > 1 and x.stride(0) < k) or not weight.is_contiguous():
        raise ValueError("bf16 GEMV needs x's columns and the weight contiguous, got strides "
                         f"{x.stride()} and {weight.stride()}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bf16 GEMV bias must be a contiguous [{n}], got {tuple(bias.shape)}")


def _run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, path: int = AUTO) -> torch.Tensor:
    """The kernel call with no checks: the caller has established everything `gemv` checks
    (`linear` does on its own route test, once per decode linear)."""
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
        if (1 <= x2.shape[0] <= _ROUTE_ROWS and x2.stride(-1) == 1 and x2.stride(0) >= x2.shape[1]
                and x2.shape[1] == weight.shape[1] and weight.is_contiguous()
                and (bias is None or (bias.dtype == torch.bfloat16 and bias.is_cpu and bias.dim() == 1
                                      and bias.shape[0] == weight.shape[0] and bias.is_contiguous()))):
            y = _run(x2, weight, bias)
            return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)
