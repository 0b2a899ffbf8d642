"""`pdserve make-model DIR`: write a built-in Llama checkpoint to DIR (the trained
`pdserve-tiny-llama`, its `--draft`, or the `--random`-weight one); `pdserve
train-model`: retrain the built-in models (`pdserve.builtin.train`)."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "make-model",
        help="write a built-in Llama checkpoint (trained by default)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("dir", type=Path, help="output directory (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--draft", action="store_true",
                       help="the draft model (pdserve-tiny-llama-draft, same tokenizer)")
    which.add_argument("--random", action="store_true",
                       help="the random-weight checkpoint of the same shape (benchmarks, tests)")
    p.set_defaults(func=run)
    t = subparsers.add_parser(
        "train-model",
        help="retrain the built-in models into pdserve/builtin/weights (a few CPU minutes)",
        description="Retrain the tokenizer, pdserve-tiny-llama and its draft on the story corpus.",
    )
    t.add_argument("--out", type=Path, default=None, help="output directory (default: the package's)")
    t.add_argument("--threads", type=int, default=1, help="torch threads (the result depends on it)")
    t.add_argument("--steps", type=int, default=None, help="override the step count (smoke runs)")
    t.add_argument("--only", choices=("tiny-llama", "tiny-llama-draft"), action="append",
                   help="train only this model (repeatable; default: both)")
    t.set_defaults(func=run_train)


def run(args: argparse.Namespace) -> int:
    # torch-free, but not needed to parse
    from pdserve.builtin.default_model import (
        DRAFT,
        TRAINED,
        BuiltinWeightsError,
        write_builtin_model,
    )
    from pdserve.builtin.random_model import write_random_model

    out: Path = args.dir
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        print(f"pdserve make-model: {out} exists and is not empty (use --force)", file=sys.stderr)
        return 1
    try:
        if out.is_dir() and args.force:
            shutil.rmtree(out)
        elif out.exists() and args.force:
            out.unlink()
        if args.random:
            write_random_model(out)
        else:
            write_builtin_model(out, DRAFT if args.draft else TRAINED)
    except OSError as e:
        print(f"pdserve make-model: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 1
    except BuiltinWeightsError as e:
        print(f"pdserve make-model: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


def run_train(args: argparse.Namespace) -> int:
    from pdserve.builtin.default_model import BUILTIN_WEIGHTS_DIR
    from pdserve.builtin.train import SPECS, train_all

    train_all(args.out or BUILTIN_WEIGHTS_DIR, args.threads, args.steps, args.only or tuple(SPECS))
    return 0
