"""Parse a container's command line with the real `pdserve` argument parser,
so the manifests and the Dockerfiles cannot drift from the CLI's flags."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest


def parse_with_real_cli(argv: list[str]) -> argparse.Namespace:
    """Parse `pdserve ARGV`; skip if that subcommand is not built yet, fail if rejected."""
    from pdserve.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if argv[0] not in sub.choices:
        pytest.skip(f"`pdserve {argv[0]}` is not built yet; cannot check its flags")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"`pdserve {' '.join(argv)}` is rejected by the CLI:\n{err.getvalue()}")
