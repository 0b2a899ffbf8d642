"""Shared-memory hygiene: segments and liveness lock files of dead workers are swept,
nothing else is touched; a sender's lock file goes with it (close, or process exit)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kv_transfer import make_sender
from kv_transfer.pool.blocks import numpy_dtype
from kv_transfer.pool.shm import create_shm_pool, remove_segments_of, sweep_stale_segments
from kv_transfer.sender.sender import Sender
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
    from kv_transfer.pool.shm import LivenessLock, lock_holder_gone, watch_liveness

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


_SENDER_THEN_EXIT = """
import numpy as np
from kv_transfer import make_sender
from kv_transfer.pool.blocks import numpy_dtype
from tests.kv_transfer.harness import TINY
sender = make_sender(TINY, np.zeros(TINY.pool_shape(4), numpy_dtype(TINY)))
print(sender._liveness.name, flush=True)
"""  # exits without closing its sender


def _lock_name(sender: Sender) -> str:
    lock = sender._liveness  # what its Hello names to a same-host receiver
    assert lock is not None
    return lock.name


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_senders_liveness_lock_file_goes_on_close_and_at_exit() -> None:
    sender = make_sender(TINY, np.zeros(TINY.pool_shape(4), numpy_dtype(TINY)))
    path = Path("/dev/shm") / _lock_name(sender)
    assert path.exists()
    sender.close()
    assert not path.exists()
    # A process that ends without closing its sender removes the file on its way out.
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", _SENDER_THEN_EXIT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    name = done.stdout.strip()
    assert name.startswith("pdkvlive_") and not (Path("/dev/shm") / name).exists()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_the_next_sender_sweeps_lock_files_of_killed_processes() -> None:
    stale = Path("/dev/shm") / f"pdkvlive_{_dead_pid()}_{secrets.token_hex(6)}"
    live = Path("/dev/shm") / f"pdkvlive_{os.getpid()}_{secrets.token_hex(6)}"
    stale.write_bytes(b"")  # left by a sender killed with -9
    live.write_bytes(b"")
    sender = make_sender(TINY, np.zeros(TINY.pool_shape(4), numpy_dtype(TINY)))
    try:
        assert not stale.exists()
        assert live.exists()  # a live pid's is never touched
    finally:
        sender.close()
        for path in (stale, live):
            path.unlink(missing_ok=True)


def test_removing_one_dead_workers_segments_leaves_every_other(tmp_path: Path) -> None:
    """What `pdserve up` runs for a worker it saw die (pdserve/cli/up.py `_restart`)."""
    victim, other_dead, live = _dead_pid(), _dead_pid(), os.getpid()
    gone = [_name(victim), f"pdkvlive_{victim}_{secrets.token_hex(6)}"]
    keep = [_name(other_dead), _name(live), f"pdkv_{victim}_xyz", f"psm_{victim}"]
    for name in [*gone, *keep]:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(remove_segments_of(victim, str(tmp_path))) == sorted(gone)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)
    assert remove_segments_of(live, str(tmp_path)) == []  # a live process's are never touched
    assert remove_segments_of(victim, str(tmp_path / "absent")) == []
