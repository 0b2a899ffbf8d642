"""Sender-side records: one per transfer, one per peer address (see sender.py).

`TransferRecord`s are guarded by the sender lock; `PeerRecord`s belong to the
sender's I/O thread alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kv_transfer import wire
from kv_transfer.api import TransferState
from kv_transfer.links import Link, Parts
from kv_transfer.pool.blocks import ChunkSpan
from kv_transfer.pool.cuda_ipc import CudaPool, attach_cuda_pool, is_cuda_descriptor
from kv_transfer.pool.protocol import PoolOps
from kv_transfer.pool.shm import ShmPool, attach_shm_pool
from pdserve.common.kv_layout import KVLayout


@dataclass
class TransferRecord:
    transfer_id: str
    request_id: str
    peer: str
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]
    deadline: float
    state: TransferState = TransferState.RESERVED
    reason: str = ""
    # Layer ranges queued by the worker, each with the event its KV is ready at (or None).
    pending_layers: deque[tuple[int, int, Any]] = field(default_factory=deque)
    spans: deque[tuple[ChunkSpan, Any]] = field(default_factory=deque)
    claim_sent: bool = False
    granted: bool = False
    write_deadline: float = 0.0
    abort_pending: bool = False
    lapsed: bool = False  # its lease ran out with no ack; the I/O thread clears it once seen
    copying: int = 0  # device copies of this transfer in flight, waited on without the lock

    def end(self, state: TransferState, reason: str) -> None:
        """Caller holds the lock. A non-COMPLETE end tells the receiver we stopped writing."""
        self.state, self.reason = state, reason
        self.spans.clear()
        self.pending_layers.clear()
        self.abort_pending = state is not TransferState.COMPLETE

    @property
    def visible_state(self) -> TransferState:
        """What the worker sees: a copy still reading the source blocks (or writing a
        peer's pool) makes a terminal record CANCELLING until it is done."""
        if self.state.terminal and self.copying:
            return TransferState.CANCELLING
        return self.state

    def expire(self, now: float) -> None:
        """Caller holds the lock: fail a live transfer whose lease has run out."""
        if not self.state.terminal and now >= self.deadline:
            self.end(TransferState.FAILED, "no ack from the receiver before the lease deadline")
            self.lapsed = True


@dataclass
class PeerRecord:
    address: str
    link: Link
    want_direct: bool  # shm+ / cuda+ address: write into the receiver's pool directly
    ready: bool = False
    refused: str = ""
    max_frame: int = wire.DEFAULT_MAX_FRAME_BYTES
    direct: ShmPool | CudaPool | None = None  # the receiver's pool, mapped here
    direct_ops: PoolOps | None = None
    control: deque[Parts] = field(default_factory=deque)
    blocked: tuple[Parts, np.ndarray | None] | None = None  # a message that would block


def attach_direct(layout: KVLayout, descriptor: wire.ShmDescriptor,
                  on_device: bool) -> ShmPool | CudaPool:
    """Map a receiver's advertised pool: shared memory for host pools, CUDA IPC for device."""
    if is_cuda_descriptor(descriptor):
        if not on_device:
            raise ValueError("host pool cannot write into a device pool")
        return attach_cuda_pool(layout, descriptor)
    if on_device:
        raise ValueError("device pool cannot write into a host pool")
    return attach_shm_pool(layout, descriptor)
