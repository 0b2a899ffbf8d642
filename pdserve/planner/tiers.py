"""What the KV tiers below a worker's pool hold for one model (`pdserve plan
--kv-offload-memory / --kv-offload-disk / --kv-remote-memory`).

Every tier stores one record per block (kv_transfer/tiers/record.py): a header of
`RECORD_HEADER_BYTES` and the block's K and V of every layer, each row with its
per-head scales when the KV cache is quantized (as the pool stores it). The host and
disk tiers count their files' sizes against their bound; when a write passes it they
delete the least recently used files down to 90% (kv_transfer/tiers/files.py), so a
tier holds between 90% and 100% of `blocks`. The remote tier's bound is the Redis
server's (`maxmemory`); each record there also costs its key (`REMOTE_KEY_BYTES`) and
Redis's own per-key overhead, which is not counted.

A block holds `block_size` tokens of some prompt's prefix (the tiers are keyed by the
chained prefix hash), so `tokens` = `blocks` x block size.
"""

from __future__ import annotations

from dataclasses import dataclass

# The record header (magic, key, rows, length, checksum): kv_transfer.tiers.record.HEADER_BYTES,
# repeated here because the planner sits below kv_transfer (a test keeps the two equal).
RECORD_HEADER_BYTES = 60
REMOTE_KEY_BYTES = len(b"pdserve:kv:") + 64  # kv_transfer.tiers.remote: prefix + hex key
EVICT_TO = 0.9  # a file tier past its bound deletes down to this fraction of it
SCALE_BYTES = 4  # pdserve.common.kv_layout.SCALE_BYTES: one float32 per (layer, K/V, block, KV head)
TIER_NAMES = ("host", "disk", "remote")


@dataclass(frozen=True)
class TierCapacity:
    name: str  # host | disk | remote
    bytes: int  # the tier's bound
    record_bytes: int  # one stored block, as the tier counts it
    blocks: int  # blocks that fit the bound
    tokens: int  # prefix tokens those blocks hold
    pool_multiple: float  # tokens / the pool's token budget (0 when the pool holds none)


def record_bytes(num_layers: int, num_kv_heads: int, head_dim: int, kv_bytes_per_element: int,
                 block_size: int, quantized: bool) -> int:
    """Bytes of one block's record: the header, then K and V rows of every layer."""
    row = block_size * num_kv_heads * head_dim * kv_bytes_per_element
    if quantized:
        row = -(-(row + num_kv_heads * SCALE_BYTES) // 8) * 8  # scales, padded to 8-byte words
    return RECORD_HEADER_BYTES + 2 * num_layers * row


def tier_capacity(name: str, size: int, block_record_bytes: int, block_size: int,
                  pool_tokens: int) -> TierCapacity:
    per_block = block_record_bytes + (REMOTE_KEY_BYTES if name == "remote" else 0)
    blocks = size // per_block
    tokens = blocks * block_size
    return TierCapacity(name, size, per_block, blocks, tokens, tokens / pool_tokens if pool_tokens else 0.0)


def format_tier(t: TierCapacity, size_text: str) -> tuple[str, str]:
    """The plan's row for one tier."""
    bound = ("the server's maxmemory bounds it; Redis's own per-key overhead not counted" if t.name == "remote"
             else f"LRU down to {EVICT_TO:.0%} when full")
    multiple = f", {t.pool_multiple:.1f}x the pool's token budget" if t.pool_multiple else ""
    return (f"{t.name} tier", f"{size_text}: {t.blocks:,} blocks = {t.tokens:,} prefix tokens "
            f"({t.record_bytes:,} bytes a block{multiple}; {bound})")
