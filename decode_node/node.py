"""The decode worker: reserves blocks, receives KV, decodes in continuous batches.

A request's life here:
1. `DecodeReserve`: the engine reserves blocks for the prompt (WAITING_FOR_KV)
   and the KV receiver expects the transfer into exactly those blocks; the
   block ids go back to the gateway (`ReserveResult`). Refusal reserves nothing.
2. `StartDecode` brings the first token(s) sampled by the prefill worker.
3. When the transfer is COMPLETE (every block verified) and the first tokens
   are known, the engine admits the sequence (`start_remote`, RUNNING).
4. Each engine step's new tokens go to the gateway as one `TokenBatch`.
5. Finish, `Abort` or a failed transfer frees the blocks; a failed transfer is
   reported as a retryable `RequestFailed`, so the gateway re-prefills.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from decode_node.engine_glue import StatsMirror, wire_deltas
from decode_node.runtime import NodeLoad, NodeRegistration, Sender
from decode_node.worker_metrics import WorkerMetrics
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.sequence import TokenLogprob
from kv_transfer.api import TransferState
from pdserve import protocol as p
from pdserve.sampling_params import SamplingParams, SamplingParamsError

log = logging.getLogger(__name__)

TRANSFER_LEASE_S = 30.0
_FAILED = {TransferState.FAILED, TransferState.ABORTED}


@dataclass
class _Incoming:
    transfer_id: str
    reserved_at: float
    num_blocks: int
    first_tokens: list[int] | None = None
    first_logprobs: list[Any] | None = None
    first_at: float = 0.0  # when StartDecode arrived: prefill done, transfer finishing


def engine_logprobs(raw: list[Any]) -> list[TokenLogprob] | None:
    if not raw or all(r is None for r in raw):
        return None
    return [TokenLogprob(int(r[0]), float(r[1]), tuple((int(a), float(b)) for a, b in r[2])) for r in raw]


class DecodeNode:
    role = "decode"

    def __init__(self, worker_id: str, engine: LLMEngine, runner: ModelRunner, receiver: Any,
                 send: Sender, metrics: WorkerMetrics, kv_shm: str = "") -> None:  # fmt: skip
        self.worker_id = worker_id
        self.engine = engine
        self.runner = runner
        self.receiver = receiver
        self.send = send
        self.metrics = metrics
        self.kv_shm = kv_shm
        self.stats = StatsMirror(metrics)
        self._incoming: dict[str, _Incoming] = {}
        self._running: set[str] = set()
        # Stage timings reported on a request's first and last deltas: rid -> (admitted_at, kv_transfer_s).
        self._timing: dict[str, tuple[float, float]] = {}
        # Cancelled transfers whose writer may still be active: blocks are freed
        # only once the transfer is terminal (transfer_id -> request id).
        self._cancelling: dict[str, str] = {}

    def registration(self) -> NodeRegistration:
        layout = self.runner.layout
        total = self.engine.stats().num_total_blocks
        return NodeRegistration(self.receiver.address, self.kv_shm, layout.compat_hash, total, layout.block_size)

    # --- control messages --------------------------------------------------

    def handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.DecodeReserve):
            self._reserve(msg)
        elif isinstance(msg, p.StartDecode):
            inc = self._incoming.get(msg.request_id)
            if inc is not None and inc.transfer_id == msg.transfer_id:
                inc.first_tokens, inc.first_logprobs = list(msg.token_ids), list(msg.logprobs)
                inc.first_at = time.monotonic()
        elif isinstance(msg, p.Abort):
            for rid in msg.request_ids:
                self._abort(rid)

    def _reserve(self, msg: p.DecodeReserve) -> None:
        rid = msg.request_id
        try:
            params = SamplingParams.from_dict(msg.params)
            blocks = self.engine.reserve_remote(rid, list(msg.prompt_token_ids), params)
        except (SamplingParamsError, ValueError) as e:
            self.send(p.RequestFailed(rid, f"invalid request: {e}", retryable=False))
            return
        if blocks is None:
            self.send(p.ReserveResult(rid, msg.transfer_id, [], refused="not enough free KV blocks"))
            return
        self.receiver.expect(msg.transfer_id, rid, list(blocks), TRANSFER_LEASE_S)
        self._incoming[rid] = _Incoming(msg.transfer_id, time.monotonic(), len(blocks))
        self.metrics.requests.inc()
        self.send(p.ReserveResult(rid, msg.transfer_id, list(blocks)))

    def _abort(self, rid: str) -> None:
        inc = self._incoming.pop(rid, None)
        if inc is not None:
            self.metrics.aborts.inc()
            self.receiver.cancel(inc.transfer_id)
            self._cancelling[inc.transfer_id] = rid
        elif rid in self._running:
            self.metrics.aborts.inc()
            self.engine.abort(rid)
            self._running.discard(rid)
            self._timing.pop(rid, None)

    def _reap_cancelled(self) -> None:
        for tid, rid in list(self._cancelling.items()):
            if self.receiver.poll(tid).terminal:
                del self._cancelling[tid]
                self.receiver.forget(tid)
                self.engine.abort(rid)

    # --- step ----------------------------------------------------------------

    def step(self) -> bool:
        if self._cancelling:
            self._reap_cancelled()
        admitted = self._admit_arrived()
        if not self._running:
            return admitted
        outputs = self.engine.step()
        for out in outputs:
            if out.finished:
                self._running.discard(out.request_id)
        deltas = [self._with_timings(d) for d in wire_deltas(outputs)]
        if deltas:
            self.send(p.TokenBatch(self.worker_id, deltas))
        return True

    def _with_timings(self, d: p.TokenDelta) -> p.TokenDelta:
        """kv_transfer on a request's first delta; decode (admission to finish) on its last."""
        timing = self._timing.get(d.request_id)
        if timing is None:
            return d
        admitted_at, transfer_s = timing
        timings = {"kv_transfer": transfer_s} if transfer_s >= 0 else {}
        self._timing[d.request_id] = (admitted_at, -1.0)
        if d.request_id not in self._running:
            timings["decode"] = time.monotonic() - admitted_at
            del self._timing[d.request_id]
        return replace(d, timings=timings) if timings else d

    def _admit_arrived(self) -> bool:
        admitted = False
        for rid, inc in list(self._incoming.items()):
            state = self.receiver.poll(inc.transfer_id)
            if state in _FAILED:
                self._transfer_failed(rid, inc, state)
            elif state == TransferState.COMPLETE and inc.first_tokens is not None:
                del self._incoming[rid]
                self.receiver.forget(inc.transfer_id)
                self.metrics.transfer_seconds.observe(time.monotonic() - inc.reserved_at)
                self.metrics.transfer_bytes.inc(inc.num_blocks * self._block_bytes())
                out = self.engine.start_remote(rid, inc.first_tokens, engine_logprobs(inc.first_logprobs or []))
                if not out.finished:
                    self._running.add(rid)
                    now = time.monotonic()
                    self._timing[rid] = (now, now - inc.first_at)
                admitted = True
        return admitted

    def _transfer_failed(self, rid: str, inc: _Incoming, state: TransferState) -> None:
        del self._incoming[rid]
        self.receiver.forget(inc.transfer_id)
        self.engine.abort(rid)
        self.metrics.transfer_failures.inc()
        log.warning("KV transfer for %s ended %s", rid, state.name)
        self.send(p.RequestFailed(rid, f"kv transfer {state.name.lower()}", retryable=True,
                                  transfer_id=inc.transfer_id))  # fmt: skip

    def _block_bytes(self) -> int:
        layout = self.runner.layout
        return layout.block_bytes_per_layer * layout.num_layers

    def load(self) -> NodeLoad:
        return self.stats.update(self.engine.stats())

    def busy(self) -> bool:
        return bool(self._incoming or self._running or self._cancelling)

    def close(self) -> None:
        for rid in list(self._incoming) + list(self._running):
            self._abort(rid)
        self.receiver.close()
