"""The prefix cache's changes in the order they happened: the one log of them, which
both feeds read after every tick: the KV events a worker publishes in vLLM's format
(`--kv-events-config`, pdserve/worker/vllm_events/) as it is, and the gateway's KV
index netted per key (`CacheEvents.netted`, cache_events.py).

It keeps every change in order, with what an external router needs to name a block
itself: the parent of a run of newly cached blocks and their token ids. The block
manager calls:

- `stored(digest, parent, token_ids, root)` when a digest is registered; consecutive
  registrations of one chain (each block's parent the previous block) join one
  `BlocksStored`, as vLLM sends one `BlockStored` per run of a request's blocks;
- `removed(digest)` when a registration is evicted (consecutive ones join one
  `BlocksRemoved`);
- `cleared()` when the whole prefix cache is forgotten.

The worker drains it after every tick, so it holds at most one tick's changes (no
more than the blocks a step computes plus those it evicts). Torch-free,
single-threaded (the engine loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlocksStored:
    """A run of newly cached blocks, each the child of the one before; the first is the
    child of `parent` (None: the first block of a sequence, whose parent is `root`)."""

    digests: list[bytes]
    parent: bytes | None
    token_ids: list[int]
    root: bytes  # the chain's root digest (pdserve.common.block_hash.prefix_root: base or adapter)


@dataclass
class BlocksRemoved:
    digests: list[bytes]


@dataclass(frozen=True)
class AllCleared:
    pass


BlockEvent = BlocksStored | BlocksRemoved | AllCleared


@dataclass
class BlockEventLog:
    """Ordered changes until `drain`."""

    block_size: int
    events: list[BlockEvent] = field(default_factory=list)

    def stored(self, digest: bytes, parent: bytes, token_ids: tuple[int, ...], root: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlocksStored) and last.digests[-1] == parent and last.root == root:
            last.digests.append(digest)
            last.token_ids.extend(token_ids)
            return
        self.events.append(BlocksStored([digest], None if parent == root else parent, list(token_ids), root))

    def removed(self, digest: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlocksRemoved):
            last.digests.append(digest)
        else:
            self.events.append(BlocksRemoved([digest]))

    def cleared(self) -> None:
        self.events.append(AllCleared())

    def drain(self) -> list[BlockEvent]:
        events, self.events = self.events, []
        return events
