"""Quantized linears of one tensor-parallel rank.

A weight is quantized whole, exactly as a single process quantizes it, and only then
sliced, so the ranks together hold the single process's codes, scales and zeros and
their partial sums add up to its output (`pdserve.engine.parallel.weights.Span` says which part):

- column-parallel (q/k/v, gate/up: output channels split): a channel's codes go with
  its int8 scale, or its int4 scales and zeros, of every group;
- row-parallel (o_proj, down_proj: input channels split): int8 keeps the whole row's
  per-output-channel scale on every rank; int4 splits along whole groups (a group that
  would straddle two ranks is refused, `pdserve.engine.parallel.plan.check_tp_quant`).

An AWQ/GPTQ checkpoint's parts slice the same way. GPTQ act-order stores input channels
sorted by group (`Int4Parts.perm`); a row-parallel rank takes the stored columns whose
input channel it owns, which must be whole groups, else the checkpoint is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.parallel.plan import TPShard
from pdserve.engine.parallel.weights import COLUMNS, Span, shard_span
from pdserve.engine.quant.formats import INT4_GROUP, QuantizationError
from pdserve.engine.quant.linear import Int8Linear, int4_linear, quantize_weight
from pdserve.engine.quant.pack import Int4Parts, Int8Parts, quantize_int4, quantize_int8


def quantized_linear(param: str, sources: Sequence[torch.Tensor], scheme: str, dtype: torch.dtype,
                     device: torch.device, shard: TPShard | None, head_dim: int) -> nn.Module:
    """The quantized layer of parameter `param` on this rank, from its full float `sources`
    (in the checkpoint's precision) quantized under `scheme` (int8 | int4)."""
    full = [s.to(device) for s in sources]
    if shard is None or shard.size == 1:
        return quantize_weight(full[0] if len(full) == 1 else torch.cat(full), scheme, dtype)
    spans = [shard_span(param, i, shard, head_dim) for i in range(len(full))]
    if scheme == "int8":
        parts8 = [slice_int8(quantize_int8(w), span) for w, span in zip(full, spans, strict=True)]
        cat = Int8Parts(torch.cat([p.q for p in parts8]), torch.cat([p.scales for p in parts8]))
        return Int8Linear(cat, dtype, device)
    if scheme == "int4":
        parts4 = [slice_int4(_quantize_int4(w), span, param) for w, span in zip(full, spans, strict=True)]
        return int4_linear(parts4, dtype, device)
    raise QuantizationError(f"no on-the-fly quantization {scheme!r} under tensor parallel")


def _quantize_int4(w: torch.Tensor) -> Int4Parts:
    """`quantize_weight`'s int4: K zero-padded to whole groups for the scales, codes of
    the real width (the layer pads K itself)."""
    pad_k = -w.shape[1] % INT4_GROUP
    parts = quantize_int4(F.pad(w.float(), (0, pad_k)) if pad_k else w, INT4_GROUP)
    return parts._replace(q=parts.q[:, : w.shape[1]])


def slice_int8(parts: Int8Parts, span: Span | None) -> Int8Parts:
    """The rank's part of a per-output-channel int8 weight."""
    if span is None:
        return parts
    a, b = span.start, span.stop
    if span.axis == COLUMNS:
        return Int8Parts(parts.q[a:b], parts.scales[a:b])
    return Int8Parts(parts.q[:, a:b], parts.scales)  # a row's scale holds for all its inputs


def slice_int4(parts: Int4Parts, span: Span | None, name: str) -> Int4Parts:
    """The rank's part of an int4 weight: output channels with their groups' scales and
    zeros, or whole groups of input channels (QuantizationError when a group straddles)."""
    if span is None:
        return parts
    a, b, g = span.start, span.stop, parts.group
    if span.axis == COLUMNS:
        return parts._replace(q=parts.q[a:b], scales=parts.scales[a:b], zeros=parts.zeros[a:b])
    if a % g or b % g:
        raise QuantizationError(f"{name}: input channels {a}:{b} of this tensor-parallel rank split "
                                f"{g}-channel quantization groups (a group may not straddle two ranks)")
    if parts.perm is None:
        return parts._replace(q=parts.q[:, a:b], scales=parts.scales[:, a // g:b // g],
                              zeros=parts.zeros[:, a // g:b // g])
    return _slice_act_order(parts, a, b, name)


def _slice_act_order(parts: Int4Parts, a: int, b: int, name: str) -> Int4Parts:
    """Stored columns j (group j // g) whose input channel perm[j] lies in a:b, when
    they are whole groups; their channel order becomes the rank's own perm."""
    assert parts.perm is not None
    g = parts.group
    cols = ((parts.perm >= a) & (parts.perm < b)).nonzero().squeeze(1)
    blocks = cols.reshape(-1, g)
    firsts = blocks[:, 0]
    if bool((firsts % g).any()) or not torch.equal(blocks, firsts[:, None] + torch.arange(g)):
        raise QuantizationError(f"{name}: GPTQ act-order (g_idx) groups mix input channels of "
                                "different tensor-parallel ranks; serve this checkpoint with "
                                "tensor_parallel_size 1 or one quantized without desc_act")
    groups = firsts // g
    perm = parts.perm[cols] - a
    local = None if torch.equal(perm, torch.arange(b - a)) else perm
    return Int4Parts(parts.q[:, cols], parts.scales[:, groups], parts.zeros[:, groups], g, local)
