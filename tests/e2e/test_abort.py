"""Client disconnects at random points free every KV block on every worker."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import random
import socket
import time
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
            "stream_options": {"include_usage": True}}
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


def _send_and_close_after(port: int, model: str, i: int, delay_s: float) -> None:
    """Send a streaming request on a raw socket and hang up after `delay_s`, wherever the
    request is by then (queued, prefilling, transferring KV or decoding)."""
    body = json.dumps({"model": model, "prompt": f"abort test {i} " + "pad " * (i % 60),
                       "max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True})
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        time.sleep(delay_s)


def _one(port: int, model: str, i: int, action: tuple[str, float]) -> int | None:
    kind, arg = action
    if kind == "read":
        return _stream_and_maybe_drop(port, model, i, None)
    if kind == "events":
        _stream_and_maybe_drop(port, model, i, int(arg))
    else:
        _send_and_close_after(port, model, i, arg)
    return None


def test_random_disconnects_free_all_kv(log_dir: Path, reference: Reference) -> None:
    """200 requests, a random half of them abandoned at random points: before the first
    byte comes back (queued, prefilling, transferring) or mid-stream (decoding)."""
    rng = random.Random(7)
    plan: list[tuple[str, float]] = []
    for _ in range(200):
        if rng.random() < 0.5:
            plan.append(("read", 0.0))
        elif rng.random() < 0.5:
            plan.append(("time", rng.uniform(0.0, 0.6)))
        else:
            plan.append(("events", float(rng.choice([1, 2, 5, 20]))))
    with running_cluster(log_dir, {"prefill": 1, "decode": 1}) as c:
        with cf.ThreadPoolExecutor(32) as pool:
            got = list(pool.map(lambda a: _one(c.port, reference.model_name, *a), enumerate(plan)))
        for action, n in zip(plan, got, strict=True):
            if action[0] == "read":
                assert n == 60  # the survivors streamed every token
        for w in c.wait_idle(timeout=60):
            assert w["free_blocks"] == w["total_blocks"]
        assert c.gateway is not None and c.gateway.alive()
        assert all(w.alive() for w in c.workers), "a worker died under client aborts"
        status, body = http_call("GET", f"{c.url}/ready")
        assert status == 200, body
        # Still serving correctly afterwards.
        want = reference.generate(reference.completion_ids("after aborts"), max_tokens=6, temperature=0.0)[0]
        status, out = http_call("POST", f"{c.url}/v1/completions",
                                {"model": reference.model_name, "prompt": "after aborts", "max_tokens": 6, "temperature": 0})
        assert status == 200 and out["choices"][0]["text"] == reference.text(want)
