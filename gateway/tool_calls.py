"""Tool calls in generated text: parsers that split a choice's output into content and
tool-call deltas, streaming or at once (vLLM's `--tool-call-parser` formats).

- `hermes` (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  anywhere in the text; text outside the tags is content.
- `llama3_json` (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, several separated by `;`.
- forced calls (`tool_choice` required / a named function, generated under a grammar):
  a named call's output is its arguments object, streamed as it comes; `required`
  produces `[{"name": ..., "parameters": {...}}, ...]`.

A parser yields `ToolCallDelta`s: the first delta of call i carries its name, later
ones only argument text, as OpenAI streams them. `ToolCallAssembler` gives each call
its id and the OpenAI dict shapes.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

PARSERS = ("hermes", "llama3_json")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    name: str | None  # set on a call's first delta
    arguments: str


class ParseStep(NamedTuple):
    content: str
    calls: list[ToolCallDelta]


class ToolCallParser(Protocol):
    def feed(self, text: str) -> ParseStep: ...

    def finish(self) -> ParseStep: ...

    @property
    def unclosed(self) -> int | None:
        """After `finish`: the index of a streamed call whose arguments were cut off
        (max_tokens) before they closed; the final message leaves it out."""
        ...


def _call(obj: Any, args_key: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that could begin `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass
class HermesParser:
    _buf: str = ""
    _inside: bool = False
    _n: int = 0
    unclosed: int | None = None  # a call is parsed whole or not at all

    def feed(self, text: str) -> ParseStep:
        self._buf += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if not self._inside:
                i = self._buf.find(_OPEN)
                if i < 0:
                    keep = _held_prefix(self._buf, _OPEN)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._buf[:i])
                self._buf, self._inside = self._buf[i + len(_OPEN):], True
            else:
                j = self._buf.find(_CLOSE)
                if j < 0:
                    break
                raw, self._buf, self._inside = self._buf[:j], self._buf[j + len(_CLOSE):], False
                content.append(self._take(raw, calls))
        return ParseStep("".join(content), calls)

    def finish(self) -> ParseStep:
        calls: list[ToolCallDelta] = []
        text = self._take(self._buf, calls) if self._inside else self._buf
        self._buf, self._inside = "", False
        return ParseStep(text, calls)

    def _take(self, raw: str, calls: list[ToolCallDelta]) -> str:
        """Parse one tagged call into `calls`; text that is not a call stays content."""
        try:
            parsed = _call(json.loads(raw), "arguments")
        except ValueError:
            parsed = None
        if parsed is None:
            return _OPEN + raw + _CLOSE
        calls.append(ToolCallDelta(self._n, parsed[0], parsed[1]))
        self._n += 1
        return ""


@dataclass
class Llama3JsonParser:
    _buf: str = ""
    _mode: str = "?"  # ? undecided, text, calls
    unclosed: int | None = None  # calls are parsed at the end, whole

    def feed(self, text: str) -> ParseStep:
        self._buf += text
        if self._mode == "?":
            head = self._buf.lstrip()
            if not head or (_PYTHON_TAG.startswith(head) and head != _PYTHON_TAG):
                return ParseStep("", [])
            self._mode = "calls" if head.startswith(("{", _PYTHON_TAG)) else "text"
        if self._mode == "text":
            out, self._buf = self._buf, ""
            return ParseStep(out, [])
        return ParseStep("", [])

    def finish(self) -> ParseStep:
        buf, self._buf = self._buf, ""
        if self._mode != "calls":
            return ParseStep(buf, [])
        calls = _json_calls(buf.strip().removeprefix(_PYTHON_TAG), "parameters")
        return ParseStep("", calls) if calls else ParseStep(buf, [])


def _json_calls(text: str, args_key: str) -> list[ToolCallDelta]:
    """Call objects separated by `;` or whitespace; [] unless the whole text is calls."""
    dec, pos = json.JSONDecoder(), 0
    calls: list[ToolCallDelta] = []
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            return calls
        try:
            obj, pos = dec.raw_decode(text, pos)
        except ValueError:
            return []
        parsed = _call(obj, args_key)
        if parsed is None:
            return []
        calls.append(ToolCallDelta(len(calls), *parsed))


@dataclass
class NamedCallParser:
    """tool_choice names a function: the whole output is its arguments."""

    name: str
    _started: bool = False
    unclosed: int | None = None  # the one call is kept, cut off or not, as OpenAI does

    def feed(self, text: str) -> ParseStep:
        if not text and self._started:
            return ParseStep("", [])
        delta = ToolCallDelta(0, None if self._started else self.name, text)
        self._started = True
        return ParseStep("", [delta])

    def finish(self) -> ParseStep:
        return self.feed("")


_REQUIRED_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')


@dataclass
class RequiredCallsParser:
    """tool_choice required: the output is a JSON array of {name, parameters}, the
    shape the grammar forces (name first). Streamed: a call's name as soon as its
    header is complete, then its arguments as they come. Text that is not that shape
    (only possible without the grammar) is parsed whole at the end."""

    _buf: str = ""
    _all: str = ""
    _phase: str = "open"  # open, head, args, close, sep, done, failed
    _n: int = 0
    _depth: int = 0
    _in_str: bool = False
    _esc: bool = False
    _started: bool = False  # the current arguments value has begun

    @property
    def unclosed(self) -> int | None:
        return self._n - 1 if self._phase == "args" else None

    def feed(self, text: str) -> ParseStep:
        self._buf += text
        self._all += text
        calls: list[ToolCallDelta] = []
        while self._step(calls):
            pass
        return ParseStep("", calls)

    def finish(self) -> ParseStep:
        if self._n:  # calls were streamed; a cut-off one stays as far as it came
            return ParseStep("", [])
        try:
            items = json.loads(self._all)
        except ValueError:
            return ParseStep(self._all, [])
        calls = [_call(o, "parameters") for o in items] if isinstance(items, list) else [None]
        if not calls or any(c is None for c in calls):
            return ParseStep(self._all, [])
        return ParseStep("", [ToolCallDelta(i, *c) for i, c in enumerate(calls) if c is not None])

    def _step(self, calls: list[ToolCallDelta]) -> bool:
        """Consume what the current phase can; False when it needs more text."""
        buf = self._buf.lstrip() if self._phase in ("open", "close", "sep") else self._buf
        if self._phase in ("done", "failed") or not buf:
            return False
        if self._phase in ("open", "close", "sep"):
            want = {"open": "[", "close": "}", "sep": ",]"}[self._phase]
            if buf[0] not in want:
                self._phase = "failed"
                return False
            self._buf = buf[1:]
            self._phase = {"[": "head", "}": "sep", ",": "head", "]": "done"}[buf[0]]
            return True
        if self._phase == "head":
            m = _REQUIRED_HEAD.match(buf)
            if m is None:
                if not buf.lstrip().startswith("{") and buf.strip():
                    self._phase = "failed"
                return False
            calls.append(ToolCallDelta(self._n, json.loads(f'"{m.group(1)}"'), ""))
            self._n += 1
            self._buf, self._phase = buf[m.end():], "args"
            self._depth, self._in_str, self._esc, self._started = 0, False, False, False
            return True
        return self._args(calls)

    def _args(self, calls: list[ToolCallDelta]) -> bool:
        """Stream the arguments value up to its end: a bracket or a string closing at
        depth 0, or the `,`/`}` after a bare scalar (not part of the value)."""
        if not self._started:
            self._buf = self._buf.lstrip()
        i, done = 0, False
        while i < len(self._buf) and not done:
            c = self._buf[i]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == '"':
                    self._in_str = False
            elif self._started and self._depth == 0 and c in ",}":
                done = True
                break
            elif c == '"':
                self._in_str = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
            self._started = self._started or not c.isspace()
            i += 1
            done = self._started and self._depth == 0 and not self._in_str and c in '}]"'
        piece, self._buf = self._buf[:i], self._buf[i:]
        if piece:
            calls.append(ToolCallDelta(self._n - 1, None, piece))
        if done:
            self._phase = "close"
        return done


@dataclass
class FirstCallOnly:
    """parallel_tool_calls false: only a choice's first call is a call."""

    inner: ToolCallParser

    @property
    def unclosed(self) -> int | None:
        return 0 if self.inner.unclosed == 0 else None

    def feed(self, text: str) -> ParseStep:
        return self._first(self.inner.feed(text))

    def finish(self) -> ParseStep:
        return self._first(self.inner.finish())

    @staticmethod
    def _first(step: ParseStep) -> ParseStep:
        return ParseStep(step.content, [c for c in step.calls if c.index == 0])


