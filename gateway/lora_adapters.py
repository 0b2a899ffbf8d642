"""The LoRA adapters the gateway serves by name (`--enable-lora --lora-modules name=path`,
`POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`).

A request selects one with `"model": "<adapter name>"`; the gateway attaches its
`LoraRef` (name, path, weights fingerprint) to the request, so the prefill worker, the
decode worker and any recovery attempt run it under the same weights, and the KV-aware
router keys its blocks by the adapter. An adapter is checked when it is added (its
config and tensor header: `pdserve/common/lora_checkpoint.py`); the workers check its shapes
against the model again when they first load it. An adapter in use by a request cannot
be unloaded.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.lora import LoraError, LoraRef, lora_ref
from pdserve.common.lora_checkpoint import plan_adapter


@dataclass(frozen=True)
class GatewayLoraConfig:
    """`--enable-lora` as the gateway sees it."""

    modules: tuple[tuple[str, str], ...] = ()  # (name, path) served from the start
    max_lora_rank: int = 16
    max_loras: int = 1  # the workers' bound on adapters in one step (reported in metrics)
    # Runtime loads must lie under this directory; None: any path the gateway can read.
    allowed_dir: str | None = None


class LoraAdapters:
    """Served adapters by name; mutated only on the gateway's event loop."""

    def __init__(self, config: GatewayLoraConfig, reserved_names: tuple[str, ...]) -> None:
        self.config = config
        self._reserved = frozenset(reserved_names)
        self._refs: dict[str, LoraRef] = {}
        self._in_use: Counter[str] = Counter()
        for name, path in config.modules:
            self.load(name, path, check_dir=False)

    def __contains__(self, name: object) -> bool:
        return name in self._refs

    def __iter__(self) -> Iterator[LoraRef]:
        return iter(list(self._refs.values()))

    def get(self, name: str) -> LoraRef | None:
        return self._refs.get(name)

    def load(self, name: str, path: str, *, check_dir: bool = True) -> LoraRef:
        """Serve the PEFT adapter at `path` as `name`; LoraError saying why not."""
        return self.add(self.check(name, path, check_dir=check_dir))

    def check(self, name: str, path: str, *, check_dir: bool = True) -> LoraRef:
        """The reference of the adapter at `path` as `name`, its files checked and
        fingerprinted; LoraError saying why not. Reads the files and changes nothing, so
        the HTTP handler runs it on a thread, off the event loop (`add` then serves it)."""
        if not name or len(name) > 256:
            raise LoraError("lora_name must be a non-empty string of at most 256 characters")
        if name in self._reserved:
            raise LoraError(f"lora_name {name!r} is the base model's name")
        if check_dir and self.config.allowed_dir is not None:
            root = Path(self.config.allowed_dir).resolve()
            if not Path(path).resolve().is_relative_to(root):
                raise LoraError(f"lora_path {path!r} is outside the allowed directory")
        plan_adapter(path, self.config.max_lora_rank)
        return lora_ref(name, path)

    def add(self, ref: LoraRef) -> LoraRef:
        """Serve `ref` (from `check`); LoraError when its name is taken meanwhile."""
        if ref.name in self._refs:
            raise LoraError(f"LoRA adapter {ref.name!r} is already loaded")
        self._refs[ref.name] = ref
        return ref

    def unload(self, name: str) -> None:
        if name not in self._refs:
            raise KeyError(name)
        if self._in_use[name]:
            raise LoraError(f"LoRA adapter {name!r} is in use by {self._in_use[name]} request(s)")
        del self._refs[name]

    def acquire(self, name: str) -> LoraRef:
        self._in_use[name] += 1
        return self._refs[name]

    def release(self, name: str) -> None:
        self._in_use[name] -= 1
        if self._in_use[name] <= 0:
            del self._in_use[name]

    def running(self) -> dict[str, int]:
        """Requests in the gateway per adapter name (the adapter metrics)."""
        return dict(self._in_use)
