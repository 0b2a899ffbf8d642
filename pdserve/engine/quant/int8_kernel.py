"""The native int8 weight GEMM (pdserve/engine/kernels/_int8_gemm.c, pdserve/engine/kernels/_int8_vnni.c) for bf16
activations on CPU.

`pack` lays an int8 weight [N, K] out once, at load, as [N/16, K/2, 16, 2] (N padded to
16 and K to 2 with zero codes): one 32-byte load is 16 output channels x 2 consecutive
k. `matmul` runs it for any number of rows in one call; the library picks the path per
call (`path_for`, one C function): up to 4 rows (decode) integer dot products that stream
the codes with the fewest instructions per byte (`VNNI`, pdserve/engine/kernels/_int8_vnni.c: the rows in
15-bit fixed point per group of 64 k, pdserve/engine/kernels/_act_q16.h; `GEMV`, the exact float32 loop of
pdserve/engine/kernels/_int8_gemv.c, stays as a forced path), 5-16 rows AMX with each 32-k chunk of
codes widened as it streams in (`AMX_ROWS`, batched decode), above that AMX tiles over
codes widened to bf16 once per call (prefill), or AVX-512 BF16 dot products where AMX
is not there. `packs_for` is the one place that decides whether a layer keeps its codes
in this layout and runs the kernel for every call (pdserve/engine/quant/linear.py): only for
bf16 on a CPU that has AVX-512 BF16, and never when the library is missing, predates
this interface, or `PDSERVE_NATIVE_KERNELS=0` (`python -m bench.int8_gemm` times every
path against torch's).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pdserve.engine.kernels import native as native_kernels
from pdserve.engine.kernels import table as kernel_table

AUTO, GEMV, DPBF16, AMX, AMX_ROWS, VNNI, AMX_Q8 = 0, 1, 2, 3, 4, 5, 6  # `matmul` paths (the C PATH_* codes)
PATHS = {"gemv": GEMV, "dpbf16": DPBF16, "amx": AMX, "amx_rows": AMX_ROWS, "vnni": VNNI, "amx_q8": AMX_Q8}


class PackedInt8(NamedTuple):
    """An int8 weight in the kernel's layout with its float32 per-channel scales."""

    codes: torch.Tensor  # int8 [ceil(N/16), ceil(K/2), 16, 2]
    scales: torch.Tensor  # float32 [N]
    out_features: int
    in_features: int


def available() -> bool:
    """The library has the kernel and this CPU can run it."""
    lib = native_kernels.LIB
    return lib is not None and hasattr(lib, "pd_int8_gemm_path") and bool(lib.pd_int8_gemm_supported())


def amx_available() -> bool:
    """`available()` and this process may use AMX tiles (else `matmul` runs AVX-512 BF16)."""
    lib = native_kernels.LIB
    return available() and lib is not None and bool(lib.pd_int8_gemm_amx_supported())


_AVAILABLE = available()


def packs_for(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an int8 layer computing in `dtype` on `device` keeps a copy for the kernel:
    where pdserve/engine/kernels/table.py routes its rows to a native int8 entry (all or none)."""
    if not (_AVAILABLE and dtype == torch.bfloat16 and device.type == "cpu"):
        return False
    plan = kernel_table.plan(kernel_table.LinearSpec("int8", "bfloat16", device.type))
    return all(r.kernel.path != AUTO for r in plan.routes)


def pack(q: torch.Tensor, scales: torch.Tensor) -> PackedInt8:
    """int8 codes [N, K] and per-channel scales [N] in the kernel's layout."""
    n, k = q.shape
    padded = F.pad(q, (0, k % 2, 0, -n % 16))
    codes = padded.reshape(padded.shape[0] // 16, 16, padded.shape[1] // 2, 2).permute(0, 2, 1, 3)
    return PackedInt8(codes.contiguous(), scales.float().contiguous(), n, k)


def path_for(rows: int) -> int:
    """The path the library runs for `rows` rows (`AUTO` where it is unavailable)."""
    lib = native_kernels.LIB
    return int(lib.pd_int8_gemm_path(rows)) if lib is not None and _AVAILABLE else AUTO


def matmul(x: torch.Tensor, w: PackedInt8, path: int = AUTO) -> torch.Tensor:
    """x [M, K] bf16 @ (codes * scales)^T -> [M, N] bf16, on `path` (default: the
    library's choice for M rows)."""
    lib = native_kernels.LIB
    assert lib is not None
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"int8 kernel takes bf16 [M, {w.in_features}], got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=torch.bfloat16)
    if m == 0:
        return y
    rc = lib.pd_int8_gemm_bf16(x.data_ptr(), m, w.in_features, w.codes.data_ptr(), w.scales.data_ptr(),
                               w.out_features, y.data_ptr(), torch.get_num_threads(), path)
    if rc != 0:
        raise ValueError(f"int8 kernel cannot run {m} x {w.in_features} @ {w.out_features} on path {path} "
                         f"(code {rc})")
    return y
