"""How a worker's ranks split the KV pool: tensor-parallel size, pipeline stages and
the KV heads and layers being split. The KV handshake carries it (kv_transfer.wire
`Hello.parallel`) so a receiver refuses, with a reason naming both sides, a pair it
cannot map.

On CPU every group keeps its pool in the full layout (pdserve.engine.parallel.shared_pool),
so any two valid layouts of the same model map onto each other: each decode rank's
(layer, head) slices are where the prefill ranks wrote them. What cannot map is a
side whose split is not one of the model (a TP size that does not divide the KV heads
nor is divided by them, more stages than layers) or two sides that disagree on the
heads or layers being split.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.kv_layout import KVLayout


class LayoutPairError(ValueError):
    """Two workers' parallel layouts that KV cannot be handed between."""


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    num_kv_heads: int
    num_layers: int

    @classmethod
    def of(cls, tp: int, pp: int, kv: KVLayout) -> ParallelLayout:
        """A worker's layout: its group's sizes over its pool's heads and layers."""
        return cls(tp, pp, kv.num_kv_heads, kv.num_layers)

    def encode(self) -> tuple[int, int, int, int]:
        return (self.tp, self.pp, self.num_kv_heads, self.num_layers)

    @classmethod
    def decode(cls, fields: tuple[int, ...]) -> ParallelLayout:
        if len(fields) != 4:
            raise LayoutPairError(f"a parallel layout has 4 fields, got {len(fields)}")
        return cls(*fields)

    def __str__(self) -> str:
        return f"TP {self.tp} x PP {self.pp} over {self.num_kv_heads} KV heads, {self.num_layers} layers"


def check_layout(side: str, layout: ParallelLayout) -> None:
    """Raise LayoutPairError unless `layout` is a split of its own heads and layers."""
    tp, kvh = layout.tp, layout.num_kv_heads
    if tp < 1 or layout.pp < 1 or kvh < 1 or layout.num_layers < 1:
        raise LayoutPairError(f"{side} layout {layout} has a size below 1")
    if kvh % tp and tp % kvh:
        raise LayoutPairError(f"{side} TP {tp} and its {kvh} KV heads do not divide one another")
    if layout.pp > layout.num_layers:
        raise LayoutPairError(f"{side} PP {layout.pp} exceeds its {layout.num_layers} layers")


def check_pair(sender: ParallelLayout, receiver: ParallelLayout) -> None:
    """Raise LayoutPairError, naming both layouts, unless KV written under `sender`'s
    split can be read under `receiver`'s."""
    try:
        check_layout("sender", sender)
        check_layout("receiver", receiver)
        if sender.num_kv_heads != receiver.num_kv_heads:
            raise LayoutPairError("the sides split different KV head counts")
        if sender.num_layers != receiver.num_layers:
            raise LayoutPairError("the sides split different layer counts")
    except LayoutPairError as e:
        raise LayoutPairError(f"cannot map KV layouts (sender {sender}; receiver {receiver}): {e}") from None
