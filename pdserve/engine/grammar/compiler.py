"""Compiling a `StructuredOutput` against the model's tokenizer, once per constraint.

`GrammarCompiler.compile(c)` returns a `CompiledGrammar` (a template matcher that each
sequence copies), from an LRU cache keyed by the constraint's hash. Compiling runs on
a small thread pool and the engine loop waits for it at most `timeout_s`: a constraint
that takes longer is refused with `GrammarCompileError` (the request gets a 400 naming
its parameter) and the loop goes on, so one pathological schema costs the worker at most
that long, once. A compile that outlives its wait keeps running in the pool and is
cached when it lands, so a retry can hit; a cache hit costs nothing.

"Compiled" includes the grammar's first mask: llguidance builds its lexer lazily, so a
pathological pattern (`(a{200}){1000}`: fifteen bytes) costs its time on the first mask,
which would otherwise fall inside an engine step. The first mask is computed in the pool,
under the same timeout, and every sequence's matcher starts from it. `PARSER_LIMITS`
bounds what llguidance may spend building regexes and per step; a grammar that exceeds
them at run time puts its matcher in the error state, which allows only EOS, and the
sequence ends.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pdserve.common.structured import StructuredOutput, StructuredOutputError, check

CACHE_SIZE = 256
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# llguidance's parser limits (its defaults in comments): regex construction fuel (1M,
# ~50k/ms: the knob that stops `(a{N}){1000}`), lexer fuel per mask (200k, ~14k/ms),
# Earley items per mask (50k), lexer states (250k, 1-2 kB each), and no schema text in
# error messages (they reach logs).
PARSER_LIMITS: dict[str, Any] = {"initial_lexer_fuel": 200_000, "step_lexer_fuel": 100_000, "step_max_items": 20_000,
                 "max_lexer_states": 50_000, "verbose_errors": False}


class GrammarCompileError(StructuredOutputError):
    """A constraint that did not compile (invalid, too complex, or not in time)."""


class CompiledGrammar:
    """A compiled constraint; `new_matcher()` gives a fresh llguidance matcher at the start of
    output, whose first mask is `first_mask` (computed once, at compile time)."""

    def __init__(self, key: str, template: Any, eos_token_ids: Sequence[int]) -> None:
        self.key = key
        self._template = template
        self.eos_token_ids = tuple(eos_token_ids)
        # None (a template built without one): each matcher computes its own.
        self.first_mask: bytes | None = getattr(template, "first_mask", None)

    def new_matcher(self) -> Any:
        return self._template.deep_copy()


def load_tokenizer(model_dir: str, vocab_size: int, eos_token_ids: Sequence[int]) -> Any:
    """The llguidance tokenizer of the model's `tokenizer.json`, covering the model's whole
    vocabulary (ids past the tokenizer's own are never allowed)."""
    from llguidance import LLTokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise GrammarCompileError("structured_outputs", f"structured outputs need {path}, which is missing")
    return LLTokenizer(path.read_text(encoding="utf-8"), n_vocab=vocab_size, eos_token=list(eos_token_ids))


class GrammarCompiler:
    """Compiles and caches grammars for one model; safe to call from the engine loop only."""

    def __init__(self, tokenizer_factory: Callable[[], Any], eos_token_ids: Sequence[int],
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, cache_size: int = CACHE_SIZE,
                 build: Callable[[Any, str], Any] | None = None) -> None:
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer: Any = None
        self.eos_token_ids = tuple(eos_token_ids)
        self.timeout_s = timeout_s
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._pending: dict[str, cf.Future[Any]] = {}
        self._build = build or _build_matcher
        self._pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        self.num_compiled = 0
        self.num_hits = 0

    def compile(self, c: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of `c`, or GrammarCompileError naming `c.param`."""
        key = c.key
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.num_hits += 1
            return hit
        try:
            grammar = check(c)  # a grammar error is reported without compiling anything
        except StructuredOutputError as e:
            raise GrammarCompileError(e.param, str(e)) from None
        future = self._pending.get(key)
        if future is None:
            tokenizer = self._tok()
            future = self._pool.submit(self._build, tokenizer, grammar)
            self._pending[key] = future
        try:
            template = future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            raise GrammarCompileError(
                c.param, f"{c.param} could not be compiled within {self.timeout_s:g} s "
                "(--grammar-compile-timeout)") from None
        del self._pending[key]
        if template.is_error():
            raise GrammarCompileError(c.param, f"invalid {c.param}: {template.get_error()[:300]}")
        compiled = CompiledGrammar(key, template, self.eos_token_ids)
        self._cache[key] = compiled
        self.num_compiled += 1
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _tok(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._tokenizer_factory()
        return self._tokenizer


class _Template:
    """An llguidance matcher at the start of output, with its first mask already computed."""

    def __init__(self, matcher: Any, first_mask: bytes) -> None:
        self.matcher = matcher
        self.first_mask = first_mask

    def is_error(self) -> bool:
        return bool(self.matcher.is_error())

    def get_error(self) -> str:
        return str(self.matcher.get_error())

    def deep_copy(self) -> Any:
        return self.matcher.deep_copy()


def _build_matcher(tokenizer: Any, grammar: str) -> Any:
    """Runs in the compile pool: the matcher and its first mask (llguidance drops the GIL)."""
    from llguidance import LLMatcher, LLParserLimits

    matcher = LLMatcher(tokenizer, grammar, log_level=0, limits=LLParserLimits(**PARSER_LIMITS))
    first = matcher.compute_bitmask() if not matcher.is_error() else b""
    return _Template(matcher, first)
