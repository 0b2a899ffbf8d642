"""Quantized linear layers over torch's own int8/int4 matmul kernels, and the hook the
model calls (`linear`) so a layer's weight may be a float tensor or one of these.

CPU: `torch._weight_int8pack_mm` (int8 weight [N, K], per-row scales) and
`torch._weight_int4pack_mm_for_cpu` over `_convert_weight_to_int4pack_for_cpu`; both
take float32, float16 and bfloat16 activations and return that dtype. CUDA: int4 through
`_weight_int4pack_mm` (bfloat16 only, so other activations are cast), int8 as an int8
weight converted per call and the scales applied to the output.

The int4 kernels need N % 16 == 0 and K % group == 0: weights are padded with zero
rows (outputs sliced off) and zero columns (activations zero-padded to match).

The aten CPU kernels are small-M kernels (AVX-512, no AMX): measured on this host
(1 thread, 768-4096 x 768-2048 layers) they take ~0.3x the bf16 matmul's time at one
row but 2.5-3x at 16 rows and 3-27x at 128. A bf16 int8 layer on a CPU with AVX-512
BF16 therefore holds its codes only in the native kernel's layout and runs it for every
call, all rows at once (pdserve/engine/quant/int8_kernel.py: integer dot products over rows in 15-bit
fixed point up to 4 rows, AMX tiles over int8 codes widened to bf16 above, chunk by chunk as
they stream in up to 16; `python -m bench.int8_gemm` times each against the bf16 matmul). Otherwise (float32, no AVX-512 BF16) an int8 layer given more
than `INT8_KERNEL_ROWS` rows converts its weight to the compute dtype for that call and
runs the ordinary matmul, scaling the output per channel (exact: x @ (q s)^T =
(x @ q^T) s). An int4 layer on CPU given 1 to `INT4_KERNEL_ROWS` (4) bf16 rows (decode) runs
the native int4 GEMV (pdserve/engine/kernels/_int4_gemv.c: integer dot products over the packed codes and
rows in 15-bit fixed point); given more, on a CPU with AMX, it runs
the native int4 GEMM (pdserve/engine/quant/int4_kernel.py, pdserve/engine/kernels/_int4_gemm.c) over the same packed
codes the aten kernel reads: per 64 output channels it widens the codes to bf16 once per call
into AMX B tiles that stay in cache and multiplies every row against them, so no dense weight
is written or read (prefill about as fast as bf16's, batched decode faster;
`python -m bench.int4_gemm` per layer, `python -m bench.quant` end to end). Without AMX, 5 to
`INT4_VNNI_ROWS` (384) rows run the GEMV's arithmetic in register tiles
(pdserve/engine/kernels/_int4_tiles.c: each row the bits it has in the GEMV). Otherwise
(float32 activations, no native kernel for the rows) a layer given more than `INT4_DEQUANT_ROWS`
(32) rows unpacks its codes into a dense weight of the compute dtype (`pd_int4_dequant`,
pdserve/engine/kernels/_cpu_kernels.c) and runs the ordinary matmul; without the library it stays on the aten
kernel. pdserve/engine/kernels/table.py holds these routes. CPU int4 weights are padded to
N % 64 == 0, the block the packed layout is uniform over.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.kernels import bf16_gemv
from pdserve.engine.kernels import native as native_kernels
from pdserve.engine.kernels import table as kernel_table
from pdserve.engine.kernels.native import DTYPE_CODES
from pdserve.engine.quant import int4_kernel, int8_kernel
from pdserve.engine.quant.formats import INT4_GROUP, ON_THE_FLY, QuantizationError
from pdserve.engine.quant.pack import Int4Parts, Int8Parts, quantize_int4, quantize_int8

_N_ALIGN = 16
_N_ALIGN_CPU = 64
INT8_KERNEL_ROWS = kernel_table.BY_NAME["int8_aten"].max_rows
INT4_KERNEL_ROWS = kernel_table.BY_NAME["int4_gemv"].max_rows  # the native GEMV up to here; a native GEMM above
INT4_DEQUANT_ROWS = kernel_table.BY_NAME["int4_dequant"].min_rows - 1  # without it: aten up to here, then unpack


class Int8Linear(nn.Module):
    q: torch.Tensor | None  # int8 [N, K]; None where the native kernel holds the codes
    scales: torch.Tensor  # [N], the compute dtype

    def __init__(self, parts: Int8Parts, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.out_features, self.in_features = parts.q.shape
        self.register_buffer("scales", parts.scales.to(device=device, dtype=dtype))
        # A bf16 layer on a CPU the native kernel runs on keeps its codes only in the
        # kernel's layout (once: int8 stays 1 byte a weight), and every call runs it.
        self.native: int8_kernel.PackedInt8 | None = None
        if int8_kernel.packs_for(dtype, device):
            self.native = int8_kernel.pack(parts.q, self.scales)
            self.register_buffer("q", None)
            # the kernel per row bucket, chosen once (pdserve/engine/kernels/table.py): its C path code
            self.plan = kernel_table.plan(kernel_table.LinearSpec("int8", "bfloat16", "cpu", *parts.q.shape[::-1]))
        else:
            self.register_buffer("q", parts.q.to(device).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.dtype == torch.bfloat16 and x.dim() == 2:
            # decode's call: no reshapes or casts (us each)
            return int8_kernel.matmul(x, self.native, self.plan.kernel_for(x.shape[0]).path)
        x2 = x.reshape(-1, self.in_features)
        if self.native is not None:
            y = int8_kernel.matmul(x2.to(torch.bfloat16), self.native,
                                   self.plan.kernel_for(x2.shape[0]).path).to(x2.dtype)
        else:
            assert self.q is not None
            if x2.device.type == "cpu" and x2.shape[0] <= INT8_KERNEL_ROWS:
                y = torch._weight_int8pack_mm(x2.contiguous(), self.q, self.scales)
            else:
                y = F.linear(x2, self.q.to(x2.dtype)) * self.scales
        return y.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    packed: torch.Tensor  # the kernel's packed codes
    scales_and_zeros: torch.Tensor  # [K / group, N, 2]: scale, offset
    perm: torch.Tensor | None  # input-channel order of the codes (GPTQ act-order)

    def __init__(self, parts: Int4Parts, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        n, k = parts.q.shape
        self.out_features, self.in_features, self.group = n, k, parts.group
        q, scales, zeros = parts.q, parts.scales, parts.zeros
        self.on_cuda = device.type == "cuda"
        pad_n = -n % (_N_ALIGN if self.on_cuda else _N_ALIGN_CPU)
        self.pad_k = -k % parts.group
        if pad_n or self.pad_k:  # padded weights are 0 (q = zero, any scale)
            q = F.pad(q, (0, self.pad_k, 0, pad_n))
            scales = F.pad(scales, (0, 0, 0, pad_n))
            zeros = F.pad(zeros, (0, 0, 0, pad_n))
        # Kernel form: w = (q - 8) * scale + offset, so offset = (8 - zero) * scale.
        sz = torch.stack([scales, (8.0 - zeros) * scales], dim=-1).transpose(0, 1).contiguous()
        kernel_dtype = torch.bfloat16 if self.on_cuda else dtype
        self.register_buffer("scales_and_zeros", sz.to(device=device, dtype=kernel_dtype))
        self.register_buffer("packed", _pack_int4(q.to(device), self.on_cuda))
        self.register_buffer("perm", None if parts.perm is None else parts.perm.to(device))
        self._plans: dict[torch.dtype, kernel_table.Plan] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if self.pad_k:
            x2 = F.pad(x2, (0, self.pad_k))
        if self.on_cuda:
            y = torch._weight_int4pack_mm(x2.to(torch.bfloat16).contiguous(), self.packed, self.group,
                                          self.scales_and_zeros).to(x.dtype)
        else:
            y = self._cpu(x2)
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features]
        return y.reshape(*x.shape[:-1], self.out_features)

    def plan(self, dtype: torch.dtype) -> kernel_table.Plan:
        """This layer's CPU routes for `dtype` activations (pdserve/engine/kernels/table.py), chosen
        once per activation dtype, at its first call in that dtype."""
        got = self._plans.get(dtype)
        if got is None:
            spec = kernel_table.LinearSpec("int4", str(dtype).removeprefix("torch."), "cpu",
                                           self.in_features + self.pad_k, self.scales_and_zeros.shape[1],
                                           self.group)
            got = self._plans[dtype] = kernel_table.plan(spec)
        return got

    def _cpu(self, x2: torch.Tensor) -> torch.Tensor:
        name = self.plan(x2.dtype).kernel_for(x2.shape[0]).name
        if name == "int4_gemv":
            return int4_kernel.gemv(x2, self.packed, self.scales_and_zeros, self.group)
        if name == "int4_gemm_amx":
            return int4_kernel.matmul(x2, self.packed, self.scales_and_zeros, self.group)
        if name == "int4_gemm_vnni":
            return int4_kernel.tiles(x2, self.packed, self.scales_and_zeros, self.group)
        if name == "int4_dequant":
            return F.linear(x2, self.dense_weight(x2.dtype))
        return torch._weight_int4pack_mm_for_cpu(x2.contiguous(), self.packed, self.group, self.scales_and_zeros)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The CPU-packed codes as a dense [N_padded, K_padded] weight of `dtype`
        (float32 or bfloat16), through the native kernel."""
        lib = native_kernels.LIB
        assert lib is not None and not self.on_cuda
        sz = self.scales_and_zeros
        n = sz.shape[1]
        out = torch.empty(n, self.in_features + self.pad_k, dtype=dtype)
        rc = lib.pd_int4_dequant(self.packed.data_ptr(), sz.data_ptr(), DTYPE_CODES[sz.dtype], n,
                                 out.shape[1], self.group, DTYPE_CODES[dtype], out.data_ptr(),
                                 torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"int4 weight of shape {tuple(out.shape)} cannot be unpacked (code {rc})")
        return out


