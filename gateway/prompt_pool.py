"""Chat-template rendering and tokenization off the event loop, in bounded pools.

Rendering a template and tokenizing a long prompt take milliseconds to seconds of CPU;
on the event loop they would stall every other connection (`/health` included). So the
handlers run them here, after the cheap checks (a prompt's character count is checked
before it is tokenized: gateway/prompts.py), and before admission:

- two lanes, each a small thread pool with a bounded queue: prompts of at most
  `SMALL_CHARS` characters, and longer ones. A flood of huge prompts queues only behind
  itself; an ordinary prompt never waits for one.
- a full lane answers 503 with Retry-After, like a full admission queue.
- long texts are encoded through the tokenizer's GIL-releasing path
  (`Tokenizer.encode_bounded`), so a pool thread busy on one does not stall the loop.

A job whose caller went away (client disconnect) still runs to its end in its thread;
its result is dropped. The bounded queue is what bounds that work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gateway.errors import unavailable

T = TypeVar("T")

SMALL_CHARS = 16 << 10  # prompts up to this many characters use the small lane


class _Lane:
    def __init__(self, name: str, threads: int, queue: int) -> None:
        self.name = name
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix=f"pdserve-prompt-{name}")
        self.limit = threads + queue  # jobs running or waiting
        self.pending = 0


class PromptPool:
    """Where the gateway renders and tokenizes prompts; `run` from the event loop."""

    def __init__(self, threads: int, queue: int, retry_after_s: float = 1) -> None:
        self._small = _Lane("small", threads, queue)
        self._large = _Lane("large", threads, queue)
        self._retry_after_s = retry_after_s

    def pending(self, lane: str) -> int:
        return (self._small if lane == "small" else self._large).pending

    async def run(self, chars: int, fn: Callable[[], T]) -> T:
        """`fn()` in a thread of the lane for a prompt of `chars` characters; its result or
        its exception. A full lane: APIError 503."""
        lane = self._small if chars <= SMALL_CHARS else self._large
        if lane.pending >= lane.limit:
            raise unavailable(f"server overloaded: too many {lane.name} prompts being tokenized; retry later",
                              "overloaded", self._retry_after_s, "tokenizer_busy")
        lane.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(lane.executor, fn)
        finally:
            lane.pending -= 1

    def close(self) -> None:
        for lane in (self._small, self._large):
            lane.executor.shutdown(wait=False, cancel_futures=True)
