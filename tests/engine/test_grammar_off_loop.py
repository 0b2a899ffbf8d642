"""A grammar compiles off the step loop (pdserve/engine/grammar/pending.py): a request
whose grammar is not compiled yet waits WAITING_FOR_GRAMMAR, unseen by the scheduler and
holding no block, while every other request keeps stepping; it is queued once its
compile (first mask included) lands, and refused, holding nothing, when the compile
fails or outlives --grammar-compile-timeout. On the built-in model and its real
tokenizer, the compile a real pathological regex's, held at a gate the test opens."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.structured import StructuredOutput
from pdserve.engine.core.outputs import RequestOutput
from pdserve.engine.core.sequence import SequenceStatus
from pdserve.engine.grammar.compiler import GrammarCompileError
from pdserve.engine.llm_engine import GrammarNotReady, LLMEngine
from tests.engine.grammar_gate import GATE_WAIT_S, PATHOLOGICAL, Gate, gate_engine
from tests.engine.test_engine import assert_idle
from tests.engine.test_grammar import make_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PLAIN = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)


def constrained(pattern: str = PATHOLOGICAL, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, structured=StructuredOutput(
        "regex", pattern, "structured_outputs.regex"), **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("grammar-off-loop"))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


@pytest.fixture()
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.open.set()  # never leave a compile thread waiting


def _status(engine: LLMEngine, rid: str) -> SequenceStatus:
    return engine._requests[rid].seqs[0].status


def _step_until(engine: LLMEngine, done: object, what: str) -> list[RequestOutput]:
    """Step (waiting on the compile pool when nothing else can run) until `done()`."""
    outs: list[RequestOutput] = []
    deadline = time.monotonic() + GATE_WAIT_S
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        batch = engine.schedule()
        if batch.is_empty:
            engine.grammar.wait(0.05)
        outs += engine.execute(batch)
    return outs


def test_others_finish_while_a_pathological_grammar_compiles(model_dir: Path, tok: Tokenizer, gate: Gate) -> None:
    engine = make_engine(model_dir)
    gate_engine(engine, gate)
    engine.add_request("g", tok.encode("grammar"), constrained())
    assert _status(engine, "g") is SequenceStatus.WAITING_FOR_GRAMMAR and engine.num_compiling == 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_allocatable  # holds no block
    engine.add_request("plain", tok.encode("plain text"), PLAIN)
    tokens: list[int] = []
    steps = 0
    while "plain" in engine._requests:
        for out in engine.step():
            assert out.request_id == "plain"  # the compiling request is never scheduled
            tokens += [t for c in out.outputs for t in c.token_ids]
        steps += 1
        assert steps < 100
    # The other request ran to its end, step after step, with the compile still held.
    assert len(tokens) == PLAIN.max_tokens and not gate.open.is_set()
    assert _status(engine, "g") is SequenceStatus.WAITING_FOR_GRAMMAR and engine.num_compiling == 1
    assert gate.started.wait(GATE_WAIT_S) and gate.num_builds == 1
    gate.open.set()
    outs = _step_until(engine, lambda: not engine.has_unfinished(), "the grammar request never ran")
    got = [t for o in outs for c in o.outputs for t in c.token_ids]
    a = tok.encode("a", add_special_tokens=False)[0]
    assert got and got[0] == a  # drawn under the grammar's (compile-time) first mask
    assert outs[-1].finished and engine.take_failed() == []
    assert_idle(engine)


def test_a_compile_past_the_timeout_is_refused_holding_no_block(model_dir: Path, tok: Tokenizer,
                                                                 gate: Gate) -> None:
    engine = make_engine(model_dir)
    gate_engine(engine, gate, timeout_s=0.3)
    total = engine.block_manager.num_allocatable
    engine.add_request("g", tok.encode("grammar"), constrained())
    failed = []

    def refused() -> bool:
        assert engine.block_manager.num_free_blocks == total  # not a block, the whole wait
        failed.extend(engine.take_failed())
        return bool(failed)

    _step_until(engine, refused, "the compile was never timed out")
    [f] = failed
    assert f.request_id == "g" and f.param == "structured_outputs.regex"
    assert "could not be compiled within 0.3 s" in f.reason
    assert engine.num_compiling == 0 and "g" not in engine._requests
    assert_idle(engine)
    # The compile went on in the pool; once it lands a retry is queued at once.
    gate.open.set()
    engine.grammar.timeout_s = 30.0
    engine.grammar.compile(constrained().structured)  # type: ignore[arg-type]
    engine.add_request("again", tok.encode("grammar"), constrained())
    assert _status(engine, "again") is SequenceStatus.WAITING and gate.num_builds == 1
    _step_until(engine, lambda: not engine.has_unfinished(), "the retry never finished")
    assert_idle(engine)


def test_a_failed_compile_is_refused_and_remembered(model_dir: Path, tok: Tokenizer) -> None:
    engine = make_engine(model_dir)
    engine.grammar._build = _raise  # type: ignore[method-assign]
    engine.add_request("g", tok.encode("x"), constrained("[a-z]+"))
    failed: list = []
    _step_until(engine, lambda: bool(failed.extend(engine.take_failed()) or failed), "never refused")
    assert failed[0].request_id == "g" and "could not be compiled (RuntimeError)" in failed[0].reason
    # The same constraint again is refused at once, without compiling (a plain 400).
    with pytest.raises(GrammarCompileError, match="could not be compiled"):
        engine.add_request("g2", tok.encode("x"), constrained("[a-z]+"))
    assert_idle(engine)


def _raise(tokenizer: object, grammar: str) -> object:
    raise RuntimeError("the grammar library failed")


def test_an_aborted_compiling_request_holds_nothing(model_dir: Path, tok: Tokenizer, gate: Gate) -> None:
    engine = make_engine(model_dir)
    gate_engine(engine, gate)
    engine.add_request("g", tok.encode("x"), constrained())
    assert engine.has_unfinished() and engine.abort("g")
    assert engine.num_compiling == 0
    assert_idle(engine)


def test_a_reservation_needs_its_grammar_first(model_dir: Path, tok: Tokenizer, gate: Gate) -> None:
    """The decode side: `reserve_remote` reserves nothing before the grammar compiled;
    `grammar_ready` says when it has, or refuses past the timeout."""
    engine = make_engine(model_dir)
    gate_engine(engine, gate, timeout_s=30.0)
    params = constrained()
    since = time.monotonic()
    assert not engine.grammar_ready(params, since)
    with pytest.raises(GrammarNotReady):
        engine.reserve_remote("r", tok.encode("x"), params)
    assert "r" not in engine._requests
    with pytest.raises(GrammarCompileError, match="could not be compiled within"):
        engine.grammar_ready(params, since - 31.0)  # asked first 31 s ago: out of time
    gate.open.set()
    deadline = time.monotonic() + GATE_WAIT_S
    while not engine.grammar_ready(params, time.monotonic()):
        assert time.monotonic() < deadline
        engine.grammar.wait(0.05)
    assert engine.reserve_remote("r", tok.encode("x"), params).ok
    assert engine.abort("r")
    assert_idle(engine)
