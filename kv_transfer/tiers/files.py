"""A tier of block files in one directory: the host tier (a directory in /dev/shm,
i.e. shared memory every worker of the host maps) and the disk tier (a directory
kept across restarts) are both this class.

Layout: `DIR/<2 hex>/<64 hex key>.kv`, one record (tiers/record.py) per file.

Safe with any number of processes on one directory and with a kill -9 at any point:
- a record is written to a temporary `.<key>.<pid>.<random>.tmp` beside its final
  name, flushed, then `os.replace`d into place, so a reader sees a whole file or none;
  readers never open temporary names, and the record's length and checksum catch
  anything else (a torn page, a bad disk);
- two writers of one key write the same bytes; the last rename wins, harmlessly;
- temporaries a dead process left are removed when a tier opens the directory.

Bounded: every process counts what it wrote; when its count passes the bound it
rescans the directory (so what other processes wrote is counted too) and deletes
the least recently used files (a hit refreshes its file's mtime) down to 90%.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kv_transfer.tiers.base import TierStats
from kv_transfer.tiers.record import MissReason
from pdserve.common.pids import pid_alive

log = logging.getLogger(__name__)

SUFFIX = ".kv"
# Rescan at least every this many writes, so another process's writes are counted.
RESCAN_EVERY = 512
# A temporary file older than this is a leftover even if its pid was reused.
STALE_TMP_S = 600.0


class FileTier:
    """Block files under `root`, at most `capacity` bytes of them."""

    def __init__(self, name: str, root: str | os.PathLike[str], capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"the {name} tier needs a positive size, got {capacity}")
        self.name = name
        self.root = Path(root)
        self.location = os.path.realpath(self.root)
        self.capacity = capacity
        self.stats = TierStats(name)
        self._estimate = 0
        self._since_scan = 0
        self._on_evicted: Callable[[list[bytes]], None] | None = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._estimate = self._scan(clean=True)
        except OSError as e:
            # An unusable directory is a tier that misses and fails every write (counted).
            self.stats.write_failed(f"cannot use {self.root}: {e}")

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[:2] / f"{h}{SUFFIX}"

    def get(self, key: bytes, into: memoryview | None = None) -> bytes | memoryview | None:
        p = self.path(key)
        try:
            with open(p, "rb", buffering=0) as f:
                data = _read(f, into)
        except FileNotFoundError:
            self.stats.miss(MissReason.ABSENT)
            return None
        except OSError as e:
            self.stats.miss(MissReason.UNAVAILABLE, f"{p}: {e}")
            return None
        with contextlib.suppress(OSError):
            os.utime(p)  # recently used: evicted last
        return data

    def contains(self, key: bytes) -> bool:
        return self._exists(key, lookup=False)

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        return [self._exists(k, lookup=True) for k in keys]  # a stat each: microseconds

    def _exists(self, key: bytes, lookup: bool) -> bool:
        p = self.path(key)
        try:
            os.stat(p)
        except FileNotFoundError:
            return False
        except OSError as e:
            if lookup:
                self.stats.miss(MissReason.UNAVAILABLE, f"{p}: {e}")
            return False
        return True

    def discard(self, key: bytes) -> None:
        with contextlib.suppress(OSError):
            self.path(key).unlink()

    def put(self, key: bytes, record: bytes) -> bool:
        p = self.path(key)
        tmp = p.with_name(f".{p.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            p.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(record)
                f.flush()
            os.replace(tmp, p)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.stats.write_failed(f"{p}: {e}")
            return False
        self.stats.wrote(len(record))
        self._estimate += len(record)
        self._since_scan += 1
        if self._estimate > self.capacity or self._since_scan >= RESCAN_EVERY:
            self._enforce_bound()
        return True

    def watch_evictions(self, sink: Callable[[list[bytes]], None]) -> bool:
        self._on_evicted = sink
        return True

    def close(self) -> None:
        pass

    # ---------------------------------------------------------------- internals
    def _files(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every record file now in the directory."""
        out = []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if entry.name.endswith(SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat()
                        out.append((st.st_mtime, st.st_size, Path(entry.path)))
        return out

    def _scan(self, clean: bool = False) -> int:
        if clean:
            self._remove_stale_tmp()
        total = sum(size for _, size, _ in self._files())
        self.stats.set_stored(total)
        self._since_scan = 0
        return total

    def _enforce_bound(self) -> None:
        try:
            files = self._files()
        except OSError as e:
            self.stats.write_failed(f"cannot scan {self.root}: {e}")
            return
        total = sum(size for _, size, _ in files)
        removed: list[Path] = []
        freed = 0
        if total > self.capacity:
            goal = int(self.capacity * 0.9)
            for _, size, path in sorted(files):
                if total - freed <= goal:
                    break
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed.append(path)
                freed += size
        self.stats.set_stored(total)
        if removed:
            self.stats.evicted(len(removed), freed)
            if self._on_evicted is not None:
                self._on_evicted(_keys(removed))
        self._estimate = total - freed
        self._since_scan = 0

    def _remove_stale_tmp(self) -> None:
        now = time.time()
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if not entry.name.endswith(".tmp"):
                    continue
                parts = entry.name.split(".")
                pid = int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else 0
                with contextlib.suppress(OSError):
                    if not pid_alive(pid) or now - entry.stat().st_mtime > STALE_TMP_S:
                        os.unlink(entry.path)


def _keys(paths: list[Path]) -> list[bytes]:
    """The keys of record files (`<64 hex>.kv`); a name that is not one is skipped."""
    out = []
    for path in paths:
        with contextlib.suppress(ValueError):
            out.append(bytes.fromhex(path.name[: -len(SUFFIX)]))
    return out


def _read(f: io.FileIO, into: memoryview | None) -> bytes | memoryview:
    """The whole file: into `into` when it is the file's size (a record is immutable once
    renamed into place, so what fstat saw is what is read; a short read is returned
    short and checked as truncated), else as new bytes."""
    if into is None or os.fstat(f.fileno()).st_size != len(into):
        return f.readall()
    got = 0
    while got < len(into):
        n = f.readinto(into[got:])
        if not n:
            return into[:got]
        got += n
    return into
