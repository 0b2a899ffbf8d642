"""Shared-memory hygiene: segments of dead workers are swept, nothing else is touched."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from kv_transfer.shm_pool import create_shm_pool, sweep_stale_segments
from tests.kv_transfer.harness import TINY


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _name(pid: int) -> str:
    return f"pdkv_{pid}_{secrets.token_hex(6)}"


def test_sweep_removes_dead_creators_segments_only(tmp_path: Path) -> None:
    dead, live = _dead_pid(), os.getpid()
    keep = [
        _name(live),  # a live worker's pool
        f"pdkv_{dead}_xyz",  # not our exact pattern
        f"pdkvx_{dead}_{secrets.token_hex(6)}",
        f"psm_{dead}",  # someone else's segment
        f"pdkv_{dead}_{secrets.token_hex(6)}.bak",
    ]
    # A dead worker's pool and a dead sender's liveness lock.
    stale = [_name(dead), f"pdkvlive_{dead}_{secrets.token_hex(6)}"]
    for name in [*keep, *stale]:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(sweep_stale_segments(str(tmp_path))) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)


def test_sweep_of_a_missing_directory_is_a_no_op(tmp_path: Path) -> None:
    assert sweep_stale_segments(str(tmp_path / "absent")) == []


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_creating_a_pool_sweeps_segments_of_killed_workers() -> None:
    stale = Path("/dev/shm") / _name(_dead_pid())
    live = Path("/dev/shm") / _name(os.getpid())
    stale.write_bytes(b"left by a worker killed with -9")
    live.write_bytes(b"ours, still in use")
    try:
        with create_shm_pool(TINY, 2) as pool:
            assert not stale.exists()
            assert live.exists()
            own = Path("/dev/shm") / pool.descriptor.name
            assert own.exists()
        assert not own.exists()  # the owner unlinks on a normal exit
    finally:
        for path in (stale, live):
            path.unlink(missing_ok=True)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_liveness_lock_reads_alive_until_its_holder_closes_it() -> None:
    from kv_transfer.shm_pool import LivenessLock, lock_holder_gone, watch_liveness

    lock = LivenessLock()
    fd = watch_liveness(lock.name)
    try:
        assert fd is not None
        assert not lock_holder_gone(fd)
        assert watch_liveness("psm_123") is None  # never opens names that are not ours
        lock.close()
        assert lock_holder_gone(fd)
        assert not (Path("/dev/shm") / lock.name).exists()
    finally:
        lock.close()
        if fd is not None:
            os.close(fd)
