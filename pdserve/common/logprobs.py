"""Logprobs: one type from the sampler to the HTTP response (engine, wire and gateway)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class Logprob:
    """Logprob of one sampled token and the top-n alternatives (n = params.logprobs)."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()
