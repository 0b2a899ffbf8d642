"""The gateway's optimistic load between heartbeats (gateway/registry.py): a heartbeat
drops only the pending load of the requests it lists as received; a request still on
the wire keeps counting until a later heartbeat lists it or it leaves."""

from __future__ import annotations

from gateway.registry import WorkerInfo, WorkerRegistry
from pdserve.common.protocol import Heartbeat, RegisterWorker

TOTAL = 100


def _registry(*workers: tuple[str, str]) -> WorkerRegistry:
    r = WorkerRegistry(heartbeat_timeout_s=60.0)
    for wid, role in workers:
        assert r.register(RegisterWorker(wid, role, "h", "", "", "c", TOTAL, 16, 0, 1), 0.0).accepted
    return r


def _info(r: WorkerRegistry, wid: str) -> WorkerInfo:
    w = r.get(wid)
    assert w is not None
    return w


def _beat(wid: str, seq: int, received: list[str] | None, free: int = TOTAL, running: int = 0,
          queued: int = 0) -> Heartbeat:
    return Heartbeat(wid, queued, free, TOTAL, running, 0, received=received, seq=seq)


def _consistent(w: WorkerInfo) -> None:
    """The totals are the sums over the per-request entries."""
    assert w.pending_tokens == sum(w.pending_prompts.values())
    assert w.pending_blocks == sum(b for b, _ in w.pending_holds.values())
    assert w.pending_seqs == sum(s for _, s in w.pending_holds.values())


def test_a_heartbeat_built_before_a_reservation_arrived_leaves_it_counted() -> None:
    r = _registry(("d1", "decode"))
    d1 = _info(r, "d1")
    r.heartbeat(_beat("d1", 1, []), 0.1)
    d1.add_pending("a#1", 0, blocks=10, seqs=1)  # routed; on the wire
    d1.add_pending("b#1", 0, blocks=5, seqs=1)
    # Built before either arrived: its load counts neither.
    r.heartbeat(_beat("d1", 2, []), 0.2)
    assert (d1.free_blocks, d1.running) == (TOTAL - 15, 2)
    _consistent(d1)
    # `a` arrived (the load counts it); `b` is still in the worker's inbox.
    r.heartbeat(_beat("d1", 3, ["a#1"], free=TOTAL - 10, running=1), 0.3)
    assert (d1.free_blocks, d1.running) == (TOTAL - 15, 2)  # not TOTAL - 25: `a` counted once
    assert d1.pending_holds == {"b#1": (5, 1)}
    _consistent(d1)
    r.heartbeat(_beat("d1", 4, ["b#1"], free=TOTAL - 15, running=2), 0.4)
    assert (d1.free_blocks, d1.running, d1.pending_holds) == (TOTAL - 15, 2, {})
    _consistent(d1)


def test_queued_prompt_tokens_wait_for_the_heartbeat_that_lists_them() -> None:
    r = _registry(("p1", "prefill"))
    p1 = _info(r, "p1")
    p1.add_pending("a#1", 300)
    r.heartbeat(_beat("p1", 1, [], queued=40), 0.1)  # 40 tokens of other requests
    assert p1.queued_tokens == 340
    r.heartbeat(_beat("p1", 2, ["a#1"], queued=340), 0.2)
    assert (p1.queued_tokens, p1.pending_prompts) == (340, {})
    _consistent(p1)


def test_a_request_that_arrived_and_left_within_one_interval_is_cleared() -> None:
    r = _registry(("c1", "colocated"))
    c1 = _info(r, "c1")
    c1.add_pending("a#1", 20, blocks=3, seqs=1)
    # The worker took it and finished it before the heartbeat: the load shows nothing of it.
    r.heartbeat(_beat("c1", 1, ["a#1"]), 0.1)
    assert (c1.free_blocks, c1.running, c1.queued_tokens) == (TOTAL, 0, 0)
    c1.release("a#1")  # its last tokens came in after: nothing more to take
    assert (c1.free_blocks, c1.running, c1.queued_tokens) == (TOTAL, 0, 0)
    _consistent(c1)


def test_release_drops_a_hold_no_heartbeat_listed() -> None:
    """A lost heartbeat cannot leak a hold: the request leaving drops it."""
    r = _registry(("d1", "decode"))
    d1 = _info(r, "d1")
    d1.add_pending("a#1", 0, blocks=10, seqs=1)
    for seq in (1, 2, 3):
        r.heartbeat(_beat("d1", seq, []), 0.1 * seq)
    assert d1.pending_holds == {"a#1": (10, 1)}
    d1.release("a#1")
    assert (d1.free_blocks, d1.running, d1.pending_holds) == (TOTAL, 0, {})
    _consistent(d1)


def test_ids_this_gateway_never_routed_are_ignored() -> None:
    r = _registry(("d1", "decode"))
    d1 = _info(r, "d1")
    d1.add_pending("mine#1", 0, blocks=4, seqs=1)
    r.heartbeat(_beat("d1", 1, ["theirs#1", "theirs#2"], free=TOTAL - 20, running=2), 0.1)
    assert (d1.free_blocks, d1.running, d1.pending_holds) == (TOTAL - 24, 3, {"mine#1": (4, 1)})
    _consistent(d1)


def test_a_heartbeat_that_cannot_vouch_for_its_list_replaces_all_pending_load() -> None:
    r = _registry(("d1", "decode"))
    d1 = _info(r, "d1")
    d1.add_pending("a#1", 7, blocks=2, seqs=1)
    r.heartbeat(_beat("d1", 1, None), 0.1)  # the worker's list overflowed
    assert (d1.pending_holds, d1.pending_prompts, d1.free_blocks) == ({}, {}, TOTAL)
    d1.add_pending("b#1", 7, blocks=2, seqs=1)
    r.heartbeat(_beat("d1", 2, []), 0.2)
    assert d1.pending_holds == {"b#1": (2, 1)}
    r.heartbeat(_beat("d1", 4, []), 0.4)  # heartbeat 3 was lost: what it listed is unknown
    assert (d1.pending_holds, d1.free_blocks, d1.queued_tokens) == ({}, TOTAL, 0)
    d1.add_pending("c#1", 7, blocks=2, seqs=1)
    r.heartbeat(Heartbeat("d1", 0, TOTAL, TOTAL, 0, 0), 0.5)  # an older worker: no list, no numbers
    assert (d1.pending_holds, d1.pending_prompts, d1.pending_tokens) == ({}, {}, 0)
    _consistent(d1)
