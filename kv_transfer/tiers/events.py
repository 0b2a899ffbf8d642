"""What the tier writer did to the tiers, for the worker's KV events (vLLM's format,
pdserve/worker/vllm_events/): blocks it stored in a tier, and blocks this worker's own
bound enforcement evicted from one.

    log = TierEventLog()
    cache = build_tier_cache(config, layout, events=log)
    for change in log.drain(): ...   # the worker's main loop, after every tick

The writer thread appends (`stored` after a write succeeded, `removed` after files were
deleted); the thread that publishes the pool's events drains, so no socket is touched
off its thread. Consecutive changes of one kind to one tier join one `TierBlocks`, in
the order they happened. Bounded: past `max_blocks` undrained blocks a change is dropped,
counted and logged once (the writer never waits on the publisher).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass
class TierBlocks:
    """Blocks (prefix-cache digests) stored in, or evicted from, one tier."""

    tier: str  # KVTier.name: host | disk | remote
    stored: bool  # True: written to the tier; False: evicted from it
    digests: list[bytes] = field(default_factory=list)


class TierEventLog:
    """Thread-safe: the tier writer appends, the worker's main loop drains."""

    def __init__(self, max_blocks: int = 100_000) -> None:
        self.max_blocks = max_blocks
        self._events: list[TierBlocks] = []
        self._held = 0
        self._dropped = 0
        self._lock = threading.Lock()

    def stored(self, tier: str, digest: bytes) -> None:
        self._append(tier, True, [digest])

    def removed(self, tier: str, digests: list[bytes]) -> None:
        self._append(tier, False, digests)

    def drain(self) -> list[TierBlocks]:
        with self._lock:
            events, self._events, self._held = self._events, [], 0
        return events

    @property
    def dropped(self) -> int:
        """Block changes dropped because the log was full."""
        with self._lock:
            return self._dropped

    def _append(self, tier: str, stored: bool, digests: list[bytes]) -> None:
        with self._lock:
            full = self._held + len(digests) > self.max_blocks
            if full:
                first = self._dropped == 0
                self._dropped += len(digests)
            else:
                self._held += len(digests)
                last = self._events[-1] if self._events else None
                if last is not None and last.tier == tier and last.stored == stored:
                    last.digests.extend(digests)
                else:
                    self._events.append(TierBlocks(tier, stored, list(digests)))
        if full and first:
            log.warning("KV tier events: %d block changes not drained; further ones are dropped "
                        "(counted)", self.max_blocks)
