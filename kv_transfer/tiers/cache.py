"""The tiers below a worker's KV pool, as one store the engine asks (pdserve/engine/pool_blocks.py).

    cache = TieredKVCache(layout, [host, disk, remote])
    payloads = cache.load(digests)   # the longest leading run found, checked: a row per block
    cache.release(payloads)          # copied into the pool: the read buffer may be reused
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
tier has, by a cheap existence check: each tier asked once, `KVTier.lookup`, one
round trip to Redis; a tier that cannot be asked, such as Redis down,
counts an unavailable miss) and `load_async` (the same `load` on the loader thread) let
an admission or a decode reservation promise the blocks at once and read them while
the loop steps on (pdserve/engine/tier_fill.py); a block that is gone or bad by then
ends the run that is returned (counted as that tier's miss: absent, corrupt, ...).

`offer` never blocks: the block joins a bounded queue; when the queue is full the
block is dropped (counted) rather than make a step wait. The writer thread encodes
each block once and writes it to every tier that lacks it.

With an event log (`events`, tiers/events.py; the worker's `--kv-events-config`) the
writer also reports each block it stored in a tier, once the write succeeded; and of
those it reported stored in a file tier (host, disk), the ones this process's bound
enforcement evicted, the bad records the loader discarded, and the oldest once more
were reported than the tier holds (`ReportedBlocks`: another worker sharing the tier
evicted it). Without one nothing is recorded.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
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
# The write queue's default bound, in bytes of queued blocks (at least 256 blocks): a burst
# of long prompts whose blocks wait for the writer (at nice 19 beside the step loop's busy
# threads) is kept, not dropped; 256 blocks were ~3 prompts of 2,000 tokens of a small model.
WRITE_QUEUE_BYTES = 256 << 20
MIN_QUEUED_WRITES = 256


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
    __slots__ = ("buffer", "digest", "key", "payload", "record", "tiers")

    def __init__(self, digest: bytes, key: bytes, payload: np.ndarray | None, record: bytes | memoryview | None,
                 tiers: Sequence[KVTier], buffer: np.ndarray | None = None) -> None:
        self.digest, self.key, self.payload, self.record, self.tiers = digest, key, payload, record, tiers
        self.buffer = buffer  # the read buffer a promotion's `record` views (ReadBuffers.promoted)


def owner_of(view: np.ndarray) -> np.ndarray:
    """The array that owns `view`'s memory (numpy points every view's `base` at it)."""
    return view if view.base is None else view.base  # type: ignore[return-value]


class ReadBuffers:
    """The loads' read buffers: one spare, reused once every reader of it said it is done.

    Reading into fresh memory faults in every page first (on the 2-core VM a 24 MB
    load read in ~5 ms into memory used before, 15-55 ms into fresh), and the loader
    reads one load at a time, so one spare covers the steady state. A buffer `take`
    hands out has two readers, and each says when it is done with it: the engine, which
    copies the load into its pool and then `release`s the payloads (TieredKVCache.release,
    from pdserve/engine/pool_blocks.py), and the writer, which copies each promoted
    record out of it (`promoting` counts them, `promoted` each one written). Until both
    are done the next load reads into a fresh buffer, which becomes the spare; a load the
    engine never copies in (its read timed out, its request ended) only keeps its buffer
    from being reused, and the garbage collector frees it with its last view."""

    def __init__(self, record_bytes: int, max_spare_bytes: int = SPARE_READ_BUFFER_BYTES) -> None:
        self.record_bytes = record_bytes
        self.max_spare_bytes = max_spare_bytes
        self._spare: np.ndarray | None = None
        self._leased = False  # the spare is handed out and the engine has not released it
        self._promotions = 0  # the spare's promoted records the writer has not copied yet
        self._lock = threading.Lock()  # check-then-take: two loads never share a buffer

    def take(self, rows: int) -> np.ndarray:
        """A [rows, record bytes] uint8 buffer nothing else uses (its contents undefined)."""
        with self._lock:
            spare = self._spare
            free = spare is not None and not self._leased and not self._promotions
            if free and spare is not None and spare.shape[0] >= rows:
                self._leased = True
                return spare[:rows]
            buf = np.empty((rows, self.record_bytes), np.uint8)
            if buf.nbytes <= self.max_spare_bytes and (spare is None or not free or rows >= spare.shape[0]):
                self._spare, self._leased, self._promotions = buf, True, 0
            return buf

    def release(self, view: np.ndarray) -> None:
        """The engine is done with the load `view` is (part of)."""
        with self._lock:
            if owner_of(view) is self._spare:
                self._leased = False

    def promoting(self, buffer: np.ndarray, records: int) -> None:
        """`records` promotions viewing `buffer` go to the writer."""
        with self._lock:
            if buffer is self._spare:
                self._promotions += records

    def promoted(self, buffer: np.ndarray) -> None:
        """The writer is done with one promotion from `buffer` (written or not)."""
        with self._lock:
            if buffer is self._spare:
                self._promotions -= 1


class ReportedBlocks:
    """Key -> digest of the blocks reported stored in one tier, oldest first, at most
    `limit` (thread-safe: the writer adds and evicts, the loader discards)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, key: bytes, digest: bytes) -> bytes | None:
        """Remember `key`; the digest of the oldest block it pushed out, if any."""
        with self._lock:
            self._blocks[key] = digest
            self._blocks.move_to_end(key)
            return self._blocks.popitem(last=False)[1] if len(self._blocks) > self.limit else None

    def pop(self, keys: Sequence[bytes]) -> list[bytes]:
        """Forget `keys`: the digests of those remembered."""
        with self._lock:
            return [d for k in keys if (d := self._blocks.pop(k, None)) is not None]


