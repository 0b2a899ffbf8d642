"""Load modes: closed loop at fixed concurrency, Poisson arrivals, a sweep of
concurrencies; plus the periodic long prompts of the mixed workload.

Every run is bounded twice: no request starts after `num_requests` have
started or `max_duration_s` has passed; requests still in flight then get
`drain_timeout_s` to finish and are cancelled after that (recorded as
`cancelled`, counted neither as completed nor as failed). Warm-up requests are
sent once before the first run, at the run's concurrency, and discarded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np

from pdserve.loadgen.client import StreamingClient, resolve_model
from pdserve.loadgen.config import BenchConfig, LoadMode
from pdserve.loadgen.metrics import summarize
from pdserve.loadgen.progress import ProgressBar
from pdserve.loadgen.prompts import TokenCounter
from pdserve.loadgen.records import RequestRecord, RequestSpec
from pdserve.loadgen.server_stats import SETTLE_S, scrape, spec_summary
from pdserve.loadgen.workloads import Workload


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One measured run (one concurrency of a sweep, or the whole benchmark)."""

    label: str
    concurrency: int | None
    request_rate: float | None
    started_at: str  # UTC wall clock, ISO 8601
    origin: float  # perf_counter at the start; record times are relative to it
    records: list[RequestRecord]
    summary: dict[str, Any]
    per_tag: dict[str, dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class BenchResult:
    config: BenchConfig
    model: str
    runs: list[RunResult]


class _Budget:
    """Shared start permission: count and deadline bounds of one run."""

    def __init__(self, num_requests: int, max_duration_s: float) -> None:
        self.left = num_requests
        self.deadline = time.perf_counter() + max_duration_s

    def take(self) -> bool:
        if self.left <= 0 or time.perf_counter() >= self.deadline:
            return False
        self.left -= 1
        return True


class _Run:
    """Bookkeeping of one run: its records (appended when a request starts)."""

    def __init__(self, client: StreamingClient, progress: ProgressBar | None) -> None:
        self.client = client
        self.progress = progress
        self.records: list[RequestRecord] = []

    async def one(self, spec: RequestSpec) -> None:
        rec = self.client.new_record(spec)
        self.records.append(rec)
        try:
            await self.client.send(spec, rec)
        except asyncio.CancelledError:
            # Stopped by the run's hard deadline: not the server's failure.
            rec.cancelled = True
            rec.end_time = time.perf_counter()
            raise
        if self.progress is not None:
            self.progress.advance(rec.ok)


async def _closed_loop(run: _Run, workload: Workload, concurrency: int, budget: _Budget) -> None:
    async def worker() -> None:
        while budget.take():
            await run.one(workload.next())

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))


async def _poisson(
    run: _Run, workload: Workload, rate: float, cap: int | None, budget: _Budget, seed: int
) -> None:
    rng = np.random.default_rng(seed + 2)
    sem = asyncio.Semaphore(cap) if cap else None
    tasks: list[asyncio.Task[None]] = []
    next_at = time.perf_counter()  # the first request goes at once

    async def limited(spec: RequestSpec) -> None:
        if sem is None:
            await run.one(spec)
            return
        async with sem:
            await run.one(spec)

    while True:
        delay = next_at - time.perf_counter()
        if next_at >= budget.deadline:
            break
        if delay > 0:
            await asyncio.sleep(delay)
        if not budget.take():
            break
        tasks.append(asyncio.create_task(limited(workload.next())))
        next_at += rng.exponential(1.0 / rate)
    await asyncio.gather(*tasks)


async def _long_prompts(run: _Run, workload: Workload, interval_s: float, budget: _Budget) -> None:
    """Mixed workload: one long prompt every `interval_s`, the first after one interval."""
    tasks: list[asyncio.Task[None]] = []
    next_at = time.perf_counter() + interval_s
    while next_at < budget.deadline:
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        if not budget.take():
            break
        tasks.append(asyncio.create_task(run.one(workload.next_long_prompt())))
        next_at += interval_s
    await asyncio.gather(*tasks)


