"""Prefill-heavy serving throughput against the engine's compute floor.

    .venv/bin/python -m bench.throughput --model DIR [--num-requests 32 --concurrency 16
        --input-len 500 --output-len 64] [--up-args "--colocated"]

In one run: (1) the single-process `LLMEngine` (all cores, the colocated shape)
runs `--concurrency` requests of the workload's shape and we time its prefill
(until every request has its first token) and its decode (the rest), giving
the engine's prefill tokens/s and decode tokens/s; (2) `pdserve up <up-args>`
serves `--num-requests` requests of `--input-len` prompt tokens and
`--output-len` output tokens at `--concurrency`, measured by the load generator.

    compute floor = prompt tokens / engine prefill rate
                  + (output tokens - 1 per request) / engine decode rate

with the token counts the server reported. Target of issue 7: served wall time
(the load generator's duration) <= 1.1x the floor. The engine runs before the
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
class EngineRates:
    prefill_tok_s: float
    decode_tok_s: float


def measure_engine(model_dir: str | None, args: argparse.Namespace, salt: int) -> EngineRates:
    """Prefill and decode tokens/s of the engine on one wave of `concurrency` requests."""
    w = harness.random_wave(model_dir, args.threads, args.concurrency, args.input_len, args.output_len, seed=salt)
    return EngineRates(args.concurrency * args.input_len / w.prefill_s, w.decode_tokens / w.decode_s)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, engine_threads=True)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=500)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--engine-reps", type=int, default=2, help="engine waves; rates are medians")
    ap.add_argument("--up-args", default="--colocated")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tok = harness.tokenizer_dir(args)
    runs = [measure_engine(args.model, args, salt) for salt in range(args.engine_reps)]
    rates = harness.median_of(runs)
    cfg = BenchConfig(
        endpoint=EndpointConfig(),
        workload=WorkloadConfig(input_len=args.input_len, output_len=args.output_len, tokenizer_dir=tok),
        load=LoadConfig(concurrency=args.concurrency, warmup=1, num_requests=args.num_requests,
                        max_duration_s=600),
        output=harness.output_config(),
    )
    with pdserve_up("throughput", harness.up_args(args.up_args, args.model)) as server:
        cfg = dataclasses.replace(cfg, endpoint=EndpointConfig(base_url=server.base_url))
        s = run_benchmark(cfg).runs[0].summary
    prompt_tokens = s["total_prompt_tokens"]
    decode_tokens = s["total_output_tokens"] - s["completed"]
    floor = prompt_tokens / rates.prefill_tok_s + decode_tokens / rates.decode_tok_s
    wall = s["duration_s"]
    row = {
        "engine_prefill_tok_s": rates.prefill_tok_s,
        "engine_decode_tok_s": rates.decode_tok_s,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "completed": s["completed"],
        "failed": s["failed"],
        "floor_s": floor,
        "wall_s": wall,
        "ratio": wall / floor,
        "ttft_p50_s": s["ttft"]["p50"],
        "tpot_p50_s": s["tpot"]["p50"],
    }
    print(f"{harness.machine_line()}\nengine: prefill {rates.prefill_tok_s:.0f} tok/s, decode {rates.decode_tok_s:.0f} tok/s "
          f"(batch {args.concurrency}, {args.threads} threads; runs {[(round(r.prefill_tok_s), round(r.decode_tok_s)) for r in runs]})")
    print(f"served: {s['completed']} completed, {s['failed']} failed; {prompt_tokens} prompt + "
          f"{decode_tokens} decode tokens in {wall:.2f} s")
    print(f"compute floor {floor:.2f} s; wall / floor = {row['ratio']:.3f} "
          f"(target <= 1.1: {'MET' if row['ratio'] <= 1.1 else 'MISSED'})")
    harness.write_json(args.output_json, {"args": vars(args), "result": row, "summary": s})
    return 0


if __name__ == "__main__":
    sys.exit(main())
