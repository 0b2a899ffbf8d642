"""Quantized weight values and their unpacking from AWQ / GPTQ checkpoint tensors.

Every 4-bit source ends as one `Int4Parts`: unsigned codes 0..15 and, per group of
`group` input channels and per output channel, a scale and an integer zero point:

    w[n, k] = (q[n, k] - zeros[n, k // group]) * scales[n, k // group]

(AWQ's and GPTQ's convention; `linear.Int4Linear` turns it into the kernels'.)
`perm`, when set, is the input-channel order the codes are stored in (GPTQ act-order):
column j of `q` is input channel `perm[j]`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.engine.quant.formats import PrequantConfig, QuantizationError

# AWQ's GEMM packing stores output channels 0, 2, 4, 6, 1, 3, 5, 7 in the nibbles of
# each int32 (lowest nibble first); this reads them back in channel order.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


class Int8Parts(NamedTuple):
    q: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N]


class Int4Parts(NamedTuple):
    q: torch.Tensor  # int32 [N, K], values 0..15
    scales: torch.Tensor  # float32 [N, K // group]
    zeros: torch.Tensor  # float32 [N, K // group], integer-valued
    group: int
    perm: torch.Tensor | None = None  # int64 [K]: stored column j is input channel perm[j]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] in input-channel order."""
        n, k = self.q.shape
        g = self.q.float().reshape(n, k // self.group, self.group)
        w = ((g - self.zeros[..., None]) * self.scales[..., None]).reshape(n, k)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def quantize_int8(w: torch.Tensor) -> Int8Parts:
    """Symmetric int8 with one scale per output channel (row)."""
    wf = w.float()
    scales = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(wf / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Parts(q, scales)


def quantize_int4(w: torch.Tensor, group: int) -> Int4Parts:
    """Asymmetric 4-bit, min/max per group of `group` input channels (K % group == 0)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo = g.amin(dim=-1).clamp(max=0.0)
    hi = g.amax(dim=-1).clamp(min=0.0)  # the range holds 0, so 0 is exact
    scales = ((hi - lo) / 15.0).clamp(min=1e-12)
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = (torch.round(g / scales[..., None]) + zeros[..., None]).clamp(0, 15)
    return Int4Parts(q.reshape(n, k).to(torch.int32), scales, zeros, group)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, C, 8], lowest nibble first."""
    return (packed.to(torch.int32)[..., None] >> _SHIFTS) & 0xF


def awq_parts(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              pq: PrequantConfig) -> Int4Parts:
    """AWQ GEMM tensors (qweight [K, N/8], qzeros [G, N/8], scales [G, N]) as Int4Parts."""
    order = torch.tensor(AWQ_UNPACK_ORDER)
    q = _nibbles(qweight)[..., order].reshape(qweight.shape[0], -1)  # [K, N]
    z = _nibbles(qzeros)[..., order].reshape(qzeros.shape[0], -1)  # [G, N]
    k = q.shape[0]
    return _regroup(Int4Parts(q.t().contiguous(), scales.float().t().contiguous(),
                              z.float().t().contiguous(), k // scales.shape[0]), pq)


def gptq_parts(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor | None, pq: PrequantConfig) -> Int4Parts:
    """GPTQ tensors (qweight [K/8, N] packed along K, qzeros [G, N/8], scales [G, N],
    g_idx [K]) as Int4Parts; act-order channels are sorted into contiguous groups."""
    q = _nibbles(qweight).permute(0, 2, 1).reshape(-1, qweight.shape[1])  # [K, N]
    z = _nibbles(qzeros).reshape(qzeros.shape[0], -1) + pq.zero_offset  # [G, N]
    k, groups = q.shape[0], scales.shape[0]
    group = k // groups
    perm = None
    if g_idx is not None:
        g_idx = g_idx.to(torch.int64)
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise QuantizationError(f"gptq g_idx holds a group outside [0, {groups})")
        contiguous = torch.arange(k) // group
        if not torch.equal(g_idx, contiguous):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], contiguous):
                raise QuantizationError(f"gptq g_idx does not give every group {group} channels")
            q = q[perm]
    parts = Int4Parts(q.t().contiguous(), scales.float().t().contiguous(), z.float().t().contiguous(),
                      group, perm)
    return _regroup(parts, pq)


def _regroup(parts: Int4Parts, pq: PrequantConfig) -> Int4Parts:
    """Repeat each scale/zero over 128-groups when the checkpoint's group is no kernel size."""
    k = parts.q.shape[1]
    if k % parts.group:
        raise QuantizationError(f"{pq.method}: {k} input channels do not split into groups of {parts.group}")
    group = pq.kernel_group(k)
    if group == parts.group:
        return parts
    rep = parts.group // group
    return parts._replace(scales=parts.scales.repeat_interleave(rep, dim=1),
                          zeros=parts.zeros.repeat_interleave(rep, dim=1), group=group)


def pack_awq(q_kn: torch.Tensor) -> torch.Tensor:
    """Codes [K, N] (0..15) into AWQ's int32 [K, N/8] (the inverse of `awq_parts`' unpack)."""
    k, n = q_kn.shape
    cols = q_kn.to(torch.int64).reshape(k, n // 8, 8)[..., list(AWQ_PACK_ORDER)]
    return (cols << _SHIFTS.to(torch.int64)).sum(-1).to(torch.int32)


def pack_gptq_rows(q_kn: torch.Tensor) -> torch.Tensor:
    """Codes [K, N] into GPTQ's int32 [K/8, N], input channels packed lowest nibble first."""
    k, n = q_kn.shape
    rows = q_kn.to(torch.int64).reshape(k // 8, 8, n)
    return (rows << _SHIFTS.to(torch.int64)[:, None]).sum(1).to(torch.int32)


def pack_cols(z_gn: torch.Tensor) -> torch.Tensor:
    """Values [G, N] into int32 [G, N/8] packed along N in order (GPTQ's qzeros)."""
    g, n = z_gn.shape
    cols = z_gn.to(torch.int64).reshape(g, n // 8, 8)
    return (cols << _SHIFTS.to(torch.int64)).sum(-1).to(torch.int32)
