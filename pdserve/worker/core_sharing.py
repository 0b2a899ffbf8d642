"""A prefill worker lends its cores to the decode worker beside it while it has no work.

The two share one small file that `pdserve up` creates (its path is passed to both
workers): byte 0 is the prefill worker's "I want my cores" flag, and an exclusive
`flock` on the file is the right to run on the prefill worker's cores. The kernel
drops the lock of a process that dies, so a dead decode worker never keeps them.

Prefill (`CoreLender`), around each node step:
1. it holds work (`node.busy()`) and not the lock: raise the flag, then take the
   lock, waiting at most `max_wait_s`. The decode worker gives the cores back at
   the start of its next step, so the wait is at most one decode step; past the
   bound (a hung decode worker) the prefill worker runs anyway.
2. no work left after the step: lower the flag and release the lock.

Decode (`CoreBorrower`), before each node step:
1. holding the lock and the flag is up: back to its own cores, release the lock.
2. not holding it and the flag is down: try the lock without waiting; with it, read
   the flag again (a prefill worker that raised it meanwhile is never overrun: it
   finds the lock taken and waits for step 1), then widen to both workers' cores.

So a prefill step never runs while the decode worker uses the lent cores, except
after the bounded wait.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Sequence

from pdserve.common.roles import Role
from pdserve.worker.cpu_cores import CoreGrant, apply_grant, borrow_grant
from pdserve.worker.node_api import Node, NodeWrapper

log = logging.getLogger(__name__)

_WANT, _IDLE = b"\x01", b"\x00"


class CoreShareFile:
    """The flag byte and the lock of one lender/borrower pair."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR)
        self.held = False

    def want(self) -> bool:
        return os.pread(self.fd, 1, 0) == _WANT

    def set_want(self, want: bool) -> None:
        os.pwrite(self.fd, _WANT if want else _IDLE, 0)

    def try_lock(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.held = True
        return True

    def unlock(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.held = False

    def close(self) -> None:
        os.close(self.fd)  # drops the lock too


def create_share_file(path: str) -> None:
    """The file both workers open: one flag byte, down."""
    with open(path, "wb") as f:
        f.write(_IDLE)


class CoreLender:
    """Prefill side: keeps the lock while the node holds work."""

    def __init__(self, share: CoreShareFile, max_wait_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.share, self.max_wait_s, self.clock = share, max_wait_s, clock
        self.gave_up = False  # waited the bound once: until the lock comes, only try it

    def before_step(self, node: Node) -> None:
        if self.share.held or not node.busy():
            return
        self.share.set_want(True)
        deadline = self.clock() + (0.0 if self.gave_up else self.max_wait_s)
        while not self.share.try_lock():
            if self.clock() >= deadline:
                if not self.gave_up:
                    log.warning("the decode worker kept the lent cores past %.2f s; "
                                "prefilling anyway", self.max_wait_s)
                self.gave_up = True
                return
            time.sleep(0.0005)
        self.gave_up = False

    def after_step(self, node: Node) -> None:
        if not node.busy():
            self.share.set_want(False)
            if self.share.held:
                self.share.unlock()


class CoreBorrower:
    """Decode side: runs on the lender's cores too while it holds the lock."""

    def __init__(self, share: CoreShareFile, own: Sequence[int], lendable: Sequence[int],
                 apply: Callable[[CoreGrant], None] = apply_grant) -> None:
        self.share, self.own, self.lendable, self.apply = share, tuple(own), tuple(lendable), apply
        self.grant = borrow_grant(self.own, self.lendable, lender_idle=False)

    def before_step(self, node: Node) -> None:
        if self.share.held:
            if self.share.want():
                self._set(borrow_grant(self.own, self.lendable, lender_idle=False))
                self.share.unlock()
        elif not self.share.want() and self.share.try_lock():
            if self.share.want():
                self.share.unlock()
            else:
                self._set(borrow_grant(self.own, self.lendable, lender_idle=True))

    def after_step(self, node: Node) -> None:
        pass

    def _set(self, grant: CoreGrant) -> None:
        if grant != self.grant:
            self.apply(grant)
            self.grant = grant


class SharedCoresNode(NodeWrapper):
    """A node whose steps go through a lender's or borrower's hand-over."""

    def __init__(self, node: Node, side: CoreLender | CoreBorrower) -> None:
        super().__init__(node)
        self.side = side

    def step(self) -> bool:
        self.side.before_step(self.node)
        worked = self.node.step()
        self.side.after_step(self.node)
        return worked

    def close(self) -> None:
        try:
            self.node.close()
        finally:
            self.side.share.close()


def share_cores(node: Node, path: str, own: Sequence[int], borrow: Sequence[int],
                apply: Callable[[CoreGrant], None] = apply_grant) -> Node:
    """`node` lending its cores (prefill) or borrowing the prefill worker's (decode, which
    applies each grant with `apply`)."""
    share = CoreShareFile(path)
    side: CoreLender | CoreBorrower
    if node.role == Role.DECODE:
        side = CoreBorrower(share, own, borrow, apply)
    else:
        side = CoreLender(share)
    log.info("%s worker %s cores over %s", node.role,
             "borrows the prefill worker's" if node.role == Role.DECODE else "lends its", path)
    return SharedCoresNode(node, side)
