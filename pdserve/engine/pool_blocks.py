"""Whole-block copies in and out of the KV pool: copy-on-write, and the engine's side
of the KV tiers below its pool (kv_transfer/tiers is the store).

The scheduler asks `PrefixTiers.present` which blocks of a new prompt past its pool
hit the tiers hold, allocates them and parks the prompt while the tiers' loader
thread reads them (pdserve/engine/tier_fill.py); the bytes that landed come back in
the step that admits it as `BlockLoad`s: the engine writes them into those blocks
before the step runs (`TierLink.load`), so the rest of the prompt is computed on top
of them exactly as on top of a pool hit. After a step, every block the
prefix cache newly registered is copied out of the pool and offered to the tiers
(`offer_stored`); the copy is the only work the step loop does for a write.

Payloads are one block's raw bytes in the pool's storage order without the block
axis, [layer, K/V, slot, head, dim] (a quantized layout: [layer, K/V, row bytes]).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pdserve.common.block_runs import block_runs
from pdserve.engine.core.block_manager import BlockCopy, BlockManager
from pdserve.engine.runner.kv_pool import KVPool
from pdserve.engine.tier_api import BlockLoad, PrefixTiers

__all__ = ["BlockLoad", "PrefixTiers", "TierLink", "copy_blocks", "offer_stored", "read_blocks",
           "write_loads"]


def copy_blocks(pool: KVPool, copies: Sequence[BlockCopy]) -> None:
    """Copy-on-write: duplicate shared blocks (all layers, K and V) before writing."""
    if not copies:
        return
    kv = pool.kv
    src = torch.tensor([c.src for c in copies], dtype=torch.long, device=kv.device)
    dst = torch.tensor([c.dst for c in copies], dtype=torch.long, device=kv.device)
    kv[:, :, dst] = kv[:, :, src]


def write_loads(pool: KVPool, loads: Sequence[BlockLoad]) -> None:
    """Copy every load's payloads into its pool blocks (all layers, K and V): one strided
    copy per run of consecutive block ids, straight from the tiers' read buffer (on a CPU
    pool ~3x faster than one `index_copy_` of the load, even with every id apart)."""
    kv = pool.kv
    for load in loads:
        n = len(load.block_ids)
        if not n:
            continue
        raw = torch.from_numpy(load.payloads)  # rows may be strided: records with headers
        blocks = raw.view(kv.dtype).view(n, *kv.shape[:2], *kv.shape[3:]).movedim(0, 2)
        for run in block_runs(load.block_ids):
            kv[:, :, run.src:run.src + run.length].copy_(blocks[:, :, run.pos:run.pos + run.length])


def read_blocks(pool: KVPool, block_ids: Sequence[int]) -> list[np.ndarray]:
    """A copy of each block's bytes (uint8, one payload per block)."""
    kv = pool.kv
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv.device)
    blocks = kv[:, :, idx].movedim(2, 0).contiguous().cpu()
    raw = blocks.view(-1).view(torch.uint8).numpy().reshape(len(block_ids), -1)
    return list(raw)


def offer_stored(tiers: PrefixTiers, pool: KVPool, stored: Sequence[tuple[bytes, int]]) -> int:
    """Offer the newly cached blocks `(digest, block id)` to the tiers; how many were
    queued (the rest were dropped by a full queue)."""
    if not stored:
        return 0
    payloads = read_blocks(pool, [b for _, b in stored])
    return sum(tiers.offer(digest, p) for (digest, _), p in zip(stored, payloads, strict=True))


class TierLink:
    """One engine's tie to its tiers: loads into the pool, write-down after each step.

    A block loaded from the tiers is registered in the prefix cache like a computed one,
    but never offered back: `load` remembers its digest until the next `write_down`
    (a load before a step, or a decode reservation's at any time before one)."""

    def __init__(self, tiers: PrefixTiers, pool: KVPool, block_manager: BlockManager) -> None:
        self.tiers = tiers
        self.pool = pool
        block_manager.record_stored()
        assert block_manager.stored is not None
        self._stored = block_manager.stored  # drained here after every step
        self._loaded: set[bytes] = set()

    def load(self, loads: Sequence[BlockLoad]) -> None:
        write_loads(self.pool, loads)
        for load in loads:
            self.tiers.release(load.payloads)  # copied: the tiers may reuse the read buffer
        self._loaded.update(d for load in loads for d in load.digests)

    def write_down(self) -> int:
        """Offer the blocks registered since the last call, except those loaded from the tiers."""
        stored = [s for s in self._stored if s[0] not in self._loaded]
        self._stored.clear()
        self._loaded.clear()
        return offer_stored(self.tiers, self.pool, stored)
