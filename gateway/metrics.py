"""Gateway Prometheus metrics, on a per-app `CollectorRegistry` (no process-global state).

Request-level histograms and counters are observed by the request handlers; queue
depth and in-flight counts are read from the admission controller at scrape time, and
the fleet's worker gauges (`llm_current_batch_size{role,worker}`,
`llm_kv_cache_usage_ratio{role,worker}`, ...) are re-exported from
`GenerationBackend.fleet_metrics()` at scrape time, so one scrape sees the fleet.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.admission import AdmissionController
from gateway.backend import PRIORITIES, GenerationBackend

log = logging.getLogger("pdserve.gateway")

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
STAGE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    """All gateway metrics of one app."""

    def __init__(self, admission: AdmissionController, backend: GenerationBackend) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.ttft = Histogram(
            "llm_time_to_first_token_seconds", "Time from request arrival to the first output token.",
            buckets=TTFT_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "llm_time_per_output_token_seconds", "Mean time per output token after the first, per request.",
            buckets=TPOT_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "llm_e2e_request_latency_seconds", "Time from request arrival to its last byte.",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.queue_wait = Histogram(
            "llm_queue_wait_seconds", "Time a request waited for admission.", ["priority"],
            buckets=STAGE_BUCKETS, registry=r,
        )
        self.stage = Histogram(
            "llm_request_stage_seconds", "Time per request spent in each stage.", ["stage"],
            buckets=STAGE_BUCKETS, registry=r,
        )
        self.rejected = Counter(
            "llm_requests_rejected", "Requests rejected, by reason.", ["reason"], registry=r
        )
        self.requests = Counter(
            "llm_requests", "Finished requests by endpoint and HTTP status.", ["endpoint", "status"], registry=r
        )
        self.connections_dropped = Counter(
            "llm_connections_dropped", "Client connections the gateway cut: refused past the cap, "
            "or a stalled reader (gateway/connections.py).", ["reason"], registry=r
        )
        self.prompt_tokens = Counter("llm_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("llm_generation_tokens", "Output tokens generated.", registry=r)
        self.cached_tokens = Counter("llm_prompt_cached_tokens", "Prompt tokens served from the prefix cache.", registry=r)
        r.register(_StateCollector(admission, backend))

    def observe_stages(self, timings: Mapping[str, float]) -> None:
        for stage, seconds in timings.items():
            if stage != "e2e":
                self.stage.labels(stage=stage).observe(max(seconds, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Gauges read at scrape time: admission state and the backend's fleet gauges."""

    def __init__(self, admission: AdmissionController, backend: GenerationBackend) -> None:
        self._admission = admission
        self._backend = backend

    def collect(self) -> Iterable[Metric]:
        depth = GaugeMetricFamily("llm_queue_depth", "Requests waiting for admission.", labels=["priority"])
        for p in PRIORITIES:
            depth.add_metric([p], self._admission.depth(p))
        yield depth
        yield GaugeMetricFamily(
            "llm_requests_in_flight", "Requests admitted to the backend and not finished.",
            value=self._admission.in_flight,
        )
        yield from self._fleet()

    def _fleet(self) -> Iterable[Metric]:
        try:
            samples = list(self._backend.fleet_metrics())
        except Exception:  # a scrape must never fail because the registry hiccuped
            log.exception("fleet_metrics failed")
            return
        families: dict[str, GaugeMetricFamily] = {}
        for s in samples:
            fam = families.get(s.name)
            if fam is None:
                fam = families[s.name] = GaugeMetricFamily(s.name, s.documentation, labels=sorted(s.labels))
            fam.add_metric([s.labels[k] for k in sorted(s.labels)], s.value)
        yield from families.values()
