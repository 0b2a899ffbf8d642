"""Core policy on a shared host: the plan `pdserve up` pins workers to, a borrowing
worker's grant, and the hand-over by which a prefill and a decode worker run on each
other's cores while the other has nothing to compute."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.cli.up import borrows_cores, core_plan, core_settings, new_share_dir
from pdserve.cli.worker_args import WorkerArgs
from pdserve.common.roles import Role
from pdserve.worker.core_sharing import (
    CoreBorrower,
    CoreKeeper,
    CoreShareFile,
    CoreSharing,
    create_share_dir,
    share_path,
)
from pdserve.worker.cpu_cores import (
    CoreGrant,
    borrow_grant,
    format_cpu_list,
    parse_cpu_list,
    plan_cores,
)
from pdserve.worker.node_api import CoreDemand


def test_cpu_lists_parse_and_format_like_proc() -> None:
    assert parse_cpu_list("0-3,6") == (0, 1, 2, 3, 6)
    assert parse_cpu_list("5") == (5,)
    assert format_cpu_list((6, 0, 1, 2, 3)) == "0-3,6"
    assert format_cpu_list((1, 3, 4)) == "1,3-4"
    for bad in ("", "a", "3-1", "1,1", "1-", "-2"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_plan_gives_disjoint_consecutive_cores_in_start_order() -> None:
    assert plan_cores([0, 1], [1, 1]) == [(0,), (1,)]
    assert plan_cores([7, 2, 3, 5, 4], [2, 1, 2]) == [(2, 3), (4,), (5, 7)]
    assert plan_cores([0, 1, 2, 3], [2]) == [(0, 1)]  # spare cores stay unused
    assert plan_cores([0, 1], [1, 2]) is None  # 3 threads on 2 cores: nothing is pinned
    with pytest.raises(ValueError):
        plan_cores([0, 1], [0, 1])


def test_a_borrower_adds_the_lenders_cores_only_while_the_lender_is_idle() -> None:
    assert borrow_grant((1,), (0,), lender_idle=True) == CoreGrant((1, 0), 2)
    assert borrow_grant((1,), (0,), lender_idle=False) == CoreGrant((1,), 1)
    assert borrow_grant((2, 3), (0, 1), lender_idle=True) == CoreGrant((2, 3, 0, 1), 4)
    assert borrow_grant((1,), (1,), lender_idle=True) == CoreGrant((1,), 1)  # nothing to add


def _up_args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = dict(colocated=False, workers=1, prefill=1, decode=1, threads=1,
                                   prefill_threads=None, decode_threads=None, device="cpu",
                                   cpu_affinity="auto", no_core_borrowing=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_up_pins_when_threads_fit_and_borrows_with_one_prefill_and_one_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    args = _up_args(prefill_threads=1, decode_threads=3)
    assert core_plan(args) == [(0,), (1, 2, 3)]
    assert borrows_cores(args)
    settings = core_settings(args, [Role.PREFILL, Role.DECODE], "/dev/shm/x")
    assert settings == [{"cpu_cores": (0,), "core_share": "/dev/shm/x", "borrow_cores": (1, 2, 3)},
                        {"cpu_cores": (1, 2, 3), "core_share": "/dev/shm/x", "borrow_cores": (0,)}]
    argv = [WorkerArgs(**s).to_argv(role) for s, role in zip(settings, [Role.PREFILL, Role.DECODE], strict=True)]
    assert argv == [["--cpu-cores", "0", "--core-share", "/dev/shm/x", "--borrow-cores", "1-3"],
                    ["--cpu-cores", "1-3", "--core-share", "/dev/shm/x", "--borrow-cores", "0"]]
    assert not borrows_cores(_up_args(decode=2))  # which decode worker would borrow?
    assert not borrows_cores(_up_args(no_core_borrowing=True))
    assert core_plan(_up_args(threads=3)) is None  # 6 threads on 4 cores: unpinned
    assert core_plan(_up_args(cpu_affinity="off")) is None
    assert core_plan(_up_args(device="cuda")) is None
    with pytest.raises(SystemExit, match="do not fit"):
        core_plan(_up_args(threads=3, cpu_affinity="on"))


# What each node's core_demand() says (the nodes' own rules are checked end to end in
# tests/e2e/test_cpu_affinity.py).
IDLE = CoreDemand(keep=False, borrow=False)  # nothing, or a decode worker's reservation only
COMPUTING = CoreDemand(keep=True, borrow=True)
HANDING_OFF = CoreDemand(keep=True, borrow=False)  # a prompt done, its KV on the way to decode


def test_a_borrowing_worker_loads_openmp_counting_the_cores_it_may_borrow() -> None:
    """libgomp sizes its default team, and decides whether a team may spin, from the
    mask it loads under: a worker that may borrow loads torch pinned to both sets of
    cores, then runs on its own (a non-borrowing one counts its own only)."""
    host = sorted(os.sched_getaffinity(0))
    if len(host) < 2:
        pytest.skip("needs two cores to borrow one")
    probe = ("import os, sys; from pdserve.worker.cpu_cores import pin_at_start; "
             f"pin_at_start(({host[0]},), {tuple(host[1:2])!r} if sys.argv[1] == 'borrow' else ()); "
             "import torch; print(torch.get_num_threads(), sorted(os.sched_getaffinity(0)))")
    for mode, threads in (("borrow", 2), ("own", 1)):
        out = subprocess.run([sys.executable, "-c", probe, mode], capture_output=True, text=True, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": ""}).stdout.split(maxsplit=1)
        assert out == [str(threads), f"[{host[0]}]\n"], (mode, out)


def test_up_makes_a_sharing_directory_both_workers_open(tmp_path: Path) -> None:
    directory = new_share_dir(str(tmp_path))
    assert Path(directory).parent == tmp_path and Path(directory).name.startswith("pdserve-cores-")
    for role in (Role.PREFILL, Role.DECODE):
        share = CoreShareFile(share_path(directory, role))
        assert not share.want() and share.try_lock()
        share.close()


class Recorder:
    """The grants a worker applied, in one event list shared by both workers."""

    def __init__(self, role: str, events: list[str]) -> None:
        self.role, self.events = role, events

    def __call__(self, grant: CoreGrant) -> None:
        self.events.append(f"{self.role} on {format_cpu_list(grant.cores)}")


def _workers(tmp_path: Path, events: list[str], max_wait_s: float = 60.0,
             borrowed: list[str] | None = None) -> tuple[CoreSharing, CoreSharing]:
    """A prefill worker on core 0 and a decode worker on core 1, each able to borrow the other's,
    made as `share_cores` makes them."""
    directory = str(tmp_path / "cores")
    create_share_dir(directory)

    def side(role: Role, own: int, other: Role) -> CoreSharing:
        keeper = CoreKeeper(CoreShareFile(share_path(directory, role)), max_wait_s=max_wait_s)
        borrower = CoreBorrower(CoreShareFile(share_path(directory, other)), own=(own,), lendable=(1 - own,),
                                apply=Recorder(role.value, events))
        if borrowed is not None:
            borrower.widened = lambda: borrowed.append(role.value)
        return CoreSharing(keeper, borrower)

    return side(Role.PREFILL, 0, Role.DECODE), side(Role.DECODE, 1, Role.PREFILL)


def _in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run() -> None:
        fn()
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done


def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        threading.Event().wait(0.001)


def test_decode_runs_on_the_idle_prefill_workers_cores_and_gives_them_back_before_its_next_step(
    tmp_path: Path,
) -> None:
    events: list[str] = []
    borrowed: list[str] = []
    prefill, decode = _workers(tmp_path, events, borrowed=borrowed)
    prefill.after_step(IDLE)
    decode.before_step(IDLE)  # no stream yet: it borrows nothing
    assert events == []
    decode.before_step(COMPUTING)
    assert events == ["decode on 0-1"] and borrowed == ["decode"]
    decode.before_step(COMPUTING)  # still borrowing: no repeated grant
    assert events == ["decode on 0-1"]

    def prefill_step() -> None:
        prefill.before_step(COMPUTING)  # waits until the decode worker lets go
        events.append("prefill step")

    t, done = _in_thread(prefill_step)
    _until(decode.borrower.share.want)  # type: ignore[union-attr]  # its flag is up before it waits
    assert not done.is_set()
    decode.before_step(COMPUTING)  # the decode worker's next step
    t.join(timeout=30)
    assert done.is_set()
    assert events == ["decode on 0-1", "decode on 1", "prefill step"]
    assert prefill.keeper.share.held and not decode.borrower.share.held  # type: ignore[union-attr]
    assert prefill.borrower is not None and not prefill.borrower.share.held  # decode computes: not lent

    decode.before_step(COMPUTING)  # prefill still busy: decode stays on its own core
    assert events[-1] == "prefill step"
    prefill.after_step(IDLE)
    assert not prefill.keeper.share.held and not prefill.keeper.share.want()
    decode.before_step(COMPUTING)
    assert events[-1] == "decode on 0-1"
    decode.after_step(IDLE)  # its last stream ended: back to its own core, nothing held
    assert events[-1] == "decode on 1"
    assert not decode.keeper.share.held and not decode.borrower.share.held  # type: ignore[union-attr]


def test_prefill_runs_on_the_idle_decode_workers_cores_until_a_prompt_is_handed_off(tmp_path: Path) -> None:
    events: list[str] = []
    borrowed: list[str] = []
    prefill, decode = _workers(tmp_path, events, borrowed=borrowed)
    decode.after_step(IDLE)  # the decode worker holds only the request's reservation
    prefill.before_step(COMPUTING)
    assert events == ["prefill on 0-1"] and borrowed == ["prefill"]
    prefill.after_step(COMPUTING)  # a chunk of the prompt: still computing, still borrowing
    assert events == ["prefill on 0-1"]
    prefill.after_step(HANDING_OFF)  # the prompt is done: the decode step for it starts soon
    assert events == ["prefill on 0-1", "prefill on 0"]
    assert prefill.keeper.share.held and not prefill.borrower.share.held  # type: ignore[union-attr]
    prefill.before_step(HANDING_OFF)  # another prompt queued, but one is still on its way
    assert events[-1] == "prefill on 0"

    decode.before_step(HANDING_OFF)  # its KV arriving: it keeps its core, without any wait
    assert decode.keeper.share.held and decode.keeper.share.want()
    assert not decode.borrower.share.held  # type: ignore[union-attr]  # prefill has work: not lent
    prefill.before_step(COMPUTING)  # the decode worker's flag is up: no borrowing
    assert events[-1] == "prefill on 0" and borrowed == ["prefill"]


def test_a_worker_that_never_yields_delays_the_owner_only_by_the_bound(tmp_path: Path) -> None:
    events: list[str] = []
    prefill, decode = _workers(tmp_path, events, max_wait_s=0.05)
    decode.before_step(COMPUTING)
    assert decode.borrower is not None and decode.borrower.share.held
    prefill.before_step(COMPUTING)  # the decode worker is hung: no step will give back
    assert not prefill.keeper.share.held and prefill.keeper.gave_up
    prefill.before_step(COMPUTING)  # later steps only try the lock: no second wait
    assert prefill.keeper.gave_up
    decode.before_step(COMPUTING)  # it comes back and sees the flag
    assert events[-1] == "decode on 1" and not decode.borrower.share.held
    prefill.before_step(COMPUTING)
    assert prefill.keeper.share.held and not prefill.keeper.gave_up

    prefill.after_step(IDLE)
    decode.before_step(COMPUTING)  # borrows again, then hangs
    prefill.before_step(COMPUTING)
    assert prefill.keeper.gave_up
    prefill.after_step(IDLE)  # its work ended: the next claim waits the bound again
    waited = threading.Event()
    prefill.keeper.reclaim(waited.set)  # set from inside the wait loop only
    assert waited.is_set() and prefill.keeper.gave_up


def test_two_workers_each_holding_the_others_cores_both_get_their_own_back(tmp_path: Path) -> None:
    """Each waits for its own cores while the other holds them (a state only the bounded
    wait leads to): each gives back what it borrowed while it waits and once its own are
    back, so neither waits out its bound (60 s here)."""
    events: list[str] = []
    prefill, decode = _workers(tmp_path, events)
    assert prefill.borrower is not None and decode.borrower is not None
    prefill.borrower.try_borrow()
    decode.borrower.try_borrow()
    assert prefill.borrower.share.held and decode.borrower.share.held
    start = threading.Barrier(2)

    def step(side: CoreSharing) -> Callable[[], None]:
        return lambda: (start.wait(), side.before_step(COMPUTING))[-1]

    threads = [_in_thread(step(prefill)), _in_thread(step(decode))]
    for t, _ in threads:
        t.join(timeout=30)
    assert all(done.is_set() for _, done in threads)
    assert prefill.keeper.share.held and decode.keeper.share.held
    assert not prefill.keeper.gave_up and not decode.keeper.gave_up
    assert not prefill.borrower.share.held and not decode.borrower.share.held
    assert sorted(events[-2:]) == ["decode on 1", "prefill on 0"]


def test_a_lock_won_just_as_the_owner_raised_its_flag_is_handed_straight_back(tmp_path: Path) -> None:
    events: list[str] = []
    _, decode = _workers(tmp_path, events)
    assert decode.borrower is not None
    wants = iter([False, True])  # down when first read, up when re-read under the lock
    decode.borrower.share.want = lambda: next(wants)  # type: ignore[method-assign]
    decode.before_step(COMPUTING)
    assert events == [] and not decode.borrower.share.held


def test_a_restarted_worker_lowers_the_flag_its_killed_predecessor_left_up(tmp_path: Path) -> None:
    events: list[str] = []
    prefill, decode = _workers(tmp_path, events)
    prefill.before_step(COMPUTING)  # then killed: its flag stays up, its lock goes with it
    prefill.close()
    assert decode.borrower is not None and decode.borrower.share.want()
    CoreKeeper(CoreShareFile(share_path(str(tmp_path / "cores"), Role.PREFILL)))  # the replacement
    decode.before_step(COMPUTING)
    assert events[-1] == "decode on 0-1"
