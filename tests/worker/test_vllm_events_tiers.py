"""The KV tiers' writes and evictions as vLLM-format KV events: the tier writer's log
(kv_transfer/tiers/events.py), drained where the pool's events are and sent on the same
publisher, reaches a real ZeroMQ SUB as BlockStored / BlockRemoved in the tier's medium
("CPU" for the host tier, "DISK" for the disk tier), decoded with plain msgpack."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

from kv_transfer.tiers.cache import TieredKVCache
from kv_transfer.tiers.events import TierBlocks, TierEventLog
from kv_transfer.tiers.files import FileTier
from kv_transfer.tiers.record import HEADER_BYTES, block_payload_bytes
from pdserve.common.block_hash import block_key
from pdserve.common.hosts import free_port
from pdserve.common.kv_layout import KVLayout
from pdserve.engine.core.block_events import AllCleared
from pdserve.worker.vllm_events.config import KVEventsConfig
from pdserve.worker.vllm_events.publisher import KVEventPublisher

LAYOUT = KVLayout("cfg", 2, 2, 8, 4, "float32", weights="w")
SIZE = block_payload_bytes(LAYOUT)
RECORD = HEADER_BYTES + SIZE
BS = 4


def payload(i: int) -> np.ndarray:
    return np.full(SIZE, i, np.uint8)


def digest(i: int) -> bytes:
    return bytes([i]) * 32


class Sub:
    """A real SUB on the publisher; every event it decoded, in order."""

    def __init__(self, pub: KVEventPublisher) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(pub.endpoint)
        self.events: list[list[Any]] = []
        for _ in range(400):  # a SUB that just connected misses what came before it joined
            pub.publish([AllCleared()], BS)
            if self.sock.poll(50):
                break
        else:
            raise AssertionError("the subscriber never joined")

    def hashes(self, tag: str, medium: str) -> list[int]:
        return [h for e in self.events if e[0] == tag and e[-1] == medium for h in e[1]]

    def until(self, cond: Any, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"{what}; got {self.events}"
            if self.sock.poll(200):
                _, _, frame = self.sock.recv_multipart()
                self.events.extend(msgpack.unpackb(frame)[1])


def publish_tiers(pub: KVEventPublisher, cache: TieredKVCache, log: TierEventLog) -> None:
    """What the worker's main loop does after a tick: the tier writer's changes since."""
    assert cache.flush()
    pub.publish(log.drain(), BS)


def test_tier_writes_and_evictions_reach_a_subscriber_in_their_tiers_mediums(tmp_path: Path) -> None:
    host = FileTier("host", tmp_path / "shm", 4 * RECORD)  # 4 records: a fifth evicts down to 90%
    disk = FileTier("disk", tmp_path / "disk", 1 << 30)
    log = TierEventLog()
    cache = TieredKVCache(LAYOUT, [host, disk], events=log)
    pub = KVEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{free_port()}"))
    sub = Sub(pub)
    try:
        first = [digest(i) for i in range(3)]
        keys = [block_key(d) for d in first]
        for i, d in enumerate(first):
            assert cache.offer(d, payload(i))
        publish_tiers(pub, cache, log)
        sub.until(lambda: sub.hashes("BlockStored", "CPU") == keys and sub.hashes("BlockStored", "DISK") == keys,
                  "the three blocks stored in the host and disk tiers")
        stored = next(e for e in sub.events if e[0] == "BlockStored")
        assert stored == ["BlockStored", keys[:1], None, [], BS, None, "CPU"]  # by hash, as vLLM's offloader
        assert not sub.hashes("BlockRemoved", "CPU")

        later = [digest(i) for i in range(3, 6)]
        for i, d in enumerate(later, 3):
            assert cache.offer(d, payload(i))
        publish_tiers(pub, cache, log)
        evicted = host.stats.snapshot().evictions
        assert evicted > 0
        gone = [block_key(d) for d in first + later if not host.path(cache.key(d)).exists()]
        assert len(gone) == evicted
        sub.until(lambda: sorted(sub.hashes("BlockRemoved", "CPU")) == sorted(gone),
                  "the host tier's evictions removed")
        assert sub.hashes("BlockStored", "CPU") == keys + [block_key(d) for d in later]
        # A removal follows the block's store: its BlockStored came in an earlier event.
        order = [(e[0], h) for e in sub.events if e[-1] == "CPU" for h in e[1]]
        assert all(order.index(("BlockStored", h)) < order.index(("BlockRemoved", h)) for h in gone)
        assert not sub.hashes("BlockRemoved", "DISK")  # the disk tier has room: nothing evicted there
    finally:
        sub.sock.close()
        pub.close()
        cache.close()


def test_a_block_copied_up_from_the_disk_is_stored_in_the_host_tier(tmp_path: Path) -> None:
    host = FileTier("host", tmp_path / "shm", 1 << 30)
    disk = FileTier("disk", tmp_path / "disk", 1 << 30)
    log = TierEventLog()
    cache = TieredKVCache(LAYOUT, [host, disk], events=log)
    try:
        assert cache.offer(digest(7), payload(7)) and cache.flush()
        host.discard(cache.key(digest(7)))  # only the disk holds it now
        log.drain()
        assert len(cache.load([digest(7)])) == 1 and cache.flush()
        assert log.drain() == [TierBlocks("host", True, [digest(7)])]  # promoted: the host tier has it again
    finally:
        cache.close()


def test_without_an_event_log_nothing_is_recorded(tmp_path: Path) -> None:
    host = FileTier("host", tmp_path / "shm", 2 * RECORD)
    cache = TieredKVCache(LAYOUT, [host])
    try:
        for i in range(6):
            assert cache.offer(digest(i), payload(i))
        assert cache.flush() and host.stats.snapshot().evictions > 0
        assert cache._reported == {} and host._on_evicted is None  # no digest kept, no callback
    finally:
        cache.close()


def test_the_log_joins_runs_and_drops_past_its_bound_counted() -> None:
    log = TierEventLog(max_blocks=3)
    log.stored("host", digest(1))
    log.stored("host", digest(2))
    log.stored("disk", digest(1))
    log.stored("disk", digest(2))  # a fourth undrained block: dropped
    assert log.dropped == 1
    assert log.drain() == [TierBlocks("host", True, [digest(1), digest(2)]), TierBlocks("disk", True, [digest(1)])]
    log.removed("host", [digest(1)])
    assert log.drain() == [TierBlocks("host", False, [digest(1)])]


def test_a_discarded_bad_record_is_reported_removed(tmp_path: Path) -> None:
    host = FileTier("host", tmp_path / "shm", 1 << 30)
    log = TierEventLog()
    cache = TieredKVCache(LAYOUT, [host], events=log)
    try:
        assert cache.offer(digest(3), payload(3)) and cache.flush()
        assert log.drain() == [TierBlocks("host", True, [digest(3)])]
        path = host.path(cache.key(digest(3)))
        path.write_bytes(path.read_bytes()[:-1] + b"\xff")  # one payload byte flipped: the checksum fails
        assert len(cache.load([digest(3)])) == 0
        assert not path.exists()  # discarded, so the recomputed block takes its place
        assert log.drain() == [TierBlocks("host", False, [digest(3)])]
    finally:
        cache.close()


def test_the_reported_blocks_of_a_tier_are_bounded_oldest_out_first() -> None:
    from kv_transfer.tiers.cache import ReportedBlocks

    reported = ReportedBlocks(limit=2)
    assert reported.add(b"k1", digest(1)) is None and reported.add(b"k2", digest(2)) is None
    assert reported.add(b"k1", digest(1)) is None  # stored again: now the newest
    assert reported.add(b"k3", digest(3)) == digest(2)  # past the bound: the oldest goes
    assert len(reported) == 2
    assert reported.pop([b"k1", b"k9"]) == [digest(1)]  # only what it remembers
    assert reported.pop([b"k1"]) == [] and len(reported) == 1


def test_blocks_another_worker_evicted_from_a_shared_tier_are_reported_removed_past_its_size(
        tmp_path: Path) -> None:
    """Two workers on one host tier of 4 records: the second's writes evict the first's
    blocks, which the first never sees; the first still reports them removed once it has
    reported more blocks stored than the tier can hold."""
    a_log, b_log = TierEventLog(), TierEventLog()
    a = TieredKVCache(LAYOUT, [FileTier("host", tmp_path, 4 * RECORD)], events=a_log)
    b = TieredKVCache(LAYOUT, [FileTier("host", tmp_path, 4 * RECORD)], events=b_log)
    try:
        for i in range(4):
            assert a.offer(digest(i), payload(i)) and a.flush()
        for i in range(10, 16):
            assert b.offer(digest(i), payload(i)) and b.flush()
        a_log.drain()
        assert a.offer(digest(20), payload(20)) and a.flush()
        removed = [d for e in a_log.drain() if not e.stored for d in e.digests]
        assert digest(0) in removed  # pushed out of the first worker's map: reported gone
    finally:
        a.close()
        b.close()
