"""Live role flips through real processes (gateway/admin_roles.py, worker/role_switch.py).

One cluster for the module: a gateway with an admin token and round-robin routing, one
prefill and two decode workers. Streams run while a decode worker turns into a prefill
worker and back; every stream completes with the single-process engine's tokens, the
flipped worker then serves its new role, and no KV block is left behind.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, http, metric_value, sse, worker_metrics
from tests.e2e.conftest import Reference

TOKEN = "flip-test-admin-token-0123456789"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("role_flip"))
    try:
        c.start_gateway("--router", "round-robin", env={"PDSERVE_ADMIN_TOKEN": TOKEN})
        c.add_worker("prefill")
        c.add_worker("decode")
        c.add_worker("decode")
        c.wait_roles(prefill=1, decode=2)
        yield c
    finally:
        for w in c.workers:  # drain all at once; stop() then waits for each
            w.signal(signal.SIGTERM)
        c.stop()


def admin(c: Cluster, worker_id: str, body: Any, token: str | None = TOKEN) -> tuple[int, Any]:
    import json

    req = urllib.request.Request(f"{c.url}/admin/workers/{worker_id}/role", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream_text(c: Cluster, ref: Reference, prompt: str) -> str:
    """A greedy stream's text, checked to end with [DONE] and no error event."""
    body = {"model": ref.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "ignore_eos": True}
    events = sse(f"{c.url}/v1/completions", body, timeout=120)
    assert events[-1] == "[DONE]", events[-3:]
    assert not any("error" in e for e in events[:-1] if isinstance(e, dict)), events
    return "".join(ch["text"] for e in events[:-1] for ch in e.get("choices", []))


def want_text(ref: Reference, prompt: str) -> str:
    """The single-process engine's greedy text (what a run without any flip gives)."""
    out = ref.generate(ref.completion_ids(prompt), max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)[0]
    assert len(out) == MAX_TOKENS
    return ref.text(out)


def by_id(c: Cluster, worker_id: str) -> dict[str, Any]:
    return next(w for w in c.worker_list() if w["id"] == worker_id)


def flip_under_load(c: Cluster, ref: Reference, target: str, role: str, tag: str) -> dict[str, Any]:
    """Start streams, wait until `target` holds some, flip it, and check every stream."""
    prompts = [f"{tag} stream {i}: " + "tell me more " * (i % 4) for i in range(6)]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(stream_text, c, ref, p) for p in prompts]
        c._wait(lambda: by_id(c, target)["inflight_requests"] > 0, f"{target} holding a stream", 60)
        status, body = admin(c, target, {"role": role})
        assert status == 202, body
        got = [f.result(timeout=120) for f in futures]
    assert body["inflight"] > 0  # it drained work, not an idle worker
    assert got == [want_text(ref, p) for p in prompts]
    # Drained, not aborted: no stream needed the gateway's recovery (re-prefill elsewhere),
    # which would also give the same tokens.
    assert c.gateway is not None and "recovering" not in c.gateway.log_path.read_text()
    c._wait(lambda: by_id(c, target)["role"] == role and not by_id(c, target)["draining"],
            f"{target} registered as {role}", 90)
    return by_id(c, target)


def test_admin_call_needs_the_token_and_refuses_bad_flips(cluster: Cluster) -> None:
    c = cluster
    prefill = next(w for w in c.worker_list() if w["role"] == "prefill")
    decode = next(w for w in c.worker_list() if w["role"] == "decode")
    assert admin(c, decode["id"], {"role": "prefill"}, token=None)[0] == 401
    assert admin(c, decode["id"], {"role": "prefill"}, token="wrong-token-wrong-token")[0] == 401
    assert admin(c, decode["id"], {"role": "colocated"})[0] == 400
    assert admin(c, decode["id"], {"nope": 1})[0] == 400
    assert admin(c, "no-such-worker", {"role": "prefill"})[0] == 404
    assert admin(c, decode["id"], {"role": "decode"})[0] == 409
    status, body = admin(c, prefill["id"], {"role": "decode"})  # the only prefill worker
    assert status == 409 and "last prefill" in body["error"]["message"]
    assert not any(w["draining"] for w in c.worker_list())


def test_decode_worker_flips_to_prefill_and_back_under_load(cluster: Cluster, reference: Reference) -> None:
    c = cluster
    target = sorted(w["id"] for w in c.worker_list() if w["role"] == "decode")[0]
    before = worker_metrics(by_id(c, target))
    assert metric_value(before, "llm_role_flips_total") == 0

    flipped = flip_under_load(c, reference, target, "prefill", "down")
    assert metric_value(worker_metrics(flipped), "llm_role_flips_total") == 1
    # Round-robin over two prefill workers: the flipped one prefills one of these.
    prompts = [f"after flip {i}" for i in range(2)]
    with cf.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda p: stream_text(c, reference, p), prompts))
    assert got == [want_text(reference, p) for p in prompts]
    assert metric_value(worker_metrics(by_id(c, target)), "llm_prefill_requests_total") >= 1

    back = flip_under_load(c, reference, target, "decode", "up")
    assert metric_value(worker_metrics(back), "llm_role_flips_total") == 2
    served = metric_value(worker_metrics(back), "llm_worker_requests_total")
    with cf.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda p: stream_text(c, reference, p), prompts))
    assert got == [want_text(reference, p) for p in prompts]
    assert metric_value(worker_metrics(by_id(c, target)), "llm_worker_requests_total") > served

    status, text = http("GET", f"{c.url}/metrics")
    assert status == 200
    assert 'llm_role_flips_total{from_role="decode",to_role="prefill"} 1.0' in text
    assert 'llm_role_flips_total{from_role="prefill",to_role="decode"} 1.0' in text
    c.wait_idle()
