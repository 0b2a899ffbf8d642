"""Metric formulas: pure functions from client-side timestamps to numbers.

Token-to-chunk rule (how a chunk carrying several tokens is spread):

* A request's output token count `n` is the server's `usage.completion_tokens`
  (one token per content chunk when the server reports no usage).
* Each content chunk `i` gets `k_i >= 1` tokens with `sum(k_i) = n`. The `n - C`
  extra tokens (C = number of chunks) are shared out by largest remainder in
  proportion to the client tokenizer's per-chunk estimate minus one when a
  tokenizer was given; otherwise evenly over chunks 1..C-1 (the first chunk
  comes out of prefill, which yields one token).
* The gap before chunk `i` (i >= 1) is divided evenly among its `k_i` tokens:
  `k_i` ITL samples of `gap_i / k_i` each. Tokens that shared the first chunk
  arrived together with the first token: `k_0 - 1` samples of 0.
* So every request contributes exactly `n - 1` ITL samples that sum to
  `t_last_chunk - t_first_chunk`; its mean ITL equals its TPOT up to the tail
  after the last content chunk (usage chunk, `[DONE]`).
* If the server reports fewer tokens than chunks (`n < C`), each chunk counts as
  one token for ITL (C - 1 raw gaps) and the request is counted in
  `requests_fewer_tokens_than_chunks`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pdserve.loadgen.config import SLOConfig
from pdserve.loadgen.records import RequestRecord

PERCENTILES = (50, 90, 95, 99)

LEGEND: dict[str, str] = {
    "ttft": "time to first token = t(first content chunk) - t(request sent), per request",
    "e2e": "end-to-end latency = t(stream end: [DONE] or close) - t(request sent)",
    "tpot": "time per output token = (e2e - ttft) / (output_tokens - 1), requests with >= 2 tokens",
    "itl": "inter-token latency: every gap between consecutive content chunks, a gap before a "
    "chunk of k tokens split into k samples of gap/k; tokens sharing the first chunk add "
    "k-1 samples of 0; n-1 samples per request (see pdserve/loadgen/metrics.py)",
    "output_tokens": "usage.completion_tokens reported by the server (else one per content chunk)",
    "prompt_tokens": "usage.prompt_tokens reported by the server (else the client's estimate)",
    "duration_s": "t(last counted request ended) - t(first counted request sent); warm-up and "
    "deadline-cancelled requests are not counted",
    "request_throughput": "completed requests / duration_s",
    "output_throughput": "sum(output_tokens) / duration_s over completed requests",
    "total_token_throughput": "sum(prompt_tokens + output_tokens) / duration_s",
    "prefill_throughput": "sum(prompt_tokens) / duration_s over completed requests",
    "prefill_rate_per_request": "prompt_tokens / ttft per completed request (stats; p50 is the "
    "typical single-request prefill speed, including queueing and network)",
    "decode_throughput": "sum(output_tokens - 1) / duration_s over completed requests",
    "decode_rate_per_stream": "sum(output_tokens - 1) / sum(e2e - ttft) over completed requests "
    "(one stream's decode speed, = 1 / token-weighted mean TPOT)",
    "goodput": "completed requests meeting every given SLO (ttft <= T, tpot <= T, max itl <= T, "
    "e2e <= T; tpot/itl of a 1-token request count as met) / duration_s",
    "failures": "failed requests by key: http_<status>, timeout, connection_error, "
    "stream_error, incomplete_stream, no_content",
    "percentiles": "linear interpolation between closest ranks (numpy 'linear'); latencies in s",
}


@dataclasses.dataclass(frozen=True)
class Stats:
    """Distribution summary of one metric (seconds for latencies)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    max: float | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def stats(values: Iterable[float]) -> Stats:
    """mean, p50, p90, p95, p99 and max; all None for no values."""
    arr = np.asarray(list(values), dtype=float)
    if arr.size == 0:
        return Stats(0, None, None, None, None, None, None)
    p = np.percentile(arr, PERCENTILES)
    return Stats(
        count=int(arr.size),
        mean=float(arr.mean()),
        p50=float(p[0]),
        p90=float(p[1]),
        p95=float(p[2]),
        p99=float(p[3]),
        max=float(arr.max()),
    )


def allocate_tokens(
    n_tokens: int, num_chunks: int, estimates: Sequence[int] | None = None
) -> list[int]:
    """Tokens per chunk, each >= 1, summing to `n_tokens` (needs n_tokens >= num_chunks).

    See the module docstring for the rule.
    """
    if num_chunks == 0:
        return []
    if n_tokens < num_chunks:
        raise ValueError(f"{n_tokens} tokens cannot fill {num_chunks} chunks")
    extra = n_tokens - num_chunks
    weights = [max(0, e - 1) for e in estimates] if estimates is not None else []
    if not weights or len(weights) != num_chunks or sum(weights) == 0:
        weights = [0] + [1] * (num_chunks - 1) if num_chunks > 1 else [1]
    total = sum(weights)
    shares = [extra * w / total for w in weights]
    alloc = [math.floor(s) for s in shares]
    # Largest remainder; ties go to the earlier chunk so the result is deterministic.
    order = sorted(range(num_chunks), key=lambda i: (-(shares[i] - alloc[i]), i))
    for i in order[: extra - sum(alloc)]:
        alloc[i] += 1
    return [1 + a for a in alloc]


