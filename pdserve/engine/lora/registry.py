"""The adapters one model runner can serve: at most `max_loras` resident (in the compute
dtype, on the runner's device, ready for a step) and an LRU of at most `max_cpu_loras`
checked adapters in host memory behind them.

    registry.register(ref)        # read + check the files (LoraError: nothing kept)
    weights = registry.activate({fp1, fp2})   # make a step's adapters resident

A worker reads an adapter off its loop instead (pdserve/engine/lora/loader.py,
pdserve/worker/lora_loading.py): `read(ref)` touches no registry state, so it runs on a
thread, and `install(ref, weights)` keeps the result between two steps. Host copies are
held in the compute dtype, so making one resident on the CPU converts nothing. The host
LRU never drops an adapter that a queued or running request still needs (`keep`): it
may exceed `max_cpu_loras` by those until they end (the engine trims it after each step),
rather than read one again on the loop.

An adapter is keyed by its weights fingerprint (`pdserve/common/lora.py`), never by its name:
two requests that name the same adapter but reach the runner with different files are
different adapters. `register` refuses files whose fingerprint is not the one the
request carries (the compatibility check across prefill and decode). An adapter
evicted from both tiers is read again from its path when a request needs it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import torch

from pdserve.common.lora import LoraError, LoraRef, adapter_fingerprint
from pdserve.engine.core.sequence import Sequence
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.lora.batch import LoraStack
from pdserve.engine.lora.checkpoint import LoraWeights, load_lora
from pdserve.engine.lora.config import LoraConfig, LoraStats


@dataclass(frozen=True)
class LoraCounts:
    """Loads from disk, promotions to resident and evictions so far (metrics)."""

    loads: int
    activations: int
    evictions: int
    resident: int
    cached: int


_STACKS = 1  # the current set: a changed set is restacked (its bytes count twice in `pdserve plan`)


class LoraRegistry:
    def __init__(self, config: LoraConfig, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config
        self.model_config = model_config
        self.dtype = dtype
        self.device = device
        self._refs: dict[str, LoraRef] = {}
        self._cpu: OrderedDict[str, LoraWeights] = OrderedDict()
        self._resident: OrderedDict[str, LoraWeights] = OrderedDict()
        self._loads = self._activations = self._evictions = 0
        # Stacks of recent adapter sets (a decode batch runs the same set step after step).
        self._stacks: OrderedDict[tuple[str, ...], LoraStack] = OrderedDict()

    def register(self, ref: LoraRef, keep: Collection[str] = ()) -> None:
        """Make `ref` servable: read and check its files unless already held. LoraError
        (nothing kept) when they are malformed, too big, or not the fingerprinted ones."""
        if self.holds(ref.fingerprint):
            self._refs.setdefault(ref.fingerprint, ref)
            self._touch(ref.fingerprint)
            return
        self.install(ref, self.read(ref), keep)

    def read(self, ref: LoraRef) -> LoraWeights:
        """`ref`'s files read, checked and converted to the compute dtype, in host memory;
        LoraError when they cannot be served. Reads no registry state and changes none, so
        it may run on any thread."""
        actual = adapter_fingerprint(ref.path)
        if actual != ref.fingerprint:
            raise LoraError(f"LoRA adapter {ref.name!r} at {ref.path!r} has fingerprint "
                            f"{actual[:16]}…, the request expects {ref.fingerprint[:16]}… "
                            f"(its files changed)")
        weights = load_lora(ref.path, actual, self.model_config, self.config.max_lora_rank)
        return weights.to(self.dtype, torch.device("cpu"))

    def install(self, ref: LoraRef, weights: LoraWeights, keep: Collection[str] = ()) -> None:
        """Hold `weights` (`read(ref)`'s result) in host memory; the least recently used
        others not in `keep` give way."""
        if weights.fingerprint != ref.fingerprint:
            raise ValueError(f"weights {weights.fingerprint[:16]}… are not adapter {ref.name!r}")
        self._loads += 1
        self._cache(weights, keep)
        self._refs[ref.fingerprint] = ref

    def over_bound(self) -> bool:
        """More adapters in host memory than `max_cpu_loras` (kept for queued requests)."""
        return len(self._cpu) > self.config.cpu_slots

    def trim(self, keep: Collection[str]) -> None:
        """Back within `max_cpu_loras`, least recently used first, keeping `keep`."""
        spare = [fp for fp in self._cpu if fp not in keep]
        while len(self._cpu) > self.config.cpu_slots and spare:
            del self._cpu[spare.pop(0)]
            self._evictions += 1

    def holds(self, fingerprint: str) -> bool:
        """Resident or in host memory: a request under it needs no read."""
        return fingerprint in self._cpu or fingerprint in self._resident

    def knows(self, fingerprint: str) -> bool:
        return fingerprint in self._refs

    def held(self) -> tuple[str, ...]:
        """Fingerprints of the adapters resident or in host memory (no disk read needed)."""
        return tuple(sorted(set(self._resident) | set(self._cpu)))

    def activate(self, fingerprints: Collection[str]) -> dict[str, LoraWeights]:
        """The step's adapters, resident; the least recently used others give way."""
        if len(fingerprints) > self.config.max_loras:
            raise ValueError(f"{len(fingerprints)} adapters in one step, max_loras is "
                             f"{self.config.max_loras}")
        out = {}
        for fp in fingerprints:
            w = self._resident.get(fp)
            if w is None:
                w = self._promote(fp, keep=fingerprints)
            self._resident.move_to_end(fp)
            out[fp] = w
        return out

    def stack(self, fingerprints: Collection[str]) -> LoraStack:
        """The step's adapters resident and stacked (`pdserve.engine.lora.batch`)."""
        key = tuple(sorted(fingerprints))
        stack = self._stacks.get(key)
        if stack is None or any(fp not in self._resident for fp in key):
            weights = self.activate(key)
            stack = LoraStack([weights[fp] for fp in key])
            self._stacks[key] = stack
            while len(self._stacks) > _STACKS:
                self._stacks.popitem(last=False)
        else:
            for fp in key:
                self._resident.move_to_end(fp)
        self._stacks.move_to_end(key)
        return stack

    def counts(self) -> LoraCounts:
        return LoraCounts(self._loads, self._activations, self._evictions,
                          len(self._resident), len(self._cpu))

    def resident_bytes(self) -> int:
        return sum(w.nbytes for w in self._resident.values())

    # ----------------------------------------------------------------- internals
    def _cache(self, weights: LoraWeights, keep: Collection[str] = ()) -> None:
        self._cpu[weights.fingerprint] = weights
        self._cpu.move_to_end(weights.fingerprint)
        self.trim({*keep, weights.fingerprint})

    def _touch(self, fp: str) -> None:
        for tier in (self._cpu, self._resident):
            if fp in tier:
                tier.move_to_end(fp)

    def _promote(self, fp: str, keep: Collection[str]) -> LoraWeights:
        host = self._cpu.get(fp)
        if host is None:
            ref = self._refs.get(fp)
            if ref is None:
                raise KeyError(f"LoRA adapter {fp[:16]}… was never registered")
            host = self.read(ref)  # evicted from both tiers since it was registered
            self._loads += 1
            self._cache(host, keep)
        while len(self._resident) >= self.config.max_loras:
            victim = next(f for f in self._resident if f not in keep)
            del self._resident[victim]
            self._evictions += 1
            for key in [k for k in self._stacks if victim in k]:  # no stack outlives its weights
                del self._stacks[key]
        weights = host.to(self.dtype, self.device)
        self._resident[fp] = weights
        self._activations += 1
        return weights


def register_lora(registry: LoraRegistry | None, ref: LoraRef, keep: Collection[str] = ()) -> None:
    """`registry.register(ref, keep)`; a LoraError when this runner serves no LoRA at all."""
    if registry is None:
        raise LoraError(f"LoRA adapter {ref.name!r}: LoRA is not enabled (--enable-lora)")
    registry.register(ref, keep)


def lora_stats(registry: LoraRegistry, running: Iterable[Sequence], waiting: Iterable[Sequence]) -> LoraStats:
    """The registry's figures and the adapters of the running and the waiting sequences."""
    def names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
        return tuple(sorted({s.lora.name for s in seqs if s.lora is not None}))

    c = registry.counts()
    return LoraStats(registry.held(), names(running), names(waiting), registry.config.max_loras,
                     c.loads, c.evictions)
