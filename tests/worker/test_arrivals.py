"""The arrivals a worker's heartbeats report (pdserve/worker/arrivals.py): each once, only those
in the snapshot a heartbeat sends, and None once more arrived than are kept."""

from __future__ import annotations

from pdserve.worker.arrivals import ArrivalCursor, ArrivalLog, Arrivals, Report


def test_each_arrival_is_reported_once_by_the_heartbeat_whose_snapshot_holds_it() -> None:
    log, cursor = ArrivalLog(keep=8), ArrivalCursor()
    assert cursor.next_report(log.snapshot()) == Report(1, [])
    log.record("a")
    log.record("b")
    snap = log.snapshot()
    assert log.snapshot() is snap  # nothing new: the same immutable snapshot
    log.record("c")  # after the snapshot the heartbeat sends: not in it, so not reported yet
    assert cursor.next_report(snap) == Report(2, ["a", "b"])
    assert cursor.next_report(snap) == Report(3, [])  # the same snapshot again: nothing twice
    assert snap == Arrivals(2, ("a", "b"))  # published snapshots never change
    assert cursor.next_report(log.snapshot()) == Report(4, ["c"])


def test_more_arrivals_than_kept_are_reported_as_unknown_then_reporting_resumes() -> None:
    log, cursor = ArrivalLog(keep=3), ArrivalCursor()
    for rid in "abc":
        log.record(rid)
    assert cursor.next_report(log.snapshot()) == Report(1, ["a", "b", "c"])  # exactly as many as kept
    for rid in "defg":
        log.record(rid)
    assert cursor.next_report(log.snapshot()) == Report(2, None)  # "d" is no longer kept
    log.record("h")
    assert cursor.next_report(log.snapshot()) == Report(3, ["h"])
