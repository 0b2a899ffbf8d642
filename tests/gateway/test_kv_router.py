"""Routing by KV (gateway/kv_router.py): the documented cost (uncached prompt tokens +
queued tokens), round-robin and least-loaded as the cache-blind baselines, the local
prefill decision on the decode worker, and the index corrected by what workers report."""

from __future__ import annotations

import pytest

from gateway.kv_index import KvIndex
from gateway.kv_router import KvRouter, RouterConfig
from gateway.registry import WorkerInfo, WorkerRegistry
from pdserve.common.block_hash import prefix_block_keys
from pdserve.common.protocol import Heartbeat, KvEvents, RegisterWorker, RequestPayload, Resume
from pdserve.common.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(1, 42))  # 10 full blocks + 1 token; 10 cacheable blocks


def _worker(wid: str, role: str = "prefill", queued: int = 0, running: int = 0) -> WorkerInfo:
    reg = RegisterWorker(wid, role, "h", "", "", "c", 256, BS, 0, 1)
    w = WorkerInfo(reg, 0.0, 0.0)
    w.load = Heartbeat(wid, queued, 256, 256, running, 0)
    return w


def _router(kind: str = "kv-aware", threshold: int = 0, **held: list[int]) -> KvRouter:
    index = KvIndex()
    for wid, keys in held.items():
        index.reset_worker(wid, 0.0)
        index.apply(KvEvents(wid, 1, keys, snapshot=True), 0.0)
    return KvRouter(RouterConfig(kind, threshold), index)


def _payload(tokens: list[int] = PROMPT) -> RequestPayload:
    return RequestPayload(list(tokens), SamplingParams(max_tokens=4))


KEYS = prefix_block_keys(PROMPT, BS)


def test_kv_aware_picks_the_worker_holding_the_prefix_and_counts_why() -> None:
    a, b = _worker("a"), _worker("b")
    router = _router(a=KEYS[:2], b=KEYS[:6])
    pick = router.pick([a, b], _payload())
    assert pick is not None and pick.worker is b
    assert (pick.route.predicted_blocks, pick.route.reason) == (6, "prefix_hit")
    assert router.cost(a, 41, 8) == 33 and router.cost(b, 41, 24) == 17
    other = router.pick([a, b], _payload([500, *PROMPT[1:]]))  # shares nothing: the load decides
    assert other is not None and other.worker is a and other.route.reason == "load"
    assert router.decisions == {"prefix_hit": 1, "load": 1}


def test_queued_load_outweighs_a_small_hit_but_not_a_large_one() -> None:
    busy, idle = _worker("busy", queued=30), _worker("idle")
    small = _router(busy=KEYS[:2])  # 8 cached tokens < 30 queued
    pick = small.pick([busy, idle], _payload())
    assert pick is not None and pick.worker is idle
    large = _router(busy=KEYS)  # 40 cached tokens > 30 queued
    pick = large.pick([busy, idle], _payload())
    assert pick is not None and pick.worker is busy and pick.route.predicted_blocks == 10


def test_the_last_token_is_never_counted_as_cached() -> None:
    tokens = PROMPT[:40]  # exactly 10 blocks: only 9 can be hits
    router = _router(a=prefix_block_keys(tokens, BS))
    pick = router.pick([_worker("a")], _payload(tokens))
    assert pick is not None and pick.route.predicted_blocks == 9


def test_colocated_running_sequences_count_as_load() -> None:
    a, b = _worker("a", "colocated", running=3), _worker("b", "colocated")
    router = _router(a=KEYS[:2])  # 8 cached tokens < 3 running x 16
    pick = router.pick([a, b], _payload())
    assert pick is not None and pick.worker is b


def test_round_robin_and_least_loaded_ignore_the_cache() -> None:
    a, b = _worker("a"), _worker("b", queued=5)
    rr = _router("round-robin", a=KEYS, b=KEYS)
    order = [rr.pick([b, a], _payload()) for _ in range(4)]
    assert [p.worker.worker_id for p in order if p] == ["a", "b", "a", "b"]
    assert rr.decisions == {"round_robin": 4}
    ll = _router("least-loaded", b=KEYS)
    pick = ll.pick([a, b], _payload())
    assert pick is not None and pick.worker is a and pick.route.reason == "least_loaded"


