"""Draft KV made on the prefill worker (`"draft_kv": "prefill"`), 1P+1D through real
processes and sockets: streams equal the single-process engine without speculation
(greedy, seeded, penalties, n=2, logprobs, a stop string); the decode worker drafts
without ever prefilling the draft; both draft pools end empty; and a decode worker
whose draft is another checkpoint is refused at registration (the layout hash test in
tests/nodes/test_draft_kv_handoff.py covers the other mismatches). Decode-local draft
KV through 1P+2D: tests/e2e/test_spec_decode.py's kill test."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import test_spec_decode as spec_e2e
from tests.e2e.cluster import Cluster, http, metric_value, worker_metrics
from tests.e2e.conftest import Reference
from tests.helpers.tiny_models import copy_with_one_weight_changed


def _spec(draft: Path) -> str:
    # The target as its own draft: every greedy draft over the right KV is accepted.
    return json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                       "draft_kv": "prefill"})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("draft-kv"))
    try:
        c.start_gateway()
        c.add_worker("prefill", "--speculative-config", _spec(model_dir), "--worker-id", "p")
        c.add_worker("decode", "--speculative-config", _spec(model_dir), "--worker-id", "d")
        c.wait_roles(prefill=1, decode=1)
        yield c
    finally:
        c.stop()


def _by_role(c: Cluster) -> dict[str, dict[str, Any]]:
    return {w["role"]: w for w in c.worker_list()}


def test_streams_equal_the_engine_without_speculation(cluster: Cluster, reference: Reference) -> None:
    spec_e2e.test_streams_equal_the_engine_without_speculation(cluster, reference)


def test_the_decode_worker_drafts_over_shipped_kv_and_both_draft_pools_end_empty(
        cluster: Cluster, reference: Reference) -> None:
    body = {"model": reference.model_name, "prompt": spec_e2e.PROMPTS[1], "max_tokens": 16,
            "temperature": 0, "ignore_eos": True}
    workers = _by_role(cluster)
    # Forks of an n=2 request (the test above) draft from KV they prefilled themselves.
    names = ("llm_spec_draft_prefill_tokens_total", "llm_spec_decode_num_draft_tokens_total",
             "llm_spec_decode_num_accepted_tokens_total")
    text = worker_metrics(workers["decode"])
    before = [metric_value(text, n) for n in names]
    status, out = http("POST", f"{cluster.url}/v1/completions", body)
    assert status == 200, out
    cluster.wait_idle()
    seen: dict[str, str] = {}

    def settled() -> bool:  # the last step's gauges are published on the next tick
        seen.update({role: worker_metrics(workers[role]) for role in ("prefill", "decode")})
        return all(metric_value(seen[r], "llm_spec_draft_kv_used_blocks") == 0 for r in seen)

    cluster._wait(settled, "both draft pools empty", timeout=20)
    prefilled, drafted, accepted = (metric_value(seen["decode"], n) - b for n, b in zip(names, before, strict=True))
    assert prefilled == 0 and drafted > 0
    # The target drafting for itself over the KV the prefill worker made: its greedy
    # drafts hold (KV that is wrong or misplaced would be rejected).
    assert accepted >= 0.5 * drafted, (accepted, drafted)


def test_a_decode_worker_with_another_draft_is_refused(cluster: Cluster, model_dir: Path,
                                                      tmp_path: Path) -> None:
    other = copy_with_one_weight_changed(model_dir, tmp_path / "other-draft")
    proc = cluster.add_worker("decode", "--speculative-config", _spec(other), "--worker-id", "other")
    assert cluster.gateway is not None
    log = cluster.gateway.log_path
    cluster._wait(lambda: "refused worker other: compat_hash" in log.read_text(errors="replace"),
                  "the decode worker with another draft refused", timeout=90)
    assert "the draft model must match" in log.read_text(errors="replace")  # says why
    assert sorted(w["id"] for w in cluster.worker_list()) == ["d", "p"]
    assert proc.alive()
