"""CUDA IPC (GPU, same host): a device pool shared between processes by IPC handle.

The decode worker allocates its pool with `create_cuda_pool` -- one cudaMalloc,
so the IPC handle covers exactly the pool -- and gives the engine a torch view
of it (`tensor_adapter.tensor_from_dlpack(pool.array)`). A `ZmqReceiver` with
`transport="cuda"` advertises the handle once in its HelloAck (as a descriptor
named `cudaipc:<device>:<hex handle>`); a same-host sender whose own pool is a
device array maps it (`attach_cuda_pool`) and then only block ids and
checksums travel: blocks move with one cudaMemcpy2DAsync per block (the K/V
rows of consecutive layers of one block are equally strided), checksums are
computed on the device. The same lease rule as shared memory applies.

The sender synchronizes its stream before announcing a chunk, so the receiver's
verification sees the copied bytes. The prefill worker must call
`send_layer(i)` only once layer i's KV writes are complete on the device.

cupy is imported lazily, only here; without it (or without a GPU) nothing in
kv_transfer needs this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from common.kv_layout import KVLayout
from kv_transfer.blocks import numpy_dtype
from kv_transfer.checksum import word_dtype
from kv_transfer.wire import ShmDescriptor

PREFIX = "cudaipc:"
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: unified addressing picks the direction (and peer)


def _cupy() -> Any:
    import cupy

    return cupy


def cuda_available() -> bool:
    try:
        return bool(_cupy().cuda.runtime.getDeviceCount() > 0)
    except Exception:  # no cupy, no driver, no device: all mean "not available"
        return False


def is_cuda_descriptor(descriptor: ShmDescriptor) -> bool:
    return descriptor.name.startswith(PREFIX)


class CudaPool:
    """A device pool; `array` is a cupy array, `descriptor` goes to peers."""

    def __init__(self, array: Any, descriptor: ShmDescriptor, owner: bool,
                 memory: Any, opened_ptr: int | None) -> None:
        self.array = array
        self.descriptor = descriptor
        self.owner = owner
        self._memory = memory
        self._opened_ptr = opened_ptr

    def close(self) -> None:
        self.array = None
        if self._opened_ptr is not None:
            _cupy().cuda.runtime.ipcCloseMemHandle(self._opened_ptr)
            self._opened_ptr = None
        self._memory = None

    def unlink(self) -> None:
        """Nothing to unlink: device memory goes with its owner."""


def create_cuda_pool(layout: KVLayout, num_blocks: int, device: int = 0) -> CudaPool:
    cp = _cupy()
    shape = layout.pool_shape(num_blocks)
    dtype = numpy_dtype(layout)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    with cp.cuda.Device(device):
        memory = cp.cuda.Memory(nbytes)
        array = cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, 0))
        array.fill(0)
        handle = bytes(cp.cuda.runtime.ipcGetMemHandle(memory.ptr))
    name = f"{PREFIX}{device}:{handle.hex()}"
    return CudaPool(array, ShmDescriptor(name, shape, dtype.name), True, memory, None)


def attach_cuda_pool(layout: KVLayout, descriptor: ShmDescriptor, device: int | None = None
                     ) -> CudaPool:
    """Map a peer's device pool into this process (on `device`, default the current one)."""
    cp = _cupy()
    if not is_cuda_descriptor(descriptor):
        raise ValueError("not a CUDA IPC descriptor")
    dtype = np.dtype(descriptor.dtype)
    shape = tuple(descriptor.shape)
    if dtype != numpy_dtype(layout) or len(shape) != 6 or shape != layout.pool_shape(shape[2]):
        raise ValueError("device pool does not match the layout")
    owner_device, hex_handle = descriptor.name[len(PREFIX):].split(":", 1)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    dev = cp.cuda.Device().id if device is None else device
    with cp.cuda.Device(dev):
        ptr = cp.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(hex_handle))
        memory = cp.cuda.UnownedMemory(ptr, nbytes, None, dev)
        array = cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, 0))
    del owner_device  # the handle already names the owning device
    return CudaPool(array, descriptor, False, memory, ptr)


class DevicePoolOps:
    """`PoolOps` for a C-contiguous cupy pool."""

    on_device = True

    def __init__(self, array: Any) -> None:
        cp = _cupy()
        self.array = cp.asarray(array)  # accepts anything with __dlpack__/__cuda_array_interface__
        if not self.array.flags.c_contiguous:
            raise ValueError("device pool must be C-contiguous")
        shape = self.array.shape
        self._row_bytes = int(np.prod(shape[3:])) * self.array.dtype.itemsize
        raw = self.array.reshape(shape[:3] + (-1,)).view(np.uint8)
        self._words = raw.view(word_dtype(self._row_bytes))

    def row_sums(self, l0: int, l1: int, ids: Sequence[int]) -> np.ndarray:
        cp = _cupy()
        picked = self._words[l0:l1, :, cp.asarray(list(ids), dtype=cp.int64)]
        return np.asarray(picked.sum(axis=-1, dtype=cp.uint64).get(), dtype=np.uint64)

    def copy_to(self, dst: Any, l0: int, l1: int, src_ids: Sequence[int],
                dst_ids: Sequence[int]) -> np.ndarray:
        cp = _cupy()
        if not dst.on_device:
            raise ValueError("cannot copy a device pool into a host pool directly")
        stream = cp.cuda.get_current_stream()
        src_nb, dst_nb = self.array.shape[2], dst.array.shape[2]
        height = (l1 - l0) * 2  # the (layer, K/V) rows of one block share one stride
        for s, d in zip(src_ids, dst_ids, strict=True):
            src_ptr = self.array[l0, 0, s].data.ptr
            dst_ptr = dst.array[l0, 0, d].data.ptr
            cp.cuda.runtime.memcpy2DAsync(dst_ptr, dst_nb * self._row_bytes, src_ptr,
                                          src_nb * self._row_bytes, self._row_bytes, height,
                                          _MEMCPY_DEFAULT, stream.ptr)
        sums = self.row_sums(l0, l1, src_ids)  # same stream: ordered after the copies
        stream.synchronize()
        return sums

    def flip_byte(self, layer: int, block: int) -> None:
        row = self.array[layer, 0, block].reshape(-1).view(np.uint8)
        row[0] ^= 0xFF

