"""Decode-side checks of one `Chunk` and verification of its bytes.

Everything about a chunk is checked before a byte of its frame is interpreted:
the header against the layout and this receiver's limits, then against the
reservation it names. Only then are the bytes written (inline frames, scattered
into the reserved blocks, host -> device through a staging buffer for a device
pool) or found (shared memory: the sender already wrote them
into this pool) and checked against the chunk's checksum, in one pass.
"""

from __future__ import annotations

from typing import cast

import numpy as np

from kv_transfer import wire
from kv_transfer.checksum import digest
from kv_transfer.pool.blocks import frame_nbytes, scatter_with_sums
from kv_transfer.pool.copy_threads import CopyThreads
from kv_transfer.pool.protocol import PoolOps
from kv_transfer.pool.staging import DeviceOps
from kv_transfer.receiver.state import ReservationRecord
from pdserve.common.kv_layout import KVLayout


class FrameCheck:
    """Validates and lands chunks for one receiver pool (called under the receiver lock)."""

    def __init__(self, layout: KVLayout, ops: PoolOps, copy: CopyThreads, *,
                 max_frame_bytes: int, shared: bool) -> None:
        self.layout = layout
        self.max_frame_bytes = max_frame_bytes
        self.shared = shared  # the pool is advertised for same-host direct writes
        self._ops = ops
        self._copy = copy

    def problem(self, peer: bytes, msg: wire.Chunk, frame: memoryview | None,
                res: ReservationRecord | None) -> str:
        """Why this chunk must be refused ("" if it may be written)."""
        return self._header_problem(msg, frame) or _reservation_problem(peer, msg, res)

    def _header_problem(self, msg: wire.Chunk, frame: memoryview | None) -> str:
        nl = self.layout.num_layers
        if not 0 <= msg.layer_start < msg.layer_end <= nl:
            return f"bad layer range {msg.layer_start}..{msg.layer_end}"
        if not msg.dst_block_ids:
            return "chunk without blocks"
        expected = frame_nbytes(self.layout, msg.layer_end - msg.layer_start,
                                len(msg.dst_block_ids))
        if msg.nbytes != expected:
            return f"declared {msg.nbytes} bytes, layout says {expected}"
        if msg.nbytes > self.max_frame_bytes:
            return f"chunk of {msg.nbytes} bytes exceeds the {self.max_frame_bytes}-byte limit"
        if msg.inline != (frame is not None):
            return "frame presence does not match header"
        if frame is not None and frame.nbytes != msg.nbytes:
            return f"frame has {frame.nbytes} bytes, header declares {msg.nbytes}"
        if not msg.inline and not self.shared:
            return "shared-memory chunk but this pool is not shared"
        if msg.compat_hash != self.layout.compat_hash:
            return "compatibility hash mismatch"
        return ""

    def land(self, msg: wire.Chunk, frame: memoryview | None) -> bool:
        """Write an inline frame into its blocks, then (either way) verify the blocks'
        bytes against the chunk checksum. Only for a chunk `problem` passed, whose
        reservation is live: the blocks are reserved for this transfer and nothing
        reads them before COMPLETE, so a bad frame only fails the transfer."""
        l0, l1, ids = msg.layer_start, msg.layer_end, msg.dst_block_ids
        if frame is not None and self._ops.on_device:  # host -> device through staging
            raw = np.frombuffer(frame, dtype=np.uint8)
            sums = cast(DeviceOps, self._ops).scatter_from_host(l0, l1, ids, raw)
        elif frame is not None:  # verify while scattering: one pass over the frame
            pool = self._ops.array
            data = np.frombuffer(frame, dtype=pool.dtype).reshape(
                (l1 - l0, 2, len(ids)) + pool.shape[3:])
            sums = scatter_with_sums(pool, l0, l1, ids, data, self._copy)
        else:  # shared memory: the bytes are already in our pool; verify them there
            sums = self._ops.row_sums(l0, l1, ids)
        return digest(sums) == msg.checksum


def _reservation_problem(peer: bytes, msg: wire.Chunk, res: ReservationRecord | None) -> str:
    if res is None:
        return "no reservation for transfer"
    if res.peer != peer:
        return "chunk from a sender that holds no grant"
    if len(set(msg.dst_block_ids)) != len(msg.dst_block_ids) or any(
            b not in res.index for b in msg.dst_block_ids):
        return "chunk names blocks outside the reservation"
    return ""
