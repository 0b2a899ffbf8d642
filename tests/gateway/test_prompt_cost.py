"""A prompt's cost is bounded before admission: the character pre-check, tokenization and
templates off the event loop (gateway/prompts.py, gateway/prompt_pool.py), capped
`stop_token_ids` and `user`, and a template failing in any way answered 400."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gateway.config import GatewayConfig, RequestLimits
from gateway.state import STATE
from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model
from tests.gateway.local_backend import GatewayThread, LocalBackend, raw

MODEL = "m"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d: Path = write_default_model(tmp_path_factory.mktemp("cost-model"))
    return Tokenizer.from_model_dir(d)


@pytest.fixture
def backend(tok: Tokenizer) -> LocalBackend:
    return LocalBackend(tok)


@pytest.fixture
def gw(backend: LocalBackend, tok: Tokenizer) -> Iterator[GatewayThread]:
    with GatewayThread(GatewayConfig(model_name=MODEL, max_model_len=256), backend, tok) as g:
        yield g


def completion(g: GatewayThread, **body: object) -> tuple[int, dict[str, object]]:
    r = raw(g.url, "POST", "/v1/completions", json_body={"model": MODEL, "max_tokens": 2, **body})
    return r.status, r.json()


def error_code(out: dict[str, object]) -> object:
    err = out["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
    return err["code"]


def test_obviously_too_long_prompts_are_refused_before_tokenizing(gw: GatewayThread, tok: Tokenizer) -> None:
    limit = 256 * tok.max_token_chars
    status, out = completion(gw, prompt="x" * (limit + 1))
    assert status == 400 and error_code(out) == "prompt_too_long"
    long_chat = [{"role": "user", "content": "y" * (limit + 1)}]
    r = raw(gw.url, "POST", "/v1/chat/completions", json_body={"model": MODEL, "messages": long_chat})
    assert r.status == 400 and error_code(r.json()) == "prompt_too_long"
    # Under the character bound, the token count decides, as before.
    status, out = completion(gw, prompt="hello " * 300)
    assert status == 400 and error_code(out) == "context_length_exceeded"
    assert completion(gw, prompt="hello")[0] == 200


def test_stop_token_ids_are_capped_and_deduplicated(gw: GatewayThread, backend: LocalBackend) -> None:
    status, out = completion(gw, prompt="hi", stop_token_ids=list(range(65)))
    assert status == 400 and error_code(out) == "too_many_stop_token_ids"
    status, _ = completion(gw, prompt="hi", stop_token_ids=[9, 3, 9, 3, 7])
    assert status == 200 and backend.requests[-1].params.stop_token_ids == frozenset({3, 7, 9})


def test_user_is_capped_and_logged_truncated(gw: GatewayThread, caplog: pytest.LogCaptureFixture) -> None:
    status, out = completion(gw, prompt="hi", user="u" * 257)
    assert status == 400 and error_code(out) == "string_above_max_length"
    with caplog.at_level(logging.INFO, logger="pdserve.gateway"):
        assert completion(gw, prompt="hi", user="v" * 256)[0] == 200
    lines = [r.getMessage() for r in caplog.records if '"event":"request"' in r.getMessage()]
    assert lines and all("v" * 65 not in line and '"user":"' + "v" * 64 + '"' in line for line in lines)


@pytest.mark.parametrize(("template", "kind"), [
    ("{% for i in range(10**6) %}x{% endfor %}", "OverflowError"),  # the sandbox's range cap
    ("{{ 1 // (messages | length - 1) }}", "ZeroDivisionError"),
    ("{{ messages[0].content.__class__.__mro__ }}", "SecurityError"),
    ("{{ messages[7].content.upper() }}", "UndefinedError"),
    ("{{ raise_exception('no system turns here') }}", "no system turns"),
])
def test_template_errors_of_any_kind_are_a_400(tok: Tokenizer, template: str, kind: str) -> None:
    broken = Tokenizer(tok.backend, chat_template=template, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    with GatewayThread(GatewayConfig(model_name=MODEL, max_model_len=256), LocalBackend(broken), broken) as g:
        r = raw(g.url, "POST", "/v1/chat/completions",
                json_body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status == 400, r.body
        assert error_code(r.json()) == "invalid_messages"
        assert kind in r.json()["error"]["message"] or kind in ("SecurityError", "UndefinedError")


def test_health_stays_fast_while_huge_prompts_tokenize(tok: Tokenizer) -> None:
    """20 prompts of ~1 MiB each pass the character check (raised for the test) and are
    tokenized, then refused as too long. While any of them is being tokenized, /health
    answers in well under the time one of them takes to tokenize (measured here, on this
    machine): on the event loop, a /health would wait for whole ones."""
    huge = "hello world, this is some text! " * 32000  # 1,024,000 characters
    t0 = time.perf_counter()
    tok.encode(huge)
    one_prompt_s = time.perf_counter() - t0
    limits = RequestLimits(max_body_bytes=2 << 20, max_prompt_chars=4 << 20)
    config = GatewayConfig(model_name=MODEL, max_model_len=256, limits=limits)
    with GatewayThread(config, LocalBackend(tok), tok) as g:
        assert g.app is not None
        state = g.app[STATE]
        statuses: list[int] = []

        async def flood() -> None:
            async with aiohttp.ClientSession() as s:
                async def one() -> None:
                    async with s.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": huge}) as r:
                        statuses.append(r.status)
                        assert error_code(await r.json()) == "context_length_exceeded"
                await asyncio.gather(*(one() for _ in range(20)))

        sender = threading.Thread(target=lambda: asyncio.run(flood()))
        sender.start()
        latencies: list[float] = []
        tokenizing_seen = 0  # samples taken while a huge prompt was in the pool
        try:
            while sender.is_alive():
                t0 = time.perf_counter()
                assert raw(g.url, "GET", "/health").status == 200
                latencies.append(time.perf_counter() - t0)
                tokenizing_seen += g.call(lambda: state.prompts.pending("large")) > 0
        finally:
            sender.join(120)
        assert statuses == [400] * 20
        assert tokenizing_seen >= 20, "sampled /health while the prompts were tokenizing"
        latencies.sort()
        p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
        print(f"/health under the flood: {len(latencies)} samples, p50 {p50 * 1e3:.1f} ms, "
              f"p99 {p99 * 1e3:.1f} ms, max {latencies[-1] * 1e3:.0f} ms; one prompt {one_prompt_s:.2f} s")
        # On the loop, a /health would wait for whole tokenizations: p50 near one_prompt_s.
        assert p50 < one_prompt_s / 20 and p99 < one_prompt_s / 2, (p50, p99, one_prompt_s)
