"""The gateway's spans: one SERVER span per generation request, one span per attempt.

`RequestSpan.start` continues the caller's W3C `traceparent` (or starts a trace) and
names the span after the GenAI operation (`chat <model>`, `text_completion <model>`).
At the end it carries the OpenTelemetry GenAI attributes (`gen_ai.request.model`,
`gen_ai.request.max_tokens`, `gen_ai.usage.input_tokens`, `gen_ai.usage.output_tokens`,
`gen_ai.response.finish_reasons`), the time to first token and the admission queue
time (vLLM's `gen_ai.latency.*` names), and the HTTP status.

`AttemptSpan` covers one attempt of the cluster backend (gateway/cluster.py): the
routing decision (mode, chosen workers, the KV index's expected prefix hit) and, for
a recovery, the resumed tokens. Its traceparent is what the workers' spans hang from.

Only built when the gateway has a tracer (`--otlp-traces-endpoint`); otherwise the
request path holds None and does nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.common.tracing import Span, Tracer

OPERATIONS = {"chat": "chat", "completion": "text_completion"}


class RequestSpan:
    """The SERVER span of one HTTP generation request."""

    def __init__(self, span: Span) -> None:
        self.span = span

    @classmethod
    def start(cls, tracer: Tracer, headers: Mapping[str, str], kind: str, path: str,
              model: str, request_id: str) -> RequestSpan:
        op = OPERATIONS.get(kind, kind)
        carrier = {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}
        span = tracer.start(f"{op} {model}", carrier, server=True, attributes={
            "gen_ai.operation.name": op, "gen_ai.system": "pdserve", "gen_ai.request.model": model,
            "http.request.method": "POST", "http.route": path, "pdserve.request_id": request_id,
        })
        return cls(span)

    @property
    def traceparent(self) -> str | None:
        return self.span.traceparent

    def parsed(self, model: str, max_tokens: int | None, n: int, temperature: float | None,
               top_p: float | None, stream: bool, prompt_tokens: int) -> None:
        attrs: dict[str, Any] = {"gen_ai.request.model": model, "gen_ai.request.choice.count": n,
                                 "pdserve.stream": stream, "gen_ai.usage.input_tokens": prompt_tokens}
        if max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = max_tokens
        if temperature is not None:
            attrs["gen_ai.request.temperature"] = temperature
        if top_p is not None:
            attrs["gen_ai.request.top_p"] = top_p
        self.span.set(attrs)

    def end(self, status: int, error: str | None, output_tokens: int | None, cached_tokens: int,
            finish_reasons: Sequence[str | None], ttft_s: float | None, queue_s: float | None,
            e2e_s: float) -> None:
        attrs: dict[str, Any] = {"http.response.status_code": status, "gen_ai.latency.e2e": e2e_s}
        if output_tokens is not None:
            attrs["gen_ai.usage.output_tokens"] = output_tokens
            attrs["pdserve.usage.cached_tokens"] = cached_tokens
            attrs["gen_ai.response.finish_reasons"] = [r or "" for r in finish_reasons]
        if ttft_s is not None:
            attrs["gen_ai.latency.time_to_first_token"] = ttft_s
        if queue_s is not None:
            attrs["gen_ai.latency.time_in_queue"] = queue_s
        self.span.set(attrs)
        if error is not None:
            attrs_err = {"error.type": error}
            self.span.set(attrs_err)
            if status >= 500 or status == 499:
                self.span.error(error)
        self.span.end()


class AttemptSpan:
    """One attempt of a request across the workers: where it was routed, how it ended."""

    def __init__(self, tracer: Tracer, parent: str, attempt: int, resumed_tokens: int) -> None:
        attrs: dict[str, Any] = {"pdserve.attempt": attempt}
        if attempt > 1:
            attrs["pdserve.recovery"] = resumed_tokens > 0
            attrs["pdserve.resumed_tokens"] = resumed_tokens
        self.span = tracer.start("gateway.route", parent, attributes=attrs)

    @property
    def traceparent(self) -> str | None:
        return self.span.traceparent

    def routed(self, mode: str, worker_role: str, worker_id: str, expected_cached_tokens: int,
               reason: str) -> None:
        """A routing decision: `worker_role` (prefill, decode, colocated) goes to `worker_id`."""
        self.span.set({"pdserve.route.mode": mode, f"pdserve.route.{worker_role}_worker": worker_id})
        if worker_role != "decode" or mode == "local_prefill":
            self.span.set({"pdserve.route.expected_cached_tokens": expected_cached_tokens,
                           "pdserve.route.reason": reason})

    def end(self, failure: str | None, cached_tokens: int | None) -> None:
        if cached_tokens is not None:
            self.span.set({"pdserve.route.observed_cached_tokens": cached_tokens})
        if failure:
            self.span.event("attempt_failed", {"reason": failure[:200]})
            self.span.error(failure)
        self.span.end()
