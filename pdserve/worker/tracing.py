"""The spans of a worker's traced requests, recorded after the fact.

A request whose payload carries a `traceparent` (the gateway traced it and sampled
it) gets a `_Trace` here when it arrives: a handful of timestamps (`mark`), its
prefill chunks, its token and step counts, attributes and events. When the request
leaves the node (`end`), its spans are emitted at once with their real start and end
times, children of the gateway's attempt span:

- prefill: `prefill` with `prefill.queue`, one `prefill.chunk` per engine step that
  computed part of the prompt, and `kv_transfer` (transport, bytes, blocks);
- decode: `decode` with `decode.kv_wait`, `decode.queue` and `decode.generate`
  (tokens, steps, speculation's tokens per step), a `resume` event for a recovery;
- colocated: `colocated` with `colocated.queue`, its prefill chunks and `colocated.generate`.

Free when off: without a tracer, or for untraced requests, the table stays empty and
every hook the nodes call per step is guarded by `if traces:` (an empty table is
false). With traced requests the per-step work is one dict lookup per output.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.common.payload import RequestPayload
from pdserve.common.tracing import AttrValue, SpanEvent, Tracer, now_ns
from pdserve.engine.core.outputs import RequestOutput
from pdserve.engine.core.scheduler import SchedulerOutput


@dataclass
class _Trace:
    parent: str
    name: str
    marks: dict[str, int]
    attrs: dict[str, AttrValue]
    events: list[SpanEvent] = field(default_factory=list)
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # start, end (ns), tokens
    tokens: int = 0
    steps: int = 0


@dataclass(frozen=True)
class Child:
    """A child span between two marks of the request (skipped when either is missing)."""

    name: str
    start: str
    end: str
    attributes: dict[str, AttrValue] = field(default_factory=dict)


class WorkerTraces:
    """The traced requests of one node, by worker-side request id."""

    def __init__(self, tracer: Tracer | None, worker_id: str) -> None:
        self.tracer = tracer
        self.worker_id = worker_id
        self._live: dict[str, _Trace] = {}

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, rid: str) -> bool:
        return rid in self._live

    def begin(self, rid: str, payload: RequestPayload, name: str) -> None:
        """Start tracing `rid` if the gateway sent a context and this worker exports spans."""
        if self.tracer is None or payload.traceparent is None:
            return
        attrs: dict[str, AttrValue] = {"pdserve.worker": self.worker_id, "pdserve.request_id": rid,
                                       "gen_ai.usage.input_tokens": len(payload.prompt_token_ids),
                                       "gen_ai.request.max_tokens": payload.params.max_tokens}
        trace = _Trace(payload.traceparent, name, {"start": now_ns()}, attrs)
        if payload.resume is not None:
            resumed = len(payload.resume.output_token_ids)
            attrs["pdserve.resumed_tokens"] = resumed
            trace.events.append(SpanEvent("resume", trace.marks["start"],
                                          {"pdserve.resumed_tokens": resumed,
                                           "pdserve.choice_index": payload.resume.choice_index}))
        self._live[rid] = trace

    def mark(self, rid: str, name: str, *, first: bool = True) -> None:
        """Stamp `name` now (`first`: keep an earlier stamp)."""
        trace = self._live.get(rid)
        if trace is not None and not (first and name in trace.marks):
            trace.marks[name] = now_ns()

    def set(self, rid: str, attributes: dict[str, AttrValue]) -> None:
        trace = self._live.get(rid)
        if trace is not None:
            trace.attrs.update(attributes)

    def event(self, rid: str, name: str, attributes: dict[str, AttrValue] | None = None) -> None:
        trace = self._live.get(rid)
        if trace is not None:
            trace.events.append(SpanEvent(name, now_ns(), attributes))

    def step(self, batch: SchedulerOutput, started_ns: int, outputs: Iterable[RequestOutput]) -> None:
        """After an engine step: the prefill chunks it computed of traced requests still
        prefilling, and the tokens each traced request gained."""
        ended = now_ns()
        for chunk, seq in zip(batch.chunks, batch.seqs, strict=True):
            trace = self._live.get(seq.request_id)
            if trace is not None and "first_token" not in trace.marks:
                trace.chunks.append((started_ns, ended, len(chunk.token_ids)))
                trace.marks.setdefault("scheduled", started_ns)
        self.outputs(outputs, ended)

    def outputs(self, outputs: Iterable[RequestOutput], at_ns: int | None = None) -> None:
        for out in outputs:
            trace = self._live.get(out.request_id)
            if trace is None:
                continue
            gained = sum(len(c.token_ids) for c in out.outputs)
            if gained:
                trace.marks.setdefault("first_token", at_ns or now_ns())
                trace.tokens += gained
                trace.steps += 1

    def end(self, rid: str, children: Sequence[Child] = (), error: str | None = None) -> None:
        """Emit the request's spans (its own, its chunks, `children`) and forget it."""
        trace = self._live.pop(rid, None)
        if trace is None or self.tracer is None:
            return
        marks = trace.marks
        marks.setdefault("end", now_ns())
        if trace.tokens:
            trace.attrs["gen_ai.usage.output_tokens"] = trace.tokens
            trace.attrs["pdserve.steps"] = trace.steps
            if trace.attrs.get("pdserve.spec.enabled"):  # each step emits 1 + the drafts it accepted
                trace.attrs["pdserve.spec.accepted_tokens"] = trace.tokens - trace.steps
                trace.attrs["pdserve.spec.tokens_per_step"] = trace.tokens / trace.steps
        span = self.tracer.start(trace.name, trace.parent, attributes=trace.attrs, at_ns=marks["start"])
        for ev in trace.events:
            span.event(ev.name, ev.attributes, ev.at_ns)
        for i, (start, stop, tokens) in enumerate(trace.chunks):
            self.tracer.record(f"{trace.name}.chunk", span, start, stop,
                               {"pdserve.chunk.index": i, "pdserve.chunk.tokens": tokens})
        for child in children:
            if child.start in marks and child.end in marks:
                self.tracer.record(child.name, span, marks[child.start], max(marks[child.start], marks[child.end]),
                                   child.attributes)
        if error is not None:
            span.event("ended", {"reason": error[:200]})
        span.end(marks["end"])

    def drop(self, rid: str, reason: str) -> None:
        """An aborted or failed request: its spans so far, ended with `reason`."""
        if rid in self._live:
            self.end(rid, error=reason)

    def take(self, rid: str, prefix: str) -> dict[str, AttrValue]:
        """Remove and return the attributes of a live trace whose names start with `prefix`."""
        trace = self._live.get(rid)
        if trace is None:
            return {}
        taken = {k: v for k, v in trace.attrs.items() if k.startswith(prefix)}
        for k in taken:
            del trace.attrs[k]
        return taken

    def seconds(self, rid: str, start: str, end: str) -> float | None:
        """Between two marks of a live trace, in seconds; None when either is missing."""
        trace = self._live.get(rid)
        if trace is None or start not in trace.marks or end not in trace.marks:
            return None
        return (trace.marks[end] - trace.marks[start]) / 1e9
