"""The file tier (kv_transfer/tiers/files.py) with real processes: bounded LRU, two
writers on one directory, a kill -9 in the middle of a write, a write the OS refuses
(a full file system), and what a dead writer left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from kv_transfer.tiers.files import FileTier

ROOT = Path(__file__).resolve().parents[2]


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def python(code: str, **kw: object) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)  # type: ignore[call-overload]


def test_put_get_and_lru_eviction_down_to_the_bound(tmp_path: Path) -> None:
    tier = FileTier("disk", tmp_path, capacity=10_000)
    for i in range(5):
        assert tier.put(key(i), bytes([i]) * 1000)
    for i in range(5):  # written long ago, in this order
        os.utime(tier.path(key(i)), (1e9 + i, 1e9 + i))
    assert tier.get(key(0)) == b"\x00" * 1000  # a hit: now the most recently used
    for i in range(5, 12):
        assert tier.put(key(i), bytes([i]) * 1000)
    on_disk = sum(f.stat().st_size for f in tmp_path.rglob("*.kv"))
    assert on_disk <= 10_000
    assert tier.contains(key(0)) and not tier.contains(key(1))
    assert tier.stats.snapshot().evictions >= 2
    assert tier.get(key(1)) is None and tier.stats.snapshot().misses == {"absent": 1}


def test_a_record_of_the_expected_size_is_read_into_the_callers_buffer(tmp_path: Path) -> None:
    tier = FileTier("host", tmp_path, capacity=1 << 20)
    assert tier.put(key(0), bytes(range(200)) * 5)
    buf = bytearray(1000)
    into = memoryview(buf)
    assert tier.get(key(0), into) is into and bytes(buf) == bytes(range(200)) * 5
    other = memoryview(bytearray(999))  # another size: the file's own bytes, buffer untouched
    assert tier.get(key(0), other) == bytes(range(200)) * 5 and bytes(other) == bytes(999)
    assert tier.get(key(1), into) is None and tier.stats.snapshot().misses == {"absent": 1}


def test_two_processes_writing_one_directory_leave_only_sound_files(tmp_path: Path) -> None:
    code = f"""
        from kv_transfer.tiers.files import FileTier
        import sys
        t = FileTier("disk", {str(tmp_path)!r}, 1 << 30)
        me = int(sys.argv[1])
        for i in range(300):
            k = (i % 50).to_bytes(4, "big") * 8  # both write the same 50 keys over and over
            assert t.put(k, bytes([i % 50]) * (4096 + (i % 50)))
            got = t.get(k)
            assert got is not None and got == bytes([i % 50]) * (4096 + (i % 50)), "torn read"
        print("ok")
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(n)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and out.strip() == "ok", err
    tier = FileTier("disk", tmp_path, 1 << 30)
    for i in range(50):
        assert tier.get(key(i)) == bytes([i]) * (4096 + i)
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_kill_9_mid_write_is_never_read_and_its_leftover_is_removed(tmp_path: Path) -> None:
    # The child writes half a record to its temporary file, says so, and waits to be killed.
    code = f"""
        import os, sys
        import kv_transfer.tiers.files as files
        t = files.FileTier("disk", {str(tmp_path)!r}, 1 << 30)
        real_open = open
        class Half:
            def __init__(self, f): self.f = f
            def __enter__(self): return self
            def __exit__(self, *a): self.f.close()
            def write(self, b):
                self.f.write(b[: len(b) // 2]); self.f.flush()
                print("half", flush=True); sys.stdin.read()  # killed here
        files.open = lambda p, m: Half(real_open(p, m))
        t.put(bytes(32), b"x" * 100_000)
    """
    child = python(code, stdin=subprocess.PIPE)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "half"
    tmps = list(tmp_path.rglob("*.tmp"))
    assert len(tmps) == 1 and 0 < tmps[0].stat().st_size < 100_000
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    reader = FileTier("disk", tmp_path, 1 << 30)  # opening the directory sweeps the dead writer's file
    assert reader.get(bytes(32)) is None
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_write_the_file_system_refuses_is_a_counted_failure_with_nothing_left(tmp_path: Path) -> None:
    # RLIMIT_FSIZE makes the kernel refuse the write (EFBIG), as a full disk does (ENOSPC).
    code = f"""
        import resource, signal
        from kv_transfer.tiers.files import FileTier
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        t = FileTier("disk", {str(tmp_path)!r}, 1 << 30)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        ok = t.put(bytes(32), b"x" * 100_000)
        s = t.stats.snapshot()
        print(ok, s.write_failures, s.writes)
    """
    child = python(code)
    out, err = child.communicate(timeout=60)
    assert out.split() == ["False", "1", "0"], err
    assert "could not be written" in err  # logged once
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.kv"))
