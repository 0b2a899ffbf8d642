"""Cluster behaviour through real processes: late joiners, removal, n > 1 with one
prefill, seeded determinism, and 64 concurrent streams that leave no KV behind."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import Cluster, http, metric_value, running_cluster, sse, worker_metrics
from tests.e2e.conftest import Reference


def _complete(c: Cluster, ref: Reference, prompt: str, **kw: object) -> dict:
    body = {"model": ref.model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    status, out = http("POST", f"{c.url}/v1/completions", body)
    assert status == 200, out
    return out


def _by_role(c: Cluster, role: str) -> list[dict]:
    return [w for w in c.worker_list() if w["role"] == role]


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One prefill and one decode worker, shared by the tests that leave them idle (each
    asserts by deltas or on a state it waits for, and ends waiting for idle KV)."""
    with running_cluster(tmp_path_factory.mktemp("pd"), {"prefill": 1, "decode": 1}) as c:
        yield c


def test_late_decode_worker_joins_and_stopped_worker_leaves(log_dir: Path, reference: Reference) -> None:
    c = Cluster(log_dir)
    try:
        c.start_gateway(wait=False)
        c.add_worker("prefill")
        c.wait_roles(prefill=1)
        status, _ = http("POST", f"{c.url}/v1/completions",
                         {"model": reference.model_name, "prompt": "hi", "max_tokens": 2})
        assert status == 503  # no decode worker yet
        first = c.add_worker("decode")
        c.wait_roles(prefill=1, decode=1)
        want = reference.text(reference.generate(reference.completion_ids("late join"), max_tokens=8, temperature=0.0)[0])
        assert _complete(c, reference, "late join")["choices"][0]["text"] == want

        c.add_worker("decode")
        c.wait_roles(prefill=1, decode=2)
        with cf.ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda i: _complete(c, reference, f"spread {i}"), range(8)))
        assert all(o["choices"][0]["finish_reason"] for o in outs)
        served = {w["id"]: metric_value(worker_metrics(w), "llm_worker_requests_total") for w in _by_role(c, "decode")}
        assert all(v > 0 for v in served.values()), served  # the late worker got traffic too

        first.stop()
        assert first.popen.returncode == 0  # graceful SIGTERM exits 0
        remaining = c.wait_roles(prefill=1, decode=1)
        survivor = next(w for w in remaining if w["role"] == "decode")
        before = metric_value(worker_metrics(survivor), "llm_worker_requests_total")
        for i in range(3):
            assert _complete(c, reference, f"after stop {i}")["choices"][0]["text"]
        assert metric_value(worker_metrics(survivor), "llm_worker_requests_total") == before + 3
        c.wait_idle()
    finally:
        c.stop()


def test_n3_seeded_prefills_once_and_matches_engine(pd: Cluster, reference: Reference) -> None:
    c = pd
    prompt = "Three ways to say hello"
    params = {"max_tokens": 10, "temperature": 0.9, "seed": 1234, "n": 3}
    want = reference.generate(reference.completion_ids(prompt), **params)
    prefill = _by_role(c, "prefill")[0]
    before = metric_value(worker_metrics(prefill), "llm_prefill_requests_total")
    out = _complete(c, reference, prompt, **params)
    got = sorted(out["choices"], key=lambda ch: ch["index"])
    assert [ch["text"] for ch in got] == [reference.text(w) for w in want]
    assert metric_value(worker_metrics(prefill), "llm_prefill_requests_total") == before + 1

    # Same seed, same text (and a different seed differs somewhere).
    again = _complete(c, reference, prompt, **params)
    assert [ch["text"] for ch in sorted(again["choices"], key=lambda ch: ch["index"])] == [ch["text"] for ch in got]
    c.wait_idle()


def test_64_concurrent_streams_complete_and_free_all_kv(pd: Cluster, reference: Reference) -> None:
    c = pd
    prompts = [f"Request number {i}: " + "word " * (i % 9) for i in range(64)]
    lengths = [2 + (i * 7) % 23 for i in range(64)]
    ids = [reference.completion_ids(p) for p in prompts]

    def run(i: int) -> str:
        body = {"model": reference.model_name, "prompt": prompts[i], "max_tokens": lengths[i],
                "temperature": 0, "stream": True, "ignore_eos": True}
        events = sse(f"{c.url}/v1/completions", body, timeout=120)
        assert events[-1] == "[DONE]"
        finishes = [ch["finish_reason"] for e in events[:-1] for ch in e.get("choices", []) if ch["finish_reason"]]
        assert finishes == ["length"]
        return "".join(ch["text"] for e in events[:-1] for ch in e.get("choices", []))

    with cf.ThreadPoolExecutor(64) as pool:
        texts = list(pool.map(run, range(64)))
    for i in range(0, 64, 8):  # spot-check against the engine
        want = reference.generate(ids[i], max_tokens=lengths[i], temperature=0.0, ignore_eos=True)[0]
        assert texts[i] == reference.text(want)
    workers = c.wait_idle()
    for w in workers:
        assert w["free_blocks"] == w["total_blocks"]
        text = worker_metrics(w)
        assert metric_value(text, "llm_kv_cache_usage_ratio") == 0.0
        assert metric_value(text, "llm_decode_tokens_total" if w["role"] == "decode" else "llm_prefill_tokens_total") > 0
    # The gateway re-exports the fleet's gauges, one sample per worker, labelled by role
    # and worker: once a heartbeat after the last release has arrived, every one is 0.
    c._wait(lambda: _fleet_usage(c) == {w["id"]: 0.0 for w in workers}, "fleet KV usage 0 at the gateway")
    status, body = http("GET", f"{c.url}/metrics")
    assert status == 200
    fams = {f.name: f for f in text_string_to_metric_families(body)}
    assert {s.labels["role"] for s in fams["llm_current_batch_size"].samples} == {"decode"}


def _fleet_usage(c: Cluster) -> dict[str, float]:
    status, body = http("GET", f"{c.url}/metrics")
    assert status == 200
    fams = {f.name: f for f in text_string_to_metric_families(body)}
    return {s.labels["worker"]: s.value for s in fams["llm_kv_cache_usage_ratio"].samples}


def test_workers_rejoin_a_restarted_gateway(log_dir: Path, reference: Reference) -> None:
    c = Cluster(log_dir)
    try:
        c.start_gateway(wait=False)
        c.add_worker("worker")
        c.wait_roles(colocated=1)
        assert c.gateway is not None
        assert c.gateway.stop() == 0  # graceful: drains, exits 0
        c.start_gateway()  # same ports: the workers' sockets reconnect by themselves
        c.wait_roles(colocated=1)
        assert _complete(c, reference, "again")["choices"][0]["finish_reason"] == "length"
    finally:
        c.stop()
