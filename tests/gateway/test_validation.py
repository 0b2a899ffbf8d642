"""Table-driven bad-input suite: each malformed request gets its documented 4xx status and
OpenAI envelope naming the parameter, never a traceback or an echo of huge input; after
all of them the gateway still serves a normal request correctly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.config import GatewayConfig, RequestLimits
from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model
from tests.gateway.local_backend import GatewayThread, LocalBackend, raw

MODEL = "served"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
LIMITS = RequestLimits(
    max_body_bytes=4096, max_header_bytes=1024, max_messages=8, max_prompt_tokens=100, max_n=4,
    max_tokens=100, max_stop=2, max_stop_len=16, max_logprobs=5,
)
HUGE = "A" * 3000


@dataclass(frozen=True)
class Case:
    name: str
    status: int
    param: str | None
    code: str | None = None
    body: Any = None  # JSON body (completions unless chat)
    chat: bool = False
    data: bytes | None = None  # raw body instead of JSON
    headers: tuple[tuple[str, str], ...] = ()
    method: str = "POST"


def c(name: str, status: int, param: str | None, code: str | None = None, **fields: Any) -> Case:
    return Case(name, status, param, code, **fields)


def comp(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MSG, "max_tokens": 2, **kw}


JSON_CT = (("Content-Type", "application/json"),)

CASES = [
    # Transport level: content type, size, encoding, JSON.
    c("invalid json", 400, None, "invalid_json", data=b'{"prompt": "x",', headers=JSON_CT),
    c("invalid utf-8", 400, None, "invalid_utf8", data=b'{"prompt": "\xff\xfe"}', headers=JSON_CT),
    c("lone surrogate escape", 400, None, "invalid_utf8", data=b'{"prompt": "a\\ud800b"}', headers=JSON_CT),
    c("deeply nested json", 400, None, "invalid_json", data=b'{"prompt":' + b"[" * 1500 + b"]" * 1500 + b"}",
      headers=JSON_CT),
    c("json array body", 400, None, "invalid_json", data=b'["prompt"]', headers=JSON_CT),
    c("NaN literal", 400, None, "invalid_json", data=b'{"prompt": "x", "temperature": NaN}', headers=JSON_CT),
    c("wrong content type", 415, None, "unsupported_media_type", data=b'{"prompt": "x"}',
      headers=(("Content-Type", "text/plain"),)),
    c("body too large", 413, None, "request_too_large", body=comp(prompt="x" * 5000)),
    c("header too large", 431, "x-big", "header_too_large", body=comp(), headers=(("x-big", "h" * 2000),)),
    c("wrong method", 405, None, "method_not_allowed", method="GET"),
    # Model.
    c("unknown model", 404, "model", "model_not_found", body=comp(model="gpt-4")),
    c("model not a string", 400, "model", "invalid_type", body=comp(model=3)),
    # Prompt.
    c("missing prompt", 400, "prompt", "missing_required_parameter", body={"model": MODEL}),
    c("empty prompt", 400, "prompt", "empty_prompt", body=comp(prompt="")),
    c("empty token list", 400, "prompt", "empty_prompt", body=comp(prompt=[])),
    c("prompt wrong type", 400, "prompt", "invalid_type", body=comp(prompt=123)),
    c("batched prompts", 400, "prompt", "unsupported_value", body=comp(prompt=["a", "b"])),
    c("token id past vocab", 400, "prompt", "invalid_token_id", body=comp(prompt=[5, 10**6])),
    c("negative token id", 400, "prompt", "invalid_token_id", body=comp(prompt=[5, -1])),
    c("prompt too many tokens", 400, "prompt", "prompt_too_long", body=comp(prompt=[10] * 101)),
    c("context length exceeded", 400, "prompt", "context_length_exceeded", body=comp(prompt=[10] * 60, max_tokens=90)),
    # Messages.
    c("empty messages", 400, "messages", "empty_array", body=chat(messages=[]), chat=True),
    c("messages not a list", 400, "messages", "invalid_type", body=chat(messages="hi"), chat=True),
    c("too many messages", 400, "messages", "too_many_messages", body=chat(messages=MSG * 9), chat=True),
    c("bad role", 400, "messages[0].role", "invalid_value", body=chat(messages=[{"role": "robot", "content": "x"}]), chat=True),
    c("content wrong type", 400, "messages[1].content", "invalid_type",
      body=chat(messages=[*MSG, {"role": "user", "content": 5}]), chat=True),
    c("image content part", 400, "messages[0].content[0]", "invalid_value",
      body=chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), chat=True),
    c("message not an object", 400, "messages[0]", "invalid_type", body=chat(messages=["hi"]), chat=True),
    # Sampling parameters: types and ranges.
    c("temperature negative", 400, "temperature", "invalid_value", body=comp(temperature=-0.1)),
    c("temperature above 2", 400, "temperature", "invalid_value", body=comp(temperature=2.5)),
    c("temperature string", 400, "temperature", "invalid_type", body=comp(temperature="hot")),
    c("top_p zero", 400, "top_p", "invalid_value", body=comp(top_p=0)),
    c("top_p above one", 400, "top_p", "invalid_value", body=comp(top_p=1.5)),
    c("top_k float", 400, "top_k", "invalid_type", body=comp(top_k=5.0)),
    c("min_p above one", 400, "min_p", "invalid_value", body=comp(min_p=1.5)),
    c("presence_penalty range", 400, "presence_penalty", "invalid_value", body=comp(presence_penalty=3)),
    c("repetition_penalty zero", 400, "repetition_penalty", "invalid_value", body=comp(repetition_penalty=0)),
    c("n zero", 400, "n", "invalid_value", body=comp(n=0)),
    c("n above limit", 400, "n", "invalid_value", body=comp(n=5)),
    c("n boolean", 400, "n", "invalid_type", body=comp(n=True)),
    c("max_tokens zero", 400, "max_tokens", "invalid_value", body=comp(max_tokens=0)),
    c("max_tokens string", 400, "max_tokens", "invalid_type", body=comp(max_tokens="10")),
    c("max_tokens above limit", 400, "max_tokens", "invalid_value", body=comp(max_tokens=101)),
    c("max_completion_tokens zero", 400, "max_completion_tokens", "invalid_value",
      body=chat(max_completion_tokens=0), chat=True),
    c("seed float", 400, "seed", "invalid_type", body=comp(seed=1.5)),
    c("stop too many", 400, "stop", "too_many_stop", body=comp(stop=["a", "b", "c"])),
    c("stop too long", 400, "stop", "invalid_value", body=comp(stop="s" * 17)),
    c("stop wrong type", 400, "stop", "invalid_type", body=comp(stop=[1])),
    c("stop empty string", 400, "stop", "invalid_value", body=comp(stop="")),
    c("logprobs above limit", 400, "logprobs", "invalid_value", body=comp(logprobs=6)),
    c("chat logprobs int", 400, "logprobs", "invalid_type", body=chat(logprobs=3), chat=True),
    c("top_logprobs without logprobs", 400, "top_logprobs", "invalid_value", body=chat(top_logprobs=2), chat=True),
    c("stream not a bool", 400, "stream", "invalid_type", body=comp(stream="yes")),
    c("stream_options without stream", 400, "stream_options", "invalid_value",
      body=comp(stream_options={"include_usage": True})),
    c("ignore_eos string", 400, "ignore_eos", "invalid_type", body=comp(ignore_eos="true")),
    c("speculative string", 400, "speculative", "invalid_type", body=comp(speculative="no")),
    c("priority unknown", 400, "priority", "invalid_value", body=comp(priority="urgent")),
    c("priority header unknown", 400, "x-pdserve-priority", "invalid_value", body=comp(),
      headers=(("x-pdserve-priority", "vip"),)),
    # Unknown and unsupported fields.
    c("unknown field", 400, "frobnicate", "unknown_parameter", body=comp(frobnicate=1)),
    c("huge unknown field name", 400, "A" * 64, "unknown_parameter", body=comp(**{HUGE[:1000]: 1})),
    c("tool_choice auto without a parser", 400, "tool_choice", "invalid_value",
      body=chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="auto"), chat=True),
    c("echo not a boolean", 400, "echo", "invalid_type", body=comp(echo="yes")),
    c("echo on chat", 400, "echo", "unsupported_parameter", body=chat(echo=True), chat=True),
    c("response_format bad schema", 400, "response_format.json_schema.schema", "invalid_structured_output",
      body=chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
      chat=True),
    c("logit_bias not supported", 400, "logit_bias", "unsupported_parameter", body=comp(logit_bias={"5": 10})),
]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayThread, LocalBackend, Tokenizer]]:
    d: Path = write_default_model(tmp_path_factory.mktemp("gw-model"))
    tok = Tokenizer.from_model_dir(d)
    backend = LocalBackend(tok)
    config = GatewayConfig(model_name=MODEL, max_model_len=128, limits=LIMITS)
    with GatewayThread(config, backend, tok) as g:
        yield g, backend, tok


@pytest.mark.parametrize("case", CASES, ids=[x.name for x in CASES])
def test_bad_input(gw: tuple[GatewayThread, LocalBackend, Tokenizer], case: Case) -> None:
    g, backend, _ = gw
    before = len(backend.requests)
    path = "/v1/chat/completions" if case.chat else "/v1/completions"
    r = raw(g.url, case.method, path, json_body=case.body if case.data is None else None, data=case.data,
            headers=dict(case.headers))
    assert r.status == case.status, r.body[:300]
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("invalid_request_error" if r.status < 500 else "server_error")
    assert err["param"] == case.param
    assert err["code"] == case.code
    assert "Traceback" not in r.body.decode() and len(r.body) < 800  # no traceback, no echo of big input
    assert len(backend.requests) == before  # rejected before reaching the backend


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 25 and len({x.name for x in CASES}) == len(CASES)


def test_harmless_and_neutral_fields_are_accepted(gw: tuple[GatewayThread, LocalBackend, Tokenizer]) -> None:
    g, _, _ = gw
    ok = [
        comp(user="u", store=False, metadata={"a": "b"}, logit_bias={}, echo=False, suffix=None, best_of=1),
        chat(tools=[], tool_choice="none", response_format={"type": "text"}, parallel_tool_calls=True,
             service_tier="auto", logprobs=False, messages=[
                 {"role": "system", "content": "s"},
                 {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                 {"role": "assistant", "content": None, "tool_calls": []},
                 {"role": "user", "content": "c", "name": "bob"}]),
    ]
    for i, body in enumerate(ok):
        r = raw(g.url, "POST", "/v1/chat/completions" if i else "/v1/completions", json_body=body)
        assert r.status == 200, r.body[:300]


def test_normal_requests_still_served_after_bad_input(gw: tuple[GatewayThread, LocalBackend, Tokenizer]) -> None:
    g, backend, tok = gw
    for case in CASES[:10]:  # one more burst of garbage first
        raw(g.url, case.method, "/v1/completions", json_body=case.body, data=case.data, headers=dict(case.headers))
    cl = openai.OpenAI(base_url=g.url + "/v1", api_key="x", max_retries=0)
    r = cl.completions.create(model=MODEL, prompt="hello", max_tokens=5)
    assert r.choices[0].text == tok.decode(backend.expected_tokens(5))
    chunks = list(cl.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3, stream=True))  # type: ignore[arg-type]
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == tok.decode(backend.expected_tokens(3))
    assert json.loads(raw(g.url, "GET", "/ready").body)["ready"] is True
