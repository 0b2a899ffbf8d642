"""OpenTelemetry traces across real processes: the gateway and each worker export their
spans over OTLP/HTTP to a real receiver (tests/helpers/otlp_receiver.py, which decodes
the protobuf); the tests check the tree the spans form in the caller's trace, for a
colocated worker, 1 prefill + 1 decode, and a decode worker killed mid-stream."""

from __future__ import annotations

import concurrent.futures as cf
import json
import secrets
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import ROOT, Cluster
from tests.e2e.conftest import Reference
from tests.helpers.otlp_receiver import OtlpReceiver, ReceivedSpan, otlp_receiver

# The SDK's batch processor exports every 100 ms instead of every 5 s: the tests wait
# on the spans, and a shorter delay only makes the wait shorter.
ENV = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture()
def receiver() -> Iterator[OtlpReceiver]:
    with otlp_receiver() as r:
        yield r


def traced_cluster(log_dir: Path, receiver: OtlpReceiver, roles: dict[str, int],
                   *gateway_extra: str, worker_extra: tuple[str, ...] = (),
                   worker_env: dict[str, str] | None = None) -> Cluster:
    c = Cluster(log_dir)
    flag = ["--otlp-traces-endpoint", receiver.endpoint]
    c.start_gateway(*flag, *gateway_extra, env=ENV, wait=False)
    for role, n in roles.items():
        for _ in range(n):
            c.add_worker(role, *flag, *worker_extra, env={**ENV, **(worker_env or {})})
    c.wait_gateway()
    c.wait_roles(**{("colocated" if r == "worker" else r): n for r, n in roles.items()})
    return c


