"""One step's LoRA rows: which flat token rows run under which adapter, and the
low-rank update every targeted linear adds to its base output.

The step's adapters are stacked per layer and fused linear (`LoraStack`: their A
matrices concatenated along the rank, their B matrices likewise, each rank column
tagged with the adapter slot that owns it), so one step with rows of several adapters
and of the base model takes two matmuls per linear whatever the mix (Punica's
gathered form, on CPU as one masked GEMM pair):

    out += ((x @ A_all.T) * W) @ B_all.T,   W[t, j] = scale_j if row t's adapter owns column j else 0

A base row's W is all zero, so it gains exactly nothing; a row of adapter k gains
only its own columns (the others multiply by exact zeros). A step with no adapter row
builds no batch at all, so the base path is the plain model.

Row invariance at bf16 (docs/determinism.md): the shrink's column j is one dot product
over the input (its own accumulator in every bf16 kernel, whatever N and j's place in
it), but the expand sums over all R columns, and the kernels sum K in 32-k steps, each
lane of a step in its own accumulator, lanes summed by one fixed tree. So in a bf16
stack each adapter's block starts at a multiple of `ALIGN` and is padded with zero rows
of A and zero columns of B to a multiple of it: a row's own columns then fill the same
lanes of the same k steps whichever adapters share the stack, the other steps add exact
zeros to accumulators that start at +0, and the row's bits are those of its adapter
alone (and the stacked N stays a multiple of 16, so AMX never hands a column to its
AVX-512 tail). float32 (aten's order is not row-invariant anyway) is not padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.lora.checkpoint import GROUPS, FusedDelta, LoraWeights
from pdserve.engine.quant.linear import linear

ALIGN = 32
"""The bf16 kernels' k step (pdserve/engine/kernels/_bf16_gemv.c, _bf16_emul.c, _bf16_amx.c): a bf16
stack's per-adapter block of rank columns starts at, and spans, a multiple of it."""


@dataclass(frozen=True)
class StackedDelta:
    a: torch.Tensor  # [R, in]: every adapter's A rows of this linear, in slot order
    b: torch.Tensor  # [out, R]
    owner: torch.Tensor  # [R] long: the slot of the adapter each rank column belongs to
    rank_scale: torch.Tensor  # [R]


class LoraStack:
    """A set of adapters (slot i = `adapters[i]`) stacked per layer and fused linear;
    built once per distinct set and reused by every step that runs that set."""

    def __init__(self, adapters: Sequence[LoraWeights]) -> None:
        self.fingerprints = tuple(w.fingerprint for w in adapters)
        num_layers = len(adapters[0].layers)
        self.layers: list[dict[str, StackedDelta]] = []
        # Layers whose columns have the same owners and scales share one (owner, scale)
        # pair, so a step builds each row weighting once (`LoraBatch.weights`).
        shared: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        for i in range(num_layers):
            groups = {}
            for g in GROUPS:
                parts = [(slot, _padded(w.layers[i][g])) for slot, w in enumerate(adapters) if g in w.layers[i]]
                if not parts:
                    continue
                owner = torch.cat([torch.full((d.a.shape[0],), s, dtype=torch.long, device=d.a.device)
                                   for s, d in parts])
                scale = torch.cat([d.rank_scale for _, d in parts])
                key = (tuple(owner.tolist()), tuple(scale.tolist()))
                owner, scale = shared.setdefault(key, (owner, scale))
                groups[g] = StackedDelta(torch.cat([d.a for _, d in parts]),
                                         torch.cat([d.b for _, d in parts], dim=1), owner, scale)
            self.layers.append(groups)


def _padded(d: FusedDelta) -> FusedDelta:
    """`d` with its rank padded to a multiple of `ALIGN` (zero A rows, zero B columns,
    zero scales) when it is bf16; as it is otherwise."""
    pad = -d.a.shape[0] % ALIGN if d.a.dtype == torch.bfloat16 else 0
    if not pad:
        return d
    return FusedDelta(torch.cat([d.a, d.a.new_zeros(pad, d.a.shape[1])]),
                      torch.cat([d.b, d.b.new_zeros(d.b.shape[0], pad)], dim=1).contiguous(),
                      torch.cat([d.rank_scale, d.rank_scale.new_zeros(pad)]))


class LoraLayer:
    """The step's rows bound to layer `index`: what a layer's linears call."""

    __slots__ = ("batch", "index")

    def __init__(self, batch: LoraBatch, index: int) -> None:
        self.batch = batch
        self.index = index

    def apply(self, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base output of fused linear `group` on input `x`) plus each row's
        own adapter's update, in place."""
        d = self.batch.stack.layers[self.index].get(group)
        if d is None:
            return out
        out += linear(linear(x, d.a, None) * self.batch.weights(d, x.dtype), d.b, None)
        return out


class LoraBatch:
    """Per-row adapters of one step (flat rows in the runner's order)."""

    def __init__(self, stack: LoraStack, row_slot: torch.Tensor) -> None:
        self.stack = stack
        self.row_slot = row_slot  # [T] long: the row's slot in `stack`, -1 for the base model
        self._weights: dict[int, torch.Tensor] = {}

    def weights(self, d: StackedDelta, dtype: torch.dtype) -> torch.Tensor:
        """W [T, R] of `d`'s columns: the column's scale where the row's adapter owns it,
        else 0 (built once per step for each distinct owner layout)."""
        w = self._weights.get(id(d.owner))
        if w is None:
            w = (self.row_slot[:, None] == d.owner[None, :]).to(dtype) * d.rank_scale
            self._weights[id(d.owner)] = w
        return w

    def layer(self, index: int) -> LoraLayer:
        return LoraLayer(self, index)

    @classmethod
    def build(cls, runs: Sequence[tuple[str, int]], stack: LoraStack, device: torch.device) -> LoraBatch:
        """From (adapter fingerprint or "" for the base, row count) runs in row order."""
        slot = {fp: i for i, fp in enumerate(stack.fingerprints)}
        ids = [slot[fp] if fp else -1 for fp, n in runs for _ in range(n)]
        return cls(stack, torch.tensor(ids, dtype=torch.long, device=device))
