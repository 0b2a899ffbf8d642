"""Forced tool calls follow the tool's schema strictly and stream as they come:
`strict` closes every object schema that does not say otherwise (checked with
`jsonschema` on what it accepts and rejects); the `required` parser streams each call's
name and then its arguments in any split of the text; `parallel_tool_calls: false`
keeps one call (auto) or bounds the array (required); a call cut off by max_tokens is
left out of the final message."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.tool_calls import (
    FirstCallOnly,
    HermesParser,
    RequiredCallsParser,
    ToolCallAssembler,
    parser_factory,
)
from gateway.tool_schema import strict
from gateway.validation import CHAT, parse_request

NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "stops": {"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer"}}}},
        "either": {"anyOf": [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "string"}]},
        "free": {"type": "object", "additionalProperties": {"type": "string"}},
        "both": {"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}}},
                           {"type": "object", "properties": {"y": {"type": "integer"}}}]},
    },
    "$defs": {"p": {"type": "object", "properties": {"q": {"type": "string"}}}},
}


def test_strict_closes_every_object_schema_that_does_not_say_otherwise() -> None:
    s = strict(NESTED)
    assert NESTED.get("additionalProperties") is None  # the input is not changed
    ok = {"city": "Oslo", "where": {"lat": 1.5}, "stops": [{"n": 1}], "either": {"a": "x"},
          "free": {"anything": "goes"}, "both": {"x": 1, "y": 2}}
    jsonschema.validate(ok, s)
    for bad in ({"city": "Oslo", "extra": 1}, {"where": {"lat": 1, "lon": 2}}, {"stops": [{"n": 1, "m": 2}]},
                {"either": {"a": "x", "b": "y"}}):
        jsonschema.validate(bad, NESTED)  # the literal reading lets unnamed keys through
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, s)
    assert s["$defs"]["p"]["additionalProperties"] is False
    assert s["properties"]["free"]["additionalProperties"] == {"type": "string"}  # said otherwise: kept
    assert "additionalProperties" not in s["properties"]["both"]["allOf"][0]  # allOf members stay open
    assert strict(True) is True and strict({"type": "string"}) == {"type": "string"}


REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Pa}\\"ris", "d": [1, {"x": 2}]}}, '
            '{"name": "get_time", "parameters": 3}, {"name": "s", "parameters": "a,}"}]')
WANT = [{"name": "get_weather", "arguments": '{"city": "Pa}\\"ris", "d": [1, {"x": 2}]}'},
        {"name": "get_time", "arguments": "3"}, {"name": "s", "arguments": '"a,}"'}]


def _run(parser: Any, text: str, cuts: list[int]) -> tuple[list[dict[str, str]], int]:
    """(assembled calls, how many feeds produced a delta)."""
    asm, pos, live = ToolCallAssembler(), 0, 0
    for cut in [*cuts, len(text)]:
        step = parser.feed(text[pos:cut])
        live += bool(step.calls)
        asm.deltas(step.calls)
        pos = cut
    asm.deltas(parser.finish().calls)
    return [{k: c["function"][k] for k in ("name", "arguments")} for c in asm.calls()], live


def test_required_parser_streams_in_any_split() -> None:
    assert _run(RequiredCallsParser(), REQUIRED, [])[0] == WANT
    for cut in range(1, len(REQUIRED)):
        assert _run(RequiredCallsParser(), REQUIRED, [cut])[0] == WANT, cut
    calls, live = _run(RequiredCallsParser(), REQUIRED, list(range(1, len(REQUIRED))))
    assert calls == WANT and live > 30  # one character at a time: deltas all along, not at the end
    # Not the forced shape (a server without the grammar): parsed whole, or content.
    assert _run(RequiredCallsParser(), '[{"parameters": {}, "name": "f"}]', [4])[0] == [{"name": "f", "arguments": "{}"}]
    p = RequiredCallsParser()
    assert p.feed("no calls").content == "" and p.finish().content == "no calls"


def test_cut_off_call_is_flagged_and_parallel_false_keeps_one() -> None:
    p = RequiredCallsParser()
    p.feed(REQUIRED[:REQUIRED.index('"d"')])
    p.finish()
    assert p.unclosed == 0
    p = RequiredCallsParser()
    p.feed(REQUIRED[:REQUIRED.index('"parameters": 3') + len('"parameters": 3')])  # 3 or 34...?
    assert p.unclosed == 1
    p = RequiredCallsParser()
    p.feed(REQUIRED)
    assert p.unclosed is None
    hermes = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    assert [c["name"] for c in _run(HermesParser(), hermes, [20])[0]] == ["a", "b"]
    make = parser_factory("auto", None, "hermes", parallel=False)
    assert make is not None and isinstance(make(), FirstCallOnly)
    assert [c["name"] for c in _run(make(), hermes, [20])[0]] == ["a"]


def _chat(**extra: Any) -> Any:
    tools = [{"type": "function", "function": {"name": "f", "parameters": NESTED}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, **extra}
    return parse_request(CHAT, body, GatewayConfig(model_name="m", tool_call_parser="hermes"))


def test_parallel_tool_calls_shapes_the_constraint_and_is_validated() -> None:
    one = json.loads(_chat(tool_choice="required", parallel_tool_calls=False).params.structured.spec)
    many = json.loads(_chat(tool_choice="required").params.structured.spec)
    assert one["maxItems"] == 1 and "maxItems" not in many and many["minItems"] == 1
    assert many["items"]["anyOf"][0]["properties"]["parameters"] == strict(NESTED)
    assert not _chat(parallel_tool_calls=False).shape.parallel and _chat().shape.parallel
    with pytest.raises(APIError) as e:
        _chat(parallel_tool_calls="no")
    assert e.value.status == 400 and e.value.param == "parallel_tool_calls"
