"""The decode worker: reserves blocks, receives KV, decodes in continuous batches.

A request's life here:
1. `DecodeReserve`: the engine pins the prompt's leading blocks its prefix
   cache holds, holds the next ones its KV tiers have (read off the loop while the
   prefill worker computes the rest: pdserve/engine/tier_fill.py), reserves blocks
   for the rest (WAITING_FOR_KV), and the KV receiver expects the transfer into
   exactly those blocks; their ids and the number held go back to the gateway
   (`ReserveResult`: suffix-only handoff).
   Admission keeps room for the running streams' growth
   (`pdserve.engine.core.scheduler.ReserveCheck`), so a request never evicts one; a refusal
   reserves nothing and says why, and the gateway retries it. A request whose
   grammar is not compiled yet is held, with no block, and reserved once it is
   (a grammar that does not compile in time is refused, not retryable), so the
   compile never runs on the step loop.
2. `StartDecode` brings the first token(s) sampled by the prefill worker.
3. When the transfer is COMPLETE (every block verified), the tier blocks are in
   and the first tokens are known, the engine admits the sequence (`start_remote`,
   RUNNING); a tier block that could not be read fails the request, retryable.
   With draft_kv=prefill the draft pool's blocks are reserved too; admission never
   waits for their transfer: COMPLETE by then or within a few decode steps, they are
   the sequence's draft KV (pdserve/worker/draft_kv.py), else the draft is prefilled here and
   the transfer dropped.
4. Each engine step's new tokens go to the gateway as one `TokenBatch`.
5. Finish, `Abort` or a failed transfer frees the blocks; a failed transfer is
   reported as a retryable `RequestFailed`, so the gateway re-prefills.

Local prefill: a `RunRequest` (the gateway found the prompt's uncached part within
its `--local-prefill-threshold`, this worker's prefix cache counted) is prefilled
here, in chunks between decode steps, and decoded like any other: no transfer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from kv_transfer.api import KVReceiver, TransferState
from pdserve.common import protocol as p
from pdserve.common.logprobs import Logprob
from pdserve.common.logs import request_fields
from pdserve.common.roles import Role
from pdserve.engine.core.reservation import Reservation
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.runner.model_runner import ModelRunner
from pdserve.engine.tier_fill import FillState
from pdserve.worker.draft_kv import DraftReceipts
from pdserve.worker.engine_glue import wire_deltas
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.node_api import CoreDemand, NodeLoad, NodeRegistration, Sender
from pdserve.worker.node_base import EngineNode, node_registration
from pdserve.worker.tracing import Child, WorkerTraces
from pdserve.worker.transfers import FAILED_STATES, RESERVATION_LEASE_S, TRANSFER_LEASE_S, Transfers

log = logging.getLogger(__name__)


@dataclass
class _Incoming:
    transfer_id: str
    reserved_at: float
    num_blocks: int
    first_tokens: list[int] | None = None
    first_logprobs: list[Logprob | None] | None = None
    first_at: float = 0.0  # when StartDecode arrived: prefill done, transfer finishing
    complete_at: float = 0.0  # when the transfer was first seen COMPLETE


@dataclass
class _Stages:
    """Stage clocks of a running request, reported on its finishing delta."""

    kv_transfer_s: float  # StartDecode (transfer begun after the first token) to KV COMPLETE
    ready_at: float  # KV complete and first tokens known
    first_step_at: float = 0.0  # start of its first decode step

    def timings(self, now: float) -> dict[str, float]:
        first = self.first_step_at or now
        return {"kv_transfer": self.kv_transfer_s, "decode_queue": first - self.ready_at, "decode": now - first}


def first_logprobs(raw: list[Logprob | None] | None) -> list[Logprob | None] | None:
    """The first tokens' logprobs for the engine: None when none was requested."""
    return None if not raw or all(r is None for r in raw) else raw


