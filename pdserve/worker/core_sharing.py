"""A prefill and a decode worker on one host run on each other's cores while the other has nothing to compute.

`pdserve up` makes a small directory (its path is passed to both workers) with one file
per role: `prefill` for the prefill worker's cores, `decode` for the decode worker's.
In each, byte 0 is its owner's "I want my cores" flag, and an exclusive `flock` on the
file is the right to run on those cores. The kernel drops the lock of a process that
dies, so a dead worker never keeps the other's cores.

Each worker keeps its own cores (`CoreKeeper`) and may run on the other's
(`CoreBorrower`, with `--borrow-cores`), as the node's `core_demand()` says: `keep`
while it computes or its work is on the way (a prefill worker's KV still being sent, a
decode worker's KV arriving: a decode worker only holding a reservation keeps nothing),
`borrow` while a step computes and nothing of its is on the way to the other worker (a
prefill worker that finished a prompt gives the decode worker's cores back at once,
before the decode worker's step for it can start).

Before each step:
1. borrowing and the owner's flag is up: back to its own cores, release the lock;
2. `keep` and not holding its own lock: raise its flag, take the lock, waiting at most
   `max_wait_s`. The borrower gives the cores back before its next step, so the wait
   is at most one of its steps; past the bound it runs anyway (a hung worker, or a
   borrowing prefill step longer than the bound: work that reaches the decode worker
   other than through that prefill worker's handoff, a local prefill or a request
   the gateway re-routes, can wait that long). While
   it waits, and once more after, it still gives back what it borrowed from a waiting
   owner, so two workers each holding the other's cores never wait out the bound;
3. `borrow`, not borrowing and the other's flag down: try the other's lock without
   waiting; with it, read the flag again (an owner that raised it meanwhile is never
   overrun: it finds the lock taken and waits for step 1), then widen to both sets.

After each step:
4. no `keep`: lower its flag and release its lock (the next claim waits its bound again);
5. no `borrow`: back to its own cores, release the other's lock.

So a step never runs on cores whose owner has work, except after the bounded wait.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from pdserve.common.roles import Role
from pdserve.worker.cpu_cores import CoreGrant, apply_grant, borrow_grant
from pdserve.worker.node_api import CoreDemand, Node, NodeWrapper

log = logging.getLogger(__name__)

_WANT, _IDLE = b"\x01", b"\x00"
SHARING_ROLES = (Role.PREFILL, Role.DECODE)


def _nothing() -> None:
    pass


class CoreShareFile:
    """The flag byte and the lock of one worker's cores."""

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


def create_share_dir(path: str) -> None:
    """The directory both workers open: one file per role, its flag down."""
    os.makedirs(path, exist_ok=True)
    for role in SHARING_ROLES:
        with open(share_path(path, role), "wb") as f:
            f.write(_IDLE)


def share_path(directory: str, role: Role) -> str:
    """The file of `role`'s cores in a core-sharing directory."""
    return str(Path(directory) / role.value)


class CoreBorrower:
    """Runs on another worker's cores too while it holds that worker's lock."""

    def __init__(self, share: CoreShareFile, own: Sequence[int], lendable: Sequence[int],
                 apply: Callable[[CoreGrant], None] = apply_grant, widened: Callable[[], None] = _nothing) -> None:
        self.share, self.own, self.lendable, self.apply = share, tuple(own), tuple(lendable), apply
        self.widened = widened  # counts each widening
        self.grant = borrow_grant(self.own, self.lendable, lender_idle=False)

    def give_back_if_wanted(self) -> None:
        if self.share.held and self.share.want():
            self.give_back()

    def give_back(self) -> None:
        if self.share.held:
            self._set(borrow_grant(self.own, self.lendable, lender_idle=False))
            self.share.unlock()

    def try_borrow(self) -> None:
        if self.share.held or self.share.want() or not self.share.try_lock():
            return
        if self.share.want():
            self.share.unlock()
        else:
            self._set(borrow_grant(self.own, self.lendable, lender_idle=True))
            self.widened()

    def _set(self, grant: CoreGrant) -> None:
        if grant != self.grant:
            self.apply(grant)
            self.grant = grant


