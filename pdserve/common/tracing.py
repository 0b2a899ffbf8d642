"""OpenTelemetry traces for every pdserve process: off by default, free when off.

`TracingConfig.resolve(flag)` is None unless `--otlp-traces-endpoint` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) names a collector; then `Tracer(config, role,
instance)` loads the OpenTelemetry SDK and its OTLP exporter (`pip install
pdserve[otel]`), so a process that does not trace never imports them. Callers hold a
`Tracer | None` and test it once per request, never per token.

The trace context travels between processes as a W3C `traceparent` string: from the
client in the HTTP header, from the gateway to the workers inside the typed request
messages (`RequestPayload.traceparent`, pdserve/common/payload.py). Each process
exports its own spans with its own `service.name` (`<OTEL_SERVICE_NAME>-<role>`);
the gateway samples, the workers follow the sampled flag of the context they get.

Spans may be recorded after the fact (`Tracer.record` with start and end times in
nanoseconds since the epoch): a worker keeps a few timestamps per traced request and
emits its spans when the request leaves it, so its step loop does no span work.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.common import envs

PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
            "parentbased_always_off", "parentbased_traceidratio")
# version 00: 2 + 1 + 32 + 1 + 16 + 1 + 2 characters, lower-case hex, ids not all zero.
TRACEPARENT_RE = re.compile(r"^00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}$")
MAX_TRACEPARENT_LEN = 55

AttrValue = str | bool | int | float | Sequence[str] | Sequence[int] | Sequence[float]
Attributes = Mapping[str, AttrValue]


def valid_traceparent(value: str) -> bool:
    """A well-formed W3C traceparent of version 00."""
    return len(value) == MAX_TRACEPARENT_LEN and TRACEPARENT_RE.match(value) is not None


def now_ns() -> int:
    """The span clock: nanoseconds since the epoch."""
    return time.time_ns()


@dataclass(frozen=True)
class TracingConfig:
    """Where and how a process exports its spans."""

    endpoint: str
    protocol: str = "grpc"
    headers: tuple[tuple[str, str], ...] = ()
    service_name: str = "pdserve"
    sampler: str = "parentbased_always_on"
    sampler_arg: float = 1.0

    def __post_init__(self) -> None:
        if not self.endpoint:
            raise ValueError("the OTLP traces endpoint is empty")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be one of {', '.join(PROTOCOLS)}, "
                             f"not {self.protocol!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"OTEL_TRACES_SAMPLER must be one of {', '.join(SAMPLERS)}, not {self.sampler!r}")
        if not 0.0 <= self.sampler_arg <= 1.0:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a ratio in [0, 1], not {self.sampler_arg}")

    @classmethod
    def resolve(cls, endpoint: str | None) -> TracingConfig | None:
        """The flag's endpoint, else the environment's; None (tracing off) when neither
        is set. ValueError names a bad OTEL_* variable."""
        endpoint = (endpoint or "").strip() or envs.otlp_traces_endpoint()
        if not endpoint:
            return None
        sampler, arg = envs.otel_traces_sampler()
        try:
            ratio = float(arg) if arg is not None else 1.0
        except ValueError:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG must be a number, not {str(arg)[:20]!r}") from None
        return cls(endpoint, envs.otlp_traces_protocol(), envs.otlp_traces_headers(),
                   envs.otel_service_name(), sampler, ratio)

    @property
    def export_url(self) -> str:
        """The exporter's endpoint: an http/protobuf URL without a path gets `/v1/traces`."""
        if self.protocol == "http/protobuf" and self.endpoint.count("/") <= 2:
            return self.endpoint.rstrip("/") + "/v1/traces"
        return self.endpoint


