"""`pdserve keygen DIR`: a fresh CURVE key set for a cluster started by hand or on
Kubernetes (pdserve/cli/cluster_keys.py lays it out; docs/security.md says which process
gets which file). DIR is created mode 0700 and must be new or empty; the keys are
written into files only, never printed.
"""

from __future__ import annotations

import argparse

from pdserve.cli.args import UsageError


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ap = sub.add_parser("keygen", help="write CURVE key pairs for a gateway and its workers")
    ap.add_argument("directory", help="where to write them (new or empty; created 0700)")
    ap.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.cli import cluster_keys

    try:
        keys = cluster_keys.create(args.directory)
    except (FileExistsError, NotADirectoryError, PermissionError) as e:
        raise UsageError("directory", str(e)) from None
    print(f"gateway: {' '.join(keys.gateway_flags())}")
    print(f"workers: {' '.join(keys.worker_flags())}")
    return 0
