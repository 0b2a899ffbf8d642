"""What the tiers below a worker's KV pool are (`--kv-offload-*`, `--kv-remote-url`),
and building them for one pool layout."""

from __future__ import annotations

import getpass
import os
from dataclasses import dataclass

from kv_transfer.tiers.base import KVTier
from kv_transfer.tiers.cache import TieredKVCache
from kv_transfer.tiers.events import TierEventLog
from kv_transfer.tiers.files import FileTier
from pdserve.common.kv_layout import KVLayout

DEFAULT_DISK_BYTES = 16 << 30


def default_host_dir() -> str:
    """The host tier every worker of this user on this host shares (shared memory).
    The records' keys name the model and layout, so servers of different models may
    share it; `--kv-offload-memory-dir` gives one deployment its own."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"/dev/shm/pdserve-kv-{user}"


@dataclass(frozen=True)
class KVOffloadConfig:
    memory_bytes: int = 0  # host tier bound; 0: no host tier
    memory_dir: str = ""  # "": default_host_dir()
    disk_dir: str = ""  # "": no disk tier
    disk_bytes: int = DEFAULT_DISK_BYTES
    remote_url: str = ""  # redis://HOST:PORT/DB; "": no remote tier
    max_queued_writes: int = 0  # blocks the write queue holds; 0: WRITE_QUEUE_BYTES of them (at least 256)

    def __post_init__(self) -> None:
        if self.memory_bytes < 0 or self.disk_bytes <= 0:
            raise ValueError("tier sizes must be positive")
        if self.remote_url and not self.remote_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"--kv-remote-url must be redis://, rediss:// or unix://, got {self.remote_url!r}")

    @property
    def enabled(self) -> bool:
        return bool(self.memory_bytes or self.disk_dir or self.remote_url)


def build_tier_cache(config: KVOffloadConfig, layout: KVLayout,
                     events: TierEventLog | None = None) -> TieredKVCache | None:
    """The configured tiers in lookup order (host, disk, remote), or None if none are;
    with `events`, the writer reports what it stores and evicts there (tiers/events.py)."""
    if not config.enabled:
        return None
    tiers: list[KVTier] = []
    if config.memory_bytes:
        tiers.append(FileTier("host", config.memory_dir or default_host_dir(), config.memory_bytes))
    if config.disk_dir:
        tiers.append(FileTier("disk", config.disk_dir, config.disk_bytes))
    if config.remote_url:
        from kv_transfer.tiers.remote import RedisTier

        tiers.append(RedisTier(config.remote_url))
    return TieredKVCache(layout, tiers, config.max_queued_writes, events)