def ttft(rec: RequestRecord) -> float | None:
    return rec.chunk_times[0] - rec.send_time if rec.chunk_times else None


def e2e(rec: RequestRecord) -> float | None:
    return None if rec.end_time is None else rec.end_time - rec.send_time


def tpot(rec: RequestRecord) -> float | None:
    """(e2e - ttft) / (n - 1); None for fewer than 2 tokens."""
    first, total, n = ttft(rec), e2e(rec), rec.output_tokens
    if first is None or total is None or n < 2:
        return None
    return (total - first) / (n - 1)


def itls(rec: RequestRecord) -> list[float]:
    """The request's inter-token latency samples (module docstring rule)."""
    times = rec.chunk_times
    if len(times) < 2 and rec.output_tokens <= 1:
        return []
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    n = rec.output_tokens
    if n < len(times):
        return gaps
    k = allocate_tokens(n, len(times), rec.chunk_token_est)
    out = [0.0] * (k[0] - 1)
    for gap, ki in zip(gaps, k[1:], strict=True):
        out.extend([gap / ki] * ki)
    return out


def meets_slo(rec: RequestRecord, slo: SLOConfig) -> bool:
    """A completed request meets the SLO only if it meets every given term."""
    if not rec.ok:
        return False
    # (limit, measured value, whether a missing value counts as met): a request
    # without a decode phase cannot miss tpot/itl; a missing ttft/e2e is a miss.
    checks = (
        (slo.ttft_s, ttft(rec), False),
        (slo.tpot_s, tpot(rec), True),
        (slo.itl_s, max(itls(rec), default=None), True),
        (slo.e2e_s, e2e(rec), False),
    )
    for limit, value, missing_ok in checks:
        if limit is None:
            continue
        if value is None:
            if missing_ok:
                continue
            return False
        if value > limit:
            return False
    return True


def run_duration(records: Sequence[RequestRecord]) -> float:
    """First counted send to last counted end (module LEGEND `duration_s`)."""
    counted = [r for r in records if not r.cancelled and r.end_time is not None]
    if not counted:
        return 0.0
    return max(r.end_time for r in counted if r.end_time is not None) - min(
        r.send_time for r in counted
    )


def _rate(amount: float, seconds: float) -> float | None:
    return amount / seconds if seconds > 0 else None


def summarize(
    records: Sequence[RequestRecord], slo: SLOConfig, duration_s: float | None = None
) -> dict[str, Any]:
    """All run-level metrics of `records` (see LEGEND for each formula)."""
    duration = run_duration(records) if duration_s is None else duration_s
    done = [r for r in records if r.ok]
    failed = [r for r in records if r.error is not None and not r.cancelled]
    out_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.input_tokens or 0 for r in done)
    decode_tokens = sum(max(0, r.output_tokens - 1) for r in done)
    decode_time = sum((e2e(r) or 0.0) - (ttft(r) or 0.0) for r in done if r.output_tokens >= 2)
    prefill_rates = [
        (r.input_tokens or 0) / t for r in done if (t := ttft(r)) is not None and t > 0
    ]
    all_itls = [x for r in done for x in itls(r)]
    met = sum(1 for r in done if meets_slo(r, slo)) if slo.any else None
    counted = len([r for r in records if not r.cancelled])
    return {
        "num_requests": counted,
        "completed": len(done),
        "failed": len(failed),
        "cancelled": sum(1 for r in records if r.cancelled),
        "failures": dict(Counter(r.error for r in failed if r.error is not None)),
        "duration_s": duration,
        "total_prompt_tokens": prompt_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": _rate(len(done), duration),
        "output_throughput": _rate(out_tokens, duration),
        "total_token_throughput": _rate(out_tokens + prompt_tokens, duration),
        "prefill_throughput": _rate(prompt_tokens, duration),
        "prefill_rate_per_request": stats(prefill_rates).to_dict(),
        "decode_throughput": _rate(decode_tokens, duration),
        "decode_rate_per_stream": _rate(decode_tokens, decode_time),
        "ttft": stats(t for r in done if (t := ttft(r)) is not None).to_dict(),
        "tpot": stats(t for r in done if (t := tpot(r)) is not None).to_dict(),
        "itl": stats(all_itls).to_dict(),
        "e2e": stats(t for r in done if (t := e2e(r)) is not None).to_dict(),
        "goodput": {
            "slo": {k: v for k, v in dataclasses.asdict(slo).items() if v is not None},
            "requests_met": met,
            "fraction_met": None if met is None or not counted else met / counted,
            "request_goodput": None if met is None else _rate(met, duration),
        },
        "requests_without_usage": sum(1 for r in done if not r.usage_reported),
        "requests_fewer_tokens_than_chunks": sum(
            1 for r in done if r.output_tokens < len(r.chunk_times)
        ),
    }