class Span:
    """One live span. Attribute and event calls are cheap appends to the SDK's span."""

    def __init__(self, span: Any, propagator: Any) -> None:
        self._span = span
        self._propagator = propagator

    @property
    def recording(self) -> bool:
        """False when the sampler dropped it: then nothing about it is exported."""
        return bool(self._span.is_recording())

    @property
    def traceparent(self) -> str | None:
        """The W3C context naming this span as parent; None when it is not sampled."""
        if not self.recording:
            return None
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(self._span))
        return carrier.get("traceparent")

    def set(self, attributes: Attributes) -> None:
        self._span.set_attributes(dict(attributes))

    def event(self, name: str, attributes: Attributes | None = None, at_ns: int | None = None) -> None:
        self._span.add_event(name, dict(attributes or {}), at_ns)

    def error(self, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_status(Status(StatusCode.ERROR, description[:200]))

    def end(self, at_ns: int | None = None) -> None:
        self._span.end(at_ns)


@dataclass(frozen=True)
class SpanEvent:
    name: str
    at_ns: int
    attributes: Attributes | None = None


class Tracer:
    """The SDK's tracer provider for one process, exporting over OTLP in the background."""

    def __init__(self, config: TracingConfig, role: str, instance: str = "") -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            raise SystemExit("--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'pdserve[otel]'") \
                from None
        self.config = config
        self.service_name = f"{config.service_name}-{role}"
        attrs = {"service.name": self.service_name, "pdserve.role": role}
        if instance:
            attrs["service.instance.id"] = instance
        self._provider = TracerProvider(resource=Resource.create(attrs), sampler=_sampler(config))
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(config)))
        self._tracer = self._provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()

    def _context(self, parent: str | Mapping[str, str] | Span | None) -> Any:
        from opentelemetry.trace import set_span_in_context

        if parent is None:
            return None
        if isinstance(parent, Span):
            return set_span_in_context(parent._span)
        carrier = {"traceparent": parent} if isinstance(parent, str) else parent
        return self._propagator.extract(carrier)

    def start(self, name: str, parent: str | Mapping[str, str] | Span | None = None, *,
              server: bool = False, attributes: Attributes | None = None, at_ns: int | None = None) -> Span:
        """A live span, child of `parent` (a traceparent, HTTP headers holding one, or a
        span); a new trace when there is none. `server`: an HTTP SERVER span."""
        from opentelemetry.trace import SpanKind

        kind = SpanKind.SERVER if server else SpanKind.INTERNAL
        span = self._tracer.start_span(name, self._context(parent), kind, dict(attributes or {}), start_time=at_ns)
        return Span(span, self._propagator)

    def record(self, name: str, parent: str | Span | None, start_ns: int, end_ns: int,
               attributes: Attributes | None = None, events: Sequence[SpanEvent] = ()) -> Span:
        """A span that already happened, ended at `end_ns`; returned for its children's parent."""
        span = self.start(name, parent, attributes=attributes, at_ns=start_ns)
        for ev in events:
            span.event(ev.name, ev.attributes, ev.at_ns)
        span.end(end_ns)
        return span

    def flush(self, timeout_s: float = 5.0) -> bool:
        return bool(self._provider.force_flush(int(timeout_s * 1000)))

    def shutdown(self) -> None:
        """Export what is queued, then stop the exporter thread."""
        self._provider.shutdown()


def _sampler(config: TracingConfig) -> Any:
    from opentelemetry.sdk.trace import sampling

    name, ratio = config.sampler, config.sampler_arg
    root = {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF}.get(
        name.removeprefix("parentbased_"), sampling.TraceIdRatioBased(ratio))
    return sampling.ParentBased(root) if name.startswith("parentbased_") else root


def _exporter(config: TracingConfig) -> Any:
    headers = dict(config.headers) or None
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        insecure = config.endpoint.startswith("http://") or "://" not in config.endpoint
        return GrpcExporter(endpoint=config.endpoint, insecure=insecure, headers=headers)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=config.export_url, headers=headers)


def make_tracer(endpoint: str | None, role: str, instance: str = "") -> Tracer | None:
    """The process's tracer, or None when tracing is off (then nothing is imported)."""
    config = TracingConfig.resolve(endpoint)
    return Tracer(config, role, instance) if config is not None else None