def _pack_int4(q: torch.Tensor, cuda: bool) -> torch.Tensor:
    if not cuda:
        return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    k = q.shape[1]
    tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
    u8 = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
    return torch._convert_weight_to_int4pack(u8, tiles)


class ConcatLinear(nn.Module):
    """Fused projections whose parts cannot share one kernel call (GPTQ act-order parts
    with different channel orders): each part runs on its own, outputs concatenated."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def linear(x: torch.Tensor, weight: torch.Tensor | nn.Module, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear` for a float weight (bf16 decode rows on CPU: the native GEMV,
    pdserve/engine/kernels/bf16_gemv.py); the quantized layer's own matmul otherwise."""
    if isinstance(weight, torch.Tensor):
        return bf16_gemv.linear(x, weight, bias)
    y = weight(x)
    return y if bias is None else y + bias


def int4_linear(parts: Sequence[Int4Parts], dtype: torch.dtype, device: torch.device) -> nn.Module:
    """One Int4Linear over parts concatenated along N (same group and channel order),
    else a ConcatLinear of one per part."""
    first = parts[0]
    same = all(p.group == first.group and _same_perm(p.perm, first.perm) for p in parts)
    if same:
        cat = Int4Parts(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                        torch.cat([p.zeros for p in parts]), first.group, first.perm)
        return Int4Linear(cat, dtype, device)
    return ConcatLinear([Int4Linear(p, dtype, device) for p in parts])


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a, b)


def quantize_weight(w: torch.Tensor, scheme: str, dtype: torch.dtype | None = None) -> nn.Module:
    """A float weight [N, K] as an Int8Linear or Int4Linear on its device, computing in
    `dtype` (default: the weight's). Scales come from `w` as given (the checkpoint's
    precision), not from a copy rounded to `dtype` first."""
    dtype = dtype or w.dtype
    if scheme == "int8":
        return Int8Linear(quantize_int8(w), dtype, w.device)
    if scheme == "int4":
        pad_k = -w.shape[1] % INT4_GROUP
        padded = F.pad(w.float(), (0, pad_k)) if pad_k else w
        parts = quantize_int4(padded, INT4_GROUP)
        # The kernel pads K itself: hand it the real width.
        return Int4Linear(parts._replace(q=parts.q[:, : w.shape[1]]), dtype, w.device)
    raise QuantizationError(f"no on-the-fly quantization {scheme!r} (choose {', '.join(ON_THE_FLY)})")


def set_weight(model: nn.Module, name: str, value: nn.Module) -> None:
    """Replace parameter `name` (dotted path) of `model` by the quantized layer `value`."""
    owner_path, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_path)
    delattr(owner, attr)
    setattr(owner, attr, value)

