"""The decode receiver's descriptors on same-host senders' liveness locks.

A sender that writes KV straight into the shared-memory pool names, in its Hello, a
`LivenessLock` it holds for its whole life (kv_transfer/pool/shm.py); the receiver
keeps a descriptor on it, so a cancelled transfer is released as soon as its writer
is known dead instead of at its lease. Each descriptor is a file a peer made this
process open, so the table is bounded and emptied as peers go:

* at most `capacity` descriptors; a Hello past that evicts the oldest entry no live
  reservation uses, and if every entry is in use the newcomer gets none (and so no
  direct writes: its KV travels as frames);
* a peer's new Hello replaces its old descriptor;
* `sweep` closes every descriptor whose lock holder has gone and no live reservation
  still asks about (a reservation that does is settled first, by `holder_gone`);
* `close` closes them all.

ZeroMQ does not tell a ROUTER when a peer disconnects (ROUTER_NOTIFY is a draft
API), so "a peer has gone" is read from its lock: a sender releases it when it
closes or dies. A peer that keeps its lock but stops talking holds at most one
entry per connection, and the cap bounds those.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Set

from kv_transfer.pool.shm import lock_holder_gone, watch_liveness

DEFAULT_CAPACITY = 64


class LivenessTable:
    """Peer -> descriptor on its liveness lock; not thread-safe (the receiver lock guards it)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 watch: Callable[[str], int | None] = watch_liveness) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._watch = watch
        self._fds: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._fds)

    def watch(self, peer: bytes, name: str, in_use: Set[bytes]) -> bool:
        """Hold a descriptor on the lock `peer` names; True if one is held now (the lock
        exists and a live process holds it, and there was room). `in_use`: peers of live
        reservations, never evicted."""
        self.drop(peer)
        fd = self._watch(name) if name else None
        if fd is None:
            return False
        if len(self._fds) >= self.capacity and not self._evict_one(in_use):
            os.close(fd)
            return False
        self._fds[peer] = fd
        return True

    def holder_gone(self, peer: bytes | None) -> bool:
        """True once `peer`'s lock is released (False for a peer with no descriptor)."""
        fd = self._fds.get(peer) if peer is not None else None
        return fd is not None and lock_holder_gone(fd)

    def drop(self, peer: bytes) -> None:
        fd = self._fds.pop(peer, None)
        if fd is not None:
            os.close(fd)

    def sweep(self, in_use: Set[bytes]) -> int:
        """Close the descriptors of peers that have gone and that no live reservation
        uses; how many were closed."""
        gone = [peer for peer, fd in self._fds.items() if peer not in in_use and lock_holder_gone(fd)]
        for peer in gone:
            self.drop(peer)
        return len(gone)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _evict_one(self, in_use: Set[bytes]) -> bool:
        victim = next((peer for peer in self._fds if peer not in in_use), None)
        if victim is None:
            return False
        self.drop(victim)
        return True
