"""`--thread-policy adaptive`: a node whose engine steps run with the thread count the
governor (pdserve/worker/thread_governor.py) picks, timed and reported to it.

`GovernedNode` wraps the role's node itself, inside any core-sharing wrapper, so a
step's time is the engine's alone (not a lender's wait for its cores). A step's
size is the growth of `NodeLoad.tokens`, read in `load()`, which the main loop
calls after every tick; a step that computed no token (a decode node only polling
its KV transfers) is not observed. The governor itself lives as long as the process (its
thread pool does), across role flips; each node reports to its role's metrics.

With core borrowing (pdserve/worker/core_sharing.py) the borrower's grant is the ceiling:
`governed_grant` applies a grant with the count the governor wants under it.

`governor_for` gives the governor a low state of N throttled threads
(pdserve/worker/spin_throttle.py) where torch runs on libgomp and the environment left the
wait policy to libgomp; otherwise its low state is 1 thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from pdserve.worker.cpu_cores import CoreGrant, apply_grant
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.node_api import Node, NodeLoad, NodeWrapper
from pdserve.worker.spin_throttle import SpinThrottle, available
from pdserve.worker.thread_governor import ThreadGovernor

log = logging.getLogger(__name__)


class GovernedNode(NodeWrapper):
    """`node`, each step at the governor's thread count; its time and size observed."""

    def __init__(self, node: Node, governor: ThreadGovernor, metrics: WorkerMetrics,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(node)
        self.governor, self.metrics, self.timer = governor, metrics, timer
        self._tokens: int | None = None  # NodeLoad.tokens before the unobserved step
        self._pending: float | None = None  # seconds of a step not yet observed
        metrics.torch_threads.set(governor.applied)

    def step(self) -> bool:
        if self._pending is not None:  # nobody read the load since the last step
            self.load()
        if self._tokens is None:
            self._tokens = self.node.load().tokens
        self.metrics.torch_threads.set(self.governor.before_step())
        start = self.timer()
        worked = self.node.step()
        if worked:
            self._pending = self.timer() - start
        return worked

    def load(self) -> NodeLoad:
        load = self.node.load()
        tokens = load.tokens - (self._tokens if self._tokens is not None else load.tokens)
        if self._pending is not None and tokens > 0:  # a step that only moved KV computed nothing
            switch = self.governor.observe(tokens, self._pending)
            if switch is not None:
                self.metrics.count_thread_switch(switch.reason)
        self._pending, self._tokens = None, load.tokens
        return load


def governed_grant(governor: ThreadGovernor,
                   apply: Callable[[CoreGrant], None] = apply_grant) -> Callable[[CoreGrant], None]:
    """A borrower's `apply`: the grant's cores, with the governor's count under its threads."""

    def apply_governed(grant: CoreGrant) -> None:
        apply(CoreGrant(grant.cores, governor.set_ceiling(grant.threads)))

    return apply_governed


def governor_for(threads: int) -> ThreadGovernor:
    """The governor of a worker of `threads` threads, its low state throttled N where it can."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().lower()
    spin = SpinThrottle() if threads > 1 and policy in ("", "active") and available() else None
    governor = ThreadGovernor(threads, spin=spin)
    log.info("thread policy adaptive: %d spinning torch threads or %s per step, whichever runs faster",
             threads, f"{threads} throttled" if spin is not None else "1")
    return governor
