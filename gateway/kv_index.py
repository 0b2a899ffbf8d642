"""Which worker holds which prefix blocks: the gateway's view of every worker's prefix
cache, for KV-aware routing (gateway/kv_router.py).

Fed by the workers' `KvEvents` (pdserve/worker/kv_events.py): a block key
(pdserve/common/block_hash.py) is held by a worker from its *stored* event to its *evicted*
one. Each worker's batches are numbered; the index applies batch `seq + 1` after
`seq` and nothing else:

1. A worker registers: its entries are dropped and the index waits for the snapshot
   the worker sends right after registering (`snapshot=True` replaces its entries
   and sets its number).
2. A batch with the next number is applied; a batch whose number is not the next
   one is a gap (a lost or reordered message): the worker's entries are kept (stale
   beats empty for routing) and `apply` says to ask for a snapshot, again every
   `resend_s` until one arrives; batches meanwhile are ignored.
3. A worker that leaves (expired, deregistered, restarted under a new id) is dropped.

What the workers' KV tiers hold is kept beside it (`tiers`, gateway/kv_tiers.py): every
stored key a registered worker reports, in order or not, is credited to its tiers too.

The index also self-corrects from what workers report back: `cached_tokens` below
the prediction removes the blocks the worker no longer has, above it adds the ones it
has (`KvRouter.observe`). Several gateways keep their own index from the same
broadcast; they never talk to each other. Plain Python, no I/O; the control plane
owns the clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gateway.kv_tiers import TierIndex
from pdserve.common.protocol import KvEvents


@dataclass
class _WorkerBlocks:
    keys: set[int] = field(default_factory=set)
    seq: int | None = None  # None: waiting for a snapshot
    asked_at: float = float("-inf")  # last snapshot request


class KvIndex:
    """Block key -> workers holding it, and the reverse, with per-worker batch numbers."""

    def __init__(self, resend_s: float = 1.0) -> None:
        self.resend_s = resend_s
        self._holders: dict[int, set[str]] = {}
        self._workers: dict[str, _WorkerBlocks] = {}
        self.tiers = TierIndex()  # the control plane attaches each worker's tiers

    # --- membership ----------------------------------------------------------

    def reset_worker(self, worker_id: str, now: float) -> None:
        """`worker_id` (re)registered: forget it and wait for its snapshot (already on
        its way, so it is not asked for before `resend_s`)."""
        self.drop_worker(worker_id)
        self._workers[worker_id] = _WorkerBlocks(asked_at=now)

    def drop_worker(self, worker_id: str) -> None:
        self.tiers.detach(worker_id)
        w = self._workers.pop(worker_id, None)
        if w is not None:
            self._discard(worker_id, w.keys)

    # --- events --------------------------------------------------------------

    def apply(self, ev: KvEvents, now: float) -> bool:
        """Apply one batch from a registered worker; True: ask it for a snapshot now."""
        w = self._workers.get(ev.worker_id)
        if w is None:
            return False  # not registered here: its registration brings a snapshot
        self.tiers.stored(ev.worker_id, ev.stored)  # written down, whatever the batch's order
        if ev.snapshot:
            self._discard(ev.worker_id, w.keys - set(ev.stored))
            self._add(ev.worker_id, ev.stored)
            w.seq = ev.seq
            return False
        if w.seq is not None and ev.seq == w.seq + 1:
            self._discard(ev.worker_id, ev.evicted)
            self._add(ev.worker_id, ev.stored)
            w.seq = ev.seq
            return False
        if w.seq is not None and ev.seq <= w.seq:
            return False  # already contained in a snapshot
        w.seq = None
        if now - w.asked_at < self.resend_s:
            return False
        w.asked_at = now
        return True

    def add(self, worker_id: str, keys: Iterable[int]) -> None:
        """Keys a worker reported holding (its `cached_tokens` covered them)."""
        if worker_id in self._workers:
            self._add(worker_id, keys)

    def remove(self, worker_id: str, keys: Iterable[int]) -> None:
        """Keys a worker turned out not to hold (its `cached_tokens` fell short)."""
        if worker_id in self._workers:
            self._discard(worker_id, keys)

    # --- queries -------------------------------------------------------------

    def overlaps(self, keys: Sequence[int], workers: Iterable[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of `keys` it holds (a chained key
        names its whole prefix, so the count stops at the first miss)."""
        matched = {w: 0 for w in workers}
        alive = set(matched)
        for i, key in enumerate(keys):
            alive &= self._holders.get(key, set())
            if not alive:
                break
            for w in alive:
                matched[w] = i + 1
        return matched

    def num_blocks(self, worker_id: str) -> int:
        w = self._workers.get(worker_id)
        return len(w.keys) if w else 0

    def waiting_snapshot(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.seq is None

    def holds(self, worker_id: str, key: int) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and key in w.keys

    # --- internals -----------------------------------------------------------

    def _add(self, worker_id: str, keys: Iterable[int]) -> None:
        mine = self._workers[worker_id].keys
        for k in keys:
            if k not in mine:
                mine.add(k)
                self._holders.setdefault(k, set()).add(worker_id)

    def _discard(self, worker_id: str, keys: Iterable[int]) -> None:
        mine = self._workers[worker_id].keys if worker_id in self._workers else set()
        for k in list(keys):
            mine.discard(k)
            holders = self._holders.get(k)
            if holders is not None:
                holders.discard(worker_id)
                if not holders:
                    del self._holders[k]
