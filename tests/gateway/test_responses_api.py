"""`POST /v1/responses` through the official `openai` client (`client.responses.create`
and `client.responses.stream`): text and item input, instructions, streaming with
OpenAI's event sequence, `text.format` json_schema, function calls, `store` +
`previous_response_id`, an unknown id, the bounded store's evictions, and bad input as
a 4xx in OpenAI's error shape naming the Responses parameter. Every streamed event and
every Response is validated against the openai package's own models.

The backend replays a scripted output (`LocalBackend`), so what the gateway sends it
(the prompt, the constraint) and what it answers are both exact."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.config import GatewayConfig
from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model
from tests.gateway.local_backend import GatewayThread, LocalBackend, raw

MODEL = "served"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS: Any = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
               "parameters": WEATHER, "strict": True}]
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_model_dir(write_default_model(tmp_path_factory.mktemp("responses-model")))


@pytest.fixture()
def gw(tok: Tokenizer) -> Iterator[tuple[GatewayThread, LocalBackend]]:
    backend = LocalBackend(tok)
    config = GatewayConfig(model_name=MODEL, max_model_len=2048, responses_store_size=3)
    with GatewayThread(config, backend, tok) as g:
        yield g, backend


def _client(g: GatewayThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)


def _script(backend: LocalBackend, tok: Tokenizer, text: str) -> int:
    """The backend's next output is `text`, then EOS; returns a max_output_tokens that fits."""
    backend.pool = tok.encode(text, add_special_tokens=False)
    backend.eos_at = len(backend.pool)
    return len(backend.pool) + 1


def _prompt(backend: LocalBackend, tok: Tokenizer) -> str:
    return tok.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)


def test_text_input_and_instructions(gw: tuple[GatewayThread, LocalBackend], tok: Tokenizer) -> None:
    g, backend = gw
    n = _script(backend, tok, "The sea is big.")
    r = _client(g).responses.create(model=MODEL, input="Tell me about the sea.", instructions="Be brief.",
                                    max_output_tokens=n, temperature=0.5, top_p=0.9)
    Response.model_validate(r.model_dump())
    assert (r.status, r.output_text, r.object, r.model) == ("completed", "The sea is big.", "response", MODEL)
    assert r.instructions == "Be brief." and r.max_output_tokens == n and r.temperature == 0.5
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    prompt = _prompt(backend, tok)
    assert "system<|end_header_id|>\n\nBe brief.<|eot_id|>" in prompt and "Tell me about the sea." in prompt
    params = backend.requests[-1].params
    assert (params.max_tokens, params.temperature, params.top_p) == (n, 0.5, 0.9)
    assert r.usage is not None and r.usage.input_tokens == len(backend.requests[-1].prompt_token_ids)
    assert r.usage.output_tokens == n and r.usage.total_tokens == r.usage.input_tokens + n
    # Cut off by max_output_tokens: incomplete, as OpenAI reports it.
    r = _client(g).responses.create(model=MODEL, input="Tell me about the sea.", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.model_dump()["output"][0]["status"] == "incomplete"


def test_item_input_with_a_function_call_round_trip(gw: tuple[GatewayThread, LocalBackend], tok: Tokenizer) -> None:
    g, backend = gw
    n = _script(backend, tok, "It is sunny in Paris.")
    items: Any = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = _client(g).responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=n)
    assert r.output_text == "It is sunny in Paris."
    prompt = _prompt(backend, tok)
    assert "Use tools." in prompt and "Weather in Paris?" in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_stream_event_sequence_matches_openai_types(gw: tuple[GatewayThread, LocalBackend], tok: Tokenizer) -> None:
    g, backend = gw
    n = _script(backend, tok, "Once upon a time.")
    body = {"model": MODEL, "input": "Story?", "max_output_tokens": n, "stream": True}
    res = raw(g.url, "POST", "/v1/responses", json_body=body)
    assert res.status == 200 and res.headers["Content-Type"].startswith("text/event-stream")
    events = [EVENTS.validate_python(json.loads(d)) for d in res.sse_data()]
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert deltas > 1 and [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Once upon a time." and events[-4].text == text
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text and final.usage.output_tokens == n
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {final.output[0].id}
    # The client's stream helper reads the same stream.
    with _client(g).responses.stream(model=MODEL, input="Story?", max_output_tokens=n) as stream:
        seen = [e.type for e in stream]
        assert stream.get_final_response().output_text == text
    assert seen == kinds


def test_json_schema_format_reaches_the_structured_engine(gw: tuple[GatewayThread, LocalBackend],
                                                          tok: Tokenizer) -> None:
    g, backend = gw
    n = _script(backend, tok, '{"city": "Oslo"}')
    fmt: Any = {"type": "json_schema", "name": "place", "schema": WEATHER, "strict": True}
    r = _client(g).responses.create(model=MODEL, input="Where?", text={"format": fmt}, max_output_tokens=n)
    assert json.loads(r.output_text) == {"city": "Oslo"}
    c = backend.requests[-1].params.structured
    assert c is not None and c.kind == "json_schema" and json.loads(c.spec) == WEATHER
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"


def test_function_call_output_items_streamed_and_not(gw: tuple[GatewayThread, LocalBackend], tok: Tokenizer) -> None:
    g, backend = gw
    n = _script(backend, tok, '[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    kw: Any = {"model": MODEL, "input": "Weather in Rome?", "tools": TOOLS, "tool_choice": "required",
               "max_output_tokens": n}
    r = _client(g).responses.create(**kw)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Rome"} and r.status == "completed"
    c = backend.requests[-1].params.structured
    assert c is not None and json.loads(c.spec)["items"]["anyOf"][0]["properties"]["parameters"] == {
        **WEATHER, "additionalProperties": False}
    with _client(g).responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.output_text.delta" not in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Rome"}
    [fc] = final.output
    assert fc.type == "function_call" and fc.name == "get_weather" and fc.arguments == done.arguments
    # The agent loop: the call's output continues the stored conversation.
    n = _script(backend, tok, "Sunny in Rome.")
    out: Any = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 25C"}]
    r = _client(g).responses.create(model=MODEL, input=out, previous_response_id=r.id, tools=TOOLS,
                                    tool_choice="none", max_output_tokens=n)
    assert r.output_text == "Sunny in Rome."
    prompt = _prompt(backend, tok)
    assert prompt.index("Weather in Rome?") < prompt.index('"name": "get_weather", "arguments": {"city": "Rome"}')
    assert prompt.index("get_weather") < prompt.index("<tool_response>\nsunny, 25C\n</tool_response>")


