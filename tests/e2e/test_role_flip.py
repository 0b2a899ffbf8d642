"""Live role flips through real processes (gateway/admin_roles.py, pdserve/worker/role_switch.py).

One cluster for the module: two gateways (each with the admin token and round-robin
routing) over one prefill and two decode workers, every worker registered with both;
the decode worker that flips has the larger KV pool. Streams run while it turns into a
prefill worker and back; every stream completes with the single-process engine's
tokens, the flipped worker then serves its new role, and no KV block is left behind.
A flip asked of one gateway is learnt by the other from the worker's own messages (its
`Deregister(final=False)` and its new registration): streams on both gateways during
the flip all complete, and the other gateway then routes the worker's new role to it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.cluster import WORKER_BLOCKS, Cluster, http, metric_value, sse, worker_metrics
from tests.e2e.conftest import Reference

TOKEN = "flip-test-admin-token-0123456789"
MAX_TOKENS = 32
# The flipping decode worker's pool (the others have WORKER_BLOCKS): back in the decode
# role and idle, it has the most free KV, so a gateway's decode reservations go there.
# With equal pools every idle decode worker reports all its blocks free (cached prefix
# blocks count as free), and the choice would fall to the worker-id tie-break.
TARGET_BLOCKS = "320"


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Cluster]]:
    """(the first gateway, which owns the workers; a second gateway over the same workers)."""
    c, other = Cluster(tmp_path_factory.mktemp("role_flip")), Cluster(tmp_path_factory.mktemp("role_flip_b"))
    try:
        for g in (c, other):
            g.start_gateway("--router", "round-robin", env={"PDSERVE_ADMIN_TOKEN": TOKEN})
        for role, blocks in (("prefill", WORKER_BLOCKS), ("decode", WORKER_BLOCKS), ("decode", TARGET_BLOCKS)):
            c.add_worker(role, "--gateway", other.control, "--num-blocks", blocks)
        other.workers = c.workers  # for its logs on a timeout; c stops them
        for g in (c, other):
            g.wait_roles(prefill=1, decode=2)
        yield c, other
    finally:
        for w in c.workers:  # drain all at once; stop() then waits for each
            w.signal(signal.SIGTERM)
        c.stop()
        other.workers = []
        other.stop()


@pytest.fixture(scope="module")
def cluster(gateways: tuple[Cluster, Cluster]) -> Cluster:
    return gateways[0]


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


def flipping_decode_worker(c: Cluster) -> str:
    """The decode worker with the larger pool (TARGET_BLOCKS): the one the tests flip."""
    decode = [w for w in c.worker_list() if w["role"] == "decode"]
    assert sorted(w["total_blocks"] for w in decode) == [int(WORKER_BLOCKS) - 1, int(TARGET_BLOCKS) - 1], decode
    return str(max(decode, key=lambda w: w["total_blocks"])["id"])


def wait_most_free_decode(g: Cluster, target: str) -> None:
    """Until gateway `g` lists `target` as a routable decode worker with more free KV
    blocks than any other decode worker: then `g` reserves a new stream's blocks there
    (gateway/router.py `pick_decode`), whatever heartbeat arrives meanwhile."""
    def most_free() -> bool:
        pool = [w for w in g.worker_list() if w["role"] == "decode" and not w["draining"] and not w["stalled"]]
        mine = [w for w in pool if w["id"] == target]
        return bool(mine) and all(w["free_blocks"] < mine[0]["free_blocks"] for w in pool if w["id"] != target)

    g._wait(most_free, f"{target} listed as the decode worker with the most free KV", 30)


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
    target = flipping_decode_worker(c)
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
    wait_most_free_decode(c, target)
    with cf.ThreadPoolExecutor(2) as pool:  # the emptied, larger pool has the most free KV: both reserve there
        got = list(pool.map(lambda p: stream_text(c, reference, p), prompts))
    assert got == [want_text(reference, p) for p in prompts]
    assert metric_value(worker_metrics(by_id(c, target)), "llm_worker_requests_total") == served + len(prompts)

    status, text = http("GET", f"{c.url}/metrics")
    assert status == 200
    assert 'llm_role_flips_total{from_role="decode",to_role="prefill"} 1.0' in text
    assert 'llm_role_flips_total{from_role="prefill",to_role="decode"} 1.0' in text
    c.wait_idle()


def gateway_flips(g: Cluster, from_role: str, to_role: str) -> float:
    """Completed flips gateway `g` has counted (it counts a re-registration in a new role)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = http("GET", f"{g.url}/metrics")
    assert status == 200
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "llm_role_flips_total" and s.labels == {"from_role": from_role, "to_role": to_role})


