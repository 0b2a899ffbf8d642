"""Speculative decoding of structured-output requests is exact: a schema-constrained
request drafts, its drafts are cut at the first token the grammar rejects, and each
verification row is masked with the grammar state along the draft, so the tokens (and
logprobs) equal speculation off, greedy and seeded.

Drafts come from an oracle that knows the reference continuation and, call by call,
corrupts one position with a token the grammar rejects (the draft is cut there), with
a token the grammar allows but the target does not draw (the target rejects it), or
with nothing; and from the n-gram proposer. Built-in model, random weights, its real
tokenizer (llguidance needs one)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured import json_schema
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.grammar.compiler import CompiledGrammar
from pdserve.engine.grammar.matcher import GrammarMatcher
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.decoder import SpecDecoder
from tests.engine.test_grammar import SCHEMA, assert_valid
from tests.engine.test_spec_decode import assert_idle_and_clean, assert_same, full_sequences

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 4
C = json_schema(SCHEMA, "response_format")
GREEDY = SamplingParams(max_tokens=120, temperature=0.0, structured=C)
SEEDED = SamplingParams(max_tokens=120, temperature=1.0, seed=21, logprobs=2, structured=C)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("grammar-spec-model"))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


def make_engine(model_dir: Path, spec: SpeculativeConfig | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(model_dir), dtype="float32", num_threads=1,
                                  cache=CacheConfig(block_size=4, num_blocks=512), speculative=spec))


class GrammarOracle:
    """The reference continuation of whichever reference `token_ids` starts, corrupted
    at one position per call: calls % 3 == 0 a token the grammar rejects there, == 1 a
    token it allows there (when one other than the reference exists), == 2 none."""

    def __init__(self, references: Sequence[Sequence[int]], prompt_lens: Sequence[int],
                 compiled: CompiledGrammar, vocab: int) -> None:
        self.references = [(list(r), n) for r, n in zip(references, prompt_lens, strict=True)]
        self.compiled = compiled
        self.vocab = vocab
        self.calls = 0
        self.proposed = 0
        self.grammar_rejected = 0

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        self.calls += 1
        n = len(token_ids)
        for ref, prompt_len in self.references:
            if len(ref) <= n or ref[:n] != list(token_ids):
                continue
            draft = ref[n:n + num_tokens]
            wrong = self.calls % len(draft) if draft else 0
            if draft and self.calls % 3 != 2:
                m = GrammarMatcher(self.compiled)
                m.sync(ref[prompt_len:n])
                allowed = m.allowed_along(draft, self.vocab)[wrong]
                pick = [t for t in range(self.vocab) if bool(allowed[t]) == (self.calls % 3 == 1)
                        and t != draft[wrong]]
                if pick:
                    draft[wrong] = pick[len(pick) // 2]
                    self.grammar_rejected += self.calls % 3 == 0
            self.proposed += len(draft)
            return draft
        return []


def _outputs(model_dir: Path, tok: Tokenizer, params: SamplingParams) -> tuple[list[list[int]], Any]:
    batch = [tok.encode(p) for p in ("hello", "a json thing:", "x y z", "record 7 ->")]
    return batch, make_engine(model_dir).generate(batch, params)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_oracle_drafts_cut_by_the_grammar_give_identical_output(model_dir: Path, tok: Tokenizer,
                                                               params: SamplingParams) -> None:
    batch, off = _outputs(model_dir, tok, params)
    for r in off:
        assert_valid(model_dir, tok, C, list(r.choices[0].token_ids), str(r.choices[0].finish_reason))
    spec = SpeculativeConfig("ngram", K, prompt_lookup_min=1, prompt_lookup_max=1)
    engine = make_engine(model_dir, spec)
    oracle = GrammarOracle(full_sequences(off), [len(p) for p in batch], engine.grammar.compile(C),
                           engine.vocab_size)
    engine.spec = SpecDecoder(spec, engine.block_manager, engine.max_model_len, proposer=oracle)
    on = engine.generate(batch, params)
    assert_same(on, off)
    stats = engine.stats().spec
    assert stats is not None and stats.num_drafts > 0 and stats.num_accepted_tokens > 0, stats
    # The grammar-rejected tokens were cut before verification: fewer tokens were
    # verified than proposed, and the target still rejected some grammar-valid ones.
    assert oracle.grammar_rejected > 0 and stats.num_draft_tokens < oracle.proposed
    assert stats.num_accepted_tokens < stats.num_draft_tokens
    assert_idle_and_clean(engine, full_sequences(off))


def test_ngram_drafts_of_schema_requests_are_exact(model_dir: Path, tok: Tokenizer) -> None:
    batch, off = _outputs(model_dir, tok, SEEDED)
    engine = make_engine(model_dir, SpeculativeConfig("ngram", K, prompt_lookup_min=1, prompt_lookup_max=3))
    on = engine.generate(batch, SEEDED)
    assert_same(on, off)
    stats = engine.stats().spec
    assert stats is not None and stats.num_drafts > 0, stats
    assert_idle_and_clean(engine, full_sequences(off))


def test_unconstrained_batches_never_reach_the_grammar_hook(model_dir: Path, tok: Tokenizer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch-level guard: with no constrained row in the batch `constrain` is not
    called at all (it used to run, and build an expanded sequence list, every step)."""
    import pdserve.engine.llm_engine as llm_engine

    calls: list[int] = []
    real = llm_engine.constrain
    monkeypatch.setattr(llm_engine, "constrain", lambda *a: (calls.append(1), real(*a))[1])
    engine = make_engine(model_dir, SpeculativeConfig("ngram", K, prompt_lookup_min=1, prompt_lookup_max=3))
    engine.generate([tok.encode("plain"), tok.encode("text")], SamplingParams(max_tokens=8, temperature=0.0))
    assert calls == []
    engine.generate([tok.encode("plain")], GREEDY)  # a constrained one does reach it
    assert calls
