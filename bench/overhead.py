"""Full-stack overhead: decode tokens/s through `pdserve up` vs the engine alone.

    .venv/bin/python -m bench.overhead --batches 1,16,32

For each batch B: the single-process `LLMEngine` (all cores, the colocated
shape) runs B requests together and its decode step time is measured once all
B are decoding; then `pdserve up` serves B concurrent streaming requests of the
same shape and the client measures the per-stream decode rate. Prints
full-stack / engine decode tokens/s per B and the added per-token latency
(full-stack TPOT - engine step). Targets of issue 7: >= 0.9x at 16 and 32; at
B = 1 the ITL p50 <= 1.15x the engine's step time. The engine runs before the
server starts, so the two never compete for cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from bench import harness
from pdserve.loadgen.config import BenchConfig, EndpointConfig, LoadConfig, WorkloadConfig
from pdserve.loadgen.launch import pdserve_up
from pdserve.loadgen.runner import run_benchmark


@dataclasses.dataclass(frozen=True)
class EngineDecode:
    batch: int
    step_s: float  # mean decode step with all `batch` sequences running
    tokens_per_s: float


def measure_engine(
    model_dir: str | None, batch: int, prompt_len: int, output_len: int, threads: int
) -> EngineDecode:
    """Decode rate of the single-process engine at `batch` (imports torch)."""
    w = harness.random_wave(model_dir, threads, batch, prompt_len, output_len, seed=batch)
    return EngineDecode(batch, w.decode_s / max(1, w.decode_steps), w.decode_tokens / w.decode_s if w.decode_s else 0.0)


def fmt(value: float | None, scale: float = 1000.0) -> str:
    return "-" if value is None else f"{value * scale:.2f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, engine_threads=True)
    ap.add_argument("--batches", default="1,16,32")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--up-args", default="--colocated")
    return ap.parse_args(argv)


def bench_config(
    args: argparse.Namespace, base_url: str, batch: int, tok: str | None
) -> BenchConfig:
    return BenchConfig(
        endpoint=EndpointConfig(base_url=base_url),
        workload=WorkloadConfig(
            input_len=args.prompt_len, output_len=args.output_len, tokenizer_dir=tok
        ),
        load=LoadConfig(concurrency=batch, warmup=batch, num_requests=batch, max_duration_s=600),
        output=harness.output_config(),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    tok = harness.tokenizer_dir(args)
    engine = {
        b: measure_engine(args.model, b, args.prompt_len, args.output_len, args.threads)
        for b in batches
    }
    stack: dict[int, dict] = {}
    with pdserve_up("overhead", harness.up_args(args.up_args, args.model)) as server:
        for b in batches:
            stack[b] = run_benchmark(bench_config(args, server.base_url, b, tok)).runs[0].summary
    print(f"{harness.machine_line()}\n{'batch':>6}{'engine tok/s':>14}{'stack tok/s':>13}{'ratio':>8}{'step ms':>9}"
          f"{'TPOT ms':>9}{'added ms':>10}{'ITL p50 ms':>12}")
    rows = []
    for b in batches:
        e, s = engine[b], stack[b]
        per_stream = s["decode_rate_per_stream"] or 0.0
        stack_rate = per_stream * b  # all b streams decode together
        tpot = s["tpot"]["p50"]
        row = {
            "batch": b,
            "engine_decode_tok_s": e.tokens_per_s,
            "engine_step_s": e.step_s,
            "stack_decode_tok_s": stack_rate,
            "ratio": stack_rate / e.tokens_per_s if e.tokens_per_s else None,
            "stack_tpot_p50_s": tpot,
            "added_per_token_s": None if tpot is None else tpot - e.step_s,
            "stack_itl_p50_s": s["itl"]["p50"],
        }
        rows.append(row)
        print(f"{b:>6}{e.tokens_per_s:>14.1f}{stack_rate:>13.1f}{fmt(row['ratio'], 1):>8}"
              f"{fmt(e.step_s):>9}{fmt(tpot):>9}{fmt(row['added_per_token_s']):>10}"
              f"{fmt(s['itl']['p50']):>12}")
    for row in rows:
        if row["batch"] >= 16 and row["ratio"] is not None:
            print(
                f"target batch {row['batch']}: ratio {row['ratio']:.3f} >= 0.9: {row['ratio'] >= 0.9}"
            )
        if row["batch"] == 1 and row["stack_itl_p50_s"] is not None:
            r = row["stack_itl_p50_s"] / row["engine_step_s"]
            print(f"target batch 1: ITL p50 / engine step = {r:.3f} <= 1.15: {r <= 1.15}")
    harness.write_json(args.output_json, {"args": vars(args), "rows": rows, "full_stack": stack})
    return 0


if __name__ == "__main__":
    sys.exit(main())
