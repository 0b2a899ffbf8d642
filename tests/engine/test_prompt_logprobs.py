"""Prompt logprobs (vLLM's `prompt_logprobs`) equal transformers' float32 log-softmax
within 1e-4 for llama, qwen2, qwen3 and mistral; chunked prefill equals unchunked; a
request whose prompt is in the prefix cache gets the same values (its positions are
computed, not skipped) while a request without them does read the cache; stepped
outputs report them once, with the first token; and the generated tokens are those of
the same request without prompt logprobs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ATOL = 1e-4
TOP = 3
PROMPT = [1, *range(40, 40 + 37)]  # 38 tokens: more than two 16-token blocks


def _hf(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _engine(model_dir: Path, **sched: Any) -> LLMEngine:
    cfg = EngineConfig(model_dir=str(model_dir), dtype="float32", num_threads=1,
                       cache=CacheConfig(block_size=16, num_blocks=64),
                       scheduler=SchedulerConfig(**sched) if sched else SchedulerConfig())
    return LLMEngine(cfg)


def _check(lps: tuple[object, ...] | None, want: torch.Tensor, prompt: list[int]) -> None:
    assert lps is not None and len(lps) == len(prompt) and lps[0] is None
    for pos in range(1, len(prompt)):
        lp = lps[pos]
        assert lp is not None and lp.token_id == prompt[pos]  # type: ignore[attr-defined]
        ref = want[pos - 1]
        assert abs(lp.logprob - float(ref[prompt[pos]])) <= ATOL, pos  # type: ignore[attr-defined]
        top = lp.top  # type: ignore[attr-defined]
        vals, ids = torch.topk(ref, TOP)
        assert [t.token_id for t in top] == ids.tolist(), pos
        assert max(abs(t.logprob - v) for t, v in zip(top, vals.tolist(), strict=True)) <= ATOL


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_prompt_logprobs_equal_transformers(tiny_model_dir: Callable[..., Path], family: str) -> None:
    d = tiny_model_dir(family)
    want = _hf(d, PROMPT)
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=TOP, ignore_eos=True)
    engine = _engine(d)
    (plain,) = engine.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert plain.prompt_logprobs is None
    (r,) = engine.generate([PROMPT], params)
    _check(r.prompt_logprobs, want, PROMPT)
    assert r.token_ids == plain.token_ids  # the sampled rows are the same rows
    # The prompt is now in the prefix cache; the logprobs are computed all the same.
    (again,) = engine.generate([PROMPT], params)
    assert again.prompt_logprobs == r.prompt_logprobs and again.token_ids == r.token_ids
    (plain_hit,) = engine.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert plain_hit.num_cached_tokens > 0  # a request without them does read the cache
    # Chunked prefill (10-token chunks), with a neighbour in the batch, equals unchunked.
    chunked = _engine(d, max_num_batched_tokens=10, long_prefill_token_threshold=10)
    other = [1, 7, 8, 9, 10, 11]
    out = chunked.generate([PROMPT, other], [params, SamplingParams(max_tokens=3, prompt_logprobs=0)])
    _check(out[0].prompt_logprobs, want, PROMPT)
    assert out[0].token_ids == r.token_ids
    lps = out[1].prompt_logprobs
    assert lps is not None and len(lps) == len(other) and lps[0] is None
    _check_top1_or_none(lps, _hf(d, other), other, top=0)


def test_streamed_outputs_report_prompt_logprobs_once(tiny_model_dir: Callable[..., Path]) -> None:
    d = tiny_model_dir("llama")
    engine = _engine(d, max_num_batched_tokens=16, long_prefill_token_threshold=16)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=5, temperature=0.0, prompt_logprobs=1, ignore_eos=True))
    reported = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                reported.append((out.outputs[0].token_ids if out.outputs else (), out.prompt_logprobs))
    assert len(reported) == 1
    first_tokens, lps = reported[0]
    assert len(first_tokens) == 1 and len(lps) == len(PROMPT)  # with the first token
    _check_top1_or_none(lps, _hf(d, PROMPT), PROMPT, top=1)


def _check_top1_or_none(lps: tuple[object, ...], want: torch.Tensor, prompt: list[int], top: int) -> None:
    for pos in range(1, len(prompt)):
        lp = lps[pos]
        assert abs(lp.logprob - float(want[pos - 1][prompt[pos]])) <= ATOL  # type: ignore[attr-defined]
        assert len(lp.top) == top  # type: ignore[attr-defined]
