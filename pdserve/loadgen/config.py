"""Frozen configuration of one `pdserve bench` invocation.

The CLI (`pdserve/cli/bench.py`) is the only place that parses arguments; it
builds a `BenchConfig` and hands it to `pdserve.loadgen.runner.run_benchmark`.
Benchmark drivers (`bench/*.py`) build the same dataclasses directly.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any


class Endpoint(str, enum.Enum):
    """Which OpenAI route the requests go to."""

    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is Endpoint.COMPLETIONS else "/v1/chat/completions"


class WorkloadKind(str, enum.Enum):
    RANDOM = "random"
    SHARED_PREFIX = "shared-prefix"
    MIXED = "mixed"
    DATASET = "dataset"


class LenDistribution(str, enum.Enum):
    FIXED = "fixed"
    UNIFORM = "uniform"  # mean * [1 - r, 1 + r]
    NORMAL = "normal"  # sigma = mean * r
    EXPONENTIAL = "exponential"  # mean = mean (r unused)


@dataclasses.dataclass(frozen=True)
class EndpointConfig:
    """Where requests go and how they are authenticated."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: Endpoint = Endpoint.COMPLETIONS
    api_key: str | None = None
    model: str | None = None  # None: the first id listed by GET /v1/models
    # Ids the requests take in turn (e.g. LoRA adapter names, each a `"model"`); when
    # set, `model` is unused.
    models: tuple[str, ...] = ()
    request_timeout_s: float = 600.0
    ignore_eos: bool = True
    temperature: float = 0.0
    # JSON object merged into every request body (e.g. a response_format), as text.
    extra_body: str | None = None


@dataclasses.dataclass(frozen=True)
class MixedConfig:
    """Decode streams (short prompt, long output) plus periodic long prompts.

    The decode streams are kept `concurrency` deep; one long prompt starts every
    `long_prompt_interval_s`. Records are tagged `decode` and `long_prompt` so
    ITL of the streams and TTFT of the long prompts are reported separately.
    """

    long_prompt_len: int = 1500
    long_prompt_output_len: int = 16
    long_prompt_interval_s: float = 3.0


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    """What the prompts look like."""

    kind: WorkloadKind = WorkloadKind.RANDOM
    input_len: int = 128
    output_len: int = 128
    len_distribution: LenDistribution = LenDistribution.FIXED
    len_range: float = 0.5  # the `r` of the distribution, see LenDistribution
    shared_prefix_len: int = 1024
    num_prefixes: int = 1
    dataset_path: str | None = None
    tokenizer_dir: str | None = None
    seed: int = 0
    mixed: MixedConfig = dataclasses.field(default_factory=MixedConfig)


class LoadMode(str, enum.Enum):
    CONCURRENCY = "concurrency"
    POISSON = "poisson"
    SWEEP = "sweep"


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """How requests are issued and when the run stops."""

    concurrency: int = 1
    request_rate: float | None = None  # requests/s, Poisson arrivals
    max_concurrency: int | None = None  # cap on in-flight requests with request_rate
    sweep: tuple[int, ...] = ()  # concurrencies, one run each
    warmup: int = 0
    num_requests: int = 100
    max_duration_s: float = 600.0
    # After max_duration no request starts; those in flight get this long to end.
    drain_timeout_s: float = 60.0

    @property
    def mode(self) -> LoadMode:
        if self.sweep:
            return LoadMode.SWEEP
        if self.request_rate is not None:
            return LoadMode.POISSON
        return LoadMode.CONCURRENCY


@dataclasses.dataclass(frozen=True)
class SLOConfig:
    """Service-level objectives in seconds; None means no objective."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    itl_s: float | None = None  # max inter-token gap of the request
    e2e_s: float | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.itl_s, self.e2e_s))


@dataclasses.dataclass(frozen=True)
class OutputConfig:
    json_path: str | None = None
    png_path: str | None = None
    progress: bool = True
    print_table: bool = True


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    endpoint: EndpointConfig = dataclasses.field(default_factory=EndpointConfig)
    workload: WorkloadConfig = dataclasses.field(default_factory=WorkloadConfig)
    load: LoadConfig = dataclasses.field(default_factory=LoadConfig)
    slo: SLOConfig = dataclasses.field(default_factory=SLOConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; the API key is never written out."""
        d = _plain(dataclasses.asdict(self))
        if d["endpoint"].get("api_key"):
            d["endpoint"]["api_key"] = "***"
        return d


def parse_slo(text: str) -> SLOConfig:
    """Parse `ttft=0.5,tpot=0.05,e2e=10` (seconds) into an `SLOConfig`.

    Unknown keys are errors, not ignored.
    """
    fields = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2e": "e2e_s"}
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in fields:
            raise ValueError(f"bad SLO term {part!r}; expected one of {sorted(fields)}=SECONDS")
        seconds = float(value)
        if seconds <= 0:
            raise ValueError(f"SLO {key} must be > 0 seconds, got {value}")
        values[fields[key]] = seconds
    return SLOConfig(**values)


def _plain(value: Any) -> Any:
    """Enums to their values, tuples to lists, recursively."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
