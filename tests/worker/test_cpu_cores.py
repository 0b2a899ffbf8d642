"""Core policy on a shared host: the plan `pdserve up` pins workers to, the decode
worker's grant, and the lend/borrow hand-over between a prefill and a decode worker."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

import pytest

from pdserve.cli.up import borrows_cores, core_plan, core_settings
from pdserve.cli.worker_args import WorkerArgs
from pdserve.common.roles import Role
from pdserve.worker.core_sharing import CoreBorrower, CoreLender, CoreShareFile, create_share_file
from pdserve.worker.cpu_cores import (
    CoreGrant,
    borrow_grant,
    format_cpu_list,
    parse_cpu_list,
    plan_cores,
)


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


def test_decode_borrows_the_lenders_cores_only_while_it_is_idle() -> None:
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
    assert settings == [{"cpu_cores": (0,), "core_share": "/dev/shm/x"},
                        {"cpu_cores": (1, 2, 3), "core_share": "/dev/shm/x", "borrow_cores": (0,)}]
    argv = [WorkerArgs(**s).to_argv(role) for s, role in zip(settings, [Role.PREFILL, Role.DECODE], strict=True)]
    assert argv == [["--cpu-cores", "0", "--core-share", "/dev/shm/x"],
                    ["--cpu-cores", "1-3", "--core-share", "/dev/shm/x", "--borrow-cores", "0"]]
    assert not borrows_cores(_up_args(decode=2))  # which decode worker would borrow?
    assert not borrows_cores(_up_args(no_core_borrowing=True))
    assert core_plan(_up_args(threads=3)) is None  # 6 threads on 4 cores: unpinned
    assert core_plan(_up_args(cpu_affinity="off")) is None
    assert core_plan(_up_args(device="cuda")) is None
    with pytest.raises(SystemExit, match="do not fit"):
        core_plan(_up_args(threads=3, cpu_affinity="on"))


class FakeNode:
    role = Role.PREFILL

    def __init__(self) -> None:
        self.work = False

    def busy(self) -> bool:
        return self.work


class Recorder:
    """The grants the borrower applied, and when, in one event list shared with the lender."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def __call__(self, grant: CoreGrant) -> None:
        self.events.append(f"decode on {format_cpu_list(grant.cores)}")


def _pair(tmp_path: Path, events: list[str], max_wait_s: float = 60.0) -> tuple[CoreLender, CoreBorrower]:
    path = str(tmp_path / "cores")
    create_share_file(path)
    lender = CoreLender(CoreShareFile(path), max_wait_s=max_wait_s)
    borrower = CoreBorrower(CoreShareFile(path), own=(1,), lendable=(0,), apply=Recorder(events))
    return lender, borrower


def test_decode_gives_the_cores_back_before_the_next_prefill_step(tmp_path: Path) -> None:
    events: list[str] = []
    lender, borrower = _pair(tmp_path, events)
    prefill, decode = FakeNode(), FakeNode()
    lender.before_step(prefill)  # no work: nothing to take back
    lender.after_step(prefill)
    borrower.before_step(decode)
    assert events == ["decode on 0-1"] and borrower.share.held
    borrower.before_step(decode)  # still idle: no change, no repeated grant
    assert events == ["decode on 0-1"]

    prefill.work = True
    got_cores = threading.Event()

    def prefill_step() -> None:
        lender.before_step(prefill)  # blocks until the decode worker lets go
        events.append("prefill step")
        got_cores.set()

    t = threading.Thread(target=prefill_step)
    t.start()
    while not lender.share.want():  # the flag is up before the lender waits on the lock
        threading.Event().wait(0.001)
    assert not got_cores.is_set()
    borrower.before_step(decode)  # the decode worker's next step
    t.join(timeout=30)
    assert got_cores.is_set()
    assert events == ["decode on 0-1", "decode on 1", "prefill step"]
    assert lender.share.held and not borrower.share.held

    borrower.before_step(decode)  # prefill still busy: decode stays on its own core
    assert events[-1] == "prefill step"
    prefill.work = False
    lender.after_step(prefill)
    assert not lender.share.held and not lender.share.want()
    borrower.before_step(decode)
    assert events[-1] == "decode on 0-1"


def test_a_decode_worker_that_never_yields_delays_prefill_only_by_the_bound(tmp_path: Path) -> None:
    events: list[str] = []
    lender, borrower = _pair(tmp_path, events, max_wait_s=0.05)
    borrower.before_step(FakeNode())
    assert borrower.share.held
    prefill = FakeNode()
    prefill.work = True
    lender.before_step(prefill)  # the decode worker is hung: no step will release
    assert not lender.share.held and lender.gave_up
    lender.before_step(prefill)  # later steps only try the lock: no second wait
    assert lender.gave_up
    borrower.before_step(FakeNode())  # it comes back and sees the flag
    assert events[-1] == "decode on 1" and not borrower.share.held
    lender.before_step(prefill)
    assert lender.share.held and not lender.gave_up


def test_a_lock_won_just_as_prefill_raised_its_flag_is_handed_straight_back(tmp_path: Path) -> None:
    events: list[str] = []
    lender, borrower = _pair(tmp_path, events)
    wants = iter([False, True])  # down when first read, up when re-read under the lock
    borrower.share.want = lambda: next(wants)  # type: ignore[method-assign]
    borrower.before_step(FakeNode())
    assert events == [] and not borrower.share.held
