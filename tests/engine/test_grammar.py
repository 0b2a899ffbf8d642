"""Structured outputs in the engine, on the built-in model (random weights, its real
byte-level BPE tokenizer): the grammar masks every draw, the grammar state survives a
prefill -> decode handoff and a resume by replay, drafts are checked without being
committed, and compiling is cached and bounded in time.

Schemas force termination (enums, booleans, bounded strings and arrays) so that even
random weights finish inside max_tokens; validity is checked with `jsonschema` and with
llguidance's own matcher."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest

from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured import StructuredOutput, grammar_text, json_schema
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.grammar.compiler import GrammarCompileError, GrammarCompiler, load_tokenizer
from pdserve.engine.grammar.matcher import GrammarMatcher
from pdserve.engine.llm_engine import LLMEngine
from tests.engine.test_engine import _copy_kv, assert_idle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "color", "name", "tags"],
    "additionalProperties": False,
}
SAMPLED = {"temperature": 1.0, "max_tokens": 120}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("grammar-model"))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


def make_engine(model_dir: Path, **cfg: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model_dir=str(model_dir), dtype="float32", num_threads=1,
                                  cache=CacheConfig(num_blocks=128), **cfg))


@pytest.fixture()
def engine(model_dir: Path) -> Iterator[LLMEngine]:
    e = make_engine(model_dir)
    yield e
    assert_idle(e)


def schema_params(seed: int, **kw: Any) -> SamplingParams:
    return SamplingParams(**{**SAMPLED, **kw}, seed=seed, structured=json_schema(SCHEMA, "response_format"))


def assert_valid(model_dir: Path, tok: Tokenizer, c: StructuredOutput, ids: list[int], finish: str) -> str:
    """The output is a complete match: llguidance's matcher accepts every token and
    ends accepting, and the text parses (json_schema: validates against the schema)."""
    assert finish == "stop", f"did not finish inside max_tokens: {tok.decode(ids)!r}"
    eos = set(tok.eos_token_ids)
    body = [t for t in ids if t not in eos]
    assert len(body) == len(ids) - 1 and ids[-1] in eos  # ended by EOS, nothing after it
    m = llguidance.LLMatcher(load_tokenizer(str(model_dir), 2048, sorted(eos)), grammar_text(c), log_level=0)
    assert m.validate_tokens(body) == len(body) and m.consume_tokens(body) and m.is_accepting()
    text = tok.decode(body, skip_special_tokens=True)
    if c.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(c.spec))
    return text


def test_sampled_schema_outputs_are_all_valid(engine: LLMEngine, model_dir: Path, tok: Tokenizer) -> None:
    prompts = [tok.encode(p) for p in ("hello", "the quick brown fox", "json please:", "1 2 3")]
    results = engine.generate(prompts * 3, [schema_params(seed) for seed in range(12)])
    texts = set()
    for r in results:
        for ch in r.choices:
            texts.add(assert_valid(model_dir, tok, schema_params(0).structured, list(ch.token_ids), str(ch.finish_reason)))  # type: ignore[arg-type]
    assert len(texts) > 3  # sampled, so the 12 outputs are not all one string


def test_n_choices_forked_at_the_first_token_each_follow_the_grammar(engine: LLMEngine, model_dir: Path,
                                                                     tok: Tokenizer) -> None:
    [r] = engine.generate([tok.encode("hi")], schema_params(7, n=3))
    for ch in r.choices:
        assert_valid(model_dir, tok, schema_params(0).structured, list(ch.token_ids), str(ch.finish_reason))  # type: ignore[arg-type]


@pytest.mark.parametrize("c", [
    StructuredOutput("regex", r"(yes|no), [0-9]{2,4}!", "structured_outputs.regex"),
    StructuredOutput("choice", json.dumps(["a.b (c)", "x|y", "plain"]), "structured_outputs.choice"),
    StructuredOutput("grammar", 'start: term ("+" term)? ("+" term)? ";"\nterm: "ab" | "cd"',
                     "structured_outputs.grammar"),
], ids=["regex", "choice", "lark"])
def test_regex_choice_and_grammar_constraints(engine: LLMEngine, model_dir: Path, tok: Tokenizer,
                                              c: StructuredOutput) -> None:
    params = [SamplingParams(**SAMPLED, seed=s, structured=c) for s in range(4)]
    for r in engine.generate([tok.encode("go")] * 4, params):
        text = assert_valid(model_dir, tok, c, list(r.choices[0].token_ids), str(r.choices[0].finish_reason))
        if c.kind == "choice":
            assert text in json.loads(c.spec)


def test_json_object_output_stays_inside_the_grammar(engine: LLMEngine, model_dir: Path, tok: Tokenizer) -> None:
    """Any JSON object: unbounded, so random weights may not close it inside max_tokens;
    every token they produce is still one the grammar accepts, and a closed one parses."""
    c = StructuredOutput("json_object", "", "response_format")
    m = llguidance.LLMatcher(load_tokenizer(str(model_dir), 2048, sorted(tok.eos_token_ids)), grammar_text(c),
                             log_level=0)
    for r in engine.generate([tok.encode("go")] * 3, [SamplingParams(**SAMPLED, seed=s, structured=c) for s in range(3)]):
        ids = [t for t in r.choices[0].token_ids if t not in tok.eos_token_ids]
        assert m.validate_tokens(ids) == len(ids) and tok.decode(ids).startswith("{")
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(tok.decode(ids)), dict)


def test_greedy_too(engine: LLMEngine, model_dir: Path, tok: Tokenizer) -> None:
    [r] = engine.generate([tok.encode("x")], schema_params(0, temperature=0.0))
    assert_valid(model_dir, tok, schema_params(0).structured, list(r.choices[0].token_ids), str(r.choices[0].finish_reason))  # type: ignore[arg-type]


def test_prefill_to_decode_handoff_replays_the_first_token_once(model_dir: Path, tok: Tokenizer) -> None:
    """The decode engine rebuilds the grammar state from the prefill's first token: the
    tokens equal a single engine's, and a replay that consumed the first token twice
    would leave the grammar in error (EOS at once) or change the tokens."""
    params = [schema_params(s, n=2 if s % 2 else 1) for s in range(4)]
    prompts = [tok.encode(f"prompt {s}") for s in range(4)]
    ref = make_engine(model_dir).generate(prompts, params)
    prefill, decode = make_engine(model_dir), make_engine(model_dir)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        rid = f"r{i}"
        prefill.add_request(rid, prompt, p, prefill_only=True)
        assert p.structured is not None
        decode.grammar.compile(p.structured)  # what a decode node waits for (grammar_ready) before reserving
        reserved = decode.reserve_remote(rid, prompt, p).block_ids
        firsts: list[int] = []
        while prefill.has_unfinished():
            for out in prefill.step():
                firsts = [c.token_ids[0] for c in sorted(out.outputs, key=lambda c: c.index)]
        _copy_kv(prefill, prefill.held_blocks(rid), decode, reserved)
        prefill.release(rid)
        got = [[t] for t in firsts]
        decode.start_remote(rid, firsts)
        while decode.has_unfinished():
            for out in decode.step():
                for c in out.outputs:
                    got[c.index] += c.token_ids
        assert got == [list(c.token_ids) for c in ref[i].choices]
    assert_idle(prefill)
    assert_idle(decode)


def test_resume_replays_the_streamed_tokens(engine: LLMEngine, model_dir: Path, tok: Tokenizer) -> None:
    """Recovery re-prefills prompt + streamed output; the grammar replays that output and
    the continuation equals the undisturbed run."""
    prompt, p = tok.encode("resume me"), schema_params(11)
    full = list(engine.generate([prompt], p)[0].choices[0].token_ids)
    for k in (1, 5, len(full) - 2):
        engine.add_request(f"resume{k}", prompt, p, output_token_ids=full[:k])
        rest: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                rest += [t for c in out.outputs for t in c.token_ids]
        assert full[:k] + rest == full


def test_matcher_checks_a_draft_without_committing(engine: LLMEngine, model_dir: Path, tok: Tokenizer) -> None:
    c = json_schema(SCHEMA, "response_format")
    compiled = engine.grammar.compile(c)
    good = tok.encode('{"ok": true, "color": "red"', add_special_tokens=False)
    m = GrammarMatcher(compiled)
    assert m.accepted_prefix(good) == len(good)
    bad = good[:3] + tok.encode("}}}", add_special_tokens=False)
    assert m.accepted_prefix(bad) == 3  # cut at the first token the grammar rejects
    assert m.num_consumed == 0 and m.accepted_prefix(good) == len(good)  # nothing was committed
    assert m.sync(good[:2]) and m.accepted_prefix(good[2:]) == len(good) - 2
    assert not m.allowed(2048)[tok.encode("}", add_special_tokens=False)[0]]
    # Masks along a draft (for verifying it against the target model's logits): one per
    # accepted position plus the next, each equal to the committed state's there.
    masks = m.allowed_along(bad[2:], 2048)
    assert len(masks) == 2 and m.num_consumed == 2  # bad[2] accepted, bad[3] rejected
    assert (masks[0] == m.allowed(2048)).all() and masks[0][bad[2]] and not masks[1][bad[3]]
    step = GrammarMatcher(compiled)
    assert step.sync(good[:3]) and (step.allowed(2048) == masks[1]).all()


def test_compiled_grammars_are_cached_by_schema(engine: LLMEngine, tok: Tokenizer) -> None:
    before = engine.grammar.num_compiled
    engine.generate([tok.encode("a"), tok.encode("b")], [schema_params(1, max_tokens=2), schema_params(2, max_tokens=2)])
    # The same schema with its keys in another order is another text: compiled apart.
    other = json.loads(json.dumps(SCHEMA))
    other["properties"] = dict(reversed(list(other["properties"].items())))
    engine.generate([tok.encode("c")], SamplingParams(max_tokens=2, structured=json_schema(other, "response_format")))
    assert engine.grammar.num_compiled == before + 2
    assert engine.grammar.num_hits >= 1


def test_a_bad_constraint_is_a_value_error_naming_the_parameter(engine: LLMEngine, tok: Tokenizer) -> None:
    bad = StructuredOutput("regex", "a(b", "structured_outputs.regex")
    with pytest.raises(ValueError, match="structured_outputs.regex") as info:
        engine.add_request("bad", tok.encode("x"), SamplingParams(structured=bad))
    assert isinstance(info.value, GrammarCompileError) and info.value.param == "structured_outputs.regex"
    assert not engine.has_unfinished()


def test_compile_timeout_refuses_and_a_late_compile_is_cached() -> None:
    """A compile that outlives --grammar-compile-timeout is refused at once (the caller is
    not held past the timeout); when it lands it is cached, so the next request hits."""
    release, started = threading.Event(), threading.Event()
    built: list[str] = []

    def slow_build(tokenizer: Any, grammar: str) -> Any:
        started.set()
        assert release.wait(30)
        built.append(grammar)
        return _Template()

    compiler = GrammarCompiler(lambda: object(), [0], timeout_s=0.05, build=slow_build)
    c = StructuredOutput("regex", "[a-z]+", "structured_outputs.regex")
    with pytest.raises(GrammarCompileError, match="could not be compiled within 0.05 s") as info:
        compiler.compile(c)
    assert info.value.param == "structured_outputs.regex" and started.is_set()
    release.set()
    compiler.timeout_s = 30.0  # now wait for the pending compile (not a second one)
    compiled = compiler.compile(c)
    assert compiled.key == c.key and len(built) == 1
    assert compiler.compile(c) is compiled and compiler.num_hits == 1
    compiler.close()


class _Template:
    def is_error(self) -> bool:
        return False

    def deep_copy(self) -> _Template:
        return self
