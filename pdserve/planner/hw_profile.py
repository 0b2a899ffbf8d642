"""`pdserve profile`: measure this hardware's prefill and decode step times with the
engine in-process and fit the coefficients `pdserve plan --simulate` reads
(pdserve/planner/profile.py has the schema and the fit).

- Prefill: one prompt of each length in `prefill_lengths`, prefix caching off, one
  timed `step()` each (the token budget is raised to the longest prompt, so one step
  computes the whole prompt); the median of `reps`.
- Decode: for each batch size B and context length C, B requests with C-token
  prompts are prefilled, then `decode_steps` decode steps are timed; the median
  step of `reps` runs.
- KV copy: the median of `reps` copies of 1,024 tokens' KV bytes (this model's
  layout) from one buffer to another, as the same-host handoff copies between pools.
- The machine's 1-minute load average before and after, kept with the profile: a
  profile taken under another load than the serving it predicts is off by the
  difference.

Prompts are random token ids (the time of a step does not depend on which tokens).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.common.sampling_params import SamplingParams
from pdserve.planner.profile import Profile, fit_decode, fit_prefill


@dataclass(frozen=True)
class ProfileConfig:
    model_dir: str
    dtype: str = "auto"
    device: str = "cpu"
    threads: int | None = None
    prefill_lengths: tuple[int, ...] = (32, 128, 384, 768, 1536)
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    context_lengths: tuple[int, ...] = (64, 512)
    decode_steps: int = 8
    reps: int = 3
    block_size: int = 16
    chunk_tokens: int = 2048  # the serving workers' --max-num-batched-tokens
    max_num_seqs: int = 64  # the serving workers' --max-num-seqs

    def __post_init__(self) -> None:
        sizes = (*self.prefill_lengths, *self.batch_sizes, *self.context_lengths)
        if len(self.prefill_lengths) < 3 or len(self.batch_sizes) * len(self.context_lengths) < 3:
            raise ValueError("a fit needs at least 3 prefill lengths and 3 decode (batch, context) points")
        if min(sizes) < 1 or self.decode_steps < 1 or self.reps < 1:
            raise ValueError("lengths, batch sizes, steps and reps must be >= 1")


def measure(config: ProfileConfig, progress: Callable[[str], None] = lambda _: None) -> Profile:
    """Build the engine once and time its steps (module docstring)."""
    from pdserve.engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.dtype import resolved_config

    longest = max(max(config.prefill_lengths), max(config.context_lengths) + config.decode_steps + 2)
    # one step prefills the longest prompt, or a whole decode batch's prompts
    budget = max(longest, max(config.batch_sizes) * max(config.context_lengths), config.chunk_tokens)
    engine_config = resolved_config(EngineConfig(
        model_dir=config.model_dir, dtype=config.dtype, device=config.device, num_threads=config.threads,
        cache=CacheConfig(block_size=config.block_size, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=max(config.max_num_seqs, *config.batch_sizes),
                                  max_num_batched_tokens=budget, max_model_len=longest + 1),
    ))
    load_before = os.getloadavg()[0]
    engine = LLMEngine(engine_config)
    total_blocks = engine.stats().num_total_blocks
    _Timer(engine, config).prefill(32)  # warm-up: first-call allocations and kernel selection
    timer = _Timer(engine, config)
    prefill = []
    for n in config.prefill_lengths:
        s = statistics.median(timer.prefill(n) for _ in range(config.reps))
        prefill.append((n, s))
        progress(f"prefill {n:5d} tokens: {s * 1000:8.2f} ms")
    decode = []
    for b in config.batch_sizes:
        for c in config.context_lengths:
            s = statistics.median(timer.decode(b, c) for _ in range(config.reps))
            decode.append((b, c, s))
            progress(f"decode batch {b:3d} x {c:5d} context: {s * 1000:8.2f} ms/step")
    copy_s = statistics.median(_copy_s(engine.runner.layout.kv_bytes_per_token * COPY_TOKENS, config.device)
                               for _ in range(config.reps)) / COPY_TOKENS
    progress(f"KV copy: {copy_s * 1e6:.3f} us/token")
    return Profile(fit_prefill(prefill), fit_decode(decode), config.block_size, config.chunk_tokens,
                   config.max_num_seqs, total_blocks * config.block_size, config.model_dir,
                   engine_config.dtype, config.device, config.threads, copy_s,
                   (load_before, os.getloadavg()[0]))


COPY_TOKENS = 1024


def _copy_s(nbytes: int, device: str) -> float:
    """Seconds to copy `nbytes` from one buffer to another on `device`."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages
    if src.is_cuda:
        torch.cuda.synchronize(src.device)
    t0 = time.perf_counter()
    dst.copy_(src)
    if src.is_cuda:
        torch.cuda.synchronize(src.device)
    return time.perf_counter() - t0


class _Timer:
    def __init__(self, engine: Any, config: ProfileConfig) -> None:
        self.engine = engine
        self.config = config
        self._n = 0

    def _prompt(self, length: int) -> list[int]:
        rng = random.Random(self._n)
        return [rng.randrange(3, self.engine.vocab_size) for _ in range(length)]

    def _add(self, length: int, max_tokens: int) -> None:
        self._n += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(f"profile-{self._n}", self._prompt(length), params)

    def prefill(self, length: int) -> float:
        self._add(length, 1)
        t0 = time.perf_counter()
        self.engine.step()
        dt = time.perf_counter() - t0
        self._drain()
        return dt

    def decode(self, batch: int, context: int) -> float:
        for _ in range(batch):
            self._add(context, self.config.decode_steps + 2)
        self.engine.step()  # every prompt in one step (the budget holds them all), first tokens out
        t0 = time.perf_counter()
        for _ in range(self.config.decode_steps):
            self.engine.step()
        dt = (time.perf_counter() - t0) / self.config.decode_steps
        self._drain()
        return dt

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()
