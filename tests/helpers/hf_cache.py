"""A Hugging Face hub cache laid out the way `huggingface_hub` writes one, for offline tests:
`<cache>/models--ORG--NAME/{blobs/<sha256>, refs/<revision>, snapshots/<commit>/<file> -> blob}`."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def add_to_cache(cache: Path, repo_id: str, source: Path, revision: str = "main") -> Path:
    """Copy every file of `source` into `cache` as the snapshot of `repo_id` at `revision`;
    returns the snapshot directory. Files are blobs named by content hash, linked from
    the snapshot, and `refs/<revision>` names the (made-up) commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for f in sorted(p for p in source.rglob("*") if p.is_file()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snapshot / f.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs" / revision).write_text(commit)
    return snapshot
