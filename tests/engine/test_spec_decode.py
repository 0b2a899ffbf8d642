"""Speculative decoding in the engine is exact: output with drafts equals output without.

Each test runs the same requests through an engine without speculation and one with
it, and compares every token, logprob and finish reason. Drafts come from the n-gram
proposer, or from an oracle that knows the reference continuation and corrupts some
positions, so every path is taken: all drafts accepted, a partial prefix, none.
Afterwards the block manager holds nothing, passes its integrity check, and its prefix
cache holds only blocks of tokens that were really generated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.decoder import SpecDecoder

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=77, ignore_eos=True)
PENALIZED = SamplingParams(max_tokens=24, temperature=0.9, seed=5, ignore_eos=True, presence_penalty=0.7,
                           frequency_penalty=0.6, repetition_penalty=1.3, logprobs=3)
# Greedy under strong penalties: row j's argmax hinges on the drafts before it being
# counted as output (a verifier that forgot them picks a penalized token again).
GREEDY_PENALIZED = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=2.0,
                                  frequency_penalty=2.0, repetition_penalty=2.0)
NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


def make_engine(model_dir: Path, spec: SpeculativeConfig | None = None, *, block_size: int = 4,
                num_blocks: int = 256, budget: int = 2048) -> LLMEngine:
    cfg = EngineConfig(
        model_dir=str(model_dir), dtype="float32",  # token-exact comparisons: see test_engine.py
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
        speculative=spec,
    )
    return LLMEngine(cfg)


def prompts(*lengths: int, seed: int = 0, repeat: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() * repeat for n in lengths]


class Oracle:
    """Proposes the reference continuation of whichever reference sequence `token_ids`
    starts, with the draft at one position per call (cycling) replaced by a wrong token."""

    def __init__(self, references: Sequence[Sequence[int]], vocab: int) -> None:
        self.references = [list(r) for r in references]
        self.vocab = vocab
        self.calls = 0

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        self.calls += 1
        n = len(token_ids)
        for ref in self.references:
            if len(ref) > n and ref[:n] == list(token_ids):
                draft = ref[n:n + num_tokens]
                wrong = self.calls % (num_tokens + 2)  # past the end: this draft is all correct
                if wrong < len(draft):
                    draft[wrong] = (draft[wrong] + 1) % self.vocab
                return draft
        return []


def outcome(results: Any) -> list[Any]:
    """Tokens, finish reasons and logprob token ids (compared exactly)."""
    def ids(entries: Any) -> Any:
        return None if entries is None else [(e.token_id, [t.token_id for t in e.top]) for e in entries]

    return [[(c.token_ids, c.finish_reason, ids(c.logprobs)) for c in r.choices] for r in results]


def logprob_values(results: Any) -> list[float]:
    return [v for r in results for c in r.choices for e in (c.logprobs or ())
            for v in (e.logprob, *(t.logprob for t in e.top))]


def assert_same(on: Any, off: Any) -> None:
    """Identical tokens; logprob values to float32 rounding: a verified position's logits
    come from one forward over 1 + K tokens, not from its own single-token forward, so
    their last bits may differ (as chunked prefill's do from unchunked); tokens may not."""
    assert outcome(on) == outcome(off)
    assert logprob_values(on) == pytest.approx(logprob_values(off), abs=1e-5)


def full_sequences(results: Any) -> list[list[int]]:
    return [list(r.prompt_token_ids) + list(c.token_ids) for r in results for c in r.choices]


def assert_idle_and_clean(engine: LLMEngine, sequences: list[list[int]]) -> None:
    """No block held, integrity intact, and every cached block is a block of real tokens."""
    bm = engine.block_manager
    assert not engine.has_unfinished()
    assert bm.num_free_blocks == bm.num_allocatable
    assert bm.check_integrity(), bm.integrity_errors()
    bs = bm.block_size
    real = {tuple(s[i:i + bs]) for s in sequences for i in range(0, len(s) - bs + 1, bs)}
    cached = [b.token_ids for b in bm._blocks if b.block_hash is not None]
    assert cached and all(t in real for t in cached), "a cached block holds draft tokens"


def with_oracle(model_dir: Path, reference: list[list[int]], k: int = 4, **engine_kw: Any) -> tuple[LLMEngine, Oracle]:
    spec = SpeculativeConfig("ngram", k, prompt_lookup_min=1, prompt_lookup_max=1)
    engine = make_engine(model_dir, spec, **engine_kw)
    oracle = Oracle(reference, engine.vocab_size)
    engine.spec = SpecDecoder(spec, engine.block_manager, engine.max_model_len, proposer=oracle)
    return engine, oracle


@pytest.mark.parametrize("params", [GREEDY, SEEDED, PENALIZED, GREEDY_PENALIZED],
                         ids=["greedy", "seeded", "penalties", "greedy-penalties"])
def test_oracle_drafts_give_identical_output_with_accepts_and_rejects(model_dir: Path, params: SamplingParams) -> None:
    batch = prompts(5, 17, 9, seed=1)
    off = make_engine(model_dir).generate(batch, params)
    engine, _ = with_oracle(model_dir, full_sequences(off))
    on = engine.generate(batch, params)
    assert_same(on, off)
    stats = engine.stats().spec
    assert stats is not None and 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert stats.accepted_per_position[0] >= stats.accepted_per_position[-1] > 0
    assert engine.stats().num_generated_tokens == sum(len(c.token_ids) for r in off for c in r.choices)
    assert_idle_and_clean(engine, full_sequences(off))


def test_n_choices_logprobs_and_stop_tokens_are_identical(model_dir: Path) -> None:
    batch = prompts(6, 11, seed=2)
    base = SamplingParams(**{**PENALIZED.to_dict(), "n": 3, "max_tokens": 20})
    probe = make_engine(model_dir).generate(batch, base)
    stop = probe[0].choices[1].token_ids[7]  # ends some choices early, mid-draft
    params = SamplingParams(**{**base.to_dict(), "stop_token_ids": (stop,)})
    off = make_engine(model_dir).generate(batch, params)
    assert any(c.finish_reason == "stop" for r in off for c in r.choices)
    engine, _ = with_oracle(model_dir, full_sequences(probe))
    on = engine.generate(batch, params)
    assert_same(on, off)
    assert engine.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]
    assert_idle_and_clean(engine, full_sequences(off))


