"""`pdserve` command line. Each subcommand lives in its own module here and
registers itself; argument parsing happens only in this package, which turns
arguments into frozen config dataclasses and calls into the owning package.
Heavy imports (torch) happen inside each command's `run`, so `pdserve gateway`
never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Module names under pdserve.cli, one per subcommand (or group of subcommands).
COMMAND_MODULES = (
    "make_model",
    "generate",
    "gateway",
    "workers",
    "up",
    "plan",
    "bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        # A listed module that is missing is a broken install: fail, never drop the command.
        importlib.import_module(f"pdserve.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
