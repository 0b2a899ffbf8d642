"""Adapters read off the caller's thread: a worker's loop starts a read and keeps stepping
the other requests; between two steps it takes what finished and installs it
(`LLMEngine.install_lora`).

    loader = LoraLoader(registry.read)
    loader.start(ref)              # on a thread: read, check, convert (LoraRegistry.read)
    for done in loader.finished():  # later, on the loop: LoadDone(ref, weights, error)
        ...

One read at a time, on one thread: a second adapter waits for the first rather than
take a second core from the steps. Each fingerprint is read once however many requests
wait for it. A read that fails gives its `LoraError` message (or the exception's, for
anything else it raised) and no weights, so nothing of it can be installed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from pdserve.common.lora import LoraError, LoraRef
from pdserve.engine.lora.checkpoint import LoraWeights

log = logging.getLogger(__name__)


class LoadDone(NamedTuple):
    """A finished read: `weights` when it succeeded, else None and `error` says why."""

    ref: LoraRef
    weights: LoraWeights | None
    error: str


class LoraLoader:
    def __init__(self, read: Callable[[LoraRef], LoraWeights]) -> None:
        self._read = read
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        self._pending: dict[str, tuple[LoraRef, Future[LoraWeights]]] = {}

    def start(self, ref: LoraRef) -> None:
        """Read `ref` on the loader's thread, unless its fingerprint is being read already."""
        if ref.fingerprint not in self._pending:
            self._pending[ref.fingerprint] = (ref, self._pool.submit(self._read, ref))

    def reading(self, fingerprint: str) -> bool:
        return fingerprint in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def finished(self) -> list[LoadDone]:
        """The reads that ended since the last call, in the order they were started."""
        out = []
        for fp, (ref, fut) in list(self._pending.items()):
            if not fut.done():
                continue
            del self._pending[fp]
            err = fut.exception()
            if err is None:
                out.append(LoadDone(ref, fut.result(), ""))
            else:
                if not isinstance(err, LoraError):
                    log.warning("reading LoRA adapter %r failed", ref.name, exc_info=err)
                out.append(LoadDone(ref, None, str(err) or type(err).__name__))
        return out

    def close(self) -> None:
        """Drop the reads not yet started; do not wait for the one running."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pending.clear()
