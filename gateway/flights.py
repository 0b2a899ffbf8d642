"""Requests in flight at the gateway: what a request has produced so far (kept across
attempts) apart from what its current attempt holds (workers, ids, reservation), and
the table the control plane hands worker events to.

A request's `RequestState` lives from `ClusterBackend.generate` to its end. Each
attempt (the first, a recovery, a retry after a refused reservation) gets a fresh
`Attempt` with its own worker-side id `<request id>#<n>` and its own event queue, so
the events of an abandoned attempt are dropped with it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from gateway.backend import GenerateRequest
from gateway.kv_router import Route
from gateway.registry import WorkerInfo
from gateway.tracing import AttemptSpan
from pdserve.common import protocol as p

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLost:
    """Event: a worker of the attempt left the registry (expired, gone or stalled)."""

    worker_id: str


@dataclass
class RequestState:
    """What a request produced, across all its attempts."""

    req: GenerateRequest
    generated: list[list[int]]  # tokens streamed so far, per choice
    finished: list[bool]  # per choice
    attempts: int = 0
    failures: int = 0
    reserve_first: bool = False  # the next attempt prefills only once decode reserved
    reserve_deadline: float = 0.0  # set by the first attempt; retries after a refusal keep it

    @classmethod
    def new(cls, req: GenerateRequest) -> RequestState:
        n = req.params.n
        return cls(req, [[] for _ in range(n)], [False] * n)

    @property
    def done(self) -> bool:
        return all(self.finished)


@dataclass
class Attempt:
    """One try at (part of) a request: the workers it uses and where it stands."""

    wid: str  # worker-side request id
    payload: p.RequestPayload  # what it sends to its workers
    choices: list[int]  # the choices it generates
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    workers: set[str] = field(default_factory=set)
    decode_id: str = ""
    prefill_id: str = ""
    transfer_id: str = ""
    reserved: bool = False
    first: p.FirstToken | None = None  # held until the reservation, then StartDecode
    reserve_deadline: float = 0.0
    route: Route | None = None  # where its prompt is computed, and the KV index's prediction
    span: AttemptSpan | None = None  # a traced request's attempt (gateway/tracing.py)
    failure: str | None = None  # why it failed, for its span
    cached_tokens: int | None = None  # what its prompt's worker found cached (first report)

    @property
    def reserving(self) -> bool:
        return bool(self.decode_id) and not self.reserved


@dataclass
class Flight:
    request: RequestState
    attempt: Attempt

    @property
    def attempt_done(self) -> bool:
        return all(self.request.finished[c] for c in self.attempt.choices)


class FlightTable:
    """The current attempt of every request by worker-side id. The control plane hands
    it worker events (`deliver`) and lost workers (`lost`); nothing else reaches a flight."""

    def __init__(self) -> None:
        self._by_wid: dict[str, Flight] = {}

    def add(self, flight: Flight) -> None:
        self._by_wid[flight.attempt.wid] = flight

    def remove(self, wid: str) -> None:
        self._by_wid.pop(wid, None)

    def flights(self) -> list[Flight]:
        return list(self._by_wid.values())

    def deliver(self, sender: str, wid: str, event: Any) -> None:
        """A worker's event for `wid`; dropped unless that worker serves the attempt."""
        flight = self._by_wid.get(wid)
        if flight is not None and sender in flight.attempt.workers:
            flight.attempt.events.put_nowait(event)

    def lost(self, w: WorkerInfo | None) -> None:
        """`w` left the registry or stalled: each of its attempts fails over."""
        if w is None:
            return
        log.warning("worker %s (%s) lost, %d requests in flight", w.worker_id, w.role, len(w.inflight))
        for wid in list(w.inflight):
            flight = self._by_wid.get(wid)
            if flight is not None:
                flight.attempt.events.put_nowait(WorkerLost(w.worker_id))
