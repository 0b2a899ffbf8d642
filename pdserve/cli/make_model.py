"""`pdserve make-model DIR`: write the built-in deterministic Llama checkpoint to DIR."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "make-model",
        help="write the built-in random-weight Llama checkpoint",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("dir", type=Path, help="output directory (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.default_model import write_default_model  # torch-free, but not needed to parse

    out: Path = args.dir
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        print(f"pdserve make-model: {out} exists and is not empty (use --force)", file=sys.stderr)
        return 1
    try:
        if out.is_dir() and args.force:
            shutil.rmtree(out)
        elif out.exists() and args.force:
            out.unlink()
        write_default_model(out)
    except OSError as e:
        print(f"pdserve make-model: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(out)
    return 0
