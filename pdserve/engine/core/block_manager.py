"""Torch-free KV block bookkeeping: which physical block holds which tokens of whom.

Block ids are bookkeeping; the model runner owns the tensors. Only block ids
(block tables and (src, dst) copy pairs) leave this module.

Invariants (checked by `integrity_errors()`):
- block 0 is the null block: never free, never owned, never cached;
- every other block is either free or owned, never both;
- a block's reference count equals the number of owner tables that hold it;
- every cached (hashed) block is registered under its own hash, and every free
  block that still carries a hash sits in the LRU of free cached blocks.

Prefix caching: a FULL, computed block is registered under
`SHA-256(parent block digest || token ids of the block as little-endian int64)`,
the first block's parent being the fixed `ROOT_DIGEST`. The key therefore names
the whole prefix, not just the block: two prompts share block i only if they
agree on every token up to the end of block i (short of a SHA-256 collision),
and a hit on block i implies hits on blocks 0..i-1. Free blocks that still
carry a hash are kept in an LRU and reused by a later prompt with the same
prefix, or evicted (oldest first) when fresh blocks run out. The hash lives in
`pdserve/common/block_hash.py`, so the gateway's KV index computes the very same chain;
with `record_events()` every registration and eviction is recorded for it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.common.block_hash import ROOT_DIGEST, block_hash, block_key
from pdserve.common.kv_layout import NULL_BLOCK
from pdserve.engine.core.block_events import BlockEventLog

__all__ = ["ROOT_DIGEST", "BlockManager", "block_hash"]


class PrefixHit(NamedTuple):
    """Cached blocks covering the first `num_tokens` tokens of a prompt."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    num_tokens: int


NO_HIT = PrefixHit((), (), 0)


class BlockCopy(NamedTuple):
    """Copy-on-write: the runner copies block `src` into block `dst` before the step."""

    src: int
    dst: int


