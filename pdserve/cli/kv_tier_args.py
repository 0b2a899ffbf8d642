"""`--kv-offload-*` and `--kv-remote-url` (fields of `WorkerArgs`, every worker role):
the KV tiers below a worker's pool, checked into a `KVOffloadConfig`."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pdserve.cli.args import UsageError, byte_size

if TYPE_CHECKING:
    from kv_transfer.tiers import KVOffloadConfig


def tier_config(args: argparse.Namespace) -> KVOffloadConfig | None:
    """The worker's tiers, checked; None when no tier flag is given."""
    from kv_transfer.tiers import KVOffloadConfig
    from kv_transfer.tiers.config import DEFAULT_DISK_BYTES

    if args.kv_offload_disk is not None and not args.kv_offload_dir:
        raise UsageError("--kv-offload-disk", "needs --kv-offload-dir")
    if args.kv_offload_memory_dir and not args.kv_offload_memory:
        raise UsageError("--kv-offload-memory-dir", "needs --kv-offload-memory")
    if not (args.kv_offload_memory or args.kv_offload_dir or args.kv_remote_url):
        return None
    if args.kv_remote_url:
        try:
            import redis  # noqa: F401
        except ImportError:
            raise UsageError("--kv-remote-url", "needs the redis package: pip install 'pdserve[redis]'") from None
    try:
        return KVOffloadConfig(memory_bytes=byte_size(args.kv_offload_memory) if args.kv_offload_memory else 0,
                               memory_dir=args.kv_offload_memory_dir or "",
                               disk_dir=args.kv_offload_dir or "",
                               disk_bytes=byte_size(args.kv_offload_disk) if args.kv_offload_disk else DEFAULT_DISK_BYTES,
                               remote_url=args.kv_remote_url or "")
    except ValueError as e:
        raise UsageError("--kv-remote-url" if "remote" in str(e) else "--kv-offload-memory", str(e)) from None

