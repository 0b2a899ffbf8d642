"""Compiling a `StructuredOutput` against the model's tokenizer, once per constraint.

`GrammarCompiler.poll(c, since)` never blocks: it starts the compile on a small thread
pool (the first call) and returns the `CompiledGrammar` (a template matcher that each
sequence copies) once it is ready, None while it is still compiling, and raises
`GrammarCompileError` (the request gets a 400 naming its parameter) when the constraint
is invalid, its compile failed, or `timeout_s` has passed since `since` (when that
request first asked). The engine keeps such a request in a compiling state its
scheduler never sees and polls it between steps (pdserve/engine/llm_engine.py), so a
pathological schema costs the step loop nothing. A compile that outlives a request's
wait keeps running in the pool and is cached when it lands, so a retry can hit; a
compile that failed is remembered (bounded), so resending it costs nothing either.
`compile(c)` is the blocking form (tests, tools).

"Compiled" includes the grammar's first mask: llguidance builds its lexer lazily, so a
pathological pattern (`(a{200}){1000}`: fifteen bytes) costs its time on the first mask,
which would otherwise fall inside an engine step. The first mask is computed in the pool,
under the same timeout, and every sequence's matcher starts from it. `PARSER_LIMITS`
bounds what llguidance may spend building regexes and per step; a grammar that exceeds
them at run time puts its matcher in the error state, which allows only EOS, and the
sequence ends. The pool's threads run at a lower CPU priority than the step loop
(`COMPILE_NICENESS`), so compiles in flight slow other requests' tokens little even
when the cores are few.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pdserve.common.structured import StructuredOutput, StructuredOutputError, check

CACHE_SIZE = 256
FAILED_CACHE_SIZE = 256  # constraints whose compile failed: refused again without compiling
COMPILE_NICENESS = 10  # the compile threads' nice value above the step loop's (Linux: per thread)
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
    """Compiles and caches grammars for one model; call it from the engine loop only."""

    def __init__(self, tokenizer_factory: Callable[[], Any], eos_token_ids: Sequence[int],
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, cache_size: int = CACHE_SIZE,
                 build: Callable[[Any, str], Any] | None = None) -> None:
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()  # the pool's threads build it once, on first use
        self.eos_token_ids = tuple(eos_token_ids)
        self.timeout_s = timeout_s
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._failed: OrderedDict[str, str] = OrderedDict()  # key -> why (bounded)
        self._pending: dict[str, cf.Future[Any]] = {}
        self._build = build or _build_matcher
        self._pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile",
                                           initializer=_lower_priority)
        self.num_compiled = 0
        self.num_hits = 0

    def poll(self, c: StructuredOutput, since: float) -> CompiledGrammar | None:
        """The compiled grammar of `c` if it is ready, None while it compiles and `since`
        (time.monotonic() of the caller's first ask) is under `timeout_s` ago; otherwise
        GrammarCompileError naming `c.param`. The first call starts the compile."""
        key = c.key
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.num_hits += 1
            return hit
        if key in self._failed:
            raise GrammarCompileError(c.param, self._failed[key])
        future = self._pending.get(key)
        if future is None:
            try:
                grammar = check(c)  # a grammar error is reported without compiling anything
            except StructuredOutputError as e:
                raise GrammarCompileError(e.param, str(e)) from None
            future = self._pool.submit(self._build_with_tokenizer, grammar)
            self._pending[key] = future
        if future.done():
            return self._land(c, future)
        if time.monotonic() - since >= self.timeout_s:
            raise GrammarCompileError(
                c.param, f"{c.param} could not be compiled within {self.timeout_s:g} s "
                "(--grammar-compile-timeout)")
        return None

    def compile(self, c: StructuredOutput) -> CompiledGrammar:
        """`poll` waiting up to `timeout_s` (blocking: never from the step loop)."""
        since = time.monotonic()
        while (compiled := self.poll(c, since)) is None:
            cf.wait([self._pending[c.key]], timeout=max(0.0, since + self.timeout_s - time.monotonic()))
        return compiled

    def wait(self, timeout_s: float) -> None:
        """Block until some compile in flight lands or `timeout_s` passes (for a caller
        with nothing else to do)."""
        if self._pending:
            cf.wait(list(self._pending.values()), timeout=timeout_s, return_when=cf.FIRST_COMPLETED)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _land(self, c: StructuredOutput, future: cf.Future[Any]) -> CompiledGrammar:
        key = c.key
        del self._pending[key]
        try:
            template = future.result()
        except GrammarCompileError as e:
            self._remember_failure(key, str(e))
            raise GrammarCompileError(c.param, str(e)) from None
        except Exception as e:  # noqa: BLE001 - the grammar library's own errors: a refusal, never a crash
            self._remember_failure(key, f"{c.param} could not be compiled ({type(e).__name__})")
            raise GrammarCompileError(c.param, self._failed[key]) from None
        if template.is_error():
            self._remember_failure(key, f"invalid {c.param}: {template.get_error()[:300]}")
            raise GrammarCompileError(c.param, self._failed[key])
        compiled = CompiledGrammar(key, template, self.eos_token_ids)
        self._cache[key] = compiled
        self.num_compiled += 1
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return compiled

    def _remember_failure(self, key: str, why: str) -> None:
        self._failed[key] = why
        while len(self._failed) > FAILED_CACHE_SIZE:
            self._failed.popitem(last=False)

    def _build_with_tokenizer(self, grammar: str) -> Any:
        """In the pool: the tokenizer (built once: reading tokenizer.json is slow) and the matcher."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._tokenizer_factory()
        return self._build(self._tokenizer, grammar)

    def _tok(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._tokenizer_factory()
        return self._tokenizer


def _lower_priority() -> None:
    """The compile thread's initializer: below the step loop's CPU priority (Linux applies a
    thread id's nice value to that thread alone; elsewhere, or when refused, nothing changes)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICENESS)
    except (AttributeError, OSError):
        pass


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
