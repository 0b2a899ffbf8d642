"""`pdserve profile`: time this hardware's prefill (against prompt length) and decode
steps (against batch size and context) with the engine in-process, and write the
JSON profile `pdserve plan --simulate` reads (schema: pdserve/planner/profile.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pdserve.cli.args import (
    UsageError,
    add_model_arg,
    model_dir,
    positive_int,
)
from pdserve.cli.worker_args import WorkerArgs


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, not {text!r}")
    return values


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("profile", help="measure prefill and decode step times for `plan --simulate`",
                              description=__doc__.splitlines()[0])
    add_model_arg(p)
    WorkerArgs.add_to(p, only=("device", "dtype"))
    p.add_argument("--threads", type=positive_int, default=None, help="torch threads (as the workers will run)")
    p.add_argument("--output", "-o", type=Path, default=Path("profile.json"), help="where to write the profile")
    p.add_argument("--prefill-lengths", type=_ints, default=(32, 128, 384, 768, 1536), metavar="N,N,...")
    p.add_argument("--batch-sizes", type=_ints, default=(1, 4, 16), metavar="B,B,...")
    p.add_argument("--context-lengths", type=_ints, default=(64, 512), metavar="C,C,...")
    p.add_argument("--decode-steps", type=positive_int, default=8, help="timed decode steps per point")
    p.add_argument("--reps", type=positive_int, default=3, help="runs per point (the median is kept)")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                   help="the workers' per-step token budget (prefill chunk), recorded for the simulator")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="the workers' decode batch cap, recorded")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.planner.hw_profile import ProfileConfig, measure

    model = model_dir(args.model)
    if not model.is_dir():
        raise UsageError("--model", f"{model} is not a directory")
    try:
        config = ProfileConfig(str(model), args.dtype, args.device, args.threads, args.prefill_lengths,
                               args.batch_sizes, args.context_lengths, args.decode_steps, args.reps,
                               args.block_size, args.max_num_batched_tokens, args.max_num_seqs)
        profile = measure(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"pdserve profile: {e}", file=sys.stderr)
        return 2
    profile.save(args.output)
    pf, df = profile.prefill, profile.decode
    print(f"wrote {args.output}: prefill = {pf.c0 * 1e3:.3f} ms + {pf.c1 * 1e6:.3f} us/token + "
          f"{pf.c2 * 1e9:.4f} ns/token^2; decode step = {df.c0 * 1e3:.3f} ms + {df.per_seq * 1e3:.3f} ms/seq + "
          f"{df.per_ctx_token * 1e6:.4f} us/context token")
    return 0
