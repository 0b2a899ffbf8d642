"""Registry and routing decisions, without processes."""

from __future__ import annotations

from gateway.registry import WorkerRegistry
from gateway.router import blocks_needed, pick_colocated, pick_decode, pick_prefill
from pdserve.common.protocol import Heartbeat, RegisterWorker


def _reg(wid: str, role: str, total: int = 100, compat: str = "c1") -> RegisterWorker:
    return RegisterWorker(wid, role, "h", "", "", compat, total, 16, 0, 1)


def test_register_heartbeat_expire() -> None:
    r = WorkerRegistry(heartbeat_timeout_s=1.0)
    assert r.register(_reg("p1", "prefill"), now=0.0).accepted
    assert r.register(_reg("d1", "decode"), now=0.0).accepted
    assert not r.register(_reg("d2", "decode", compat="other"), now=0.0).accepted
    assert r.heartbeat(Heartbeat("d1", 0, 90, 100, 1, 0), now=0.9)
    assert not r.heartbeat(Heartbeat("ghost", 0, 90, 100, 1, 0), now=0.9)
    r.get("p1").inflight.add("req#1")  # type: ignore[union-attr]
    dead = r.expire(now=1.5)
    assert [w.worker_id for w in dead] == ["p1"] and dead[0].inflight == {"req#1"}
    assert [w.worker_id for w in r.all()] == ["d1"]


def test_draining_workers_are_not_routed() -> None:
    r = WorkerRegistry(3.0)
    r.register(_reg("d1", "decode"), 0.0)
    r.register(_reg("d2", "decode"), 0.0)
    r.get("d1").draining = True  # type: ignore[union-attr]
    assert [w.worker_id for w in r.pool("decode")] == ["d2"]


def test_routing_prefers_free_kv_then_small_batch_and_short_queues() -> None:
    r = WorkerRegistry(3.0)
    for wid in ("d1", "d2", "d3"):
        r.register(_reg(wid, "decode"), 0.0)
    r.heartbeat(Heartbeat("d1", 0, 50, 100, 2, 0), 0.1)
    r.heartbeat(Heartbeat("d2", 0, 80, 100, 9, 0), 0.1)
    r.heartbeat(Heartbeat("d3", 0, 80, 100, 3, 0), 0.1)
    assert pick_decode(r.pool("decode")).worker_id == "d3"  # type: ignore[union-attr]
    r.get("d3").pending_blocks = 40  # type: ignore[union-attr]  # reserved since its heartbeat
    assert pick_decode(r.pool("decode")).worker_id == "d2"  # type: ignore[union-attr]

    for wid, queued in (("p1", 500), ("p2", 20)):
        r.register(_reg(wid, "prefill"), 0.0)
        r.heartbeat(Heartbeat(wid, queued, 100, 100, 0, 0), 0.1)
    assert pick_prefill(r.pool("prefill")).worker_id == "p2"  # type: ignore[union-attr]
    assert pick_prefill(r.pool("prefill"), exclude=frozenset({"p2"})).worker_id == "p1"  # type: ignore[union-attr]
    assert pick_colocated(r.pool("colocated")) is None
    assert blocks_needed(17, 16) == 2 and blocks_needed(16, 16) == 1


def test_worker_holding_work_without_steps_is_stalled_until_it_steps_again() -> None:
    r = WorkerRegistry(heartbeat_timeout_s=60.0)
    r.register(_reg("d1", "decode"), 0.0)
    r.register(_reg("d2", "decode"), 0.0)
    # d1 decodes (its step counter moves); d2 holds running sequences and stands still.
    for t, steps in ((0.5, 10), (1.0, 20), (1.5, 30), (2.5, 40)):
        r.heartbeat(Heartbeat("d1", 0, 90, 100, 2, 0, steps=steps), now=t)
        r.heartbeat(Heartbeat("d2", 0, 90, 100, 2, 0, steps=7), now=t)
    assert r.find_stalled(now=2.4, stall_timeout_s=2.0) == []  # d2: still within the timeout
    stalled = r.find_stalled(now=2.6, stall_timeout_s=2.0)
    assert [w.worker_id for w in stalled] == ["d2"]
    assert r.find_stalled(now=3.0, stall_timeout_s=2.0) == []  # reported once
    assert [w.worker_id for w in r.pool("decode")] == ["d1"]  # not routed
    assert r.get("d2").describe(3.0)["stalled"] is True  # type: ignore[union-attr]  # listed as unhealthy
    r.heartbeat(Heartbeat("d2", 0, 90, 100, 2, 0, steps=8), now=3.1)  # it stepped again
    assert [w.worker_id for w in r.pool("decode")] == ["d1", "d2"]


def test_only_runnable_work_counts_towards_a_stall() -> None:
    r = WorkerRegistry(heartbeat_timeout_s=60.0)
    r.register(_reg("d1", "decode"), 0.0)  # holds only reservations waiting for KV
    r.register(_reg("p1", "prefill"), 0.0)  # idle
    r.register(_reg("p2", "prefill"), 0.0)  # queued prompt tokens, no step
    for t in (0.5, 5.0, 9.0):
        r.heartbeat(Heartbeat("d1", 0, 80, 100, 0, 3, steps=5), now=t)
        r.heartbeat(Heartbeat("p1", 0, 100, 100, 0, 0, steps=5), now=t)
        r.heartbeat(Heartbeat("p2", 900, 100, 100, 0, 1, steps=5), now=t)
    assert [w.worker_id for w in r.find_stalled(now=9.1, stall_timeout_s=2.0)] == ["p2"]
    # A silent idle worker is the heartbeat timeout's business, not a stall.
    assert r.find_stalled(now=30.0, stall_timeout_s=2.0) == []
