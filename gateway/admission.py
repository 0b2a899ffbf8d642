"""Admission control: a bounded number of requests inside the backend, bounded queues in front.

Policy
------
1. At most `max_in_flight` requests hold a slot (are inside the backend) at once.
2. A request that finds no free slot waits in the queue of its priority class
   (`interactive` or `batch`). A full queue (`max_depth`) or a wait longer than
   `max_wait_s` rejects it: 503 with `Retry-After`, never an unbounded queue.
3. When a slot frees, it goes to the oldest interactive waiter: interactive work is
   always admitted before batch work queued at the same time, so a batch backlog never
   delays an interactive request by more than the slots already running.
4. Aging: a batch waiter older than `batch_aging_s` is served first, so a steady
   interactive stream cannot starve batch work forever either. With
   `batch_aging_s=None` the priority is strict.
5. While draining (shutdown), new requests are rejected; those already queued keep
   their place and are served.

Invariant: a free slot implies both queues are empty (a release hands its slot straight
to the next waiter), so the fast path never overtakes a waiter.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

from gateway.backend import PRIORITIES
from gateway.config import AdmissionConfig
from gateway.errors import APIError, unavailable


@dataclass(eq=False)  # identity: a waiter is removed from its queue by identity
class _Waiter:
    priority: str
    enqueued_at: float
    future: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass(frozen=True)
class Admission:
    """The result of a successful admission."""

    priority: str
    wait_s: float  # time spent queued


class AdmissionController:
    def __init__(self, config: AdmissionConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._queues: dict[str, deque[_Waiter]] = {p: deque() for p in PRIORITIES}
        self._in_flight = 0
        self._draining = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def depth(self, priority: str) -> int:
        return sum(1 for w in self._queues[priority] if not w.future.done())

    def start_draining(self) -> None:
        self._draining = True

    @asynccontextmanager
    async def slot(self, priority: str) -> AsyncIterator[Admission]:
        """Hold a slot for the duration of the block. Raises APIError (503) when rejected."""
        admission = await self.acquire(priority)
        try:
            yield admission
        finally:
            self.release()

    async def acquire(self, priority: str) -> Admission:
        if self._draining:
            raise unavailable("server is shutting down", "draining", self._config.retry_after_s, "draining")
        if self._in_flight < self._config.max_in_flight:
            self._in_flight += 1
            return Admission(priority, 0.0)
        limits = self._config.queue(priority)
        if self.depth(priority) >= limits.max_depth:
            raise self._overloaded(f"the {priority} queue is full", "queue_full")
        waiter = _Waiter(priority, self._clock())
        self._queues[priority].append(waiter)
        try:
            done, _ = await asyncio.wait({waiter.future}, timeout=limits.max_wait_s)
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        if not done:
            self._abandon(waiter)
            raise self._overloaded(f"waited {limits.max_wait_s:g}s in the {priority} queue", "queue_timeout")
        return Admission(priority, self._clock() - waiter.enqueued_at)

    def release(self) -> None:
        """Give a slot back; it goes straight to the next waiter, if any."""
        self._in_flight -= 1
        while self._in_flight < self._config.max_in_flight:
            waiter = self._next_waiter()
            if waiter is None:
                return
            self._in_flight += 1
            waiter.future.set_result(None)

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiter leaves (timeout, disconnect); a slot granted meanwhile is passed on."""
        granted = waiter.future.done() and not waiter.future.cancelled()
        if not waiter.future.done():
            waiter.future.cancel()
        with suppress(ValueError):
            self._queues[waiter.priority].remove(waiter)
        if granted:
            self.release()

    def _next_waiter(self) -> _Waiter | None:
        for q in self._queues.values():
            while q and q[0].future.done():
                q.popleft()  # abandoned
        interactive, batch = self._queues["interactive"], self._queues["batch"]
        aging = self._config.batch_aging_s
        if batch and aging is not None and self._clock() - batch[0].enqueued_at >= aging:
            return batch.popleft()
        if interactive:
            return interactive.popleft()
        if batch:
            return batch.popleft()
        return None

    def _overloaded(self, message: str, reason: str) -> APIError:
        return unavailable(f"server overloaded: {message}; retry later", "overloaded", self._config.retry_after_s, reason)
