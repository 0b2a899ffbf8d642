"""The prefill worker: chunked prefill, first-token sampling, pushing KV.

A request's life here:
1. `PrefillRequest` arrives (while the decode worker reserves blocks); the
   engine queues it prefill-only (WAITING), or, while its grammar compiles,
   holds it off the scheduler with no block (WAITING_FOR_GRAMMAR; a grammar that
   does not compile in time is refused, not retryable).
2. Engine steps prefill it in chunks (prefix cache included) and sample the
   first token of every choice; the request then holds its blocks
   (FINISHED_PREFILLED).
3. The first tokens go straight to the gateway (`FirstToken`: TTFT). The KV
   transfer starts once both the KV and the `TransferTarget` (the blocks the
   decode worker reserved) are there: same-host shared memory or tcp, chosen
   from the peer's address; only blocks from `skip_blocks` on (those the decode
   worker does not hold already). KV is never written before the reservation. When
   the target is known before the step that completes the prompt, the push is
   layer-wise: layer i of all the request's blocks ships while layer i+1
   computes (chunked prompts included: earlier chunks' layers are final).
   With draft_kv=prefill the draft model then prefills the same tokens and its KV
   ships too, as a second transfer (pdserve/worker/draft_kv.py).
4. Only when the transfer is COMPLETE (decode verified every block), and a draft
   transfer under way terminal, are the blocks released (a draft not shipped by then
   never ships: decode does not wait for it). A failed transfer releases them too and reports a
   retryable `RequestFailed`. `Abort` drops the request at any stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_transfer.api import KVSender, TransferState
from pdserve.common import protocol as p
from pdserve.common.block_hash import prefix_root
from pdserve.common.logs import request_fields
from pdserve.common.roles import Role
from pdserve.common.tracing import now_ns
from pdserve.common.transport import host_id, transport_kind
from pdserve.engine.core.outputs import RequestOutput
from pdserve.engine.core.scheduler import SchedulerOutput
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.runner.model_runner import ModelRunner
from pdserve.worker.draft_kv import DraftShipper, Shipped
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.node_api import CoreDemand, NodeLoad, Sender
from pdserve.worker.node_base import EngineNode
from pdserve.worker.tracing import Child, WorkerTraces
from pdserve.worker.transfers import FAILED_STATES, TRANSFER_LEASE_S, Transfers

log = logging.getLogger(__name__)

# A prefilled request whose destination never arrives (the gateway lost it) gives its blocks back.
TARGET_WAIT_S = 30.0


@dataclass
class _Job:
    msg: p.PrefillRequest
    arrived_at: float
    target: p.TransferTarget | None = None
    prefilled: bool = False
    prefilled_at: float = 0.0
    scheduled_at: float = 0.0  # start of the first engine step that computed part of it
    transfer_started_at: float = 0.0
    draft_sent: bool = False  # draft_kv=prefill: shipped, or refused for good
    cached_tokens: int = 0  # what the prefix cache held of it on arrival: not queued work


def peer_address(msg: p.TransferTarget, direct: bool = True) -> str:
    """Direct copies (shared memory, CUDA IPC) only when both sides asked for them (the
    decode worker advertises `shm+`/`cuda+`, this worker's `--kv-transport` is not tcp)
    and they share a host; plain frames otherwise (a device pool's through host staging)."""
    peer = msg.target_kv_address
    if not direct or msg.target_host_id != host_id():
        for prefix in ("shm+", "cuda+"):
            peer = peer.removeprefix(prefix)
    return peer


def layer_ready(device: torch.device) -> torch.cuda.Event | None:
    """An event on the compute stream after the KV written so far (None on CPU, where
    compute is done when the step returns): the sender's copy stream waits on it on the
    device, so layer i is copied while layer i + 1 computes, and the host never blocks."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class PrefillNode(EngineNode):
    role = Role.PREFILL

    def __init__(self, worker_id: str, engine: LLMEngine, runner: ModelRunner, sender: KVSender,
                 send: Sender, metrics: WorkerMetrics, layerwise: bool = True,
                 direct: bool = True, drafts: DraftShipper | None = None,
                 traces: WorkerTraces | None = None) -> None:
        super().__init__(worker_id, engine, runner, send, metrics, traces)
        self.drafts = drafts  # draft_kv=prefill: the draft's KV ships with the target's
        self.direct = direct  # --kv-transport allows shm / CUDA IPC with same-host peers
        # Push each layer's KV while the next layer computes (when the target is known in time).
        self.layerwise = layerwise
        self.sender = sender
        self._jobs: dict[str, _Job] = {}
        # Cancelled transfers may still read their source blocks: released once terminal.
        self.transfers = Transfers(sender, engine, runner.layout, metrics)

    def handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.PrefillRequest):
            self._add(msg)
        elif isinstance(msg, p.TransferTarget):
            job = self._jobs.get(msg.request_id)
            if job is not None and job.target is None:
                bad = self._bad_target(job, msg)
                if bad:
                    self._abort(msg.request_id)
                    self.send(p.RequestFailed(msg.request_id, f"invalid transfer target: {bad}", retryable=False))
                    return
                job.target = msg
                if job.prefilled:
                    self._start_transfer(job)
                    self._ship_draft(job)
        elif isinstance(msg, p.Abort):
            for rid in msg.request_ids:
                self._abort(rid)

    def _bad_target(self, job: _Job, msg: p.TransferTarget) -> str:
        """Why `msg` cannot receive this prompt's blocks ("" when it can): the held
        blocks and the destination blocks must cover the prompt's blocks exactly."""
        need = -(-job.msg.payload.num_tokens // self.runner.layout.block_size)
        if msg.skip_blocks < 0 or msg.skip_blocks + len(msg.dst_block_ids) != need:
            return f"{msg.skip_blocks} held + {len(msg.dst_block_ids)} destination blocks for a {need}-block prompt"
        return ""

    def _add(self, msg: p.PrefillRequest) -> None:
        def enter(req: p.RequestPayload) -> None:
            self.engine.add_request(msg.request_id, req.prompt_token_ids, req.params, prefill_only=True,
                                    output_token_ids=req.output_token_ids, choice_index=req.choice_index,
                                    lora=req.lora)

        if self.admit(msg, enter) is None:
            return
        root = prefix_root(msg.payload.lora.fingerprint if msg.payload.lora else "")
        cached = self.engine.block_manager.match_prefix([*msg.payload.prompt_token_ids,
                                                         *msg.payload.output_token_ids], root).num_tokens
        self._jobs[msg.request_id] = _Job(msg, time.monotonic(), cached_tokens=cached)
        self.traces.begin(msg.request_id, msg.payload, "prefill")
        self.accepted(msg.request_id, f"{msg.payload.num_tokens} prompt tokens", prefill=True)

    def _abort(self, rid: str) -> None:
        job = self._jobs.pop(rid, None)
        if job is None:
            return
        log.debug("prefill request %s aborted", rid, extra=request_fields(rid))
        self.metrics.aborts.inc()
        self.traces.drop(rid, "aborted")
        if job.transfer_started_at and job.target is not None:
            self.transfers.cancel(job.target.transfer_id, rid)
            self._end_draft(job)
        else:
            self.engine.abort(rid)  # frees queued, prefilling or held blocks alike

    # --- step ----------------------------------------------------------------

    def step(self) -> bool:
        self.transfers.reap()
        if self.drafts is not None:
            self.drafts.reap()
        worked = self._poll_transfers()
        if self.engine.has_unfinished():
            started, started_ns = time.monotonic(), now_ns() if self.traces else 0
            batch = self.engine.schedule()
            outputs = self.engine.execute(batch, self._layer_sends(batch))
            self._mark_scheduled(started, {seq.request_id for seq in batch.seqs})
            if self.traces:
                self.traces.step(batch, started_ns, outputs)
            for out in outputs:
                if out.finished and out.request_id in self._jobs:
                    self._prefilled(self._jobs[out.request_id], out)
            for rid in self.refuse_failed():
                self._jobs.pop(rid, None)
                self.traces.drop(rid, "grammar not compiled")
            worked = worked or not batch.is_empty  # a grammar compiling: idle until it lands
        return worked

    def _mark_scheduled(self, step_started: float, scheduled: set[str]) -> None:
        """Stamp the jobs this step computed a chunk of, the first time (`prefill_queue`)."""
        for rid in scheduled:
            job = self._jobs.get(rid)
            if job is not None and not job.scheduled_at:
                job.scheduled_at = step_started

    def _prefilled(self, job: _Job, out: RequestOutput) -> None:
        job.prefilled = out.prefilled
        job.prefilled_at = time.monotonic()
        if job.msg.request_id in self.traces:
            self.traces.set(job.msg.request_id, {
                "pdserve.prefix_cache.hit_tokens": out.num_cached_tokens,
                "gen_ai.latency.time_in_queue": (job.scheduled_at or job.arrived_at) - job.arrived_at,
                "pdserve.prefill.compute_s": job.prefilled_at - (job.scheduled_at or job.arrived_at)})
        choices = sorted(out.outputs, key=lambda c: c.index)
        self.send(p.FirstToken(
            job.msg.request_id, job.target.transfer_id if job.target else "",
            [c.token_ids[0] for c in choices],
            [c.finish_reason for c in choices],
            [c.logprobs[0] if c.logprobs else None for c in choices],
            out.num_cached_tokens,
            self._timings(job),
            list(out.prompt_logprobs) if out.prompt_logprobs is not None else None,
        ))
        if not out.prefilled or all(c.finish_reason is not None for c in choices):
            self._finish_without_decode(job)
        elif job.target is not None:
            if not job.transfer_started_at:
                self._start_transfer(job)
            self._ship_draft(job)

    def _ship_draft(self, job: _Job) -> None:
        """draft_kv=prefill: right after the target prefill, run the draft over the same
        tokens and push its KV (the target's transfer is already on its way)."""
        target = job.target
        if self.drafts is None or target is None or target.draft is None or job.draft_sent:
            return
        payload = job.msg.payload
        shipped = self.drafts.ship(target.transfer_id, job.msg.request_id,
                                   [*payload.prompt_token_ids, *payload.output_token_ids], target.draft,
                                   TRANSFER_LEASE_S, layer_ready(self.runner.device))
        job.draft_sent = shipped is not Shipped.NO_ROOM  # no room: again next step
        if shipped is Shipped.REFUSED:
            log.warning("draft KV of %s not shipped: %d destination blocks", job.msg.request_id,
                        len(target.draft.block_ids), extra=request_fields(job.msg.request_id))

    def _draft_pending(self, job: _Job) -> bool:
        """The target's transfer is COMPLETE: is the job's draft KV on its way (its source
        blocks still read)? One not shipped yet (no room) never ships: the decode worker
        admits on the target's KV alone and prefills the draft itself."""
        if self.drafts is None or job.target is None or job.target.draft is None:
            return False
        if not job.draft_sent:
            job.draft_sent = True
            log.debug("draft KV of %s not shipped: the target's KV is in first", job.msg.request_id,
                      extra=request_fields(job.msg.request_id))
            return False
        return not self.drafts.settled(job.target.transfer_id)

    def _end_draft(self, job: _Job) -> None:
        if self.drafts is not None and job.target is not None:
            self.drafts.end(job.target.transfer_id)

    @staticmethod
    def _timings(job: _Job) -> dict[str, float]:
        """`prefill_queue`: arrival to first scheduled; `prefill_compute`: to the first token."""
        scheduled = job.scheduled_at or job.arrived_at
        return {"prefill_queue": scheduled - job.arrived_at, "prefill_compute": job.prefilled_at - scheduled}

    def _layer_sends(self, batch: SchedulerOutput) -> Callable[[int], None] | None:
        """Layer-wise push: begin the transfers of requests `batch` finishes prefilling
        whose target is already known, and return the runner's hook that ships layer i
        (of all their blocks, earlier chunks included) once it is in the pool. A target
        that arrives after the prefill gets the whole request at once (`send_all`)."""
        if not self.layerwise:
            return None
        tids = []
        for done in self.engine.completing_prefills(batch):
            job = self._jobs.get(done.request_id)
            if job is not None and job.target is not None and not job.transfer_started_at:
                self._begin_transfer(job, done.block_ids)
                tids.append(job.target.transfer_id)
        if not tids:
            return None
        def send_layer(layer: int) -> None:
            ready = layer_ready(self.runner.device)
            for tid in tids:
                self.sender.send_layer(tid, layer, ready)

        return send_layer

    def _start_transfer(self, job: _Job) -> None:
        """Whole-request push: the prefill is done and the target is known."""
        self._begin_transfer(job, self.engine.held_blocks(job.msg.request_id))
        assert job.target is not None
        self.sender.send_all(job.target.transfer_id, layer_ready(self.runner.device))

    def _begin_transfer(self, job: _Job, src_blocks: list[int]) -> None:
        target = job.target
        assert target is not None
        skip = target.skip_blocks  # decode holds the prompt's first blocks: only the rest travel
        src = list(src_blocks)[skip : skip + len(target.dst_block_ids)]
        peer = peer_address(target, self.direct)
        self.sender.begin(target.transfer_id, job.msg.request_id, peer, src,
                          list(target.dst_block_ids), TRANSFER_LEASE_S)
        job.transfer_started_at = time.monotonic()
        if job.msg.request_id in self.traces:
            self.traces.mark(job.msg.request_id, "transfer_start")
            self.traces.set(job.msg.request_id, {"pdserve.kv.transport": transport_kind(peer),
                                                 "pdserve.kv.blocks": len(src), "pdserve.kv.skip_blocks": skip,
                                                 "pdserve.kv.bytes": len(src) * self.transfers.block_bytes,
                                                 "pdserve.kv.target_worker": target.target_worker})

    def _finish_without_decode(self, job: _Job) -> None:
        """Every choice ended at its first token: no decode needs the KV. A layer-wise
        push already under way is cancelled (the gateway aborts the decode side, which
        never admits it) and its request dropped once the transfer is terminal."""
        if not job.transfer_started_at:
            self._finish(job)
            return
        assert job.target is not None
        self._jobs.pop(job.msg.request_id, None)
        self.traces.drop(job.msg.request_id, "finished at first token")
        self.transfers.cancel(job.target.transfer_id, job.msg.request_id)

    def _poll_transfers(self) -> bool:
        changed = False
        now = time.monotonic()
        for job in list(self._jobs.values()):
            if job.prefilled and job.target is None and now - job.prefilled_at > TARGET_WAIT_S:
                log.warning("no transfer target for %s after %.0fs; releasing", job.msg.request_id, TARGET_WAIT_S)
                self._finish(job)
                self.send(p.RequestFailed(job.msg.request_id, "no transfer target", retryable=True))
                continue
            if not job.transfer_started_at:
                continue
            assert job.target is not None
            tid = job.target.transfer_id
            state = self.sender.poll(tid)
            if state == TransferState.COMPLETE and self._draft_pending(job):
                continue
            if state == TransferState.COMPLETE:
                self.traces.mark(job.msg.request_id, "transfer_done")
                self.transfers.completed(job.transfer_started_at, peer_address(job.target, self.direct),
                                         len(job.target.dst_block_ids))
                self._finish(job)
                changed = True
            elif state in FAILED_STATES:
                self.traces.set(job.msg.request_id, {"pdserve.kv.state": state.name.lower()})
                self._finish(job)
                self.send(self.transfers.failed(job.msg.request_id, tid, state))
                changed = True
        return changed

    def _finish(self, job: _Job) -> None:
        """Blocks are released only here: after COMPLETE, failure, or no transfer needed."""
        self._jobs.pop(job.msg.request_id, None)
        self._end_trace(job.msg.request_id)
        log.debug("prefill request %s finished", job.msg.request_id, extra=request_fields(job.msg.request_id))
        if job.transfer_started_at and job.target is not None:
            self.sender.forget(job.target.transfer_id)
        self._end_draft(job)
        if job.prefilled:
            self.engine.release(job.msg.request_id)

    def _end_trace(self, rid: str) -> None:
        if rid not in self.traces:
            return
        kv = self.traces.take(rid, "pdserve.kv.")  # the transfer's attributes go on its own span
        kv_s = self.traces.seconds(rid, "transfer_start", "transfer_done")
        if kv_s is not None:
            kv["pdserve.kv.seconds"] = kv_s
        self.traces.end(rid, (Child("prefill.queue", "start", "scheduled"),
                              Child("kv_transfer", "transfer_start", "transfer_done", kv)))

    def load(self) -> NodeLoad:
        # Work, not prompt length: the gateway weighs it against a prefix hit (gateway/kv_router.py).
        queued = sum(j.msg.payload.num_tokens - j.cached_tokens for j in list(self._jobs.values()) if not j.prefilled)
        if self.drafts is not None:
            self.drafts.publish()
        return self.stats.update(self.engine.stats(), queued)

    def busy(self) -> bool:
        return bool(self._jobs) or self.transfers.cancelling() or (
            self.drafts is not None and self.drafts.cancelling())

    def core_demand(self) -> CoreDemand:
        """Its cores while it holds a job (a prefilled one's KV is still being sent); the
        decode worker's too only while none of its prompts is done: a finished one's
        decode starts there meanwhile."""
        jobs = list(self._jobs.values())
        return CoreDemand(keep=bool(jobs), borrow=bool(jobs) and not any(j.prefilled for j in jobs))

    def close(self) -> None:
        for rid in list(self._jobs):
            self._abort(rid)
        self.sender.close()
        if self.drafts is not None:
            self.drafts.close()
