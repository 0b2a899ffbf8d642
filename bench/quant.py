"""Weight quantization speed on one engine: bf16 vs int8 vs int4, same weights, same run.

    python -m bench.quant [--quick] [--model DIR] [--reps 3] [--threads N]

Builds the ~125M benchmark shape (`bench.engine.build_125m`, random weights) unless
`--model` names a checkpoint, loads it once per scheme, and measures, interleaving the
schemes within each repetition so background load hits all alike (median of `--reps`):

- concurrency-1 decode ITL: one sequence, mean time between its output tokens;
- concurrency-16 output tok/s: 16 sequences decoding together;
- prefill tok/s: one `--prompt-len` prompt to its first token.

Ratios are quantized / bf16 (ITL: < 1 is faster; tok/s: > 1 is faster).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from bench import harness
from bench.engine import Throughput, _prompts, build_125m, engine_run
from pdserve.engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine

SCHEMES = ("none", "int8", "int4")
BATCH = 16


class Speed(NamedTuple):
    itl_ms: float  # concurrency 1
    tok_s_16: float  # concurrency 16 output tokens/s
    prefill_tok_s: float  # one prompt


def _engine(model_dir: Path, scheme: str, args: argparse.Namespace) -> LLMEngine:
    per_seq = (args.prompt_len + args.decode_tokens + 1) // 16 + 2
    return LLMEngine(EngineConfig(
        model_dir=str(model_dir), dtype=args.dtype, quantization=scheme,
        cache=CacheConfig(num_blocks=BATCH * per_seq + 1, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=BATCH, max_num_batched_tokens=BATCH * args.prompt_len),
    ))


def measure(engine: LLMEngine, args: argparse.Namespace, salt: int) -> Speed:
    vocab = engine.vocab_size
    one: Throughput = engine_run(engine, _prompts(1, args.prompt_len, vocab, salt), args.decode_tokens)
    many = engine_run(engine, _prompts(BATCH, args.prompt_len, vocab, salt + 1), args.decode_tokens)
    return Speed(1000.0 / one.decode_tok_s, many.decode_tok_s, one.prefill_tok_s)


def run(model_dir: Path, args: argparse.Namespace) -> dict[str, Speed]:
    engines = {s: _engine(model_dir, s, args) for s in SCHEMES}
    for e in engines.values():  # warm-up: first-call allocations, kernel packing caches
        measure(e, argparse.Namespace(prompt_len=8, decode_tokens=2), 99)
    runs: dict[str, list[Speed]] = {s: [] for s in SCHEMES}
    with torch.inference_mode():
        for rep, s in harness.turns(SCHEMES, args.reps):
            runs[s].append(measure(engines[s], args, rep))
    return {s: harness.median_of(rs) for s, rs in runs.items()}


def format_table(speeds: dict[str, Speed]) -> str:
    base = speeds["none"]
    lines = [f"{'weights':>8} | {'c=1 ITL ms':>10} {'ratio':>6} | {'c=16 tok/s':>10} {'ratio':>6} | "
             f"{'prefill tok/s':>13} {'ratio':>6}"]
    for s, v in speeds.items():
        name = "bf16" if s == "none" else s
        lines.append(f"{name:>8} | {v.itl_ms:>10.2f} {v.itl_ms / base.itl_ms:>6.2f} | {v.tok_s_16:>10.0f} "
                     f"{v.tok_s_16 / base.tok_s_16:>6.2f} | {v.prefill_tok_s:>13.0f} "
                     f"{v.prefill_tok_s / base.prefill_tok_s:>6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: build the 125M shape)")
    ap.add_argument("--dtype", default="bfloat16", help="compute dtype of every scheme (default bfloat16)")
    args = harness.parse_speed_args(ap, argv, quick=(16, 4), full=(128, 64))
    print(harness.machine_line())
    print(f"torch threads {torch.get_num_threads()}, {args.dtype} compute, prompt {args.prompt_len} tokens, "
          f"{args.decode_tokens} decode tokens, median of {args.reps}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or build_125m(Path(tmp) / "125m")
        table = format_table(run(model_dir, args))
    print(table)
    return table


if __name__ == "__main__":
    main()
