"""What the prefix cache gained and lost since it was last asked: the feed behind the
gateway's KV-aware routing (pdserve/worker/kv_events.py publishes it).

The block manager records a block key as *stored* when a digest is registered in its
cache and as *evicted* when that registration goes. Within one batch only a key's
final state counts (stored then evicted in one tick is just evicted), so a batch is
two disjoint lists whose order does not matter. A cleared cache, or more pending
changes than `max_pending`, marks the batch `reset`: the reader must take a full
snapshot instead of applying it. Torch-free, single-threaded (the engine loop).
"""

from __future__ import annotations

from typing import NamedTuple

from pdserve.common.block_hash import block_key


class CacheEvents(NamedTuple):
    """One batch: keys now cached, keys no longer cached; `reset`: take a snapshot."""

    stored: list[int]
    evicted: list[int]
    reset: bool = False

    @property
    def empty(self) -> bool:
        return not (self.stored or self.evicted or self.reset)


class CacheEventLog:
    """Pending changes, netted per key, until `drain`."""

    def __init__(self, max_pending: int = 1 << 16) -> None:
        self.max_pending = max_pending
        self._state: dict[int, bool] = {}  # key -> cached at the end of the batch
        self._reset = False

    def stored(self, digest: bytes) -> None:
        self._set(block_key(digest), True)

    def evicted(self, digest: bytes) -> None:
        self._set(block_key(digest), False)

    def cleared(self) -> None:
        self._state.clear()
        self._reset = True

    def _set(self, key: int, cached: bool) -> None:
        if self._reset:
            return  # a snapshot follows anyway
        self._state[key] = cached
        if len(self._state) > self.max_pending:
            self.cleared()

    def drain(self) -> CacheEvents:
        events = CacheEvents(
            [k for k, c in self._state.items() if c], [k for k, c in self._state.items() if not c], self._reset
        )
        self._state = {}
        self._reset = False
        return events
