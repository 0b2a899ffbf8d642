"""A real OTLP/HTTP traces endpoint for tests: `POST /v1/traces` bodies are decoded
with opentelemetry-proto's `ExportTraceServiceRequest` (gzip too), every span is kept
as a `ReceivedSpan`, and a test waits on a condition over them (`wait_for`)."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    name: str
    kind: str  # SERVER, INTERNAL, ...
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: dict[str, dict[str, Any]]  # name -> attributes (the last of a name)
    status: str  # UNSET, OK, ERROR
    resource: dict[str, Any]


def decode_export(body: bytes) -> list[ReceivedSpan]:
    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    spans = []
    for rs in req.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(ReceivedSpan(
                    str(resource.get("service.name", "")), s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                    s.name, PbSpan.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"), s.start_time_unix_nano,
                    s.end_time_unix_nano, {a.key: _value(a.value) for a in s.attributes},
                    {e.name: {a.key: _value(a.value) for a in e.attributes} for e in s.events},
                    s.status.StatusCode.Name(s.status.code).removeprefix("STATUS_CODE_"), resource,
                ))
    return spans


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.exports = 0
        self.headers: list[dict[str, str]] = []  # of each export request
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = decode_export(body)
                with receiver._cond:
                    receiver.spans.extend(spans)
                    receiver.exports += 1
                    receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                    receiver._cond.notify_all()
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._cond:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, cond: Callable[[list[ReceivedSpan]], bool], timeout: float = 60.0,
                 what: str = "spans") -> list[ReceivedSpan]:
        """Every span received so far, once `cond` holds over them; AssertionError at `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not cond(list(self.spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in self.spans})
                    raise AssertionError(f"timed out waiting for {what}; received {names}")
                self._cond.wait(left)
            return list(self.spans)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    r.start()
    try:
        yield r
    finally:
        r.close()
