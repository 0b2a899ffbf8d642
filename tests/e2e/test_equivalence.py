"""Greedy output through the gateway equals the single-process engine, for every
topology and transport, for completions and chat, streaming and not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, http, running_cluster, sse
from tests.e2e.conftest import Reference

TOPOLOGIES = {
    "1p1d-tcp": ({"prefill": 1, "decode": 1}, ("--kv-transport", "tcp")),
    "1p1d-shm": ({"prefill": 1, "decode": 1}, ("--kv-transport", "shm")),
    "2p2d": ({"prefill": 2, "decode": 2}, ()),
    "colocated": ({"worker": 1}, ()),
}
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away, there lived", "1 2 3 4 5 6"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    roles, extra = TOPOLOGIES[request.param]
    log_dir: Path = tmp_path_factory.mktemp(request.param)
    with running_cluster(log_dir, roles, *extra) as c:
        yield c


def test_completions_equal_engine(cluster: Cluster, reference: Reference) -> None:
    for prompt in PROMPTS:
        ids = reference.completion_ids(prompt)
        want = reference.generate(ids, max_tokens=MAX_TOKENS, temperature=0.0)[0]
        body = {"model": reference.model_name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0, "logprobs": 0}
        status, out = http("POST", f"{cluster.url}/v1/completions", body)
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["text"] == reference.text(want)
        # Token ids: the per-token strings of the logprobs are exactly the reference tokens.
        assert choice["logprobs"]["tokens"] == [reference.tokenizer.decode([t], skip_special_tokens=False) for t in want]
        assert out["usage"]["completion_tokens"] == len(want)
        assert out["usage"]["prompt_tokens"] == len(ids)

        events = sse(f"{cluster.url}/v1/completions", {**body, "stream": True, "logprobs": None})
        assert events[-1] == "[DONE]"
        text = "".join(c["text"] for e in events[:-1] for c in e.get("choices", []))
        assert text == reference.text(want)


def test_chat_equal_engine(cluster: Cluster, reference: Reference) -> None:
    want = reference.generate(reference.chat_ids(CHAT), max_tokens=MAX_TOKENS, temperature=0.0)[0]
    body = {"model": reference.model_name, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, out = http("POST", f"{cluster.url}/v1/chat/completions", body)
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] == reference.text(want)

    events = sse(f"{cluster.url}/v1/chat/completions", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    text = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e.get("choices", []))
    assert text == reference.text(want)


def test_prompt_token_ids_equal_engine(cluster: Cluster, reference: Reference) -> None:
    """Token ids in, token ids out (via per-token logprob entries)."""
    ids = reference.completion_ids(PROMPTS[1])[:9]
    want = reference.generate(ids, max_tokens=MAX_TOKENS, temperature=0.0)[0]
    body = {"model": reference.model_name, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0}
    status, out = http("POST", f"{cluster.url}/v1/completions", body)
    assert status == 200, out
    got = [reference.tokenizer.token_to_id(t) for t in out["choices"][0]["logprobs"]["tokens"]]
    assert out["choices"][0]["text"] == reference.text(want)
    assert len(got) == len(want)
    cluster.wait_idle()
