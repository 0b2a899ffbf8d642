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

Every copy runs on the pool's own copy stream, created on the pool's device
(whatever the current device is), ordered after the compute stream's `ready`
event (`send_layer(i, ready=)`); the sender waits for the copy's event outside
its lock before announcing a chunk, so the receiver's verification sees the
copied bytes. A peer's handle is opened on the device that owns it (named in the
descriptor). The same ops move a device pool over plain tcp through pinned host
staging buffers (staging.py).

cupy is imported lazily, only here; without it (or without a GPU) nothing in
kv_transfer needs this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kv_transfer.checksum import word_dtype
from kv_transfer.pool.blocks import numpy_dtype
from kv_transfer.pool.protocol import PoolOps
from kv_transfer.pool.staging import StartedCopy, frame_sums
from kv_transfer.wire import ShmDescriptor
from pdserve.common.kv_layout import KVLayout

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
                 memory: Any, opened_ptr: int | None, device: int = 0) -> None:
        self.array = array
        self.device = device
        self.descriptor = descriptor
        self.owner = owner
        self._memory = memory
        self._opened_ptr = opened_ptr

    def close(self) -> None:
        self.array = None
        if self._opened_ptr is not None:
            with _cupy().cuda.Device(self.device):  # the device it was opened on
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
    return CudaPool(array, ShmDescriptor(name, shape, dtype.name), True, memory, None, device)


def owner_device(descriptor: ShmDescriptor, device: int | None = None) -> int:
    """The device to open a peer's handle on: the owner's (named in the descriptor), not
    whatever device happens to be current; `device` overrides it."""
    if not is_cuda_descriptor(descriptor):
        raise ValueError("not a CUDA IPC descriptor")
    index, sep, handle = descriptor.name[len(PREFIX):].partition(":")
    if not sep or not index.isdigit() or not handle:
        raise ValueError(f"malformed CUDA IPC descriptor {descriptor.name[:40]!r}")
    return int(index) if device is None else device


def attach_cuda_pool(layout: KVLayout, descriptor: ShmDescriptor, device: int | None = None
                     ) -> CudaPool:
    """Map a peer's device pool into this process, on its owner's device (or `device`)."""
    cp = _cupy()
    if not is_cuda_descriptor(descriptor):
        raise ValueError("not a CUDA IPC descriptor")
    dtype = np.dtype(descriptor.dtype)
    shape = tuple(descriptor.shape)
    if dtype != numpy_dtype(layout) or len(shape) != 6 or shape != layout.pool_shape(shape[2]):
        raise ValueError("device pool does not match the layout")
    dev = owner_device(descriptor, device)
    hex_handle = descriptor.name[len(PREFIX):].split(":", 1)[1]
    nbytes = int(np.prod(shape)) * dtype.itemsize
    with cp.cuda.Device(dev):
        ptr = cp.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(hex_handle))
        memory = cp.cuda.UnownedMemory(ptr, nbytes, None, dev)
        array = cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(memory, 0))
    return CudaPool(array, descriptor, False, memory, ptr, dev)


