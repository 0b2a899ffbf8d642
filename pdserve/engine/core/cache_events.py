"""What the prefix cache gained and lost since it was last asked: the feed behind the
gateway's KV-aware routing (pdserve/worker/kv_events.py publishes it).

It is the block manager's one ordered log (`BlockEventLog`, block_events.py) of a tick,
netted per block key: within one batch only a key's final state counts (stored then
evicted in one tick is just evicted), so a batch is two disjoint lists whose order does
not matter. A cleared cache, or more changed keys than `max_pending`, marks the batch
`reset`: the reader must take a full snapshot instead of applying it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from pdserve.common.block_hash import block_key
from pdserve.engine.core.block_events import AllCleared, BlockEvent, BlocksStored


class CacheEvents(NamedTuple):
    """One batch: keys now cached, keys no longer cached; `reset`: take a snapshot."""

    stored: list[int]
    evicted: list[int]
    reset: bool = False

    @property
    def empty(self) -> bool:
        return not (self.stored or self.evicted or self.reset)

    @classmethod
    def netted(cls, events: Iterable[BlockEvent], max_pending: int = 1 << 16) -> CacheEvents:
        """The batch of a drained run of ordered events (in the order they happened)."""
        state: dict[int, bool] = {}  # key -> cached at the end of the batch
        for event in events:
            if isinstance(event, AllCleared):
                return cls([], [], True)
            for digest in event.digests:
                state[block_key(digest)] = isinstance(event, BlocksStored)
            if len(state) > max_pending:
                return cls([], [], True)  # a snapshot is cheaper than the batch
        return cls([k for k, c in state.items() if c], [k for k, c in state.items() if not c])
