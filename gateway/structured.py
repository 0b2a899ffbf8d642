"""Request fields that shape the output: `response_format`, vLLM's `structured_outputs`,
`tools` and `tool_choice` -> one `OutputShape`, or a 400 naming the parameter.

A constraint is checked here with the grammar engine the workers compile with
(`pdserve.common.structured.check`), so an invalid schema, regex or grammar never reaches a
worker. Tools: `tool_choice` `required` or a named function is enforced with a JSON
schema built from the tools' parameters (vLLM's shapes): a named call generates the
function's arguments object; `required` generates `[{"name": ..., "parameters": ...}]`.
Either follows the parameters strictly (gateway/tool_schema.py: no property the schema
does not name), and `parallel_tool_calls: false` allows one call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.errors import invalid
from gateway.fields import bool_field
from gateway.tool_schema import strict
from pdserve.common.structured import StructuredOutput, StructuredOutputError, check, json_schema

MAX_SPEC_BYTES = 32 << 10  # a constraint travels in one control message (strings <= 64 KiB)
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
NONE, AUTO, REQUIRED, NAMED = "none", "auto", "required", "named"


@dataclass(frozen=True)
class Tool:
    """One function tool: its name, description and parameters schema (as JSON text)."""

    name: str
    description: str
    parameters: str

    def as_template_arg(self) -> dict[str, Any]:
        """The OpenAI shape chat templates receive in `tools`."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description, "parameters": json.loads(self.parameters)}}


@dataclass(frozen=True)
class OutputShape:
    """What a request asks of its output's shape.

    `tool_mode`: none | auto (the parser finds calls in free text) | required | named
    (the grammar forces calls; `tool_name` is the named one). `parallel`: more than
    one call per choice is allowed (parallel_tool_calls)."""

    constraint: StructuredOutput | None = None
    tools: tuple[Tool, ...] = ()
    tool_mode: str = NONE
    tool_name: str | None = None
    parallel: bool = True

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """`tools` for the chat template (none when tool_choice is none)."""
        return [t.as_template_arg() for t in self.tools] if self.tools and self.tool_mode != NONE else None


def parse_output_shape(body: Mapping[str, Any], chat: bool, auto_tools: bool) -> OutputShape:
    """The request's output shape; `auto_tools`: the server parses tool calls
    (--enable-auto-tool-choice with a --tool-call-parser)."""
    constraint = _response_format(body.get("response_format"))
    so = _structured_outputs(body.get("structured_outputs"))
    if constraint is not None and so is not None:
        raise invalid("structured_outputs", "give response_format or structured_outputs, not both", "conflicting_parameters")
    constraint = constraint or so
    if not chat:
        for key in ("tools", "tool_choice"):
            if body.get(key) is not None:
                raise invalid(key, f"{key} is only supported on /v1/chat/completions", "unsupported_parameter")
        return _checked(OutputShape(constraint))
    tools = _tools(body.get("tools"))
    mode, name = _tool_choice(body.get("tool_choice"), tools, auto_tools)
    parallel = bool(bool_field(body, "parallel_tool_calls", True))
    if mode in (REQUIRED, NAMED):
        if constraint is not None:
            raise invalid("tool_choice", f"tool_choice {mode!r} cannot be combined with a structured output",
                          "conflicting_parameters")
        constraint = _tool_constraint(tools, mode, name, parallel)
    return _checked(OutputShape(constraint, tools, mode, name, parallel))


def _checked(shape: OutputShape) -> OutputShape:
    c = shape.constraint
    if c is not None:
        if len(c.spec.encode()) > MAX_SPEC_BYTES:
            raise invalid(c.param, f"{c.param} is too large (at most {MAX_SPEC_BYTES} bytes)", "too_large")
        try:
            check(c)
        except StructuredOutputError as e:
            raise invalid(e.param, str(e), "invalid_structured_output") from None
    return shape


def _response_format(value: Any) -> StructuredOutput | None:
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid(param, "response_format must be an object with a type", "invalid_type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", "", param)
    if kind != "json_schema":
        raise invalid(f"{param}.type", "response_format.type must be text, json_object or json_schema")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid(f"{param}.json_schema", "json_schema must be an object", "invalid_type")
    if not isinstance(spec.get("name", ""), str):
        raise invalid(f"{param}.json_schema.name", "name must be a string", "invalid_type")
    schema = spec.get("schema", {"type": "object"})
    return _json_schema(schema, f"{param}.json_schema.schema")


