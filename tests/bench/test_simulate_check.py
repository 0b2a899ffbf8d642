"""bench/simulate_check.py's measuring side against a server of known timing: each
request is sent at its workload arrival with a prompt of exactly its drawn length and
its drawn output length, and TTFT / ITL / goodput come out as the server's timing."""

from __future__ import annotations

import pytest

from bench.simulate_check import gateway_s, replay
from pdserve.common.slo import Slo
from pdserve.planner.profile import DecodeFit, PrefillFit, Profile
from pdserve.planner.simulate import Cluster, summarize
from pdserve.planner.workload import Workload
from tests.bench.fake_openai import FakeOpenAIServer


def test_replay_sends_the_workload_and_measures_its_timing(fake_server: FakeOpenAIServer) -> None:
    fake_server.behaviour.ttft_s, fake_server.behaviour.itl_s = 0.05, 0.01
    requests = Workload.parse("rate=10,n=4,prompt=5-40,output=6,arrivals=uniform,seed=7").requests()
    results = replay(fake_server.url, requests, vocab=100, seed=7)
    assert [len(b["prompt"]) for b in fake_server.requests] == [q.prompt_tokens for q in requests]
    assert all(b["max_tokens"] == 6 and b["ignore_eos"] and b["stream"] for b in fake_server.requests)
    assert all(0 <= t < 100 for b in fake_server.requests for t in b["prompt"])
    assert all(r.arrival >= q.arrival for r, q in zip(results, requests, strict=True))  # never early
    assert all(r.ttft_s >= 0.05 for r in results)  # the server's own first-token delay
    # the last token comes >= 5 gaps of 10 ms after the first is due; ITL is the mean gap after the first
    assert all(r.finish - r.arrival >= 0.05 + 5 * 0.01 * (1 - 1e-6) for r in results)
    assert all(r.ttft_s + 5 * r.itl_s == pytest.approx(r.finish - r.arrival) for r in results)
    res = summarize(Cluster(1, 1), results, Slo(ttft_s=0.04, itl_s=1.0))  # TTFT SLO below the server's
    assert res.met == 0 and summarize(Cluster(1, 1), results, Slo(1.0, 1.0)).met == 4


def test_replay_shares_the_workloads_prefix_and_calibration_times_the_gateway(
        fake_server: FakeOpenAIServer) -> None:
    fake_server.behaviour.ttft_s, fake_server.behaviour.itl_s = 0.05, 0.01
    requests = Workload.parse("rate=10,n=3,prompt=20-40,output=2,prefix=16,arrivals=uniform,seed=7").requests()
    replay(fake_server.url, requests, vocab=1000, seed=7)
    prompts = [b["prompt"] for b in fake_server.requests]
    assert prompts[0][:16] == prompts[1][:16] == prompts[2][:16]
    assert len({tuple(p[16:20]) for p in prompts}) == 3  # the rest is each request's own
    # 1 ms per prompt token: of the burst's last first token (>= the server's 50 ms), 32 ms
    # are the prefill, the rest is three gateway times
    linear = Profile(PrefillFit(0.0, 0.001, 0.0), DecodeFit(0.01, 0.0, 0.0))
    del fake_server.requests[:]
    assert (0.05 - 0.032) / 3 <= gateway_s(fake_server.url, 1000, linear, 3, seed=1) < 0.5
    assert [len(b["prompt"]) for b in fake_server.requests] == [32] * 9  # the median of 3 bursts
    assert all(b["max_tokens"] == 1 for b in fake_server.requests)