def flip_across(asker: Cluster, other: Cluster, ref: Reference, target: str, role: str, tag: str) -> None:
    """Streams through `other` until `target` has taken one on (its accepted-requests
    counter moved: a condition that stays true, where a prefill's few milliseconds of
    in-flight are a race to catch), then more on both gateways, and while those run
    flip `target` through `asker`. Every stream on either gateway completes with the
    engine's tokens, and `other` learns the new role (listed, counted, not draining)."""
    old_role = by_id(other, target)["role"]
    counted = gateway_flips(other, old_role, role)
    accepted = metric_value(worker_metrics(by_id(other, target)), "llm_worker_requests_total")
    prompts: list[str] = []
    with cf.ThreadPoolExecutor(16) as pool:
        futures: list[cf.Future[str]] = []

        def submit(g: Cluster) -> None:
            prompts.append(f"{tag} {len(prompts)}: " + "tell me more " * (len(prompts) % 4))
            futures.append(pool.submit(stream_text, g, ref, prompts[-1]))

        def taken_on() -> bool:
            return metric_value(worker_metrics(by_id(other, target)), "llm_worker_requests_total") > accepted

        while not taken_on():
            assert len(prompts) < 48, f"{target} never took a stream of the other gateway"
            for _ in range(4):  # round-robin over two prefill workers, or the most free KV: target's
                submit(other)
            with contextlib.suppress(AssertionError):
                other._wait(taken_on, "the target taking a stream", 30)
        for g in (other, other, other, asker) * 2:  # in flight across the flip
            submit(g)
        status, body = admin(asker, target, {"role": role})
        assert status == 202, body
        got = [f.result(timeout=120) for f in futures]
    assert got == [want_text(ref, p) for p in prompts]
    other._wait(lambda: by_id(other, target)["role"] == role and not by_id(other, target)["draining"],
                f"the other gateway listing {target} as {role}", 90)
    assert gateway_flips(other, old_role, role) == counted + 1


def test_a_flip_through_one_gateway_is_learnt_and_routed_by_the_other(
        gateways: tuple[Cluster, Cluster], reference: Reference) -> None:
    a, b = gateways
    target = flipping_decode_worker(a)
    prompts = [f"second gateway {i}" for i in range(2)]

    flip_across(a, b, reference, target, "prefill", "across down")
    before = metric_value(worker_metrics(by_id(b, target)), "llm_prefill_requests_total")
    with cf.ThreadPoolExecutor(2) as pool:  # round-robin over b's two prefill workers
        got = list(pool.map(lambda p: stream_text(b, reference, p), prompts))
    assert got == [want_text(reference, p) for p in prompts]
    assert metric_value(worker_metrics(by_id(b, target)), "llm_prefill_requests_total") == before + 1

    flip_across(b, a, reference, target, "decode", "across up")  # and back, asked of the other gateway
    served = metric_value(worker_metrics(by_id(a, target)), "llm_worker_requests_total")
    wait_most_free_decode(a, target)  # a's own view, not b's: heartbeats and registration reach each apart
    with cf.ThreadPoolExecutor(2) as pool:  # the emptied, larger pool has the most free KV: a reserves both there
        got = list(pool.map(lambda p: stream_text(a, reference, p), prompts))
    assert got == [want_text(reference, p) for p in prompts]
    assert metric_value(worker_metrics(by_id(a, target)), "llm_worker_requests_total") == served + len(prompts)
    for g in (a, b):
        g.wait_idle()