class TieredKVCache:
    """Tiers in lookup order; the writer thread starts with the cache."""

    def __init__(self, layout: KVLayout, tiers: Sequence[KVTier], max_queued: int = 0,
                 events: TierEventLog | None = None) -> None:
        if not tiers:
            raise ValueError("a tiered KV cache needs at least one tier")
        self.layout = layout
        self.tiers = list(tiers)
        self.namespace = tier_namespace(layout)
        self.payload_bytes = block_payload_bytes(layout)
        self.record_bytes = record_bytes(layout)
        self.num_rows = block_rows(layout)
        self.max_queued = max_queued or max(MIN_QUEUED_WRITES, WRITE_QUEUE_BYTES // self.record_bytes)
        self._queue: queue.Queue[_Write | None] = queue.Queue(self.max_queued)
        self._lock = threading.Lock()
        self._loads = self._loaded_blocks = self._dropped = self._timeouts = 0
        self._load_seconds = 0.0
        self._events = events
        # Per tier whose evictions this process sees: key -> digest of each block reported
        # stored and not yet evicted or discarded, so a removal names digests. At most as
        # many as the tier holds records: past that, the oldest was evicted by another
        # worker on the store (reported removed then).
        self._reported: dict[str, ReportedBlocks] = {}
        if events is not None:
            for tier in self.tiers:
                if tier.watch_evictions(functools.partial(self._evicted, tier.name)):
                    self._reported[tier.name] = ReportedBlocks(max(1, tier.capacity // self.record_bytes))
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        self._loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-tier-loader")
        self._buffers = ReadBuffers(self.record_bytes)

    def key(self, digest: bytes) -> bytes:
        return tier_key(self.namespace, digest)

    # ------------------------------------------------------- engine (and loader)
    def load(self, digests: Sequence[bytes]) -> np.ndarray:
        """Payloads of the longest leading run of `digests` some tier holds, checked: one
        row per block, [blocks, payload bytes] uint8 (rows of a read buffer: `release`
        them once copied, so the next load may reuse it)."""
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
        owner = owner_of(records)
        self._buffers.promoting(owner, len(promote))
        for digest, key, row, served in promote:
            if not self._enqueue(_Write(digest, key, None, records[row].data.toreadonly(), self.tiers[:served], owner)):
                self._buffers.promoted(owner)  # dropped: the writer never sees it
        if n:
            with self._lock:
                self._loads += 1
                self._loaded_blocks += n
                self._load_seconds += time.perf_counter() - t0
        return records[:n, HEADER_BYTES:]

    def release(self, payloads: np.ndarray) -> None:
        """The engine copied a load's `payloads` into its pool: their buffer may be reused."""
        self._buffers.release(payloads)

    def present(self, digests: Sequence[bytes]) -> int:
        """How many leading `digests` some tier holds (an existence check, not a read):
        each tier is asked once, for the blocks the tiers above it lack (one round trip
        to Redis whatever the prefix's length)."""
        keys = [self.key(d) for d in digests]
        found = [False] * len(keys)
        for tier in self.tiers:
            ask = [i for i, f in enumerate(found) if not f]
            if not ask:
                break
            for i, has in zip(ask, tier.lookup([keys[i] for i in ask]), strict=True):
                found[i] = has
        return found.index(False) if False in found else len(found)

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
                if tier.name in self._reported:
                    self._evicted(tier.name, [key])
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
                if item is not None and item.buffer is not None:
                    self._buffers.promoted(item.buffer)
                item = None
                self._queue.task_done()

    def _write(self, item: _Write) -> None:
        record = item.record
        for tier in item.tiers:
            if tier.contains(item.key):
                continue
            if record is None:
                assert item.payload is not None
                record = encode_record(item.key, item.payload, self.num_rows)
            elif isinstance(record, memoryview):  # a promotion's view of a read buffer: copied here, off the loader
                record = record.tobytes()
            if tier.put(item.key, record) and self._events is not None:
                self._stored(tier.name, item.key, item.digest)

    def _stored(self, tier: str, key: bytes, digest: bytes) -> None:
        assert self._events is not None
        self._events.stored(tier, digest)
        reported = self._reported.get(tier)
        if reported is not None and (oldest := reported.add(key, digest)) is not None:
            self._events.removed(tier, [oldest])

    def _evicted(self, tier: str, keys: list[bytes]) -> None:
        """A file tier's bound enforcement deleted `keys` (writer thread, inside `put`), or
        the loader discarded a bad record: the blocks among them this cache reported
        stored are reported removed."""
        assert self._events is not None
        digests = self._reported[tier].pop(keys)
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
