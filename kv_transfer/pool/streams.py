"""Copy streams and events: the ordering the staging and CUDA IPC paths rely on.

A `CopyStream` runs block copies in order, off the compute stream; a copy waits
for the KV it reads with `wait(ready)` (an event the compute stream recorded
after writing that KV: the GPU orders it, the host never blocks) and is known to
be done when the `CopyEvent` recorded after it completes. The sender waits on
that event *outside* its lock (sender.py), so `poll`/`cancel` never wait on a
copy.

`HostStream`/`HostEvent` are the CPU implementation: copies run when they are
enqueued, so an event is complete once recorded, unless a test holds the
stream's `gate` closed -- then every event recorded meanwhile completes only
when the gate opens, which is how CPU tests see what happens while a device
copy is still running. The CUDA implementation is in cuda_ipc.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol


class CopyEvent(Protocol):
    def synchronize(self) -> None:
        """Block the calling thread until the copies before this event are done."""
        ...

    def query(self) -> bool:
        """True once they are done (never blocks)."""
        ...


class CopyStream(Protocol):
    def wait(self, ready: Any) -> None:
        """Copies enqueued from now on start only after `ready` (an event of the stream that
        wrote the KV; None: already written) -- without blocking the host."""
        ...

    def record(self) -> CopyEvent:
        """An event that completes when everything enqueued so far is done."""
        ...


class HostEvent:
    """A CPU copy's completion: done at once, or when its gate opens."""

    def __init__(self, gate: threading.Event | None = None,
                 on_wait: Callable[[], None] | None = None) -> None:
        self._gate = gate
        self._on_wait = on_wait

    def synchronize(self) -> None:
        if self._on_wait is not None:
            self._on_wait()
        if self._gate is not None:
            self._gate.wait()

    def query(self) -> bool:
        return self._gate is None or self._gate.is_set()


class HostStream:
    """`CopyStream` for pools in host memory (the test double of a device pool).

    `gate`: while set to a cleared `threading.Event`, events recorded complete only
    once it is set. `on_wait`: called by every `synchronize` (tests check which locks
    are held there). Both are for tests; production code leaves them None."""

    def __init__(self) -> None:
        self.gate: threading.Event | None = None
        self.on_wait: Callable[[], None] | None = None
        self.waited: list[Any] = []  # the ready events copies were ordered after

    def wait(self, ready: Any) -> None:
        if ready is not None:
            self.waited.append(ready)
            ready.synchronize()  # host copies run now: what they read must be written first

    def record(self) -> CopyEvent:
        return HostEvent(self.gate, self.on_wait)
