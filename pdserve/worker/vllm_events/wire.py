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
`medium` is "GPU" for the worker's own pool: vLLM's name for the engine's pool
(its CPU backend sends it too), whatever the device; a router ranks it first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from pdserve.common.block_hash import ROOT_DIGEST, block_key
from pdserve.engine.core.block_events import AllCleared, BlockEvent, BlocksRemoved, BlocksStored

MEDIUM_POOL = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame pair: (END_SEQ, b"")


def event_array(event: BlockEvent, block_size: int, medium: str = MEDIUM_POOL) -> list[Any]:
    """One event as vLLM's tagged array."""
    if isinstance(event, BlocksStored):
        lora_id = None if event.root == ROOT_DIGEST else block_key(event.root)
        return ["BlockStored", [block_key(d) for d in event.digests],
                None if event.parent is None else block_key(event.parent),
                event.token_ids, block_size, lora_id, medium]
    if isinstance(event, BlocksRemoved):
        return ["BlockRemoved", [block_key(d) for d in event.digests], medium]
    assert isinstance(event, AllCleared)
    return ["AllBlocksCleared"]


def encode_batch(ts: float, events: Sequence[BlockEvent], block_size: int, data_parallel_rank: int = 0) -> bytes:
    """The payload frame of one batch."""
    body = [ts, [event_array(e, block_size) for e in events], data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