def test_previous_response_id_continues_the_conversation(gw: tuple[GatewayThread, LocalBackend],
                                                         tok: Tokenizer) -> None:
    g, backend = gw
    cl = _client(g)
    n = _script(backend, tok, "I am a boat.")
    first = cl.responses.create(model=MODEL, input="Who are you?", instructions="Speak as a boat.",
                                max_output_tokens=n)
    assert cl.responses.retrieve(first.id).output_text == "I am a boat."
    n = _script(backend, tok, "I float.")
    second = cl.responses.create(model=MODEL, input="What do you do?", previous_response_id=first.id,
                                 max_output_tokens=n)
    assert second.previous_response_id == first.id and second.output_text == "I float."
    prompt = _prompt(backend, tok)
    assert prompt.index("Who are you?") < prompt.index("I am a boat.") < prompt.index("What do you do?")
    assert "Speak as a boat." not in prompt  # instructions are not carried over (OpenAI)
    # A chain of three turns, then store: false is not kept.
    third = cl.responses.create(model=MODEL, input="And?", previous_response_id=second.id, max_output_tokens=n)
    assert "Who are you?" in _prompt(backend, tok) and third.status == "completed"
    unstored = cl.responses.create(model=MODEL, input="x", store=False, max_output_tokens=n)
    with pytest.raises(openai.NotFoundError):
        cl.responses.retrieve(unstored.id)
    cl.responses.delete(third.id)
    with pytest.raises(openai.NotFoundError):
        cl.responses.retrieve(third.id)


def test_unknown_id_is_404_and_the_store_is_bounded(gw: tuple[GatewayThread, LocalBackend], tok: Tokenizer) -> None:
    g, backend = gw
    cl = _client(g)
    before = len(backend.requests)
    with pytest.raises(openai.NotFoundError) as e:
        cl.responses.create(model=MODEL, input="hi", previous_response_id="resp_nope")
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "previous_response_id"
    assert err["type"] == "invalid_request_error" and err["code"] == "previous_response_not_found"
    assert len(backend.requests) == before  # refused before any generation
    n = _script(backend, tok, "ok")
    ids = [cl.responses.create(model=MODEL, input=f"q{i}", max_output_tokens=n).id for i in range(5)]
    metrics = raw(g.url, "GET", "/metrics").body.decode()
    assert "llm_responses_evicted_total 2.0" in metrics  # capacity 3, five stored
    for rid in ids[:2]:  # the oldest two are gone: an unknown id again
        with pytest.raises(openai.NotFoundError):
            cl.responses.create(model=MODEL, input="more", previous_response_id=rid, max_output_tokens=n)
    assert cl.responses.create(model=MODEL, input="more", previous_response_id=ids[4], max_output_tokens=n).id


BAD: list[tuple[str, dict[str, Any], int, str | None]] = [
    ("no input", {}, 400, "input"),
    ("empty input", {"input": ""}, 400, "input"),
    ("input type", {"input": 3}, 400, "input"),
    ("item type", {"input": [{"type": "image_generation_call"}]}, 400, "input[0].type"),
    ("image part", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     400, "input[0].content[0]"),
    ("bad role", {"input": [{"role": "robot", "content": "x"}]}, 400, "input[0].role"),
    ("call arguments", {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
     400, "input[0].arguments"),
    ("max_output_tokens", {"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ("temperature", {"input": "x", "temperature": 9}, 400, "temperature"),
    ("unknown field", {"input": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("format", {"input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text.format.type"),
    ("schema", {"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "nope"}}}},
     400, "text.format.schema"),
    ("tool kind", {"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ("tool name", {"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, 400, "tools[0].name"),
    ("choice name", {"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     400, "tool_choice.name"),
    ("store type", {"input": "x", "store": "yes"}, 400, "store"),
    ("model", {"input": "x", "model": "other"}, 404, "model"),
    ("background", {"input": "x", "background": True}, 400, "background"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_4xx(gw: tuple[GatewayThread, LocalBackend], name: str, body: dict[str, Any],
                                  status: int, param: str | None) -> None:
    g, backend = gw
    before = len(backend.requests)
    r = raw(g.url, "POST", "/v1/responses", json_body={"model": MODEL, **body})
    assert r.status == status, r.body[:300]
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], err
    assert len(backend.requests) == before
    assert raw(g.url, "POST", "/v1/responses", data=b"{not json",
               headers={"Content-Type": "application/json"}).status == 400
    assert raw(g.url, "GET", "/v1/responses/resp_missing").status == 404
