"""Throttle libgomp's spin-waits at run time, for the thread governor's low state.

libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, at load. But its manual
(GOMP_SPINCOUNT) documents one rule it applies at every wait: "If there are more
OpenMP threads than available CPUs, 1000 and 100 spins for OMP_WAIT_POLICY being
ACTIVE or undefined, respectively" (instead of 300,000 or so) before a thread sleeps
on a futex. The count it compares is every OpenMP thread of the process, in every
host thread's pool; "available CPUs" is the affinity mask when libgomp loaded.

So `SpinThrottle.on(N)` starts a helper thread that runs one OpenMP region of
`cpu_count - N + 2` threads, then waits: its pool's threads stay docked (asleep) and
lift the process's count above the CPUs, so the worker's own N-thread team waits
almost passively from then on. `off()` ends the helper; libgomp frees its pool as the
thread exits, and the team spins again. Measured beside one busy process on 2 cores
(bench/README.md, "thread governor"): a throttled 2-thread team runs like one under
OMP_WAIT_POLICY=PASSIVE, and the pool-lifted count is visible as 2 more threads in
/proc/self/task while it is on.

Public interfaces only: torch.set_num_threads and an ordinary parallel tensor op in
the helper thread, no libgomp symbol. `available()` says whether the process's
OpenMP is libgomp (the rule is libgomp's); elsewhere the governor's low state is
1 thread.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_REGION_ELEMENTS = 1 << 20  # at::parallel_for's grain is 32,768: every thread gets a share


def available() -> bool:
    """True when torch runs its intra-op threads on libgomp (GNU OpenMP)."""
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return "libgomp" in maps


class SpinThrottle:
    """`on()`: the process's OpenMP threads spin 100 times, then sleep; `off()`: undone."""

    def __init__(self, cpus: int | None = None) -> None:
        self.cpus = cpus or os.cpu_count() or 1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def helper_threads(self, threads: int) -> int:
        """The helper's pool for a team of `threads`: 1 (the main thread) + (threads - 1)
        in its pool + (helper - 1) docked must exceed the CPUs."""
        return max(2, self.cpus - threads + 2)

    @property
    def engaged(self) -> bool:
        return self._thread is not None

    def on(self, threads: int) -> None:
        """Throttle the spin-waits of a team of `threads` (a no-op while on)."""
        if threads < 1:
            raise ValueError(f"a worker needs at least one thread, got {threads}")
        if self._thread is not None:
            return
        size = self.helper_threads(threads)
        ready = threading.Event()
        failed: list[BaseException] = []
        self._stop.clear()

        def hold() -> None:
            try:
                _open_pool(size)
            except BaseException as e:  # noqa: BLE001 - handed to on()'s caller
                failed.append(e)
            ready.set()
            self._stop.wait()

        self._thread = threading.Thread(target=hold, name="spin-throttle", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            self.off()
            raise RuntimeError("could not open the OpenMP pool that throttles spinning") from failed[0]

    def off(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join()


def _open_pool(threads: int) -> None:
    """One OpenMP region of `threads` threads in this (non-main) thread: libgomp keeps
    the pool for the thread's life. torch's count for threads started later is put back."""
    import torch

    before = torch.get_num_threads()  # this thread's first read: torch's process-wide count
    if before == threads:  # (set_num_threads also clears oneDNN's primitive cache)
        torch.ones(_REGION_ELEMENTS).add_(1.0)
        return
    torch.set_num_threads(threads)
    try:
        torch.ones(_REGION_ELEMENTS).add_(1.0)
    finally:
        torch.set_num_threads(before)
