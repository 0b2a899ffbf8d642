"""The staging path: a device pool (one the host cannot read) over plain tcp.

Prefill side: a chunk of layers [l0, l1) of some blocks is copied device -> host
into a pinned staging buffer on the pool's copy stream, ordered after the event
the compute stream recorded once those layers were written (`send_layer(...,
ready=)`), so layer i travels while layer i + 1 computes; the sender waits for
the copy outside its lock, checksums the host frame and sends it inline. Decode
side: an inline frame is checksummed on the host and copied host -> device into
the reserved blocks. The frame format and the checksums are those of host pools,
so a host sender and a device receiver (or the reverse) interoperate.

`DeviceOps` is what the transfer layer asks of a device pool: the CUDA version
is `cuda_ipc.DevicePoolOps`; `HostStagedOps` is its CPU test double, for a
`HiddenHostPool` -- host memory that reports itself as not host-visible, so CI
runs the very same sender and receiver code as a GPU pod would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from kv_transfer.checksum import block_row_sums, pool_words, row_sums
from kv_transfer.pool.blocks import gather, scatter
from kv_transfer.pool.protocol import PoolOps
from kv_transfer.pool.streams import CopyEvent, HostStream


class StartedCopy(NamedTuple):
    """A copy enqueued on a copy stream: `event` completes with it; `sums()` (call only
    after that) are the row sums of what was copied, in frame row order."""

    event: CopyEvent
    sums: Callable[[], np.ndarray]


class DeviceOps(PoolOps, Protocol):
    """`PoolOps` of a device pool, plus the asynchronous copies of the staging path."""

    staged_bytes: int  # bytes moved through host staging buffers, both directions

    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A flat uint8 host buffer copies can use asynchronously (pinned on CUDA)."""
        ...

    def start_gather(self, l0: int, l1: int, ids: Sequence[int], buffer: np.ndarray,
                     ready: Any) -> StartedCopy:
        """Enqueue device -> host: layers [l0, l1) of `ids` into `buffer` as one frame."""
        ...

    def start_copy_to(self, dst: PoolOps, l0: int, l1: int, src_ids: Sequence[int],
                      dst_ids: Sequence[int], ready: Any) -> StartedCopy:
        """Enqueue a device -> device block copy into a mapped peer pool."""
        ...

    def scatter_from_host(self, l0: int, l1: int, ids: Sequence[int],
                          frame: np.ndarray) -> np.ndarray:
        """Host -> device: write a frame into blocks `ids` (complete on return); the
        frame's row sums."""
        ...


def frame_sums(frame: np.ndarray, l0: int, l1: int, num_blocks: int) -> np.ndarray:
    """Row sums of a host frame of layers [l0, l1) of `num_blocks` blocks."""
    return row_sums(frame, (l1 - l0) * 2 * num_blocks).reshape(l1 - l0, 2, num_blocks)


class HiddenHostPool:
    """A host pool that the transfer layer must treat as device memory (test double).

    `array` is the real storage (a C-contiguous numpy pool, e.g. a CPU engine's KV
    tensor seen through numpy); nothing but `HostStagedOps` touches it."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.stream = HostStream()


class HostStagedOps:
    """`DeviceOps` for a `HiddenHostPool`: each copy goes through a host staging
    buffer exactly where a device pool's would, on a `HostStream`."""

    on_device = True

    def __init__(self, pool: HiddenHostPool) -> None:
        self.array = pool.array
        self.stream = pool.stream
        self._words = pool_words(pool.array)
        self.staged_bytes = 0

    def row_sums(self, l0: int, l1: int, ids: Sequence[int]) -> np.ndarray:
        return block_row_sums(self._words, l0, l1, ids)

    def copy_to(self, dst: PoolOps, l0: int, l1: int, src_ids: Sequence[int],
                dst_ids: Sequence[int]) -> np.ndarray:
        started = self.start_copy_to(dst, l0, l1, src_ids, dst_ids, None)
        started.event.synchronize()
        return started.sums()

    def flip_byte(self, layer: int, block: int) -> None:
        self.array[layer, 0, block].reshape(-1).view(np.uint8)[0] ^= 0xFF

    def host_buffer(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def start_gather(self, l0: int, l1: int, ids: Sequence[int], buffer: np.ndarray,
                     ready: Any) -> StartedCopy:
        self.stream.wait(ready)
        frame = gather(self.array, l0, l1, ids, buffer)
        self.staged_bytes += frame.nbytes
        return StartedCopy(self.stream.record(), lambda: frame_sums(frame, l0, l1, len(ids)))

    def start_copy_to(self, dst: PoolOps, l0: int, l1: int, src_ids: Sequence[int],
                      dst_ids: Sequence[int], ready: Any) -> StartedCopy:
        if not isinstance(dst, HostStagedOps):
            raise ValueError("a hidden host pool copies only into another one")
        self.stream.wait(ready)
        sums = self.row_sums(l0, l1, src_ids)
        frame = gather(self.array, l0, l1, src_ids)
        scatter(dst.array, l0, l1, dst_ids, frame)
        return StartedCopy(self.stream.record(), lambda: sums)

    def scatter_from_host(self, l0: int, l1: int, ids: Sequence[int],
                          frame: np.ndarray) -> np.ndarray:
        sums = frame_sums(frame, l0, l1, len(ids))
        staged = self.host_buffer(frame.nbytes)
        staged[...] = frame.reshape(-1).view(np.uint8)  # the pinned staging copy a device pool makes
        shape = (l1 - l0, 2, len(ids)) + self.array.shape[3:]
        scatter(self.array, l0, l1, ids, staged.view(self.array.dtype).reshape(shape))
        self.stream.record().synchronize()
        self.staged_bytes += frame.nbytes
        return sums
