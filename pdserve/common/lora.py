"""A LoRA adapter as every process names it: the served name, where its PEFT checkpoint
lies, and a fingerprint of its bytes.

Plain stdlib, because the gateway (no torch) fingerprints adapters too: the fingerprint
travels in every request that selects the adapter (`pdserve/common/payload.py`), a worker
refuses to run it from files whose fingerprint differs, and it seeds the prefix-cache
chain (`pdserve/common/block_hash.py` `prefix_root`), so KV computed under one adapter is never
a cache hit under another or under the base model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_CHUNK = 1 << 20


class LoraError(ValueError):
    """An adapter that cannot be served (missing files, malformed, incompatible)."""


@dataclass(frozen=True)
class LoraRef:
    """One adapter, as a request carries it to the prefill and decode workers.

    name:        the name clients select it by (`"model": name`).
    path:        the PEFT checkpoint directory on the workers' host.
    fingerprint: hex SHA-256 of its config and weights (`adapter_fingerprint`).
    """

    name: str
    path: str
    fingerprint: str


def adapter_files(path: str | Path) -> tuple[Path, Path]:
    """(adapter_config.json, adapter_model.safetensors) of a PEFT checkpoint directory;
    LoraError naming what is missing."""
    root = Path(path)
    if not root.is_dir():
        raise LoraError(f"LoRA adapter path {str(path)!r} is not a directory")
    config, weights = root / ADAPTER_CONFIG, root / ADAPTER_WEIGHTS
    for f in (config, weights):
        if not f.is_file():
            raise LoraError(f"LoRA adapter {str(path)!r} has no {f.name}")
    return config, weights


def adapter_fingerprint(path: str | Path) -> str:
    """Hex SHA-256 over the adapter's config and weights files (length-prefixed, so the
    split between the two is part of the digest)."""
    h = hashlib.sha256(b"pdserve lora v1")
    for f in adapter_files(path):
        h.update(f.stat().st_size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def lora_ref(name: str, path: str | Path) -> LoraRef:
    """The reference of the adapter at `path`, served as `name` (its files fingerprinted)."""
    if not name:
        raise LoraError("a LoRA adapter needs a non-empty name")
    return LoraRef(name, str(Path(path).resolve()), adapter_fingerprint(path))