def _structured_outputs(value: Any) -> StructuredOutput | None:
    param = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid(param, "structured_outputs must be an object", "invalid_type")
    unknown = [k for k in value if k not in _STRUCTURED_KEYS and k not in ("disable_any_whitespace", "whitespace_pattern")]
    if unknown:
        raise invalid(f"{param}.{str(unknown[0])[:40]}", "unknown structured_outputs field", "unknown_parameter")
    given = [k for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise invalid(param, f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_KEYS)}")
    key = given[0]
    spec, where = value[key], f"{param}.{key}"
    if key == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError:
                raise invalid(where, "json must be a JSON schema (an object or its JSON text)") from None
        return _json_schema(spec, where)
    if key == "json_object":
        return StructuredOutput("json_object", "", where)
    if key == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(s, str) and s for s in spec):
            raise invalid(where, "choice must be a non-empty array of non-empty strings", "invalid_type")
        return StructuredOutput("choice", json.dumps(spec), where)
    if not isinstance(spec, str) or not spec:
        raise invalid(where, f"{key} must be a non-empty string", "invalid_type")
    return StructuredOutput("regex" if key == "regex" else "grammar", spec, where)


def _json_schema(schema: Any, param: str) -> StructuredOutput:
    try:
        return json_schema(schema, param)
    except StructuredOutputError as e:
        raise invalid(e.param, str(e), "invalid_type") from None


def _tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid("tools", "tools must be an array", "invalid_type")
    tools, names = [], set()
    for i, t in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise invalid(where, "a tool must be {\"type\": \"function\", \"function\": {...}}", "invalid_type")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.match(name):
            raise invalid(f"{where}.function.name", "function names are 1-64 characters of a-z, A-Z, 0-9, _ . -")
        if name in names:
            raise invalid(f"{where}.function.name", f"duplicate function name {name!r}")
        names.add(name)
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise invalid(f"{where}.function.description", "description must be a string", "invalid_type")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise invalid(f"{where}.function.parameters", "parameters must be a JSON schema object", "invalid_type")
        c = _json_schema(params, f"{where}.function.parameters")
        try:
            check(c)
        except StructuredOutputError as e:
            raise invalid(e.param, str(e), "invalid_structured_output") from None
        tools.append(Tool(name, desc, c.spec))
    return tuple(tools)


def _tool_choice(value: Any, tools: tuple[Tool, ...], auto_tools: bool) -> tuple[str, str | None]:
    param = "tool_choice"
    if value is None:
        return (AUTO if tools and auto_tools else NONE), None
    if value in (NONE, AUTO, REQUIRED):
        if value != NONE and not tools:
            raise invalid(param, f"tool_choice {value!r} needs tools")
        if value == AUTO and not auto_tools:
            raise invalid(param, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                          "on the server")
        return str(value), None
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise invalid(param, 'tool_choice must be none, auto, required or {"type": "function", '
                      '"function": {"name": ...}}', "invalid_type")
    if name not in {t.name for t in tools}:
        raise invalid(f"{param}.function.name", f"tool_choice names {name[:64]!r}, which is not in tools")
    return NAMED, name


def _tool_constraint(tools: tuple[Tool, ...], mode: str, name: str | None, parallel: bool) -> StructuredOutput:
    if mode == NAMED:
        tool = next(t for t in tools if t.name == name)
        params = strict(json.loads(tool.parameters))
        return StructuredOutput("json_schema", json.dumps(params, separators=(",", ":")), "tool_choice")
    item = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]},
                                                          "parameters": strict(json.loads(t.parameters))},
                       "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
    if not parallel:
        array["maxItems"] = 1
    return StructuredOutput("json_schema", json.dumps(array, separators=(",", ":")), "tool_choice")


def tool_message_fields(m: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`tool_calls` of an assistant message (arguments decoded, as chat templates expect
    them) and `tool_call_id` of a tool message; 400 naming the field when malformed."""
    out: dict[str, Any] = {}
    role, calls, call_id = m.get("role"), m.get("tool_calls"), m.get("tool_call_id")
    if calls not in (None, []):
        if role != "assistant" or not isinstance(calls, list):
            raise invalid(f"{where}.tool_calls", "tool_calls must be an array on an assistant message", "invalid_type")
        out["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if role == "tool":
        if not isinstance(call_id, str):
            raise invalid(f"{where}.tool_call_id", "a tool message needs a tool_call_id string", "invalid_type")
        out["tool_call_id"] = call_id
    elif call_id is not None:
        raise invalid(f"{where}.tool_call_id", "only tool messages carry tool_call_id")
    return out


def _history_call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise invalid(where, 'a tool call is {"id", "type": "function", "function": {"name", "arguments"}}',
                      "invalid_type")
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        raise invalid(f"{where}.function.arguments", "arguments must be JSON text") from None
    return {"id": str(c.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}}
