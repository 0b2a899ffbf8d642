"""A grammar compiler whose compiles run for real (llguidance, first mask included) and
then wait at a gate the test holds: "still compiling" for exactly as long as the test
says, with no sleep and no race."""

from __future__ import annotations

import threading
from typing import Any

from pdserve.engine.grammar.compiler import GrammarCompiler, _build_matcher, load_tokenizer
from pdserve.engine.llm_engine import LLMEngine

PATHOLOGICAL = "(a{200}){1000}"  # fifteen bytes: 0.3-0.5 s of lexer building on its first mask
GATE_WAIT_S = 60.0


class Gate:
    def __init__(self) -> None:
        self.open = threading.Event()
        self.started = threading.Event()  # a compile entered the pool
        self.built = threading.Event()  # the real compile is done; it now waits for `open`
        self.num_builds = 0

    def build(self, tokenizer: Any, grammar: str) -> Any:
        self.started.set()
        self.num_builds += 1
        template = _build_matcher(tokenizer, grammar)
        self.built.set()
        assert self.open.wait(GATE_WAIT_S), "the test never opened the gate"
        return template


def gate_engine(engine: LLMEngine, gate: Gate, timeout_s: float = 30.0) -> GrammarCompiler:
    """Give `engine` a compiler (over its model's real tokenizer) whose compiles pass `gate`."""
    eos = sorted(engine.eos_token_ids)
    engine.grammar.close()
    engine.grammar = GrammarCompiler(lambda: load_tokenizer(engine.config.model_dir, engine.vocab_size, eos),
                                     eos, timeout_s, build=gate.build)
    return engine.grammar
