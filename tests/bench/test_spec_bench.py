"""bench/spec_decode.py on a tiny model: its workloads' prompts, and one alternating
off/on round whose outputs match and whose on run verified drafts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bench import spec_decode
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.spec.config import SpeculativeConfig
from tests.engine.test_spec_decode import make_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Chars:
    """A stand-in tokenizer: one id per character."""

    eos_token_ids = (1,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(ch) % 200 + 5 for ch in text]


def test_quote_prompts_end_by_restarting_the_story_and_open_prompts_are_its_first_sentence() -> None:
    story = spec_decode._story(7)
    quote, opening = spec_decode.text_prompt("quote", 7), spec_decode.text_prompt("open", 7)
    assert quote.startswith(story) and quote.endswith("\n\n" + opening)
    assert story.startswith(opening) and opening.endswith(".") and opening.count(". ") == 0
    batch = spec_decode.prompts("quote", 3, 0, 5, 100, _Chars())
    assert len({tuple(p) for p in batch}) == 3  # fresh stories per request


def test_open_workload_drafts_with_the_trained_draft_model() -> None:
    spec = SpeculativeConfig.from_json(spec_decode.default_spec("open"))
    assert spec.method == "draft_model" and spec.num_speculative_tokens == spec_decode.DRAFT_K
    assert spec.model is not None and Path(spec.model).name == "pdserve-tiny-llama-draft"
    assert SpeculativeConfig.from_json(spec_decode.default_spec("quote")).method == "ngram"
    redo = SpeculativeConfig.from_json(spec_decode.default_spec("redo"))
    assert (redo.method, redo.num_speculative_tokens, redo.prompt_lookup_min) == ("ngram", 6, 2)


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Callable[..., Path]) -> tuple[LLMEngine, LLMEngine]:
    model = tiny_model_dir("llama")
    return make_engine(model), make_engine(model, SpeculativeConfig.from_json(spec_decode.NGRAM))


@pytest.mark.parametrize("on_first", [False, True])
def test_a_round_matches_outputs_and_reports_acceptance(on_first: bool,
                                                        engines: tuple[LLMEngine, LLMEngine]) -> None:
    off, on = engines
    batch = spec_decode.prompts("repeat", 2, 24, 3, 100)
    a, b, ratio = spec_decode.compare(off, on, batch, 12, on_first)
    assert ratio.identical and a.outputs == b.outputs and all(len(o) == 12 for o in a.outputs)
    assert a.drafts == 0 and b.drafts > 0 and ratio.mean_acceptance_length == b.mean_acceptance_length > 1
    assert ratio.wall > 0 and ratio.cpu > 0


def test_prompt_ngram_fraction_counts_output_tokens_that_continue_a_prompt_trigram() -> None:
    assert spec_decode.prompt_ngram_fraction([1, 2, 3, 1, 2], [3, 1, 2]) == 1.0  # the prompt's tail counts
    prompt = [1, 2, 3, 4, 5]
    assert spec_decode.prompt_ngram_fraction(prompt, [9, 9, 9]) == 0.0
    assert spec_decode.prompt_ngram_fraction(prompt, [6, 1, 2, 3]) == 0.25  # only (1, 2, 3)


def test_redo_prompt_holds_the_models_own_answer_then_the_opening_again(engines: tuple[LLMEngine, LLMEngine]) -> None:
    off, _ = engines
    [prompt] = spec_decode.prompts("redo", 1, 0, 5, 100, _Chars(), off)
    opening = _Chars().encode(spec_decode.text_prompt("open", 500))
    first = spec_decode.greedy_answer(off, opening, spec_decode.REDO_ANSWER_LEN)
    first = first if first and first[-1] == 1 else [*first, 1]
    answer = spec_decode.greedy_answer(off, opening + first + opening, spec_decode.REDO_ANSWER_LEN)
    closed = answer if answer and answer[-1] == 1 else [*answer, 1]
    assert spec_decode.REDO_PASSES == 2 and prompt == opening + closed + opening and len(answer) > 0
    assert spec_decode.prompts("redo", 2, 0, 6, 100, _Chars(), off)[1] != prompt  # fresh stories per request
