"""Structured-output constraints: what a request asks its output to match, and the one
place such a constraint becomes a grammar of the grammar engine (llguidance).

A `StructuredOutput` travels inside `SamplingParams` (typed, msgpack, never pickled).
The gateway turns `response_format`, `structured_outputs` and forced tool calls into
one and checks it with `check` (a 400 naming `param` when it is bad); each worker
compiles it against its tokenizer (pdserve/engine/grammar) into the token mask it samples
under. Both call `grammar_text`, so the gateway accepts exactly what workers compile.

llguidance is imported lazily: it is torch-free, but processes that never meet a
constraint do not need it loaded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# Compact JSON (json.dumps' separators, no free whitespace): a model cannot wander off
# into unbounded whitespace, and the output is what clients expect to parse.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# `{"type": "json_object"}`: any JSON object.
ANY_OBJECT_SCHEMA = '{"type": "object"}'
_REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~")


class StructuredOutputError(ValueError):
    """A constraint that does not compile; `param` names the request field that set it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutput:
    """One output constraint.

    kind: json_schema (spec: the schema as JSON text), json_object (spec unused),
    regex (spec: the pattern), choice (spec: a JSON array of strings), grammar (spec: a
    Lark grammar, llguidance's dialect). `param` is the request field it came from
    (`response_format`, `structured_outputs.regex`, `tool_choice` ...), for errors."""

    kind: str
    spec: str = ""
    param: str = "structured_outputs"

    def validate(self) -> StructuredOutput:
        if self.kind not in KINDS:
            raise StructuredOutputError(self.param, f"unknown constraint kind {self.kind!r}")
        return self

    @property
    def key(self) -> str:
        """Cache key of the compiled grammar: a hash of what it compiles from."""
        return hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (Rust regex syntax: punctuation escaped)."""
    return "(" + "|".join("".join("\\" + c if c in _REGEX_SPECIAL else c for c in s) for s in choices) + ")"


def grammar_text(c: StructuredOutput) -> str:
    """The llguidance grammar for `c` (not yet checked: see `check`)."""
    from llguidance import LLMatcher

    if c.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(c.spec, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if c.kind == "json_object":
        return LLMatcher.grammar_from_json_schema(ANY_OBJECT_SCHEMA, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if c.kind == "regex":
        return LLMatcher.grammar_from_regex(c.spec)
    if c.kind == "choice":
        return LLMatcher.grammar_from_regex(choice_regex(json.loads(c.spec)))
    return LLMatcher.grammar_from_lark(c.spec)


def check(c: StructuredOutput) -> str:
    """The grammar for `c`, or StructuredOutputError with the grammar engine's reason."""
    from llguidance import LLMatcher

    c.validate()
    try:
        grammar = grammar_text(c)
    except (ValueError, TypeError) as e:
        raise StructuredOutputError(c.param, f"invalid {c.param}: {_first_line(str(e))}") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputError(c.param, f"invalid {c.param}: {_first_line(error)}")
    return grammar


def json_schema(schema: Any, param: str) -> StructuredOutput:
    """A json_schema constraint from a decoded schema (an object, or a boolean schema)."""
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError(param, f"{param} must be a JSON schema object")
    return StructuredOutput("json_schema", json.dumps(schema, separators=(",", ":")), param)


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "rejected by the grammar engine"
    return line[:300]
