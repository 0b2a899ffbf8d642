"""OpenAI response shapes for completions and chat completions, streaming and not.

One `ResponseBuilder` per request turns `ChoiceUpdate`s into stream chunks, or
accumulates them into the final non-streaming body.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.backend import Logprob
from gateway.generation import ChoiceUpdate
from gateway.prompt_echo import PromptView, echo_logprobs, prepend, vllm_prompt_logprobs
from gateway.tokenizer import Tokenizer
from gateway.tool_calls import ToolCallAssembler, ToolCallParser
from gateway.validation import CHAT


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class _Accumulated:
    text: list[str] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ResponseBuilder:
    def __init__(self, kind: str, request_id: str, model: str, tokenizer: Tokenizer, n: int, want_logprobs: bool,
                 tool_parser: Callable[[], ToolCallParser] | None = None, named_tool: bool = False) -> None:
        self._kind = kind
        self.id = ("chatcmpl-" if kind == CHAT else "cmpl-") + request_id
        self._model = model
        self._tok = tokenizer
        self._want_logprobs = want_logprobs
        self._created = int(time.time())
        self._acc = [_Accumulated() for _ in range(n)]
        self._text_offset = [0] * n  # completions logprobs.text_offset, per choice
        # Chat with tools: each choice's text goes through a tool-call parser.
        self._tool_parser = tool_parser if kind == CHAT else None
        self._parsers = [tool_parser() for _ in range(n)] if tool_parser is not None and kind == CHAT else []
        self._calls = [ToolCallAssembler() for _ in range(n)]
        self._named_tool = named_tool  # OpenAI ends a forced named call with "stop"
        self._prompt: PromptView | None = None
        self._opened: set[int] = set()  # choices whose first chunk went out (echo, prompt_logprobs)

    def set_prompt(self, view: PromptView) -> None:
        """The prompt, for echo and prompt_logprobs; set once its logprobs are in (they
        come with the first token)."""
        self._prompt = view
        if view.echo:  # the output's text offsets start after the echoed prompt's tokens
            self._text_offset = [sum(len(self._token(t)) for t in view.token_ids)] * len(self._acc)

    # -- streaming ------------------------------------------------------------

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self._kind == CHAT else "text_completion"
        return {"id": self.id, "object": obj, "created": self._created, "model": self._model, "choices": choices}

    def role_chunk(self) -> dict[str, Any]:
        """Chat streams open every choice with the assistant role (and the prompt's logprobs)."""
        return self._with_prompt_logprobs(self._envelope(
            [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
             for i in range(len(self._acc))]
        ))

    def chunk(self, u: ChoiceUpdate) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": u.index}
        if self._kind == CHAT and self._parsers:
            choice["delta"] = self._tool_delta(u)
        elif self._kind == CHAT:
            choice["delta"] = {"content": u.text} if u.text or u.finish_reason is None else {}
        else:
            choice["text"] = u.text
        choice["logprobs"] = self._logprobs(u.index, u.logprobs, u.text) if self._want_logprobs else None
        if self._kind != CHAT and u.index not in self._opened:
            self._opened.add(u.index)
            self._open_completion(choice)
        choice["finish_reason"] = self._finish_reason(u.index, u.finish_reason)
        if u.finish_reason is not None:
            choice["stop_reason"] = u.stop_reason
        return self._envelope([choice])

    def final_chunk(self, usage_obj: dict[str, Any] | None, timings: dict[str, float] | None) -> dict[str, Any]:
        """The last chunk before [DONE]: no choices, usage and/or the pdserve_timings extension."""
        out = self._envelope([])
        if usage_obj is not None:
            out["usage"] = usage_obj
        if timings is not None:
            out["pdserve_timings"] = timings
        return out

    # -- non-streaming --------------------------------------------------------

    def add(self, u: ChoiceUpdate) -> None:
        acc = self._acc[u.index]
        acc.text.append(u.text)
        if u.logprobs:
            acc.logprobs.extend(u.logprobs)
        if u.finish_reason is not None:
            acc.finish_reason, acc.stop_reason = u.finish_reason, u.stop_reason

    def final(self, usage_obj: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for i, acc in enumerate(self._acc):
            text = "".join(acc.text)
            lp = self._logprobs(i, acc.logprobs, text) if self._want_logprobs else None
            if self._kind == CHAT:
                choice: dict[str, Any] = {"index": i, "message": self._message(i, text)}
            else:
                choice = {"index": i, "text": text}
            choice.update(logprobs=lp, finish_reason=self._finish_reason(i, acc.finish_reason),
                          stop_reason=acc.stop_reason)
            if self._kind != CHAT:
                self._open_completion(choice)
            choices.append(choice)
        obj = "chat.completion" if self._kind == CHAT else "text_completion"
        body = {"id": self.id, "object": obj, "created": self._created, "model": self._model,
                "choices": choices, "usage": usage_obj}
        return self._with_prompt_logprobs(body) if self._kind == CHAT else body

    # -- the prompt: echo and prompt_logprobs ---------------------------------

    def _open_completion(self, choice: dict[str, Any]) -> None:
        """A completion choice's first chunk (or whole body): echo and prompt_logprobs."""
        view = self._prompt
        if view is None:
            return
        if view.echo:
            choice["text"] = view.text + choice["text"]
            if choice["logprobs"] is not None:
                choice["logprobs"] = prepend(echo_logprobs(view, self._token), choice["logprobs"])
        if view.logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(view.logprobs, self._token)

    def _with_prompt_logprobs(self, body: dict[str, Any]) -> dict[str, Any]:
        if self._prompt is not None and self._prompt.logprobs is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(self._prompt.logprobs, self._token)
        return body

    # -- tool calls -----------------------------------------------------------

    def _tool_delta(self, u: ChoiceUpdate) -> dict[str, Any]:
        parser = self._parsers[u.index]
        content, calls = parser.feed(u.text)
        if u.finish_reason is not None:
            tail = parser.finish()
            content, calls = content + tail.content, calls + tail.calls
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = self._calls[u.index].deltas(calls)
        return delta

    def _message(self, index: int, text: str) -> dict[str, Any]:
        if self._tool_parser is None:
            return {"role": "assistant", "content": text}
        parser = self._tool_parser()
        first, rest = parser.feed(text), parser.finish()
        calls = self._calls[index]
        calls.deltas([c for c in first.calls + rest.calls if c.index != parser.unclosed])
        content = first.content + rest.content
        if not calls.any:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content or None, "tool_calls": calls.calls()}

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        if reason == "stop" and self._calls[index].any and not self._named_tool:
            return "tool_calls"
        return reason

    # -- logprobs -------------------------------------------------------------

    def _token(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, index: int, entries: list[Logprob] | None, text: str) -> dict[str, Any] | None:
        entries = entries or []
        if self._kind == CHAT:
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens = [self._token(e.token_id) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(self._text_offset[index])
            self._text_offset[index] += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token(t.token_id): t.logprob for t in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _chat_entry(self, e: Logprob) -> dict[str, Any]:
        tok = self._token(e.token_id)
        return {
            "token": tok,
            "logprob": e.logprob,
            "bytes": list(tok.encode("utf-8")),
            "top_logprobs": [
                {"token": (t := self._token(a.token_id)), "logprob": a.logprob, "bytes": list(t.encode("utf-8"))}
                for a in e.top
            ],
        }
