"""Client + runner against the fake SSE server on a loopback port.

Measured TTFT/ITL are checked against the server's known delays. Tolerances
are one-sided-wide because this host is shared: a loaded machine only ever
makes gaps longer.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from pdserve.loadgen.config import (
    BenchConfig,
    Endpoint,
    EndpointConfig,
    LoadConfig,
    MixedConfig,
    OutputConfig,
    WorkloadConfig,
    WorkloadKind,
    parse_slo,
)
from pdserve.loadgen.runner import run_benchmark
from tests.bench.fake_openai import FakeOpenAIServer

SLACK = 0.04  # seconds a loaded shared host may add to a median


def config(server: FakeOpenAIServer, **load: object) -> BenchConfig:
    wl = load.pop("workload", WorkloadConfig(input_len=16, output_len=5))
    ep = load.pop("endpoint", EndpointConfig(base_url=server.url, request_timeout_s=10))
    slo = load.pop("slo", parse_slo(""))
    return BenchConfig(
        endpoint=ep,  # type: ignore[arg-type]
        workload=wl,  # type: ignore[arg-type]
        load=LoadConfig(**{"num_requests": 6, "max_duration_s": 20, **load}),  # type: ignore[arg-type]
        slo=slo,  # type: ignore[arg-type]
        output=OutputConfig(progress=False),
    )


def test_concurrency_run_measures_known_delays(fake_server: FakeOpenAIServer) -> None:
    fake_server.behaviour.ttft_s, fake_server.behaviour.itl_s = 0.08, 0.03
    result = run_benchmark(config(fake_server, concurrency=2, warmup=2))
    assert result.model == "fake-model"
    (run,) = result.runs
    s = run.summary
    assert (s["completed"], s["failed"], len(run.records)) == (6, 0, 6)
    assert len(fake_server.requests) == 8  # warm-up sent, not measured
    assert s["total_output_tokens"] == 30 and s["total_prompt_tokens"] == 6 * 16
    assert 0.08 - 0.005 <= s["ttft"]["p50"] <= 0.08 + SLACK
    assert 0.03 - 0.005 <= s["itl"]["p50"] <= 0.03 + SLACK
    assert s["itl"]["count"] == 6 * 4
    assert 0.03 - 0.005 <= s["tpot"]["p50"] <= 0.03 + SLACK
    assert s["e2e"]["p50"] >= 0.08 + 4 * 0.03 - 0.005
    sent_ids = [{k.lower(): v for k, v in h.items()}["x-request-id"] for h in fake_server.headers]
    assert len(set(sent_ids)) == 8  # unique, so server logs can be matched to records
    assert {r.request_id for r in run.records} <= set(sent_ids)
    assert all(r.response_id == "x" for r in run.records)
    body = fake_server.requests[0]
    assert body["ignore_eos"] is True and body["max_tokens"] == 5 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "fake-model"


def test_multi_token_chunks_spread_to_per_token_itl(fake_server: FakeOpenAIServer) -> None:
    b = fake_server.behaviour
    b.ttft_s, b.itl_s, b.tokens_per_chunk = 0.02, 0.02, 3
    wl = WorkloadConfig(input_len=4, output_len=7)  # chunks of 1, 3, 3 tokens
    run = run_benchmark(config(fake_server, num_requests=2, workload=wl)).runs[0]
    assert all(len(r.chunk_times) == 3 and r.output_tokens == 7 for r in run.records)
    s = run.summary
    assert s["itl"]["count"] == 2 * 6
    assert 0.02 - 0.004 <= s["itl"]["p50"] <= 0.02 + SLACK


def test_chat_endpoint_api_key_and_failures(fake_server: FakeOpenAIServer, tmp_path: Path) -> None:
    fake_server.behaviour.api_key = "sekrit"
    ds = tmp_path / "d.jsonl"
    prompts = ["one two", "FAIL503 please", "ERRSTREAM now", "three four", "CLOSEEARLY x"]
    ds.write_text("\n".join(json.dumps({"prompt": p, "max_tokens": 3}) for p in prompts))
    cfg = config(
        fake_server,
        concurrency=2,
        num_requests=5,
        workload=WorkloadConfig(kind=WorkloadKind.DATASET, dataset_path=str(ds)),
        endpoint=EndpointConfig(
            base_url=fake_server.url, endpoint=Endpoint.CHAT, api_key="sekrit", model="m1"
        ),
    )
    s = run_benchmark(cfg).runs[0].summary
    assert s["completed"] == 2 and s["failed"] == 3
    assert s["failures"] == {"http_503": 1, "stream_error:500": 1, "incomplete_stream": 1}
    assert s["total_output_tokens"] == 6  # the role-only event is not a token
    assert fake_server.requests[0]["model"] == "m1" and "messages" in fake_server.requests[0]
    assert fake_server.headers[0]["Authorization"] == "Bearer sekrit"
    wrong = dataclasses.replace(cfg, endpoint=dataclasses.replace(cfg.endpoint, api_key="x"))
    assert run_benchmark(wrong).runs[0].summary["failures"] == {"http_401": 5}


def test_requests_take_the_models_in_turn(fake_server: FakeOpenAIServer) -> None:
    """`models` (e.g. LoRA adapter names): warm-up and measured requests cycle through
    them, each model as often as the others; `model` is then unused."""
    models = ("a0", "a1", "a2", "a3")
    ep = EndpointConfig(base_url=fake_server.url, model="base", models=models, request_timeout_s=10)
    result = run_benchmark(config(fake_server, concurrency=4, warmup=4, num_requests=8, endpoint=ep))
    assert result.model == "a0,a1,a2,a3" and result.runs[0].summary["completed"] == 8
    sent = sorted(r["model"] for r in fake_server.requests)
    assert sent == sorted(models * 3)  # 12 requests: 4 warm-up + 8 measured


def test_poisson_arrivals(fake_server: FakeOpenAIServer) -> None:
    fake_server.behaviour.ttft_s, fake_server.behaviour.itl_s = 0.01, 0.005
    t0 = time.perf_counter()
    run = run_benchmark(config(fake_server, request_rate=40.0, num_requests=8)).runs[0]
    assert run.summary["completed"] == 8 and run.request_rate == 40.0 and run.concurrency is None
    sends = sorted(r.send_time for r in run.records)
    assert sends[-1] - sends[0] > 0.0  # spread out, not a burst
    assert time.perf_counter() - t0 < 10


def test_max_duration_bounds_the_run(fake_server: FakeOpenAIServer) -> None:
    fake_server.behaviour.ttft_s, fake_server.behaviour.itl_s = 0.05, 0.2
    wl = WorkloadConfig(input_len=4, output_len=50)  # 10 s per request
    t0 = time.perf_counter()
    cfg = config(
        fake_server, concurrency=2, num_requests=100, max_duration_s=0.3, drain_timeout_s=0.2
    )
    run = run_benchmark(dataclasses.replace(cfg, workload=wl)).runs[0]
    assert time.perf_counter() - t0 < 3
    s = run.summary
    assert s["cancelled"] == 2 and s["completed"] == 0 and s["failed"] == 0


def test_sweep_and_slo_goodput(fake_server: FakeOpenAIServer) -> None:
    fake_server.behaviour.ttft_s, fake_server.behaviour.itl_s = 0.02, 0.01
    result = run_benchmark(
        config(fake_server, sweep=(1, 3), num_requests=3, slo=parse_slo("ttft=5,tpot=5"))
    )
    assert [r.label for r in result.runs] == ["c=1", "c=3"]
    for run in result.runs:
        assert run.summary["completed"] == 3 and run.summary["goodput"]["requests_met"] == 3
    tight = run_benchmark(config(fake_server, num_requests=2, slo=parse_slo("ttft=0.001")))
    assert tight.runs[0].summary["goodput"]["requests_met"] == 0


def test_mixed_workload_tags_long_prompts(fake_server: FakeOpenAIServer) -> None:
    fake_server.behaviour.ttft_s, fake_server.behaviour.itl_s = 0.01, 0.01
    wl = WorkloadConfig(
        kind=WorkloadKind.MIXED,
        input_len=4,
        output_len=10,
        mixed=MixedConfig(
            long_prompt_len=200, long_prompt_output_len=2, long_prompt_interval_s=0.15
        ),
    )
    cfg = config(fake_server, concurrency=2, num_requests=100, max_duration_s=0.5, workload=wl)
    run = run_benchmark(cfg).runs[0]
    tags = {r.tag for r in run.records}
    assert tags == {"decode", "long_prompt"}
    assert run.per_tag["long_prompt"]["completed"] >= 2
    assert run.per_tag["long_prompt"]["total_prompt_tokens"] % 200 == 0
    assert run.per_tag["decode"]["itl"]["count"] > 0


def test_server_without_usage(fake_server: FakeOpenAIServer) -> None:
    fake_server.behaviour.report_usage = False
    fake_server.behaviour.ttft_s = fake_server.behaviour.itl_s = 0.005
    s = run_benchmark(config(fake_server, num_requests=2)).runs[0].summary
    assert s["requests_without_usage"] == 2 and s["total_output_tokens"] == 10
    assert s["total_prompt_tokens"] == 32  # the client's word-count estimate
