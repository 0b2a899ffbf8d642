"""A decode reservation's blocks from the KV tiers, loaded while the rest is computed.

    n = fills.start(request_id, block_ids, digests)  # the leading run some tier has
    fills.state(request_id)                          # PENDING until read; DONE: copied in

A decode worker's suffix-only handoff holds the prompt's leading blocks its pool has
and, after them, those the tiers have (`LLMEngine.reserve_remote`). Which blocks the
tiers have is an existence check (`PrefixTiers.present`), so the reservation answers at
once; reading and checking them runs on the tiers' loader thread while the prefill
worker computes and ships the rest. The read bytes are copied into the reserved blocks
on the engine loop (`state`, polled before the sequence is admitted), so nothing but
the loop ever writes the pool here. A block that is gone or bad by the time it is read
fails the fill (FAILED): the request is retried, and the retry finds it a miss (a bad
record was discarded).
"""

from __future__ import annotations

import concurrent.futures
import enum
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pdserve.engine.pool_blocks import TierLink
from pdserve.engine.tier_api import BlockLoad


class FillState(enum.Enum):
    NONE = "none"  # no fill (none started, or it ended DONE or FAILED and was reported)
    PENDING = "pending"  # being read
    DONE = "done"  # read, checked and copied into the reserved blocks
    FAILED = "failed"  # a promised block could not be read: the request must be retried


class _Fill(NamedTuple):
    future: concurrent.futures.Future[list[np.ndarray]]
    block_ids: tuple[int, ...]
    digests: tuple[bytes, ...]


class TierFills:
    """The pending fills of one engine's reservations, by request id."""

    def __init__(self, link: TierLink) -> None:
        self.link = link
        self._fills: dict[str, _Fill] = {}

    def present(self, digests: Sequence[bytes]) -> int:
        return self.link.tiers.present(digests)

    def start(self, request_id: str, block_ids: Sequence[int], digests: Sequence[bytes]) -> None:
        """Read `digests` (which the tiers have) for `block_ids`, off the loop."""
        future = self.link.tiers.load_async(digests)
        self._fills[request_id] = _Fill(future, tuple(block_ids), tuple(digests))

    def pending(self, request_id: str) -> bool:
        return request_id in self._fills

    def state(self, request_id: str) -> FillState:
        """PENDING while the read runs; then, once, DONE (the bytes are in the blocks now)
        or FAILED; NONE after that and for a request without a fill."""
        fill = self._fills.get(request_id)
        if fill is None:
            return FillState.NONE
        if not fill.future.done():
            return FillState.PENDING
        del self._fills[request_id]
        try:
            payloads = fill.future.result()
        except Exception:  # the tiers never raise; a cancelled or broken loader is a failed fill
            return FillState.FAILED
        if len(payloads) < len(fill.digests):
            return FillState.FAILED
        self.link.load([BlockLoad(fill.block_ids, tuple(payloads), fill.digests)])
        return FillState.DONE

    def wait(self, request_id: str, timeout_s: float = 30.0) -> FillState:
        """Block until the request's read ends, then `state` (tests; the node polls)."""
        fill = self._fills.get(request_id)
        if fill is not None:
            concurrent.futures.wait([fill.future], timeout_s)
        return self.state(request_id)

    def drop(self, request_id: str) -> None:
        """The request ended: its read, if still running, is ignored (it never writes the pool)."""
        fill = self._fills.pop(request_id, None)
        if fill is not None:
            fill.future.cancel()
