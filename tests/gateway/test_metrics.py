"""/metrics after real traffic, parsed with prometheus_client's parser; per-request stage
timings returned to the client and adding up to the end-to-end latency."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.config import GatewayConfig
from gateway.metrics import TPOT_BUCKETS, TTFT_BUCKETS
from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model
from tests.gateway.local_backend import GatewayThread, LocalBackend, raw

MODEL = "m"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d: Path = write_default_model(tmp_path_factory.mktemp("gw-model"))
    return Tokenizer.from_model_dir(d)


@pytest.fixture
def gw(tok: Tokenizer) -> Iterator[tuple[GatewayThread, LocalBackend]]:
    backend = LocalBackend(tok, token_delay=0.01)
    with GatewayThread(GatewayConfig(model_name=MODEL), backend, tok) as g:
        yield g, backend


def scrape(g: GatewayThread) -> dict[str, tuple[str, list[Sample]]]:
    r = raw(g.url, "GET", "/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    return {f.name: (f.type, f.samples) for f in text_string_to_metric_families(r.body.decode())}


def value(samples: list[Sample], name: str, **labels: str) -> float:
    return next(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def buckets(samples: list[Sample], name: str) -> list[float]:
    return [float(s.labels["le"]) for s in samples if s.name == f"{name}_bucket" and s.labels["le"] != "+Inf"]


def test_metrics_after_traffic(gw: tuple[GatewayThread, LocalBackend]) -> None:
    g, backend = gw
    cl = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
    for _ in range(3):
        cl.completions.create(model=MODEL, prompt="hello", max_tokens=5)
    list(cl.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True))  # type: ignore[arg-type]
    raw(g.url, "POST", "/v1/completions", json_body={"prompt": "x", "temperature": -1})  # rejected
    fam = scrape(g)

    ttft_type, ttft = fam["llm_time_to_first_token_seconds"]
    assert ttft_type == "histogram"
    assert value(ttft, "llm_time_to_first_token_seconds_count") == 4
    assert value(ttft, "llm_time_to_first_token_seconds_sum") > 0
    assert buckets(ttft, "llm_time_to_first_token_seconds") == list(TTFT_BUCKETS)
    tpot_type, tpot = fam["llm_time_per_output_token_seconds"]
    assert tpot_type == "histogram" and value(tpot, "llm_time_per_output_token_seconds_count") == 4
    assert buckets(tpot, "llm_time_per_output_token_seconds") == list(TPOT_BUCKETS)
    # ~10 ms per token in the backend: the mean lands in the 0.01-0.025 s range.
    assert 0.005 < value(tpot, "llm_time_per_output_token_seconds_sum") / 4 < 0.1

    assert value(fam["llm_e2e_request_latency_seconds"][1], "llm_e2e_request_latency_seconds_count") == 4
    assert value(fam["llm_queue_wait_seconds"][1], "llm_queue_wait_seconds_count", priority="interactive") == 4
    assert fam["llm_prompt_tokens"][0] == "counter"
    assert value(fam["llm_generation_tokens"][1], "llm_generation_tokens_total") == 3 * 5 + 4
    assert value(fam["llm_prompt_tokens"][1], "llm_prompt_tokens_total") > 0
    assert value(fam["llm_requests_rejected"][1], "llm_requests_rejected_total", reason="invalid") == 1
    assert value(fam["llm_requests"][1], "llm_requests_total", endpoint="completions", status="400") == 1
    stages = fam["llm_request_stage_seconds"][1]
    for stage in ("parse", "tokenize", "queue_wait", "prefill_compute", "decode", "detokenize", "respond"):
        assert value(stages, "llm_request_stage_seconds_count", stage=stage) == 4, stage

    # Scrape-time gauges: admission state and the fleet re-exported from the backend.
    assert fam["llm_queue_depth"][0] == "gauge"
    assert {s.labels["priority"] for s in fam["llm_queue_depth"][1]} == {"interactive", "batch"}
    assert value(fam["llm_requests_in_flight"][1], "llm_requests_in_flight") == 0
    batch_type, batch = fam["llm_current_batch_size"]
    assert batch_type == "gauge" and batch[0].labels == {"role": "colocated", "worker": "local-0"}
    assert fam["llm_kv_cache_usage_ratio"][0] == "gauge"


def test_metrics_have_no_global_state(tok: Tokenizer) -> None:
    """Two apps in one process each count their own requests."""
    b1, b2 = LocalBackend(tok), LocalBackend(tok)
    with GatewayThread(GatewayConfig(model_name=MODEL), b1, tok) as g1, GatewayThread(GatewayConfig(model_name=MODEL), b2, tok) as g2:
        raw(g1.url, "POST", "/v1/completions", json_body={"prompt": "x", "max_tokens": 2})
        assert value(scrape(g1)["llm_e2e_request_latency_seconds"][1], "llm_e2e_request_latency_seconds_count") == 1
        assert value(scrape(g2)["llm_e2e_request_latency_seconds"][1], "llm_e2e_request_latency_seconds_count") == 0


def _check_adds_up(timings: dict[str, float], measured: float) -> None:
    parts = sum(v for k, v in timings.items() if k != "e2e")
    e2e = timings["e2e"]
    assert abs(parts - e2e) <= 0.05 * e2e + 0.005, timings
    assert e2e <= measured + 0.001  # the gateway's e2e fits inside what the client saw
    assert timings["decode"] > 0.5 * e2e  # the slow part is attributed to the right stage


def test_stage_timings_add_up_non_streaming(gw: tuple[GatewayThread, LocalBackend]) -> None:
    g, _ = gw
    cl = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
    resp = cl.completions.with_raw_response.create(
        model=MODEL, prompt="hello", max_tokens=20, extra_headers={"x-pdserve-timings": "1"})
    timings = json.loads(resp.headers["x-pdserve-timings"])
    assert set(timings) >= {"parse", "tokenize", "queue_wait", "prefill_queue", "prefill_compute", "kv_transfer",
                            "decode_queue", "decode", "detokenize", "respond", "e2e"}
    _check_adds_up(timings, resp.elapsed.total_seconds())
    plain = cl.completions.with_raw_response.create(model=MODEL, prompt="hello", max_tokens=2)
    assert "x-pdserve-timings" not in plain.headers


def test_stage_timings_add_up_streaming(gw: tuple[GatewayThread, LocalBackend]) -> None:
    g, _ = gw
    import time
    t0 = time.perf_counter()
    r = raw(g.url, "POST", "/v1/chat/completions", headers={"x-pdserve-timings": "1"},
            json_body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True,
                       "stream_options": {"include_usage": True}})
    measured = time.perf_counter() - t0
    data = r.sse_data()
    assert data[-1] == "[DONE]"
    final = json.loads(data[-2])
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 20
    _check_adds_up(final["pdserve_timings"], measured)
