"""Issue 5 acceptance: graceful shutdown of the gateway and of a worker, real processes.

Gateway SIGTERM while long streams are active, precisely:
- every active stream completes: all its tokens, `finish_reason` "length", usage, `[DONE]`;
- while any of them is still streaming, `/ready` answers 503 (reason "draining"),
  `/health` still answers 200, and a new generation request answers 503 with
  `Retry-After` in OpenAI's error envelope (code "draining");
- the gateway then exits 0 and a new connection is refused.

Worker SIGTERM while it holds sequences: it deregisters at once (listed as
`draining` by `GET /v1/workers`, its own /health answers 503, nothing new is routed
to it), finishes every sequence it holds, exits 0 and leaves the worker list.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, Proc, running_cluster
from tests.observability.obs import MODEL, Stream, post, stream, wait_until

LONG = 240  # tokens per long stream: seconds of decoding on the tiny CPU model
STREAMS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One cluster for both tests: the worker test runs first and replaces the decode
    worker it stopped; the gateway test stops the gateway last."""
    with running_cluster(tmp_path_factory.mktemp("obs-drain"), {"prefill": 1, "decode": 1}) as c:
        yield c


def ensure_decode_worker(c: Cluster) -> None:
    if not any(w["role"] == "decode" and not w["draining"] for w in c.worker_list()):
        c.add_worker("decode")
    c.wait_roles(prefill=1, decode=1)


def request(url: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> tuple[int, dict[str, str], Any]:
    """(status, lower-cased headers, parsed JSON body) of a GET (no body) or POST."""
    req = post(url, body) if body is not None else urllib.request.Request(url)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, headers, raw = r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        status, headers, raw = e.code, dict(e.headers), e.read()
    return status, {k.lower(): v for k, v in headers.items()}, json.loads(raw) if raw else None


def start_long_streams(c: Cluster, pool: cf.ThreadPoolExecutor) -> list[cf.Future[Stream]]:
    """STREAMS long streams, returned once every one has received its first event."""
    started = threading.Semaphore(0)
    body = {"model": MODEL, "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    futs = [pool.submit(stream, f"{c.url}/v1/completions", {**body, "prompt": f"long story {i}"},
                        None, 120.0, started.release) for i in range(STREAMS)]
    for _ in futs:
        assert started.acquire(timeout=60), [f.exception() for f in futs if f.done()]
    return futs


def check_complete(s: Stream) -> None:
    assert s.status == 200
    assert s.events[-1] == "[DONE]", s.events[-3:]
    assert s.finish_reasons == ["length"], s.events[-3:]
    assert s.completion_tokens == LONG


def new_request_body() -> dict[str, Any]:
    return {"model": MODEL, "prompt": "too late", "max_tokens": 2}


def _decode(c: Cluster) -> tuple[Proc, dict[str, Any]]:
    listed = [w for w in c.worker_list() if w["role"] == "decode"]
    assert len(listed) == 1, listed
    proc = next(p for p in c.workers if p.popen.pid == listed[0]["pid"])
    return proc, listed[0]


def test_worker_sigterm_deregisters_finishes_sequences_exits_0(cluster: Cluster) -> None:
    ensure_decode_worker(cluster)
    proc, info = _decode(cluster)
    with cf.ThreadPoolExecutor(STREAMS) as pool:
        futs = start_long_streams(cluster, pool)
        proc.signal(signal.SIGTERM)

        def deregistered() -> dict[str, Any] | None:
            w = next((w for w in cluster.worker_list() if w["id"] == info["id"]), None)
            return w if w is not None and w["draining"] else None

        listed = wait_until(deregistered, "the decode worker listed as draining", timeout=10, interval=0.02)
        health, _, _ = request(f"http://127.0.0.1:{info['metrics_port']}/health")
        # Nothing new is routed to a draining worker: with no other decode worker, 503.
        status, headers, body = request(f"{cluster.url}/v1/completions", new_request_body())
        probed_at = time.monotonic()
        streams = [f.result(timeout=120) for f in futs]

    assert listed["inflight_requests"] == STREAMS, listed
    assert health == 503
    assert status == 503 and int(headers["retry-after"]) >= 1, (status, headers, body)
    assert body["error"]["code"] == "no_workers", body
    assert all(s.done_at is not None and s.done_at > probed_at for s in streams), "streams ended before the probes"
    for s in streams:
        check_complete(s)
    assert proc.popen.wait(30) == 0, proc.log()
    wait_until(lambda: all(w["id"] != info["id"] for w in cluster.worker_list()),
               "the stopped worker to leave the worker list", timeout=10)
    assert cluster.gateway is not None and cluster.gateway.alive()
    ensure_decode_worker(cluster)


def test_gateway_sigterm_drains_active_streams_then_exits_0(cluster: Cluster) -> None:
    gateway = cluster.gateway
    assert gateway is not None and gateway.alive()
    ensure_decode_worker(cluster)
    with cf.ThreadPoolExecutor(STREAMS) as pool:
        futs = start_long_streams(cluster, pool)
        gateway.signal(signal.SIGTERM)

        def draining() -> bool:
            status, _, body = request(f"{cluster.url}/ready")
            return status == 503 and body == {"ready": False, "reason": "draining"}

        wait_until(draining, "/ready to answer 503 draining", timeout=10, interval=0.02)
        status, headers, body = request(f"{cluster.url}/v1/completions", new_request_body())
        health, _, _ = request(f"{cluster.url}/health")
        probed_at = time.monotonic()
        streams = [f.result(timeout=120) for f in futs]

    assert status == 503, body
    assert int(headers["retry-after"]) >= 1, headers
    assert body["error"]["code"] == "draining" and body["error"]["message"], body
    assert health == 200
    # The probes above ran while the streams were still active.
    assert all(s.done_at is not None and s.done_at > probed_at for s in streams), "streams ended before the probes"
    for s in streams:
        check_complete(s)
    assert gateway.popen.wait(30) == 0, gateway.log()
    with pytest.raises(urllib.error.URLError) as exc:
        request(f"{cluster.url}/v1/completions", new_request_body(), timeout=5)
    assert isinstance(exc.value.reason, ConnectionRefusedError), exc.value
