"""Draft-model speculation in the engine: exact output, and the draft's own KV pool
ends empty.

The target drafting for itself accepts (nearly) every greedy draft, which shows the
draft KV follows the sequence across accepted and rejected steps; an unrelated
one-layer draft is rejected most of the time and must still change nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.draft_model import DraftModelProposer
from tests.engine.test_spec_decode import (
    GREEDY,
    PENALIZED,
    SEEDED,
    assert_same,
    make_engine,
    prompts,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def other_draft(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama", seed=1, num_hidden_layers=1)


def draft_engine(model_dir: Path, draft: Path, k: int = 4, **kw: int) -> LLMEngine:
    return make_engine(model_dir, SpeculativeConfig("draft_model", k, model=str(draft)), **kw)


def draft_pool(engine: LLMEngine) -> DraftModelProposer:
    assert engine.spec is not None and isinstance(engine.spec.proposer, DraftModelProposer)
    return engine.spec.proposer


def assert_both_pools_idle(engine: LLMEngine) -> None:
    for bm in (engine.block_manager, draft_pool(engine).blocks):
        assert bm.num_free_blocks == bm.num_allocatable and bm.check_integrity(), bm.integrity_errors()


def test_target_as_its_own_draft_accepts_greedy_drafts_and_matches(model_dir: Path) -> None:
    batch = prompts(5, 19, 8, seed=11)
    off = make_engine(model_dir).generate(batch, GREEDY)
    engine = draft_engine(model_dir, model_dir)
    assert_same(engine.generate(batch, GREEDY), off)
    stats = engine.stats().spec
    assert stats is not None and stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0, stats
    assert stats.mean_acceptance_length > 3.5
    assert_both_pools_idle(engine)


@pytest.mark.parametrize("params", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalties"])
def test_an_unrelated_draft_changes_nothing(model_dir: Path, other_draft: Path, params: SamplingParams) -> None:
    batch = prompts(6, 14, 3, seed=12)
    nparams = SamplingParams(**{**params.to_dict(), "n": 2})
    off = make_engine(model_dir).generate(batch, nparams)
    engine = draft_engine(model_dir, other_draft, k=3)
    assert_same(engine.generate(batch, nparams), off)
    assert engine.stats().spec.num_draft_tokens > 0  # type: ignore[union-attr]
    assert_both_pools_idle(engine)


def test_abort_and_a_short_draft_pool_free_everything(model_dir: Path) -> None:
    engine = draft_engine(model_dir, model_dir, k=6)
    for i, prompt in enumerate(prompts(9, 12, 4, seed=13)):
        engine.add_request(f"r{i}", prompt, SamplingParams(**{**GREEDY.to_dict(), "max_tokens": 30}))
    for _ in range(4):
        engine.step()
    assert draft_pool(engine).blocks.num_free_blocks < draft_pool(engine).blocks.num_allocatable
    engine.abort("r1")
    while engine.has_unfinished():
        engine.step()
    assert_both_pools_idle(engine)


def test_a_draft_with_another_vocabulary_is_refused(model_dir: Path, tiny_model_dir: Callable[..., Path]) -> None:
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        draft_engine(model_dir, tiny_model_dir("tied"))
