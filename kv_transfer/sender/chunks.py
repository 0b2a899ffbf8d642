"""Sender-side chunks: planning a granted transfer's layer ranges into spans, and
turning each span into one message (see sender.py for the I/O loop around it).

Inline peers get the blocks gathered into a reusable staging buffer that travels
zero-copy; shared-memory / CUDA IPC peers get them copied straight into their pool
and receive only the header. `plan` and `next` run on the sender's I/O thread *with
the sender lock held*: that is the lease rule of sender.py -- a source block is
read, and a peer's pool written, only for a live transfer and (for direct writes)
only before its write deadline.

A device pool's copies are asynchronous (staging.py): `next` only enqueues them on
the pool's copy stream, behind the compute that writes the KV, and returns a
`PendingCopy`; `produce` waits for it with the lock *released* (the transfer counts
as `copying`, so `poll` never reports it terminal meanwhile), then finishes the
chunk under the lock. The write deadline of a direct write is checked again once
the copy is done: a copy queued behind compute may run later than it was queued.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import numpy as np

from kv_transfer import wire
from kv_transfer.api import TransferState
from kv_transfer.checksum import digest
from kv_transfer.faults import FaultConfig
from kv_transfer.links import Parts, StagingBuffers
from kv_transfer.pool.blocks import frame_nbytes, gather_with_sums, plan_chunks
from kv_transfer.pool.copy_threads import CopyThreads
from kv_transfer.pool.protocol import PoolOps
from kv_transfer.pool.staging import DeviceOps, StartedCopy
from kv_transfer.sender.state import PeerRecord, TransferRecord
from pdserve.common.kv_layout import KVLayout


class OutChunk(NamedTuple):
    """One chunk message and its frame buffer (None for a header-only direct write)."""

    parts: Parts
    buffer: np.ndarray | None


class PendingCopy(NamedTuple):
    """A device chunk whose copy is enqueued: wait for `copy.event` without the lock,
    then call `finish` with it."""

    copy: StartedCopy
    finish: Callable[[np.ndarray], OutChunk | None]


class ChunkMaker:
    """Plans and produces chunks for one sender's source pool (I/O thread only)."""

    def __init__(self, layout: KVLayout, ops: PoolOps, copy: CopyThreads, faults: FaultConfig,
                 *, chunk_bytes: int, shm_chunk_bytes: int,
                 clock: Callable[[], float]) -> None:
        self.layout = layout
        self.chunk_bytes = chunk_bytes
        self.shm_chunk_bytes = shm_chunk_bytes
        # Inline frame buffers, recycled once sent; pinned for a device pool's copies.
        self._device = cast(DeviceOps, ops) if ops.on_device else None
        self.staging = StagingBuffers(alloc=None if self._device is None else self._device.host_buffer)
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
            l0, l1, ready = t.pending_layers.popleft()
            t.spans.extend((span, ready) for span in
                           plan_chunks(self.layout, len(t.src_ids), l0, l1, limit))

    def produce(self, lock: threading.Lock, peer: PeerRecord, t: TransferRecord) -> OutChunk | None:
        """`next` under `lock`; a device copy is waited for with `lock` released."""
        with lock:
            made = self.next(peer, t)
            if not isinstance(made, PendingCopy):
                return made
            t.copying += 1
        try:
            made.copy.event.synchronize()
            sums = made.copy.sums()
        finally:
            with lock:
                t.copying -= 1
        with lock:
            return made.finish(sums)

    def next(self, peer: PeerRecord, t: TransferRecord) -> OutChunk | PendingCopy | None:
        """Produce `t`'s next chunk (lock held); None if there is nothing to send now.

        Inline: gather the blocks into a staging buffer, checksumming on the way.
        Shared memory: checksum the source blocks in place and copy them straight
        into the receiver's pool; the message is only the header.
        """
        index = self._made
        self._made += 1
        if t.state.terminal or not t.spans:
            return None
        span, ready = t.spans.popleft()
        l0, l1 = span.layer_start, span.layer_end
        src = t.src_ids[span.first:span.last]
        dst = t.dst_ids[span.first:span.last]
        nbytes = frame_nbytes(self.layout, l1 - l0, len(src))
        if index == self._faults.drop_chunk:
            return None
        if self._device is not None:
            return self._start_device(peer, t, index, (l0, l1, src, dst, nbytes), ready)
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
        return self._chunk(t, dst, l0, l1, nbytes, checksum, buffer)

    def _chunk(self, t: TransferRecord, dst: tuple[int, ...], l0: int, l1: int, nbytes: int,
               checksum: int, buffer: np.ndarray | None) -> OutChunk:
        header = wire.encode(wire.Chunk(t.transfer_id, t.request_id, self._compat,
                                        dst, l0, l1, nbytes, checksum, buffer is not None))
        return OutChunk([header], None) if buffer is None else OutChunk([header, buffer], buffer)

    def _start_device(self, peer: PeerRecord, t: TransferRecord, index: int,
                      what: tuple[int, int, tuple[int, ...], tuple[int, ...], int],
                      ready: Any) -> OutChunk | PendingCopy | None:
        """Enqueue a device chunk's copy (lock held): into the peer's mapped pool (CUDA
        IPC) or device -> pinned host staging buffer (inline frame)."""
        assert self._device is not None
        l0, l1, src, dst, nbytes = what
        direct = peer.direct_ops
        if direct is not None:
            if self._clock() >= t.write_deadline:
                t.end(TransferState.FAILED, "write deadline passed before the copy")
                return None
            started = self._device.start_copy_to(direct, l0, l1, src, dst, ready)
        else:
            buffer = self.staging.take(nbytes)
            started = self._device.start_gather(l0, l1, src, buffer, ready)

        def finish(sums: np.ndarray) -> OutChunk | None:
            """The copy is done (lock held again): checksum, or give up on a dead transfer."""
            if t.state.terminal:
                return None
            if direct is not None:
                if self._clock() >= t.write_deadline:  # the copy may have waited on compute
                    t.end(TransferState.FAILED, "write deadline passed during the copy")
                    return None
                if index == self._faults.corrupt_chunk:
                    direct.flip_byte(l0, dst[0])
                return self._chunk(t, dst, l0, l1, nbytes, digest(sums), None)
            if index == self._faults.corrupt_chunk:
                buffer[nbytes // 2] ^= 0xFF
            return self._chunk(t, dst, l0, l1, nbytes, digest(sums), buffer)

        return PendingCopy(started, finish)
