"""Causal attention of a prefill chunk that continues a cached context, with no mask.

A chunk's n queries sit at positions [start, start + n) of a ctx = start + n context:
row i attends to keys [0, start + i]. As a dense [n, ctx] mask with grouped-query heads,
SDPA falls back to its math backend (heads repeated, full score matrices in memory). The
same result in two fused calls instead:

    prefix keys [0, start):   every row sees all of them   -> (out_p, lse_p), no mask
    chunk keys [start, ctx):  a square causal pattern      -> (out_c, lse_c), is_causal
    out = out_p * exp(lse_p - lse) + out_c * exp(lse_c - lse),  lse = logaddexp(lse_p, lse_c)

The per-part log-sum-exp comes from the flash kernels behind SDPA (CPU: grouped-query
heads native; CUDA: half precision, K/V heads repeated). Where neither applies (float32 on
CUDA), a boolean mask is built on the device: correct, not fast.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

LseAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool],
                        tuple[torch.Tensor, torch.Tensor]]


def chunk_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [1, H, n, D] at positions [start, start + n); k, v [1, KVH, start + n, D] -> [1, H, n, D]."""
    if start == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    attend = lse_attention(q)
    if attend is None:
        return dense_fallback(q, k, v, start)
    out_p, lse_p = attend(q, k[:, :, :start], v[:, :, :start], False)
    out_c, lse_c = attend(q, k[:, :, start:], v[:, :, start:], True)
    lse = torch.logaddexp(lse_p, lse_c)
    w_p = torch.exp(lse_p - lse).unsqueeze(-1)
    w_c = torch.exp(lse_c - lse).unsqueeze(-1)
    return (out_p.float() * w_p + out_c.float() * w_c).to(q.dtype)


def lse_attention(q: torch.Tensor) -> LseAttention | None:
    """A fused attention returning (out, logsumexp [1, H, n] float32) for q's device and
    dtype; None where there is none."""
    aten = torch.ops.aten
    if q.device.type == "cpu" and hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return _cpu_flash
    flash_dims = q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and flash_dims:
        return _cuda_flash
    return None


def _cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[:2]
    return out, lse.float()


def _cuda_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[1] // k.shape[1]
    if group > 1:  # the aten op wants as many K/V heads as query heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[:2]
    return out, lse.float()


def dense_fallback(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """The lower-right causal pattern as a boolean mask built on the device."""
    n, ctx = q.shape[2], k.shape[2]
    rows = torch.arange(start, start + n, device=q.device)[:, None]
    allowed = torch.arange(ctx, device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
