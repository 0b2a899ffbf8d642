"""Fault injection for tests: corrupt, drop or delay KV frames. Off by default.

Senders and receivers inject only the FaultConfig they are given (none by
default); they never read the environment. `FaultConfig.from_env()` reads the
spec from PDSERVE_KV_FAULTS (through `pdserve.common.envs`), e.g.
`PDSERVE_KV_FAULTS="corrupt_chunk=2,delay_s=0.05"`; a worker calls it only when
started with `--enable-fault-injection` (see `pdserve.worker.faults.injected_faults`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from pdserve.common import envs

ENV_VAR = "PDSERVE_KV_FAULTS"


@dataclass(frozen=True)
class FaultConfig:
    corrupt_chunk: int = -1  # sender: flip one byte of its n-th data chunk (0-based)
    drop_chunk: int = -1  # sender: silently drop its n-th data chunk
    delay_s: float = 0.0  # sender: sleep before every data chunk
    drop_acks: bool = False  # receiver: never send the final Ack

    @property
    def active(self) -> bool:
        return self != FaultConfig()

    @classmethod
    def parse(cls, text: str) -> FaultConfig:
        """Parse `key=value,...`; unknown keys are errors."""
        known = {f.name: f.type for f in fields(cls)}
        values: dict[str, object] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, _, raw = item.partition("=")
            if key not in known:
                raise ValueError(f"unknown fault {key!r}; known: {sorted(known)}")
            kind = known[key]
            if kind == "bool":
                values[key] = raw.lower() in ("1", "true", "yes")
            elif kind == "float":
                values[key] = float(raw)
            else:
                values[key] = int(raw)
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FaultConfig:
        """From PDSERVE_KV_FAULTS (or `env`, a mapping standing in for the environment)."""
        return cls.parse(envs.kv_faults() if env is None else env.get(ENV_VAR, ""))