async def _bounded(
    make: Callable[[], list[Awaitable[None]]], max_duration_s: float, drain_s: float
) -> None:
    """Run the load coroutines; cancel whatever is left after duration + drain."""
    tasks = [asyncio.ensure_future(c) for c in make()]
    _, pending = await asyncio.wait(tasks, timeout=max_duration_s + drain_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _measure(
    cfg: BenchConfig,
    client: StreamingClient,
    workload: Workload,
    label: str,
    concurrency: int | None,
) -> RunResult:
    load = cfg.load
    progress = ProgressBar(label, load.num_requests, load.max_duration_s, cfg.output.progress)
    run = _Run(client, progress)
    started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    origin = time.perf_counter()
    budget = _Budget(load.num_requests, load.max_duration_s)
    spec_before = await scrape(client.session, cfg.endpoint)

    def make() -> list[Awaitable[None]]:
        coros: list[Awaitable[None]] = []
        if concurrency is None:
            assert load.request_rate is not None
            coros.append(
                _poisson(
                    run,
                    workload,
                    load.request_rate,
                    load.max_concurrency,
                    budget,
                    cfg.workload.seed,
                )
            )
        else:
            coros.append(_closed_loop(run, workload, concurrency, budget))
        if workload.has_long_prompts:
            coros.append(
                _long_prompts(run, workload, cfg.workload.mixed.long_prompt_interval_s, budget)
            )
        return coros

    await _bounded(make, load.max_duration_s, load.drain_timeout_s)
    progress.close()
    records = run.records
    summary = summarize(records, cfg.slo)
    if spec_before is not None:  # the counters reach the gateway with the next heartbeats
        await asyncio.sleep(SETTLE_S)
        summary["spec_decode"] = spec_summary(spec_before, await scrape(client.session, cfg.endpoint))
    tags = sorted({r.tag for r in records})
    per_tag = (
        {
            t: summarize([r for r in records if r.tag == t], cfg.slo, summary["duration_s"])
            for t in tags
        }
        if len(tags) > 1
        else {}
    )
    return RunResult(
        label,
        concurrency,
        load.request_rate if concurrency is None else None,
        started_at,
        origin,
        records,
        summary,
        per_tag,
    )


async def _warmup(
    cfg: BenchConfig, client: StreamingClient, workload: Workload, concurrency: int
) -> None:
    if cfg.load.warmup <= 0:
        return
    run = _Run(client, None)
    budget = _Budget(cfg.load.warmup, cfg.load.max_duration_s)
    await _bounded(
        lambda: [_closed_loop(run, workload, concurrency, budget)],
        cfg.load.max_duration_s,
        cfg.load.drain_timeout_s,
    )


async def arun_benchmark(cfg: BenchConfig) -> BenchResult:
    """Run every measured run `cfg` describes and return raw records + summaries."""
    counter = TokenCounter(cfg.workload.tokenizer_dir) if cfg.workload.tokenizer_dir else None
    workload = Workload(cfg.workload, counter)
    load = cfg.load
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        model = await resolve_model(session, cfg.endpoint)
        client = StreamingClient(session, cfg.endpoint, model, counter)
        runs: list[RunResult] = []
        if load.mode is LoadMode.SWEEP:
            await _warmup(cfg, client, workload, load.sweep[0])
            for c in load.sweep:
                runs.append(await _measure(cfg, client, workload, f"c={c}", c))
        elif load.mode is LoadMode.POISSON:
            await _warmup(cfg, client, workload, load.max_concurrency or 1)
            runs.append(await _measure(cfg, client, workload, f"rate={load.request_rate}/s", None))
        else:
            await _warmup(cfg, client, workload, load.concurrency)
            runs.append(
                await _measure(cfg, client, workload, f"c={load.concurrency}", load.concurrency)
            )
    return BenchResult(cfg, model, runs)


def run_benchmark(cfg: BenchConfig) -> BenchResult:
    """Synchronous entry point for the CLI and the benchmark drivers."""
    return asyncio.run(arun_benchmark(cfg))
