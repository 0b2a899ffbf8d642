"""ClusterBackend: the GenerationBackend that drives real workers over ZeroMQ.

Life of a request (one *attempt*; recovery starts a new attempt):

1. Pick workers. With prefill and decode pools: the decode worker with the
   most free KV, then the prefill worker with the fewest queued tokens. With
   only a colocated pool: the least loaded colocated worker.
2. Disaggregated: send `DecodeReserve` and `PrefillRequest` at once, so the
   reservation overlaps the prefill compute. When `ReserveResult` says the
   blocks are reserved, send their ids to the prefill worker (`TransferTarget`):
   it pushes KV only after that, so no KV is ever written into blocks not yet
   reserved. A refusal (decode admission keeps room for its running streams)
   is retried on the decode pool until `reserve_timeout_s`; a prefill that has
   not produced its first token yet is cancelled at once and the next attempt
   reserves first and prefills only once the blocks are granted, so waiting
   for decode room never costs prefill compute or prefill KV.
   Colocated: send `RunRequest`.
3. `FirstToken` from prefill is yielded at once (TTFT) and, once the blocks are
   reserved, forwarded to the decode worker as `StartDecode`; decode admits the
   sequence when the KV transfer is complete and streams `TokenBatch` deltas.
4. A worker that fails the request, or goes silent, ends the attempt: the
   gateway re-prefills prompt + tokens already streamed on another worker and
   continues, at most `max_recoveries` times. The streamed tokens travel as
   output (a `Resume` in the request payload), so seeded sampling and penalties continue exactly;
   an n > 1 request that already streamed resumes each unfinished choice as its
   own n=1 attempt (`Resume.choice_index`). Only an empty pool is an error.
5. Closing the iterator (disconnect, stop string, deadline) sends `Abort` to
   every worker the request touched.

The socket loop and the worker registry are the base class, `ControlPlane`
(gateway/control_plane.py); this module is the request flow on top of it.

Each attempt has its own worker-side request id (`<id>#<attempt>`), so late
messages of an abandoned attempt are recognised and dropped.

Every request travels with a seed: one without gets a fresh random 63-bit seed
before its first attempt (with `PDSERVE_GATEWAY_SEED_KEY` set, `assigned_seed(key,
id)` instead, a keyed hash of its id, so a test can rebuild the seed). A client that
resends a request id still gets a new sample, as OpenAI's API promises. Sampled
token i of choice c is drawn from (seed, c, i) on any worker, so every attempt,
recoveries included, continues the same draws. The seed stays inside the cluster:
the HTTP layer never sees it, so it is never echoed to the client.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from common import protocol as p
from common.transport import new_id
from gateway.backend import BackendError, BackendErrorKind, GenerateRequest, Logprob, TokenDelta
from gateway.control_plane import ClusterConfig, ControlPlane
from gateway.registry import WorkerInfo
from gateway.router import blocks_needed, pick_colocated, pick_decode, pick_prefill

log = logging.getLogger(__name__)

__all__ = ["ClusterBackend", "ClusterConfig"]


@dataclass(frozen=True)
class _WorkerLost:
    worker_id: str


class _ReserveRefused(Exception):
    """Decode refused the reservation while the prefill was still computing."""


class _AttemptFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Flight:
    req: GenerateRequest
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    generated: list[list[int]] = field(default_factory=list)
    finished: list[bool] = field(default_factory=list)
    attempt: int = 0
    wid: str = ""  # worker-side request id of the current attempt
    workers: set[str] = field(default_factory=set)  # workers of the current attempt
    decode_id: str = ""
    prefill_id: str = ""
    transfer_id: str = ""
    reserved: bool = False
    first: p.FirstToken | None = None  # waiting for the reservation before StartDecode
    reserve_deadline: float = 0.0
    reserve_first: bool = False  # the next attempt prefills only once decode reserved
    inputs: p.RequestPayload | None = None  # what the current attempt sends
    choices: list[int] = field(default_factory=list)  # choices the current attempt generates
    failures: int = 0

    @property
    def done(self) -> bool:
        return all(self.finished)

    @property
    def attempt_done(self) -> bool:
        return all(self.finished[c] for c in self.choices)


def assigned_seed(key: bytes, request_id: str) -> int:
    """The seed the gateway gives request `request_id` when the client set none: a
    63-bit keyed hash of the id (blake2b), unpredictable without the gateway's key."""
    digest = hashlib.blake2b(request_id.encode(), key=key, digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class ClusterBackend(ControlPlane):
    def __init__(self, config: ClusterConfig | None = None) -> None:
        super().__init__(config)
        self._flights: dict[str, _Flight] = {}  # by worker-side request id
        self._seed_key = self.config.seed_key  # None: a random seed per request

    # --- request flow ----------------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if req.params.seed is None:
            req = replace(req, params=replace(req.params, seed=self._new_seed(req.request_id)))
        n = req.params.n
        flight = _Flight(req, generated=[[] for _ in range(n)], finished=[False] * n)
        try:
            while not flight.done:
                try:
                    await self._launch(flight)
                    async for delta in self._follow(flight):
                        yield delta
                    self._end_attempt(flight, abort=False)  # one choice of several is done
                except _AttemptFailed as e:
                    self._recover_or_raise(flight, e.reason)
                except _ReserveRefused:
                    self._end_attempt(flight, abort=True)  # the prefill stops now, not a failure
                    flight.reserve_first = True
                    await asyncio.sleep(self.config.reserve_retry_s)
        finally:
            self._end_attempt(flight, abort=not flight.done)

    def _new_seed(self, request_id: str) -> int:
        if self._seed_key is None:
            return secrets.randbits(63)
        return assigned_seed(self._seed_key, request_id)

    def _recover_or_raise(self, flight: _Flight, reason: str) -> None:
        self._end_attempt(flight, abort=True)
        flight.failures += 1
        if flight.failures > self.config.max_recoveries:
            raise BackendError(BackendErrorKind.FAILED, f"request failed after recoveries: {reason}")
        log.warning("recovering %s (attempt %d): %s", flight.req.request_id, flight.attempt, reason)

    def _attempt_inputs(self, flight: _Flight) -> p.RequestPayload:
        """What the next attempt sends to its workers.

        Before any token streamed: the whole request. Afterwards each unfinished choice
        resumes on its own (n=1, one after another): the prompt plus a `Resume` with its
        streamed tokens, which stay output to the engine, so the workers continue its
        seeds and penalties exactly; max_tokens still counts them."""
        params, prompt = flight.req.params, list(flight.req.prompt_token_ids)
        if not any(flight.generated):
            flight.choices = list(range(params.n))
            return p.RequestPayload(prompt, params)
        choice = next(c for c, fin in enumerate(flight.finished) if not fin)
        flight.choices = [choice]
        resume = p.Resume(list(flight.generated[choice]), choice)
        return p.RequestPayload(prompt, replace(params, n=1), resume)

    async def _launch(self, flight: _Flight) -> None:
        flight.attempt += 1
        flight.wid = f"{flight.req.request_id}#{flight.attempt}"
        flight.workers = set()
        flight.decode_id = flight.prefill_id = flight.transfer_id = ""
        flight.reserved, flight.first = False, None
        flight.events = asyncio.Queue()  # events of earlier attempts are dropped with their queue
        self._flights[flight.wid] = flight
        payload = flight.inputs = self._attempt_inputs(flight)
        mode = await self._wait_mode(flight)
        if mode == "colocated":
            w = pick_colocated(self.registry.pool("colocated"))
            assert w is not None
            self._assign(flight, w, payload.num_tokens)
            self._send(w.worker_id, p.RunRequest(flight.wid, payload))
            return
        reserve_first, flight.reserve_first = flight.reserve_first, False
        if not reserve_first:  # a retry after a refusal keeps the request's first deadline
            flight.reserve_deadline = time.monotonic() + self.config.reserve_timeout_s
        self._reserve(flight)
        if not reserve_first:
            self._start_prefill(flight)

    def _start_prefill(self, flight: _Flight) -> None:
        """Send the attempt's prompt to the prefill worker with the fewest queued tokens."""
        prefill = pick_prefill(self.registry.pool("prefill"))
        if prefill is None:
            raise BackendError(BackendErrorKind.NO_WORKERS, "no prefill worker registered", retry_after=1.0)
        payload = flight.inputs
        assert payload is not None
        self._assign(flight, prefill, payload.num_tokens)
        flight.prefill_id = prefill.worker_id
        self._send(prefill.worker_id, p.PrefillRequest(flight.wid, payload))

    def _reserve(self, flight: _Flight) -> None:
        """Ask the decode worker with the most free KV to reserve blocks for the prompt."""
        decode = pick_decode(self.registry.pool("decode"))
        if decode is None:
            raise BackendError(BackendErrorKind.NO_WORKERS, "no decode worker registered", retry_after=1.0)
        payload = flight.inputs
        assert payload is not None
        flight.transfer_id = new_id("xfer")
        flight.decode_id = decode.worker_id
        self._assign(flight, decode, 0, blocks=blocks_needed(payload.num_tokens, decode.reg.block_size))
        self._send(decode.worker_id, p.DecodeReserve(flight.wid, flight.transfer_id, payload))

    async def _on_reserved(self, flight: _Flight, result: p.ReserveResult) -> None:
        if result.ok:
            flight.reserved = True
            w = self.registry.get(flight.decode_id)
            if w is None:
                raise _AttemptFailed(f"worker {flight.decode_id} lost")
            if not flight.prefill_id:  # reserved first: the target follows the prompt at once
                self._start_prefill(flight)
            self._send(flight.prefill_id, p.TransferTarget(
                flight.wid, flight.transfer_id, w.worker_id, w.reg.host_id, w.reg.kv_address,
                w.reg.kv_shm, list(result.block_ids),
            ))
            if flight.first is not None:
                self._start_decode(flight, flight.first)
            return
        self._unassign(flight, flight.decode_id)
        if time.monotonic() > flight.reserve_deadline:
            raise BackendError(BackendErrorKind.OVERLOADED, f"decode refused: {result.refused}", retry_after=1.0)
        if flight.prefill_id and flight.first is None:
            raise _ReserveRefused(result.refused)
        await asyncio.sleep(self.config.reserve_retry_s)
        self._reserve(flight)

    async def _wait_mode(self, flight: _Flight) -> str:
        deadline = time.monotonic() + self.config.no_worker_wait_s
        while True:
            mode = self._mode()
            if mode is not None:
                return mode
            if time.monotonic() >= deadline:
                raise BackendError(
                    BackendErrorKind.NO_WORKERS, "no prefill+decode or colocated worker registered",
                    retry_after=1.0,
                )
            await asyncio.sleep(0.05)

    async def _follow(self, flight: _Flight) -> AsyncIterator[TokenDelta]:
        while not flight.attempt_done:
            reserving = bool(flight.decode_id) and not flight.reserved
            ev = await self._next_event(flight, flight.reserve_deadline if reserving else None)
            if isinstance(ev, p.ReserveResult):
                if ev.transfer_id == flight.transfer_id and not flight.reserved:
                    await self._on_reserved(flight, ev)
            elif isinstance(ev, p.FirstToken):
                for d in self._first_token(flight, ev):
                    yield d
            elif isinstance(ev, p.TokenDelta):
                if flight.prefill_id:  # decode is streaming: the KV arrived, prefill's part is over
                    self._unassign(flight, flight.prefill_id)
                    flight.prefill_id = ""
                delta = self._record(flight, ev.index, ev.token_ids, ev.finish_reason, ev.logprobs,
                                     ev.cached_tokens, ev.timings)
                if delta is not None:
                    yield delta
            else:
                self._check_failure(flight, ev)

    def _first_token(self, flight: _Flight, ev: p.FirstToken) -> list[TokenDelta]:
        out = []
        for i, tok in enumerate(ev.token_ids[: len(flight.choices)]):
            first = ev.logprobs[i] if i < len(ev.logprobs) else None
            lp = [first] if first is not None else None
            reason = ev.finish_reasons[i] if i < len(ev.finish_reasons) else None
            d = self._record(flight, flight.choices[i], [tok], reason, lp, ev.cached_tokens, ev.timings or None)
            if d is not None:
                out.append(d)
        if flight.attempt_done:
            # Nothing left to decode: free the reservation (the prefill kept no blocks).
            self._send(flight.decode_id, p.Abort([flight.wid], "finished at first token"))
        elif flight.reserved:
            self._start_decode(flight, ev)
        else:
            flight.first = ev
        return out

    def _start_decode(self, flight: _Flight, ev: p.FirstToken) -> None:
        msg = p.StartDecode(flight.wid, flight.transfer_id, list(ev.token_ids), list(ev.logprobs))
        self._send(flight.decode_id, msg)

    def _record(
        self, flight: _Flight, index: int, token_ids: list[int], reason: str | None,
        logprobs: list[Logprob] | None, cached: int, timings: dict[str, float] | None,
    ) -> TokenDelta | None:
        if not 0 <= index < len(flight.finished) or flight.finished[index]:
            return None
        flight.generated[index].extend(token_ids)
        if reason is not None:
            flight.finished[index] = True
        return TokenDelta(index, list(token_ids), logprobs, reason, cached, timings)

    def _check_failure(self, flight: _Flight, ev: Any) -> None:
        if isinstance(ev, p.RequestFailed):
            if not ev.retryable:
                raise BackendError(BackendErrorKind.INVALID if "invalid" in ev.reason else BackendErrorKind.FAILED, ev.reason)
            raise _AttemptFailed(ev.reason)
        if isinstance(ev, _WorkerLost) and ev.worker_id in flight.workers:
            raise _AttemptFailed(f"worker {ev.worker_id} lost")

    async def _next_event(self, flight: _Flight, attempt_deadline: float | None = None) -> Any:
        """The next event of the current attempt; TIMEOUT past the request's deadline,
        `_AttemptFailed` past `attempt_deadline`."""
        req_deadline = flight.req.deadline
        deadlines = [d for d in (attempt_deadline, req_deadline) if d is not None]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        try:
            return await asyncio.wait_for(flight.events.get(), timeout)
        except asyncio.TimeoutError:
            pass
        if req_deadline is not None and time.monotonic() >= req_deadline:
            raise BackendError(BackendErrorKind.TIMEOUT, "request deadline passed")
        raise _AttemptFailed("decode reservation timed out")

    # --- bookkeeping -----------------------------------------------------

    def _assign(self, flight: _Flight, w: WorkerInfo, tokens: int, blocks: int = 0) -> None:
        flight.workers.add(w.worker_id)
        w.inflight.add(flight.wid)
        w.pending_tokens += tokens
        w.pending_blocks += blocks
        w.pending_seqs += 1 if blocks or w.role == "colocated" else 0

    def _unassign(self, flight: _Flight, worker_id: str) -> None:
        flight.workers.discard(worker_id)
        w = self.registry.get(worker_id)
        if w is not None:
            w.inflight.discard(flight.wid)

    def _end_attempt(self, flight: _Flight, abort: bool) -> None:
        if not flight.wid:
            return
        for wid in list(flight.workers):
            if abort:
                self._send(wid, p.Abort([flight.wid], "aborted"))
            self._unassign(flight, wid)
        self._flights.pop(flight.wid, None)

    # --- events from the control plane ------------------------------------

    def _deliver(self, sender: str, wid: str, event: Any) -> None:
        flight = self._flights.get(wid)
        if flight is not None and sender in flight.workers:
            flight.events.put_nowait(event)

    def _lost(self, w: WorkerInfo | None) -> None:
        if w is None:
            return
        log.warning("worker %s (%s) lost, %d requests in flight", w.worker_id, w.role, len(w.inflight))
        for wid in list(w.inflight):
            flight = self._flights.get(wid)
            if flight is not None:
                flight.events.put_nowait(_WorkerLost(w.worker_id))

