"""The weights fingerprint: which tensor bytes a checkpoint holds, computed once and cached.

Two checkpoints with the same `config.json` (a base model and its fine-tune) must
not exchange KV blocks, so the KV compatibility hash covers this fingerprint.

    fp = fingerprint_files(model_dir, [model_dir / "model.safetensors"], user_cache_dir)
    fp.digest    # 16 hex digits
    fp.hashed    # the files whose bytes were read this time; () when all came from the cache

Each weight file is hashed whole (SHA-256 of every byte: the safetensors header with
tensor names, dtypes, shapes and offsets, then the tensor bytes), streamed in chunks,
shards in parallel.
Sampling a few tensors would be cheaper but unsound: a fine-tune may change one
layer only. Hashing is paid once per checkpoint: the per-file digests are cached in
`<model_dir>/.pdserve-weights.json`, or, when the model dir is read-only, in
`<user_cache_dir>/<hash of the model dir's path>.json`. A cached digest is reused
only while the file's name, size and mtime (ns) are unchanged.

A file modified in the same filesystem timestamp tick as it was hashed could keep
its size and mtime while its bytes changed (git's "racily clean" problem), so a
digest is cached only for a file whose mtime is older than the hash by more than
the coarsest common mtime granularity; a fresher file is simply hashed again next
time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CACHE_NAME = ".pdserve-weights.json"
CACHE_VERSION = 1
_CHUNK_BYTES = 8 << 20
_RACY_WINDOW_NS = 2_000_000_000  # FAT keeps mtimes to 2 s; ext4/xfs to a kernel tick
_MAX_CACHE_BYTES = 1 << 20  # thousands of shards fit; anything bigger is not ours


class FingerprintError(RuntimeError):
    """A weight file changed while it was being hashed, or could not be read."""


@dataclass(frozen=True)
class FileStamp:
    """What the cache is keyed by: the file's name (relative to the model dir), size, mtime."""

    name: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class WeightsFingerprint:
    digest: str  # 16 hex digits over every file's name and SHA-256
    hashed: tuple[str, ...]  # files whose bytes were read by this call, sorted
    cache_path: Path | None  # the cache file written or read; None when neither worked


def fingerprint_files(
    model_dir: Path, files: Sequence[Path], user_cache_dir: Path
) -> WeightsFingerprint:
    """The fingerprint of `files` (weight files inside `model_dir`), reusing cached digests."""
    stamps = [_stamp(model_dir, f) for f in sorted(set(files))]
    primary = model_dir / CACHE_NAME
    fallback = user_cache_dir / f"{hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]}.json"
    cached, cache_path = _read_cache(primary)
    if not cached:
        cached, cache_path = _read_cache(fallback)
    keep = {st.name: cached[st.name] for st in stamps if _matches(cached.get(st.name), st)}
    stale = [st for st in stamps if st.name not in keep]
    digests = {name: str(entry["sha256"]) for name, entry in keep.items()}
    if stale:
        started_ns = time.time_ns()
        for st, digest in zip(stale, _hash_files(model_dir, stale), strict=True):
            digests[st.name] = digest
            if started_ns - st.mtime_ns > _RACY_WINDOW_NS:
                keep[st.name] = {"size": st.size, "mtime_ns": st.mtime_ns, "sha256": digest}
        log.info("fingerprinted %d weight file(s) of %s", len(stale), model_dir)
        if any(st.name in keep for st in stale):
            cache_path = _write_cache(keep, (primary, fallback))
    combined = hashlib.sha256(b"pdserve-weights-v1\n")
    for name in sorted(digests):
        combined.update(f"{name}\0{digests[name]}\n".encode())
    return WeightsFingerprint(combined.hexdigest()[:16], tuple(st.name for st in stale), cache_path)


def _matches(entry: dict[str, Any] | None, st: FileStamp) -> bool:
    return entry is not None and (entry["size"], entry["mtime_ns"]) == (st.size, st.mtime_ns)


def _hash_files(model_dir: Path, stamps: list[FileStamp]) -> list[str]:
    """SHA-256 of each file, shards in parallel (hashlib and file reads release the GIL)."""
    with ThreadPoolExecutor(min(len(stamps), os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda st: _hash_file(model_dir / st.name, st), stamps))


def _stamp(model_dir: Path, path: Path) -> FileStamp:
    try:
        st = path.stat()
        name = str(path.relative_to(model_dir))
    except (OSError, ValueError) as e:
        raise FingerprintError(f"cannot fingerprint weight file {path}: {e}") from e
    return FileStamp(name, st.st_size, st.st_mtime_ns)


def _hash_file(path: Path, stamp: FileStamp) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            before = os.fstat(f.fileno())
            while chunk := f.read(_CHUNK_BYTES):
                h.update(chunk)
            after = os.fstat(f.fileno())
    except OSError as e:
        raise FingerprintError(f"cannot read weight file {path}: {e}") from e
    seen = {(s.st_size, s.st_mtime_ns) for s in (before, after)}
    if seen != {(stamp.size, stamp.mtime_ns)}:
        raise FingerprintError(f"weight file {path} changed while it was being fingerprinted")
    return h.hexdigest()


def _read_cache(path: Path) -> tuple[dict[str, dict[str, Any]], Path | None]:
    """Valid entries of one cache file; ({}, None) when it is absent, unreadable or malformed."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_CACHE_BYTES + 1)
        data = json.loads(raw) if len(raw) <= _MAX_CACHE_BYTES else None
    except (OSError, ValueError):
        return {}, None
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}, None
    files = data.get("files")
    if not isinstance(files, dict):
        return {}, None
    valid = {name: e for name, e in files.items() if _valid_entry(e)}
    return valid, path


def _valid_entry(e: Any) -> bool:
    return (
        isinstance(e, dict)
        and type(e.get("size")) is int
        and type(e.get("mtime_ns")) is int
        and isinstance(e.get("sha256"), str)
        and len(e["sha256"]) == 64
    )


def _write_cache(entries: dict[str, dict[str, Any]], candidates: tuple[Path, ...]) -> Path | None:
    """Write atomically to the first candidate that takes it (the model dir may be read-only)."""
    body = json.dumps({"version": CACHE_VERSION, "files": entries}, indent=1, sort_keys=True)
    for path in candidates:
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            with os.fdopen(fd, "w") as f:
                f.write(body + "\n")
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
            return path
        except OSError as e:
            log.debug("weights fingerprint cache %s not writable: %s", path, e)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    log.warning("weights fingerprint cache not writable in %s", ", ".join(str(p.parent) for p in candidates))
    return None
