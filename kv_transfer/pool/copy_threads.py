"""Helper threads that share one copy: numpy and the native kernel release the GIL."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

Work = Callable[[Sequence[Any]], None]


# Copies are memory-bound. A second thread on an idle core adds bandwidth, but on
# a busy machine (the model, the peer process and the zmq I/O threads all want a
# core) it measured no faster, so helpers are opt-in (`copy_threads=`).
DEFAULT_COPY_THREADS = 1


class CopyThreads:
    """Helper threads that take a share of each copy (numpy releases the GIL while it
    copies and sums, so the shares run in parallel). The calling thread copies its
    own share too, and every share is finished when `run` returns -- so callers
    keep their rule that no copy outlives the lock they hold around it."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = (ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kv-copy")
                      if self.threads > 1 else None)

    def run(self, work: Work, todo: Sequence[Any]) -> None:
        n = min(self.threads, len(todo))
        if self._pool is None or n < 2:
            work(todo)
            return
        futures = [self._pool.submit(work, todo[i::n]) for i in range(1, n)]
        try:
            work(todo[0::n])
        finally:
            wait(futures)
        for f in futures:
            f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


__all__ = ["DEFAULT_COPY_THREADS", "CopyThreads", "Work"]