class DecodeNode(EngineNode):
    role = Role.DECODE

    def __init__(self, worker_id: str, engine: LLMEngine, runner: ModelRunner, receiver: KVReceiver,
                 send: Sender, metrics: WorkerMetrics, kv_shm: str = "",
                 drafts: DraftReceipts | None = None, traces: WorkerTraces | None = None) -> None:
        super().__init__(worker_id, engine, runner, send, metrics, traces)
        self.drafts = drafts  # draft_kv=prefill: draft KV arrives with the target's
        self.receiver = receiver
        self.kv_shm = kv_shm
        self._incoming: dict[str, _Incoming] = {}
        self._running: set[str] = set()
        # Reservations whose grammar still compiles (message, first ask): no block yet.
        self._held: dict[str, tuple[p.DecodeReserve, float]] = {}
        # Stage timings of running requests, reported on their finishing deltas.
        self._timing: dict[str, _Stages] = {}
        # Cancelled transfers whose writer may still be active: blocks are freed once terminal.
        self.transfers = Transfers(receiver, engine, runner.layout, metrics)

    def registration(self) -> NodeRegistration:
        """With the receiver's address and the pool's shared-memory name, for prefill workers."""
        return node_registration(self.engine, self.runner.layout, self.receiver.address, self.kv_shm)

    # --- control messages --------------------------------------------------

    def handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.DecodeReserve):
            self._reserve(msg)
        elif isinstance(msg, p.RunRequest):
            self._run_local(msg)
        elif isinstance(msg, p.StartDecode):
            inc = self._incoming.get(msg.request_id)
            if inc is not None and inc.transfer_id == msg.transfer_id:
                inc.first_tokens, inc.first_logprobs = list(msg.token_ids), list(msg.logprobs)
                inc.first_at = time.monotonic()
                self.traces.event(msg.request_id, "first_token", {"pdserve.first_tokens": len(msg.token_ids)})
        elif isinstance(msg, p.Abort):
            for rid in msg.request_ids:
                self._abort(rid)

    def _reserve(self, msg: p.DecodeReserve) -> None:
        rid = msg.request_id
        if not self._grammar_ready(msg):
            return

        def enter(req: p.RequestPayload) -> Reservation:
            return self.engine.reserve_remote(rid, req.prompt_token_ids, req.params, req.output_token_ids,
                                              req.choice_index, reuse_prefix=True, lora=req.lora)

        admitted = self.admit(msg, enter)
        if admitted is None:
            return
        reservation = admitted.value
        if not reservation.ok:
            self.metrics.reservations_refused.inc()
            self.send(p.ReserveResult(rid, msg.transfer_id, [], refused=reservation.check.reason))
            return
        blocks = reservation.block_ids
        self.receiver.expect(msg.transfer_id, rid, list(blocks), TRANSFER_LEASE_S, RESERVATION_LEASE_S)
        draft = None if self.drafts is None else self.drafts.reserve(
            msg.transfer_id, rid, self.engine.seq_id(rid),
            [*msg.payload.prompt_token_ids, *msg.payload.output_token_ids], TRANSFER_LEASE_S)
        self._incoming[rid] = _Incoming(msg.transfer_id, time.monotonic(), len(blocks))
        self.traces.begin(rid, msg.payload, "decode")
        self.traces.set(rid, {"pdserve.kv.blocks": len(blocks), "pdserve.prefix_cache.hit_blocks":
                              reservation.cached_blocks})
        self.metrics.blocks_reused.inc(reservation.cached_blocks)
        self.accepted(rid, f"{len(blocks)} blocks reserved, {reservation.cached_blocks} held", prefill=False)
        self.send(p.ReserveResult(rid, msg.transfer_id, list(blocks), cached_blocks=reservation.cached_blocks,
                                  draft=draft))

    def _grammar_ready(self, msg: p.DecodeReserve) -> bool:
        """False while the request's grammar compiles: the reservation is held, with no
        block, and retried every step (`_retry_held`); a grammar that fails, or outlives
        --grammar-compile-timeout from the first ask, is refused here and now."""
        rid = msg.request_id
        _, since = self._held.pop(rid, (msg, time.monotonic()))
        try:
            if self.engine.grammar_ready(msg.payload.params, since):
                return True
        except ValueError as e:  # GrammarCompileError: its message names the parameter
            self.send(p.RequestFailed(rid, f"invalid request: {e}", retryable=False))
            return False
        self._held[rid] = (msg, since)
        return False

    def _retry_held(self) -> None:
        for msg, _ in list(self._held.values()):
            self._reserve(msg)

    def _run_local(self, msg: p.RunRequest) -> None:
        """Prefill the request here as well (no KV transfer): it runs from its first step."""
        rid = msg.request_id

        def enter(req: p.RequestPayload) -> None:
            self.engine.add_request(rid, req.prompt_token_ids, req.params, output_token_ids=req.output_token_ids,
                                    choice_index=req.choice_index, lora=req.lora)

        if self.admit(msg, enter) is None:
            return
        self._running.add(rid)
        self._timing[rid] = _Stages(0.0, time.monotonic())
        self.traces.begin(rid, msg.payload, "decode")
        self.traces.set(rid, {"pdserve.local_prefill": True})
        self.traces.mark(rid, "ready")
        self.metrics.local_prefills.inc()
        self.accepted(rid, f"{msg.payload.num_tokens} prompt tokens, prefilled locally", prefill=True)

    def _abort(self, rid: str) -> None:
        self._held.pop(rid, None)
        inc = self._incoming.pop(rid, None)
        if inc is not None or rid in self._running:
            log.debug("decode request %s aborted", rid, extra=request_fields(rid))
            self.traces.drop(rid, "aborted")
        if inc is not None:
            self.metrics.aborts.inc()
            self.transfers.cancel(inc.transfer_id, rid)
            self._end_draft(inc.transfer_id)
        elif rid in self._running:
            self.metrics.aborts.inc()
            self.engine.abort(rid)
            self._running.discard(rid)
            self._timing.pop(rid, None)
            if self.drafts is not None:
                self.drafts.ended(rid)

    # --- step ----------------------------------------------------------------

    def step(self) -> bool:
        self.transfers.reap()
        if self.drafts is not None:
            self.drafts.reap()
            self.drafts.poll()
        self._retry_held()
        admitted = self._admit_arrived()
        if not self._running:
            return admitted
        started = time.monotonic()
        for rid in self._running:
            stages = self._timing.get(rid)
            if stages is not None and not stages.first_step_at:
                stages.first_step_at = started
                self.traces.mark(rid, "first_step")
        batch = self.engine.schedule()  # queues the local runs whose grammar compiled meanwhile
        outputs = self.engine.execute(batch)
        for rid in self.refuse_failed():
            self._running.discard(rid)
            self._timing.pop(rid, None)
            self.traces.drop(rid, "grammar not compiled")
        if self.traces:
            self.traces.outputs(outputs)
        finished: dict[str, dict[str, float]] = {}
        for out in outputs:
            if out.finished and out.request_id in self._running:
                self._running.discard(out.request_id)
                finished[out.request_id] = self._finished(out.request_id)
                if self.drafts is not None:
                    self.drafts.ended(out.request_id)
        deltas = [replace(d, timings=finished[d.request_id]) if d.request_id in finished else d
                  for d in wire_deltas(outputs)]
        if deltas:
            self.send(p.TokenBatch(self.worker_id, deltas))
        return admitted or not batch.is_empty  # local runs whose grammar compiles: idle until it lands

    def _finished(self, rid: str) -> dict[str, float]:
        """The request's stage timings (kv_transfer, decode_queue, decode) for its finishing delta."""
        log.debug("decode request %s finished", rid, extra=request_fields(rid))
        stages = self._timing.pop(rid, None)
        self._end_trace(rid)
        return stages.timings(time.monotonic()) if stages is not None else {}

    def _end_trace(self, rid: str) -> None:
        if rid not in self.traces:
            return
        if self.engine.spec is not None:
            self.traces.set(rid, {"pdserve.spec.enabled": True})
        self.traces.end(rid, (Child("decode.kv_wait", "start", "kv_complete"),
                              Child("decode.queue", "ready", "first_step"),
                              Child("decode.generate", "first_step", "end")))

    def _admit_arrived(self) -> bool:
        admitted = False
        for rid, inc in list(self._incoming.items()):
            state = self.receiver.poll(inc.transfer_id)
            if state == TransferState.COMPLETE and not inc.complete_at:
                inc.complete_at = time.monotonic()
                self.traces.mark(rid, "kv_complete")
            if state in FAILED_STATES:
                self._transfer_failed(rid, inc, state)
            elif state == TransferState.COMPLETE and inc.first_tokens is not None:
                fill = self.engine.tier_fill(rid)  # the held blocks from the KV tiers
                if fill is FillState.PENDING:
                    continue
                if fill is FillState.FAILED:
                    self._tier_fill_failed(rid, inc)
                    continue
                del self._incoming[rid]
                self.receiver.forget(inc.transfer_id)
                # The receiver's own kind: a same-host sender uses it, a remote one tcp frames.
                self.transfers.completed(inc.reserved_at, self.receiver.address, inc.num_blocks)
                out = self.engine.start_remote(rid, inc.first_tokens, first_logprobs(inc.first_logprobs))
                self.traces.mark(rid, "ready")
                if self.drafts is not None:
                    self.drafts.admit(inc.transfer_id, running=not out.finished)
                if not out.finished:
                    self._running.add(rid)
                    # Non-overlapping with the prefill stages: the transfer counts from the
                    # first token (StartDecode); before that it is hidden behind prefill.
                    self._timing[rid] = _Stages(max(0.0, inc.complete_at - inc.first_at), max(inc.complete_at, inc.first_at))
                else:
                    log.debug("decode request %s finished", rid, extra=request_fields(rid))
                    self._end_trace(rid)
                admitted = True
        return admitted

    def _end_draft(self, transfer_id: str) -> None:
        if self.drafts is not None:
            self.drafts.end(transfer_id)

    def _tier_fill_failed(self, rid: str, inc: _Incoming) -> None:
        """A block the tiers had at reservation was gone or bad when read (counted as the
        tier's miss): the request is retried, and the retry finds it a miss."""
        del self._incoming[rid]
        self.traces.drop(rid, "kv tier load failed")
        self._end_draft(inc.transfer_id)
        self.receiver.forget(inc.transfer_id)
        self.engine.abort(rid)
        log.info("decode request %s: a KV tier block promised at reservation was not readable; retried",
                 rid, extra=request_fields(rid))
        self.send(p.RequestFailed(rid, "kv tier load failed", retryable=True, transfer_id=inc.transfer_id))

    def _transfer_failed(self, rid: str, inc: _Incoming, state: TransferState) -> None:
        del self._incoming[rid]
        self.traces.drop(rid, f"kv transfer {state.name.lower()}")
        self._end_draft(inc.transfer_id)
        self.receiver.forget(inc.transfer_id)
        self.engine.abort(rid)
        self.send(self.transfers.failed(rid, inc.transfer_id, state))

    def load(self) -> NodeLoad:
        s = self.engine.scheduler  # local prefills, queued or reading their prefix from the tiers
        queued = sum(seq.num_uncomputed_tokens for seq in s.waiting) + s.tier_reads.uncomputed_tokens
        if self.drafts is not None:
            self.drafts.publish()
        return self.stats.update(self.engine.stats(), queued, held=len(self._held))

    def busy(self) -> bool:
        return bool(self._incoming or self._running or self._held) or self.transfers.cancelling() or (
            self.drafts is not None and self.drafts.cancelling())

    def core_demand(self) -> CoreDemand:
        """Its cores while it decodes or a prefilled request's KV is arriving; a reservation
        whose prompt is still being prefilled leaves them to the prefill worker."""
        arriving = any(inc.first_at or inc.complete_at for inc in self._incoming.values())
        return CoreDemand(keep=bool(self._running) or arriving, borrow=bool(self._running))

    def close(self) -> None:
        self._held.clear()
        for rid in list(self._incoming) + list(self._running):
            self._abort(rid)
        self.receiver.close()
        if self.drafts is not None:
            self.drafts.close()
