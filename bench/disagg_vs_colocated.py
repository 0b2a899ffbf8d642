"""Prefill/decode interference: the mixed workload against 1 prefill + 1 decode
worker and against the colocated worker, one after the other on this machine.

    .venv/bin/python -m bench.disagg_vs_colocated --duration 60 --runs 3

Decode streams (short prompts, long outputs) run `--streams` deep while a long
prompt arrives every `--interval` seconds. Prints decode-stream ITL
p50/p95/p99/max, the short (decode-stream) prompts' TTFT p50/p95, long-prompt TTFT
p50/p95, goodput and output throughput for each configuration and their ratios
(1P+1D / colocated), per run (each run starts both configurations fresh, 1P+1D
first), then a VERDICT line per target with the median of the per-run ratios:
short-prompt TTFT p95 ratio <= 1 and ITL p99 ratio <= 0.2 (issue 18's mixed
workload: short prompts no slower than colocated, the ITL advantage kept), and
long-prompt TTFT p50 ratio <= 1.5 (issue 7).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from bench import harness
from pdserve.loadgen.compare import Column, Target, column_ratio, format_comparison, split_args
from pdserve.loadgen.config import (
    BenchConfig,
    EndpointConfig,
    LoadConfig,
    MixedConfig,
    WorkloadConfig,
    WorkloadKind,
    parse_slo,
)
from pdserve.loadgen.launch import pdserve_up
from pdserve.loadgen.report import format_report, to_json
from pdserve.loadgen.runner import run_benchmark

COLUMNS = (
    Column("ITL p50 ms", ("decode", "itl", "p50")),
    Column("ITL p95 ms", ("decode", "itl", "p95")),
    Column("ITL p99 ms", ("decode", "itl", "p99")),
    Column("ITL max ms", ("decode", "itl", "max")),
    Column("short TTFT p50", ("decode", "ttft", "p50")),
    Column("short TTFT p95", ("decode", "ttft", "p95")),
    Column("TTFT p50 ms", ("long_prompt", "ttft", "p50")),
    Column("TTFT p95 ms", ("long_prompt", "ttft", "p95")),
    Column("goodput r/s", ("all", "goodput", "request_goodput"), scale=1, fmt=".3f"),
    Column("out tok/s", ("all", "output_throughput"), scale=1),
    Column("failed", ("all", "failed"), scale=1, fmt=".0f"),
)
TARGETS = (Target("short TTFT p95", 1.0), Target("ITL p99 ms", 0.2), Target("TTFT p50 ms", 1.5))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, model_help="model dir for every `pdserve up` (default: built-in)",
                        tokenizer=True)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per configuration")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-input", type=int, default=32)
    ap.add_argument("--stream-output", type=int, default=200)
    ap.add_argument("--long-prompt-len", type=int, default=1500)
    ap.add_argument("--long-prompt-output", type=int, default=16)
    ap.add_argument("--interval", type=float, default=3.0)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--slo", default="ttft=5,tpot=0.2")
    ap.add_argument("--disagg-args", default="--prefill 1 --decode 1")
    ap.add_argument("--colocated-args", default="--colocated")
    ap.add_argument("--up-extra", default="", help="flags added to both `pdserve up` commands")
    ap.add_argument("--runs", type=int, default=1, help="runs of both configurations; verdicts on the median")
    return ap.parse_args(argv)


def bench_config(args: argparse.Namespace, base_url: str, tokenizer: str | None) -> BenchConfig:
    return BenchConfig(
        endpoint=EndpointConfig(base_url=base_url),
        workload=WorkloadConfig(
            kind=WorkloadKind.MIXED,
            input_len=args.stream_input,
            output_len=args.stream_output,
            tokenizer_dir=tokenizer,
            mixed=MixedConfig(args.long_prompt_len, args.long_prompt_output, args.interval),
        ),
        load=LoadConfig(
            concurrency=args.streams,
            warmup=args.warmup,
            num_requests=1_000_000,  # bounded by --duration
            max_duration_s=args.duration,
            drain_timeout_s=max(60.0, args.duration),
        ),
        slo=parse_slo(args.slo),
        output=harness.output_config(),
    )


def run_once(args: argparse.Namespace, configs: list[tuple[str, list[str]]], tokenizer: str | None,
             label: str) -> tuple[dict[str, dict], dict[str, Any]]:
    """Both configurations once: their summaries (by tag) and JSON results."""
    summaries: dict[str, dict] = {}
    results = {}
    for name, up_args in configs:
        with pdserve_up(name, up_args) as server:
            result = run_benchmark(bench_config(args, server.base_url, tokenizer))
        run = result.runs[0]
        print(f"\n### {name} ({label})\n{format_report(result, legend=False)}")
        summaries[name] = {"all": run.summary, **run.per_tag}
        results[name] = to_json(result)
    print(f"\n## {label}: decode streams (ITL, short-prompt TTFT) and long prompts (TTFT), 1P+1D vs colocated"
          f" (load average {os.getloadavg()[0]:.1f})")
    rows = [(name, summaries[name]) for name, _ in configs]
    print(format_comparison(COLUMNS, rows, [("1P+1D/colo", "1P+1D", "colocated")]))
    return summaries, results


def verdicts(per_run: list[dict[str, dict]]) -> list[str]:
    """One VERDICT line per target: the per-run ratios, their median, PASS/MISS."""
    def line(t: Target) -> str:
        ratios = [column_ratio(COLUMNS, t.header, s["1P+1D"], s["colocated"]) for s in per_run]
        return harness.verdict(f"{t.header} 1P+1D/colocated", ratios, f"<= {t.bound}",
                               lambda m: "MISSED" not in t.check(m), "{:.3f}")

    return [line(t) for t in TARGETS]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = harness.tokenizer_dir(args)
    extra = harness.up_args(args.up_extra, args.model)
    configs = [
        ("1P+1D", split_args(args.disagg_args) + extra),
        ("colocated", split_args(args.colocated_args) + extra),
    ]
    per_run, results = [], []
    for i in range(args.runs):
        summaries, result = run_once(args, configs, tokenizer, f"run {i + 1} of {args.runs}")
        per_run.append(summaries)
        results.append(result)
    lines = verdicts(per_run)
    print("\n" + "\n".join([harness.machine_line(), *lines]))
    harness.write_json(args.output_json, {"args": vars(args), "verdicts": lines, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
