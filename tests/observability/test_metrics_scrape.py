"""Issue 5 acceptance: `/metrics` on the gateway and on every worker after real traffic.

The four design metrics exist with the right types (TTFT and TPOT histograms with
the design's bucket bounds, batch size and KV usage gauges per worker, re-exported
by the gateway with `role`/`worker` labels), their counts match the traffic, a
worker's KV gauge shows a running stream at the next scrape (gauges are set by the
worker's main loop every step, not by the heartbeat), and KV usage returns to its
idle value once the traffic is over.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.metrics import TPOT_BUCKETS, TTFT_BUCKETS
from tests.e2e.cluster import Cluster, http, running_cluster
from tests.observability.obs import (
    MODEL,
    bucket_bounds,
    families,
    held_stream,
    samples,
    scrape,
    stream,
    value,
    wait_until,
)

TTFT = "llm_time_to_first_token_seconds"
TPOT = "llm_time_per_output_token_seconds"
BATCH = "llm_current_batch_size"
KV = "llm_kv_cache_usage_ratio"
LONG_TOKENS = 96
HELD_TOKENS = 1500  # the held stream cannot finish before its KV shows (it is let go first)


@pytest.fixture(scope="module")
def colocated_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("obs-colo"), {"worker": 1}) as c:
        yield c


def worker_url(w: dict[str, Any]) -> str:
    return f"http://127.0.0.1:{w['metrics_port']}/metrics"


def send_traffic(c: Cluster) -> list[int]:
    """3 streaming + 3 non-streaming short requests and one long stream, concurrently;
    the completion token count of each."""
    url = f"{c.url}/v1/completions"
    base = {"model": MODEL, "temperature": 0, "ignore_eos": True}

    def streamed(i: int, n: int) -> int:
        s = stream(url, {**base, "prompt": f"stream {i}", "max_tokens": n, "stream": True,
                         "stream_options": {"include_usage": True}})
        assert s.events[-1] == "[DONE]" and s.finish_reasons == ["length"], s.events[-3:]
        assert s.completion_tokens == n
        return n

    def plain(i: int) -> int:
        status, body = http("POST", url, {**base, "prompt": f"plain {i}", "max_tokens": 6})
        assert status == 200, body
        return int(body["usage"]["completion_tokens"])

    with cf.ThreadPoolExecutor(7) as pool:
        futs = [pool.submit(streamed, 99, LONG_TOKENS)]
        futs += [pool.submit(streamed, i, 6) for i in range(3)]
        futs += [pool.submit(plain, i) for i in range(3)]
        return [f.result() for f in futs]


def check_fleet_metrics(c: Cluster) -> None:
    workers = c.wait_idle()
    idle = {w["id"]: value(scrape(worker_url(w)), KV) for w in workers}
    gw_before = scrape(f"{c.url}/metrics")
    tokens = send_traffic(c)
    sent = len(tokens)

    # Gateway: histograms with the design's buckets, counts equal to the traffic.
    gw = scrape(f"{c.url}/metrics")
    fams = families(gw)
    assert fams[TTFT].type == "histogram" and fams[TPOT].type == "histogram"
    assert bucket_bounds(gw, TTFT) == list(TTFT_BUCKETS)
    assert (TTFT_BUCKETS[0], TTFT_BUCKETS[-1]) == (0.05, 10.0)
    assert bucket_bounds(gw, TPOT) == list(TPOT_BUCKETS)
    assert (TPOT_BUCKETS[0], TPOT_BUCKETS[-1]) == (0.005, 0.25)
    assert value(gw, f"{TTFT}_count") - value(gw_before, f"{TTFT}_count") == sent
    assert value(gw, f"{TTFT}_bucket", le="+Inf") - value(gw_before, f"{TTFT}_bucket", le="+Inf") == sent
    assert value(gw, f"{TPOT}_count") - value(gw_before, f"{TPOT}_count") == sent  # every request > 1 token
    assert value(gw, f"{TTFT}_sum") > value(gw_before, f"{TTFT}_sum")
    assert value(gw, "llm_generation_tokens_total") - value(gw_before, "llm_generation_tokens_total") == sum(tokens)

    # Workers: their own gauges, labelled with their role and id; work counted.
    for w in workers:
        labels = {"role": w["role"], "worker": w["id"]}
        text = scrape(worker_url(w))
        fams = families(text)
        assert fams[KV].type == "gauge" and samples(text, KV, **labels), text
        if w["role"] != "prefill":
            assert fams[BATCH].type == "gauge" and samples(text, BATCH, **labels), text
        counter = "llm_decode_tokens_total" if w["role"] == "decode" else "llm_prefill_tokens_total"
        url = worker_url(w)

        def counted(url: str = url, counter: str = counter) -> bool:
            return value(scrape(url), counter) > 0

        wait_until(counted, f"{counter} on {w['id']}")

    # The gateway re-exports every worker's gauges with role and worker labels.
    fams = families(gw)
    assert fams[KV].type == "gauge" and fams[BATCH].type == "gauge"
    for w in workers:
        labels = {"role": w["role"], "worker": w["id"]}
        assert len(samples(gw, KV, **labels)) == 1, (labels, samples(gw, KV))
        if w["role"] != "prefill":
            assert len(samples(gw, BATCH, **labels)) == 1, (labels, samples(gw, BATCH))

    # KV is in use while a stream runs: hold one open until its worker's gauge shows it.
    holders = [w for w in workers if w["role"] != "prefill"]
    body = {"model": MODEL, "prompt": "held", "max_tokens": HELD_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with held_stream(f"{c.url}/v1/completions", body):

        def kv_in_use() -> bool:
            return any(value(scrape(worker_url(w)), KV) > idle[w["id"]] for w in holders)

        wait_until(kv_in_use, "a KV holder's gauge above idle while a stream runs")

    def back_to_idle() -> bool:
        gw_now = scrape(f"{c.url}/metrics")
        for w in workers:
            labels = {"role": w["role"], "worker": w["id"]}
            if value(scrape(worker_url(w)), KV) != idle[w["id"]] or value(gw_now, KV, **labels) != idle[w["id"]]:
                return False
            if w["role"] != "prefill" and value(gw_now, BATCH, **labels) != 0:
                return False
        return True

    wait_until(back_to_idle, "KV usage back to its idle value on every worker and in the gateway", timeout=20)


def test_disaggregated_fleet_metrics(pd_cluster: Cluster) -> None:
    check_fleet_metrics(pd_cluster)


def test_colocated_fleet_metrics(colocated_cluster: Cluster) -> None:
    check_fleet_metrics(colocated_cluster)


def test_health_and_ready(pd_cluster: Cluster) -> None:
    assert http("GET", f"{pd_cluster.url}/health")[0] == 200
    status, body = http("GET", f"{pd_cluster.url}/ready")
    assert status == 200 and body["ready"] is True, body
    for w in pd_cluster.worker_list():
        status, body = http("GET", f"http://127.0.0.1:{w['metrics_port']}/health")
        assert status == 200, (w, body)
