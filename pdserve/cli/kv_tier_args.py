"""`--kv-offload-*` and `--kv-remote-url`: the KV tiers below each worker's pool, for
`pdserve prefill|decode|worker` and, passed on to every worker, `pdserve up`."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pdserve.cli.args import UsageError, byte_size, byte_size_text

if TYPE_CHECKING:
    from kv_transfer.tiers import KVOffloadConfig


def add_tier_args(ap: argparse.ArgumentParser, *, keep_text: bool = False) -> None:
    """The flags; `keep_text`: keep sizes as written (`up` passes them on)."""
    size = byte_size_text if keep_text else byte_size
    ap.add_argument("--kv-offload-memory", type=size, default=None, metavar="SIZE",
                    help="host KV tier: blocks evicted from (and written through) the worker's pool "
                    "are kept in shared memory that every worker on this host reads, e.g. 8GiB")
    ap.add_argument("--kv-offload-memory-dir", default=None, metavar="DIR",
                    help="the host tier's shared-memory directory (default /dev/shm/pdserve-kv-USER)")
    ap.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                    help="disk KV tier: block files in DIR, kept across restarts, shareable by the "
                    "servers of one host")
    ap.add_argument("--kv-offload-disk", type=size, default=None, metavar="SIZE",
                    help="the disk tier's bound (default 16GiB; needs --kv-offload-dir)")
    ap.add_argument("--kv-remote-url", default=None, metavar="redis://HOST:PORT/DB",
                    help="remote KV tier shared across hosts: a Redis (pip install 'pdserve[redis]')")


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
        return KVOffloadConfig(memory_bytes=args.kv_offload_memory or 0,
                               memory_dir=args.kv_offload_memory_dir or "",
                               disk_dir=args.kv_offload_dir or "",
                               disk_bytes=args.kv_offload_disk or DEFAULT_DISK_BYTES,
                               remote_url=args.kv_remote_url or "")
    except ValueError as e:
        raise UsageError("--kv-remote-url" if "remote" in str(e) else "--kv-offload-memory", str(e)) from None


def tier_flags(args: argparse.Namespace) -> list[str]:
    """`up`'s tier flags as a worker's command line."""
    flags: list[str] = []
    for name in ("kv_offload_memory", "kv_offload_memory_dir", "kv_offload_dir", "kv_offload_disk",
                 "kv_remote_url"):
        value = getattr(args, name)
        if value:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags
