"""Sampling parameters: the per-request knobs shared by gateway, nodes and engine.

Plain stdlib so the gateway (which never imports torch) can build and validate
them, and msgpack-friendly so they cross process boundaries as a dict.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pdserve.common.structured import StructuredOutput, StructuredOutputError


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; `param` names it for the API error envelope."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # A set: the engine checks every sampled token against it (the gateway caps its size).
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs of each sampled token; None = off
    # vLLM's prompt_logprobs: the logprob of each prompt token after the first, and the
    # top-n alternatives; None = off. Such a request never reads the prefix cache (the
    # positions it needs must be computed).
    prompt_logprobs: int | None = None
    n: int = 1
    # Output constraint (JSON schema, regex, choice, grammar) enforced as a token mask.
    structured: StructuredOutput | None = None
    # False: never draft for this request, whatever --speculative-config says.
    speculative: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.stop_token_ids, frozenset):  # any iterable of ids is accepted
            object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self) -> SamplingParams:
        """Raise SamplingParamsError naming the first bad field; return self."""
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", "max_tokens must be at least 1")
        if self.temperature < 0:
            raise SamplingParamsError("temperature", "temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", "top_p must be in (0, 1]")
        if self.top_k < -1:
            raise SamplingParamsError("top_k", "top_k must be -1, 0 or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", "min_p must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise SamplingParamsError("repetition_penalty", "repetition_penalty must be > 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError("logprobs", "logprobs must be in [0, 20]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise SamplingParamsError("prompt_logprobs", "prompt_logprobs must be in [0, 20]")
        if self.n < 1:
            raise SamplingParamsError("n", "n must be at least 1")
        if self.structured is not None:
            try:
                self.structured.validate()
            except StructuredOutputError as e:
                raise SamplingParamsError(e.param, str(e)) from None
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_token_ids"] = sorted(self.stop_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        if set(d) - set(known):
            raise SamplingParamsError(sorted(set(d) - set(known))[0], "unknown sampling field")
        if "stop_token_ids" in known:
            known["stop_token_ids"] = frozenset(int(t) for t in known["stop_token_ids"])
        if isinstance(known.get("structured"), dict):
            known["structured"] = StructuredOutput(**known["structured"])
        return cls(**known).validate()