class CudaEvent:
    """`streams.CopyEvent` over a cupy event."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def synchronize(self) -> None:
        self._event.synchronize()

    def query(self) -> bool:
        return bool(self._event.done)


class CudaStream:
    """`streams.CopyStream`: a non-blocking cupy stream on one device."""

    def __init__(self, device: int) -> None:
        self.device = device
        with _cupy().cuda.Device(device):
            self.stream = _cupy().cuda.Stream(non_blocking=True)

    def wait(self, ready: Any) -> None:
        if ready is None:
            return
        handle = getattr(ready, "cuda_event", None)  # a torch.cuda.Event
        if handle is None:
            handle = ready.ptr  # a cupy Event
        _cupy().cuda.runtime.streamWaitEvent(self.stream.ptr, handle, 0)

    def record(self) -> CudaEvent:
        cp = _cupy()
        with cp.cuda.Device(self.device):
            event = cp.cuda.Event(block=False, disable_timing=True)
            event.record(self.stream)
        return CudaEvent(event)


class DevicePoolOps:
    """`staging.DeviceOps` for a C-contiguous cupy pool: every copy on the pool's own
    copy stream, on the pool's device."""

    on_device = True

    def __init__(self, array: Any) -> None:
        cp = _cupy()
        self.array = cp.asarray(array)  # accepts anything with __dlpack__/__cuda_array_interface__
        if not self.array.flags.c_contiguous:
            raise ValueError("device pool must be C-contiguous")
        self.device = int(self.array.device.id)
        self.copy_stream = CudaStream(self.device)
        shape = self.array.shape
        self._row_bytes = int(np.prod(shape[3:])) * self.array.dtype.itemsize
        raw = self.array.reshape(shape[:3] + (-1,)).view(np.uint8)
        self._words = raw.view(word_dtype(self._row_bytes))
        self._pinned: dict[int, np.ndarray] = {}  # receiver staging, by size (receiver lock)
        self.staged_bytes = 0

    def _on_stream(self) -> Any:
        """Run cupy work on this pool's device and copy stream."""
        return _OnStream(self.device, self.copy_stream.stream)

    def _device_sums(self, l0: int, l1: int, ids: Sequence[int]) -> Any:
        cp = _cupy()
        picked = self._words[l0:l1, :, cp.asarray(list(ids), dtype=cp.int64)]
        return picked.sum(axis=-1, dtype=cp.uint64)

    def row_sums(self, l0: int, l1: int, ids: Sequence[int]) -> np.ndarray:
        with self._on_stream():
            sums = self._device_sums(l0, l1, ids)
        event = self.copy_stream.record()
        event.synchronize()
        return np.asarray(sums.get(), dtype=np.uint64)

    def copy_to(self, dst: Any, l0: int, l1: int, src_ids: Sequence[int],
                dst_ids: Sequence[int]) -> np.ndarray:
        started = self.start_copy_to(dst, l0, l1, src_ids, dst_ids, None)
        started.event.synchronize()
        return started.sums()

    def start_copy_to(self, dst: PoolOps, l0: int, l1: int, src_ids: Sequence[int],
                      dst_ids: Sequence[int], ready: Any) -> StartedCopy:
        cp = _cupy()
        if not dst.on_device:
            raise ValueError("cannot copy a device pool into a host pool directly")
        src_nb, dst_nb = self.array.shape[2], dst.array.shape[2]
        height = (l1 - l0) * 2  # the (layer, K/V) rows of one block share one stride
        self.copy_stream.wait(ready)
        with self._on_stream():
            for s, d in zip(src_ids, dst_ids, strict=True):
                cp.cuda.runtime.memcpy2DAsync(
                    dst.array[l0, 0, d].data.ptr, dst_nb * self._row_bytes,
                    self.array[l0, 0, s].data.ptr, src_nb * self._row_bytes,
                    self._row_bytes, height, _MEMCPY_DEFAULT, self.copy_stream.stream.ptr)
            sums = self._device_sums(l0, l1, src_ids)  # same stream: after the copies
        event = self.copy_stream.record()
        return StartedCopy(event, lambda: np.asarray(sums.get(), dtype=np.uint64))

    def host_buffer(self, nbytes: int) -> np.ndarray:
        memory = _cupy().cuda.alloc_pinned_memory(nbytes)
        return np.frombuffer(memory, np.uint8, nbytes)  # the array keeps `memory` alive

    def _rows_2d(self, host: np.ndarray, l0: int, l1: int, ids: Sequence[int],
                 to_host: bool) -> None:
        """One strided copy per block between the pool and a host frame (pinned)."""
        cp = _cupy()
        n, nb, row = len(ids), self.array.shape[2], self._row_bytes
        base = host.ctypes.data
        for j, b in enumerate(ids):
            dev_ptr = self.array[l0, 0, b].data.ptr
            host_ptr = base + j * row
            dst, dpitch, src, spitch = ((host_ptr, n * row, dev_ptr, nb * row) if to_host
                                        else (dev_ptr, nb * row, host_ptr, n * row))
            cp.cuda.runtime.memcpy2DAsync(dst, dpitch, src, spitch, row, (l1 - l0) * 2,
                                          _MEMCPY_DEFAULT, self.copy_stream.stream.ptr)

    def start_gather(self, l0: int, l1: int, ids: Sequence[int], buffer: np.ndarray,
                     ready: Any) -> StartedCopy:
        self.copy_stream.wait(ready)
        with self._on_stream():
            self._rows_2d(buffer, l0, l1, ids, to_host=True)
        self.staged_bytes += buffer.nbytes
        event = self.copy_stream.record()
        return StartedCopy(event, lambda: frame_sums(buffer, l0, l1, len(ids)))

    def scatter_from_host(self, l0: int, l1: int, ids: Sequence[int],
                          frame: np.ndarray) -> np.ndarray:
        sums = frame_sums(frame, l0, l1, len(ids))
        staged = self._pinned.get(frame.nbytes)
        if staged is None:
            staged = self._pinned[frame.nbytes] = self.host_buffer(frame.nbytes)
        staged[...] = frame.reshape(-1).view(np.uint8)
        with self._on_stream():
            self._rows_2d(staged, l0, l1, ids, to_host=False)
        self.copy_stream.record().synchronize()  # the staging buffer is reused next frame
        self.staged_bytes += frame.nbytes
        return sums

    def flip_byte(self, layer: int, block: int) -> None:
        with self._on_stream():
            row = self.array[layer, 0, block].reshape(-1).view(np.uint8)
            row[0] ^= 0xFF
        self.copy_stream.record().synchronize()


class _OnStream:
    """`with cupy.cuda.Device(d), stream:` as one context manager."""

    def __init__(self, device: int, stream: Any) -> None:
        self._device = _cupy().cuda.Device(device)
        self._stream = stream

    def __enter__(self) -> None:
        self._device.__enter__()
        self._stream.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)
