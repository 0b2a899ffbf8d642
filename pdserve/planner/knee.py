"""The arrival rate at which a P:D split stops keeping up with a workload (its knee),
from a hardware profile, so that a check can load each split near but not past it.

    knee = min(prefill knee, decode knee, gateway knee, cores knee)

- Prefill: P workers each computing one request's uncached prompt in `S` seconds on
  average (`PrefillFit.step_s` over the prompt less the shared prefix blocks a warm
  prefix cache serves) are saturated at P / S requests/s.
- Decode: a decode step of B sequences takes `DecodeFit.step_s(B, B x C)` (C: mean
  prompt + half the output); the most sequences a worker can run within the ITL SLO
  is B* = (itl - c0) / (per_seq + per_ctx_token x C), at most `max_num_seqs`. By
  Little's law B* = rate / D x (output - 1) x itl, so D x B* / ((output - 1) x itl).
- Gateway: one process spending `gateway_s` per request: 1 / gateway_s.
- Cores (`cores` set): every request costs its gateway time, its prefill `S` and its
  decode steps' marginal work, (output - 1) x (per_seq + per_ctx_token x C); the
  P + D + 1 processes together do k x `Cluster.speed(k)` of it per second (k = P + D + 1).

Queueing makes TTFT climb before the prefill knee (at 0.8 of it an M/D/1 queue already
waits twice the service time), so "near the knee" is a fraction of it, stated by the
caller. Local prefill is not counted (its prompts would load the decode side).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from pdserve.common.slo import Slo
from pdserve.planner.profile import Profile
from pdserve.planner.report import Cluster
from pdserve.planner.workload import SimRequest


class Knee(NamedTuple):
    rate: float  # requests/s: the least of the three
    prefill: float
    decode: float
    gateway: float
    cores: float = math.inf

    @property
    def bound(self) -> str:
        """Which pool the knee comes from."""
        return min((self.prefill, "prefill"), (self.decode, "decode"), (self.gateway, "gateway"),
                   (self.cores, "cores"))[1]


def knee(profile: Profile, cluster: Cluster, requests: Sequence[SimRequest], slo: Slo) -> Knee:
    if not requests:
        raise ValueError("a knee needs at least one request")
    n, bs = len(requests), profile.block_size

    def uncached_s(r: SimRequest) -> float:
        hit = min(r.prefix_tokens // bs, (r.prompt_tokens - 1) // bs) * bs if cluster.prefix_caching else 0
        return profile.prefill.step_s([(hit, r.prompt_tokens - hit)])
    prefill_s = sum(uncached_s(r) for r in requests)
    prefill = cluster.prefill_workers * n / prefill_s

    d = profile.decode
    steps = sum(r.output_tokens - 1 for r in requests) / n
    context = sum(r.prompt_tokens + r.output_tokens / 2 for r in requests) / n
    per_seq = d.per_seq + d.per_ctx_token * context
    room = slo.itl_s - d.c0
    if room <= 0:
        decode = 0.0  # not even one sequence steps within the ITL SLO
    else:
        most = min(float(profile.max_num_seqs), room / per_seq if per_seq > 0 else math.inf)
        decode = cluster.decode_workers * most / (steps * slo.itl_s) if steps > 0 else math.inf
    gateway = 1 / cluster.gateway_s if cluster.gateway_s > 0 else math.inf
    cores = math.inf
    if cluster.cores is not None:
        decode_s = sum((r.output_tokens - 1) * (d.per_seq + d.per_ctx_token * (r.prompt_tokens + r.output_tokens / 2))
                       for r in requests)
        k = cluster.prefill_workers + cluster.decode_workers + 1
        cores = k * cluster.speed(k) * n / (prefill_s + decode_s + n * cluster.gateway_s)
    return Knee(min(prefill, decode, gateway, cores), prefill, decode, gateway, cores)