class CoreKeeper:
    """Holds its own cores' lock while the node has something to compute."""

    def __init__(self, share: CoreShareFile, max_wait_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.share, self.max_wait_s, self.clock = share, max_wait_s, clock
        self.gave_up = False  # waited the bound once: until the lock comes, only try it
        self.wanted = False
        share.set_want(False)  # the flag is this process's: a killed predecessor's is void

    def reclaim(self, while_waiting: Callable[[], None]) -> None:
        if self.share.held:
            return
        if not self.wanted:
            self.share.set_want(True)
            self.wanted = True
        deadline = self.clock() + (0.0 if self.gave_up else self.max_wait_s)
        while not self.share.try_lock():
            if self.clock() >= deadline:
                if not self.gave_up:
                    log.warning("the other worker kept this worker's cores past %.2f s; "
                                "computing anyway", self.max_wait_s)
                self.gave_up = True
                return
            while_waiting()
            time.sleep(0.0005)
        self.gave_up = False

    def release(self) -> None:
        self.gave_up = False  # the next claim waits its bound again
        if self.wanted:
            self.share.set_want(False)
            self.wanted = False
        if self.share.held:
            self.share.unlock()


class CoreSharing:
    """One worker's side of the pair: its keeper, and its borrower when it borrows."""

    def __init__(self, keeper: CoreKeeper, borrower: CoreBorrower | None = None) -> None:
        self.keeper, self.borrower = keeper, borrower

    def before_step(self, demand: CoreDemand) -> None:
        if self.borrower is not None:
            self.borrower.give_back_if_wanted()
        if demand.keep:
            self.keeper.reclaim(self.borrower.give_back_if_wanted if self.borrower is not None else _nothing)
            if self.borrower is not None:
                self.borrower.give_back_if_wanted()  # an owner that raised its flag while this one waited
        if demand.borrow and self.borrower is not None:
            self.borrower.try_borrow()

    def after_step(self, demand: CoreDemand) -> None:
        if not demand.keep:
            self.keeper.release()
        if not demand.borrow and self.borrower is not None:
            self.borrower.give_back()

    def close(self) -> None:
        self.keeper.share.close()
        if self.borrower is not None:
            self.borrower.share.close()


class SharedCoresNode(NodeWrapper):
    """A node whose steps go through the core hand-over."""

    def __init__(self, node: Node, sharing: CoreSharing) -> None:
        super().__init__(node)
        self.sharing = sharing

    def step(self) -> bool:
        self.sharing.before_step(self.node.core_demand())
        worked = self.node.step()
        self.sharing.after_step(self.node.core_demand())
        return worked

    def close(self) -> None:
        try:
            self.node.close()
        finally:
            self.sharing.close()


def share_cores(node: Node, directory: str, own: Sequence[int], borrow: Sequence[int],
                apply: Callable[[CoreGrant], None] = apply_grant, widened: Callable[[], None] = _nothing) -> Node:
    """`node` keeping its cores through `directory` and, with `borrow` (the other worker's
    cores), running on those too while the other computes nothing (each grant applied
    with `apply`, each widening counted by `widened`)."""
    if node.role not in SHARING_ROLES:
        raise ValueError(f"core sharing is for a prefill and a decode worker, not {node.role}")
    other = Role.DECODE if node.role == Role.PREFILL else Role.PREFILL
    keeper = CoreKeeper(CoreShareFile(share_path(directory, node.role)))
    borrower = (CoreBorrower(CoreShareFile(share_path(directory, other)), own, borrow, apply, widened)
                if borrow else None)
    log.info("%s worker keeps its cores%s over %s", node.role,
             f" and borrows the idle {other} worker's" if borrower is not None else "", directory)
    return SharedCoresNode(node, CoreSharing(keeper, borrower))
