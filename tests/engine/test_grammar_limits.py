"""A pathological grammar cannot stall the engine step (pdserve/engine/grammar/compiler.py): its
first mask is computed at compile time, inside the compile timeout and off the step
loop, and llguidance's parser limits end a matcher whose lexer would explode instead of
letting every step pay for it. On the built-in model's real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import pytest

from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model
from pdserve.common.structured import StructuredOutput
from pdserve.engine.grammar.compiler import (
    PARSER_LIMITS,
    GrammarCompileError,
    GrammarCompiler,
    load_tokenizer,
)
from pdserve.engine.grammar.matcher import GrammarMatcher

PATHOLOGICAL = "(a{200}){1000}"  # fifteen bytes; its lexer grows without bound


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("grammar-limits"))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


def compiler(model_dir: Path, tok: Tokenizer, timeout_s: float = 30.0) -> GrammarCompiler:
    eos = list(tok.eos_token_ids)
    return GrammarCompiler(lambda: load_tokenizer(str(model_dir), tok.vocab_size, eos), eos, timeout_s=timeout_s)


def regex(pattern: str) -> StructuredOutput:
    return StructuredOutput("regex", pattern, "structured_outputs.regex")


class _CountingMatcher:
    """The llguidance matcher, counting the masks it is asked to compute."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.masks = 0

    def compute_bitmask(self) -> bytes:
        self.masks += 1
        return bytes(self.inner.compute_bitmask())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_the_first_mask_comes_from_compile_time(model_dir: Path, tok: Tokenizer) -> None:
    """Every sequence starts from the mask computed when the grammar compiled: the first
    step computes nothing; the mask is llguidance's own."""
    c = compiler(model_dir, tok)
    compiled = c.compile(regex("[a-c]{2}x"))
    assert compiled.first_mask is not None
    m = GrammarMatcher(compiled)
    counting = _CountingMatcher(m._m)
    m._m = counting
    first = m.allowed(tok.vocab_size)
    assert counting.masks == 0
    fresh = llguidance.LLMatcher(c._tok(), llguidance.LLMatcher.grammar_from_regex("[a-c]{2}x"), log_level=0)
    want = np.unpackbits(np.frombuffer(fresh.compute_bitmask(), dtype=np.uint8), bitorder="little").astype(bool)
    assert (first == want[: tok.vocab_size]).all() and first[tok.encode("a", add_special_tokens=False)[0]]
    a = tok.encode("a", add_special_tokens=False)
    assert m.sync(a)
    m.allowed(tok.vocab_size)  # after a token: the matcher's own mask
    assert counting.masks == 1
    # A draft checked from the start, then rolled back to it: only the mask after the
    # draft's token is computed; the start is the compile-time mask again.
    m2 = GrammarMatcher(compiled)
    m2._m = counting2 = _CountingMatcher(m2._m)
    masks = m2.allowed_along(a, tok.vocab_size)
    assert len(masks) == 2 and (masks[0] == first).all() and counting2.masks == 1
    assert (m2.allowed(tok.vocab_size) == first).all() and counting2.masks == 1
    c.close()


def test_a_pathological_first_mask_counts_against_the_compile_timeout(model_dir: Path, tok: Tokenizer) -> None:
    """Building `(a{1000}){1000}`'s matcher takes a millisecond, its first mask far longer:
    with the first mask inside compile, a short timeout refuses it (a 400 at the gateway)
    instead of admitting it to stall a step."""
    c = compiler(model_dir, tok, timeout_s=0.01)
    with pytest.raises(GrammarCompileError, match="could not be compiled within"):
        c.compile(regex("(a{1000}){1000}"))
    c.close()


def test_parser_limits_end_a_matcher_whose_lexer_explodes(model_dir: Path, tok: Tokenizer) -> None:
    """Under llguidance's default limits every step of `(a{200}){1000}` builds more lexer
    states (0.1-0.2 s each, here); with ours the matcher errs at its first token, so the
    sequence may only end (EOS)."""
    c = compiler(model_dir, tok)
    m = GrammarMatcher(c.compile(regex(PATHOLOGICAL)))
    a = tok.encode("a", add_special_tokens=False)
    assert not m.sync(a) and m.is_error
    allowed = m.allowed(tok.vocab_size)
    assert set(np.flatnonzero(allowed)) == {t for t in tok.eos_token_ids if t < tok.vocab_size}
    # Under the default limits the same matcher does not err (it keeps paying instead).
    default = llguidance.LLMatcher(c._tok(), llguidance.LLMatcher.grammar_from_regex(PATHOLOGICAL), log_level=0)
    assert default.consume_tokens(a) and not default.is_error()
    assert PARSER_LIMITS["initial_lexer_fuel"] < llguidance.LLParserLimits().initial_lexer_fuel
    c.close()


def test_ordinary_grammars_still_compile_under_the_limits(model_dir: Path, tok: Tokenizer) -> None:
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
              "tags": {"type": "array", "items": {"enum": ["a", "b"]}}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    c = compiler(model_dir, tok)
    cases = [(StructuredOutput("json_schema", json.dumps(schema), "response_format"), '{"name": "x", "n": 1}'),
             (regex(r"\d{3}-\d{4}"), "555-1234"), (regex("(ab|cd){50}x"), "ab" * 50 + "x")]
    for so, text in cases:
        m = GrammarMatcher(c.compile(so))
        assert m.sync(tok.encode(text, add_special_tokens=False)), so
        assert m.is_accepting
    c.close()
