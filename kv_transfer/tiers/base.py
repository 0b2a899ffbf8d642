"""What every KV tier is: a bounded store of records (tiers/record.py) by 32-byte key,
and the counters it keeps.

A tier stores and returns opaque record bytes; checking them is the caller's job
(tiers/cache.py decodes every record it reads), so a tier never has to trust its
medium. `get` returns None for a block it does not have *and* for one it could not
read: a tier never raises to its caller; what went wrong is counted (`TierStats`)
and logged once per reason.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kv_transfer.tiers.record import MissReason

log = logging.getLogger(__name__)


class KVTier(Protocol):
    """One tier. Thread-safe: the engine loop reads while the writer thread writes."""

    name: str  # host | disk | remote: the metric label
    location: str  # what names the store to the router: a directory, a server (no credentials)
    capacity: int  # bytes it holds at most; 0: the store's own bound
    stats: TierStats

    def get(self, key: bytes, into: memoryview | None = None) -> bytes | memoryview | None:
        """The record stored under `key`, or None (absent or unreadable: counted).

        `into`: a buffer of a sound record's size the caller owns; a tier that can read
        straight into it does so and returns (a view of) it, saving an allocation and a
        copy per block. Any other tier, or a stored record of another size, returns
        bytes as without it; either way the caller checks what came back."""

    def put(self, key: bytes, record: bytes) -> bool:
        """Store `record` under `key` (evicting as the bound needs); False if it could
        not be written (counted). Writing a key another writer stored is harmless."""

    def contains(self, key: bytes) -> bool:
        """Whether `key` is stored: the writer's cheap check before a write."""

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of `keys` is stored: the existence check that promises blocks
        before they are read (`TieredKVCache.present`, on the engine's step loop), so one
        round trip for all of them where the store is remote; a tier that cannot be asked
        counts an unavailable miss, as `get` does, and has none of them."""

    def discard(self, key: bytes) -> None:
        """Drop what is stored under `key` (a bad record, so a sound one can replace it)."""

    def watch_evictions(self, sink: Callable[[list[bytes]], None]) -> bool:
        """Call `sink` with the keys of the records this process's bound enforcement
        deletes (on the thread that wrote); False for a tier whose evictions this process
        never sees (remote: the server's own)."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class TierSnapshot:
    """A tier's counters at one moment (what the metrics collector reads)."""

    name: str
    hits: int
    misses: dict[str, int]  # MissReason value -> count
    bytes_read: int
    bytes_written: int
    writes: int
    write_failures: int
    evictions: int
    stored_bytes: int


@dataclass
class TierStats:
    """Counters of one tier; every method takes the lock (two threads count)."""

    name: str
    hits: int = 0
    misses: dict[str, int] = field(default_factory=dict)
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    write_failures: int = 0
    evictions: int = 0
    stored_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _logged: set[str] = field(default_factory=set, repr=False)

    def hit(self, nbytes: int) -> None:
        with self._lock:
            self.hits += 1
            self.bytes_read += nbytes

    def miss(self, reason: MissReason, detail: str = "") -> None:
        with self._lock:
            self.misses[reason.value] = self.misses.get(reason.value, 0) + 1
            first = reason is not MissReason.ABSENT and reason.value not in self._logged
            self._logged.add(reason.value)
        if first:  # once per tier and reason; the counter says how often
            log.warning("KV %s tier: %s block treated as a miss (recomputed)%s; further ones are "
                        "only counted", self.name, reason.value, f": {detail}" if detail else "")

    def wrote(self, nbytes: int) -> None:
        with self._lock:
            self.writes += 1
            self.bytes_written += nbytes

    def write_failed(self, detail: str) -> None:
        with self._lock:
            self.write_failures += 1
            first = "write" not in self._logged
            self._logged.add("write")
        if first:
            log.warning("KV %s tier: a block could not be written (%s); further failures are only "
                        "counted", self.name, detail)

    def evicted(self, count: int, nbytes: int) -> None:
        with self._lock:
            self.evictions += count
            self.stored_bytes = max(0, self.stored_bytes - nbytes)

    def set_stored(self, nbytes: int) -> None:
        with self._lock:
            self.stored_bytes = nbytes

    def snapshot(self) -> TierSnapshot:
        with self._lock:
            return TierSnapshot(self.name, self.hits, dict(self.misses), self.bytes_read,
                                self.bytes_written, self.writes, self.write_failures,
                                self.evictions, self.stored_bytes)
