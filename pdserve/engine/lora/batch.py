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
it). The expand runs the native kernel pdserve/engine/kernels/_lora_expand.c: each row over
its own adapter's columns only, in their order, so its bits are those of its adapter
alone whichever adapters share the step, and it skips the other adapters' zeros (the
masked expand spent most of a step's LoRA time on them). On AMX each adapter's block is
padded to 32 columns, so the shrink's N stays a multiple of 16 (no column falls to the
AVX-512 tail). Without the kernel the expand is the masked GEMM through the bf16 linear,
which sums K in 32-k steps, column c into lane (c mod 32) / 2, lanes by one fixed tree:
there blocks are aligned to 4 columns (2 lanes: the tree's additions only swap operands,
and others' lanes add exact zeros). float32 (aten's order is not row-invariant anyway)
is neither padded nor run by the kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.kernels import bf16_gemv, lora_expand
from pdserve.engine.lora.checkpoint import GROUPS, FusedDelta, LoraWeights
from pdserve.engine.quant.linear import linear

MAX_ALIGN = 32
"""The most `stack_align` pads to (AMX: the k step of pdserve/engine/kernels/_bf16_amx.c)."""


def native_expand(dtype: torch.dtype) -> bool:
    """Whether a stack of `dtype` runs its expand on pdserve/engine/kernels/_lora_expand.c."""
    return dtype == torch.bfloat16 and bf16_gemv.enabled() and lora_expand.available()


def stack_align(dtype: torch.dtype) -> int:
    """What each adapter's block of rank columns in a stack of `dtype` starts at and spans
    a multiple of (module docstring): 1 where no row-invariant kernel runs it."""
    if dtype != torch.bfloat16 or not bf16_gemv.enabled():
        return 1
    if bf16_gemv.kernel() == "bf16_amx":
        return MAX_ALIGN
    return 1 if lora_expand.available() else 4


@dataclass(frozen=True)
class StackedDelta:
    a: torch.Tensor  # [R, in]: every adapter's A rows of this linear, in slot order
    b: torch.Tensor  # [out, R]
    owner: torch.Tensor  # [R] long: the slot of the adapter each rank column belongs to
    rank_scale: torch.Tensor  # [R]
    bt: torch.Tensor | None = None  # [R, out] contiguous (`b` is its view) where the native expand runs


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
                a = torch.cat([d.a for _, d in parts])
                if native_expand(a.dtype):
                    bt = torch.cat([d.b.t() for _, d in parts]).contiguous()
                    groups[g] = StackedDelta(a, bt.t(), owner, scale, bt)
                else:
                    groups[g] = StackedDelta(a, torch.cat([d.b for _, d in parts], dim=1), owner, scale)
            self.layers.append(groups)


def _padded(d: FusedDelta) -> FusedDelta:
    """`d` with its rank padded to a multiple of `stack_align` (zero A rows, zero B
    columns, zero scales)."""
    pad = -d.a.shape[0] % stack_align(d.a.dtype)
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
        h = linear(x, d.a, None) * self.batch.weights(d, x.dtype)
        if d.bt is not None and x.dim() == 2 and out.is_contiguous() and out.dtype == d.bt.dtype:
            lo, hi = self.batch.ranges(d)
            lora_expand.expand(h, d.bt, lo, hi, out)
        else:
            out += linear(h, d.b, None)
        return out


class LoraBatch:
    """Per-row adapters of one step (flat rows in the runner's order)."""

    def __init__(self, stack: LoraStack, row_slot: torch.Tensor) -> None:
        self.stack = stack
        self.row_slot = row_slot  # [T] long: the row's slot in `stack`, -1 for the base model
        self._weights: dict[int, torch.Tensor] = {}
        self._ranges: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def weights(self, d: StackedDelta, dtype: torch.dtype) -> torch.Tensor:
        """W [T, R] of `d`'s columns: the column's scale where the row's adapter owns it,
        else 0 (built once per step for each distinct owner layout)."""
        w = self._weights.get(id(d.owner))
        if w is None:
            w = (self.row_slot[:, None] == d.owner[None, :]).to(dtype) * d.rank_scale
            self._weights[id(d.owner)] = w
        return w

    def ranges(self, d: StackedDelta) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's columns [lo, hi) of `d` (int32 [T] each; lo == hi for a base row or an
        adapter without this linear), built once per step for each owner layout."""
        got = self._ranges.get(id(d.owner))
        if got is None:
            bounds = [(0, 0)] * (len(self.stack.fingerprints) + 1)  # index slot + 1: 0 is the base
            owner = d.owner.tolist()
            for j, s in enumerate(owner):
                lo = bounds[s + 1][0] if bounds[s + 1] != (0, 0) else j
                bounds[s + 1] = (lo, j + 1)
            table = torch.tensor(bounds, dtype=torch.int32)[self.row_slot + 1]
            got = (table[:, 0].contiguous(), table[:, 1].contiguous())
            self._ranges[id(d.owner)] = got
        return got

    def layer(self, index: int) -> LoraLayer:
        return LoraLayer(self, index)

    @classmethod
    def build(cls, runs: Sequence[tuple[str, int]], stack: LoraStack, device: torch.device) -> LoraBatch:
        """From (adapter fingerprint or "" for the base, row count) runs in row order."""
        slot = {fp: i for i, fp in enumerate(stack.fingerprints)}
        ids = [slot[fp] if fp else -1 for fp, n in runs for _ in range(n)]
        return cls(stack, torch.tensor(ids, dtype=torch.long, device=device))
