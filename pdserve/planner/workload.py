"""Workloads for `pdserve plan --simulate` and `bench/simulate_check.py`: arrivals,
prompt and output lengths, and the SLOs a request must meet to count as goodput.

A workload is written as comma-separated `key=value` pairs:

    rate=4,n=200,prompt=128-512,output=64,arrivals=poisson,seed=0

- `rate`: requests per second (> 0); `n`: number of requests;
- `prompt`, `output`: token counts, each `N` (fixed) or `A-B` (uniform, inclusive);
- `arrivals`: `poisson` (exponential gaps of mean 1/rate, the default) or `uniform`
  (exactly 1/rate apart); the first request arrives at 0;
- `prefix`: the first N prompt tokens are the same for every request (a shared system
  prompt; default 0), N below the shortest prompt: prefix caches serve them;
- `seed`: the draws are a pure function of the workload (`random.Random(seed)`), so
  the simulator and a measuring client replay the same requests.

SLOs (`pdserve.common.slo.Slo`): a request meets them when its time to first token is at most `ttft_s`
and its mean inter-token latency ((last token - first token) / (output - 1); 0 for a
one-token output) is at most `itl_s`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.common.slo import Slo, parse_slo

ARRIVALS = ("poisson", "uniform")


class WorkloadError(ValueError):
    """A workload or SLO spec that cannot be read; the message says which part."""


@dataclass(frozen=True)
class Lengths:
    """Token counts drawn uniformly from [low, high] (low == high: fixed)."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise WorkloadError(f"lengths must satisfy 1 <= low <= high, not {self.low}-{self.high}")

    @classmethod
    def parse(cls, text: str) -> Lengths:
        lo, sep, hi = text.partition("-")
        try:
            low = int(lo)
            high = int(hi) if sep else low
        except ValueError:
            raise WorkloadError(f"a length is N or A-B, not {text!r}") from None
        return cls(low, high)

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)


class SimRequest(NamedTuple):
    arrival: float  # seconds from the workload's start
    prompt_tokens: int
    output_tokens: int
    prefix_tokens: int = 0  # leading prompt tokens every request of the workload shares


@dataclass(frozen=True)
class Workload:
    rate: float
    num_requests: int
    prompt: Lengths
    output: Lengths
    arrivals: str = "poisson"
    seed: int = 0
    prefix: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise WorkloadError(f"rate must be > 0 requests/s, not {self.rate}")
        if self.num_requests < 1:
            raise WorkloadError(f"n must be >= 1, not {self.num_requests}")
        if self.arrivals not in ARRIVALS:
            raise WorkloadError(f"arrivals must be one of {', '.join(ARRIVALS)}, not {self.arrivals!r}")
        if not 0 <= self.prefix < self.prompt.low:
            raise WorkloadError(f"prefix must be >= 0 and below the shortest prompt ({self.prompt.low}), "
                                f"not {self.prefix}")

    @classmethod
    def parse(cls, text: str) -> Workload:
        fields = _pairs(text, {"rate", "n", "prompt", "output", "arrivals", "seed", "prefix"})
        missing = {"rate", "n", "prompt", "output"} - fields.keys()
        if missing:
            raise WorkloadError(f"workload needs {', '.join(sorted(missing))} (e.g. rate=4,n=200,prompt=256,output=64)")
        try:
            rate, n, seed = float(fields["rate"]), int(fields["n"]), int(fields.get("seed", "0"))
            prefix = int(fields.get("prefix", "0"))
        except ValueError as e:
            raise WorkloadError(f"workload: {e}") from None
        return cls(rate, n, Lengths.parse(fields["prompt"]), Lengths.parse(fields["output"]),
                   fields.get("arrivals", "poisson"), seed, prefix)

    def spec(self) -> str:
        """The `key=value` text this workload parses from."""
        def length(x: Lengths) -> str:
            return str(x.low) if x.low == x.high else f"{x.low}-{x.high}"
        return (f"rate={self.rate:g},n={self.num_requests},prompt={length(self.prompt)},"
                f"output={length(self.output)},arrivals={self.arrivals},seed={self.seed}"
                + (f",prefix={self.prefix}" if self.prefix else ""))

    def requests(self) -> list[SimRequest]:
        rng = random.Random(self.seed)
        out, t = [], 0.0
        for i in range(self.num_requests):
            if i:
                t += rng.expovariate(self.rate) if self.arrivals == "poisson" else 1.0 / self.rate
            out.append(SimRequest(t, self.prompt.draw(rng), self.output.draw(rng), self.prefix))
        return out


def parse_workload_slo(text: str) -> Slo:
    """`ttft=1.0,itl=0.1` (pdserve.common.slo's form) -> Slo; WorkloadError when malformed."""
    try:
        return parse_slo(text)
    except ValueError as e:
        raise WorkloadError(f"SLO: {e}") from None


def _pairs(text: str, known: set[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not value:
            raise WorkloadError(f"expected key=value, not {part!r}")
        if key not in known:
            raise WorkloadError(f"unknown key {key!r} (known: {', '.join(sorted(known))})")
        if key in out:
            raise WorkloadError(f"{key!r} given twice")
        out[key] = value
    return out
