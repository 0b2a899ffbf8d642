"""A KV pool inside a named POSIX shared-memory segment (CPU, same host).

The decode worker creates its pool here (`create_shm_pool`) and hands the numpy
view to its engine as the pool buffer; the receiver advertises the segment's
`descriptor` in its handshake, and a same-host sender attaches to it
(`attach_shm_pool`) to copy blocks straight into reserved destination blocks.

Names carry the creator's pid and a random suffix, so instances never collide.
Only the creator unlinks the segment; an attacher only unmaps it (attaching via
/dev/shm directly keeps Python's resource tracker from unlinking a segment it
does not own when the attaching process exits).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from multiprocessing import shared_memory

import numpy as np

from kv_transfer.blocks import check_pool, numpy_dtype
from kv_transfer.wire import ShmDescriptor
from pdserve.kv_layout import KVLayout

_DEV_SHM = "/dev/shm"


class ShmPool:
    """A pool array backed by shared memory. Use as a context manager or call close()."""

    def __init__(self, array: np.ndarray, descriptor: ShmDescriptor, owner: bool,
                 shm: shared_memory.SharedMemory | None, mm: mmap.mmap | None) -> None:
        self.array = array
        self.descriptor = descriptor
        self.owner = owner
        self._shm = shm
        self._mm = mm

    @property
    def num_blocks(self) -> int:
        return int(self.array.shape[2])

    def close(self) -> None:
        """Unmap this process's view (views still referenced elsewhere keep it mapped)."""
        self.array = np.empty(0, dtype=self.array.dtype)
        try:
            if self._shm is not None:
                self._shm.close()
            if self._mm is not None:
                self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes away with it

    def unlink(self) -> None:
        """Remove the segment name (creator only); existing mappings stay valid."""
        if self.owner and self._shm is not None:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()

    def __enter__(self) -> ShmPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.unlink()


def create_shm_pool(layout: KVLayout, num_blocks: int) -> ShmPool:
    """Create a zero-filled pool of `num_blocks` blocks in a new shared-memory segment."""
    shape = layout.pool_shape(num_blocks)
    dtype = numpy_dtype(layout)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    name = f"pdkv_{os.getpid()}_{secrets.token_hex(6)}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    array: np.ndarray = np.ndarray(shape, dtype=dtype, buffer=shm.buf)
    array[...] = 0
    return ShmPool(array, ShmDescriptor(name, shape, dtype.name), True, shm, None)


def attach_shm_pool(layout: KVLayout, descriptor: ShmDescriptor) -> ShmPool:
    """Map a peer's pool; ValueError if it does not match `layout`, OSError if absent."""
    dtype = np.dtype(descriptor.dtype)
    if dtype != numpy_dtype(layout) or len(descriptor.shape) != 6 \
            or tuple(descriptor.shape) != layout.pool_shape(descriptor.shape[2]):
        raise ValueError(f"shared pool {descriptor.shape}/{descriptor.dtype} does not match layout")
    if "/" in descriptor.name or not descriptor.name:
        raise ValueError("bad shared-memory name")
    nbytes = int(np.prod(descriptor.shape)) * dtype.itemsize
    if os.path.isdir(_DEV_SHM):
        fd = os.open(os.path.join(_DEV_SHM, descriptor.name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size < nbytes:
                raise ValueError("shared-memory segment smaller than its descriptor")
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        array: np.ndarray = np.ndarray(descriptor.shape, dtype=dtype, buffer=mm)
        check_pool(layout, array)
        return ShmPool(array, descriptor, False, None, mm)
    shm = shared_memory.SharedMemory(name=descriptor.name)  # pragma: no cover - non-Linux
    array = np.ndarray(descriptor.shape, dtype=dtype, buffer=shm.buf)
    return ShmPool(array, descriptor, False, shm, None)
