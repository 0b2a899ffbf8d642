"""ClusterBackend: the GenerationBackend that drives real workers over ZeroMQ.

Life of a request (one *attempt*; recovery starts a new attempt):

1. Pick workers (gateway/kv_router.py). Disaggregated: the decode worker the
   router picks (kv-aware: fewest blocks to ship, with room; it runs the whole
   request if at most `local_prefill_threshold` prompt tokens are missing from its
   cache, or up to 4x that behind a long prefill), the prefill worker it picks.
   With only a colocated pool: the colocated worker the router picks.
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

The pieces are composed, not inherited: `ControlPlane` (gateway/control_plane.py)
owns the socket and the worker registry and hands request events to the
`FlightTable` (gateway/flights.py); this module is the request flow that reads
them. A request's `RequestState` (tokens so far, failures) outlives its attempts;
each `Attempt` has its own worker-side request id (`<id>#<attempt>`) and event
queue, so late messages of an abandoned attempt are recognised and dropped.

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
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from gateway.backend import (
    BackendError,
    BackendErrorKind,
    FleetSample,
    GenerateRequest,
    Logprob,
    ReadyState,
    TokenDelta,
)
from gateway.control_plane import ClusterConfig, ControlPlane
from gateway.flights import Attempt, Flight, FlightTable, RequestState, WorkerLost
from gateway.kv_router import KvRouter, Pick
from gateway.registry import WorkerInfo, WorkerRegistry
from gateway.router import blocks_needed
from gateway.tracing import AttemptSpan
from pdserve.common import protocol as p
from pdserve.common.tracing import Tracer
from pdserve.common.transport import new_id

log = logging.getLogger(__name__)

__all__ = ["ClusterBackend", "ClusterConfig"]


class _ReserveRefused(Exception):
    """Decode refused the reservation while the prefill was still computing."""


class _AttemptFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def assigned_seed(key: bytes, request_id: str) -> int:
    """The seed the gateway gives request `request_id` when the client set none: a
    63-bit keyed hash of the id (blake2b), unpredictable without the gateway's key."""
    digest = hashlib.blake2b(request_id.encode(), key=key, digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class ClusterBackend:
    """The `GenerationBackend` over real workers: a control plane, a flight table, and
    the request flow between them."""

    def __init__(self, config: ClusterConfig | None = None, tracer: Tracer | None = None) -> None:
        self.config = config or ClusterConfig()
        self.tracer = tracer  # a traced request's attempts get spans (gateway/tracing.py)
        self.flights = FlightTable()
        self.control = ControlPlane(self.config, self.flights)
        self.router = KvRouter(self.config.router_config, self.control.kv_index)
        self._seed_key = self.config.seed_key  # None: a random seed per request

    # --- the backend contract (gateway/backend.py) ------------------------

    async def start(self) -> None:
        await self.control.start()

    async def close(self) -> None:
        await self.control.close()

    def ready(self) -> ReadyState:
        return self.control.ready()

    def workers(self) -> Sequence[Mapping[str, Any]]:
        return self.control.workers()

    def fleet_metrics(self) -> Sequence[FleetSample]:
        return [*self.control.fleet_metrics(), *self.router.samples()]

    @property
    def registry(self) -> WorkerRegistry:
        return self.control.registry

    @property
    def control_address(self) -> str:
        return self.control.control_address

    def _send(self, worker_id: str, msg: p.Message) -> None:
        self.control.send(worker_id, msg)

    # --- request flow ----------------------------------------------------

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        if req.params.seed is None:
            req = replace(req, params=replace(req.params, seed=self._new_seed(req.request_id)))
        request = RequestState.new(req)
        flight: Flight | None = None
        try:
            while not request.done:
                try:
                    flight = self._new_attempt(request)
                    await self._launch(flight)
                    async for delta in self._follow(flight):
                        yield delta
                    self._end_attempt(flight, abort=False)  # one choice of several is done
                except _AttemptFailed as e:
                    self._trace_failed(flight, e.reason)
                    self._recover_or_raise(request, flight, e.reason)
                except _ReserveRefused:
                    self._end_attempt(flight, abort=True)  # the prefill stops now, not a failure
                    request.reserve_first = True
                    await asyncio.sleep(self.config.reserve_retry_s)
        finally:
            self._end_attempt(flight, abort=not request.done)

    def _new_seed(self, request_id: str) -> int:
        if self._seed_key is None:
            return secrets.randbits(63)
        return assigned_seed(self._seed_key, request_id)

    def _recover_or_raise(self, request: RequestState, flight: Flight | None, reason: str) -> None:
        self._end_attempt(flight, abort=True)
        request.failures += 1
        if request.failures > self.config.max_recoveries:
            raise BackendError(BackendErrorKind.FAILED, f"request failed after recoveries: {reason}")
        log.warning("recovering %s (attempt %d): %s", request.req.request_id, request.attempts, reason)

    def _attempt_inputs(self, request: RequestState) -> tuple[p.RequestPayload, list[int]]:
        """What the next attempt sends to its workers, and the choices it generates.

        Before any token streamed: the whole request. Afterwards each unfinished choice
        resumes on its own (n=1, one after another): the prompt plus a `Resume` with its
        streamed tokens, which stay output to the engine, so the workers continue its
        seeds and penalties exactly; max_tokens still counts them. Each under its LoRA adapter."""
        params, prompt, lora = request.req.params, list(request.req.prompt_token_ids), request.req.lora
        if not any(request.generated):
            return p.RequestPayload(prompt, params, None, lora), list(range(params.n))
        choice = next(c for c, fin in enumerate(request.finished) if not fin)
        resume = p.Resume(list(request.generated[choice]), choice)
        return p.RequestPayload(prompt, replace(params, n=1), resume, lora), [choice]

    def _new_attempt(self, request: RequestState) -> Flight:
        """The request's next attempt, registered in the flight table (so that whatever
        happens next, `_end_attempt` finds and aborts it)."""
        request.attempts += 1
        payload, choices = self._attempt_inputs(request)
        span = None
        if self.tracer is not None and request.req.traceparent is not None:
            span = AttemptSpan(self.tracer, request.req.traceparent, request.attempts,
                               len(payload.resume.output_token_ids) if payload.resume else 0)
            payload = replace(payload, traceparent=span.traceparent)
        flight = Flight(request, Attempt(f"{request.req.request_id}#{request.attempts}", payload, choices))
        flight.attempt.span = span
        self.flights.add(flight)
        return flight

    async def _launch(self, flight: Flight) -> None:
        request, a = flight.request, flight.attempt
        mode = await self._wait_mode(request)
        if mode == "colocated":
            pick = self.router.pick(self.registry.pool(p.Role.COLOCATED), a.payload)
            assert pick is not None
            self._run_on(a, pick)
            return
        reserve_first, request.reserve_first = request.reserve_first, False
        if not reserve_first and self._prefill_locally(a):
            return
        if not reserve_first:  # a retry after a refusal keeps the request's first deadline
            request.reserve_deadline = time.monotonic() + self.config.reserve_timeout_s
        a.reserve_deadline = request.reserve_deadline
        self._reserve(a)
        if not reserve_first:
            self._start_prefill(a)

    def _run_on(self, a: Attempt, pick: Pick, blocks: int = 0) -> None:
        """The whole request on one worker: colocated, or a decode worker prefilling locally."""
        a.route = pick.route
        if a.span is not None:
            mode = "colocated" if pick.worker.role == "colocated" else "local_prefill"
            a.span.routed(mode, pick.worker.role, pick.worker.worker_id, pick.route.predicted_blocks
                          * pick.route.block_size, pick.route.reason)
        self._assign(a, pick.worker, pick.route.uncached_tokens, blocks=blocks)
        self._send(pick.worker.worker_id, p.RunRequest(a.wid, a.payload))

    def _prefill_locally(self, a: Attempt) -> bool:
        """Run on the decode worker if it has room and the uncached part is within the
        threshold, or would wait behind a long prefill (gateway/kv_router.py)."""
        decode = self.router.pick_decode(self.registry.pool(p.Role.DECODE), a.payload, count=False)
        if decode is None:
            return False
        blocks = blocks_needed(a.payload.num_tokens, decode.reg.block_size)
        prefill = self.registry.pool(p.Role.PREFILL)
        route = self.router.local_prefill(decode, a.payload, prefill) if decode.free_blocks >= blocks else None
        if route is None:
            return False
        self._run_on(a, Pick(decode, route), blocks)
        return True

    def _start_prefill(self, a: Attempt) -> None:
        """Send the attempt's prompt to the prefill worker the router picks."""
        pick = self.router.pick(self.registry.pool(p.Role.PREFILL), a.payload)
        if pick is None:
            raise BackendError(BackendErrorKind.NO_WORKERS, "no prefill worker registered", retry_after=1.0)
        prefill, a.route = pick.worker, pick.route
        if a.span is not None:
            a.span.routed("disaggregated", "prefill", prefill.worker_id,
                          pick.route.predicted_blocks * pick.route.block_size, pick.route.reason)
        self._assign(a, prefill, pick.route.uncached_tokens)
        a.prefill_id = prefill.worker_id
        self._send(prefill.worker_id, p.PrefillRequest(a.wid, a.payload))

    def _reserve(self, a: Attempt) -> None:
        """Ask the decode worker the router picks to reserve blocks for the prompt."""
        decode = self.router.pick_decode(self.registry.pool(p.Role.DECODE), a.payload)
        if decode is None:
            raise BackendError(BackendErrorKind.NO_WORKERS, "no decode worker registered", retry_after=1.0)
        a.transfer_id = new_id("xfer")
        a.decode_id = decode.worker_id
        if a.span is not None:
            a.span.routed("disaggregated", "decode", decode.worker_id, 0, "")
        self._assign(a, decode, 0, blocks=blocks_needed(a.payload.num_tokens, decode.reg.block_size))
        self._send(decode.worker_id, p.DecodeReserve(a.wid, a.transfer_id, a.payload))

    async def _on_reserved(self, a: Attempt, result: p.ReserveResult) -> None:
        if result.ok:
            a.reserved = True
            w = self.registry.get(a.decode_id)
            if w is None:
                raise _AttemptFailed(f"worker {a.decode_id} lost")
            if not a.prefill_id:  # reserved first: the target follows the prompt at once
                self._start_prefill(a)
            self._send(a.prefill_id, p.TransferTarget(
                a.wid, a.transfer_id, w.worker_id, w.reg.host_id, w.reg.kv_address,
                w.reg.kv_shm, list(result.block_ids), result.cached_blocks, result.draft,
            ))
            if a.first is not None:
                self._start_decode(a, a.first)
            return
        self._unassign(a, a.decode_id)
        if time.monotonic() > a.reserve_deadline:
            raise BackendError(BackendErrorKind.OVERLOADED, f"decode refused: {result.refused}", retry_after=1.0)
        if a.prefill_id and a.first is None:
            raise _ReserveRefused(result.refused)
        await asyncio.sleep(self.config.reserve_retry_s)
        self._reserve(a)

    async def _wait_mode(self, request: RequestState) -> str:
        deadline = time.monotonic() + self.config.no_worker_wait_s
        while True:
            mode = self.control.mode()
            if mode is not None:
                return mode
            if time.monotonic() >= deadline:
                raise BackendError(
                    BackendErrorKind.NO_WORKERS, "no prefill+decode or colocated worker registered",
                    retry_after=1.0,
                )
            await asyncio.sleep(0.05)

    async def _follow(self, flight: Flight) -> AsyncIterator[TokenDelta]:
        a = flight.attempt
        while not flight.attempt_done:
            ev = await self._next_event(flight, a.reserve_deadline if a.reserving else None)
            if isinstance(ev, p.ReserveResult):
                if ev.transfer_id == a.transfer_id and not a.reserved:
                    await self._on_reserved(a, ev)
            elif isinstance(ev, p.FirstToken):
                for d in self._first_token(flight, ev):
                    yield d
            elif isinstance(ev, p.TokenDelta):
                self._prompt_done(a, ev.cached_tokens)  # a run on one worker: its first delta says
                if a.prefill_id:  # decode is streaming: the KV arrived, prefill's part is over
                    self._unassign(a, a.prefill_id)
                    a.prefill_id = ""
                delta = self._record(flight.request, ev.index, ev.token_ids, ev.finish_reason, ev.logprobs,
                                     ev.cached_tokens, ev.timings, ev.prompt_logprobs)
                if delta is not None:
                    yield delta
            else:
                self._check_failure(a, ev)

    def _first_token(self, flight: Flight, ev: p.FirstToken) -> list[TokenDelta]:
        a, out = flight.attempt, []
        self._prompt_done(a, ev.cached_tokens)
        for i, tok in enumerate(ev.token_ids[: len(a.choices)]):
            lp = [x] if i < len(ev.logprobs) and (x := ev.logprobs[i]) is not None else None
            reason = ev.finish_reasons[i] if i < len(ev.finish_reasons) else None
            d = self._record(flight.request, a.choices[i], [tok], reason, lp, ev.cached_tokens, ev.timings or None,
                             ev.prompt_logprobs if i == 0 else None)
            if d is not None:
                out.append(d)
        if flight.attempt_done:
            # Nothing left to decode: free the reservation (the prefill kept no blocks).
            self._send(a.decode_id, p.Abort([a.wid], "finished at first token"))
        elif a.reserved:
            self._start_decode(a, ev)
        else:
            a.first = ev
        return out

    def _start_decode(self, a: Attempt, ev: p.FirstToken) -> None:
        self._send(a.decode_id, p.StartDecode(a.wid, a.transfer_id, list(ev.token_ids), list(ev.logprobs)))

    @staticmethod
    def _record(
        request: RequestState, index: int, token_ids: list[int], reason: str | None,
        logprobs: list[Logprob] | None, cached: int, timings: dict[str, float] | None,
        prompt_logprobs: list[Logprob | None] | None = None) -> TokenDelta | None:
        if not 0 <= index < len(request.finished) or request.finished[index]:
            return None
        request.generated[index].extend(token_ids)
        if reason is not None:
            request.finished[index] = True
        return TokenDelta(index, list(token_ids), logprobs, reason, cached, timings, prompt_logprobs=prompt_logprobs)

    @staticmethod
    def _check_failure(a: Attempt, ev: Any) -> None:
        if isinstance(ev, p.RequestFailed):
            if not ev.retryable:
                raise BackendError(BackendErrorKind.INVALID if "invalid" in ev.reason else BackendErrorKind.FAILED, ev.reason)
            raise _AttemptFailed(ev.reason)
        if isinstance(ev, WorkerLost) and ev.worker_id in a.workers:
            raise _AttemptFailed(f"worker {ev.worker_id} lost")

    @staticmethod
    async def _next_event(flight: Flight, attempt_deadline: float | None = None) -> Any:
        """The next event of the current attempt; TIMEOUT past the request's deadline,
        `_AttemptFailed` past `attempt_deadline`."""
        req_deadline = flight.request.req.deadline
        deadlines = [d for d in (attempt_deadline, req_deadline) if d is not None]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        try:
            return await asyncio.wait_for(flight.attempt.events.get(), timeout)
        except asyncio.TimeoutError:
            pass
        if req_deadline is not None and time.monotonic() >= req_deadline:
            raise BackendError(BackendErrorKind.TIMEOUT, "request deadline passed")
        raise _AttemptFailed("decode reservation timed out")

    # --- bookkeeping -----------------------------------------------------

    @staticmethod
    def _assign(a: Attempt, w: WorkerInfo, tokens: int, blocks: int = 0) -> None:
        a.workers.add(w.worker_id)
        w.inflight.add(a.wid)
        w.add_pending(a.wid, tokens, blocks, 1 if blocks or w.role == p.Role.COLOCATED else 0)

    def _unassign(self, a: Attempt, worker_id: str) -> None:
        a.workers.discard(worker_id)
        w = self.registry.get(worker_id)
        if w is not None:
            w.inflight.discard(a.wid)
            w.release(a.wid)

    def _prompt_done(self, a: Attempt, cached_tokens: int) -> None:
        """The prompt is computed: its cache report checks the KV index; no longer queued load."""
        if a.cached_tokens is None:
            a.cached_tokens = cached_tokens
        self.router.observe(a.route, cached_tokens)
        w = self.registry.get(a.route.worker_id) if a.route is not None else None
        if w is not None:
            w.settle(a.wid)

    @staticmethod
    def _trace_failed(flight: Flight | None, reason: str) -> None:
        if flight is not None and flight.attempt.span is not None:
            flight.attempt.failure = reason

    def _end_attempt(self, flight: Flight | None, abort: bool) -> None:
        if flight is None:
            return
        a = flight.attempt
        if a.span is not None:
            a.span.end(a.failure, a.cached_tokens)
            a.span = None
        for wid in list(a.workers):
            if abort:
                self._send(wid, p.Abort([a.wid], "aborted"))
            self._unassign(a, wid)
        self.flights.remove(a.wid)
