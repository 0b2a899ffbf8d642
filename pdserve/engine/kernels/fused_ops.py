"""bf16 CPU fast paths of three model ops, in one native pass each (pdserve/engine/kernels/_cpu_kernels.c).

`add_rms_norm(h, delta, weight, eps, norm)` returns `(h + delta, norm(h + delta))`,
`rope_qk(qkv, ...)` rotates the q and k heads of the fused qkv projection, and
`silu_mul(gate_up, inter)` is the MLP's `silu(gate) * up`, each rounded where Hugging
Face's Llama rounds in bf16 (each bf16 op's result). On CPU bf16 with the library built
they run natively (`add_rms_norm` and `rope_qk` in place); anywhere else (float32
included, so float32 stays bit-identical to HF) they run the torch ops the model always ran.
The native silu has an exp of its own, the same bits on every CPU and in every lane,
so a row's activation never depends on the batch (torch's vectorized and scalar exp can
differ in the last bit).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.engine.kernels import native as native_kernels


def _native(*ts: torch.Tensor) -> bool:
    return native_kernels.LIB is not None and all(
        t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous() for t in ts
    )


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
    norm: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, norm(h + delta)); `norm` is the torch RMSNorm used off the fast path."""
    lib = native_kernels.LIB
    if lib is None or not _native(h, delta, weight) or h.dim() != 2 or delta.shape != h.shape \
            or weight.shape != (h.shape[1],):
        h = h + delta
        return h, norm(h)
    out = torch.empty_like(h)
    lib.pd_add_rms_norm_bf16(h.data_ptr(), delta.data_ptr(), weight.data_ptr(), h.shape[0],
                             h.shape[1], eps, out.data_ptr(), torch.get_num_threads())
    return h, out


def rope_qk(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
    cos: torch.Tensor, signed_sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q [T, H, D] and k [T, KVH, D] of `qkv` [T, (H + 2 KVH) * D], rotated in place
    (`cos`/`signed_sin` as `RopeTables.lookup` gives them, [T, 1, D]); None where the
    fast path does not apply, and the caller rotates with `apply_rope`."""
    t = qkv.shape[0]
    nrot = num_heads + num_kv_heads
    lib = native_kernels.LIB
    if lib is None or not _native(qkv, cos, signed_sin) or qkv.dim() != 2 \
            or cos.shape != (t, 1, head_dim) or signed_sin.shape != cos.shape:
        return None
    lib.pd_rope_bf16(qkv.data_ptr(), t, qkv.shape[1], nrot, head_dim, cos.data_ptr(),
                     signed_sin.data_ptr(), torch.get_num_threads())
    qk = qkv[:, : nrot * head_dim].unflatten(1, (nrot, head_dim))
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    return q, k


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(gate) * up for `gate_up` [T, 2 * inter] (gate first), [T, inter]."""
    lib = native_kernels.LIB
    if lib is None or not _native(gate_up) or gate_up.dim() != 2 or gate_up.shape[1] != 2 * inter:
        gate, up = gate_up.split([inter, inter], dim=-1)
        return F.silu(gate) * up
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype)
    lib.pd_silu_mul_bf16(gate_up.data_ptr(), gate_up.shape[0], inter, gate_up.shape[1], out.data_ptr(),
                         torch.get_num_threads())
    return out
