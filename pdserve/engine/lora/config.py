"""LoRA serving bounds (`--enable-lora`, `--max-loras`, `--max-lora-rank`,
`--max-cpu-loras`: vLLM's names); torch-free, so configs and the CLI import it cheaply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class LoraConfig:
    """`--enable-lora` and its bounds (vLLM's names)."""

    max_loras: int = 1  # adapters resident at once, so at most this many in one step
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got "
                             f"{self.max_loras} and {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")

    @property
    def cpu_slots(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


class LoraStats(NamedTuple):
    """What an engine serving LoRA reports each tick (metrics, heartbeats)."""

    held: tuple[str, ...]  # fingerprints resident or in host memory
    running: tuple[str, ...]  # adapter names with running sequences
    waiting: tuple[str, ...]  # adapter names with sequences waiting (or waiting for KV)
    max_loras: int
    loads: int  # adapters read from disk so far
    evictions: int  # adapters dropped from a tier so far
