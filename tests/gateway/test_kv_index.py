"""The gateway's KV index (gateway/kv_index.py): numbered batches applied in order, a
gap answered by one snapshot request (again only after `resend_s`), snapshots that
replace a worker's entries, dropped workers, and prefix overlaps that stop at the
first missing block."""

from __future__ import annotations

from gateway.kv_index import KvIndex
from pdserve.common.protocol import KvEvents


def _registered(*workers: str) -> KvIndex:
    index = KvIndex(resend_s=1.0)
    for w in workers:
        index.reset_worker(w, now=0.0)
        assert not index.apply(KvEvents(w, 0, [], snapshot=True), now=0.0)
    return index


def test_batches_apply_in_order_and_overlaps_stop_at_the_first_miss() -> None:
    index = _registered("a", "b")
    assert not index.apply(KvEvents("a", 1, [1, 2, 3]), 0.1)
    assert not index.apply(KvEvents("b", 1, [1, 3]), 0.1)
    assert index.overlaps([1, 2, 3, 4], ["a", "b"]) == {"a": 3, "b": 1}
    assert not index.apply(KvEvents("a", 2, [4], evicted=[2]), 0.2)
    assert index.overlaps([1, 2, 3, 4], ["a", "b"]) == {"a": 1, "b": 1}
    assert index.overlaps([9, 1], ["a", "b"]) == {"a": 0, "b": 0}
    assert index.num_blocks("a") == 3


def test_a_gap_asks_for_one_snapshot_and_the_snapshot_replaces_the_entries() -> None:
    index = _registered("a")
    index.apply(KvEvents("a", 1, [1, 2]), 0.0)
    assert index.apply(KvEvents("a", 3, [5]), 2.0)  # batch 2 never came: ask
    assert index.waiting_snapshot("a")
    assert not index.apply(KvEvents("a", 4, [6]), 2.5)  # asked 0.5 s ago: wait
    assert index.overlaps([1, 2], ["a"]) == {"a": 2}  # stale entries still steer routing
    assert not index.holds("a", 5) and not index.holds("a", 6)  # nothing applied past the gap
    assert index.apply(KvEvents("a", 5, [7]), 3.5)  # still no snapshot after resend_s: ask again
    assert not index.apply(KvEvents("a", 5, [2, 7], snapshot=True), 3.6)
    assert not index.waiting_snapshot("a")
    assert not index.holds("a", 1) and index.holds("a", 2) and index.holds("a", 7)
    assert not index.apply(KvEvents("a", 6, [8]), 3.7)  # numbering continues from the snapshot
    assert index.holds("a", 8)
    assert not index.apply(KvEvents("a", 6, [9]), 3.8)  # a repeat is ignored, not a gap
    assert not index.holds("a", 9) and not index.waiting_snapshot("a")


def test_registration_resets_a_worker_and_unknown_or_dropped_workers_are_ignored() -> None:
    index = _registered("a", "b")
    index.apply(KvEvents("a", 1, [1, 2]), 0.0)
    index.apply(KvEvents("b", 1, [1, 2]), 0.0)
    index.drop_worker("b")
    assert index.overlaps([1, 2], ["a", "b"]) == {"a": 2, "b": 0}
    assert not index.apply(KvEvents("b", 2, [3]), 0.0)  # not registered: ignored, no request
    assert not index.apply(KvEvents("x", 1, [1]), 0.0)
    assert index.num_blocks("b") == index.num_blocks("x") == 0
    index.reset_worker("a", now=5.0)  # restarted: forget, wait for its snapshot
    assert index.overlaps([1], ["a"]) == {"a": 0}
    assert not index.apply(KvEvents("a", 9, [1]), 5.1)  # its snapshot is on the way: no request yet
    assert index.apply(KvEvents("a", 10, [1]), 6.5)


def test_reported_corrections_only_touch_registered_workers() -> None:
    index = _registered("a")
    index.add("a", [1, 2])
    index.add("ghost", [1])
    assert index.overlaps([1, 2], ["a", "ghost"]) == {"a": 2, "ghost": 0}
    index.remove("a", [2])
    assert index.overlaps([1, 2], ["a"]) == {"a": 1}
