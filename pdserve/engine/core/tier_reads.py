"""Prompts parked while their prefix is read from the KV tiers, off the step loop (as
vLLM's scheduler parks a request WAITING_FOR_REMOTE_KVS behind its KV connector).

Life of a parked sequence (`Scheduler` drives it, the engine reads):

1. Admission finds blocks after the pool hit that some tier holds (an existence
   check, `PrefixTiers.present`): it allocates them, parks the sequence
   WAITING_FOR_KV (`park`) and hands the engine a `TierRead`, which the engine starts
   on the tiers' loader thread (pdserve/engine/tier_fill.py). Parking takes no step
   budget: the running sequences step on while the read runs.
2. The read lands (`land`): the leading run of blocks it read and checked becomes the
   sequence's `BlockLoad`; the blocks after the first one that failed (corrupt, gone,
   the tier down, too slow) stay allocated and are recomputed. The sequence returns to
   the front of WAITING, its progress past its pool hit and the landed blocks.
3. Its next admission takes the load (`take_load`) into that step's output: the
   engine copies the bytes into the blocks before the step runs, so the rest of the
   prompt is computed on top of them exactly as on top of a pool hit.
4. Ending it in either state (`forget`: an abort) drops both; its blocks are freed by
   the scheduler as any sequence's are, and a read still running never reaches them.

Bookkeeping only: payloads are opaque here, and nothing reads a tier.
"""

from __future__ import annotations

from typing import NamedTuple

from pdserve.engine.core.sequence import Sequence
from pdserve.engine.tier_api import BlockLoad, TierRead


class LandedRead(NamedTuple):
    """A parked sequence whose read ended: the tokens its pool and its tier blocks cover."""

    seq: Sequence
    pool_tokens: int
    tier_tokens: int

    @property
    def hit_tokens(self) -> int:
        return self.pool_tokens + self.tier_tokens


class _Parked(NamedTuple):
    seq: Sequence
    read: TierRead
    pool_tokens: int


class TierReads:
    """The scheduler's parked sequences (by seq id) and the loads of the landed ones."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._parked: dict[int, _Parked] = {}
        self._landed: dict[int, BlockLoad] = {}

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._parked

    @property
    def seqs(self) -> list[Sequence]:
        """The parked sequences, in the order they were parked."""
        return [p.seq for p in self._parked.values()]

    @property
    def uncomputed_tokens(self) -> int:
        """Tokens the parked sequences still compute once their reads land whole (load)."""
        return sum(
            p.seq.num_tokens - p.pool_tokens - len(p.read.block_ids) * self.block_size
            for p in self._parked.values()
        )

    def park(self, seq: Sequence, read: TierRead, pool_tokens: int) -> None:
        self._parked[seq.seq_id] = _Parked(seq, read, pool_tokens)

    def land(self, seq_id: int, load: BlockLoad) -> LandedRead | None:
        """`load`: the leading blocks of the sequence's read that arrived whole (None: it
        is not parked, e.g. it ended meanwhile)."""
        parked = self._parked.pop(seq_id, None)
        if parked is None:
            return None
        n = len(load.block_ids)
        if load.block_ids != parked.read.block_ids[:n] or load.digests != parked.read.digests[:n]:
            raise ValueError(f"sequence {seq_id}: a tier load for blocks it was not read into")
        if n:
            self._landed[seq_id] = load
        return LandedRead(parked.seq, parked.pool_tokens, n * self.block_size)

    def take_load(self, seq_id: int) -> BlockLoad | None:
        """The landed bytes of a sequence being admitted now (None: it has none)."""
        return self._landed.pop(seq_id, None)

    def forget(self, seq_id: int) -> None:
        self._parked.pop(seq_id, None)
        self._landed.pop(seq_id, None)

    @property
    def num_landed(self) -> int:
        """Sequences holding landed bytes not yet admitted (tests: 0 when idle)."""
        return len(self._landed)
