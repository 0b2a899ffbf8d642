"""Discrete-event simulator of a disaggregated cluster, for `pdserve plan --simulate`:
the gateway, P prefill workers and D decode workers, with step times from a hardware
profile (pdserve/sim_profile.py) and requests from a workload (pdserve/workload.py).
Pure Python, no I/O, deterministic.

Life of a simulated request:

1. Arrival: the gateway reserves KV for its prompt + output tokens (whole blocks) on
   the decode worker with the most free blocks that has room (ties: the lower
   index). If none has room it waits; waiting requests are admitted strictly in
   arrival order whenever a finishing request frees blocks.
2. Reserved: it joins the FCFS queue of the prefill worker with the fewest queued
   prompt tokens (ties: the lower index).
3. A prefill step takes the queue's requests in order up to `chunk_tokens` prompt
   tokens (a longer prompt is chunked and continues first in the next step) and lasts
   `PrefillFit.step_s`. A prompt whose last chunk is in the step has its first token
   at the step's end: TTFT = that time - arrival.
4. `handoff_s` later its KV is on the decode worker, where it waits for the next
   decode step (at most `max_num_seqs` run; the rest wait in order).
5. A decode step of B sequences holding C context tokens lasts `DecodeFit.step_s(B,
   C)`; each sequence gets one token at its end. One that reaches its output length
   finishes and frees its blocks, and step 1's admission runs again.

Reported per P:D split: TTFT and inter-token latency percentiles (nearest rank; ITL
over every token gap), and goodput = requests meeting both SLOs (common.slo.Slo) /
makespan (first arrival to last token).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from common.slo import Slo
from pdserve.sim_profile import Profile
from pdserve.workload import SimRequest

TIE = 0.02  # goodputs this close are the same for `recommend`


class SimulationError(ValueError):
    """A workload the simulated cluster can never serve (a request larger than a
    decode worker's whole KV pool)."""


@dataclass(frozen=True)
class Cluster:
    prefill_workers: int
    decode_workers: int
    handoff_s: float = 0.0  # first token on the prefill worker -> KV usable on the decode worker
    kv_tokens: int | None = None  # KV pool of one decode worker; None: the profile's

    def __post_init__(self) -> None:
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ValueError("a disaggregated cluster needs at least one prefill and one decode worker")
        if self.handoff_s < 0:
            raise ValueError("handoff_s must be >= 0")


class Percentiles(NamedTuple):
    p50: float
    p90: float
    p99: float


class RequestResult(NamedTuple):
    arrival: float
    ttft_s: float
    itl_s: float  # mean gap between tokens; 0 for a one-token output
    finish: float  # time of the last token


class SimResult(NamedTuple):
    cluster: Cluster
    requests: list[RequestResult]
    ttft: Percentiles
    itl: Percentiles
    met: int  # requests meeting both SLOs
    makespan_s: float
    goodput: float  # met / makespan, requests/s


def percentiles(values: Sequence[float]) -> Percentiles:
    if not values:
        return Percentiles(0.0, 0.0, 0.0)
    xs = sorted(values)

    def rank(q: float) -> float:
        return xs[max(0, math.ceil(q / 100 * len(xs)) - 1)]
    return Percentiles(rank(50), rank(90), rank(99))


@dataclass
class _Req:
    req: SimRequest
    blocks: int
    computed: int = 0  # prompt tokens prefilled
    tokens: int = 0  # output tokens so far (the first comes from prefill)
    first: float = 0.0
    last: float = 0.0
    gaps: list[float] = field(default_factory=list)
    decode: int = -1

    @property
    def left(self) -> int:
        return self.req.prompt_tokens - self.computed


@dataclass
class _Prefill:
    queue: deque[_Req] = field(default_factory=deque)
    busy: bool = False

    @property
    def queued_tokens(self) -> int:
        return sum(r.left for r in self.queue)


@dataclass
class _Decode:
    free_blocks: int
    waiting: deque[_Req] = field(default_factory=deque)
    running: list[_Req] = field(default_factory=list)
    busy: bool = False


class _Sim:
    def __init__(self, profile: Profile, cluster: Cluster) -> None:
        self.p = profile
        self.c = cluster
        kv_blocks = (cluster.kv_tokens or profile.kv_capacity_tokens) // profile.block_size
        self.prefills = [_Prefill() for _ in range(cluster.prefill_workers)]
        self.decodes = [_Decode(kv_blocks) for _ in range(cluster.decode_workers)]
        self.capacity = kv_blocks
        self.admission: deque[_Req] = deque()
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.now = 0.0
        self._seq = itertools.count()
        self.done: list[_Req] = []

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.events, (t, next(self._seq), fn))

    def run(self, requests: Sequence[SimRequest]) -> list[_Req]:
        for req in requests:
            r = _Req(req, math.ceil((req.prompt_tokens + req.output_tokens) / self.p.block_size))
            if r.blocks > self.capacity:
                raise SimulationError(f"a request of {req.prompt_tokens}+{req.output_tokens} tokens needs "
                                      f"{r.blocks} KV blocks; a decode worker holds {self.capacity}")
            self.at(req.arrival, partial(self.arrive, r))
        while self.events:
            self.now, _, fn = heapq.heappop(self.events)
            fn()
        return self.done

    # 1-2: admission and routing
    def arrive(self, r: _Req) -> None:
        self.admission.append(r)
        self.admit()

    def admit(self) -> None:
        while self.admission:
            r = self.admission[0]
            d = max(range(len(self.decodes)), key=lambda i: (self.decodes[i].free_blocks, -i))
            if self.decodes[d].free_blocks < r.blocks:
                return
            self.admission.popleft()
            self.decodes[d].free_blocks -= r.blocks
            r.decode = d
            w = min(range(len(self.prefills)), key=lambda i: (self.prefills[i].queued_tokens, i))
            self.prefills[w].queue.append(r)
            if not self.prefills[w].busy:
                self.prefill_step(w)

    # 3: prefill
    def prefill_step(self, w: int) -> None:
        worker = self.prefills[w]
        chunks: list[tuple[_Req, int]] = []
        budget = self.p.chunk_tokens
        for r in worker.queue:
            if budget == 0:
                break
            m = min(r.left, budget)
            chunks.append((r, m))
            budget -= m
        if not chunks:
            worker.busy = False
            return
        worker.busy = True
        dt = self.p.prefill.step_s([(r.computed, m) for r, m in chunks])
        self.at(self.now + dt, lambda: self.prefill_done(w, chunks))

    def prefill_done(self, w: int, chunks: list[tuple[_Req, int]]) -> None:
        for r, m in chunks:
            r.computed += m
            if r.left == 0:
                self.prefills[w].queue.remove(r)
                r.first = r.last = self.now
                r.tokens = 1
                if r.tokens == r.req.output_tokens:
                    self.finish(r)
                else:
                    self.at(self.now + self.c.handoff_s, partial(self.handed_off, r))
        self.prefill_step(w)

    # 4-5: decode
    def handed_off(self, r: _Req) -> None:
        d = self.decodes[r.decode]
        d.waiting.append(r)
        if not d.busy:
            self.decode_step(r.decode)

    def decode_step(self, i: int) -> None:
        d = self.decodes[i]
        while d.waiting and len(d.running) < self.p.max_num_seqs:
            d.running.append(d.waiting.popleft())
        if not d.running:
            d.busy = False
            return
        d.busy = True
        context = sum(r.req.prompt_tokens + r.tokens for r in d.running)
        self.at(self.now + self.p.decode.step_s(len(d.running), context), lambda: self.decode_done(i))

    def decode_done(self, i: int) -> None:
        d = self.decodes[i]
        for r in list(d.running):
            r.tokens += 1
            r.gaps.append(self.now - r.last)
            r.last = self.now
            if r.tokens == r.req.output_tokens:
                d.running.remove(r)
                self.finish(r)
        self.decode_step(i)

    def finish(self, r: _Req) -> None:
        self.decodes[r.decode].free_blocks += r.blocks
        self.done.append(r)
        self.admit()


