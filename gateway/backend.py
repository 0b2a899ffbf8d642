"""What the gateway's HTTP layer needs from the cluster: the `GenerationBackend` contract.

The HTTP layer (validation, tokenization, admission, SSE, metrics) is written
against this small interface only; the cluster implementation (worker registry,
routing, ZeroMQ to prefill/decode workers, recovery) implements it, and so does
the in-process test backend in `tests/gateway/local_backend.py`.

Contract
--------
1. `await backend.start()` runs once when the app starts (bind sockets, start
   heartbeat tasks); `await backend.close()` once when it stops, after the
   drain. Both must be idempotent.
2. `backend.generate(req)` returns an async iterator of `TokenDelta` for the
   tokenized, validated and admitted request `req`. Nothing runs before the
   first `__anext__`. Events of the `params.n` choices may interleave; each
   choice ends with exactly one event whose `finish_reason` is set
   (`"stop"` for EOS / a stop token id, `"length"` for `max_tokens`), and the
   iterator ends after the last choice has finished.
3. Closing the iterator (`aclose()`), or cancelling the task iterating it,
   aborts the request everywhere it lives and frees its KV blocks. The HTTP
   layer closes it on client disconnect, on a stop string that finished every
   choice, on a deadline and on shutdown.
4. Failures are raised from `__anext__` as `BackendError`. Before the first
   event the HTTP layer maps the kind to a status (`NO_WORKERS` /
   `OVERLOADED` → 503 with `Retry-After`, `TIMEOUT` → 504, `INVALID` → 400,
   `FAILED` → 500); after streaming started it becomes a final SSE error event.
5. `TokenDelta.timings` carries worker-measured stage durations in seconds
   (keys from `BACKEND_STAGES`, or others); the gateway keeps the latest value
   it saw for each key, so a backend may report a stage once, on any event.
6. `ready()`, `workers()` and `fleet_metrics()` are cheap, synchronous and
   never block: they read the registry's current state. `fleet_metrics()` is
   called on every `/metrics` scrape and re-exported as gauges.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pdserve.common.logprobs import Logprob, TopLogprob
from pdserve.common.lora import LoraRef
from pdserve.common.protocol import TokenDelta
from pdserve.common.sampling_params import SamplingParams

__all__ = ["Logprob", "TokenDelta", "TopLogprob"]  # the HTTP layer's event types, shared with the wire

PRIORITIES = ("interactive", "batch")

# Stage names the workers are expected to report in `TokenDelta.timings`.
BACKEND_STAGES = ("prefill_queue", "prefill_compute", "kv_transfer", "decode_queue", "decode")


@dataclass(frozen=True)
class GenerateRequest:
    """One tokenized, validated, admitted request handed to the cluster."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: str = "interactive"  # one of PRIORITIES
    deadline: float | None = None  # time.monotonic() deadline; None = no deadline
    lora: LoraRef | None = None  # the LoRA adapter it runs under; None: the base model
    traceparent: str | None = None  # the request's gateway span (W3C); None: not traced


class BackendErrorKind(enum.Enum):
    NO_WORKERS = "no_workers"  # a needed pool is empty
    OVERLOADED = "overloaded"  # the cluster sheds load (e.g. KV high watermark)
    TIMEOUT = "timeout"  # the request's deadline passed inside the cluster
    INVALID = "invalid"  # the cluster rejected the request's contents
    FAILED = "failed"  # anything else: recovery exhausted, internal error


class BackendError(Exception):
    """A failure of the cluster, mapped by the HTTP layer to a status or an error event."""

    def __init__(
        self, kind: BackendErrorKind, message: str, *, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after = retry_after


@dataclass(frozen=True)
class ReadyState:
    """Whether the cluster can serve: at least one prefill and one decode worker (or colocated)."""

    ready: bool
    reason: str = ""  # why not ready, for the /ready body
    detail: Mapping[str, Any] = field(default_factory=dict)  # e.g. worker counts per role


@dataclass(frozen=True)
class FleetSample:
    """One gauge sample re-exported on the gateway's /metrics, e.g.
    FleetSample("llm_kv_cache_usage_ratio", "KV usage", {"role": "decode", "worker": "d0"}, 0.3).
    Samples with the same name must share the same label names and documentation."""

    name: str
    documentation: str
    labels: Mapping[str, str]
    value: float


@runtime_checkable
class GenerationBackend(Protocol):
    """The cluster as seen by the HTTP layer. See the module docstring for the contract."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]: ...

    def ready(self) -> ReadyState: ...

    def workers(self) -> Sequence[Mapping[str, Any]]:
        """JSON-serializable worker descriptions for GET /v1/workers."""
        ...

    def fleet_metrics(self) -> Sequence[FleetSample]: ...
