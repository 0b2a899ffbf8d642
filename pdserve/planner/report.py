"""What the P:D simulator (pdserve/planner/simulate.py) is asked about and what it reports:
the simulated cluster, per-request results, percentiles and goodput, the recommended
split and the table `pdserve plan --simulate` prints. `summarize` also turns measured
requests (bench/simulate_check.py) into the same figures."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.common.slo import Slo

TIE = 0.02  # goodputs this close are the same for `recommend`


@dataclass(frozen=True)
class Cluster:
    prefill_workers: int
    decode_workers: int
    handoff_s: float = 0.0  # fixed part of first token on prefill -> KV usable on decode
    kv_tokens: int | None = None  # KV pool of one decode worker; None: the profile's
    gateway_s: float = 0.0  # per request: HTTP, tokenizing, routing and the replies' way back
    local_prefill_threshold: int = 0  # uncached tokens a decode worker prefills itself; 0: off
    prefix_caching: bool = True  # the workers' prefix caches (`--no-prefix-caching`: False)
    cores: int | None = None  # cores the workers' steps share; None: one each

    def __post_init__(self) -> None:
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ValueError("a disaggregated cluster needs at least one prefill and one decode worker")
        if self.handoff_s < 0 or self.gateway_s < 0:
            raise ValueError("handoff_s and gateway_s must be >= 0")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0")
        if self.cores is not None and self.cores < 1:
            raise ValueError("cores must be >= 1")

    def speed(self, running: int) -> float:
        """Each of `running` steps' speed on `cores` shared by processor sharing,
        relative to the profile's (a step on a core of its own)."""
        if self.cores is None or running <= 0:
            return 1.0
        return min(1.0, self.cores / running)


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
