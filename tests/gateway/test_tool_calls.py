"""Tool calls and structured-output requests in the gateway: the Hermes and Llama 3 JSON
parsers (streamed in any split, and at once), OpenAI's response and delta shapes through
the official client, what the backend is asked for (the constraint, the tools in the
chat template), and bad input as a 400 naming the parameter.

The backend here replays a scripted output (`LocalBackend` with its token pool set to
the script), so the gateway's parsing is tested apart from any model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.config import GatewayConfig
from gateway.tokenizer import Tokenizer
from gateway.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    RequiredCallsParser,
    ToolCallAssembler,
)
from pdserve.builtin.default_model import write_default_model
from tests.gateway.local_backend import GatewayThread, LocalBackend, raw

MODEL = "served"
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
          '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> done')
MSG: Any = [{"role": "user", "content": "weather?"}]


def _run(parser: Any, text: str, cuts: list[int]) -> tuple[str, list[dict[str, Any]]]:
    asm, content, pos = ToolCallAssembler(), [], 0
    for cut in [*cuts, len(text)]:
        step = parser.feed(text[pos:cut])
        content.append(step.content)
        asm.deltas(step.calls)
        pos = cut
    tail = parser.finish()
    asm.deltas(tail.calls)
    return "".join(content) + tail.content, [{k: c["function"][k] for k in ("name", "arguments")} for c in asm.calls()]


def test_hermes_parser_is_split_invariant() -> None:
    want = ("Let me check.  done", [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                    {"name": "get_time", "arguments": "{}"}])
    assert _run(HermesParser(), HERMES, []) == want
    for cut in range(1, len(HERMES)):  # every two-way split, tags cut anywhere
        assert _run(HermesParser(), HERMES, [cut]) == want, cut
    assert _run(HermesParser(), HERMES, list(range(1, len(HERMES)))) == want  # one character at a time


def test_hermes_malformed_or_unclosed_calls() -> None:
    assert _run(HermesParser(), "a <tool_call>not json</tool_call> b", []) == ("a <tool_call>not json</tool_call> b", [])
    assert _run(HermesParser(), 'x<tool_call>{"name": "f", "arguments": {"a": 1}}', [3]) == (
        "x", [{"name": "f", "arguments": '{"a": 1}'}])  # EOS before the closing tag
    assert _run(HermesParser(), "a < b <tool", [2]) == ("a < b <tool", [])


def test_llama3_json_and_required_parsers() -> None:
    text = '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "f", "parameters": {"x": [1]}}'
    calls = [{"name": "get_time", "arguments": "{}"}, {"name": "f", "arguments": '{"x": [1]}'}]
    assert _run(Llama3JsonParser(), text, [5, 20]) == ("", calls)
    assert _run(Llama3JsonParser(), "  plain answer {not a call}", [1, 4]) == ("  plain answer {not a call}", [])
    assert _run(Llama3JsonParser(), '{"broken": ', []) == ('{"broken": ', [])
    arr = '[{"name": "get_time", "parameters": {}}, {"name": "f", "parameters": {"x": [1]}}]'
    assert _run(RequiredCallsParser(), arr, [7]) == ("", calls)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("tools-model"))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


@pytest.fixture()
def gw(tok: Tokenizer) -> Iterator[tuple[GatewayThread, LocalBackend]]:
    backend = LocalBackend(tok)
    with GatewayThread(GatewayConfig(model_name=MODEL, max_model_len=2048, tool_call_parser="hermes"), backend, tok) as g:
        yield g, backend


def test_builtin_template_renders_tools_and_tool_turns_like_transformers(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    d = model_dir
    msgs: Any = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    ours = Tokenizer.from_model_dir(d).apply_chat_template(msgs, tools=TOOLS)
    assert ours == AutoTokenizer.from_pretrained(d).apply_chat_template(msgs, tools=TOOLS, tokenize=False,
                                                                          add_generation_prompt=True)
    assert ours.count("<|start_header_id|>system") == 1 and "Be brief.\n\n# Tools" in ours
    assert '\n{"type": "function", "function": {"name": "get_weather"' in ours
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in ours
    assert "<tool_response>\nsunny\n</tool_response>" in ours
    # Without tools the template renders exactly as before: no tool section at all.
    plain = Tokenizer.from_model_dir(d).apply_chat_template(msgs[:2])
    assert "# Tools" not in plain and plain.count("<|start_header_id|>system") == 1


def _script(backend: LocalBackend, tok: Tokenizer, text: str) -> int:
    """The backend's next output is `text`, then EOS; returns max_tokens to ask for."""
    backend.pool = tok.encode(text, add_special_tokens=False)
    backend.eos_at = len(backend.pool)
    return len(backend.pool) + 1