def parser_factory(tool_mode: str, tool_name: str | None, parser: str | None,
                   parallel: bool = True) -> Callable[[], ToolCallParser] | None:
    """A new parser per choice, or None when the output is plain content. `parallel`
    false (parallel_tool_calls): a choice makes at most one call."""
    make = _parser_class(tool_mode, tool_name, parser)
    if make is None or parallel:
        return make
    return lambda: FirstCallOnly(make())


def _parser_class(tool_mode: str, tool_name: str | None, parser: str | None) -> Callable[[], ToolCallParser] | None:
    if tool_mode == "named" and tool_name is not None:
        return lambda: NamedCallParser(tool_name)
    if tool_mode == "required":
        return RequiredCallsParser
    if tool_mode == "auto" and parser == "hermes":
        return HermesParser
    if tool_mode == "auto" and parser == "llama3_json":
        return Llama3JsonParser
    return None


@dataclass
class ToolCallAssembler:
    """One choice's tool calls: OpenAI delta dicts while streaming, whole calls at the end."""

    ids: dict[int, str] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    args: dict[int, list[str]] = field(default_factory=dict)

    def deltas(self, calls: list[ToolCallDelta]) -> list[dict[str, Any]]:
        out = []
        for c in calls:
            d: dict[str, Any] = {"index": c.index}
            if c.name is not None:
                self.ids[c.index] = "call_" + uuid.uuid4().hex[:24]
                self.names[c.index] = c.name
                d.update(id=self.ids[c.index], type="function", function={"name": c.name, "arguments": c.arguments})
            else:
                d["function"] = {"arguments": c.arguments}
            self.args.setdefault(c.index, []).append(c.arguments)
            out.append(d)
        return out

    @property
    def any(self) -> bool:
        return bool(self.names)

    def calls(self) -> list[dict[str, Any]]:
        return [{"id": self.ids[i], "type": "function",
                 "function": {"name": self.names[i], "arguments": "".join(self.args[i])}}
                for i in sorted(self.names)]
