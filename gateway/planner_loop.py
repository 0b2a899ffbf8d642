"""The planner inside the gateway (`pdserve gateway --planner flip|replicas --slo ...`).

It runs in the gateway because the gateway already holds every signal the decision
reads (the registry's heartbeated load, its own TTFT/ITL histograms) and the admin
path that flips a worker; a separate process would only scrape and re-post them.

Every `interval_s` it builds a `LoadSample` (gateway/planner.py) from the routable
pools, the queued prefill tokens, the decode workers' mean KV usage, the p90 of the
TTFT observations of the last `window_s`, and the inter-token latency the decode
workers' heartbeats imply (running sequences / tokens decoded per second), and asks
`decide()`. It publishes

- `llm_planner_desired_workers{role}`: the split it wants (what the deploy/ HPA and
  KEDA objects scale the prefill and decode Deployments to),
- `llm_planner_pressure{role}`: the two pressures (1.0 = at the SLO),
- `llm_planner_decisions_total{action}`: flips decided (`to_prefill`, `to_decode`).

In `flip` mode it also flips a worker through `RoleFlips.request` (the admin path):
the decode worker with the fewest running sequences, or the prefill worker with the
fewest queued tokens, so the drain is short. While a flip is under way (or, in
`replicas` mode, until the pools show the published split, for at most `converge_s`)
it decides nothing: the pools are one short and the signals stale.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Iterable

from aiohttp import web
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.admin_roles import FlipCollector, RoleFlips, add_admin_routes
from gateway.control_plane import ControlPlane
from gateway.planner import Action, Decision, LoadSample, PlannerSettings, PlannerState, decide
from gateway.registry import WorkerInfo, WorkerRegistry
from gateway.state import STATE
from pdserve.common.roles import Role

log = logging.getLogger(__name__)

class HistogramWindow:
    """A quantile of what a cumulative Prometheus histogram saw in the last `window_s`
    (bucket counts now minus those `window_s` ago; the answer is a bucket's upper bound)."""

    def __init__(self, hist: Histogram, window_s: float) -> None:
        self.hist = hist
        self.window_s = window_s
        self._history: collections.deque[tuple[float, list[tuple[float, float]]]] = collections.deque()

    def _buckets(self) -> list[tuple[float, float]]:
        out = []
        for metric in self.hist.collect():
            for s in metric.samples:
                if s.name.endswith("_bucket"):
                    out.append((float(s.labels["le"]), float(s.value)))
        return sorted(out)

    def quantile(self, q: float, now: float) -> float | None:
        current = self._buckets()
        self._history.append((now, current))
        while len(self._history) > 1 and now - self._history[1][0] >= self.window_s:
            self._history.popleft()
        base = dict(self._history[0][1]) if len(self._history) > 1 else {}
        window = [(le, count - base.get(le, 0.0)) for le, count in current]
        total = window[-1][1] if window else 0.0
        if total <= 0:
            return None
        finite = [le for le, _ in window if le != float("inf")]
        for le, count in window:
            if count >= q * total:
                return le if le != float("inf") else 2 * max(finite, default=1.0)
        return None


class PlannerLoop:
    def __init__(self, settings: PlannerSettings, registry: WorkerRegistry, flips: RoleFlips,
                 ttft: Histogram) -> None:
        self.settings = settings
        self.registry = registry
        self.flips = flips
        self._ttft = HistogramWindow(ttft, settings.window_s)
        self._itl: float | None = None  # smoothed over ticks
        self._decoded: dict[str, tuple[float, float]] = {}  # decode worker -> (time, tokens decoded)
        self.state = PlannerState()
        self.last: Decision | None = None
        self.decisions: dict[str, int] = {}
        # replicas mode: the split published last and when; held until the pools show it
        self._target: tuple[int, int, float] | None = None
        self._task: asyncio.Task[None] | None = None

    def sample(self, now: float) -> LoadSample:
        prefill, decode = self.registry.pool(Role.PREFILL), self.registry.pool(Role.DECODE)
        usage = [(w.reg.total_blocks - w.free_blocks) / max(w.reg.total_blocks, 1) for w in decode]
        q = self.settings.quantile
        return LoadSample(now, len(prefill), len(decode), sum(w.queued_tokens for w in prefill),
                          sum(usage) / len(usage) if usage else 0.0,
                          self._ttft.quantile(q, now), self._decode_itl(decode, now))

    def _decode_itl(self, decode: list[WorkerInfo], now: float) -> float | None:
        """Inter-token latency from the decode workers' heartbeats: running sequences over
        tokens decoded per second since the last tick (the worst worker), smoothed. Read
        from the workers rather than the gateway's per-request TPOT histogram, which a
        2-token request fills with its KV transfer time."""
        worst: float | None = None
        for w in decode:
            hb = w.load
            tokens = hb.gauges.get("llm_decode_tokens_count") if hb is not None else None
            if hb is None or tokens is None:
                continue
            prev = self._decoded.get(w.worker_id)
            self._decoded[w.worker_id] = (now, tokens)
            if prev is not None and tokens > prev[1] and hb.running_seqs > 0 and now > prev[0]:
                itl = hb.running_seqs * (now - prev[0]) / (tokens - prev[1])
                worst = itl if worst is None else max(worst, itl)
        if worst is None:  # no decoding: the last estimate fades
            self._itl = None if self._itl is None or self._itl < 1e-3 else self._itl * 0.5
        else:
            self._itl = worst if self._itl is None else 0.5 * self._itl + 0.5 * worst
        return self._itl

    def tick(self, now: float | None = None) -> Decision | None:
        now = time.monotonic() if now is None else now
        s = self.sample(now)
        if self._converging(s) or not (s.prefill_workers and s.decode_workers):
            self.state = PlannerState(last_flip=self.state.last_flip)
            return None
        decision = decide(s, self.state, self.settings.config)
        self.state, self.last = decision.state, decision
        if decision.action is not Action.HOLD:
            key = decision.action.value
            self.decisions[key] = self.decisions.get(key, 0) + 1
            log.info("planner: %s (%s)", key, decision.reason)
            if self.settings.mode == "flip":
                self._flip(decision.action)
            else:
                self._target = (decision.desired_prefill, decision.desired_decode, now)
        return decision

    def _converging(self, s: LoadSample) -> bool:
        """A flip under way, or (replicas mode) pools not yet at the published split; the
        autoscaler gets `converge_s` for that, then the planner starts from what it sees."""
        if self.flips.pending():
            return True
        if self._target is None:
            return False
        p, d, since = self._target
        if (s.prefill_workers, s.decode_workers) == (p, d) or s.t - since > self.settings.converge_s:
            self._target = None
            return False
        return True

    def _flip(self, action: Action) -> None:
        giver = Role.DECODE if action is Action.TO_PREFILL else Role.PREFILL
        pool = self.registry.pool(giver)
        if not pool:
            return
        w = min(pool, key=lambda w: (w.running if giver == Role.DECODE else w.queued_tokens, len(w.inflight)))
        result = self.flips.request(w.worker_id, Role.PREFILL if giver == Role.DECODE else Role.DECODE)
        if result.status != 202:
            log.warning("planner: flip of %s refused: %s", w.worker_id, result.message)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                self.tick()
            except Exception:  # the planner must never take the gateway down
                log.exception("planner tick failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class PlannerCollector(Collector):
    def __init__(self, loop: PlannerLoop) -> None:
        self.loop = loop

    def collect(self) -> Iterable[Metric]:
        last = self.loop.last
        desired = GaugeMetricFamily("llm_planner_desired_workers", "Workers per role the planner wants",
                                    labels=["role"])
        pressure = GaugeMetricFamily("llm_planner_pressure", "Planner load per role (1.0 = at the SLO)",
                                     labels=["role"])
        if last is not None:
            desired.add_metric(["prefill"], last.desired_prefill)
            desired.add_metric(["decode"], last.desired_decode)
            pressure.add_metric(["prefill"], last.pressures.prefill)
            pressure.add_metric(["decode"], last.pressures.decode)
        decisions = CounterMetricFamily("llm_planner_decisions", "Flips the planner decided", labels=["action"])
        for action in (Action.TO_PREFILL.value, Action.TO_DECODE.value):
            decisions.add_metric([action], self.loop.decisions.get(action, 0))
        yield from (desired, pressure, decisions)


def install_roles(app: web.Application) -> None:
    """The admin routes, the flip counter and (when configured) the planner, on a gateway
    app whose backend is a worker cluster (one with a `ControlPlane`)."""
    state = app[STATE]
    control = getattr(state.backend, "control", None)
    if not isinstance(control, ControlPlane):
        add_admin_routes(app, None)
        return
    flips = RoleFlips(control)
    add_admin_routes(app, flips)
    state.metrics.registry.register(FlipCollector(flips.control))
    settings = state.config.planner
    if settings is None:
        return
    loop = PlannerLoop(settings, flips.control.registry, flips, state.metrics.ttft)
    state.metrics.registry.register(PlannerCollector(loop))

    async def start(_: web.Application) -> None:
        loop.start()

    async def close(_: web.Application) -> None:
        await loop.close()

    app.on_startup.append(start)
    app.on_cleanup.insert(0, close)