class SlotAllocation(NamedTuple):
    """A successful `allocate_slots`: blocks newly added to the table and CoW copies."""

    new_block_ids: tuple[int, ...]
    copies: tuple[BlockCopy, ...]


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    # Token ids of a hashed block: a hit also compares them (defence in depth).
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Allocates KV blocks to owners (sequence ids) with refcounts, CoW and prefix caching."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError("need at least 2 blocks (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free_fresh: deque[int] = deque(range(1, num_blocks))
        # Free blocks that still hold cached KV; iteration order = eviction order (LRU first).
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}  # block digest -> block id
        self._tables: dict[int, list[int]] = {}
        # Digest chain of each owner's leading full, computed blocks.
        self._hashes: dict[int, list[bytes]] = {}
        # Every registration, eviction and reset in order, with parents and token ids: the
        # feed of KV-aware routing and of vLLM-format KV events; None: nobody listens.
        self.events: BlockEventLog | None = None
        # (digest, block id) of each block registered since the last drain, for the KV
        # tiers to copy out (`record_stored`); None: no tiers.
        self.stored: list[tuple[bytes, int]] | None = None

    # ------------------------------------------------------------------ queries
    @property
    def num_allocatable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to allocate; free cached blocks count as free."""
        return len(self._free_fresh) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Used / allocatable blocks, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_allocatable

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def has_owner(self, owner: int) -> bool:
        return owner in self._tables

    def block_table(self, owner: int) -> list[int]:
        """A copy of the owner's physical block table (empty if it holds none)."""
        return list(self._tables.get(owner, ()))

    def cached_keys(self) -> list[int]:
        """The control-plane key of every cached block (a snapshot for the gateway)."""
        return [block_key(h) for h in self._cached]

    def record_events(self) -> BlockEventLog:
        """Start recording stored/removed/cleared events in order (the worker drains the
        log after every tick); every call returns the same log."""
        if self.events is None:
            self.events = BlockEventLog(self.block_size)
        return self.events

    def record_stored(self) -> None:
        """Start listing newly registered blocks in `stored` (the engine drains it)."""
        if self.stored is None:
            self.stored = []

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def match_prefix(self, token_ids: Sequence[int], root: bytes = ROOT_DIGEST) -> PrefixHit:
        """Cached full blocks at the start of `token_ids`, the chain starting at `root`
        (`pdserve.common.block_hash.prefix_root`: the base model's or a LoRA adapter's).

        Never covers the last token: its logits are needed, so it must be computed.
        Looking up has no side effects; pass the hit to `allocate_slots`.
        """
        if not self.enable_prefix_caching:
            return NO_HIT
        bs = self.block_size
        ids: list[int] = []
        hashes: list[bytes] = []
        parent = root
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, chunk)
            block_id = self._cached.get(h)
            if block_id is None or self._blocks[block_id].token_ids != chunk:
                break
            ids.append(block_id)
            hashes.append(h)
            parent = h
        return PrefixHit(tuple(ids), tuple(hashes), len(ids) * bs)

    # -------------------------------------------------------------- allocation
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate_slots(
        self,
        owner: int,
        num_tokens: int,
        num_computed_tokens: int,
        prefix: PrefixHit = NO_HIT,
    ) -> SlotAllocation | None:
        """Grow `owner`'s table to cover `num_tokens` tokens; None (no change) if no room.

        `num_computed_tokens` is where this step starts writing: a shared block at or
        after it is copied first (copy-on-write) and the copy pair returned. A prefix
        hit may only be passed while the owner holds no blocks.
        """
        table = self._tables.get(owner, [])
        if prefix.block_ids and table:
            raise ValueError("a prefix hit can only start an empty block table")
        have = len(table) + len(prefix.block_ids)
        need_new = max(0, self.blocks_for(num_tokens) - have)
        first_write = num_computed_tokens // self.block_size
        cow = [i for i in range(first_write, len(table)) if self._blocks[table[i]].ref_count > 1]
        # Reviving a free cached block for the hit takes it out of the free pool too.
        revived = sum(1 for b in prefix.block_ids if self._blocks[b].ref_count == 0)
        if need_new + len(cow) + revived > self.num_free_blocks:
            return None

        table = self._tables.setdefault(owner, table)
        hashes = self._hashes.setdefault(owner, [])
        for b in prefix.block_ids:
            self._acquire(b)
            table.append(b)
        hashes.extend(prefix.block_hashes)
        copies = []
        for i in cow:
            dst = self._take_free()
            copies.append(BlockCopy(table[i], dst))
            self._blocks[table[i]].ref_count -= 1  # still > 0: another owner keeps it
            table[i] = dst
        new = [self._take_free() for _ in range(need_new)]
        table.extend(new)
        return SlotAllocation(tuple(new), tuple(copies))

    def cache_full_blocks(
        self, owner: int, token_ids: Sequence[int], num_computed_tokens: int,
        root: bytes = ROOT_DIGEST,
    ) -> None:
        """Register the owner's newly full, computed blocks in the prefix cache, the
        chain starting at `root` (as in `match_prefix`)."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(owner)
        if table is None:
            return
        hashes = self._hashes[owner]
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(table))
        for i in range(len(hashes), num_full):
            chunk = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = hashes[-1] if hashes else root
            h = block_hash(parent, chunk)
            hashes.append(h)
            block = self._blocks[table[i]]
            # An identical block already cached elsewhere stays the canonical one.
            if block.block_hash is None and h not in self._cached:
                block.block_hash = h
                block.token_ids = chunk
                self._cached[h] = block.block_id
                if self.events is not None:
                    self.events.stored(h, parent, chunk, root)
                if self.stored is not None:
                    self.stored.append((h, block.block_id))

    def fork(self, parent: int, child: int) -> None:
        """`child` shares all of `parent`'s blocks (full and partial); writes copy later."""
        if child in self._tables:
            raise ValueError(f"owner {child} already holds blocks")
        table = self._tables.get(parent, [])
        for b in table:
            self._blocks[b].ref_count += 1
        self._tables[child] = list(table)
        self._hashes[child] = list(self._hashes.get(parent, ()))

    def free(self, owner: int) -> None:
        """Drop all of `owner`'s references; unshared blocks return to the free pool."""
        table = self._tables.pop(owner, [])
        self._hashes.pop(owner, None)
        # Tail first: the LRU then evicts a prompt's tail before its (more shareable) head.
        for b in reversed(table):
            self._release(b)

    def trim(self, owner: int, num_tokens: int) -> int:
        """Drop the owner's blocks past the first `num_tokens` tokens (speculative slots
        that were rejected); returns how many left its table. Only uncached tail blocks
        can be past its computed tokens, so nothing cached is lost."""
        table = self._tables.get(owner)
        if table is None:
            return 0
        keep = self.blocks_for(num_tokens)
        dropped = table[keep:]
        del table[keep:]
        del self._hashes[owner][keep:]
        for b in reversed(dropped):
            self._release(b)
        return len(dropped)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (owned blocks keep their KV, just not shareable)."""
        for b in self._free_cached:
            self._free_fresh.append(b)
        self._free_cached.clear()
        for block in self._blocks:
            block.block_hash = None
            block.token_ids = ()
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()

    # ---------------------------------------------------------------- internals
    def _acquire(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free_cached[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.block_hash is not None:
                self._free_cached[block_id] = None
            else:
                self._free_fresh.append(block_id)

    def _take_free(self) -> int:
        if self._free_fresh:
            block_id = self._free_fresh.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)  # evict least recently freed
            block = self._blocks[block_id]
            if block.block_hash is not None and self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None
            block.token_ids = ()
        self._blocks[block_id].ref_count = 1
        return block_id

    # ---------------------------------------------------------------- integrity
    def integrity_errors(self) -> list[str]:
        """Every violated invariant, as readable lines; empty when consistent."""
        errors: list[str] = []
        owners: dict[int, int] = {}
        for table in self._tables.values():
            for b in table:
                owners[b] = owners.get(b, 0) + 1
        free = list(self._free_fresh) + list(self._free_cached)
        free_set = set(free)
        if len(free) != len(free_set):
            errors.append("a block is listed free twice")
        if NULL_BLOCK in free_set or NULL_BLOCK in owners:
            errors.append("the null block is free or owned")
        for block in self._blocks[1:]:
            b = block.block_id
            if b in free_set and b in owners:
                errors.append(f"block {b} is both free and owned")
            if b not in free_set and b not in owners:
                errors.append(f"block {b} is neither free nor owned (leaked)")
            if block.ref_count != owners.get(b, 0):
                errors.append(f"block {b} refcount {block.ref_count} != owners {owners.get(b, 0)}")
            if b in self._free_cached and block.block_hash is None:
                errors.append(f"free cached block {b} has no hash")
            if b in self._free_fresh and block.block_hash is not None:
                errors.append(f"fresh free block {b} still has a hash")
            if block.block_hash is not None and self._cached.get(block.block_hash) != b:
                errors.append(f"block {b} has a hash not registered to it")
        for h, b in self._cached.items():
            if self._blocks[b].block_hash != h:
                errors.append(f"cached hash maps to block {b} which carries another hash")
        return errors

    def check_integrity(self) -> bool:
        return not self.integrity_errors()