def _client(g: GatewayThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)


def test_auto_tool_calls_non_streaming_and_streamed(gw: tuple[GatewayThread, LocalBackend], tok: Tokenizer) -> None:
    g, backend = gw
    n = _script(backend, tok, HERMES)
    r = _client(g).chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=n)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me check.  done"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in msg.tool_calls or []}) == 2
    # The chat template received the tools; no constraint was asked for (auto).
    prompt = tok.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert "<tools>" in prompt and '"get_weather"' in prompt and "Weather in a city" in prompt
    assert backend.requests[-1].params.structured is None

    chunks = list(_client(g).chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=n, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls: dict[int, dict[str, str]] = {}
    for ch in chunks:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += (d.function.name or "") if d.function else ""
            call["arguments"] += (d.function.arguments or "") if d.function else ""
    assert content == "Let me check.  done"
    assert calls == {0: {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                     1: {"name": "get_time", "arguments": "{}"}}
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_plain_answer_with_tools_and_tool_choice_none(gw: tuple[GatewayThread, LocalBackend], tok: Tokenizer) -> None:
    g, backend = gw
    n = _script(backend, tok, "No tools needed <here>.")
    r = _client(g).chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, max_tokens=n)
    assert r.choices[0].message.content == "No tools needed <here>." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    n = _script(backend, tok, HERMES)
    r = _client(g).chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="none", max_tokens=n)
    assert r.choices[0].message.content == HERMES  # not parsed, and the template got no tools
    assert "<tools>" not in tok.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)


def test_named_and_required_choices_ask_the_backend_for_a_constraint(
    gw: tuple[GatewayThread, LocalBackend], tok: Tokenizer,
) -> None:
    g, backend = gw
    n = _script(backend, tok, '{"city": "Oslo"}')
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    r = _client(g).chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice=named, max_tokens=n)
    [call] = r.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Oslo"}')
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None
    c = backend.requests[-1].params.structured
    # The arguments follow the parameters strictly: no key the schema does not name.
    assert c is not None and c.kind == "json_schema"
    assert json.loads(c.spec) == {**TOOLS[0]["function"]["parameters"], "additionalProperties": False}
    n = _script(backend, tok, '[{"name": "get_time", "parameters": {}}]')
    r = _client(g).chat.completions.create(model=MODEL, messages=MSG, tools=TOOLS, tool_choice="required", max_tokens=n)
    assert [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []] == [("get_time", "{}")]
    c = backend.requests[-1].params.structured
    assert c is not None and json.loads(c.spec)["minItems"] == 1


def test_response_format_and_structured_outputs_reach_the_backend(gw: tuple[GatewayThread, LocalBackend]) -> None:
    g, backend = gw
    schema = {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}
    body = {"model": MODEL, "messages": MSG, "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    assert raw(g.url, "POST", "/v1/chat/completions", json_body=body).status == 200
    c = backend.requests[-1].params.structured
    assert c is not None and (c.kind, json.loads(c.spec), c.param) == ("json_schema", schema, "response_format.json_schema.schema")
    for so, kind in (({"regex": "[a-z]+"}, "regex"), ({"choice": ["x", "y"]}, "choice"),
                     ({"grammar": 'start: "a"+'}, "grammar"), ({"json_object": True}, "json_object")):
        r = raw(g.url, "POST", "/v1/completions", json_body={"model": MODEL, "prompt": "p", "max_tokens": 2,
                                                              "structured_outputs": so})
        assert r.status == 200, r.body[:300]
        assert backend.requests[-1].params.structured.kind == kind  # type: ignore[union-attr]


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("regex", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ("lark", {"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ("empty choice", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("two kinds", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("json text", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ("unknown type", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("bad schema", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ("both", {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ("huge schema", {"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {f"p{i}" * 8: {"type": "string"} for i in range(2000)}}}}},
     "response_format.json_schema.schema"),
    ("tool params", {"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
     "tools[1].function.parameters"),
    ("tool name", {"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ("duplicate tool", {"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ("not a tool", {"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ("unknown named", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("forced plus format", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ("history arguments", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ("tool message id", {"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
]


@pytest.mark.parametrize("name,extra,param", BAD, ids=[b[0] for b in BAD])
def test_bad_constraints_and_tools_are_400_naming_the_parameter(
    gw: tuple[GatewayThread, LocalBackend], name: str, extra: dict[str, Any], param: str,
) -> None:
    g, backend = gw
    before = len(backend.requests)
    body = {"model": MODEL, "messages": MSG, "max_tokens": 2, **extra}
    r = raw(g.url, "POST", "/v1/chat/completions", json_body=body)
    assert r.status == 400, r.body[:300]
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert len(backend.requests) == before
