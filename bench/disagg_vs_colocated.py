"""Prefill/decode interference: the mixed workload against 1 prefill + 1 decode
worker and against the colocated worker, one after the other on this machine.

    .venv/bin/python -m bench.disagg_vs_colocated --duration 60

Decode streams (short prompts, long outputs) run `--streams` deep while a long
prompt arrives every `--interval` seconds. Prints decode-stream ITL
p50/p95/p99/max, long-prompt TTFT p50/p95, goodput and output throughput for
each configuration and their ratios (1P+1D / colocated), and checks the
targets of issue 7: ITL p99 ratio <= 0.2, long-prompt TTFT p50 ratio <= 1.5.
"""

from __future__ import annotations

import argparse
import sys

from bench import harness
from bench.loadgen.compare import Column, Target, column_ratio, format_comparison, split_args
from bench.loadgen.config import (
    BenchConfig,
    EndpointConfig,
    LoadConfig,
    MixedConfig,
    WorkloadConfig,
    WorkloadKind,
    parse_slo,
)
from bench.loadgen.launch import pdserve_up
from bench.loadgen.report import format_report, to_json
from bench.loadgen.runner import run_benchmark

COLUMNS = (
    Column("ITL p50 ms", ("decode", "itl", "p50")),
    Column("ITL p95 ms", ("decode", "itl", "p95")),
    Column("ITL p99 ms", ("decode", "itl", "p99")),
    Column("ITL max ms", ("decode", "itl", "max")),
    Column("TTFT p50 ms", ("long_prompt", "ttft", "p50")),
    Column("TTFT p95 ms", ("long_prompt", "ttft", "p95")),
    Column("goodput r/s", ("all", "goodput", "request_goodput"), scale=1, fmt=".3f"),
    Column("out tok/s", ("all", "output_throughput"), scale=1),
    Column("failed", ("all", "failed"), scale=1, fmt=".0f"),
)
TARGETS = (Target("ITL p99 ms", 0.2), Target("TTFT p50 ms", 1.5))


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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = harness.tokenizer_dir(args)
    extra = harness.up_args(args.up_extra, args.model)
    configs = [
        ("1P+1D", split_args(args.disagg_args) + extra),
        ("colocated", split_args(args.colocated_args) + extra),
    ]
    summaries: dict[str, dict] = {}
    results = {}
    for name, up_args in configs:
        with pdserve_up(name, up_args) as server:
            result = run_benchmark(bench_config(args, server.base_url, tokenizer))
        run = result.runs[0]
        print(f"\n### {name}\n{format_report(result, legend=False)}")
        summaries[name] = {"all": run.summary, **run.per_tag}
        results[name] = to_json(result)
    print("\n## decode streams (ITL) and long prompts (TTFT), 1P+1D vs colocated")
    rows = [(name, summaries[name]) for name, _ in configs]
    print(format_comparison(COLUMNS, rows, [("1P+1D/colo", "1P+1D", "colocated")]))
    checks = {}
    for t in TARGETS:
        r = column_ratio(COLUMNS, t.header, summaries["1P+1D"], summaries["colocated"])
        checks[t.header] = t.check(r)
        print(f"target {t.header} ratio: {checks[t.header]}")
    harness.write_json(args.output_json, {"args": vars(args), "targets": checks, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
