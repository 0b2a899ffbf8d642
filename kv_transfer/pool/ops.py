"""The pool operations for an array: host (numpy), staged and device pools.

`pool_ops(array)` returns the `PoolOps` (kv_transfer/pool/protocol.py): `HostPoolOps` for a numpy pool, the staging test double
for a `staging.HiddenHostPool`; any other array (a cupy array, e.g. a torch CUDA
pool seen through DLPack) gets the CUDA implementation from `kv_transfer.pool.cuda_ipc`,
imported only then, so CPU-only installs never import cupy. Device pools
(`on_device`) also implement `staging.DeviceOps`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kv_transfer.checksum import block_row_sums, pool_words
from kv_transfer.pool import hostcopy
from kv_transfer.pool.blocks import copy_blocks_with_sums, native_for, row_bytes
from kv_transfer.pool.copy_threads import CopyThreads
from kv_transfer.pool.protocol import PoolOps
from kv_transfer.pool.staging import HiddenHostPool, HostStagedOps


class HostPoolOps:
    on_device = False

    def __init__(self, array: np.ndarray, workers: CopyThreads | None = None) -> None:
        self.array = array
        self._words = pool_words(array)
        self._workers = workers

    def row_sums(self, l0: int, l1: int, ids: Sequence[int]) -> np.ndarray:
        native = native_for(self.array)
        if native is None:
            return block_row_sums(self._words, l0, l1, ids)
        sums = native.sum_rows(self.array, hostcopy.pool_row_offsets(self.array, l0, l1, ids),
                               row_bytes(self.array), self._workers)
        return sums.reshape(l1 - l0, 2, len(ids))

    def copy_to(self, dst: PoolOps, l0: int, l1: int, src_ids: Sequence[int],
                dst_ids: Sequence[int]) -> np.ndarray:
        if dst.on_device:
            raise ValueError("cannot copy a host pool into a device pool directly")
        return copy_blocks_with_sums(self.array, dst.array, self._words, l0, l1, src_ids,
                                     dst_ids, self._workers)

    def flip_byte(self, layer: int, block: int) -> None:
        self.array[layer, 0, block].reshape(-1).view(np.uint8)[0] ^= 0xFF


def pool_ops(array: Any, workers: CopyThreads | None = None) -> PoolOps:
    """Ops for `array`; host copies share their work with `workers` when given."""
    if isinstance(array, np.ndarray):
        return HostPoolOps(array, workers)
    if isinstance(array, HiddenHostPool):
        return HostStagedOps(array)
    from kv_transfer.pool.cuda_ipc import DevicePoolOps

    return DevicePoolOps(array)
