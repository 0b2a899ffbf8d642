"""Client disconnects at random points free every KV block on every worker."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import random
from pathlib import Path

from tests.e2e.cluster import http as http_call
from tests.e2e.cluster import running_cluster
from tests.e2e.conftest import Reference


def _stream_and_maybe_drop(port: int, model: str, i: int, drop_after: int | None) -> int:
    """Stream a request; close the connection after `drop_after` events (None: read to the
    end and return the completion tokens reported in the final usage chunk)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": model, "prompt": f"abort test {i} " + "pad " * (i % 40), "max_tokens": 60,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    usage_tokens = -1
    try:
        while True:
            line = resp.readline()
            if not line or line.strip() == b"data: [DONE]":
                return usage_tokens
            if line.startswith(b"data: "):
                events += 1
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    usage_tokens = usage["completion_tokens"]
                if drop_after is not None and events >= drop_after:
                    return events
    finally:
        conn.close()


def test_random_disconnects_free_all_kv(log_dir: Path, reference: Reference) -> None:
    rng = random.Random(7)
    with running_cluster(log_dir, {"prefill": 1, "decode": 1}) as c:
        plan = [rng.choice([None, 1, 2, 5, 20]) for _ in range(24)]
        with cf.ThreadPoolExecutor(24) as pool:
            got = list(pool.map(lambda a: _stream_and_maybe_drop(c.port, reference.model_name, *a), enumerate(plan)))
        for drop, n in zip(plan, got, strict=True):
            if drop is None:
                assert n == 60  # the survivors streamed every token
        for w in c.wait_idle(timeout=40):
            assert w["free_blocks"] == w["total_blocks"]
        status, body = http_call("GET", f"{c.url}/ready")
        assert status == 200, body
        # Still serving correctly afterwards.
        want = reference.generate(reference.completion_ids("after aborts"), max_tokens=6, temperature=0.0)[0]
        status, out = http_call("POST", f"{c.url}/v1/completions",
                                {"model": reference.model_name, "prompt": "after aborts", "max_tokens": 6, "temperature": 0})  # fmt: skip
        assert status == 200 and out["choices"][0]["text"] == reference.text(want)
