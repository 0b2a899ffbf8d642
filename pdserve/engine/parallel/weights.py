"""Slicing checkpoint tensors for one tensor-parallel rank.

Column-parallel (output rows split): q/k/v and gate/up, weights and biases.
Row-parallel (input columns split, partial sums all-reduced): o_proj and down_proj;
their biases are added once, so only rank 0 keeps them (the others hold zeros).
Everything else (embedding, norms, q/k norms, LM head) is replicated.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from pdserve.engine.models.llama import WeightSpec
from pdserve.engine.parallel.plan import HeadRange, TPShard

_QKV = ("self_attn.qkv_weight", "self_attn.qkv_bias")
_GATE_UP = ("mlp.gate_up_weight", "mlp.gate_up_bias")
_ROW_BIAS = ("self_attn.o_bias", "mlp.down_bias")

COLUMNS = 0  # axis of a column-parallel split: output channels (weight rows)
ROWS = 1  # axis of a row-parallel split: input channels (weight columns)


class Span(NamedTuple):
    """The part of a source tensor one rank holds: `start:stop` along `axis`."""

    axis: int
    start: int
    stop: int


def shard_span(param: str, index: int, shard: TPShard, head_dim: int) -> Span | None:
    """Which part of source `index` of parameter `param` rank `shard.rank` holds; None
    when the source is replicated (or, for a row-parallel bias, zeroed off rank 0)."""
    if param.endswith(_QKV):
        heads = shard.q_heads if index == 0 else shard.kv_heads
        return Span(COLUMNS, heads.start * head_dim, heads.stop * head_dim)
    if param.endswith(_GATE_UP):
        return Span(COLUMNS, shard.inter.start, shard.inter.stop)
    if param.endswith("self_attn.o_weight"):
        return Span(ROWS, shard.q_heads.start * head_dim, shard.q_heads.stop * head_dim)
    if param.endswith("mlp.down_weight"):
        return Span(ROWS, shard.inter.start, shard.inter.stop)
    return None


def shard_source(param: str, index: int, tensor: torch.Tensor, shard: TPShard,
                 head_dim: int) -> torch.Tensor:
    """Rank `shard.rank`'s part of source `index` of parameter `param` (full `tensor`)."""
    span = shard_span(param, index, shard, head_dim)
    if span is not None:
        return tensor.narrow(span.axis, span.start, span.stop - span.start)
    if param.endswith(_ROW_BIAS) and shard.rank != 0:
        return torch.zeros_like(tensor)
    return tensor


def stage_specs(specs: list[WeightSpec], layers: HeadRange) -> list[WeightSpec]:
    """The specs a pipeline stage loads: its layers (renumbered from 0) and every
    parameter outside the layers (embedding, final norm, LM head: small, kept on all)."""
    out = []
    for spec in specs:
        if not spec.param.startswith("layers."):
            out.append(spec)
            continue
        index, rest = spec.param[len("layers."):].split(".", 1)
        if layers.start <= int(index) < layers.stop:
            out.append(WeightSpec(f"layers.{int(index) - layers.start}.{rest}", spec.sources))
    return out
