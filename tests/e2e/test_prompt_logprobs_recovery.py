"""`prompt_logprobs` where the decode side computes the prompt, with real processes
(1P+2D): a request the gateway runs on a decode worker (local prefill, no KV handoff)
and one that goes through the prefill worker both report transformers' values within
1e-4; and a stream whose decode worker is killed mid-stream (SIGKILL) resumes on the
other one with its prompt logprobs reported once, in the first chunk, and its text that
of the single-process engine."""

from __future__ import annotations

import signal
import urllib.request
from pathlib import Path

from tests.e2e.cluster import Cluster, http
from tests.e2e.conftest import Reference
from tests.e2e.test_exact_recovery import KEY, KILL_AFTER, Stream
from tests.e2e.test_prompt_logprobs_serving import TOP, _check, _hf_logprobs

LOCAL_THRESHOLD = 24


def _local_prefills(c: Cluster) -> float:
    """The gateway's count of requests it ran on a decode worker (local prefill)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{c.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "llm_routing_decisions" and s.labels.get("reason") == "local_prefill")


def test_local_prefill_and_recovery_report_exact_prompt_logprobs(
    log_dir: Path, model_dir: Path, reference: Reference,
) -> None:
    c = Cluster(log_dir)
    try:
        c.start_gateway("--heartbeat-timeout", "1.5", "--router", "least-loaded", "--local-prefill-threshold",
                        str(LOCAL_THRESHOLD), env={"PDSERVE_GATEWAY_SEED_KEY": KEY.hex()})
        c.add_worker("prefill")
        victim = c.add_worker("decode", "--num-blocks", "1024", "--enable-fault-injection",
                              env={"PDSERVE_FAULTS": "step_delay_s=0.1"})
        c.add_worker("decode")
        c.wait_roles(prefill=1, decode=2)
        for prompt, local in (("A cat sat.", True), ("Stream of words " * 12, False)):
            before = _local_prefills(c)
            body = {"model": reference.model_name, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": TOP}
            status, out = http("POST", f"{c.url}/v1/completions", body)
            assert status == 200, out
            ids = reference.completion_ids(prompt)
            _check(out["choices"][0]["prompt_logprobs"], _hf_logprobs(model_dir, ids), ids)
            assert (_local_prefills(c) == before + 1) == local, prompt  # where it was computed

        prompt = "Once upon a time there was a boat that sailed the sea"
        body = {"model": reference.model_name, "prompt": prompt, "max_tokens": 40, "temperature": 0,
                "ignore_eos": True, "prompt_logprobs": TOP}
        s = Stream(c.url, "plp-recover", body)
        s.thread.start()
        s.wait_chunks(KILL_AFTER)
        held = {w["pid"]: w["inflight_requests"] for w in c.worker_list() if w["role"] == "decode"}
        assert held[victim.popen.pid] == 1, held
        victim.signal(signal.SIGKILL)
        texts, finishes = s.result()
        ids = reference.completion_ids(prompt)
        want = reference.text(reference.generate(ids, max_tokens=40, temperature=0, ignore_eos=True)[0])
        assert texts == [want] and finishes == ["length"]
        carrying = [ev for ev in s.events if any("prompt_logprobs" in ch for ch in ev.get("choices", []))]
        assert len(carrying) == 1 and carrying[0] is s.events[0]
        _check(carrying[0]["choices"][0]["prompt_logprobs"], _hf_logprobs(model_dir, ids), ids)
        assert "recovering plp-recover " in (c.gateway.log_path.read_text() if c.gateway else "")
        c.wait_roles(prefill=1, decode=1)
        c.wait_idle(timeout=50)
    finally:
        c.stop()
