"""The tiers below a worker's KV pool, as one store the engine asks (pdserve/engine/pool_blocks.py).

    cache = TieredKVCache(layout, [host, disk, remote])
    payloads = cache.load(digests)   # the longest leading run found, checked: a row per block
    cache.offer(digest, payload)     # returns at once; the writer thread stores it

`load` asks the tiers in order (host, disk, remote) for each block of the chain and
stops at the first block none has, so what it returns is always a prefix. Every record
is read into its row of one buffer the load owns (a file tier reads straight into it:
no allocation or copy per block) and checked there against the key it was asked for
and the pool's block size (tiers/record.py): a corrupt, truncated or foreign record is
a miss of that tier, counted, and the next tier is asked. A block found below the
first tier is copied up (promoted) by the writer once the run is read; a bad record is
discarded, so the recomputed block replaces it.

The engine never calls `load` on its step loop: `present` (which leading blocks some
tier has, by a cheap existence check; a tier that cannot be asked, such as Redis down,
counts an unavailable miss) and `load_async` (the same `load` on the loader thread) let
an admission or a decode reservation promise the blocks at once and read them while
the loop steps on (pdserve/engine/tier_fill.py); a block that is gone or bad by then
ends the run that is returned (counted as that tier's miss: absent, corrupt, ...).

`offer` never blocks: the block joins a bounded queue; when the queue is full the
block is dropped (counted) rather than make a step wait. The writer thread encodes
each block once and writes it to every tier that lacks it.

With an event log (`events`, tiers/events.py; the worker's `--kv-events-config`) the
writer also reports each block it stored in a tier, once the write succeeded, and the
blocks this process's bound enforcement evicted from a file tier (host, disk) among
those it reported stored. Without one nothing is recorded.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kv_transfer.tiers.base import KVTier, TierSnapshot
from kv_transfer.tiers.events import TierEventLog
from kv_transfer.tiers.record import (
    HEADER_BYTES,
    block_payload_bytes,
    block_rows,
    check_record,
    encode_record,
    record_bytes,
    tier_key,
    tier_namespace,
)
from pdserve.common.kv_layout import KVLayout
from pdserve.common.queues import drained

log = logging.getLogger(__name__)

WRITER_NICE = 19  # the writer thread's nice value (lowest priority)
SPARE_READ_BUFFER_BYTES = 64 << 20  # the largest read buffer kept for the next load


@dataclass(frozen=True)
class CacheSnapshot:
    """The cache's counters: per tier, and of the loads and the write queue."""

    tiers: tuple[TierSnapshot, ...]
    loads: int  # load() calls that found at least one block
    loaded_blocks: int
    load_seconds: float  # total time those loads took
    dropped_writes: int  # blocks not written down because the queue was full
    queued_writes: int  # blocks queued or being written
    load_timeouts: int = 0  # loads the engine stopped waiting for (`timed_out`): recomputed


class _Write:
    __slots__ = ("digest", "key", "payload", "record", "tiers")

    def __init__(self, digest: bytes, key: bytes, payload: np.ndarray | None, record: bytes | memoryview | None,
                 tiers: Sequence[KVTier]) -> None:
        self.digest, self.key, self.payload, self.record, self.tiers = digest, key, payload, record, tiers


class ReadBuffers:
    """The loads' read buffers: one spare, reused once nothing references it any more.

    Reading into fresh memory faults in every page first (on the 2-core VM a 24 MB
    load read in ~5 ms into memory used before, 15-55 ms into fresh), and the loader
    reads one load at a time, so one spare covers the steady state. Whether the spare
    is free is its reference count: every view of it (a load's payload rows, a
    promotion's record, a tensor made from them) holds a reference to it, so a spare
    only the pool references has no reader left (CPython's reference counting)."""

    def __init__(self, record_bytes: int, max_spare_bytes: int = SPARE_READ_BUFFER_BYTES) -> None:
        self.record_bytes = record_bytes
        self.max_spare_bytes = max_spare_bytes
        self._spare: np.ndarray | None = None
        self._lock = threading.Lock()  # check-then-take: two loads never share a buffer

    def take(self, rows: int) -> np.ndarray:
        """A [rows, record bytes] uint8 buffer nothing else uses (its contents undefined)."""
        with self._lock:
            if (self._spare is not None and self._spare.shape[0] >= rows
                    and sys.getrefcount(self._spare) == 2):  # the attribute and the call's argument
                return self._spare[:rows]
            buf = np.empty((rows, self.record_bytes), np.uint8)
            if buf.nbytes <= self.max_spare_bytes and (self._spare is None or rows >= self._spare.shape[0]):
                self._spare = buf
            return buf


