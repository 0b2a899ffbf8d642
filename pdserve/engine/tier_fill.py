"""Blocks from the KV tiers read off the step loop, into blocks already allocated for them.

    fills.start(key, block_ids, digests)  # the leading run some tier has (`present`)
    fills.take(key)                       # PENDING until read; then what arrived, once
    fills.state(key)                      # decode: take, and copy it in when DONE

Which blocks the tiers have is an existence check (`PrefixTiers.present`), so the
caller promises them at once; reading and checking them runs on the tiers' loader
thread (one per cache: every read of an engine queues there) while the step loop goes
on. Two callers, one `TierFills` each, keyed their own way:

- a decode worker's suffix-only handoff (`LLMEngine.reserve_remote`, by request id)
  holds the prompt's leading blocks its pool has and, after them, those the tiers
  have; they are read while the prefill worker computes and ships the rest, and
  copied in (`state`, polled before the sequence is admitted). A block that is gone
  or bad by the time it is read fails the fill (FAILED): the request is retried, and
  the retry finds it a miss (a bad record was discarded);
- a prefill or colocated admission (`LLMEngine.tier_reads`, by sequence id) parks the
  sequence while its blocks are read (pdserve/engine/core/tier_reads.py); what `take`
  returns, the leading run of blocks that arrived whole, goes to the scheduler, which
  has the rest recomputed.

Only the loop ever writes the pool: a read's bytes are copied in on the loop, and a
dropped read (its request ended) never is. `on_done` (a worker's: the wake-up of its
main loop's idle wait) runs on the loader thread as each read ends, so an idle loop
takes the bytes at once. A read that has not landed within
`timeout_s` is given up (FAILED, nothing arrived) and logged once; its thread's
result, when it comes, is ignored.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, NamedTuple, TypeVar

import numpy as np

from pdserve.engine.pool_blocks import TierLink
from pdserve.engine.tier_api import BlockLoad

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0  # a tier read not landed by then is recomputed instead

K = TypeVar("K", bound=Hashable)

NO_LOAD = BlockLoad((), np.empty((0, 0), np.uint8), ())  # nothing arrived


class FillState(enum.Enum):
    NONE = "none"  # no fill (none started, or it ended DONE or FAILED and was reported)
    PENDING = "pending"  # being read
    DONE = "done"  # every promised block was read and checked
    FAILED = "failed"  # fewer arrived (gone, bad, the tier down, timed out): the rest is a miss


class FillResult(NamedTuple):
    """How a fill ended, and the leading blocks that arrived whole (all of them: DONE)."""

    state: FillState
    load: BlockLoad = NO_LOAD


class _Fill(NamedTuple):
    future: concurrent.futures.Future[np.ndarray]
    block_ids: tuple[int, ...]
    digests: tuple[bytes, ...]
    deadline: float


class TierFills(Generic[K]):
    """The pending reads of one engine's callers, by key (see the module docstring)."""

    def __init__(
        self,
        link: TierLink,
        timeout_s: float = READ_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the tier read timeout must be > 0, got {timeout_s}")
        self.link = link
        self.timeout_s = timeout_s
        self.clock = clock
        self.on_done = on_done  # called on the loader thread as each read ends
        self.num_timeouts = 0
        self._fills: dict[K, _Fill] = {}

    def __len__(self) -> int:
        return len(self._fills)

    def present(self, digests: Sequence[bytes]) -> int:
        return self.link.tiers.present(digests)

    def start(self, key: K, block_ids: Sequence[int], digests: Sequence[bytes]) -> None:
        """Read `digests` (which the tiers have) for `block_ids`, off the loop."""
        future = self.link.tiers.load_async(digests)
        self._fills[key] = _Fill(
            future, tuple(block_ids), tuple(digests), self.clock() + self.timeout_s
        )
        if self.on_done is not None:
            on_done = self.on_done
            future.add_done_callback(lambda _: on_done())

    def pending(self, key: K) -> bool:
        return key in self._fills

    def take(self, key: K) -> FillResult:
        """PENDING while the read runs; then, once, DONE or FAILED with the blocks that
        arrived (not copied anywhere); NONE after that and for a key without a fill."""
        fill = self._fills.get(key)
        if fill is None:
            return FillResult(FillState.NONE)
        if not fill.future.done():
            if self.clock() < fill.deadline:
                return FillResult(FillState.PENDING)
            self._timed_out(key, fill)
            return FillResult(FillState.FAILED)
        del self._fills[key]
        try:
            payloads = fill.future.result()
        except Exception:  # the tiers never raise; a cancelled or broken loader is a failed fill
            return FillResult(FillState.FAILED)
        n = min(len(payloads), len(fill.digests))
        load = BlockLoad(fill.block_ids[:n], payloads[:n], fill.digests[:n])
        return FillResult(FillState.DONE if n == len(fill.digests) else FillState.FAILED, load)

    def state(self, key: K) -> FillState:
        """`take`, the bytes copied into the blocks when every promised one arrived (DONE);
        FAILED copies nothing (the decode node retries the request)."""
        got = self.take(key)
        if got.state is FillState.DONE:
            self.link.load([got.load])
        return got.state

    def wait(self, key: K, timeout_s: float = 30.0) -> FillState:
        """Block until the read ends, then `state` (tests; the node polls)."""
        fill = self._fills.get(key)
        if fill is not None:
            concurrent.futures.wait([fill.future], timeout_s)
        return self.state(key)

    def wait_any(self, timeout_s: float) -> None:
        """Block until some pending read ends, at most `timeout_s` (a caller with nothing
        else to run: `LLMEngine.generate`)."""
        if self._fills:
            concurrent.futures.wait(
                [f.future for f in self._fills.values()],
                timeout_s,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )

    def drop(self, key: K) -> None:
        """The read's owner ended: its read, if still running, is ignored (it never writes the pool)."""
        fill = self._fills.pop(key, None)
        if fill is not None:
            fill.future.cancel()

    def _timed_out(self, key: K, fill: _Fill) -> None:
        self.drop(key)
        self.num_timeouts += 1
        self.link.tiers.timed_out(fill.digests)
        if self.num_timeouts == 1:
            log.warning(
                "KV tiers: a read of %d blocks did not land within %.1f s; its blocks are "
                "recomputed (further ones are only counted)",
                len(fill.digests),
                self.timeout_s,
            )
