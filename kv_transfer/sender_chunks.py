"""Sender-side chunks: planning a granted transfer's layer ranges into spans, and
turning each span into one message (see sender.py for the I/O loop around it).

Inline peers get the blocks gathered into a reusable staging buffer that travels
zero-copy; shared-memory / CUDA IPC peers get them copied straight into their pool
and receive only the header. Both methods run on the sender's I/O thread *with the
sender lock held*: that is the lease rule of sender.py -- a source block is read,
and a peer's pool written, only for a live transfer and (for direct writes) only
before its write deadline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from common.kv_layout import KVLayout
from kv_transfer import wire
from kv_transfer.api import TransferState
from kv_transfer.blocks import frame_nbytes, gather_with_sums, plan_chunks
from kv_transfer.checksum import digest
from kv_transfer.copy_threads import CopyThreads
from kv_transfer.faults import FaultConfig
from kv_transfer.links import Parts, StagingBuffers
from kv_transfer.pool_ops import PoolOps
from kv_transfer.sender_state import PeerRecord, TransferRecord


class OutChunk(NamedTuple):
    """One chunk message and its frame buffer (None for a header-only direct write)."""

    parts: Parts
    buffer: np.ndarray | None


class ChunkMaker:
    """Plans and produces chunks for one sender's source pool (I/O thread only)."""

    def __init__(self, layout: KVLayout, ops: PoolOps, copy: CopyThreads, faults: FaultConfig,
                 *, chunk_bytes: int, shm_chunk_bytes: int,
                 clock: Callable[[], float]) -> None:
        self.layout = layout
        self.chunk_bytes = chunk_bytes
        self.shm_chunk_bytes = shm_chunk_bytes
        self.staging = StagingBuffers()  # inline frame buffers, recycled once sent
        self._compat = layout.compat_hash
        self._ops = ops
        self._copy = copy
        self._faults = faults
        self._clock = clock
        self._made = 0  # numbers chunks for fault injection

    def plan(self, peer: PeerRecord, t: TransferRecord) -> None:
        """Split `t`'s queued layer ranges into spans sized for `peer` (lock held)."""
        direct = peer.direct_ops is not None
        limit = min(self.shm_chunk_bytes if direct else self.chunk_bytes, peer.max_frame)
        while t.pending_layers:
            l0, l1 = t.pending_layers.popleft()
            t.spans.extend(plan_chunks(self.layout, len(t.src_ids), l0, l1, limit))

    def next(self, peer: PeerRecord, t: TransferRecord) -> OutChunk | None:
        """Produce `t`'s next chunk (lock held); None if there is nothing to send now.

        Inline: gather the blocks into a staging buffer, checksumming on the way.
        Shared memory: checksum the source blocks in place and copy them straight
        into the receiver's pool; the message is only the header.
        """
        index = self._made
        self._made += 1
        if t.state.terminal or not t.spans:
            return None
        span = t.spans.popleft()
        l0, l1 = span.layer_start, span.layer_end
        src = t.src_ids[span.first:span.last]
        dst = t.dst_ids[span.first:span.last]
        nbytes = frame_nbytes(self.layout, l1 - l0, len(src))
        if index == self._faults.drop_chunk:
            return None
        buffer: np.ndarray | None = None
        if peer.direct_ops is not None:
            if self._clock() >= t.write_deadline:
                t.end(TransferState.FAILED, "write deadline passed before the copy")
                return None
            checksum = digest(self._ops.copy_to(peer.direct_ops, l0, l1, src, dst))
            if index == self._faults.corrupt_chunk:
                peer.direct_ops.flip_byte(l0, dst[0])
        else:
            buffer = self.staging.take(nbytes)
            _, sums = gather_with_sums(self._ops.array, l0, l1, src, buffer, self._copy)
            checksum = digest(sums)
            if index == self._faults.corrupt_chunk:
                buffer[nbytes // 2] ^= 0xFF
        header = wire.encode(wire.Chunk(t.transfer_id, t.request_id, self._compat,
                                        dst, l0, l1, nbytes, checksum, buffer is not None))
        return OutChunk([header], None) if buffer is None else OutChunk([header, buffer], buffer)
