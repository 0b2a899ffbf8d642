"""KV tiers below a worker's pool: host (shared memory), disk and remote (Redis).

    cache = build_tier_cache(KVOffloadConfig(memory_bytes=1 << 30), layout)
    cache.load(digests) / cache.offer(digest, payload)

Bytes only (numpy): the engine copies payloads in and out of its pool
(pdserve/engine/pool_blocks.py). Every stored block is a checked record (tiers/record.py).
"""

from __future__ import annotations

from kv_transfer.tiers.cache import CacheSnapshot, TieredKVCache
from kv_transfer.tiers.config import KVOffloadConfig, build_tier_cache
from kv_transfer.tiers.events import TierBlocks, TierEventLog

__all__ = ["CacheSnapshot", "KVOffloadConfig", "TierBlocks", "TierEventLog", "TieredKVCache", "build_tier_cache"]
