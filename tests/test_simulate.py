"""The P:D simulator (pdserve/planner/simulate.py) on cases whose answer is known by hand, the
profile fit and file (pdserve/planner/profile.py) and workload specs (pdserve/planner/workload.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.common.slo import Slo
from pdserve.planner.profile import (
    DecodeFit,
    PrefillFit,
    Profile,
    ProfileError,
    fit_decode,
    fit_prefill,
)
from pdserve.planner.simulate import Cluster, SimulationError, recommend, simulate, simulate_splits
from pdserve.planner.workload import (
    Lengths,
    SimRequest,
    Workload,
    WorkloadError,
    parse_workload_slo,
)

# 1 ms per prompt token, 10 ms per decode step whatever the batch.
LINEAR = Profile(PrefillFit(0.0, 0.001, 0.0), DecodeFit(0.010, 0.0, 0.0), block_size=16, chunk_tokens=100,
                 max_num_seqs=64, kv_capacity_tokens=1 << 20)
LOOSE = Slo(10.0, 10.0)


def _ttfts(profile: Profile, cluster: Cluster, reqs: list[SimRequest], slo: Slo = LOOSE) -> list[float]:
    return [round(r.ttft_s, 9) for r in simulate(profile, cluster, reqs, slo).requests]


def test_one_request_prefill_handoff_and_decode_steps() -> None:
    res = simulate(LINEAR, Cluster(1, 1, handoff_s=0.002), [SimRequest(0.0, 100, 5)], LOOSE)
    (r,) = res.requests
    assert r.ttft_s == pytest.approx(0.100)
    assert r.finish == pytest.approx(0.100 + 0.002 + 4 * 0.010)
    assert r.itl_s == pytest.approx((0.002 + 4 * 0.010) / 4)
    assert res.makespan_s == pytest.approx(0.142) and res.goodput == pytest.approx(1 / 0.142)


def test_spaced_deterministic_arrivals_never_queue() -> None:
    reqs = Workload(1.0, 5, Lengths(100, 100), Lengths(5, 5), arrivals="uniform").requests()
    assert [r.arrival for r in reqs] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert _ttfts(LINEAR, Cluster(1, 1), reqs) == [0.1] * 5


def test_prefill_is_fcfs_and_chunked_at_the_token_budget() -> None:
    both = [SimRequest(0.0, 100, 2), SimRequest(0.0, 100, 2)]
    assert _ttfts(LINEAR, Cluster(1, 1), both) == [0.1, 0.2]  # budget 100: one prompt a step
    assert _ttfts(LINEAR, Cluster(2, 1), both) == [0.1, 0.1]  # one on each prefill worker
    # two prompts queue behind a first one; a step then takes 100 + 50 tokens, the next the other 50
    queued = [SimRequest(0.0, 100, 2), SimRequest(0.05, 100, 2), SimRequest(0.05, 100, 2)]
    wide = Profile(LINEAR.prefill, LINEAR.decode, chunk_tokens=150)
    assert _ttfts(wide, Cluster(1, 1), queued) == [0.1, 0.2, 0.25]  # ends at 0.25 and 0.3
    batched = Profile(LINEAR.prefill, LINEAR.decode, chunk_tokens=200)
    assert _ttfts(batched, Cluster(1, 1), queued) == [0.1, 0.25, 0.25]


def test_attention_square_is_split_across_chunks() -> None:
    quad = Profile(PrefillFit(0.0, 0.0, 1e-6), LINEAR.decode, chunk_tokens=100)
    (ttft,) = _ttfts(quad, Cluster(1, 1), [SimRequest(0.0, 250, 2)])
    assert ttft == pytest.approx(quad.prefill.prompt_s(250)) and ttft == pytest.approx(0.0625)


def test_kv_capacity_holds_the_second_request_back_until_the_first_finishes() -> None:
    # 100 + 5 tokens = 7 blocks of 16: a 112-token pool holds one request at a time.
    reqs = [SimRequest(0.0, 100, 5), SimRequest(0.0, 100, 5)]
    first_done = 0.100 + 0.002 + 4 * 0.010
    assert _ttfts(LINEAR, Cluster(2, 1, handoff_s=0.002, kv_tokens=112), reqs) == [0.1, round(first_done + 0.1, 9)]
    assert _ttfts(LINEAR, Cluster(2, 2, handoff_s=0.002, kv_tokens=112), reqs) == [0.1, 0.1]
    with pytest.raises(SimulationError, match="needs 7 KV blocks; a decode worker holds 6"):
        simulate(LINEAR, Cluster(1, 1, kv_tokens=96), reqs, LOOSE)


def test_decode_batch_cap_and_context_cost() -> None:
    # prefill 10 ms each; the first decodes 3 steps from 0.011, the second is on decode at 0.021
    reqs = [SimRequest(0.0, 10, 4), SimRequest(0.0, 10, 3)]
    one_seq = Profile(LINEAR.prefill, LINEAR.decode, max_num_seqs=1)
    finishes = [round(r.finish, 9) for r in simulate(one_seq, Cluster(1, 1, 0.001), reqs, LOOSE).requests]
    assert finishes == [0.041, 0.061]  # the second waits for the first to finish
    finishes = [round(r.finish, 9) for r in simulate(LINEAR, Cluster(1, 1, 0.001), reqs, LOOSE).requests]
    assert finishes == [0.041, 0.051]  # the second joins the batch at the next step (0.031)
    ctx = Profile(LINEAR.prefill, DecodeFit(0.0, 0.001, 1e-5), chunk_tokens=200)
    (r,) = simulate(ctx, Cluster(1, 1), [SimRequest(0.0, 100, 3)], LOOSE).requests
    assert r.finish - r.ttft_s == pytest.approx((0.001 + 101e-5) + (0.001 + 102e-5))


def test_goodput_counts_only_requests_meeting_both_slos() -> None:
    reqs = [SimRequest(0.0, 100, 5), SimRequest(0.0, 100, 5)]
    res = simulate(LINEAR, Cluster(1, 1), reqs, Slo(ttft_s=0.15, itl_s=1.0))
    assert res.met == 1 and res.goodput == pytest.approx(1 / res.makespan_s)
    assert simulate(LINEAR, Cluster(1, 1), reqs, Slo(ttft_s=1.0, itl_s=0.005)).met == 0
    assert res.ttft.p50 == pytest.approx(0.1) and res.ttft.p99 == pytest.approx(0.2)


def test_recommends_more_prefill_for_long_prompts_and_more_decode_for_long_outputs() -> None:
    heavy_prompt = Workload(8.0, 40, Lengths(200, 200), Lengths(2, 2), "uniform").requests()
    prefill_bound = simulate_splits(LINEAR, 3, heavy_prompt, Slo(0.5, 1.0))
    assert [r.cluster.prefill_workers for r in prefill_bound] == [1, 2]
    assert recommend(prefill_bound, Slo(0.5, 1.0)).cluster.prefill_workers == 2
    small_kv = Profile(LINEAR.prefill, DecodeFit(0.010, 0.0, 0.0), chunk_tokens=100, kv_capacity_tokens=1024)
    long_out = Workload(8.0, 40, Lengths(10, 10), Lengths(200, 200), "uniform").requests()
    assert recommend(simulate_splits(small_kv, 3, long_out, Slo(0.5, 1.0)), Slo(0.5, 1.0)).cluster.prefill_workers == 1


def test_profile_fit_recovers_coefficients_and_round_trips(tmp_path: Path) -> None:
    pf = fit_prefill([(n, 0.002 + 1e-4 * n + 1e-8 * n * n) for n in (32, 128, 512, 1024)])
    assert (pf.c0, pf.c1, pf.c2) == pytest.approx((0.002, 1e-4, 1e-8), rel=1e-6)
    df = fit_decode([(b, c, 0.005 + 0.001 * b + 1e-6 * b * c) for b in (1, 4, 16) for c in (64, 512)])
    assert (df.c0, df.per_seq, df.per_ctx_token) == pytest.approx((0.005, 0.001, 1e-6), rel=1e-6)
    # noise that would make a term negative drops it instead
    flat = fit_prefill([(32, 0.0101), (128, 0.0100), (512, 0.0099)])
    assert min(flat.c0, flat.c1, flat.c2) >= 0 and flat.prompt_s(128) == pytest.approx(0.01, rel=0.02)
    path = tmp_path / "p.json"
    Profile(pf, df, model="m", threads=2).save(path)
    assert Profile.load(path) == Profile(pf, df, model="m", threads=2)


@pytest.mark.parametrize("edit, message", [
    ({"schema": "x"}, "not a pdserve-profile/1 profile"),
    ({"decode": {"c0": 0.1}}, "missing or malformed"),
    ({"block_size": 0}, "must be >= 1"),
    ({"prefill": {"c0": -1.0, "c1": 0.0, "c2": 0.0}}, "coefficients must be >= 0"),
])
def test_a_bad_profile_is_refused_clearly(tmp_path: Path, edit: dict[str, object], message: str) -> None:
    good = Profile(PrefillFit(0.0, 0.001, 0.0), DecodeFit(0.01, 0.0, 0.0)).to_dict()
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**good, **edit}))
    with pytest.raises(ProfileError, match=message):
        Profile.load(path)


def test_workload_specs_parse_draw_reproducibly_and_refuse_bad_input() -> None:
    w = Workload.parse("rate=4,n=400,prompt=64-128,output=16,seed=3")
    assert Workload.parse(w.spec()) == w
    reqs = w.requests()
    assert reqs == w.requests() and reqs != Workload.parse("rate=4,n=400,prompt=64-128,output=16").requests()
    assert all(64 <= r.prompt_tokens <= 128 and r.output_tokens == 16 for r in reqs)
    assert reqs[-1].arrival / 399 == pytest.approx(0.25, rel=0.15)  # Poisson: mean gap 1 / rate
    assert parse_workload_slo("ttft=0.5,itl=0.05") == Slo(0.5, 0.05)
    for bad, msg in [("rate=4,n=1,prompt=8", "needs output"), ("rate=0,n=1,prompt=8,output=1", "rate must be"),
                     ("rate=1,n=1,prompt=9-3,output=1", "low <= high"), ("rate=1,n=1,prompt=8,output=1,x=2",
                                                                        "unknown key 'x'")]:
        with pytest.raises(WorkloadError, match=msg):
            Workload.parse(bad)
    with pytest.raises(WorkloadError, match="SLO: expected both ttft= and itl="):
        parse_workload_slo("ttft=1")