def simulate(profile: Profile, cluster: Cluster, requests: Sequence[SimRequest], slo: Slo) -> SimResult:
    """Run `requests` through `cluster` to the last token (module docstring)."""
    done = sorted(_Sim(profile, cluster).run(requests), key=lambda r: r.req.arrival)
    results = [RequestResult(r.req.arrival, r.first - r.req.arrival,
                             (r.last - r.first) / (r.tokens - 1) if r.tokens > 1 else 0.0, r.last) for r in done]
    return summarize(cluster, results, slo)


def summarize(cluster: Cluster, results: list[RequestResult], slo: Slo,
              gaps: Sequence[float] | None = None) -> SimResult:
    """Percentiles and goodput of finished requests (also used on measured ones).
    `gaps`: every inter-token gap; None: each request's mean gap stands for its gaps."""
    met = sum(slo.met(r.ttft_s, r.itl_s) for r in results)
    start = min((r.arrival for r in results), default=0.0)
    makespan = max((r.finish for r in results), default=0.0) - start
    itl = percentiles(gaps if gaps is not None else [r.itl_s for r in results if r.itl_s > 0])
    return SimResult(cluster, results, percentiles([r.ttft_s for r in results]), itl, met, makespan,
                     met / makespan if makespan > 0 else 0.0)