class TieredKVCache:
    """Tiers in lookup order; the writer thread starts with the cache."""

    def __init__(self, layout: KVLayout, tiers: Sequence[KVTier], max_queued: int = 256,
                 events: TierEventLog | None = None) -> None:
        if not tiers:
            raise ValueError("a tiered KV cache needs at least one tier")
        self.layout = layout
        self.tiers = list(tiers)
        self.namespace = tier_namespace(layout)
        self.payload_bytes = block_payload_bytes(layout)
        self.record_bytes = record_bytes(layout)
        self.num_rows = block_rows(layout)
        self._queue: queue.Queue[_Write | None] = queue.Queue(max_queued)
        self._lock = threading.Lock()
        self._loads = self._loaded_blocks = self._dropped = self._timeouts = 0
        self._load_seconds = 0.0
        self._events = events
        # Per tier whose evictions this process sees: key -> digest of each block reported
        # stored and not yet evicted (writer thread only), so an eviction names digests.
        self._reported: dict[str, dict[bytes, bytes]] = {}
        if events is not None:
            for tier in self.tiers:
                if tier.watch_evictions(functools.partial(self._evicted, tier.name)):
                    self._reported[tier.name] = {}
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-tier-loader")
        self._buffers = ReadBuffers(self.record_bytes)

    def key(self, digest: bytes) -> bytes:
        return tier_key(self.namespace, digest)

    # ------------------------------------------------------- engine (and loader)
    def load(self, digests: Sequence[bytes]) -> np.ndarray:
        """Payloads of the longest leading run of `digests` some tier holds, checked: one
        row per block, [blocks, payload bytes] uint8 (rows of one buffer the caller owns)."""
        t0 = time.perf_counter()
        # Every record is read straight into its row of one buffer and checked there: no
        # allocation or copy per block (each was a fresh ~200 KB buffer to fault in).
        records = self._buffers.take(len(digests))
        promote: list[tuple[bytes, bytes, int, int]] = []  # (digest, key, row, tier): below the top
        n = 0
        for digest in digests:
            key = self.key(digest)
            served = self._load_one(key, records[n])
            if served is None:
                break
            if served:
                promote.append((digest, key, n, served))
            n += 1
        # Promotions are queued once the whole run is read, so the writer's work never
        # competes with this read; it copies each checked record out of the read buffer,
        # which nobody writes once the load returns (the engine only copies it out).
        for digest, key, row, served in promote:
            self._enqueue(_Write(digest, key, None, records[row].data.toreadonly(), self.tiers[:served]))
        if n:
            with self._lock:
                self._loads += 1
                self._loaded_blocks += n
                self._load_seconds += time.perf_counter() - t0
        return records[:n, HEADER_BYTES:]

    def present(self, digests: Sequence[bytes]) -> int:
        """How many leading `digests` some tier holds (an existence check, not a read)."""
        for n, digest in enumerate(digests):
            key = self.key(digest)
            if not any(tier.contains(key, lookup=True) for tier in self.tiers):
                return n
        return len(digests)

    def load_async(self, digests: Sequence[bytes]) -> concurrent.futures.Future[np.ndarray]:
        """`load(digests)` on the loader thread."""
        return self._loader.submit(self.load, list(digests))

    def timed_out(self, digests: Sequence[bytes]) -> None:
        """The engine gave up waiting for a `load_async` of `digests` (counted; the loader
        thread's late result is ignored and its blocks are recomputed)."""
        with self._lock:
            self._timeouts += 1

    def _load_one(self, key: bytes, row: np.ndarray) -> int | None:
        """Fill `row` (one record's bytes) with `key`'s record from the first tier that
        has a sound one: that tier's index; None if none has."""
        into = row.data
        for i, tier in enumerate(self.tiers):
            record = tier.get(key, into)
            if record is None:
                continue
            miss = check_record(record, key, self.payload_bytes, self.num_rows)
            if miss is not None:
                tier.stats.miss(miss, f"key {key.hex()[:16]}")
                tier.discard(key)  # the recomputed block takes its place
                continue
            if record is not into:  # the tier's own bytes (immutable, so still the checked ones)
                row[:] = np.frombuffer(record, np.uint8)
            tier.stats.hit(len(record))
            return i
        return None

    def offer(self, digest: bytes, payload: np.ndarray) -> bool:
        """Queue one computed block (its raw bytes, owned by the cache from now on) for
        the tiers; False if the queue was full and it was dropped (counted)."""
        return self._enqueue(_Write(digest, self.key(digest), payload, None, self.tiers))

    def _enqueue(self, item: _Write) -> bool:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:
                self._dropped += 1
            return False
        return True

    # -------------------------------------------------------------------- writer
    def _write_loop(self) -> None:
        # The writer yields the CPU to the step loop's threads: on a host whose cores the
        # torch threads fill, a write-down must not slow the steps (Linux: per thread).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(item)
            except Exception:  # a writer that dies would silently stop all write-down
                log.exception("KV tier writer: a block was not written")
            finally:
                self._queue.task_done()
                item = None  # a promotion's view of a read buffer: let the buffer be reused

    def _write(self, item: _Write) -> None:
        # A promoted record is a view of a load's buffer: copied here, off the loader.
        record = item.record.tobytes() if isinstance(item.record, memoryview) else item.record
        for tier in item.tiers:
            if tier.contains(item.key):
                continue
            if record is None:
                assert item.payload is not None
                record = encode_record(item.key, item.payload, self.num_rows)
            if tier.put(item.key, record) and self._events is not None:
                self._stored(tier.name, item.key, item.digest)

    def _stored(self, tier: str, key: bytes, digest: bytes) -> None:
        assert self._events is not None
        reported = self._reported.get(tier)
        if reported is not None:
            reported[key] = digest
        self._events.stored(tier, digest)

    def _evicted(self, tier: str, keys: list[bytes]) -> None:
        """A file tier's bound enforcement deleted `keys` (writer thread, inside `put`):
        the blocks among them this cache reported stored are reported removed."""
        assert self._events is not None
        reported = self._reported[tier]
        digests = [d for k in keys if (d := reported.pop(k, None)) is not None]
        if digests:
            self._events.removed(tier, digests)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block is written (tests, shutdown); False on timeout."""
        return drained(self._queue, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (up to `timeout_s`), stop the writer, close the tiers."""
        self.flush(timeout_s)
        self._loader.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self._writer.join(timeout=2.0)
        for tier in self.tiers:
            tier.close()

    def snapshot(self) -> CacheSnapshot:
        with self._lock:
            loads, blocks, secs, dropped, timeouts = (self._loads, self._loaded_blocks,
                                                      self._load_seconds, self._dropped, self._timeouts)
        return CacheSnapshot(tuple(t.stats.snapshot() for t in self.tiers), loads, blocks, secs,
                             dropped, self._queue.unfinished_tasks, timeouts)