def test_max_tokens_truncates_exactly(model_dir: Path) -> None:
    batch = prompts(7, 13, seed=3)
    longer = make_engine(model_dir).generate(batch, SamplingParams(**{**GREEDY.to_dict(), "max_tokens": 40}))
    for max_tokens in (1, 2, 5, 11):
        params = SamplingParams(**{**GREEDY.to_dict(), "max_tokens": max_tokens})
        off = make_engine(model_dir).generate(batch, params)
        engine, _ = with_oracle(model_dir, full_sequences(longer), k=6)
        assert_same(engine.generate(batch, params), off)
        assert_idle_and_clean(engine, full_sequences(longer))


def test_rejected_slots_are_given_back_after_every_step(model_dir: Path) -> None:
    batch = prompts(3, 10, seed=4)
    off = make_engine(model_dir).generate(batch, GREEDY)
    engine, oracle = with_oracle(model_dir, full_sequences(off), k=9)  # drafts span 3 blocks of 4
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, GREEDY)
    bm = engine.block_manager
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            assert len(bm.block_table(seq.seq_id)) == bm.blocks_for(seq.num_computed_tokens)
            assert seq.num_uncomputed_tokens == 1
        assert bm.check_integrity(), bm.integrity_errors()
    assert oracle.calls > 0
    assert_idle_and_clean(engine, full_sequences(off))


def test_sequences_with_and_without_drafts_share_one_step(model_dir: Path) -> None:
    batch = prompts(8, 30, 12, seed=5)
    plain = SamplingParams(**{**SEEDED.to_dict(), "speculative": False})
    plist = [SEEDED, plain, SEEDED]
    off = make_engine(model_dir).generate(batch, plist)
    engine, _ = with_oracle(model_dir, full_sequences(off))
    steps: list[list[SeqChunk]] = []
    execute = engine.runner.execute

    def spy(chunks: Sequence[SeqChunk], layer_hook: Any = None) -> torch.Tensor:
        steps.append(list(chunks))
        return execute(chunks, layer_hook)

    engine.runner.execute = spy  # type: ignore[method-assign]
    assert_same(engine.generate(batch, plist), off)
    mixed = [s for s in steps if any(c.num_draft_tokens for c in s)
             and any(c.num_draft_tokens == 0 and c.num_tokens == 1 for c in s)]
    assert mixed, "no step verified drafts beside a plain decode"
    assert_idle_and_clean(engine, full_sequences(off))


def test_batch_size_switch_turns_drafting_off_per_step(model_dir: Path) -> None:
    batch = prompts(4, 6, 8, seed=6)
    off = make_engine(model_dir).generate(batch, GREEDY)
    spec = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=1, disable_by_batch_size=2)
    engine = make_engine(model_dir, spec)
    engine.spec = SpecDecoder(spec, engine.block_manager, engine.max_model_len,
                              proposer=Oracle(full_sequences(off), engine.vocab_size))
    assert_same(engine.generate(batch, GREEDY), off)
    assert engine.stats().spec.num_drafts == 0  # type: ignore[union-attr]  # three running > 2
    assert_same(engine.generate(batch[:2], GREEDY), off[:2])
    assert engine.stats().spec.num_drafts > 0  # type: ignore[union-attr]  # two running <= 2


def test_ngram_drafting_is_exact_on_repeating_prompts(model_dir: Path) -> None:
    batch = prompts(6, 9, 4, seed=7, repeat=4)
    for params in (GREEDY, SEEDED, PENALIZED):
        off = make_engine(model_dir).generate(batch, params)
        engine = make_engine(model_dir, NGRAM)
        assert_same(engine.generate(batch, params), off)
        assert engine.stats().spec.num_draft_tokens > 0  # type: ignore[union-attr]
        assert_idle_and_clean(engine, full_sequences(off))


def test_preemption_and_short_blocks_drop_drafts_not_streams(model_dir: Path) -> None:
    batch = prompts(5, 9, 7, 6, seed=8)
    off = make_engine(model_dir).generate(batch, GREEDY)
    engine, _ = with_oracle(model_dir, full_sequences(off), k=8, num_blocks=16)  # 15 blocks of 4
    assert_same(engine.generate(batch, GREEDY), off)
    assert engine.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]
    assert not engine.has_unfinished() and engine.block_manager.check_integrity()


def test_resumed_sequence_speculates_from_its_resume_point(model_dir: Path) -> None:
    prompt = prompts(9, seed=9)[0]
    off = make_engine(model_dir).generate([prompt], PENALIZED)[0]
    done = list(off.choices[0].token_ids[:6])
    engine, _ = with_oracle(model_dir, [prompt + list(off.choices[0].token_ids)])
    engine.add_request("r", prompt, PENALIZED, output_token_ids=done)
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            got.extend(out.outputs[0].token_ids)
    assert done + got == list(off.choices[0].token_ids)
    assert engine.stats().spec.num_accepted_tokens > 0  # type: ignore[union-attr]
