"""Speculative decoding through real processes: colocated, 1P+1D with n-gram drafts
(with a draft model whose KV the prefill worker ships: test_spec_draft_kv.py), and a
decode worker with a draft model killed with SIGKILL mid-stream. Every stream equals
the single-process engine without speculation, the workers report their drafts, and
every KV block comes back."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, http, metric_value, sse, worker_metrics
from tests.e2e.conftest import Reference
from tests.e2e.test_exact_recovery import (
    KEY,
    KILL_AFTER,
    Stream,
    _check,
    _mixed_bodies,
    _stop_after,
)

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                    "prompt_lookup_max": 3})
PROMPTS = ["one two three four one two three four one two", "The cat sat on the mat. The cat sat on the"]
MAX_TOKENS = 24


TOPOLOGIES = ("colocated-ngram", "1p1d-ngram")


@pytest.fixture(scope="module", params=TOPOLOGIES)
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            model_dir: Path) -> Iterator[Cluster]:
    name = request.param
    spec = NGRAM
    c = Cluster(tmp_path_factory.mktemp(name))
    try:
        c.start_gateway()
        if name.startswith("colocated"):
            c.add_worker("worker", "--speculative-config", spec)
            c.wait_roles(colocated=1)
        else:
            c.add_worker("prefill")
            c.add_worker("decode", "--speculative-config", spec)
            c.wait_roles(prefill=1, decode=1)
        yield c
    finally:
        c.stop()


def _bodies(reference: Reference) -> list[dict[str, Any]]:
    base = {"model": reference.model_name, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    return [
        {**base, "prompt": PROMPTS[0], "temperature": 0, "logprobs": 2},
        {**base, "prompt": PROMPTS[1], "temperature": 0.9, "seed": 3, "presence_penalty": 0.5,
         "frequency_penalty": 0.4, "repetition_penalty": 1.2},
        {**base, "prompt": PROMPTS[0], "temperature": 0.8, "seed": 4, "n": 2},
        {**base, "prompt": PROMPTS[1], "temperature": 0, "speculative": False},
    ]


def _expected(reference: Reference, body: dict[str, Any]) -> list[str]:
    knobs = {k: v for k, v in body.items() if k not in ("model", "prompt", "stream", "speculative")}
    return [reference.text(ids) for ids in reference.generate(reference.completion_ids(body["prompt"]), **knobs)]


def _texts(events: list[Any], n: int) -> list[str]:
    texts = [""] * n
    for ev in events[:-1]:
        for ch in ev.get("choices", []):
            texts[ch["index"]] += ch["text"]
    return texts


def test_streams_equal_the_engine_without_speculation(cluster: Cluster, reference: Reference) -> None:
    for body in _bodies(reference):
        want = _expected(reference, body)
        status, out = http("POST", f"{cluster.url}/v1/completions", body)
        assert status == 200, out
        assert [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])] == want, body
        events = sse(f"{cluster.url}/v1/completions", {**body, "stream": True})
        assert events[-1] == "[DONE]" and _texts(events, body.get("n", 1)) == want, body
    # A stop string that ends the text inside a verified run of drafts.
    body = _bodies(reference)[0]
    full = _expected(reference, body)[0]
    ids = reference.generate(reference.completion_ids(body["prompt"]), max_tokens=MAX_TOKENS, temperature=0.0)[0]
    stop = _stop_after(reference, ids, 8)
    cut = full[:full.find(stop)]
    status, out = http("POST", f"{cluster.url}/v1/completions", {**body, "stop": stop})
    assert status == 200 and out["choices"][0]["text"] == cut and out["choices"][0]["finish_reason"] == "stop"
    cluster.wait_idle()


def test_decode_worker_reports_drafts_and_the_gateway_reexports_them(cluster: Cluster) -> None:
    decoder = next(w for w in cluster.worker_list() if w["role"] != "prefill")
    seen: dict[str, float] = {}

    def reexported() -> bool:
        # A request the gateway already finished (the stop-string one) may still be
        # drafting on the worker until its abort lands: wait for the worker to be idle,
        # then for its heartbeat to carry the final count to the gateway.
        text = worker_metrics(decoder)
        if metric_value(text, "llm_num_running_seqs") != 0:
            return False
        for name in ("drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos"):
            seen[name] = metric_value(text, f"llm_spec_decode_num_{name}_total")
        status, body = http("GET", f"{cluster.url}/metrics")
        return metric_value(body, "llm_spec_decode_num_drafts_count") == seen["drafts"]

    cluster._wait(reexported, "the gateway's llm_spec_decode_num_drafts_count", timeout=30)
    assert seen["drafts"] > 0 and 0 < seen["accepted_tokens"] <= seen["draft_tokens"]
    assert seen["accepted_tokens_per_pos"] == seen["accepted_tokens"]


def _trained(home: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, str], Reference, str]:
    """The trained built-in model and its trained draft: the processes' environment, the
    reference engine, and a draft_model config that drafts at every batch size."""
    from gateway.tokenizer import Tokenizer
    from pdserve.builtin.default_model import default_model_dir, draft_model_dir
    from pdserve.engine.core.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from tests.e2e.cluster import DTYPE

    env = {"PDSERVE_HOME": str(home), "PDSERVE_BUILTIN_WEIGHTS": "trained"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    model = default_model_dir()  # assembled here, before the processes look for it
    engine = LLMEngine(EngineConfig(model_dir=str(model), dtype=DTYPE, num_threads=1,
                                    cache=CacheConfig(num_blocks=256)))
    spec = json.dumps({"method": "draft_model", "model": str(draft_model_dir()), "num_speculative_tokens": 3,
                       "disable_by_batch_size": 64})
    return env, Reference(engine, Tokenizer.from_model_dir(model), model.name), spec


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_kill_decode_mid_speculation_resumes_exactly(method: str, tmp_path: Path, reference: Reference,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # draft_model: the trained target with its trained draft. The survivor has none of the
    # victim's draft KV; it prefills the draft over prompt + recovered output itself, and
    # keeps accepting drafts only if that rebuilt state matches the sequence.
    env: dict[str, str] = {}
    spec = NGRAM
    if method == "draft_model":
        env, reference, spec = _trained(tmp_path / "home", monkeypatch)
    c = Cluster(tmp_path)
    # least-loaded: decode placement by most free KV, so every stream lands on the victim
    # (kv-aware would spread them by running count).
    c.start_gateway("--heartbeat-timeout", "1.5", "--router", "least-loaded",
                    env={**env, "PDSERVE_GATEWAY_SEED_KEY": KEY.hex()})
    try:
        c.add_worker("prefill", env=env)
        victim = c.add_worker("decode", "--num-blocks", "1024", "--speculative-config", spec,
                              "--enable-fault-injection", env={**env, "PDSERVE_FAULTS": "step_delay_s=0.1"})
        survivor = c.add_worker("decode", "--speculative-config", spec, env=env)
        c.wait_roles(prefill=1, decode=2)
        # Streams four times as long as test_exact_recovery's: a verified step yields up to
        # five tokens, and every stream must still be mid-way when the kill lands.
        bodies = [{**body, "max_tokens": 4 * body["max_tokens"]} for body in _mixed_bodies(reference)]
        streams = [Stream(c.url, f"exact-{i}", body) for i, body in enumerate(bodies)]
        for s in streams:
            s.thread.start()
        for s in streams:
            s.wait_chunks(KILL_AFTER)
        victim.signal(signal.SIGKILL)
        assert all(not s.finishes for s in streams)  # each cut mid-stream
        _check(reference, streams)
        gateway_log = c.gateway.log_path.read_text() if c.gateway else ""
        for s in streams:  # each was interrupted and continued on the surviving decode worker
            assert f"recovering {s.rid} " in gateway_log, s.rid
        c.wait_roles(prefill=1, decode=1)
        c.wait_idle(timeout=50)
        left = worker_metrics(next(w for w in c.worker_list() if w["pid"] == survivor.popen.pid))
        drafted = metric_value(left, "llm_spec_decode_num_draft_tokens_total")
        accepted = metric_value(left, "llm_spec_decode_num_accepted_tokens_total")
        print(f"survivor: {accepted:.0f} of {drafted:.0f} draft tokens accepted")
        assert metric_value(left, "llm_spec_decode_num_drafts_total") > 0
        if method == "draft_model":
            assert accepted >= 0.3 * drafted, (accepted, drafted)
    finally:
        c.stop()
