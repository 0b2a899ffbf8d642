"""What the KV tiers below the workers' pools hold, as the router sees them
(kv_transfer/tiers: host shared memory, disk, Redis), and what getting a prefix from
each costs.

A model that needs no new message besides the registration:

1. A worker registers the tiers it is attached to (`RegisterWorker.kv_tiers`). A tier
   is named by its kind, its location and the worker's compatibility hash, and a host
   or disk tier also by the worker's `host_id`: every worker on that host naming the same
   directory (the default host tier, /dev/shm/pdserve-kv-USER, is the same for all of
   them) shares one tier here, as it does on the host; a remote tier is shared by every
   worker naming the same server.
2. A block a worker stores in its pool (its `KvEvents.stored`) is written down to every
   tier it is attached to (pdserve/engine/pool_blocks.py), so it is credited to them all
   then. A pool eviction does not touch a tier: that is what tiers are for.
3. Each tier is bounded here as on the worker: at most the blocks its size holds
   (`KvTierInfo.capacity_blocks`), least recently stored or loaded first out (a load is
   a store again: the loaded block joins the worker's pool). A remote tier's bound is the
   server's own; here it keeps at most MAX_TIER_BLOCKS keys.
4. A tier outlives its workers: a worker that leaves detaches, what the tier holds
   stays known, so a worker that attaches later (a restart, a new worker of the host)
   is credited with it.
5. A prediction that falls short (the worker's `cached_tokens` below the pool hit plus
   the tier hit) removes the blocks past what it got from the worker's tiers
   (`KvRouter.observe`): a dropped write, a tier's own eviction, a corrupt block.

Cost: a prompt's leading blocks come from the worker's own pool (free), then, block by
block, from the first of its tiers that holds it, in the order the worker asks them
(host, disk, remote), until none does; the rest is computed. A block from a tier costs
its tokens times TIER_TOKEN_COST (of one computed token): pool < host < disk < remote
< recompute. On this CPU a host-tier hit of ~1,000 tokens made TTFT 8-13x shorter than
recomputing them, disk and Redis about as much (bench/README.md, bench/kv_tiers.py):
copying a block in costs a few percent of computing it; the ratios only have to order
the tiers and keep a tier hit far cheaper than a recompute, not model the copy exactly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from pdserve.common.protocol import KvTierInfo

TIER_ORDER = ("host", "disk", "remote")  # the order a worker asks its tiers
TIER_TOKEN_COST = {"host": 1 / 32, "disk": 1 / 16, "remote": 1 / 8}
MAX_TIER_BLOCKS = 1 << 20  # keys kept for a tier of unknown bound (remote)


class PrefixReach(NamedTuple):
    """How far a prompt's leading blocks reach on one worker: `pool` in its own pool,
    then `host`, `disk`, `remote` blocks from its tiers (each block from the first tier
    holding it)."""

    pool: int
    host: int = 0
    disk: int = 0
    remote: int = 0

    @property
    def tiered(self) -> int:
        return self.host + self.disk + self.remote

    @property
    def total(self) -> int:
        return self.pool + self.tiered

    def fetch_blocks(self) -> float:
        """What loading the tier blocks costs, in computed blocks."""
        return (self.host * TIER_TOKEN_COST["host"] + self.disk * TIER_TOKEN_COST["disk"]
                + self.remote * TIER_TOKEN_COST["remote"])


TierId = tuple[str, str, str, str]  # kind, host scope ("" for remote), location, compat hash


def tier_id(info: KvTierInfo, host_id: str, compat_hash: str) -> TierId:
    return (info.kind, "" if info.kind == "remote" else host_id, info.location, compat_hash)


class _Tier:
    __slots__ = ("capacity", "keys", "kind")

    def __init__(self, kind: str, capacity: int) -> None:
        self.kind = kind
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()  # least recently stored first

    def store(self, keys: Iterable[int]) -> None:
        for k in keys:
            self.keys[k] = None
            self.keys.move_to_end(k)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)


class TierIndex:
    """Tier -> block keys it holds (bounded LRU); worker -> the tiers it is attached to,
    in lookup order. Plain Python, no I/O (the control plane feeds it)."""

    def __init__(self) -> None:
        self._tiers: dict[TierId, _Tier] = {}
        self._attached: dict[str, list[_Tier]] = {}

    def attach(self, worker_id: str, host_id: str, compat_hash: str, infos: Sequence[KvTierInfo]) -> None:
        """`worker_id` (re)registered with these tiers (replacing what it named before)."""
        tiers = []
        for info in sorted(infos, key=lambda i: TIER_ORDER.index(i.kind) if i.kind in TIER_ORDER else 99):
            if info.kind not in TIER_ORDER:
                continue  # a kind this gateway does not know: not routed by
            capacity = info.capacity_blocks if info.capacity_blocks > 0 else MAX_TIER_BLOCKS
            tier = self._tiers.setdefault(tier_id(info, host_id, compat_hash), _Tier(info.kind, capacity))
            tier.capacity = min(max(tier.capacity, capacity), MAX_TIER_BLOCKS)
            tiers.append(tier)
        if tiers:
            self._attached[worker_id] = tiers
        else:
            self._attached.pop(worker_id, None)

    def detach(self, worker_id: str) -> None:
        """The worker left; what its tiers hold stays (rule 4)."""
        self._attached.pop(worker_id, None)

    def stored(self, worker_id: str, keys: Sequence[int]) -> None:
        """Blocks the worker stored in its pool, hence wrote down (rule 2)."""
        for tier in self._attached.get(worker_id, ()):
            tier.store(keys)

    def discard(self, worker_id: str, keys: Sequence[int]) -> None:
        """Blocks the worker's tiers turned out not to hold (rule 5)."""
        for tier in self._attached.get(worker_id, ()):
            for k in keys:
                tier.keys.pop(k, None)

    def tiers_of(self, worker_id: str) -> list[str]:
        """The kinds of the tiers the worker is attached to, in lookup order."""
        return [t.kind for t in self._attached.get(worker_id, ())]

    def reach(self, worker_id: str, keys: Sequence[int], pool: int) -> PrefixReach:
        """`keys[:pool]` in the worker's pool; how far its tiers carry the prompt on."""
        tiers = self._attached.get(worker_id)
        if not tiers:
            return PrefixReach(pool)
        found = dict.fromkeys(TIER_ORDER, 0)
        for key in keys[pool:]:
            tier = next((t for t in tiers if key in t.keys), None)
            if tier is None:
                break
            found[tier.kind] += 1
        return PrefixReach(pool, found["host"], found["disk"], found["remote"])