def test_local_prefill_counts_the_decode_workers_own_cache() -> None:
    decode = _worker("d", "decode")
    router = _router(threshold=8, d=KEYS[:8])  # 32 cached: 9 tokens left > 8
    assert router.local_prefill(decode, _payload()) is None
    router = _router(threshold=9, d=KEYS[:8])
    route = router.local_prefill(decode, _payload())
    assert route is not None and (route.worker_id, route.predicted_blocks, route.reason) == ("d", 8, "local_prefill")
    assert router.local_prefill(decode, _payload(PROMPT[:9])) is not None  # short: 1 token to compute
    assert router.local_prefill(decode, _payload([500, *PROMPT[1:9]])) is not None  # 9 uncached
    assert _router(threshold=0, d=KEYS).local_prefill(decode, _payload()) is None  # off
    assert router.decisions == {"local_prefill": 3}


def test_a_prompt_that_would_wait_behind_a_long_prefill_runs_on_the_decode_worker() -> None:
    decode = _worker("d", "decode")
    router = _router(threshold=8)  # nothing cached: a 30-token prompt is within 4 x 8, not within 8
    short = _payload(PROMPT[:30])
    idle, busy = _worker("p", queued=0), _worker("q", queued=120)  # 120 >= 4 x 30
    assert router.local_prefill(decode, short) is None  # no prefill pool given: the threshold alone
    assert router.local_prefill(decode, short, [idle, busy]) is None  # one prefill worker is free
    route = router.local_prefill(decode, short, [busy])
    assert route is not None and (route.worker_id, route.reason) == ("d", "local_prefill_busy")
    assert router.local_prefill(decode, short, [_worker("q", queued=119)]) is None  # waits < 4x its compute
    assert router.local_prefill(decode, _payload(PROMPT[:33]), [_worker("q", queued=10**6)]) is None  # > 4 x 8
    route = router.local_prefill(decode, _payload(PROMPT[:8]), [busy])
    assert route is not None and route.reason == "local_prefill"  # within the threshold itself
    assert router.decisions == {"local_prefill_busy": 1, "local_prefill": 1}


def test_resumed_output_is_hashed_with_the_prompt() -> None:
    tokens = PROMPT[:20] + PROMPT[20:]
    router = _router(a=prefix_block_keys(tokens, BS))
    payload = RequestPayload(PROMPT[:20], SamplingParams(max_tokens=40), Resume(PROMPT[20:]))
    pick = router.pick([_worker("a")], payload)
    assert pick is not None and pick.route.predicted_blocks == 10


def test_reported_cached_tokens_correct_the_index_and_are_counted() -> None:
    a = _worker("a")
    router = _router(a=KEYS[:6])
    pick = router.pick([a], _payload())
    assert pick is not None
    router.observe(pick.route, 2 * BS)  # blocks 2..5 were evicted meanwhile
    router.observe(pick.route, 0)  # only an attempt's first report counts
    assert router.index.overlaps(KEYS, ["a"]) == {"a": 2}
    assert router.cached_tokens == {"a": 8}
    pick = router.pick([a], _payload())
    assert pick is not None
    router.observe(pick.route, 5 * BS)  # more than predicted: the worker has them
    assert router.index.overlaps(KEYS, ["a"]) == {"a": 5}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in router.samples()}
    assert samples[("llm_routed_cached_tokens", (("worker", "a"),))] == 28
    assert samples[("llm_routing_decisions", (("reason", "prefix_hit"), ("router", "kv-aware")))] == 2


def test_bad_router_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="router must be one of"):
        RouterConfig("random")
    with pytest.raises(ValueError, match="local_prefill_threshold"):
        RouterConfig("kv-aware", -1)


def test_a_computed_prompt_stops_counting_as_queued_load() -> None:
    """A turn-by-turn client comes back before the next heartbeat: the prompt the worker
    just computed must not still weigh as queued tokens against its cache hit."""
    a, b = _worker("a"), _worker("b")
    router = _router(a=KEYS)
    a.add_pending("r1#1", 41)
    a.add_pending("r2#1", 5)
    pick = router.pick([a, b], _payload())
    assert pick is not None and pick.worker is b  # 41 - 40 + 46 queued > 41
    a.settle("r1#1")
    a.settle("r1#1")  # settling twice takes nothing more
    assert a.queued_tokens == 5
    pick = router.pick([a, b], _payload())
    assert pick is not None and pick.worker is a
    reg = WorkerRegistry(3.0)  # a heartbeat replaces every pending count
    reg.register(a.reg, 0.0)
    w = reg.get("a")
    assert w is not None
    w.add_pending("r3#1", 7)
    reg.heartbeat(Heartbeat("a", 3, 256, 256, 0, 0), 1.0)
    assert (w.queued_tokens, w.pending_prompts) == (3, {})
    w.settle("r3#1")
    assert w.queued_tokens == 3


