"""The prefix-cache block hash, shared by the engine's block manager and the gateway's
KV index (which must compute exactly the same chain to know who holds a prompt).

A FULL block of `block_size` tokens is named by
`SHA-256(parent block digest || token ids of the block as little-endian int64)`, the
first block's parent being the fixed `ROOT_DIGEST`. The digest therefore names the
whole prefix, not just the block: two prompts share block i only if they agree on
every token up to the end of block i, and a hit on block i implies hits on 0..i-1.

Under a LoRA adapter the chain starts from `prefix_root(fingerprint)` instead, so no
block computed under one adapter (or the base model) names a block of another.

On the control plane a block travels as its *key*: the digest's first 8 bytes as a
63-bit unsigned int (msgpack-native, no bin type on the wire). The key only steers
routing; a worker still matches full digests and token ids before reusing a block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Parent digest of the first block of every sequence (a fixed constant).
ROOT_DIGEST = hashlib.sha256(b"pdserve prefix cache root").digest()


def prefix_root(lora_fingerprint: str = "") -> bytes:
    """The parent digest of a sequence's first block: `ROOT_DIGEST` for the base model,
    else one derived from the adapter's weights fingerprint (`pdserve/common/lora.py`)."""
    if not lora_fingerprint:
        return ROOT_DIGEST
    return hashlib.sha256(ROOT_DIGEST + b"lora:" + lora_fingerprint.encode()).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained digest of one full block: SHA-256 over the parent's digest and the
    block's token ids (little-endian int64), so it names the whole prefix."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


def block_key(digest: bytes) -> int:
    """A block digest's control-plane key: its first 8 bytes, as a 63-bit int."""
    return int.from_bytes(digest[:8], "big") >> 1


def prefix_block_keys(
    token_ids: Sequence[int], block_size: int, root: bytes = ROOT_DIGEST
) -> list[int]:
    """The keys of every full block of `token_ids`, in order (the chain the block
    manager registers as those blocks are computed), from `root` (`prefix_root`)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    keys: list[int] = []
    parent = root
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(block_key(parent))
    return keys


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading blocks of a prompt a prefix-cache hit may cover: never the
    last token (its logits are needed, so it is always computed)."""
    return max(0, (num_tokens - 1) // block_size)
