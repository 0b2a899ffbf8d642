"""The KV pool a CPU tensor-parallel group shares: one POSIX shared-memory segment
in the full (all KV heads) pool layout, mapped by every rank.

Each rank reads and writes only its own KV heads (a strided head slice of every
block), so the pool a prefill or decode worker ships or receives has the same layout
whatever its TP size, and a KV handoff between different TP sizes needs no remapping.
A segment this module creates is unlinked as soon as every rank has mapped it, so a
killed group leaks nothing.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets

import torch

from pdserve.engine.parallel.plan import HeadRange
from pdserve.engine.runner.kv_quant import KVCacheView, QuantizedCache

_DEV_SHM = "/dev/shm"


class SharedSegment:
    """A mapped segment; `tensor` is its first `nbytes` bytes as uint8."""

    def __init__(self, name: str, nbytes: int, create: bool) -> None:
        self.name = name
        path = os.path.join(_DEV_SHM, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            elif os.fstat(fd).st_size < nbytes:
                raise ValueError(f"shared pool {name} is smaller than {nbytes} bytes")
            self._mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self._owner = create
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes)

    def unlink(self) -> None:
        """Remove the name (the creator, once every rank has mapped it)."""
        if self._owner:
            self._owner = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(_DEV_SHM, self.name))


def create_segment(nbytes: int) -> SharedSegment:
    """A new zero-filled segment named after this process and a random suffix."""
    return SharedSegment(f"pdtp_{os.getpid()}_{secrets.token_hex(6)}", nbytes, create=True)


def attach_segment(name: str, nbytes: int) -> SharedSegment:
    if "/" in name or not name:
        raise ValueError(f"bad shared pool name {name!r}")
    return SharedSegment(name, nbytes, create=False)


def head_slice(view: KVCacheView, heads: HeadRange) -> KVCacheView:
    """A rank's KV heads of one layer's K (or V) pool view, [blocks, slot, heads, dim]
    (a quantized view: its codes and per-head scales alike); strided, never a copy."""
    if isinstance(view, QuantizedCache):
        return QuantizedCache(view.codes[:, :, heads.start:heads.stop], view.scales[:, heads.start:heads.stop],
                              view.kind)
    return view[:, :, heads.start:heads.stop]
