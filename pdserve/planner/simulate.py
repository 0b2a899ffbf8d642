"""Discrete-event simulator of a disaggregated cluster, for `pdserve plan --simulate`:
the gateway, P prefill workers and D decode workers, with step times from a hardware
profile (pdserve/planner/profile.py) and requests from a workload (pdserve/planner/workload.py).
Pure Python, no I/O, deterministic. It models what the real system does
(gateway/cluster.py, gateway/kv_router.py, pdserve/engine/core/scheduler.py):

1. Arrival: the gateway (one process) serves arrivals one at a time, FIFO, `gateway_s`
   each (HTTP, routing, its messages; a step of its own on the cores, 7); then it
   reserves KV for prompt + output tokens (whole blocks) on the decode worker
   with the most free blocks that has room (ties: the lower index). If none has room
   it waits; waiting requests are admitted strictly in arrival order whenever a
   finishing request frees blocks.
2. Local prefill (`local_prefill_threshold` > 0): a request of which at most that many
   prompt tokens are missing from that decode worker's prefix cache is prefilled there
   (step 6) and never ships KV. Otherwise it joins the FCFS queue of the prefill
   worker of least `uncached prompt tokens + queued prompt tokens` (the kv-aware
   router's cost; ties: the lower index).
3. Prefix cache (`prefix_caching`): a workload's requests share their first
   `prefix_tokens` (pdserve/planner/workload.py). A worker holds the prefix's full blocks once
   a step that computed them has ended (no eviction: the pool is taken to be large).
   When a request's first chunk is scheduled, the blocks its worker holds are
   computed already (never the prompt's last token: pdserve/common/block_hash.py).
4. A prefill step takes the queue's requests in order up to `chunk_tokens` prompt
   tokens (a longer prompt is chunked and continues first in the next step) and lasts
   `PrefillFit.step_s`. A prompt whose last chunk is in the step has its first token
   at the step's end: TTFT = that time - arrival.
5. Handoff: `handoff_s + kv_copy_s_per_token x shipped tokens` later its KV is on the
   decode worker (shipped: the prompt less the prefix blocks the decode worker held at
   reservation, the suffix-only handoff), where it waits for the next decode step (at
   most `max_num_seqs` run, local prefills included; the rest wait in order).
6. A decode step of B decoding sequences holding C context tokens lasts
   `DecodeFit.step_s(B, C)`; each gets one token at its end. Local prefills running
   there take the step's leftover token budget (`chunk_tokens - B`) in chunks, FCFS,
   adding their `PrefillFit` chunk cost (without its per-step `c0` when the step also
   decodes); a prompt whose last chunk is in the step has its first token at its end.
   A sequence that reaches its output length finishes and frees its blocks, and step
   1's admission runs again.
7. Cores (`cores`, None: every worker has its own): the steps running at once share
   them (processor sharing: each runs at `Cluster.speed(running steps)` = min(1,
   cores / running) of the profile's speed, their ends re-planned whenever a step
   starts or ends), as unpinned workers share a host's cores under the kernel's
   scheduler. Not modelled: other load on the machine (the profile's step times carry
   whatever it was then), the clients' CPU, the gateway's per-token work, and a 1P+1D
   pair running on each other's idle cores (pdserve/worker/core_sharing.py).

Reported per P:D split (pdserve/planner/report.py): TTFT and inter-token latency
percentiles (nearest rank; ITL over every token gap), and goodput = requests meeting
both SLOs (pdserve.common.slo.Slo) / makespan (first arrival to last token). Not modelled: KV
eviction, several decode workers' kv-aware choice (the most free blocks is used),
preemption, and the lag of the gateway's KV index behind the workers' caches.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from pdserve.common.slo import Slo
from pdserve.planner.profile import Profile
from pdserve.planner.report import (
    TIE,
    Cluster,
    Percentiles,
    RequestResult,
    SimResult,
    format_results,
    percentiles,
    recommend,
    summarize,
)
from pdserve.planner.workload import SimRequest

__all__ = ["TIE", "Cluster", "Percentiles", "RequestResult", "SimResult", "SimulationError", "format_results",
           "percentiles", "recommend", "simulate", "simulate_splits", "summarize"]


class SimulationError(ValueError):
    """A workload the simulated cluster can never serve (a request larger than a
    decode worker's whole KV pool)."""


@dataclass
class _Req:
    req: SimRequest
    blocks: int
    computed: int = 0  # prompt tokens prefilled (or found in a prefix cache)
    looked_up: bool = False  # its worker's prefix cache was consulted (first chunk)
    local: bool = False  # prefilled on its decode worker
    shipped: int = 0  # prompt tokens whose KV the handoff copies
    tokens: int = 0  # output tokens so far (the first comes from prefill)
    first: float = 0.0
    last: float = 0.0
    decode: int = -1

    @property
    def left(self) -> int:
        return self.req.prompt_tokens - self.computed


@dataclass
class _Worker:
    held_prefix_blocks: int = 0  # leading blocks of the workload's shared prefix cached here
    busy: bool = False


@dataclass
class _Prefill(_Worker):
    queue: deque[_Req] = field(default_factory=deque)

    @property
    def queued_tokens(self) -> int:
        return sum(r.left for r in self.queue)


@dataclass
class _Decode(_Worker):
    free_blocks: int = 0
    waiting: deque[_Req] = field(default_factory=deque)
    running: list[_Req] = field(default_factory=list)


@dataclass
class _Step:
    left_s: float  # work left, in seconds of a core of its own
    done: Callable[[], None]
    version: int = 0  # its end event is the one scheduled with this version


class _Sim:
    def __init__(self, profile: Profile, cluster: Cluster) -> None:
        self.p = profile
        self.c = cluster
        kv_blocks = (cluster.kv_tokens or profile.kv_capacity_tokens) // profile.block_size
        self.prefills = [_Prefill() for _ in range(cluster.prefill_workers)]
        self.decodes = [_Decode(free_blocks=kv_blocks) for _ in range(cluster.decode_workers)]
        self.capacity = kv_blocks
        self.admission: deque[_Req] = deque()
        self.gateway: deque[_Req] = deque()  # at the gateway, the first being served
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.now = 0.0
        self._seq = itertools.count()
        self.done: list[_Req] = []
        self.steps: list[_Step] = []  # steps running now (with `cores`)
        self.settled = 0.0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.events, (t, next(self._seq), fn))

    # 7: steps share the cores
    def run_step(self, work_s: float, done: Callable[[], None]) -> None:
        """A step of `work_s` seconds on a core of its own; `done` at its end."""
        if self.c.cores is None:
            self.at(self.now + work_s, done)
            return
        self.settle()
        self.steps.append(_Step(work_s, done))
        self.reschedule()

    def rate(self) -> float:
        return self.c.speed(len(self.steps))

    def settle(self) -> None:
        """Charge the time since the last change to every running step."""
        done = (self.now - self.settled) * self.rate()
        for step in self.steps:
            step.left_s -= done
        self.settled = self.now

    def reschedule(self) -> None:
        rate = self.rate()
        for step in self.steps:
            step.version += 1
            self.at(self.now + max(0.0, step.left_s) / rate, partial(self.step_ended, step, step.version))

    def step_ended(self, step: _Step, version: int) -> None:
        if version != step.version:
            return  # rescheduled since
        self.settle()
        self.steps.remove(step)
        self.reschedule()
        step.done()

    def run(self, requests: Sequence[SimRequest]) -> list[_Req]:
        for req in requests:
            r = _Req(req, math.ceil((req.prompt_tokens + req.output_tokens) / self.p.block_size))
            if r.blocks > self.capacity:
                raise SimulationError(f"a request of {req.prompt_tokens}+{req.output_tokens} tokens needs "
                                      f"{r.blocks} KV blocks; a decode worker holds {self.capacity}")
            self.at(req.arrival, partial(self.at_gateway, r))
        while self.events:
            self.now, _, fn = heapq.heappop(self.events)
            fn()
        return self.done

    # 3: the shared prefix in the workers' caches
    def hit_tokens(self, worker: _Worker, r: _Req) -> int:
        """Prompt tokens `worker`'s prefix cache serves `r` now."""
        if not self.c.prefix_caching:
            return 0
        bs = self.p.block_size
        blocks = min(worker.held_prefix_blocks, r.req.prefix_tokens // bs, (r.req.prompt_tokens - 1) // bs)
        return max(0, blocks) * bs

    def look_up(self, worker: _Worker, r: _Req) -> None:
        if not r.looked_up:
            r.looked_up = True
            r.computed = max(r.computed, self.hit_tokens(worker, r))

    def computed_prefix(self, worker: _Worker, r: _Req) -> None:
        if self.c.prefix_caching:
            full = min(r.computed, r.req.prefix_tokens) // self.p.block_size
            worker.held_prefix_blocks = max(worker.held_prefix_blocks, full)

    # 1-2: admission and routing
    def at_gateway(self, r: _Req) -> None:
        self.gateway.append(r)
        if len(self.gateway) == 1:
            self.gateway_step()

    def gateway_step(self) -> None:
        if not self.gateway:
            return
        if self.c.gateway_s <= 0:
            self.gateway_done()
            return
        self.run_step(self.c.gateway_s, self.gateway_done)

    def gateway_done(self) -> None:
        self.arrive(self.gateway.popleft())
        self.gateway_step()

    def arrive(self, r: _Req) -> None:
        self.admission.append(r)
        self.admit()

    def admit(self) -> None:
        while self.admission:
            r = self.admission[0]
            d = max(range(len(self.decodes)), key=lambda i: (self.decodes[i].free_blocks, -i))
            decode = self.decodes[d]
            if decode.free_blocks < r.blocks:
                return
            self.admission.popleft()
            decode.free_blocks -= r.blocks
            r.decode = d
            held = self.hit_tokens(decode, r)
            threshold = self.c.local_prefill_threshold
            if threshold and r.req.prompt_tokens - held <= threshold:
                r.local = True
                decode.waiting.append(r)
                if not decode.busy:
                    self.decode_step(d)
                continue
            r.shipped = r.req.prompt_tokens - held
            w = min(range(len(self.prefills)), key=lambda i: (
                r.req.prompt_tokens - self.hit_tokens(self.prefills[i], r) + self.prefills[i].queued_tokens, i))
            self.prefills[w].queue.append(r)
            if not self.prefills[w].busy:
                self.prefill_step(w)

    # 4: prefill
    def prefill_step(self, w: int) -> None:
        worker = self.prefills[w]
        chunks = self.take_chunks(worker, worker.queue, self.p.chunk_tokens)
        if not chunks:
            worker.busy = False
            return
        worker.busy = True
        dt = self.p.prefill.step_s([(r.computed, m) for r, m in chunks])
        self.run_step(dt, lambda: self.prefill_done(w, chunks))

    def take_chunks(self, worker: _Worker, queue: Sequence[_Req], budget: int) -> list[tuple[_Req, int]]:
        """FCFS chunks of `queue`'s prompts within `budget` tokens (a prefix-cache lookup first)."""
        chunks: list[tuple[_Req, int]] = []
        for r in queue:
            if budget <= 0:
                break
            self.look_up(worker, r)
            m = min(r.left, budget)
            if m > 0:
                chunks.append((r, m))
                budget -= m
        return chunks

    def prefill_done(self, w: int, chunks: list[tuple[_Req, int]]) -> None:
        worker = self.prefills[w]
        for r, m in chunks:
            r.computed += m
            self.computed_prefix(worker, r)
            if r.left == 0:
                worker.queue.remove(r)
                if self.first_token(r):
                    handoff = self.c.handoff_s + self.p.kv_copy_s_per_token * r.shipped
                    self.at(self.now + handoff, partial(self.handed_off, r))
        self.prefill_step(w)

    def first_token(self, r: _Req) -> bool:
        """The prompt is done: its first token now. False: that was its only token."""
        r.first = r.last = self.now
        r.tokens = 1
        if r.tokens == r.req.output_tokens:
            self.finish(r)
            return False
        return True

    # 5-6: decode
    def handed_off(self, r: _Req) -> None:
        d = self.decodes[r.decode]
        d.held_prefix_blocks = max(d.held_prefix_blocks, min(r.req.prefix_tokens, r.req.prompt_tokens)
                                   // self.p.block_size if self.c.prefix_caching else 0)
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
        decoding = [r for r in d.running if r.left == 0]
        prefilling = [r for r in d.running if r.left > 0]
        chunks = self.take_chunks(d, prefilling, self.p.chunk_tokens - len(decoding))
        dt = 0.0
        if decoding:
            context = sum(r.req.prompt_tokens + r.tokens for r in decoding)
            dt = self.p.decode.step_s(len(decoding), context)
        if chunks:
            dt += self.p.prefill.step_s([(r.computed, m) for r, m in chunks]) - (self.p.prefill.c0 if decoding else 0)
        self.run_step(dt, lambda: self.decode_done(i, decoding, chunks))

    def decode_done(self, i: int, decoding: list[_Req], chunks: list[tuple[_Req, int]]) -> None:
        d = self.decodes[i]
        for r in decoding:
            r.tokens += 1
            r.last = self.now
            if r.tokens == r.req.output_tokens:
                d.running.remove(r)
                self.finish(r)
        for r, m in chunks:
            r.computed += m
            self.computed_prefix(d, r)
            if r.left == 0 and not self.first_token(r):
                d.running.remove(r)
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


def simulate_splits(profile: Profile, workers: int, requests: Sequence[SimRequest], slo: Slo,
                    handoff_s: float = 0.0, kv_tokens: int | None = None,
                    template: Cluster | None = None) -> list[SimResult]:
    """Every P:D split of `workers` (P = 1 .. workers - 1); `template` gives the rest of
    each split's Cluster (gateway time, local prefill, prefix caching)."""
    if workers < 2:
        raise ValueError("a P:D split needs at least 2 workers")
    base = template or Cluster(1, 1)
    return [simulate(profile, replace(base, prefill_workers=p, decode_workers=workers - p, handoff_s=handoff_s,
                                      kv_tokens=kv_tokens), requests, slo)
            for p in range(1, workers)]
