"""The native int4 weight kernels for bf16 activations on CPU: the GEMM (pdserve/engine/kernels/_int4_gemm.c)
for many rows, prefill through an int4 layer without a dense copy of its weight, and the GEMV
(pdserve/engine/kernels/_int4_gemv.c) for decode's 1-4 rows.

It reads the codes in the layout the layer already holds for torch's small-M kernel
(`torch._convert_weight_to_int4pack_for_cpu`, N padded to 64) with their group scales and
offsets, so int4 stays one copy of ~0.5 byte a weight. Per 32 output channels it widens the
codes to bf16 once per call into a buffer that stays in cache (AMX B tiles) and multiplies
every row of x against it with AMX, summing in float32 and rounding once to bf16: the
numerics of `F.linear` over the weight `pd_int4_dequant` unpacks, without writing or reading
that weight. `available` is the run-time check (the library has it, this CPU has AMX-BF16
and AVX-512 VBMI, `PDSERVE_NATIVE_KERNELS` is not 0); the layer keeps its
dequantize + matmul path where it is False (`python -m bench.int4_gemm` times both).

The GEMV reads the same bytes with integer dot products: the rows become 15-bit fixed
point per group of 64 k (pdserve/engine/kernels/_act_q16.h; each element off by at most 2^-15 of its group's
largest), the codes never widen, and each group's integer sums are scaled in float32 with
the weights exact ((q - 8) * scale + offset, not rounded to bf16). `gemv_runs` is its check
(AVX-512 VBMI, VNNI and BF16; group 32 or a multiple of 64); the layer keeps aten's
`_weight_int4pack_mm_for_cpu` where it is False. `tiles` (pdserve/engine/kernels/_int4_tiles.c) is the
same arithmetic blocked for many rows, the CPU-without-AMX GEMM: every row comes out in the
GEMV's bits whatever the row count (pdserve/engine/kernels/_int4_q16.h holds what the two share).
"""

from __future__ import annotations

import torch

from pdserve.engine.kernels import native as native_kernels
from pdserve.engine.kernels.native import DTYPE_CODES


def available() -> bool:
    """The library has the kernel and this CPU (and process) can run it."""
    lib = native_kernels.LIB
    return lib is not None and hasattr(lib, "pd_int4_gemm_bf16") and bool(lib.pd_int4_gemm_supported())


_AVAILABLE = available()


def gemv_available() -> bool:
    """The library has the GEMV and this CPU can run it."""
    lib = native_kernels.LIB
    return lib is not None and hasattr(lib, "pd_int4_gemv_bf16") and bool(lib.pd_int4_gemv_supported())


_GEMV_AVAILABLE = gemv_available()
GEMV_ROWS = int(native_kernels.LIB.pd_int4_gemv_rows()) if _GEMV_AVAILABLE and native_kernels.LIB else 0


def gemv_runs(x: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> bool:
    """Whether `gemv` takes this call: 1 to `GEMV_ROWS` 2-D bf16 rows on CPU, K a multiple
    of 32 and of the group, the group 32 or a multiple of 64, N a multiple of 64."""
    k, n = x.shape[-1], scales_and_zeros.shape[1]
    return (_GEMV_AVAILABLE and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2
            and 1 <= x.shape[0] <= GEMV_ROWS and k % 32 == 0 and k % group == 0
            and (group == 32 or group % 64 == 0) and n % 64 == 0 and scales_and_zeros.dtype in DTYPE_CODES)


def gemv(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] bf16 (M <= `GEMV_ROWS`) @ dequant(packed, scales_and_zeros)^T -> [M, N] bf16,
    over fixed-point rows (see the module's docstring)."""
    return _call("pd_int4_gemv_bf16", "int4 GEMV", x, packed, scales_and_zeros, group)


def tiles_available() -> bool:
    """The library has the GEMV's arithmetic for many rows (pdserve/engine/kernels/_int4_tiles.c) and this
    CPU can run it."""
    lib = native_kernels.LIB
    return lib is not None and hasattr(lib, "pd_int4_tiles_bf16") and bool(lib.pd_int4_tiles_supported())


def tiles(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] bf16, any M, @ dequant(packed, scales_and_zeros)^T -> [M, N] bf16: `gemv`'s
    bits for every row whatever M (the module's docstring), register tiles over the rows."""
    return _call("pd_int4_tiles_bf16", "int4 GEMM (VNNI)", x, packed, scales_and_zeros, group)


def runs(x: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> bool:
    """Whether `matmul` takes this call: 2-D bf16 rows on CPU, K a multiple of 32 (a tile)
    and of an even group, N of 64, scales in a dtype it reads."""
    k, n = x.shape[-1], scales_and_zeros.shape[1]
    return (_AVAILABLE and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2
            and k % 32 == 0 and group % 2 == 0 and k % group == 0 and n % 64 == 0
            and scales_and_zeros.dtype in DTYPE_CODES)


def matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] bf16 @ dequant(packed, scales_and_zeros)^T -> [M, N] bf16, N and K the
    padded sizes the packed codes hold (N = scales_and_zeros.shape[1])."""
    return _call("pd_int4_gemm_bf16", "int4 kernel", x, packed, scales_and_zeros, group)


def _call(symbol: str, what: str, x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
          group: int) -> torch.Tensor:
    """One of the library's int4 entry points (same arguments) on x; ValueError for what it refuses."""
    lib = native_kernels.LIB
    assert lib is not None
    n, k = scales_and_zeros.shape[1], x.shape[-1]
    if x.dtype != torch.bfloat16 or x.dim() != 2 or scales_and_zeros.shape[0] * group != k:
        raise ValueError(f"{what} takes bf16 [M, {scales_and_zeros.shape[0] * group}], "
                         f"got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    if x.shape[0] == 0:
        return y
    rc = getattr(lib, symbol)(x.data_ptr(), x.shape[0], k, packed.data_ptr(), scales_and_zeros.data_ptr(),
                              DTYPE_CODES[scales_and_zeros.dtype], n, group, y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"{what} cannot run {x.shape[0]} x {k} @ {n} in groups of {group} (code {rc})")
    return y
