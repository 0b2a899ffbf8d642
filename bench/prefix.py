"""Prefix caching: TTFT on the shared-prefix workload with and without the cache.

    .venv/bin/python -m bench.prefix --prefix-len 1024 --num-requests 16

Starts the same `pdserve up` configuration twice, the second time with prefix
caching switched off (`--no-cache-args`), sends one warm-up request (it fills
the cache) and then `--num-requests` requests that share a `--prefix-len`-token
system prompt, each with its own short suffix. Target of issue 7: TTFT at
least 3x lower with caching.
"""

from __future__ import annotations

import argparse
import sys

from bench import harness
from pdserve.loadgen.compare import Column, Target, column_ratio, format_comparison, split_args
from pdserve.loadgen.config import (
    BenchConfig,
    EndpointConfig,
    LoadConfig,
    WorkloadConfig,
    WorkloadKind,
)
from pdserve.loadgen.launch import pdserve_up
from pdserve.loadgen.report import format_report, to_json
from pdserve.loadgen.runner import run_benchmark

COLUMNS = (
    Column("TTFT mean ms", ("ttft", "mean")),
    Column("TTFT p50 ms", ("ttft", "p50")),
    Column("TTFT p95 ms", ("ttft", "p95")),
    Column("E2E p50 ms", ("e2e", "p50")),
    Column("prefill tok/s", ("prefill_rate_per_request", "p50"), scale=1),
    Column("failed", ("failed",), scale=1, fmt=".0f"),
)
MODEL_HELP = "model dir for every `pdserve up` (default: built-in)"
# no-cache / cache: caching must make TTFT at least 3x lower.
TARGET = Target("TTFT p50 ms", 3.0, at_most=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, model_help=MODEL_HELP, tokenizer=True)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--max-duration", type=float, default=600.0)
    ap.add_argument("--up-args", default="--prefill 1 --decode 1")
    ap.add_argument("--no-cache-args", default="--no-prefix-caching")
    return ap.parse_args(argv)


def bench_config(args: argparse.Namespace, base_url: str, tokenizer: str | None) -> BenchConfig:
    return BenchConfig(
        endpoint=EndpointConfig(base_url=base_url),
        workload=WorkloadConfig(
            kind=WorkloadKind.SHARED_PREFIX,
            shared_prefix_len=args.prefix_len,
            input_len=args.suffix_len,
            output_len=args.output_len,
            tokenizer_dir=tokenizer,
        ),
        load=LoadConfig(
            concurrency=args.concurrency,
            warmup=1,
            num_requests=args.num_requests,
            max_duration_s=args.max_duration,
        ),
        output=harness.output_config(),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = harness.tokenizer_dir(args)
    base = harness.up_args(args.up_args, args.model)
    configs = [("cache", base), ("no-cache", base + split_args(args.no_cache_args))]
    summaries, results = {}, {}
    for name, up_args in configs:
        with pdserve_up(name, up_args) as server:
            result = run_benchmark(bench_config(args, server.base_url, tokenizer))
        print(f"\n### {name}\n{format_report(result, legend=False)}")
        summaries[name] = result.runs[0].summary
        results[name] = to_json(result)
    print(f"\n{harness.machine_line()}\n## shared-prefix workload, {args.prefix_len}-token prefix")
    rows = [(name, summaries[name]) for name, _ in configs]
    print(format_comparison(COLUMNS, rows, [("no-cache/cache", "no-cache", "cache")]))
    r = column_ratio(COLUMNS, TARGET.header, summaries["no-cache"], summaries["cache"])
    check = TARGET.check(r)
    print(f"target TTFT without cache / with cache: {check}")
    harness.write_json(args.output_json, {"args": vars(args), "target": check, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
