"""Tracing configuration from the flag and the OTEL_* variables, and real exports over
both OTLP protocols: http/protobuf to tests/helpers/otlp_receiver.py, grpc to a grpc
server running opentelemetry-proto's TraceService."""

from __future__ import annotations

import threading
from concurrent import futures
from typing import Any

import pytest

from pdserve.common import envs
from pdserve.common.tracing import Tracer, TracingConfig, make_tracer, valid_traceparent
from tests.helpers.otlp_receiver import decode_export, otlp_receiver

OTEL_VARS = [n for n in envs.ENV_VARS if n.startswith("OTEL_")]
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


def test_off_unless_an_endpoint_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    assert TracingConfig.resolve(None) is None and make_tracer(None, "gateway") is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://env:4317")
    assert TracingConfig.resolve(None) == TracingConfig("http://env:4317")  # grpc, vLLM's default
    assert TracingConfig.resolve("http://flag:4317").endpoint == "http://flag:4317"  # type: ignore[union-attr]


def test_the_otel_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "HTTP/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "Api-Key=a%20b, x-tenant=7")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "shop")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    config = TracingConfig.resolve("http://collector:4318")
    assert config == TracingConfig("http://collector:4318", "http/protobuf", (("api-key", "a b"), ("x-tenant", "7")),
                                   "shop", "parentbased_traceidratio", 0.25)
    assert config.export_url == "http://collector:4318/v1/traces"  # a bare http endpoint gets the path
    assert TracingConfig("http://c:1/custom", "http/protobuf").export_url == "http://c:1/custom"


@pytest.mark.parametrize(("name", "value", "message"), [
    ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
    ("OTEL_TRACES_SAMPLER", "sometimes", "OTEL_TRACES_SAMPLER"),
    ("OTEL_TRACES_SAMPLER_ARG", "half", "OTEL_TRACES_SAMPLER_ARG"),
    ("OTEL_TRACES_SAMPLER_ARG", "1.5", "OTEL_TRACES_SAMPLER_ARG"),
    ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "novalue", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"),
])
def test_a_bad_variable_is_named(monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        TracingConfig.resolve("http://c:4317")


def test_traceparent_shape() -> None:
    assert valid_traceparent(TP)
    assert not valid_traceparent(TP.replace("-01", "-1")) and not valid_traceparent(TP + " ")


def test_http_export_with_headers_service_name_and_parent() -> None:
    with otlp_receiver() as r:
        config = TracingConfig(r.endpoint, "http/protobuf", (("authorization", "Bearer t"),), "shop")
        tracer = Tracer(config, "decode", "d-1")
        parent = tracer.start("parent", TP)
        assert parent.traceparent is not None and parent.traceparent.startswith(f"00-{TP[3:35]}-")
        tracer.record("done", parent, 1_000, 2_000, {"k": 3})
        parent.end()
        assert tracer.flush()
        spans = r.wait_for(lambda s: len(s) == 2)
        tracer.shutdown()
    done = next(s for s in spans if s.name == "done")
    top = next(s for s in spans if s.name == "parent")
    assert (done.service, done.resource["service.instance.id"]) == ("shop-decode", "d-1")
    assert done.parent_id == top.span_id and top.parent_id == TP[36:52] and top.trace_id == TP[3:35]
    assert (done.start_ns, done.end_ns, done.attributes) == (1_000, 2_000, {"k": 3})
    assert all(h["authorization"] == "Bearer t" for h in r.headers)


def test_sampling_off_exports_nothing_and_sends_no_context() -> None:
    with otlp_receiver() as r:
        for config in (TracingConfig(r.endpoint, "http/protobuf", sampler="always_off"),
                       TracingConfig(r.endpoint, "http/protobuf", sampler="traceidratio", sampler_arg=0.0)):
            tracer = Tracer(config, "gateway")
            span = tracer.start("dropped")
            assert not span.recording and span.traceparent is None
            span.end()
            assert tracer.flush()
            tracer.shutdown()
        # A worker follows the gateway's decision carried in the context's flags.
        follower = Tracer(TracingConfig(r.endpoint, "http/protobuf"), "prefill")
        for name, context, sampled in (("unsampled parent", TP[:-2] + "00", False), ("sampled parent", TP, True)):
            span = follower.start(name, context)
            assert span.recording is sampled
            span.end()
        follower.shutdown()
        r.wait_for(lambda s: len(s) == 1)
        assert [s.name for s in r.spans] == ["sampled parent"]


def test_grpc_export() -> None:
    import grpc  # the grpc exporter's own dependency (the otel and test extras)
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    got: list[Any] = []
    arrived = threading.Event()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (the proto's name)
            got.extend(decode_export(request.SerializeToString()))
            arrived.set()
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        tracer = Tracer(TracingConfig(f"http://127.0.0.1:{port}", "grpc"), "gateway")
        tracer.start("over grpc", server=True).end()
        assert tracer.flush()
        assert arrived.wait(30)
        tracer.shutdown()
    finally:
        server.stop(0)
    assert [(s.name, s.kind, s.service) for s in got] == [("over grpc", "SERVER", "pdserve-gateway")]