def caller_context() -> tuple[str, str, str]:
    """A caller's (trace id, span id, traceparent header)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def post(url: str, body: dict[str, Any], traceparent: str | None) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", **({"traceparent": traceparent} if traceparent else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = by_name(spans, name)
    assert len(found) == 1, (name, [(s.service, s.name) for s in spans])
    return found[0]


def server_span(spans: list[ReceivedSpan]) -> ReceivedSpan:
    found = [s for s in spans if s.kind == "SERVER"]
    assert len(found) == 1, [(s.service, s.name, s.kind) for s in spans]
    return found[0]


def has(*names: str) -> Any:
    return lambda trace: all(any(s.name == n for s in trace) for n in names)


def test_1p1d_chat_trace_continues_the_callers_span(log_dir: Path, receiver: OtlpReceiver,
                                                     reference: Reference) -> None:
    # n-gram speculation on the decode worker (a prefill worker ignores it): its span
    # reports the tokens each step emitted.
    c = traced_cluster(log_dir, receiver, {"prefill": 1, "decode": 1}, worker_extra=(
        "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})))
    try:
        trace_id, caller_span, tp = caller_context()
        body = {"model": reference.model_name, "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "user", "content": "Tell me about a tiny dragon."}]}
        resp = post(f"{c.url}/v1/chat/completions", body, tp)
        want = ("chat " + reference.model_name, "gateway.route", "prefill", "prefill.chunk", "kv_transfer",
                "decode", "decode.generate")
        receiver.wait_for(lambda _: has(*want)(receiver.trace(trace_id)), what=str(want))
        spans = receiver.trace(trace_id)
        assert {s.service for s in spans} >= {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}
        workers = {w["role"]: w["id"] for w in c.worker_list()}

        server = server_span(spans)
        assert server.parent_id == caller_span and server.service == "pdserve-gateway"
        usage = resp["usage"]
        a = server.attributes
        assert a["gen_ai.request.model"] == reference.model_name and a["gen_ai.request.max_tokens"] == 12
        assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] > 0
        assert a["gen_ai.response.finish_reasons"] == [resp["choices"][0]["finish_reason"]]
        assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        assert a["gen_ai.latency.time_in_queue"] >= 0 and a["http.response.status_code"] == 200

        route = one(spans, "gateway.route")
        assert route.parent_id == server.span_id
        assert route.attributes["pdserve.route.prefill_worker"] == workers["prefill"]
        assert route.attributes["pdserve.route.decode_worker"] == workers["decode"]
        assert route.attributes["pdserve.route.mode"] == "disaggregated"
        assert route.attributes["pdserve.route.expected_cached_tokens"] == 0  # a cold cache

        prefill, decode = one(spans, "prefill"), one(spans, "decode")
        assert prefill.parent_id == route.span_id and decode.parent_id == route.span_id
        assert prefill.service == "pdserve-prefill" and decode.service == "pdserve-decode"
        assert prefill.resource["service.instance.id"] == workers["prefill"]
        assert prefill.attributes["pdserve.prefix_cache.hit_tokens"] == 0
        chunks = by_name(spans, "prefill.chunk")
        assert all(ch.parent_id == prefill.span_id for ch in chunks)
        assert sum(ch.attributes["pdserve.chunk.tokens"] for ch in chunks) == usage["prompt_tokens"]
        kv = one(spans, "kv_transfer")
        assert kv.parent_id == prefill.span_id and kv.service == "pdserve-prefill"
        assert kv.attributes["pdserve.kv.transport"] in ("shm", "tcp")
        assert kv.attributes["pdserve.kv.bytes"] > 0 and kv.attributes["pdserve.kv.seconds"] >= 0
        assert kv.attributes["pdserve.kv.target_worker"] == workers["decode"]
        # The first token is the prefill worker's: decode produced the rest.
        d = decode.attributes
        assert d["gen_ai.usage.output_tokens"] == usage["completion_tokens"] - 1
        assert d["pdserve.spec.accepted_tokens"] == d["gen_ai.usage.output_tokens"] - d["pdserve.steps"] >= 0
        assert d["pdserve.spec.tokens_per_step"] == d["gen_ai.usage.output_tokens"] / d["pdserve.steps"]
        assert decode.events["first_token"]["pdserve.first_tokens"] == 1
        assert one(spans, "decode.generate").parent_id == decode.span_id
        assert all(server.start_ns <= s.start_ns and s.end_ns <= server.end_ns for s in spans if s is not server)

        # The same prompt again: both workers' prefix caches hold its full blocks now.
        again_id, _, again_tp = caller_context()
        again = post(f"{c.url}/v1/chat/completions", body, again_tp)
        receiver.wait_for(lambda _: has("prefill", "decode", "kv_transfer")(receiver.trace(again_id)), what="again")
        spans = receiver.trace(again_id)
        hit = one(spans, "prefill").attributes["pdserve.prefix_cache.hit_tokens"]
        assert hit == again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert sum(ch.attributes["pdserve.chunk.tokens"] for ch in by_name(spans, "prefill.chunk")) \
            == usage["prompt_tokens"] - hit
        held = one(spans, "decode").attributes["pdserve.prefix_cache.hit_blocks"]
        assert held > 0 and one(spans, "kv_transfer").attributes["pdserve.kv.skip_blocks"] == held
    finally:
        c.stop()


def test_colocated_trace_and_a_request_without_traceparent_starts_one(
        log_dir: Path, receiver: OtlpReceiver, reference: Reference) -> None:
    c = traced_cluster(log_dir, receiver, {"worker": 1})
    try:
        trace_id, caller_span, tp = caller_context()
        body = {"model": reference.model_name, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
        resp = post(f"{c.url}/v1/completions", body, tp)
        receiver.wait_for(lambda _: has("colocated", "gateway.route")(receiver.trace(trace_id)), what="colocated")
        spans = receiver.trace(trace_id)
        server = server_span(spans)
        assert server.parent_id == caller_span and server.name == f"text_completion {reference.model_name}"
        assert server.attributes["gen_ai.usage.output_tokens"] == resp["usage"]["completion_tokens"] == 6
        route = one(spans, "gateway.route")
        assert route.attributes["pdserve.route.mode"] == "colocated"
        worker = one(spans, "colocated")
        assert worker.service == "pdserve-colocated" and worker.parent_id == route.span_id
        assert worker.attributes["gen_ai.usage.output_tokens"] == 6
        chunks = by_name(spans, "colocated.chunk")
        assert sum(ch.attributes["pdserve.chunk.tokens"] for ch in chunks) == resp["usage"]["prompt_tokens"]
        assert {"colocated.queue", "colocated.generate"} <= {s.name for s in spans}

        post(f"{c.url}/v1/completions", {**body, "prompt": "No caller context"}, None)
        def new_root(spans: list[ReceivedSpan]) -> bool:
            return any(s.kind == "SERVER" and s.trace_id != trace_id and not s.parent_id for s in spans)
        root = next(s for s in receiver.wait_for(new_root, what="a root server span")
                    if s.kind == "SERVER" and s.trace_id != trace_id)
        receiver.wait_for(lambda _: has("colocated")(receiver.trace(root.trace_id)), what="its worker span")
    finally:
        c.stop()


def stream(url: str, body: dict[str, Any], traceparent: str, progress: list[int]) -> list[dict[str, Any]]:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "traceparent": traceparent})
    events = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {"):
                events.append(json.loads(line[6:]))
                progress[0] += 1
    return events


def test_a_decode_worker_killed_mid_stream_shows_as_a_second_attempt(
        log_dir: Path, receiver: OtlpReceiver, reference: Reference) -> None:
    # Slow steps (20 ms) keep the 160-token stream running for seconds: the kill lands mid-stream.
    c = traced_cluster(log_dir, receiver, {"prefill": 1, "decode": 2}, "--heartbeat-timeout", "1.5",
                       worker_extra=("--enable-fault-injection",), worker_env={"PDSERVE_FAULTS": "step_delay_s=0.02"})
    try:
        trace_id, caller_span, tp = caller_context()
        body = {"model": reference.model_name, "prompt": "A long story begins", "max_tokens": 160,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        progress = [0]
        with cf.ThreadPoolExecutor(1) as pool:
            future = pool.submit(stream, c.url, body, tp, progress)
            c._wait(lambda: progress[0] >= 5, "the stream under way")
            victim_info = next(w for w in c.worker_list() if w["role"] == "decode" and w["inflight_requests"])
            victim = next(p for p in c.workers if p.popen.pid == victim_info["pid"])
            victim.signal(signal.SIGKILL)
            killed_at = progress[0]
            events = future.result(timeout=120)
        assert killed_at < 160 and not any("error" in e for e in events)
        usage = next(e["usage"] for e in events if e.get("usage"))
        assert usage["completion_tokens"] == 160

        def two_attempts(_: list[ReceivedSpan]) -> bool:
            t = receiver.trace(trace_id)
            return len(by_name(t, "gateway.route")) == 2 and has("decode", "prefill")(t) and any(
                s.kind == "SERVER" for s in t)
        receiver.wait_for(two_attempts, what="two attempts")
        spans = receiver.trace(trace_id)
        server = server_span(spans)
        assert server.parent_id == caller_span
        assert server.attributes["gen_ai.usage.output_tokens"] == 160
        first, second = sorted(by_name(spans, "gateway.route"), key=lambda s: s.attributes["pdserve.attempt"])
        assert first.status == "ERROR" and "attempt_failed" in first.events
        assert victim_info["id"] in first.events["attempt_failed"]["reason"]
        assert first.attributes["pdserve.route.decode_worker"] == victim_info["id"]
        assert second.attributes["pdserve.recovery"] is True and second.attributes["pdserve.resumed_tokens"] > 0
        assert second.attributes["pdserve.route.decode_worker"] != victim_info["id"]
        # The killed worker's spans died with it; the survivor's decode resumes the stream.
        decode = one(spans, "decode")
        assert decode.parent_id == second.span_id and decode.resource["service.instance.id"] != victim_info["id"]
        resumed = decode.events["resume"]["pdserve.resumed_tokens"]
        assert resumed == second.attributes["pdserve.resumed_tokens"]
        assert decode.attributes["gen_ai.usage.output_tokens"] == 160 - resumed - 1
        prefills = by_name(spans, "prefill")
        assert len(prefills) == 2 and any("resume" in p.events for p in prefills)
    finally:
        c.stop()


def test_tracing_off_imports_no_opentelemetry() -> None:
    """Free when off: the gateway's request path and every node load without the SDK."""
    code = ("import sys; import gateway.openai_api, gateway.cluster, gateway.server, prefill_node.node, "
            "decode_node.node, pdserve.worker.colocated, pdserve.worker.main; "
            "from pdserve.common.tracing import make_tracer; assert make_tracer(None, 'gateway') is None; "
            "bad = [m for m in sys.modules if m.startswith('opentelemetry')]; assert not bad, bad")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
