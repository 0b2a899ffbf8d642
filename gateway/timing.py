"""Per-request stage timing.

Stages, in request order: `parse` (read and validate the body), `tokenize` (chat
template + encoding), `queue_wait` (admission), the stages the workers report
(`prefill_queue`, `prefill_compute`, `kv_transfer`, `decode_queue`, `decode`, see
gateway/backend.py), `backend_other` (time waiting on the backend that the workers did
not account for: network hops, routing, recovery), `detokenize`, and `respond`
(building and writing responses). `e2e` is the total from arrival to the last byte.

The gateway stages are measured back to back, so they add up to `e2e` up to the few
microseconds between measurements; the worker-reported stages plus `backend_other`
add up to the time the gateway spent waiting on the backend, unless the workers
report overlapping stages (layer-wise KV transfer overlaps prefill compute).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager


class RequestTimer:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.start = clock()
        self._stages: dict[str, float] = {}
        self._backend_wait = 0.0
        self._reported: dict[str, float] = {}

    def now(self) -> float:
        return self._clock()

    def elapsed(self) -> float:
        return self._clock() - self.start

    def add(self, stage: str, seconds: float) -> None:
        self._stages[stage] = self._stages.get(stage, 0.0) + seconds

    @contextmanager
    def measure(self, stage: str) -> Iterator[None]:
        t0 = self._clock()
        try:
            yield
        finally:
            self.add(stage, self._clock() - t0)

    def add_backend_wait(self, seconds: float) -> None:
        self._backend_wait += seconds

    def report(self, timings: Mapping[str, float] | None) -> None:
        """Worker-reported stage durations; the latest value per stage wins."""
        if timings:
            self._reported.update(timings)

    def result(self) -> dict[str, float]:
        """All stages in seconds, plus `e2e`."""
        out = dict(self._stages)
        out.update(self._reported)
        other = self._backend_wait - sum(self._reported.values())
        if other > 0 or not self._reported:
            out["backend_other"] = max(other, 0.0)
        out["e2e"] = self.elapsed()
        return out
