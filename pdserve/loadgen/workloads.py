"""Workloads: streams of `RequestSpec`s.

* random: unique random-word prompts, input/output lengths fixed or drawn from
  a distribution (`LenDistribution`), `ignore_eos` so each request produces
  exactly `max_tokens` tokens.
* shared-prefix: `num_prefixes` long system prompts of `shared_prefix_len`
  tokens, requests assigned round-robin, each with its own `input_len` suffix.
* mixed: decode streams (the main stream, tag `decode`: short prompts of
  `input_len`, `output_len` tokens out) plus long prompts (tag `long_prompt`)
  that the runner injects periodically.
* dataset: JSONL, one object per line with `prompt` (string) or `messages`
  (chat list) and optionally `max_tokens`/`output_len`; cycled when more
  requests are asked for than lines.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator

import numpy as np

from pdserve.loadgen.config import LenDistribution, WorkloadConfig, WorkloadKind
from pdserve.loadgen.prompts import Prompt, TokenCounter, concat, make_prompt
from pdserve.loadgen.records import RequestSpec

DECODE_TAG = "decode"
LONG_PROMPT_TAG = "long_prompt"


def sample_len(mean: int, dist: LenDistribution, r: float, rng: np.random.Generator) -> int:
    """One length >= 1 drawn around `mean`."""
    if dist is LenDistribution.FIXED:
        value = float(mean)
    elif dist is LenDistribution.UNIFORM:
        value = rng.uniform(mean * (1 - r), mean * (1 + r))
    elif dist is LenDistribution.NORMAL:
        value = rng.normal(mean, mean * r)
    else:
        value = rng.exponential(mean)
    return max(1, int(round(value)))


class Workload:
    """Deterministic (seeded) source of requests for one workload config."""

    def __init__(self, cfg: WorkloadConfig, counter: TokenCounter | None = None) -> None:
        self.cfg = cfg
        self.counter = counter
        self._rng = np.random.default_rng(cfg.seed)
        self._long_rng = np.random.default_rng(cfg.seed + 1)
        self._prefixes: list[Prompt] = []
        if cfg.kind is WorkloadKind.SHARED_PREFIX:
            self._prefixes = [
                make_prompt(cfg.shared_prefix_len, self._rng, counter)
                for _ in range(max(1, cfg.num_prefixes))
            ]
        self._dataset: Iterator[RequestSpec] | None = None
        if cfg.kind is WorkloadKind.DATASET:
            if not cfg.dataset_path:
                raise ValueError("the dataset workload needs a dataset path")
            self._dataset = itertools.cycle(load_dataset(cfg.dataset_path, cfg.output_len, counter))
        self._count = 0

    @property
    def has_long_prompts(self) -> bool:
        return self.cfg.kind is WorkloadKind.MIXED

    def next(self) -> RequestSpec:
        """The next request of the main stream."""
        self._count += 1
        if self._dataset is not None:
            return next(self._dataset)
        cfg, rng = self.cfg, self._rng
        n_in = sample_len(cfg.input_len, cfg.len_distribution, cfg.len_range, rng)
        n_out = sample_len(cfg.output_len, cfg.len_distribution, cfg.len_range, rng)
        body = make_prompt(n_in, rng, self.counter)
        if cfg.kind is WorkloadKind.SHARED_PREFIX:
            prefix = self._prefixes[(self._count - 1) % len(self._prefixes)]
            whole = concat(prefix, body, self.counter)
            return RequestSpec(
                prompt=whole.text,
                max_tokens=n_out,
                tag="shared_prefix",
                messages=(
                    {"role": "system", "content": prefix.text},
                    {"role": "user", "content": body.text},
                ),
                prompt_tokens_est=whole.tokens,
            )
        tag = DECODE_TAG if cfg.kind is WorkloadKind.MIXED else "random"
        return RequestSpec(body.text, n_out, tag=tag, prompt_tokens_est=body.tokens)

    def take(self, n: int) -> list[RequestSpec]:
        return [self.next() for _ in range(n)]

    def next_long_prompt(self) -> RequestSpec:
        """A long prompt of the mixed workload (fixed length, its own seed)."""
        m = self.cfg.mixed
        p = make_prompt(m.long_prompt_len, self._long_rng, self.counter)
        return RequestSpec(
            p.text, m.long_prompt_output_len, tag=LONG_PROMPT_TAG, prompt_tokens_est=p.tokens
        )


def load_dataset(
    path: str, default_output_len: int, counter: TokenCounter | None
) -> list[RequestSpec]:
    """Read a JSONL prompt file; malformed lines are errors with their line number."""
    specs: list[RequestSpec] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                specs.append(_dataset_spec(obj, default_output_len, counter))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from e
    if not specs:
        raise ValueError(f"{path}: no prompts")
    return specs


def _dataset_spec(obj: dict, default_output_len: int, counter: TokenCounter | None) -> RequestSpec:
    max_tokens = int(obj.get("max_tokens", obj.get("output_len", default_output_len)))
    if "messages" in obj:
        messages = tuple(
            {"role": str(m["role"]), "content": str(m["content"])} for m in obj["messages"]
        )
        prompt = "\n".join(m["content"] for m in messages)
    elif isinstance(obj.get("prompt"), str):
        messages, prompt = None, obj["prompt"]
    else:
        raise KeyError("each line needs a 'prompt' string or a 'messages' list")
    est = counter.count(prompt) if counter else len(prompt.split())
    return RequestSpec(prompt, max_tokens, tag="dataset", messages=messages, prompt_tokens_est=est)
