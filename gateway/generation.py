"""One request's generation as seen by the gateway: backend token events in, per-choice
text updates out.

`Generation` iterates the backend's `TokenDelta`s, detokenizes each choice
incrementally (UTF-8 safe, stop strings applied by `IncrementalDetokenizer`), and
yields `ChoiceUpdate`s. It closes the backend iterator when it ends for any reason,
including a stop string that finished every choice, a deadline and the consumer
going away (which is how a client disconnect aborts the request everywhere).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.backend import (
    BackendError,
    BackendErrorKind,
    GenerateRequest,
    GenerationBackend,
    Logprob,
)
from gateway.detokenizer import DetokDelta, IncrementalDetokenizer
from gateway.timing import RequestTimer
from gateway.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChoiceUpdate:
    """New output of one choice. `finish_reason` is set on the choice's last update."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the matched stop string, when one ended it


@dataclass
class _Choice:
    detok: IncrementalDetokenizer
    num_tokens: int = 0
    finished: bool = False


@dataclass
class GenerationStats:
    """Counters the handlers read for usage, metrics and logs."""

    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None  # timer clock
    # params.prompt_logprobs: from the first delta that carries them (a recovery's
    # re-prefill computes them again; the first ones stand).
    prompt_logprobs: list[Logprob | None] | None = None
    last_token_at: float | None = None
    finish_reasons: dict[int, str] = field(default_factory=dict)


class Generation:
    def __init__(
        self,
        backend: GenerationBackend,
        req: GenerateRequest,
        tokenizer: Tokenizer,
        timer: RequestTimer,
        *,
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
        on_first_token: Callable[[], None] | None = None,
    ) -> None:
        self._backend = backend
        self._req = req
        self._timer = timer
        self._on_first_token = on_first_token
        self.stats = GenerationStats()
        self._choices = [
            _Choice(IncrementalDetokenizer(tokenizer, stop=stop, skip_special_tokens=skip_special_tokens,
                                           include_stop_str=include_stop_str))
            for _ in range(req.params.n)
        ]
        self._events: AsyncIterator[Any] | None = None

    async def first(self) -> ChoiceUpdate | None:
        """Start the request and wait for its first update, so that errors before any
        output (no workers, overload) surface before the HTTP response is started."""
        self._events = self._updates()
        try:
            return await self._events.__anext__()
        except StopAsyncIteration:
            return None

    async def rest(self) -> AsyncIterator[ChoiceUpdate]:
        """The updates after `first()`."""
        assert self._events is not None, "call first() before rest()"
        async for update in self._events:
            yield update

    async def aclose(self) -> None:
        if self._events is not None:
            await self._events.aclose()  # type: ignore[attr-defined]

    async def _updates(self) -> AsyncIterator[ChoiceUpdate]:
        events = self._backend.generate(self._req)
        try:
            while not all(c.finished for c in self._choices):
                delta = await self._next(events)
                if delta is None:
                    break
                update = self._apply(delta)
                if update is not None:
                    yield update
            if not all(c.finished for c in self._choices):
                raise BackendError(BackendErrorKind.FAILED, "the backend ended the request without finishing it")
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:
                await close()

    async def _next(self, events: AsyncIterator[Any]) -> Any:
        t0 = self._timer.now()
        try:
            if self._req.deadline is None:
                return await events.__anext__()
            remaining = self._req.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            return await asyncio.wait_for(events.__anext__(), remaining)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            raise BackendError(BackendErrorKind.TIMEOUT, "request deadline exceeded") from None
        finally:
            self._timer.add_backend_wait(self._timer.now() - t0)

    def _apply(self, delta: Any) -> ChoiceUpdate | None:
        self._timer.report(delta.timings)
        self.stats.cached_tokens = max(self.stats.cached_tokens, delta.cached_tokens)
        if self.stats.prompt_logprobs is None and delta.prompt_logprobs is not None:
            self.stats.prompt_logprobs = list(delta.prompt_logprobs)
        if not 0 <= delta.index < len(self._choices):
            raise BackendError(BackendErrorKind.FAILED, f"backend sent choice index {delta.index}")
        choice = self._choices[delta.index]
        if choice.finished:
            return None  # a stop string already ended this choice; n > 1 siblings continue
        if delta.token_ids:
            now = self._timer.now()
            if self.stats.first_token_at is None:
                self.stats.first_token_at = now
                if self._on_first_token is not None:
                    self._on_first_token()
            self.stats.last_token_at = now
        with self._timer.measure("detokenize"):
            out, used = push_until_stop(choice.detok, delta.token_ids)
            text, finish, stop_reason = out.text, delta.finish_reason, None
            if out.stopped:
                finish, stop_reason = "stop", out.stop_reason
            elif finish is not None:
                text += choice.detok.flush()
        token_ids = list(delta.token_ids[:used])
        logprobs = delta.logprobs[:used] if delta.logprobs else delta.logprobs
        choice.num_tokens += used
        self.stats.completion_tokens += used
        if finish is not None:
            choice.finished = True
            self.stats.finish_reasons[delta.index] = finish
        if not text and finish is None and not logprobs:
            return None
        return ChoiceUpdate(delta.index, text, token_ids, logprobs, finish, stop_reason)


def push_until_stop(detok: IncrementalDetokenizer, token_ids: Sequence[int]) -> tuple[DetokDelta, int]:
    """Push a delta's tokens one at a time: a delta of several tokens (speculative
    decoding) then ends at the token that completes a stop string, exactly where
    one-token deltas would, so the text, logprobs and usage are the same. Returns the
    text and how many of the tokens it consumed."""
    if len(token_ids) <= 1:
        return detok.push(list(token_ids)), len(token_ids)
    texts = []
    for i, token in enumerate(token_ids):
        out = detok.push([token])
        texts.append(out.text)
        if out.stopped:
            return DetokDelta("".join(texts), True, out.stop_reason), i + 1
    return DetokDelta("".join(texts), False, None), len(token_ids)
