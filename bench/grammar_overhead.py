"""Structured outputs: TPOT of the engine with and without a JSON schema (engine path).

    .venv/bin/python -m bench.grammar_overhead --batch 8 --output-len 64 --reps 3

The single-process engine (no gateway, no sockets: the grammar's cost is all on the
worker's engine loop) decodes `--batch` (concurrency) sampled requests of `--output-len`
tokens (ignore_eos), without a constraint and with a JSON schema whose one string is
400 characters long (so the grammar is live for every token), `--reps` rounds. A
round runs both, in alternating order (plain first in even rounds, schema first in odd
ones), which cancels the drift of a shared machine's load and any warm-up favouring the
second; TPOT is the mean decode step once every request has its first token (one token
per request per step); the ratio of the medians over the rounds is reported, and the
median of each round's own ratio (robust to a round that a burst of load slowed). The
per-token cost of the grammar (mask computation, the masked fill before the draw) is
the difference; the target is a ratio <= 1.10.
"""

from __future__ import annotations

import statistics
import sys
from typing import TYPE_CHECKING

from bench import harness

if TYPE_CHECKING:
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.engine.llm_engine import LLMEngine

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400, "maxLength": 400}},
          "required": ["text"]}


def mean_step_s(engine: LLMEngine, batch: int, params: SamplingParams, tag: str) -> float:
    """Mean decode step once every request has its first token."""
    w = harness.engine_wave(engine, [[0] + [10 + i + j for j in range(64)] for i in range(batch)], params, tag=f"{tag}-")
    return w.decode_s / max(w.decode_steps, 1)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, engine_threads=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    from pdserve.common.sampling_params import SamplingParams
    from pdserve.common.structured import json_schema

    engine = harness.reference_engine(args.model, args.threads)
    base = {"max_tokens": args.output_len, "temperature": 1.0, "ignore_eos": True, "seed": 1}
    runs = {"plain": SamplingParams(**base),
            "schema": SamplingParams(**base, structured=json_schema(SCHEMA, "response_format"))}
    steps: dict[str, list[float]] = {name: [] for name in runs}
    for rep, name in harness.turns(list(runs), args.reps, alternate=True):
        steps[name].append(mean_step_s(engine, args.batch, runs[name], f"{name}{rep}"))
    med = {name: statistics.median(v) for name, v in steps.items()}
    ratio = med["schema"] / med["plain"]
    print(harness.machine_line())
    for name, v in steps.items():
        print(f"{name:7s} median TPOT {1000 * med[name]:.2f} ms  runs: "
              + " ".join(f"{1000 * x:.1f}" for x in v))
    paired = statistics.median(s / p for s, p in zip(steps["schema"], steps["plain"], strict=True))
    print(f"TPOT schema / plain = {ratio:.3f} (ratio of medians), {paired:.3f} (median of the rounds' "
          f"ratios) at concurrency {args.batch} (engine path)")
    harness.write_json(args.output_json, {"batch": args.batch, "output_len": args.output_len,
                                          "step_s": steps, "median_step_s": med, "ratio": ratio,
                                          "paired_ratio": paired})
    return 0


if __name__ == "__main__":
    sys.exit(main())
