"""KV events on the wire exactly as vLLM's `ZmqEventPublisher` sends them
(vllm/distributed/kv_events.py, msgspec structs with `array_like=True, tag=True`),
written with plain msgpack so that pdserve needs no msgspec.

A ZeroMQ message is three frames: the topic (utf-8, "" by default), the batch's
sequence number (8 bytes, big-endian, from 0) and the msgpack payload:

    batch          [ts: float, events: [event, ...], data_parallel_rank: int]
    BlockStored    ["BlockStored", block_hashes: [int], parent_block_hash: int | nil,
                    token_ids: [int], block_size: int, lora_id: int | nil, medium: str]
    BlockRemoved   ["BlockRemoved", block_hashes: [int], medium: str]
    AllBlocksCleared  ["AllBlocksCleared"]

A block hash is the block's control-plane key (pdserve.common.block_hash.block_key:
the first 8 bytes of its chained SHA-256 digest, as a 63-bit int), the same key the
gateway's KV index uses. `token_ids` are the tokens of the stored blocks, in order
(block_size per block); `parent_block_hash` is nil for a sequence's first block.
`lora_id` is nil for the base model; under a LoRA adapter it is the key of the
adapter's chain root (prefix_root), so blocks of different adapters never match.
`medium` says where the blocks are, in the order a router ranks the cost of getting
them:

    "GPU"     the worker's own pool: vLLM's name for the engine's pool (its CPU backend
              sends it too), whatever the device
    "CPU"     the host tier: shared memory every worker of the host reads (vLLM's
              offloading connector calls its host memory "CPU")
    "DISK"    the disk tier: block files kept across restarts (`--kv-offload-dir`)
    "REMOTE"  the remote tier: a Redis shared across hosts (`--kv-remote-url`)

A tier's BlockStored is sent once the worker's tier writer has written the block. A
block written down from the pool comes after the pool's BlockStored of it; a block
copied up from a lower tier (read from disk or Redis, so written to the host tier) is
queued as the read lands, so its host-tier BlockStored may come before the pool's, or
with no pool event at all when the read's request ended first. It names the blocks by
hash only, as vLLM's offloading connector does: `parent_block_hash` nil, `token_ids`
empty, `lora_id` nil (the hash already covers the adapter). A tier's BlockRemoved is
sent when this worker's own bound enforcement deletes blocks it reported stored (host
and disk LRU), when it discards a bad record it reported, and, for the oldest of them,
once it has reported more blocks stored in the tier than the tier holds (another
worker sharing the tier must have evicted it). Not seen, so never sent: the remote
tier's evictions (Redis's own maxmemory and TTL).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from kv_transfer.tiers.events import TierBlocks
from pdserve.common.block_hash import ROOT_DIGEST, block_key
from pdserve.engine.core.block_events import AllCleared, BlockEvent, BlocksRemoved, BlocksStored

MEDIUM_POOL = "GPU"
TIER_MEDIUMS = {"host": "CPU", "disk": "DISK", "remote": "REMOTE"}  # KVTier.name -> medium
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame pair: (END_SEQ, b"")


WireEvent = BlockEvent | TierBlocks  # the pool's events, and the tier writer's


def event_array(event: WireEvent, block_size: int, medium: str = MEDIUM_POOL) -> list[Any]:
    """One event as vLLM's tagged array (a pool event in `medium`, a tier's in its own)."""
    if isinstance(event, TierBlocks):
        return tier_array(event, block_size)
    if isinstance(event, BlocksStored):
        lora_id = None if event.root == ROOT_DIGEST else block_key(event.root)
        return ["BlockStored", [block_key(d) for d in event.digests],
                None if event.parent is None else block_key(event.parent),
                event.token_ids, block_size, lora_id, medium]
    if isinstance(event, BlocksRemoved):
        return ["BlockRemoved", [block_key(d) for d in event.digests], medium]
    assert isinstance(event, AllCleared)
    return ["AllBlocksCleared"]


def tier_array(event: TierBlocks, block_size: int) -> list[Any]:
    keys, medium = [block_key(d) for d in event.digests], TIER_MEDIUMS[event.tier]
    if event.stored:
        return ["BlockStored", keys, None, [], block_size, None, medium]
    return ["BlockRemoved", keys, medium]


def encode_batch(ts: float, events: Sequence[WireEvent], block_size: int, data_parallel_rank: int = 0) -> bytes:
    """The payload frame of one batch."""
    body = [ts, [event_array(e, block_size) for e in events], data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
