"""Glue between the engine and the worker nodes: building the engine, turning
engine outputs into wire deltas, and mirroring engine stats into metrics."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pdserve.common import protocol as p
from pdserve.common.kv_layout import KVLayout
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.outputs import EngineStats, RequestOutput
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parallel.runner import make_runner
from pdserve.engine.runner.model_runner import ModelRunner
from pdserve.engine.spec.decoder import SpecStats
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.node_api import NodeLoad


def build_engine(config: EngineConfig, kv_buffer: Any = None, layout: KVLayout | None = None,
                 pool_name: str = "") -> tuple[LLMEngine, ModelRunner]:
    """The engine and its runner; `layout`: `ModelRunner.layout_for(config)` if already known.

    With `config.tensor_parallel_size` > 1 the runner is rank 0 of a group whose follower
    ranks map `kv_buffer` by its shared-memory name `pool_name`; its `close` stops them."""
    if config.num_threads:
        import torch

        torch.set_num_threads(config.num_threads)
    runner = make_runner(config, kv_buffer=kv_buffer, layout=layout, pool_name=pool_name)
    return LLMEngine(config, runner=runner), runner


def wire_deltas(outputs: Iterable[RequestOutput]) -> list[p.TokenDelta]:
    """Every non-empty choice delta of one step; engine-side aborts are not reported."""
    deltas = []
    for out in outputs:
        prompt_lps = list(out.prompt_logprobs) if out.prompt_logprobs is not None else None
        for c in out.outputs:
            if c.finish_reason == "abort" or (not c.token_ids and c.finish_reason is None):
                continue
            reason = c.finish_reason
            deltas.append(p.TokenDelta(
                c.index, list(c.token_ids), list(c.logprobs) if c.logprobs is not None else None, reason,
                out.num_cached_tokens, request_id=out.request_id, prompt_logprobs=prompt_lps,
            ))
            prompt_lps = None  # once per request
    return deltas


class StatsMirror:
    """Turns the engine's cumulative stats into counter increments and a NodeLoad."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self._prompt = 0
        self._generated = 0
        self._spec = SpecStats(0, 0, 0, ())

    def update(self, s: EngineStats, queued_prefill_tokens: int = 0, held: int = 0) -> NodeLoad:
        """The node's load; `held`: requests the node keeps outside the engine (a decode
        reservation whose grammar compiles), waiting like those the engine holds."""
        m = self.metrics
        if s.num_prompt_tokens_computed > self._prompt:
            m.prefill_tokens.inc(s.num_prompt_tokens_computed - self._prompt)
            self._prompt = s.num_prompt_tokens_computed
        if s.num_generated_tokens > self._generated:
            m.decode_tokens.inc(s.num_generated_tokens - self._generated)
            self._generated = s.num_generated_tokens
        m.set_preemptions(s.num_preemptions)
        if s.spec is not None and s.spec != self._spec:
            self._mirror_spec(s.spec)
        if s.lora is not None:
            m.set_lora(s.lora)
        return NodeLoad(
            queued_prefill_tokens, s.num_free_blocks, s.num_total_blocks, s.num_running,
            s.num_waiting + s.num_waiting_for_kv + s.num_waiting_for_grammar + held, s.num_steps,
            s.num_prompt_tokens_computed + s.num_generated_tokens,
            s.lora.held if s.lora is not None else (),
        )

    def _mirror_spec(self, now: SpecStats) -> None:
        m, was = self.metrics, self._spec
        m.spec_drafts.inc(now.num_drafts - was.num_drafts)
        m.spec_draft_tokens.inc(now.num_draft_tokens - was.num_draft_tokens)
        m.spec_accepted_tokens.inc(now.num_accepted_tokens - was.num_accepted_tokens)
        m.spec_draft_prefill_tokens.inc(now.draft_prefill_tokens - was.draft_prefill_tokens)
        for j, count in enumerate(now.accepted_per_position):
            before = was.accepted_per_position[j] if j < len(was.accepted_per_position) else 0
            if count > before:
                m.add_accepted_at(j, count - before)
        self._spec = now
