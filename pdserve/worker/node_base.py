"""What the prefill, decode and colocated nodes share: the engine side they hold,
taking in request messages (enter the engine, answer bad input, count and log),
and their registration with the gateway.

`EngineNode` holds state and helpers; a node extends it with its own request
tables and message handling (decode adds its KV receiver to the registration).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from pdserve.common import protocol as p
from pdserve.common.kv_layout import KVLayout
from pdserve.common.logs import request_fields
from pdserve.engine.core.block_events import BlockEventLog
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.runner.model_runner import ModelRunner
from pdserve.worker.engine_glue import StatsMirror
from pdserve.worker.kv_tiers import tier_infos
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.node_api import NodeRegistration, Sender
from pdserve.worker.tracing import WorkerTraces

log = logging.getLogger(__name__)

T = TypeVar("T")
# The messages that bring a new request to a node.
RequestMessage = p.PrefillRequest | p.DecodeReserve | p.RunRequest


@dataclass(frozen=True)
class Admitted(Generic[T]):
    """The engine took the request; `value` is what its entry point returned."""

    value: T


def node_registration(engine: LLMEngine, layout: KVLayout, kv_address: str = "",
                      kv_shm: str = "") -> NodeRegistration:
    """What a node tells the gateway: its pool, and where its KV receiver is (decode)."""
    total = engine.stats().num_total_blocks
    return NodeRegistration(kv_address, kv_shm, layout.compat_hash, total, layout.block_size,
                            layout.quantization, layout.dtype, layout.lm_head, tier_infos(engine))


class EngineNode:
    """The engine, its runner, the reply channel and the metrics of one node."""

    role = ""

    def __init__(self, worker_id: str, engine: LLMEngine, runner: ModelRunner, send: Sender,
                 metrics: WorkerMetrics, traces: WorkerTraces | None = None) -> None:
        self.worker_id = worker_id
        # Spans of traced requests (pdserve/worker/tracing.py); empty, hence false, when off.
        self.traces = traces if traces is not None else WorkerTraces(None, worker_id)
        self.engine = engine
        self.runner = runner
        self.send = send
        self.metrics = metrics
        self.stats = StatsMirror(metrics)
        self._events = engine.block_manager.record_events()  # both KV event feeds read it
        metrics.set_info(runner.layout.quantization, runner.layout.dtype, runner.layout.weight_dtype,
                         runner.layout.lm_head)

    def cached_keys(self) -> list[int]:
        return self.engine.block_manager.cached_keys()

    def block_event_log(self) -> BlockEventLog:
        return self._events

    def registration(self) -> NodeRegistration:
        """The node's pool; no KV receiver."""
        return node_registration(self.engine, self.runner.layout)

    def admit(self, msg: RequestMessage, enter: Callable[[p.RequestPayload], T]) -> Admitted[T] | None:
        """Hand the request to `enter` (an engine entry point, which validates it). Bad
        sampling params, a bad resume point or a request the engine can never fit
        (ValueError) are answered with a non-retryable `RequestFailed` and give None;
        the engine then holds nothing of the request."""
        try:
            return Admitted(enter(msg.payload))
        except ValueError as e:  # SamplingParamsError included: its message names the parameter
            self.send(p.RequestFailed(msg.request_id, f"invalid request: {e}", retryable=False))
            return None

    def refuse_failed(self) -> list[str]:
        """Answer the requests the engine gave up on before running them (a grammar that
        did not compile, or not within --grammar-compile-timeout) like bad input: a
        non-retryable `RequestFailed` each (a 400 at the gateway). They held no block.
        Returns their ids, for the node to forget."""
        failed = self.engine.take_failed()
        for f in failed:
            log.debug("%s request %s refused: %s", self.role, f.request_id, f.reason,
                      extra=request_fields(f.request_id))
            self.send(p.RequestFailed(f.request_id, f"invalid request: {f.reason}", retryable=False))
        return [f.request_id for f in failed]

    def accepted(self, request_id: str, detail: str, *, prefill: bool) -> None:
        """Count and log a request this node took on (`prefill`: it computes the prompt)."""
        log.debug("%s request %s accepted: %s", self.role, request_id, detail, extra=request_fields(request_id))
        self.metrics.requests.inc()
        if prefill:
            self.metrics.prefill_requests.inc()
