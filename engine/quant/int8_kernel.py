"""The native small-M int8 weight GEMM (engine/_int8_gemm.c) for bf16 activations on CPU.

`pack` lays an int8 weight [N, K] out once, at load, as [N/16, K/2, 16, 2] (N padded to
16 and K to 2 with zero codes): one 32-byte load is 16 output channels x 2 consecutive
k, the operand of an AVX-512 BF16 dot product. `matmul` runs it for up to `MAX_ROWS`
rows, `matmul_rows` for any number in blocks of `MAX_ROWS`. `packs_for` is the one place
that decides whether a layer keeps its codes in this layout and runs the kernel for every
call (engine/quant/linear.py): only for bf16 on a CPU that has AVX-512 BF16, and never
when the library is missing or `PDSERVE_NATIVE_KERNELS=0` (`python -m bench.int8_gemm`
times it against torch's paths).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine import native_kernels

MAX_ROWS = 32  # rows per kernel call (AMX: two 16-row tiles)


class PackedInt8(NamedTuple):
    """An int8 weight in the kernel's layout with its float32 per-channel scales."""

    codes: torch.Tensor  # int8 [ceil(N/16), ceil(K/2), 16, 2]
    scales: torch.Tensor  # float32 [N]
    out_features: int
    in_features: int


def available() -> bool:
    """The library has the kernel and this CPU can run it."""
    lib = native_kernels.LIB
    return lib is not None and hasattr(lib, "pd_int8_gemm_bf16") and bool(lib.pd_int8_gemm_supported())


def amx_available() -> bool:
    """`available()` and this process may use AMX tiles (else `matmul` runs AVX-512 BF16)."""
    lib = native_kernels.LIB
    return available() and lib is not None and bool(lib.pd_int8_gemm_amx_supported())


_AVAILABLE = available()


def packs_for(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an int8 layer computing in `dtype` on `device` keeps a copy for the kernel."""
    return _AVAILABLE and dtype == torch.bfloat16 and device.type == "cpu"


def pack(q: torch.Tensor, scales: torch.Tensor) -> PackedInt8:
    """int8 codes [N, K] and per-channel scales [N] in the kernel's layout."""
    n, k = q.shape
    padded = F.pad(q, (0, k % 2, 0, -n % 16))
    codes = padded.reshape(padded.shape[0] // 16, 16, padded.shape[1] // 2, 2).permute(0, 2, 1, 3)
    return PackedInt8(codes.contiguous(), scales.float().contiguous(), n, k)


def matmul(x: torch.Tensor, w: PackedInt8, amx: bool = True) -> torch.Tensor:
    """x [M, K] bf16 (M <= MAX_ROWS) @ (codes * scales)^T -> [M, N] bf16, through AMX tiles
    where the CPU has them and `amx`, else the AVX-512 BF16 loop."""
    lib = native_kernels.LIB
    assert lib is not None
    x = x.contiguous()
    m, k = x.shape
    if k != w.in_features or x.dtype != torch.bfloat16:
        raise ValueError(f"int8 kernel takes bf16 [M, {w.in_features}], got {x.dtype} {tuple(x.shape)}")
    y = torch.empty(m, w.out_features, dtype=torch.bfloat16)
    rc = lib.pd_int8_gemm_bf16(x.data_ptr(), m, k, w.codes.data_ptr(), w.scales.data_ptr(),
                               w.out_features, y.data_ptr(), torch.get_num_threads(), int(amx))
    if rc != 0:
        raise ValueError(f"int8 kernel cannot run {m} x {k} @ {w.out_features} (code {rc})")
    return y


def matmul_rows(x: torch.Tensor, w: PackedInt8) -> torch.Tensor:
    """`matmul` for any number of rows, `MAX_ROWS` at a time."""
    if x.shape[0] <= MAX_ROWS:
        return matmul(x, w)
    return torch.cat([matmul(x[i:i + MAX_ROWS], w) for i in range(0, x.shape[0], MAX_ROWS)])
