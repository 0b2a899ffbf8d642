"""What the simulator (pdserve/planner/simulate.py) models of the real system beyond queues and
step times, each on a case whose answer is computed by hand: the gateway's time per
request, prefix-cache hits on prefill workers and the kv-aware prefill choice they steer,
the suffix-only handoff's copy cost, and local prefill on the decode worker mixed into
its decode steps; the profile's KV-copy cost and load average; and a split's knee."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdserve.common.slo import Slo
from pdserve.planner.knee import knee
from pdserve.planner.profile import DecodeFit, PrefillFit, Profile, ProfileError
from pdserve.planner.simulate import Cluster, SimResult, simulate
from pdserve.planner.workload import SimRequest, Workload, WorkloadError

# 1 ms per prompt token, 10 ms per decode step whatever the batch, blocks of 16.
LINEAR = Profile(PrefillFit(0.0, 0.001, 0.0), DecodeFit(0.010, 0.0, 0.0), block_size=16, chunk_tokens=1000,
                 max_num_seqs=64, kv_capacity_tokens=1 << 20)
LOOSE = Slo(10.0, 10.0)


def _run(profile: Profile, cluster: Cluster, reqs: list[SimRequest]) -> SimResult:
    return simulate(profile, cluster, reqs, LOOSE)


def _ttfts(profile: Profile, cluster: Cluster, reqs: list[SimRequest]) -> list[float]:
    return [round(r.ttft_s, 9) for r in _run(profile, cluster, reqs).requests]


def test_gateway_time_comes_before_the_prefill_and_counts_in_ttft() -> None:
    (r,) = _run(LINEAR, Cluster(1, 1, gateway_s=0.005), [SimRequest(0.0, 100, 2)]).requests
    assert r.ttft_s == pytest.approx(0.105) and r.finish == pytest.approx(0.115)
    # a second request arriving while the first's gateway time runs still queues behind it
    assert _ttfts(LINEAR, Cluster(1, 1, gateway_s=0.005), [SimRequest(0.0, 100, 2), SimRequest(0.001, 100, 2)]) \
        == [0.105, 0.204]


def test_a_shared_prefix_is_served_from_the_prefill_workers_cache() -> None:
    # 100-token prompts sharing 64 tokens = 4 blocks of 16; the second finds them cached
    reqs = [SimRequest(0.0, 100, 2, 64), SimRequest(1.0, 100, 2, 64)]
    assert _ttfts(LINEAR, Cluster(1, 1), reqs) == [0.1, 0.036]
    assert _ttfts(LINEAR, Cluster(1, 1, prefix_caching=False), reqs) == [0.1, 0.1]
    # the cached part still weighs in the attention square: c2 ((64+36)^2 - 64^2)
    quad = Profile(PrefillFit(0.0, 0.0, 1e-6), LINEAR.decode, block_size=16)
    assert _ttfts(quad, Cluster(1, 1), reqs) == [0.01, round(1e-6 * (100**2 - 64**2), 9)]
    # never the last token: a 65-token prompt with a 64-token prefix hits 4 blocks; the
    # same 64-token prompt twice only 3, (64 - 1) // 16, and a 63-token prefix 3 (full blocks)
    assert _ttfts(LINEAR, Cluster(1, 1), [SimRequest(0.0, 65, 2, 64), SimRequest(1.0, 65, 2, 64)]) == [0.065, 0.001]
    assert _ttfts(LINEAR, Cluster(1, 1), [SimRequest(0.0, 64, 2, 64), SimRequest(1.0, 64, 2, 64)]) == [0.064, 0.016]
    assert _ttfts(LINEAR, Cluster(1, 1), [SimRequest(0.0, 80, 2, 63), SimRequest(1.0, 80, 2, 63)]) == [0.08, 0.032]


def test_kv_aware_choice_weighs_uncached_and_queued_tokens() -> None:
    # A warms worker 0. At 0.2 B (36 uncached there, 100 on worker 1) goes to worker 0;
    # C: 36 + 36 queued = 72 < 100, worker 0 again, after B; D: 36 + 72 = 108 > 100, worker 1.
    reqs = [SimRequest(0.0, 100, 2, 64)] + [SimRequest(0.2, 100, 2, 64)] * 3
    assert _ttfts(LINEAR, Cluster(2, 1), reqs) == [0.1, 0.036, 0.072, 0.1]


def test_handoff_copies_only_the_blocks_the_decode_worker_lacks() -> None:
    copying = Profile(LINEAR.prefill, LINEAR.decode, block_size=16, chunk_tokens=1000, kv_copy_s_per_token=1e-4)
    reqs = [SimRequest(0.0, 100, 2, 64), SimRequest(1.0, 100, 2, 64)]
    first, second = _run(copying, Cluster(1, 1, handoff_s=0.002), reqs).requests
    assert first.finish == pytest.approx(0.100 + (0.002 + 100e-4) + 0.010)
    # the decode worker holds the 4 prefix blocks it received: 36 tokens ship
    assert second.finish == pytest.approx(1.0 + 0.036 + (0.002 + 36e-4) + 0.010)


def test_local_prefill_runs_on_the_decode_worker_in_its_decode_steps() -> None:
    c0 = Profile(PrefillFit(0.005, 0.001, 0.0), LINEAR.decode, block_size=16, chunk_tokens=1000)
    local = Cluster(1, 1, local_prefill_threshold=50)
    (alone,) = _run(c0, local, [SimRequest(0.0, 40, 3)]).requests
    assert alone.ttft_s == pytest.approx(0.045) and alone.finish == pytest.approx(0.065)  # no handoff
    # A (100 tokens, over the threshold) prefills remotely: first token 0.105, decodes from
    # there. B (40 tokens) arrives at 0.11 and rides A's next step, 0.115 - 0.165: the
    # decode step's 10 ms + 40 ms of prompt (one step, one c0).
    a, b = _run(c0, local, [SimRequest(0.0, 100, 4), SimRequest(0.110, 40, 2)]).requests
    assert a.ttft_s == pytest.approx(0.105) and a.finish == pytest.approx(0.175)
    assert b.ttft_s == pytest.approx(0.055) and b.finish == pytest.approx(0.175)
    # the step's token budget: decode tokens first, prompts chunked in the rest. Both are
    # local (30 and 40 <= 50): A's 30 tokens fill step 1 (35 ms); step 2 decodes A and
    # takes 29 of B's tokens (10 + 29 ms), step 3 A again and B's last 11 (10 + 11 ms)
    tight = Profile(c0.prefill, c0.decode, block_size=16, chunk_tokens=30)
    a, b = _run(tight, local, [SimRequest(0.0, 30, 4), SimRequest(0.0, 40, 2)]).requests
    assert a.ttft_s == pytest.approx(0.035) and b.ttft_s == pytest.approx(0.035 + 0.039 + 0.021)
    assert a.finish == b.finish == pytest.approx(0.095 + 0.010)
    assert _ttfts(tight, Cluster(1, 1), [SimRequest(0.0, 40, 2)]) == [0.05]  # threshold 0: remote, 2 steps


def test_profile_keeps_copy_cost_and_load_average(tmp_path: Path) -> None:
    profile = Profile(LINEAR.prefill, LINEAR.decode, kv_copy_s_per_token=2e-7, load_average=(1.5, 2.25))
    path = tmp_path / "p.json"
    profile.save(path)
    assert json.loads(path.read_text())["load_average"] == [1.5, 2.25]
    assert Profile.load(path) == profile
    edits: list[tuple[dict[str, object], str]] = [({"load_average": [1.0]}, "missing or malformed"),
                                                  ({"kv_copy_s_per_token": -1.0}, "coefficients must be >= 0")]
    for edit, message in edits:
        path.write_text(json.dumps({**profile.to_dict(), **edit}))
        with pytest.raises(ProfileError, match=message):
            Profile.load(path)


def test_workload_prefix_parses_and_is_refused_when_not_below_the_prompt() -> None:
    w = Workload.parse("rate=2,n=3,prompt=100-200,output=4,prefix=64,seed=5")
    assert Workload.parse(w.spec()) == w and all(r.prefix_tokens == 64 for r in w.requests())
    plain = Workload.parse("rate=2,n=3,prompt=100-200,output=4,seed=5").requests()
    assert [r[:3] for r in w.requests()] == [r[:3] for r in plain]  # the same draws
    with pytest.raises(WorkloadError, match="below the shortest prompt"):
        Workload.parse("rate=2,n=3,prompt=100-200,output=4,prefix=100")


def test_knee_is_the_least_of_prefill_decode_and_gateway_capacity() -> None:
    profile = Profile(PrefillFit(0.0, 0.001, 0.0), DecodeFit(0.010, 0.002, 0.0), block_size=16, max_num_seqs=64)
    reqs = [SimRequest(0.0, 100, 5), SimRequest(0.0, 300, 5)]  # 0.2 s of prompt on average
    k = knee(profile, Cluster(2, 1), reqs, Slo(1.0, 0.05))
    # prefill 2 / 0.2; decode: (50 - 10) / 2 ms = 20 sequences, each 4 steps of 50 ms
    assert (k.prefill, k.decode, k.gateway) == pytest.approx((10.0, 20 / (4 * 0.05), math.inf))
    assert k.rate == pytest.approx(10.0) and k.bound == "prefill"
    # a warm prefix cache: 64 + 64 of the 400 prompt tokens are cached
    warm = knee(profile, Cluster(2, 1), [r._replace(prefix_tokens=64) for r in reqs], Slo(1.0, 0.05))
    assert warm.prefill == pytest.approx(2 * 2 / (0.036 + 0.236))
    assert knee(profile, Cluster(2, 1, gateway_s=0.2), reqs, Slo(1.0, 0.05)).bound == "gateway"
    # one core for both pools: each request's 0.2 s of prompt + 4 x 2 ms of decode work
    shared = knee(profile, Cluster(2, 1, cores=1), reqs, Slo(1.0, 0.05))
    assert shared.cores == pytest.approx(1 / 0.208) and shared.bound == "cores"
    assert knee(profile, Cluster(2, 1), reqs, Slo(1.0, 0.011)).decode == pytest.approx(0.5 / (4 * 0.011))
    assert knee(profile, Cluster(2, 1), reqs, Slo(1.0, 0.005)).decode == 0.0  # ITL below one step


def test_steps_share_the_cores_when_there_are_fewer_than_workers() -> None:
    both = [SimRequest(0.0, 100, 2), SimRequest(0.0, 100, 2)]
    assert _ttfts(LINEAR, Cluster(2, 1, cores=2), both) == [0.1, 0.1]  # a core each
    assert _ttfts(LINEAR, Cluster(2, 1, cores=1), both) == [0.2, 0.2]  # half a core each
    # the first runs alone to 0.05 (50 of its 100 ms), then both at half speed: the first
    # ends at 0.15 (TTFT 0.15), the second has 50 ms left. Its decode step (10 ms) then
    # shares with it to 0.17 (the second: 40 left), which ends alone at 0.21: TTFT 0.16
    late = [SimRequest(0.0, 100, 2), SimRequest(0.05, 100, 2)]
    assert _ttfts(LINEAR, Cluster(2, 1, cores=1), late) == [0.15, 0.16]
    (r,) = _run(LINEAR, Cluster(1, 1, cores=1), [SimRequest(0.0, 100, 3)]).requests
    assert r.finish == pytest.approx(0.12)  # nothing else runs: full speed


def test_the_gateway_serves_one_request_at_a_time() -> None:
    # three at once, 50 ms of gateway each: they reach the (idle) prefill workers 50 ms apart
    three = [SimRequest(0.0, 10, 2)] * 3
    assert _ttfts(LINEAR, Cluster(3, 1, gateway_s=0.05), three) == [0.06, 0.11, 0.16]
    # on one core the gateway's work shares it with the workers' steps: from 0.05 the second
    # request's gateway time runs at half speed beside the first's prefill (to 0.07) and
    # then its decode step (to 0.09), 20 of its 50 ms done; alone to 0.12, prefill to 0.13
    shared = _ttfts(LINEAR, Cluster(3, 1, gateway_s=0.05, cores=1), three[:2])
    assert shared == [0.07, 0.13]

