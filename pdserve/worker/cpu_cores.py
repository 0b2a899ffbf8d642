"""Which cores each worker on a shared host runs on, and pinning a worker to them.

Policy (`pdserve up --cpu-affinity`, see docs/internals.md):

1. `plan_cores` gives the workers consecutive, disjoint slices of the cores this
   process may use, one core per torch thread, in start order (prefill workers,
   then decode workers). When the threads do not fit, nothing is pinned: the
   kernel's scheduler then shares the cores, which beats forcing two busy
   workers onto one core.
2. A worker pins itself at start (`pin_at_start`), before torch starts its
   thread pool, so every thread it ever makes inherits the mask. A worker that
   may borrow cores is first pinned to its own and the borrowable ones while
   torch loads: libgomp counts the cores it may use once, at load, and a team
   wider than that count barely spins (it waits on a futex at every parallel
   region).
3. With one prefill and one decode worker, each may also run on the other's
   cores while the other has nothing to compute (`borrow_grant`; the hand-over
   protocol is in pdserve/worker/core_sharing.py).

Pure functions here are what the tests check; `apply_grant` is the one place
that touches the process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import NamedTuple


class CoreGrant(NamedTuple):
    """The cores a worker runs on now and the torch threads it uses on them."""

    cores: tuple[int, ...]
    threads: int


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6), as /proc's Cpus_allowed_list writes it; ValueError otherwise."""
    cores: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: expected e.g. 0-3,6")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cores.extend(range(first, last + 1))
    if len(set(cores)) != len(cores):
        raise ValueError(f"CPU list {text!r} names a core twice")
    return tuple(cores)


def format_cpu_list(cores: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    parts: list[str] = []
    ordered = sorted(cores)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def plan_cores(host_cores: Sequence[int], threads: Sequence[int]) -> list[tuple[int, ...]] | None:
    """Disjoint core sets, one per worker (`threads[i]` cores for worker i), or None
    when the workers' threads do not fit the host's cores."""
    if any(n < 1 for n in threads):
        raise ValueError(f"every worker needs at least one thread, got {list(threads)}")
    ordered = sorted(host_cores)
    if sum(threads) > len(ordered):
        return None
    plan, start = [], 0
    for n in threads:
        plan.append(tuple(ordered[start : start + n]))
        start += n
    return plan


def borrow_grant(own: Sequence[int], lendable: Sequence[int], lender_idle: bool) -> CoreGrant:
    """A borrowing worker's cores: its own, plus the lender's while that one is idle."""
    cores = tuple(own) + (tuple(c for c in lendable if c not in own) if lender_idle else ())
    return CoreGrant(cores, len(cores))


def pin_process(cores: Sequence[int]) -> None:
    """Pin every thread of this process to `cores` (threads made later inherit it)."""
    for tid in _thread_ids():
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(tid, cores)


def pin_at_start(own: Sequence[int], borrowable: Sequence[int] = ()) -> None:
    """Pin this process to `own`, having loaded torch (and its OpenMP runtime) while
    pinned to `own` and `borrowable`, so that OpenMP counts the cores a borrowed grant adds."""
    wide = borrow_grant(own, borrowable, lender_idle=True).cores
    pin_process(wide)
    if len(wide) > len(own):
        import torch  # noqa: F401  # libgomp reads the affinity mask when it loads

        pin_process(own)


def apply_grant(grant: CoreGrant) -> None:
    """Run on `grant.cores` with `grant.threads` torch threads.

    Widening: the mask first, so threads torch starts for the larger count inherit it.
    Narrowing: the thread count first, so no parallel region is still sized for the
    cores being given back when they go.
    """
    import torch

    current = os.sched_getaffinity(0)
    if set(grant.cores) >= current:
        pin_process(grant.cores)
        torch.set_num_threads(grant.threads)
    else:
        torch.set_num_threads(grant.threads)
        pin_process(grant.cores)


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread only
        return [0]
