"""TieredKVCache (kv_transfer/tiers/cache.py): `offer` never waits on a write (a full
queue drops and counts), lookups stop at the first block no tier has, and a bad
record in one tier falls through to the next."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from kv_transfer.tiers.cache import TieredKVCache
from kv_transfer.tiers.files import FileTier
from kv_transfer.tiers.record import block_payload_bytes, decode_record
from pdserve.common.kv_layout import KVLayout

LAYOUT = KVLayout("cfg", 2, 2, 8, 4, "float32", weights="w")
SIZE = block_payload_bytes(LAYOUT)


def payload(i: int) -> np.ndarray:
    return np.full(SIZE, i, np.uint8)


class StuckTier(FileTier):
    """A file tier whose writes wait until released (a disk that stalls)."""

    def __init__(self, root: Path) -> None:
        super().__init__("disk", root, 1 << 30)
        self.release = threading.Event()

    def put(self, key: bytes, record: bytes) -> bool:
        self.release.wait(60)
        return super().put(key, record)


def test_offer_never_blocks_and_a_full_queue_drops_and_counts(tmp_path: Path) -> None:
    tier = StuckTier(tmp_path)
    cache = TieredKVCache(LAYOUT, [tier], max_queued=4)
    t0 = time.monotonic()
    results = [cache.offer(bytes([i]) * 32, payload(i)) for i in range(20)]
    assert time.monotonic() - t0 < 5  # nothing waited on the stalled tier
    # One may already sit in the writer's hands, 4 more in the queue; the rest dropped.
    assert 4 <= sum(results) <= 5 and cache.snapshot().dropped_writes == 20 - sum(results)
    tier.release.set()
    assert cache.flush()
    assert tier.stats.snapshot().writes == sum(results)
    cache.close()


def test_load_stops_at_the_first_missing_block_and_falls_through_bad_records(tmp_path: Path) -> None:
    host, disk = FileTier("host", tmp_path / "h", 1 << 30), FileTier("disk", tmp_path / "d", 1 << 30)
    cache = TieredKVCache(LAYOUT, [host, disk])
    digests = [bytes([i]) * 32 for i in range(4)]
    for i in (0, 1, 3):  # block 2 is nowhere: block 3 must not be served
        cache.offer(digests[i], payload(i))
    assert cache.flush()
    host.path(cache.key(digests[1])).write_bytes(b"junk")  # host's copy of block 1 is bad
    got = cache.load(digests)
    assert got.shape == (2, SIZE) and [int(p[0]) for p in got] == [0, 1]
    assert all((got[i] == payload(i)).all() for i in range(2))  # every byte, not just the first
    assert host.stats.snapshot().misses == {"truncated": 1, "absent": 1}  # blocks 1 and 2
    assert disk.stats.snapshot().hits == 1  # block 1 came from the disk tier
    assert cache.flush()
    promoted = host.get(cache.key(digests[1]))  # ... and was promoted back up, sound
    assert promoted is not None
    assert (decode_record(promoted, cache.key(digests[1]), SIZE, cache.num_rows) == payload(1)).all()
    cache.close()


def test_a_load_reads_each_record_into_its_row_and_a_bad_one_ends_the_run(tmp_path: Path) -> None:
    host = FileTier("host", tmp_path, 1 << 30)
    cache = TieredKVCache(LAYOUT, [host])
    digests = [bytes([i]) * 32 for i in range(4)]
    for i, d in enumerate(digests):
        cache.offer(d, payload(i + 1))
    assert cache.flush()
    path = host.path(cache.key(digests[2]))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # same size, one flipped bit: read into its row, then found corrupt
    path.write_bytes(bytes(data))
    got = cache.load(digests)
    assert got.shape == (2, SIZE) and all((got[i] == payload(i + 1)).all() for i in range(2))
    assert host.stats.snapshot().misses == {"corrupt": 1}
    assert not path.exists()  # discarded: the recomputed block takes its place
    assert cache.load([]).shape == (0, SIZE)
    cache.close()


def test_the_writer_thread_runs_at_the_lowest_priority(tmp_path: Path) -> None:
    import os

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    cache = TieredKVCache(LAYOUT, [FileTier("host", tmp_path, 1 << 30)])
    assert cache.offer(bytes(32), payload(1)) and cache.flush()  # the writer has started
    tid = cache._writer.native_id
    stat = Path(f"/proc/{os.getpid()}/task/{tid}/stat").read_text()
    nice = int(stat.rsplit(")", 1)[1].split()[16])  # field 19 of proc(5)
    assert nice == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # only the writer
    cache.close()


def test_a_read_buffer_is_reused_only_once_the_engine_and_the_writer_are_done() -> None:
    from kv_transfer.tiers.cache import ReadBuffers, owner_of

    bufs = ReadBuffers(record_bytes=64, max_spare_bytes=64 * 8)
    first = bufs.take(4)
    owner = owner_of(first)
    bufs.promoting(owner, 2)  # two promoted records view it
    assert not np.shares_memory(bufs.take(4), first)  # leased: a fresh buffer (now the spare)
    bufs = ReadBuffers(record_bytes=64, max_spare_bytes=64 * 8)
    first = bufs.take(4)
    owner = owner_of(first)
    bufs.promoting(owner, 2)
    bufs.release(first[:2, 8:])  # the engine copied the load in (a view of it, as the engine holds)
    bufs.promoted(owner)
    assert not np.shares_memory(bufs.take(3), first)  # one promotion still queued
    bufs = ReadBuffers(record_bytes=64, max_spare_bytes=64 * 8)
    first = bufs.take(4)
    owner = owner_of(first)
    bufs.promoting(owner, 2)
    bufs.release(first[:2, 8:])
    bufs.promoted(owner)
    bufs.promoted(owner)
    again = bufs.take(3)
    assert np.shares_memory(again, first) and again.shape == (3, 64)  # both done: reused
    assert not np.shares_memory(bufs.take(3), again)  # ... and leased again
    # A released view of some other buffer frees nothing.
    bufs = ReadBuffers(record_bytes=64, max_spare_bytes=64 * 8)
    held = bufs.take(4)
    bufs.release(np.empty((4, 64), np.uint8))
    assert not np.shares_memory(bufs.take(4), held)
    # Over the bound: never kept as the spare; a smaller one is.
    bufs = ReadBuffers(record_bytes=64, max_spare_bytes=64 * 8)
    big = bufs.take(9)
    assert big.shape == (9, 64) and bufs._spare is None
    small = bufs.take(2)
    bufs.release(small)
    assert np.shares_memory(bufs.take(2), small)  # the small one is the spare


def test_a_load_keeps_its_buffer_until_released_and_its_promotions_are_written(tmp_path: Path) -> None:
    """Through the cache: a disk hit is promoted to the host tier from the read buffer, so
    the next load reads elsewhere until the engine released the first and the writer copied
    the promotions; the second load's bytes never overwrite the first's."""
    host, disk = FileTier("host", tmp_path / "h", 1 << 30), FileTier("disk", tmp_path / "d", 1 << 30)
    writer = TieredKVCache(LAYOUT, [disk])
    digests = [bytes([i]) * 32 for i in range(3)]
    for i, d in enumerate(digests):
        assert writer.offer(d, payload(i))
    assert writer.flush()
    writer.close()
    cache = TieredKVCache(LAYOUT, [host, FileTier("disk", tmp_path / "d", 1 << 30)])
    want = np.stack([payload(i) for i in range(3)])
    first = cache.load(digests[:2])  # from disk: both promoted to the host tier
    assert cache.flush()  # promotions written, but the engine has not released it
    second = cache.load(digests[1:])  # block 2 from disk: promoted from this buffer
    assert not np.shares_memory(first, second)  # a fresh buffer, now the spare
    cache.release(second)
    assert cache.flush()
    third = cache.load(digests[:2])  # released, its promotion written: the spare is reused
    assert np.shares_memory(second, third)
    assert np.array_equal(first, want[:2]) and np.array_equal(third, want[:2])
    assert cache.flush()
    assert all(host.contains(cache.key(d)) for d in digests)
    cache.close()