def test_a_finished_request_stops_weighing_on_its_decode_worker_before_the_heartbeat() -> None:
    """A turn-by-turn client's next turn must find its prefix holder free again, not still
    running the last turn: a reservation's blocks and sequence count only while it is there."""
    a, b = _decode("a"), _decode("b")
    router = _router(a=KEYS[:6])
    for turn in ("t1#1", "t2#1"):
        a.add_pending(turn, 41, blocks=11, seqs=1)  # the last turns, finished since the heartbeat
    assert (a.running, a.free_blocks) == (2, 256 - 22)
    assert router.pick_decode([a, b], _payload()) is b  # 11 - 6 + 4 * 2 > 11
    a.release("t1#1")
    a.release("t1#1")  # releasing twice takes nothing more
    a.release("t2#1")
    assert (a.running, a.free_blocks, a.queued_tokens) == (0, 256, 0)
    assert router.pick_decode([a, b], _payload()) is a
    reg = WorkerRegistry(3.0)  # a heartbeat replaces every pending hold
    reg.register(a.reg, 0.0)
    w = reg.get("a")
    assert w is not None
    w.add_pending("t3#1", 41, blocks=11, seqs=1)
    reg.heartbeat(Heartbeat("a", 1, 245, 256, 1, 0), 1.0)
    assert w.pending_holds == {}
    w.release("t3#1")  # already in the heartbeat's count: nothing more to take
    assert (w.running, w.free_blocks) == (1, 245)


def _decode(wid: str, free: int = 256, running: int = 0) -> WorkerInfo:
    w = _worker(wid, "decode", running=running)
    assert w.load is not None
    w.load = Heartbeat(wid, 0, free, 256, running, 0)
    return w


def test_decode_worker_holding_the_prefix_receives_only_the_suffix() -> None:
    # 41 tokens: 11 blocks to reserve; b holds 6 of them, a has more free KV.
    a, b = _decode("a", free=200), _decode("b", free=100)
    router = _router(b=KEYS[:6])
    assert router.pick_decode([a, b], _payload()) is b
    assert router.decode_cost(a, 11, 0) == 11 and router.decode_cost(b, 11, 6) == 5
    assert router.decisions == {"decode_prefix_hit": 1}
    assert router.pick_decode([a, b], _payload([500, *PROMPT[1:]])) is a  # shares nothing: most free KV
    assert router.pick_decode([a, b], _payload(), count=False) is b and router.decisions["decode_prefix_hit"] == 1


def test_decode_choice_weighs_running_sequences_and_room() -> None:
    a = _decode("a")
    router = _router(b=KEYS[:6])  # b: 11 - 6 = 5 blocks to ship
    assert router.pick_decode([a, _decode("b", running=1)], _payload()).worker_id == "b"  # 5 + 4 < 11
    assert router.pick_decode([a, _decode("b", running=2)], _payload()) is a  # 5 + 8 > 11
    assert router.pick_decode([a, _decode("b", free=5)], _payload()).worker_id == "b"  # room for its 5
    assert router.pick_decode([a, _decode("b", free=4)], _payload()) is a  # no room for its 5
    tight = [_decode("x", free=3), _decode("y", free=4)]  # no room anywhere: most free KV
    assert router.pick_decode(tight, _payload()).worker_id == "y"
    for kind in ("round-robin", "least-loaded"):  # cache-blind: most free KV
        blind = _router(kind, b=KEYS)
        assert blind.pick_decode([_decode("a", free=200), _decode("b", free=100)], _payload()).worker_id == "a"


def test_a_prefix_holders_queued_turns_weigh_as_their_uncached_tokens() -> None:
    """A multi-turn conversation: the worker holding its history has other conversations'
    turns queued, each mostly served by its cache. Their weight is the work left (the
    prompt less what the index predicts cached), so the next turn still goes to the
    holder instead of a worker that would recompute the whole history."""
    a, b = _worker("a"), _worker("b")
    router = _router(a=KEYS)  # a holds 40 of the 41 tokens; b holds nothing
    for turn in ("c1#1", "c2#1"):  # two other turns routed to a since its heartbeat
        pick = router.pick([a, b], _payload())
        assert pick is not None and pick.worker is a and pick.route.uncached_tokens == 1
        a.add_pending(turn, pick.route.uncached_tokens)
    assert a.queued_tokens == 2
    pick = router.pick([a, b], _payload())
    assert pick is not None and pick.worker is a and pick.route.reason == "prefix_hit"
    assert router.decisions == {"prefix_hit": 3}


def test_a_worker_holding_less_than_another_is_counted_apart() -> None:
    busy, other = _worker("busy", queued=60), _worker("other")
    router = _router(busy=KEYS, other=KEYS[:2])  # the load outweighs busy's longer hit
    pick = router.pick([busy, other], _payload())
    assert pick is not None and pick.worker is other and pick.route.reason == "shorter_prefix"
    assert pick.route.uncached_tokens == 41 - 8
