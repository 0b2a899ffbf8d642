"""A grammar that does not compile within --grammar-compile-timeout, through real
processes (1P+1D): a real pathological regex is an OpenAI-shaped 400 naming the
parameter, streamed or not, while a plain request beside it is served; afterwards
every worker's KV is idle (the compiling request never held a block)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, http, running_cluster, sse

PATHOLOGICAL = "(a{200}){1000}"  # 0.3-0.5 s of lexer building: over a 0.1 s timeout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with running_cluster(tmp_path_factory.mktemp("grammar-timeout"), {"prefill": 1, "decode": 1},
                         "--grammar-compile-timeout", "0.1") as c:
        yield c


def test_a_grammar_past_the_compile_timeout_is_a_400_and_others_are_served(cluster: Cluster) -> None:
    status, models = http("GET", cluster.url + "/v1/models")
    assert status == 200
    model = models["data"][0]["id"]
    url = cluster.url + "/v1/completions"
    plain: list[Any] = []
    runner = threading.Thread(target=lambda: plain.extend(sse(url, {
        "model": model, "prompt": "plain", "max_tokens": 24, "stream": True, "ignore_eos": True})))
    runner.start()
    for i, stream in enumerate((False, True)):
        body = {"model": model, "prompt": f"regex {i}", "max_tokens": 8, "stream": stream,
                "structured_outputs": {"regex": PATHOLOGICAL.replace("200", str(200 + i))}}
        status, err = http("POST", url, body)
        assert status == 400, (stream, err)
        assert err["error"]["type"] == "invalid_request_error", err
        assert "could not be compiled within 0.1 s" in err["error"]["message"], err
        assert "structured_outputs.regex" in err["error"]["message"], err
    runner.join(timeout=120)
    assert plain and plain[-1] == "[DONE]"
    assert sum(len(e["choices"][0]["text"]) > 0 for e in plain[:-1] if e.get("choices")) > 0
    cluster.wait_idle()
