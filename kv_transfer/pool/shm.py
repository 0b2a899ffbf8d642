"""A KV pool inside a named POSIX shared-memory segment (CPU, same host).

The decode worker creates its pool here (`create_shm_pool`) and hands the numpy
view to its engine as the pool buffer; the receiver advertises the segment's
`descriptor` in its handshake, and a same-host sender attaches to it
(`attach_shm_pool`) to copy blocks straight into reserved destination blocks.

Names carry the creator's pid and a random suffix, so instances never collide.
Only the creator unlinks the segment; an attacher only unmaps it (attaching via
/dev/shm directly keeps Python's resource tracker from unlinking a segment it
does not own when the attaching process exits). A creator killed with -9
cannot unlink; the next pool or liveness lock created on the host sweeps such
segments and lock files (`sweep_stale_segments`: our own name pattern, dead
creator pid only), and `pdserve up` removes those of a worker it saw die
(`remove_segments_of`) before it starts the replacement.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import weakref
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np

from kv_transfer.pool.blocks import check_pool, numpy_dtype
from kv_transfer.wire import ShmDescriptor
from pdserve.common.kv_layout import KVLayout
from pdserve.common.pids import pid_alive

_DEV_SHM = "/dev/shm"
_PREFIX = "pdkv"
_SUFFIX_HEX = 6  # bytes of random suffix
_LIVE_PREFIX = "pdkvlive"
# Exactly the names `create_shm_pool` and `LivenessLock` make; nothing else is ever swept.
_NAME = re.compile(rf"^(?:{_PREFIX}|{_LIVE_PREFIX})_([1-9][0-9]{{0,9}})_[0-9a-f]{{{2 * _SUFFIX_HEX}}}$")

log = logging.getLogger(__name__)


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


class LivenessLock:
    """A file in /dev/shm this process holds an exclusive `flock` on for its life.

    A shared-memory receiver that opens it can tell for certain when the sender
    is gone: the kernel drops the lock only when every descriptor of the holder
    is closed, i.e. after `close` (when the sender has stopped writing) or on
    death. A live writer can never look dead.

    The file is removed by `close`; at interpreter exit only its name is (the
    descriptor, and so the lock, lives until the process is gone: a daemon I/O
    thread may still be writing), and a process killed outright leaves it to the
    sweep the next lock or pool created in the same directory runs."""

    def __init__(self, shm_dir: str = _DEV_SHM) -> None:
        sweep_stale_segments(shm_dir)
        self.name = f"{_LIVE_PREFIX}_{os.getpid()}_{secrets.token_hex(_SUFFIX_HEX)}"
        self._path = os.path.join(shm_dir, self.name)
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._unlink = weakref.finalize(self, _unlink_own, self._path, os.getpid())

    @classmethod
    def create(cls) -> LivenessLock | None:
        """None where there is no /dev/shm (the receiver then relies on leases alone)."""
        try:
            return cls()
        except OSError:
            return None

    def close(self) -> None:
        if self._fd >= 0:
            self._unlink()
            os.close(self._fd)
            self._fd = -1


def _unlink_own(path: str, creator: int) -> None:
    """Remove a liveness lock's name, in its creator only (never in a forked child)."""
    if os.getpid() == creator:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def watch_liveness(name: str, shm_dir: str = _DEV_SHM) -> int | None:
    """A descriptor on a peer's `LivenessLock`, if it names one held by a live process now."""
    if _NAME.match(name) is None or not name.startswith(_LIVE_PREFIX):
        return None
    try:
        fd = os.open(os.path.join(shm_dir, name), os.O_RDONLY)
    except OSError:
        return None
    if lock_holder_gone(fd):
        os.close(fd)
        return None  # nobody holds it: it proves nothing about the peer
    return fd


def lock_holder_gone(fd: int) -> bool:
    """True once the process that held the lock behind `fd` has closed it or died."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def sweep_stale_segments(shm_dir: str = _DEV_SHM) -> list[str]:
    """Unlink pool segments (`pdkv_<pid>_<hex>`) and liveness locks whose creator process
    is gone; return their names.

    A live pid keeps its segment, even if the pid was reused by an unrelated
    process: a leaked segment is cheaper than unlinking one a live worker owns.
    Names of any other pattern are never touched."""
    return _sweep(shm_dir, lambda pid: not pid_alive(pid))


def remove_segments_of(pid: int, shm_dir: str = _DEV_SHM) -> list[str]:
    """`sweep_stale_segments` for one dead process only: the pool segments and liveness
    locks `pid` created (a worker killed with -9 cannot unlink them); none while it lives."""
    return _sweep(shm_dir, lambda creator: creator == pid and not pid_alive(pid))


def _sweep(shm_dir: str, dead: Callable[[int], bool]) -> list[str]:
    """Unlink our names in `shm_dir` whose creator pid `dead` says is gone."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    for name in names:
        m = _NAME.match(name)
        if m is None or not dead(int(m.group(1))):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
        except FileNotFoundError:
            continue  # another sweeper was first
        except OSError as e:
            log.warning("cannot remove stale shared-memory segment %s: %s", name, e)
            continue
        removed.append(name)
    if removed:
        log.info("removed %d stale shared-memory segment(s) of dead workers", len(removed))
    return removed


def create_shm_pool(layout: KVLayout, num_blocks: int, sweep: bool = True) -> ShmPool:
    """Create a zero-filled pool of `num_blocks` blocks in a new shared-memory segment,
    first sweeping segments left by dead workers (`sweep`)."""
    if sweep:
        sweep_stale_segments()
    shape = layout.pool_shape(num_blocks)
    dtype = numpy_dtype(layout)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    name = f"{_PREFIX}_{os.getpid()}_{secrets.token_hex(_SUFFIX_HEX)}"
    shm = _create_segment(name, nbytes)
    try:
        array: np.ndarray = np.ndarray(shape, dtype=dtype, buffer=shm.buf)
        array[...] = 0
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    return ShmPool(array, ShmDescriptor(name, shape, dtype.name), True, shm, None)


def _create_segment(name: str, nbytes: int) -> shared_memory.SharedMemory:
    """A new segment readable and writable by this user only (0600), whatever the umask
    or the library's default mode: the pool holds every request's KV, so a same-host
    sender must run as the same user to attach."""
    if not os.path.isdir(_DEV_SHM):  # pragma: no cover - non-Linux
        return shared_memory.SharedMemory(name=name, create=True, size=nbytes)
    path = os.path.join(_DEV_SHM, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        return shared_memory.SharedMemory(name=name)  # maps it (and unlinks it at exit, as before)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


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