def simulate_splits(profile: Profile, workers: int, requests: Sequence[SimRequest], slo: Slo,
                    handoff_s: float = 0.0, kv_tokens: int | None = None) -> list[SimResult]:
    """Every P:D split of `workers` (P = 1 .. workers - 1)."""
    if workers < 2:
        raise ValueError("a P:D split needs at least 2 workers")
    return [simulate(profile, Cluster(p, workers - p, handoff_s, kv_tokens), requests, slo)
            for p in range(1, workers)]


def recommend(results: Sequence[SimResult], slo: Slo) -> SimResult:
    """The split of highest goodput; splits within `TIE` of it count as tied (goodput
    of a workload every split keeps up with is its arrival rate, give or take the
    last request), and the tie goes to more requests meeting the SLOs, then the most
    headroom: the least p90 TTFT / SLO + p90 ITL / SLO, then fewer prefill workers."""
    top = max(r.goodput for r in results)
    tied = [r for r in results if r.goodput >= top * (1 - TIE)]
    return min(tied, key=lambda r: (-r.met, r.ttft.p90 / slo.ttft_s + r.itl.p90 / slo.itl_s,
                                    r.cluster.prefill_workers))


def format_results(results: Sequence[SimResult], slo: Slo) -> str:
    best = recommend(results, slo)
    lines = [f"SLO: TTFT <= {slo.ttft_s * 1000:g} ms, ITL <= {slo.itl_s * 1000:g} ms",
             f"{'P:D':>5} {'TTFT p50/p90/p99 ms':>24} {'ITL p50/p90/p99 ms':>22} {'met':>9} {'goodput req/s':>14}"]
    for r in results:
        c = r.cluster
        lines.append(f"{c.prefill_workers:>2}:{c.decode_workers:<2} "
                     f"{_ms(r.ttft):>24} {_ms(r.itl):>22} {r.met:>4}/{len(r.requests):<4} {r.goodput:>14.3f}"
                     + ("  <- recommended" if r is best else ""))
    return "\n".join(lines)


def _ms(p: Percentiles) -> str:
    return f"{p.p50 * 1000:.0f}/{p.p90 * 1000:.0f}/{p.p99 * 1000:.0f}"
