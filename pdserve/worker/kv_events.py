"""Publishing the node's prefix-cache events to the gateways (KV-aware routing).

After every tick the runtime drains the engine's ordered block event log, nets it per key
(`CacheEvents.netted`, pdserve/engine/core/cache_events.py) and broadcasts one `KvEvents`
batch to every gateway it is linked with, numbered by
`seq` (1, 2, ...; nothing is sent for an empty tick). A gateway that registers the
worker gets a snapshot (`snapshot=True`: the whole cache as of the last batch number),
and so does one that saw a gap and asked (`KvSnapshotRequest`). A batch marked reset
(the cache was cleared, or too much changed in one tick) goes out as a snapshot to
every gateway. Applying a batch is idempotent (each key carries its final state), so a
snapshot taken between two batches is consistent with the next one.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common import protocol as p
from pdserve.engine.core.block_events import BlockEvent
from pdserve.engine.core.cache_events import CacheEvents
from pdserve.worker.node_api import Node


class CachePublisher:
    """The worker's batch counter and the messages it numbers. Main loop only."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.seq = 0

    def next_batch(self, node: Node, tick: Sequence[BlockEvent]) -> p.KvEvents | None:
        """The batch for every gateway of a tick's block events; None when nothing changed."""
        events = CacheEvents.netted(tick)
        if events.empty:
            return None
        self.seq += 1
        if events.reset:
            return p.KvEvents(self.worker_id, self.seq, node.cached_keys(), snapshot=True)
        return p.KvEvents(self.worker_id, self.seq, events.stored, events.evicted)

    def snapshot(self, node: Node) -> p.KvEvents:
        """The whole cache, as of batch `seq` (the next batch is `seq + 1`)."""
        return p.KvEvents(self.worker_id, self.seq, node.cached_keys()[: p.MAX_LIST_LEN], snapshot=True)
