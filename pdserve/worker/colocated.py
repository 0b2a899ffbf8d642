"""The colocated worker: prefill and decode in one engine, chunked prefill mixed
into decode steps. The baseline disaggregation must beat.

A request's life here:
1. `RunRequest` arrives: the engine queues it (WAITING).
   A structured-output request whose grammar is not compiled yet waits for it
   off the scheduler (WAITING_FOR_GRAMMAR), holding nothing; a grammar that does
   not compile in time is refused (`RequestFailed`, not retryable).
2. Engine steps prefill it in chunks alongside running decodes (RUNNING).
3. Every step's new tokens go to the gateway as one `TokenBatch`.
4. It finishes (stop/length) or an `Abort` removes it; its blocks return.
"""

from __future__ import annotations

import logging

from pdserve.common import protocol as p
from pdserve.common.logs import request_fields
from pdserve.common.roles import Role
from pdserve.common.tracing import now_ns
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.runner.model_runner import ModelRunner
from pdserve.worker.engine_glue import wire_deltas
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.node_api import CoreDemand, NodeLoad, Sender
from pdserve.worker.node_base import EngineNode
from pdserve.worker.tracing import Child, WorkerTraces

log = logging.getLogger(__name__)


class ColocatedNode(EngineNode):
    role = Role.COLOCATED

    def __init__(self, worker_id: str, engine: LLMEngine, runner: ModelRunner, send: Sender,
                 metrics: WorkerMetrics, traces: WorkerTraces | None = None) -> None:
        super().__init__(worker_id, engine, runner, send, metrics, traces)
        self._live: set[str] = set()

    def handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.RunRequest):
            self._add(msg)
        elif isinstance(msg, p.Abort):
            for rid in msg.request_ids:
                if rid in self._live:
                    log.debug("colocated request %s aborted", rid, extra=request_fields(rid))
                    self.engine.abort(rid)
                    self._live.discard(rid)
                    self.metrics.aborts.inc()
                    self.traces.drop(rid, "aborted")

    def _add(self, msg: p.RunRequest) -> None:
        def enter(req: p.RequestPayload) -> None:
            self.engine.add_request(msg.request_id, req.prompt_token_ids, req.params,
                                    output_token_ids=req.output_token_ids, choice_index=req.choice_index,
                                    lora=req.lora)

        if self.admit(msg, enter) is None:
            return
        self._live.add(msg.request_id)
        self.traces.begin(msg.request_id, msg.payload, "colocated")
        self.accepted(msg.request_id, f"{msg.payload.num_tokens} prompt tokens", prefill=True)

    def step(self) -> bool:
        if not self.engine.has_unfinished():
            return False
        started = now_ns() if self.traces else 0
        batch = self.engine.schedule()  # queues the requests whose grammar compiled meanwhile
        outputs = self.engine.execute(batch)
        if self.traces:
            self.traces.step(batch, started, outputs)
        for rid in self.refuse_failed():
            self._live.discard(rid)
            self.traces.drop(rid, "grammar not compiled")
        for out in outputs:
            if out.finished and out.request_id in self._live:
                self._live.discard(out.request_id)
                self.traces.set(out.request_id, {"pdserve.prefix_cache.hit_tokens": out.num_cached_tokens})
                self.traces.end(out.request_id, (Child("colocated.queue", "start", "scheduled"),
                                                 Child("colocated.generate", "first_token", "end")))
                log.debug("colocated request %s finished", out.request_id, extra=request_fields(out.request_id))
        deltas = wire_deltas(outputs)
        if deltas:
            self.send(p.TokenBatch(self.worker_id, deltas))
        return not batch.is_empty  # only requests whose grammar compiles: idle until it lands

    def load(self) -> NodeLoad:
        s = self.engine.scheduler
        queued = sum(seq.num_uncomputed_tokens for seq in s.waiting) + s.tier_reads.uncomputed_tokens
        return self.stats.update(self.engine.stats(), queued)

    def busy(self) -> bool:
        return self.engine.has_unfinished()

    def core_demand(self) -> CoreDemand:
        return CoreDemand(keep=self.busy(), borrow=self.busy())

    def close(self) -> None:
        for rid in list(self._live):
            self.engine.abort(rid)
            self.traces.drop(rid, "worker closed")
        self._live.clear()
