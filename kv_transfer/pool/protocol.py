"""What the transfer layer does to a pool in place: the one interface that host, staged
and device pools implement (kv_transfer/pool/ops.py picks the implementation)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


class PoolOps(Protocol):
    array: Any
    on_device: bool

    def row_sums(self, l0: int, l1: int, ids: Sequence[int]) -> np.ndarray:
        """Host array of per-row uint64 sums of layers [l0, l1) of `ids`, in frame row order."""
        ...

    def copy_to(self, dst: PoolOps, l0: int, l1: int, src_ids: Sequence[int],
                dst_ids: Sequence[int]) -> np.ndarray:
        """Copy blocks into another pool of the same kind (complete when this returns);
        returns the source's `row_sums` of those blocks."""
        ...

    def flip_byte(self, layer: int, block: int) -> None:
        """Fault injection: corrupt one byte of a block."""
        ...
