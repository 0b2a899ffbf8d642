"""One KV block as it is stored in a tier: a self-describing, self-checking record.

    magic "PDKVBLK1" | key (32 bytes) | num_rows u32 | payload_len u64 | checksum u64 | payload

The key is `tier_key(namespace, block digest)`: the prefix cache's chained block
digest (pdserve/common/block_hash.py) salted with a namespace that names everything that
changes the KV bytes (`tier_namespace`). The checksum is the KV plane's row checksum
(kv_transfer/checksum.py) over the payload's `num_rows` rows (each layer's K and V of
the block). A reader passes the key it expects and the payload length its pool needs;
a record that does not match in every respect is a miss with the reason, never KV
(`check_record` checks a buffer the reader owns in place, `decode_record` copies the
payload out).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from typing import NamedTuple

import numpy as np

from kv_transfer.checksum import frame_checksum
from pdserve.common.kv_layout import KVLayout

MAGIC = b"PDKVBLK1"
_HEADER = struct.Struct("<8s32sIQQ")
HEADER_BYTES = _HEADER.size
KEY_BYTES = 32


class MissReason(enum.Enum):
    """Why a tier did not give a block (each a metric label)."""

    ABSENT = "absent"  # not stored (the ordinary miss)
    TRUNCATED = "truncated"  # shorter or longer than its header says, or no header
    CORRUPT = "corrupt"  # the checksum or the magic does not match
    FOREIGN = "foreign"  # a valid record of another key or another layout
    UNAVAILABLE = "unavailable"  # the tier could not be read (I/O error, server down)


class RecordMiss(NamedTuple):
    reason: MissReason


def tier_namespace(layout: KVLayout) -> bytes:
    """32 bytes naming what the KV bytes of a block depend on besides its tokens: the
    model config and weights fingerprint, compute and KV-cache dtypes, quantization,
    block size, head layout and storage order (`KVLayout.compat_hash` and every field
    of the layout, so a field added there is covered here)."""
    text = "|".join(("pdserve-kv-tier-v1", layout.compat_hash, repr(layout),
                     f"row_bytes={layout.row_bytes}", "order=layer,kv,slot,head,dim"))
    return hashlib.sha256(text.encode()).digest()


def tier_key(namespace: bytes, digest: bytes) -> bytes:
    """The 32-byte tier key of a block: its prefix digest under `namespace`."""
    return hashlib.sha256(namespace + digest).digest()


def block_rows(layout: KVLayout) -> int:
    """Rows of one block's payload: K and V of every layer."""
    return 2 * layout.num_layers


def block_payload_bytes(layout: KVLayout) -> int:
    return layout.block_bytes_per_layer * layout.num_layers


def encode_record(key: bytes, payload: np.ndarray, num_rows: int) -> bytes:
    """The stored bytes of one block (`payload`: its raw bytes, C-contiguous)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a tier key is {KEY_BYTES} bytes, got {len(key)}")
    raw = np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
    header = _HEADER.pack(MAGIC, key, num_rows, raw.nbytes, frame_checksum(raw, num_rows))
    return b"".join((header, raw.data))  # one copy of the payload


def record_bytes(layout: KVLayout) -> int:
    """The stored size of one sound record of `layout`'s blocks."""
    return HEADER_BYTES + block_payload_bytes(layout)


def check_record(data: bytes | memoryview, key: bytes, payload_bytes: int,
                 num_rows: int) -> MissReason | None:
    """None if `data` is a sound record of `key` with a `payload_bytes` payload of
    `num_rows` rows, else why not. Checks `data` in place: the caller must own it (a
    buffer nobody else writes) for the answer to hold for the bytes it then uses."""
    if len(data) < HEADER_BYTES:
        return MissReason.TRUNCATED
    magic, got_key, rows, length, checksum = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        return MissReason.CORRUPT
    if len(data) != HEADER_BYTES + length:
        return MissReason.TRUNCATED
    if got_key != key or length != payload_bytes or rows != num_rows:
        return MissReason.FOREIGN
    payload = np.frombuffer(data, np.uint8, count=length, offset=HEADER_BYTES)
    if frame_checksum(payload, num_rows) != checksum:
        return MissReason.CORRUPT
    return None


def decode_record(data: bytes | memoryview, key: bytes, payload_bytes: int,
                  num_rows: int) -> np.ndarray | RecordMiss:
    """The payload (uint8, a copy the caller owns) if `data` is a sound record of `key`
    with a `payload_bytes` payload of `num_rows` rows, else why not."""
    owned = bytes(data)  # checked and copied from one snapshot of the bytes
    miss = check_record(owned, key, payload_bytes, num_rows)
    if miss is not None:
        return RecordMiss(miss)
    return np.frombuffer(owned, np.uint8, count=payload_bytes, offset=HEADER_BYTES).copy()
