"""`pdserve` command line. Each subcommand lives in its own module here and
registers itself; argument parsing happens only in this package, which turns
arguments into frozen config dataclasses and calls into the owning package.
Heavy imports (torch) happen inside each command's `run`, so `pdserve gateway`
never imports torch. Bad arguments are refused in one line with exit status 2
before anything starts (`pdserve.cli.args`).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pdserve.cli.args import Parser, UsageError, resolve_model_arg

# Module names under pdserve.cli, one per subcommand (or group of subcommands).
COMMAND_MODULES = (
    "make_model",
    "generate",
    "gateway",
    "workers",
    "up",
    "plan",
    "profile",
    "bench",
    "keygen",
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name in COMMAND_MODULES:
        # A listed module that is missing is a broken install: fail, never drop the command.
        importlib.import_module(f"pdserve.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        resolve_model_arg(args)
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
