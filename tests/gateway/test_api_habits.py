"""What clients coming from vLLM expect of the gateway, over a real socket against the
in-process LocalBackend: sampling defaults from generation_config.json (overridable per
request), --served-model-name aliases, and POST /tokenize and /detokenize."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.config import GatewayConfig
from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model
from pdserve.common.generation_config import SamplingDefaults
from tests.gateway.local_backend import GatewayThread, LocalBackend, raw

PRIMARY = "org/served-model"
ALIAS = "short-alias"
DEFAULTS = SamplingDefaults(temperature=0.25, top_p=0.75, top_k=7, min_p=0.05, repetition_penalty=1.3)
CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d: Path = write_default_model(tmp_path_factory.mktemp("gw-habits"))
    return Tokenizer.from_model_dir(d)


@pytest.fixture
def backend(tok: Tokenizer) -> LocalBackend:
    return LocalBackend(tok)


@pytest.fixture
def gw(backend: LocalBackend, tok: Tokenizer) -> Iterator[GatewayThread]:
    config = GatewayConfig(model_name=PRIMARY, model_aliases=(ALIAS,), max_model_len=256,
                           sampling_defaults=DEFAULTS, api_keys=("sk-habits",))
    with GatewayThread(config, backend, tok) as g:
        yield g


def client(gw: GatewayThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-habits", max_retries=0, timeout=20)


def post(gw: GatewayThread, path: str, body: Any, key: str | None = "sk-habits") -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = raw(gw.url, "POST", path, json_body=body, headers=headers)
    return r.status, r.json()


# --- generation defaults ---------------------------------------------------------------


def test_generation_config_defaults_fill_what_the_request_leaves_out(gw: GatewayThread, backend: LocalBackend) -> None:
    client(gw).completions.create(model=PRIMARY, prompt="Once upon a time", max_tokens=3)
    p = backend.requests[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.25, 0.75, 7, 0.05, 1.3)
    assert p.max_tokens == 3

    client(gw).chat.completions.create(model=PRIMARY, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert backend.requests[-1].params.temperature == 0.25


def test_a_request_value_overrides_each_default(gw: GatewayThread, backend: LocalBackend) -> None:
    client(gw).completions.create(model=PRIMARY, prompt="Hi", max_tokens=2, temperature=1.0, top_p=1.0,
                                  extra_body={"top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0})
    p = backend.requests[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, 0, 0.0, 1.0)
    client(gw).chat.completions.create(model=PRIMARY, messages=CHAT, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    p = backend.requests[-1].params
    assert p.temperature == 0.0 and p.top_k == 7  # only what the request names is overridden


def test_a_request_opts_out_of_speculation(gw: GatewayThread, backend: LocalBackend) -> None:
    client(gw).completions.create(model=PRIMARY, prompt="Hi", max_tokens=2, extra_body={"speculative": False})
    assert backend.requests[-1].params.speculative is False
    client(gw).chat.completions.create(model=PRIMARY, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert backend.requests[-1].params.speculative is True  # speculation is on unless a request says no


# --- served model names ----------------------------------------------------------------


def test_every_alias_is_accepted_and_the_first_name_is_reported(gw: GatewayThread) -> None:
    c = client(gw)
    for name in (PRIMARY, ALIAS):
        assert c.completions.create(model=name, prompt="Hi", max_tokens=2).model == PRIMARY
        assert c.chat.completions.create(model=name, messages=CHAT, max_tokens=2).model == PRIMARY  # type: ignore[arg-type]
        chunks = list(c.completions.create(model=name, prompt="Hi", max_tokens=2, stream=True))
        assert chunks and {ch.model for ch in chunks} == {PRIMARY}
        assert c.models.retrieve(name).id == name
    assert [m.id for m in c.models.list().data] == [PRIMARY, ALIAS]
    r = raw(gw.url, "GET", f"/v1/models/{PRIMARY}", headers={"Authorization": "Bearer sk-habits"})
    assert r.status == 200 and r.json()["id"] == PRIMARY  # a name with a slash, unescaped


def test_an_unknown_model_is_a_404_model_not_found(gw: GatewayThread, backend: LocalBackend) -> None:
    c = client(gw)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="served-model", prompt="Hi", max_tokens=2)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")
    assert backend.requests == []


# --- /tokenize and /detokenize -----------------------------------------------------------


def test_tokenize_a_prompt(gw: GatewayThread, tok: Tokenizer) -> None:
    status, out = post(gw, "/tokenize", {"model": ALIAS, "prompt": "Once upon a time"})
    want = tok.encode("Once upon a time", add_special_tokens=True)
    assert status == 200 and out == {"count": len(want), "max_model_len": 256, "tokens": want, "token_strs": None}
    assert want[0] == tok.bos_token_id  # add_special_tokens defaults to true for a prompt

    status, out = post(gw, "/tokenize", {"prompt": "Once upon a time", "add_special_tokens": False,
                                         "return_token_strs": True})
    plain = tok.encode("Once upon a time", add_special_tokens=False)
    assert status == 200 and out["tokens"] == plain and out["count"] == len(plain) == len(want) - 1
    assert out["token_strs"] == [tok.id_to_token(i) for i in plain]


def test_tokenize_messages_matches_what_a_chat_request_sends(gw: GatewayThread, backend: LocalBackend, tok: Tokenizer) -> None:
    client(gw).chat.completions.create(model=PRIMARY, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    status, out = post(gw, "/tokenize", {"model": PRIMARY, "messages": CHAT})
    assert status == 200 and out["tokens"] == backend.requests[-1].prompt_token_ids and out["count"] == len(out["tokens"])

    status, out = post(gw, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert status == 200
    assert out["tokens"] == tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=False), add_special_tokens=False)
    assert out["count"] < len(backend.requests[-1].prompt_token_ids)


def test_detokenize_round_trips_and_keeps_special_tokens(gw: GatewayThread, tok: Tokenizer) -> None:
    ids = tok.encode("The quick brown fox", add_special_tokens=True)
    status, out = post(gw, "/detokenize", {"model": PRIMARY, "tokens": ids})
    assert status == 200 and out == {"prompt": tok.decode(ids, skip_special_tokens=False)}
    assert out["prompt"].endswith("The quick brown fox") and out["prompt"] != "The quick brown fox"
    assert post(gw, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), [
    ("/tokenize", {"model": PRIMARY}, 400, "prompt", "missing_required_parameter"),
    ("/tokenize", {"prompt": 42}, 400, "prompt", "invalid_type"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens", "invalid_type"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt", "unknown_parameter"),
    ("/tokenize", {"messages": []}, 400, "messages", "empty_array"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model", "model_not_found"),
    ("/detokenize", {"model": PRIMARY}, 400, "tokens", "missing_required_parameter"),
    ("/detokenize", {"tokens": "1 2 3"}, 400, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens", "invalid_type"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "tokens", "invalid_token_id"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens", "invalid_token_id"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, 400, "prompt", "unknown_parameter"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model", "model_not_found"),
])
def test_bad_tokenize_input_is_an_error_naming_the_parameter(
    gw: GatewayThread, path: str, body: Any, status: int, param: str, code: str
) -> None:
    got, out = post(gw, path, body)
    assert got == status, out
    assert out["error"]["param"] == param and out["error"]["code"] == code, out
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["message"]
    assert post(gw, "/detokenize", {"tokens": [5, 6]})[0] == 200  # and the gateway still serves


def test_tokenize_endpoints_check_key_body_and_content_type(gw: GatewayThread) -> None:
    for path in ("/tokenize", "/detokenize"):
        assert post(gw, path, {"prompt": "a", "tokens": [1]}, key=None)[0] == 401
        r = raw(gw.url, "POST", path, data=b"{not json", headers={"Authorization": "Bearer sk-habits",
                                                                  "Content-Type": "application/json"})
        assert r.status == 400 and r.json()["error"]["code"] == "invalid_json"
        r = raw(gw.url, "POST", path, data=b"{}", headers={"Authorization": "Bearer sk-habits",
                                                           "Content-Type": "text/plain"})
        assert r.status == 415
        big = b'{"prompt": "' + b"a" * (2 << 20) + b'"}'
        r = raw(gw.url, "POST", path, data=big, headers={"Authorization": "Bearer sk-habits",
                                                         "Content-Type": "application/json"})
        assert r.status == 413 and r.json()["error"]["code"] == "request_too_large"
