"""Worker-side fault injection for reliability tests. Off by default.

Read from `PDSERVE_FAULTS` (via `common.envs`), e.g.
`PDSERVE_FAULTS="exit_after_steps=20"`; unknown keys are errors. KV-frame
faults (corrupt, drop, delay) live in `kv_transfer.faults`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, fields

from common import envs
from common import protocol as p

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerFaults:
    exit_after_steps: int = -1  # die (exit 137, no goodbye) after this many engine steps that did work
    exit_on_prefill: int = -1  # die on receiving the n-th PrefillRequest (1-based), before computing it
    exit_on_reserve: int = -1  # die on receiving the n-th DecodeReserve (1-based)
    step_delay_s: float = 0.0  # sleep after every engine step that did work (a slow worker)

    @classmethod
    def parse(cls, text: str) -> WorkerFaults:
        kinds = {f.name: f.type for f in fields(cls)}
        values: dict[str, float | int] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, _, raw = item.partition("=")
            if key not in kinds:
                raise ValueError(f"unknown worker fault {key!r}; known: {sorted(kinds)}")
            values[key] = float(raw) if kinds[key] == "float" else int(raw)
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls) -> WorkerFaults:
        return cls.parse(envs.faults())


class FaultInjector:
    def __init__(self, faults: WorkerFaults) -> None:
        self.faults = faults
        self._steps = self._prefills = self._reserves = 0

    def on_message(self, msg: p.Message) -> None:
        if isinstance(msg, p.PrefillRequest):
            self._prefills += 1
            if self._prefills == self.faults.exit_on_prefill:
                self._die("exit_on_prefill")
        elif isinstance(msg, p.DecodeReserve):
            self._reserves += 1
            if self._reserves == self.faults.exit_on_reserve:
                self._die("exit_on_reserve")

    def after_step(self, worked: bool) -> None:
        if not worked:
            return
        self._steps += 1
        if self._steps == self.faults.exit_after_steps:
            self._die("exit_after_steps")
        if self.faults.step_delay_s > 0:
            time.sleep(self.faults.step_delay_s)

    @staticmethod
    def _die(point: str) -> None:
        log.warning("fault injection: exiting at %s", point)
        logging.shutdown()
        os._exit(137)
