"""Worker-side fault injection for reliability tests. Off unless asked for.

A worker arms faults only when started with `--enable-fault-injection`; then it
reads `PDSERVE_FAULTS` (e.g. `PDSERVE_FAULTS="exit_after_steps=20"`; unknown keys
are errors) and `PDSERVE_KV_FAULTS` (KV-frame faults: corrupt, drop, delay; see
`kv_transfer.faults`) through `pdserve.common.envs`, and logs a WARNING. Without the
flag both variables are ignored, so a stray environment can never make a
production worker corrupt KV or exit.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, fields
from typing import NamedTuple

from kv_transfer.faults import FaultConfig
from pdserve.common import envs
from pdserve.common import protocol as p

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerFaults:
    exit_after_steps: int = -1  # die (exit 137, no goodbye) after this many engine steps that did work
    exit_on_prefill: int = -1  # die on receiving the n-th PrefillRequest (1-based), before computing it
    exit_on_reserve: int = -1  # die on receiving the n-th DecodeReserve (1-based)
    step_delay_s: float = 0.0  # sleep after every engine step that did work (a slow worker)
    # Stop stepping for good after this many engine steps that did work: the main loop
    # blocks (a hung kernel or collective) while the heartbeat thread keeps beating.
    hang_after_steps: int = -1

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
    def from_env(cls, enabled: bool = False) -> WorkerFaults:
        """`PDSERVE_FAULTS` when fault injection is `enabled`; no faults otherwise."""
        return cls.parse(envs.faults()) if enabled else cls()


class InjectedFaults(NamedTuple):
    """The faults one worker process injects."""

    worker: WorkerFaults
    kv: FaultConfig


NO_FAULTS = InjectedFaults(WorkerFaults(), FaultConfig())


def injected_faults(enabled: bool) -> InjectedFaults:
    """The faults the environment asks for if `enabled` (`--enable-fault-injection`),
    announced with a WARNING; none otherwise, whatever the environment says."""
    if not enabled:
        if envs.faults() or envs.kv_faults():
            log.warning("PDSERVE_FAULTS / PDSERVE_KV_FAULTS ignored: fault injection needs "
                        "--enable-fault-injection")
        return NO_FAULTS
    faults = InjectedFaults(WorkerFaults.from_env(enabled=True), FaultConfig.from_env())
    log.warning("fault injection is ON (--enable-fault-injection): %s, %s; never in production",
                faults.worker, faults.kv)
    return faults


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
        if self._steps == self.faults.hang_after_steps:
            self._hang()
        if self.faults.step_delay_s > 0:
            time.sleep(self.faults.step_delay_s)

    @staticmethod
    def _hang() -> None:
        log.warning("fault injection: hanging at hang_after_steps")
        while True:  # only a signal that kills the process ends it
            time.sleep(3600)

    @staticmethod
    def _die(point: str) -> None:
        log.warning("fault injection: exiting at %s", point)
        logging.shutdown()
        os._exit(137)
