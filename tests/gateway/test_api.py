"""The OpenAI API of the gateway over a real socket, driven by the official `openai` client
and aiohttp, against the in-process LocalBackend."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.backend import BackendErrorKind
from gateway.config import GatewayConfig
from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model
from tests.gateway.local_backend import GatewayThread, LocalBackend, raw

MODEL = "test-model"
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d: Path = write_default_model(tmp_path_factory.mktemp("gw-model"))
    return Tokenizer.from_model_dir(d)


@pytest.fixture
def backend(tok: Tokenizer) -> LocalBackend:
    return LocalBackend(tok)


@pytest.fixture
def gw(backend: LocalBackend, tok: Tokenizer) -> Iterator[GatewayThread]:
    with GatewayThread(GatewayConfig(model_name=MODEL, max_model_len=256), backend, tok) as g:
        yield g


def client(gw: GatewayThread, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=20)


def text_of(backend: LocalBackend, tok: Tokenizer, n_tokens: int, index: int = 0) -> str:
    return tok.decode(backend.expected_tokens(n_tokens, index))


def test_completion_text_usage_and_cached_tokens(gw: GatewayThread, backend: LocalBackend, tok: Tokenizer) -> None:
    backend.cached_tokens = 2
    r = client(gw).completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert r.object == "text_completion"
    assert r.choices[0].text == text_of(backend, tok, 6)
    assert r.choices[0].finish_reason == "length"
    prompt_len = len(tok.encode("Once upon a time"))
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt_len, 6, prompt_len + 6)
    assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens == 2
    assert backend.requests[-1].prompt_token_ids == tok.encode("Once upon a time")


def test_completion_prompt_as_token_ids(gw: GatewayThread, backend: LocalBackend, tok: Tokenizer) -> None:
    r = client(gw).completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3)
    assert backend.requests[-1].prompt_token_ids == [5, 6, 7, 8]
    assert r.usage is not None and r.usage.prompt_tokens == 4
    assert r.choices[0].text == text_of(backend, tok, 3)


def test_chat_non_streaming_uses_the_chat_template(gw: GatewayThread, backend: LocalBackend, tok: Tokenizer) -> None:
    r = client(gw).chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=4)  # type: ignore[arg-type]
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text_of(backend, tok, 4)
    expected_prompt = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    assert backend.requests[-1].prompt_token_ids == expected_prompt
    assert backend.requests[-1].params.max_tokens == 4


def test_chat_streaming_with_usage(gw: GatewayThread, backend: LocalBackend, tok: Tokenizer) -> None:
    chunks = list(client(gw).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=7, stream=True, stream_options={"include_usage": True}))  # type: ignore[arg-type]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text_of(backend, tok, 7)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7
    assert len({c.id for c in chunks}) == 1


def test_stream_ends_with_done_on_the_wire(gw: GatewayThread) -> None:
    r = raw(gw.url, "POST", "/v1/completions", json_body={"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True})
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    data = r.sse_data()
    assert data[-1] == "[DONE]"
    assert all(json.loads(d)["object"] == "text_completion" for d in data[:-1])


def test_stop_string_truncates_and_aborts_the_backend(gw: GatewayThread, backend: LocalBackend, tok: Tokenizer) -> None:
    full = text_of(backend, tok, 12)
    stop = " brown"
    assert stop in full
    r = client(gw).completions.create(model=MODEL, prompt="x", max_tokens=12, stop=[stop, "zzz"])
    assert r.choices[0].text == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert backend.aborted == [backend.requests[-1].request_id]  # closed early: abort everywhere
    chunks = list(client(gw).completions.create(model=MODEL, prompt="x", max_tokens=12, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_eos_finishes_with_stop_and_is_not_shown(gw: GatewayThread, backend: LocalBackend, tok: Tokenizer) -> None:
    backend.eos_at = 3
    r = client(gw).completions.create(model=MODEL, prompt="x", max_tokens=10)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text_of(backend, tok, 3)
    assert r.usage is not None and r.usage.completion_tokens == 4  # the EOS token counts
    r = client(gw).completions.create(model=MODEL, prompt="x", max_tokens=10, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 10


def test_n_choices(gw: GatewayThread, backend: LocalBackend, tok: Tokenizer) -> None:
    r = client(gw).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, n=3, seed=7)  # type: ignore[arg-type]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [text_of(backend, tok, 5, i) for i in range(3)]
    assert r.usage is not None and r.usage.completion_tokens == 15
    assert len(backend.requests) == 1 and backend.requests[0].params.n == 3  # one backend request
    texts = ["", "", ""]
    for c in client(gw).completions.create(model=MODEL, prompt="x", max_tokens=5, n=3, stream=True):
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert texts == [text_of(backend, tok, 5, i) for i in range(3)]


def test_logprobs_shapes(gw: GatewayThread, backend: LocalBackend, tok: Tokenizer) -> None:
    r = client(gw).completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs == [-0.5] * 4 and all(len(t) == 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    c = client(gw).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=3)  # type: ignore[arg-type]
    content = c.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3 and all(len(e.top_logprobs) == 3 for e in content)
    assert backend.requests[-1].params.logprobs == 3


def test_sampling_parameters_reach_the_backend(gw: GatewayThread, backend: LocalBackend) -> None:
    client(gw).completions.create(
        model=MODEL, prompt="x", max_tokens=2, temperature=0.7, top_p=0.9, seed=123, presence_penalty=0.5,
        frequency_penalty=-0.5, user="alice",
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "priority": "batch"},
    )
    p = backend.requests[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.7, 0.9, 40, 0.05, 123)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert backend.requests[-1].priority == "batch"
    client(gw).with_options(default_headers={"x-pdserve-priority": "batch"}).completions.create(
        model=MODEL, prompt="x", max_tokens=1)
    assert backend.requests[-1].priority == "batch"


def test_request_id_is_honoured_and_propagated(gw: GatewayThread, backend: LocalBackend) -> None:
    r = raw(gw.url, "POST", "/v1/completions", json_body={"model": MODEL, "prompt": "x", "max_tokens": 1},
            headers={"x-request-id": "req-abc.123"})
    assert r.headers["x-request-id"] == "req-abc.123"
    assert r.json()["id"] == "cmpl-req-abc.123"
    assert backend.requests[-1].request_id == "req-abc.123"
    r = raw(gw.url, "POST", "/v1/completions", json_body={"model": MODEL, "prompt": "x", "max_tokens": 1},
            headers={"x-request-id": "bad id with spaces"})
    assert r.headers["x-request-id"] != "bad id with spaces" and len(r.headers["x-request-id"]) == 32


def test_model_may_be_omitted(gw: GatewayThread) -> None:
    r = raw(gw.url, "POST", "/v1/completions", json_body={"prompt": "x", "max_tokens": 1})
    assert r.status == 200 and r.json()["model"] == MODEL


def test_no_workers_is_503_with_retry_after(gw: GatewayThread, backend: LocalBackend) -> None:
    backend.fail_before_first = BackendErrorKind.NO_WORKERS
    with pytest.raises(openai.InternalServerError) as e:
        client(gw).completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True)
    assert e.value.status_code == 503
    assert e.value.response.headers["Retry-After"].isdigit()
    assert e.value.body["code"] == "no_workers"  # type: ignore[index]


def test_failure_after_streaming_started_is_a_final_error_event(gw: GatewayThread, backend: LocalBackend) -> None:
    backend.fail_after = 2
    r = raw(gw.url, "POST", "/v1/chat/completions", json_body={"messages": CHAT, "max_tokens": 10, "stream": True})
    assert r.status == 200
    data = r.sse_data()
    err = json.loads(data[-2])["error"]
    assert err["type"] == "server_error" and err["code"] == "backend_failed" and "Traceback" not in err["message"]
    assert data[-1] == "[DONE]"
    with pytest.raises(openai.APIError):
        list(client(gw).chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, stream=True))  # type: ignore[arg-type]
    r = raw(gw.url, "POST", "/v1/completions", json_body={"prompt": "x", "max_tokens": 10})
    assert r.status == 500 and r.json()["error"]["code"] == "backend_failed"
    backend.fail_after = None
    assert client(gw).completions.create(model=MODEL, prompt="x", max_tokens=3).choices[0].finish_reason == "length"


def test_client_disconnect_aborts_the_backend_request(gw: GatewayThread, backend: LocalBackend) -> None:
    backend.token_delay = 0.02

    async def go() -> None:
        async with aiohttp.ClientSession() as s, s.post(
            gw.url + "/v1/completions", headers={"x-request-id": "gone-1"},
            json={"prompt": "x", "max_tokens": 200, "stream": True},
        ) as r:
            await r.content.readline()  # the first event arrived: decoding is under way
        # Leaving the block closes the connection mid-stream.

    asyncio.run(go())
    deadline = time.monotonic() + 5
    while "gone-1" not in backend.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend.aborted == ["gone-1"]
    assert gw.call(lambda: backend.active) == 0


def test_models_workers_health_ready(gw: GatewayThread, backend: LocalBackend) -> None:
    models = client(gw).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert raw(gw.url, "GET", f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert raw(gw.url, "GET", "/v1/models/other").status == 404
    assert raw(gw.url, "GET", "/v1/workers").status == 404  # no admin token configured: no listing
    assert raw(gw.url, "GET", "/health").status == 200
    ready = raw(gw.url, "GET", "/ready")
    assert ready.status == 200 and ready.json()["ready"] is True
    backend.is_ready = False
    ready = raw(gw.url, "GET", "/ready")
    assert ready.status == 503 and ready.json()["reason"] == "no decode worker registered"
    nf = raw(gw.url, "GET", "/v1/nothing")
    assert nf.status == 404 and nf.json()["error"]["type"] == "invalid_request_error"


def test_one_json_log_line_per_request(gw: GatewayThread, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pdserve.gateway"):
        raw(gw.url, "POST", "/v1/completions", json_body={"prompt": "x", "max_tokens": 2},
            headers={"x-request-id": "log-me"})
        raw(gw.url, "POST", "/v1/completions", json_body={"prompt": "x", "max_tokens": -1},
            headers={"x-request-id": "log-bad"})
    records = [json.loads(r.getMessage()) for r in caplog.records if r.name == "pdserve.gateway"]
    by_id = {r["request_id"]: r for r in records if r.get("event") == "request"}
    assert by_id["log-me"]["status"] == 200 and by_id["log-me"]["completion_tokens"] == 2
    assert set(by_id["log-me"]["timings"]) >= {"parse", "tokenize", "queue_wait", "decode", "e2e"}
    assert by_id["log-bad"]["status"] == 400 and by_id["log-bad"]["error"] == "invalid_value"


@pytest.fixture
def keyed(backend: LocalBackend, tok: Tokenizer) -> Iterator[GatewayThread]:
    config = GatewayConfig(model_name=MODEL, api_keys=("sk-one", "sk-two"), metrics_protected=True)
    with GatewayThread(config, backend, tok) as g:
        yield g


@pytest.mark.parametrize("method,path", [
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
    ("GET", f"/v1/models/{MODEL}"), ("GET", "/metrics"),
])
def test_api_key_required_on_protected_routes(keyed: GatewayThread, method: str, path: str) -> None:
    body = {"prompt": "x", "messages": CHAT} if method == "POST" else None
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic sk-one"}):
        r = raw(keyed.url, method, path, json_body=body, headers=headers)
        assert r.status == 401, (path, headers)
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "invalid_request_error"
    ok = raw(keyed.url, method, path, headers={"Authorization": "Bearer sk-two"})
    assert ok.status != 401


def test_api_key_open_routes_and_client(keyed: GatewayThread, backend: LocalBackend, tok: Tokenizer) -> None:
    assert raw(keyed.url, "GET", "/health").status == 200
    assert raw(keyed.url, "GET", "/ready").status == 200
    with pytest.raises(openai.AuthenticationError):
        client(keyed, "sk-nope").completions.create(model=MODEL, prompt="x", max_tokens=1)
    r = client(keyed, "sk-one").completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert r.choices[0].text == text_of(backend, tok, 2)


def test_non_streaming_client_disconnect_aborts_too(gw: GatewayThread, backend: LocalBackend) -> None:
    backend.token_delay = 0.02

    async def go() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as s:
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(gw.url + "/v1/completions", headers={"x-request-id": "gone-2"},
                                  json={"prompt": "x", "max_tokens": 200}) as r:
                    await r.read()

    asyncio.run(go())
    deadline = time.monotonic() + 5
    while "gone-2" not in backend.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend.aborted == ["gone-2"]


def test_request_deadline(backend: LocalBackend, tok: Tokenizer) -> None:
    backend.token_delay = 0.02
    config = GatewayConfig(model_name=MODEL, request_timeout_s=0.3)
    with GatewayThread(config, backend, tok) as g:
        assert backend.running  # the app started the backend
        r = raw(g.url, "POST", "/v1/completions", json_body={"prompt": "x", "max_tokens": 500})
        assert r.status == 504 and r.json()["error"]["code"] == "timeout"
        s = raw(g.url, "POST", "/v1/completions", json_body={"prompt": "x", "max_tokens": 500, "stream": True})
        data = s.sse_data()
        assert json.loads(data[-2])["error"]["code"] == "timeout" and data[-1] == "[DONE]"
        assert len(backend.aborted) == 2
        assert backend.requests[-1].deadline is not None
    assert not backend.running  # and closed it on cleanup


ADMIN_TOKEN = "api-test-admin-token-0123456789"


def test_worker_list_needs_the_admin_token_not_an_api_key(backend: LocalBackend, tok: Tokenizer) -> None:
    """`GET /v1/workers` names the workers and the compatibility hash a worker registers
    with: a fake worker must not read it. Only the admin token opens it."""
    config = GatewayConfig(model_name=MODEL, api_keys=("sk-one",), admin_token=ADMIN_TOKEN)
    with GatewayThread(config, backend, tok) as g:
        for headers in ({}, {"Authorization": "Bearer sk-one"}, {"Authorization": "Bearer wrong-admin-token"}):
            r = raw(g.url, "GET", "/v1/workers", headers=headers)
            assert r.status == 401, headers
            assert b"local-0" not in r.body and r.json()["error"]["code"] == "invalid_admin_token"
        ok = raw(g.url, "GET", "/v1/workers", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
        assert ok.status == 200
        assert ok.json()["data"] == [{"id": "local-0", "role": "colocated", "running": 0}]
