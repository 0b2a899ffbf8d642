"""Terminal table and JSON result file of a benchmark.

The JSON holds the config (API key masked), the model, the metric legend, and
per run: the summary (every metric of `metrics.summarize`), per-tag summaries
(mixed workload) and every request's raw record.
"""

from __future__ import annotations

import json
import os
from typing import Any

from pdserve.loadgen.metrics import LEGEND
from pdserve.loadgen.runner import BenchResult, RunResult

SCHEMA_VERSION = 1
LATENCY_ROWS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("E2E", "e2e"))
STAT_COLS = ("mean", "p50", "p90", "p95", "p99", "max")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def latency_table(summary: dict[str, Any]) -> list[str]:
    head = f"{'latency (ms)':<14}" + "".join(f"{c:>10}" for c in STAT_COLS) + f"{'n':>8}"
    lines = [head, "-" * len(head)]
    for name, key in LATENCY_ROWS:
        s = summary[key]
        lines.append(
            f"{name:<14}" + "".join(f"{_ms(s[c]):>10}" for c in STAT_COLS) + f"{s['count']:>8}"
        )
    return lines


def run_lines(run: RunResult) -> list[str]:
    s = run.summary
    lines = [f"== {run.label}  (started {run.started_at})"]
    lines += latency_table(s)
    g = s["goodput"]
    prefill_p50 = s["prefill_rate_per_request"]["p50"]
    lines += [
        f"requests: {s['completed']} completed, {s['failed']} failed, {s['cancelled']} cancelled"
        f" in {s['duration_s']:.2f} s",
        f"requests/s {_num(s['request_throughput'])}   output tok/s {_num(s['output_throughput'], '.1f')}"
        f"   total tok/s {_num(s['total_token_throughput'], '.1f')}",
        f"prefill tok/s {_num(s['prefill_throughput'], '.1f')} (aggregate)"
        f"   {_num(prefill_p50, '.1f')} (per request, p50)",
        f"decode tok/s {_num(s['decode_throughput'], '.1f')} (aggregate)"
        f"   {_num(s['decode_rate_per_stream'], '.1f')} (per stream)",
    ]
    if g["requests_met"] is not None:
        slo = ", ".join(f"{k}<={v}" for k, v in g["slo"].items())
        lines.append(
            f"goodput {_num(g['request_goodput'])} req/s: {g['requests_met']}/{s['num_requests']}"
            f" requests met {slo}"
        )
    spec = s.get("spec_decode")
    if spec:
        lines.append(
            f"speculative decoding (server): mean acceptance length {spec['mean_acceptance_length']:.2f}"
            f"   {spec['accepted_tokens']:.0f}/{spec['draft_tokens']:.0f} draft tokens accepted"
            f" ({spec['acceptance_rate'] * 100:.0f}%) over {spec['drafts']:.0f} drafts"
        )
    if s["failures"]:
        lines.append("failures: " + ", ".join(f"{k}={v}" for k, v in sorted(s["failures"].items())))
    if s["requests_without_usage"]:
        lines.append(f"note: {s['requests_without_usage']} requests had no usage; tokens = chunks")
    for tag, ts in run.per_tag.items():
        lines.append(
            f"[{tag}] n={ts['completed']} TTFT p50/p95 {_ms(ts['ttft']['p50'])}/{_ms(ts['ttft']['p95'])} ms"
            f"  ITL p50/p95/p99/max {_ms(ts['itl']['p50'])}/{_ms(ts['itl']['p95'])}/"
            f"{_ms(ts['itl']['p99'])}/{_ms(ts['itl']['max'])} ms"
        )
    return lines


def format_report(result: BenchResult, legend: bool = True) -> str:
    lines = [f"pdserve bench: model {result.model} at {result.config.endpoint.base_url}"]
    for run in result.runs:
        lines += run_lines(run)
    if len(result.runs) > 1:
        lines.append("sweep: label, requests/s, output tok/s, TTFT p50 ms, TPOT p50 ms, ITL p99 ms")
        for run in result.runs:
            s = run.summary
            lines.append(
                f"  {run.label:<10} {_num(s['request_throughput']):>8} {_num(s['output_throughput'], '.1f'):>9}"
                f" {_ms(s['ttft']['p50']):>9} {_ms(s['tpot']['p50']):>9} {_ms(s['itl']['p99']):>9}"
            )
    if legend:
        lines.append("metrics:")
        lines += [f"  {k}: {v}" for k, v in LEGEND.items()]
    return "\n".join(lines)


def to_json(result: BenchResult) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "model": result.model,
        "config": result.config.to_dict(),
        "legend": dict(LEGEND),
        "runs": [
            {
                "label": run.label,
                "concurrency": run.concurrency,
                "request_rate": run.request_rate,
                "started_at": run.started_at,
                "summary": run.summary,
                "per_tag": run.per_tag,
                "requests": [r.to_dict(run.origin) for r in run.records],
            }
            for run in result.runs
        ],
    }


def write_json(result: BenchResult, path: str) -> None:
    """Write atomically so a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(to_json(result), f, indent=1)
    os.replace(tmp, path)
