"""bench/multiturn.py's path without a cluster: conversations against the fake OpenAI
server (each turn resends the history with the server's answer), the pool sizes that
make routing matter, and the verdict lines."""

from __future__ import annotations

import numpy as np

from bench import multiturn
from bench.multiturn_workload import ChatShape, differing, history_hits, size_pools
from tests.bench.fake_openai import FakeOpenAIServer


def words(text: str) -> int:
    return len(text.split())


def test_each_turn_resends_the_shared_prefix_and_the_history_with_the_answers(
    fake_server: FakeOpenAIServer,
) -> None:
    fake_server.behaviour.ttft_s, fake_server.behaviour.itl_s = 0.001, 0.0
    shape = ChatShape(conversations=2, turns=3, output_len=2, system_words=30, opening_words=10, turn_words=5)
    out = multiturn.converse(fake_server.url, "fake-model", shape)
    prompts = [r["prompt"] for r in fake_server.requests]
    assert len(prompts) == out["requests"] == 6 and sorted(out["texts"]) == ["0/0", "0/1", "0/2", "1/0", "1/1", "1/2"]
    assert all(p.startswith(shape.system_prompt()) for p in prompts)
    for c in range(2):
        mine = [p for p in prompts if f"Document {c}:" in p]
        assert len(mine) == 3
        for t in (1, 2):  # the previous prompt, the server's answer, then the new user message
            assert mine[t] == mine[t - 1] + out["texts"][f"{c}/{t - 1}"] + shape.turn_text(shape.user_messages(c)[t])
    assert out["prompt_tokens"] == sum(words(p) for p in prompts)
    assert (out["history_hits"], out["later_turns"]) == (0, 4)  # the fake server caches nothing


def test_pools_hold_the_kv_aware_share_but_not_round_robins() -> None:
    shape = ChatShape(conversations=16, turns=6, output_len=32)
    pools = size_pools(shape, words, prefill_workers=2)
    system = words(shape.system_prompt()) // 16
    assert pools.shared_blocks == system > 0
    assert pools.kv_aware_need < pools.prefill_blocks < pools.round_robin_need
    assert pools.decode_blocks >= pools.decode_need > pools.round_robin_need  # every conversation, to its end
    legacy = ChatShape.of("legacy", 16, 6, 32, 0)
    assert legacy.system_prompt() == "" and size_pools(legacy, words, 2).shared_blocks == 0


def test_the_private_shape_shares_nothing_and_round_robins_share_does_not_fit() -> None:
    shape = ChatShape.of("private", 16, 6, 32, 0)
    assert shape.system_prompt() == ""
    openings = {shape.opening(c)[:200] for c in range(16)}
    assert len(openings) == 16  # no two conversations open alike: nothing is hot everywhere
    final = [words(shape.final_text(c)) for c in range(16)]  # less the five answers
    assert all(900 <= f <= 1100 for f in final)  # ~1,800 tokens at ~1.9 tokens a word
    pools = size_pools(shape, words, prefill_workers=2)
    assert pools.shared_blocks == 0
    # Users think before each turn (seeded per conversation): no lock step, no fixed arrival order.
    thinks = [shape.think_times(c) for c in range(16)]
    assert thinks[3] == shape.think_times(3) and len({t[0] for t in thinks}) == 16
    assert 1.0 < float(np.mean(thinks)) < 3.0 and min(min(t) for t in thinks) >= 0
    assert ChatShape.of("chat", 16, 6, 32, 0).think_times(0) == [0.0] * 6
    assert ChatShape.of("private", 16, 6, 32, 0, think_s=0).think_times(0) == [0.0] * 6
    assert pools.kv_aware_need < pools.prefill_blocks < pools.round_robin_need
    assert pools.decode_blocks >= pools.decode_need > pools.round_robin_need


def test_history_hits_and_verdicts() -> None:
    # Turn 2 found turn 1's 40 prompt tokens (2 full blocks + 8) cached; turn 3 did not.
    assert history_hits([40, 90, 140], [0, 32, 16]) == (1, 2)
    runs = [{r: {"ttft_p50_ms": ms, "texts": {"0/0": "a"}, "requests": 1, "kv_bytes": 10.0,
                 "kv_bytes_all_blocks": 100.0} for r, ms in (("kv-aware", 100.0), ("round-robin", 400.0))}]
    lines = multiturn.report(runs, ["kv-aware", "round-robin"])
    assert lines[0].startswith("VERDICT TTFT p50 round-robin / kv-aware") and lines[0].endswith("PASS")
    assert lines[1].endswith("PASS") and all(line.endswith("PASS") for line in lines[2:])
    runs[0]["round-robin"]["texts"] = {"0/0": "b"}
    runs[0]["round-robin"]["ttft_p50_ms"] = 200.0
    lines = multiturn.report(runs, ["kv-aware", "round-robin"])
    assert lines[0].endswith("MISS") and lines[1].endswith("MISS")
    assert differing({"0/0": "a", "0/1": "x"}, {"0/0": "a"}) == ["0/1"]
    assert multiturn.prefill_workers("--prefill 2 --decode 1") == 2 and multiturn.prefill_workers("--colocated") == 1
