"""Latency objectives: a request meets them when its time to first token is at most
`ttft_s` and its mean inter-token latency at most `itl_s`. Read from `ttft=2.0,itl=0.05`
(seconds; an `ms` or `s` suffix is allowed) by the gateway's planner (`--slo`) and by
`pdserve plan --simulate`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    itl_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0):
            raise ValueError(f"SLO targets must be positive seconds, not ttft={self.ttft_s} itl={self.itl_s}")

    def met(self, ttft_s: float, itl_s: float) -> bool:
        return ttft_s <= self.ttft_s and itl_s <= self.itl_s


def parse_slo(text: str) -> Slo:
    """`ttft=2.0,itl=0.05` -> Slo. ValueError naming what is wrong when malformed."""
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, raw = part.strip().partition("=")
        if not sep or key not in ("ttft", "itl") or key in values:
            raise ValueError(f"expected ttft=SECONDS,itl=SECONDS, got {text!r}")
        scale = 1e-3 if raw.endswith("ms") else 1.0
        try:
            values[key] = float(raw.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise ValueError(f"not a number of seconds: {raw!r}") from None
    if set(values) != {"ttft", "itl"}:
        raise ValueError(f"expected both ttft= and itl=, got {text!r}")
    return Slo(values["ttft"], values["itl"])
