"""The KV-aware router routes a returning prompt to a worker that can load it from its
host's KV tier (gateway/kv_tiers.py), through real processes: the worker that computed
it is gone, a worker of the same host tier that never saw it and one without tiers are
up; the prompt goes to the one with the tier (a cache-blind tie would pick the other),
is served from the tier, and the text equals the single-process reference."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from tests.e2e.cluster import Cluster, metric_value, worker_metrics
from tests.e2e.test_kv_tiers_up import BLOCK, complete, expected, prompt, shm_dir, wait_for

__all__ = ["expected", "shm_dir"]  # fixtures


def written_down(c: Cluster) -> bool:
    texts = [worker_metrics(w) for w in c.worker_list()]
    return (all(metric_value(t, "llm_kv_tier_written_bytes_total") > 0 for t in texts)
            and all(metric_value(t, "llm_kv_tier_queued_writes") == 0 for t in texts))


def test_a_returning_prompt_goes_to_a_same_host_worker_and_is_served_from_the_tier(
        log_dir: Path, shm_dir: Path, expected: dict[int, str]) -> None:
    small = ("--num-blocks", "24", "--block-size", str(BLOCK), "--max-model-len", "512")
    tier = ("--kv-offload-memory", "64MiB", "--kv-offload-memory-dir", str(shm_dir))
    c = Cluster(log_dir)
    try:
        c.start_gateway()
        first = c.add_worker("worker", "--worker-id", "w1-tier", *small, *tier)
        c.wait_roles(colocated=1)
        for i in range(5):  # prompt 0 leaves the 24-block pool; its blocks stay in the tier
            assert complete(f"{c.url}/v1", prompt(i)) == (expected[i], 0)
        wait_for(lambda: written_down(c), "write-down")
        first.stop()  # the worker that computed it is gone
        c.wait_roles(colocated=0)
        # Sorted first, the worker without tiers wins any tie a tier-blind router breaks by id.
        c.add_worker("worker", "--worker-id", "w0-plain", *small)
        c.add_worker("worker", "--worker-id", "w2-tier", *small, *tier)
        workers = {w["id"]: w for w in c.wait_roles(colocated=2)}
        text, cached = complete(f"{c.url}/v1", prompt(0))
        assert text == expected[0] and cached >= 10 * BLOCK
        hits = metric_value(worker_metrics(workers["w2-tier"]), "llm_kv_tier_hits_total")
        assert hits >= cached // BLOCK
        with urllib.request.urlopen(f"{c.url}/metrics", timeout=5) as r:
            gateway = r.read().decode()
        assert 'reason="tier_hit"' in gateway
    finally:
        c.stop()
