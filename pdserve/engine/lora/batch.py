"""One step's LoRA rows: which flat token rows run under which adapter, and the
segmented low-rank update every targeted linear adds to its base output.

Rows are grouped by adapter once per step (S-LoRA / Punica's segmented form); in every
layer each group's rows take `x @ A.T @ B.T * scale` and add it to the base linear's
output for those rows only. Base-model rows take nothing, and a step with no adapter
row builds no batch at all, so the base path is the plain model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.lora.checkpoint import FusedDelta, LoraWeights


@dataclass(frozen=True)
class LoraSegment:
    """The rows of one adapter: a contiguous run `rows` (a slice) or a gather index."""

    weights: LoraWeights
    rows: slice | torch.Tensor


class LoraLayer:
    """The segments of one step, bound to layer `index`: what a layer's linears call."""

    __slots__ = ("index", "segments")

    def __init__(self, segments: Sequence[LoraSegment], index: int) -> None:
        self.segments = segments
        self.index = index

    def apply(self, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base output of fused linear `group` on input `x`) plus each
        segment's update on its own rows, in place."""
        for seg in self.segments:
            d = seg.weights.layers[self.index].get(group)
            if d is None:
                continue
            if isinstance(seg.rows, slice):
                out[seg.rows] += _delta(d, x[seg.rows])
            else:
                out.index_add_(0, seg.rows, _delta(d, x.index_select(0, seg.rows)))
        return out


def _delta(d: FusedDelta, x: torch.Tensor) -> torch.Tensor:
    # The op order of PEFT's Linear: lora_B(lora_A(x)) * scaling.
    return F.linear(F.linear(x, d.a), d.b) * d.scale


class LoraBatch:
    """Per-row adapters of one step (flat rows in the runner's order)."""

    def __init__(self, segments: Sequence[LoraSegment]) -> None:
        self.segments = tuple(segments)

    def layer(self, index: int) -> LoraLayer:
        return LoraLayer(self.segments, index)

    @classmethod
    def build(cls, row_ids: Sequence[tuple[str, int]], adapters: dict[str, LoraWeights],
              device: torch.device) -> LoraBatch | None:
        """From (adapter fingerprint, row count) runs in row order ("" = the base model);
        None when no row runs under an adapter."""
        runs: dict[str, list[tuple[int, int]]] = {}
        at = 0
        for fp, n in row_ids:
            if fp:
                runs.setdefault(fp, []).append((at, at + n))
            at += n
        if not runs:
            return None
        segments = []
        for fp, spans in runs.items():
            merged = _merge(spans)
            rows: slice | torch.Tensor
            if len(merged) == 1:
                rows = slice(*merged[0])
            else:
                rows = torch.cat([torch.arange(s, e) for s, e in merged]).to(device)
            segments.append(LoraSegment(adapters[fp], rows))
        return cls(segments)


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = [spans[0]]
    for s, e in spans[1:]:
        if s == out[-1][1]:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out
