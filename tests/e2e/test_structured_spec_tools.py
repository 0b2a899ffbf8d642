"""Structured outputs with speculation on, and auto tool choice, through real processes
(one 1P+1D cluster, the decode worker drafting with n-gram, the gateway started with
`--enable-auto-tool-choice --tool-call-parser hermes`), with the official `openai` client:

- seeded json_schema requests: valid, token-identical to the single-process engine
  without speculation, and the decode worker really verified (and accepted) drafts;
- `tools` + `tool_choice: "auto"` whose output a `structured_outputs` regex forces to a
  Hermes `<tool_call>{...}</tool_call>`: the client receives `tool_calls` (non-streaming
  and reassembled from a stream) and `finish_reason == "tool_calls"` (vLLM keeps the
  request's structured output under auto tool choice and parses the calls out of it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, metric_value, worker_metrics
from tests.e2e.conftest import Reference
from tests.e2e.test_spec_decode import NGRAM
from tests.e2e.test_structured_outputs import (
    MAX_TOKENS,
    TOOLS,
    WEATHER,
    _client,
    _reassemble,
    _reference_text,
    _seeded_body,
    _valid,
)

N_SEEDED = 4
FORCED_CALL = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", '
               r'"days": [123]\}\}</tool_call>')


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("structured-spec-tools"))
    try:
        c.start_gateway("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
        c.add_worker("prefill")
        c.add_worker("decode", "--speculative-config", NGRAM)
        c.wait_roles(prefill=1, decode=1)
        yield c
    finally:
        c.stop()


def test_seeded_schema_requests_with_speculation_are_valid_and_identical(cluster: Cluster,
                                                                        reference: Reference) -> None:
    cl = _client(cluster)
    for i in range(N_SEEDED):
        body = _seeded_body(reference, i)
        r = cl.completions.create(**{k: v for k, v in body.items() if k != "structured_outputs"},
                                  extra_body={"structured_outputs": body["structured_outputs"]})
        assert r.choices[0].finish_reason == "stop", body["seed"]
        assert r.choices[0].text == _reference_text(reference, body), body["seed"]
        _valid(r.choices[0].text)
    decoder = next(w for w in cluster.worker_list() if w["role"] == "decode")
    text = worker_metrics(decoder)
    drafts = metric_value(text, "llm_spec_decode_num_draft_tokens_total")
    accepted = metric_value(text, "llm_spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafts, (accepted, drafts)  # constrained requests did speculate
    cluster.wait_idle()


def test_auto_tool_choice_parses_a_forced_hermes_call(cluster: Cluster, reference: Reference) -> None:
    cl = _client(cluster)
    kw: Any = {"model": reference.model_name, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
               "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 9, "tools": TOOLS, "tool_choice": "auto",
               "extra_body": {"structured_outputs": {"regex": FORCED_CALL}}}
    r = cl.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content  # the tagged call is not content
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = _valid(call.function.arguments, WEATHER)
    chunks = list(cl.chat.completions.create(stream=True, **kw))
    streamed = _reassemble(chunks)
    assert list(streamed) == [0] and streamed[0]["name"] == "get_weather" and streamed[0]["id"].startswith("call_")
    assert json.loads(streamed[0]["arguments"]) == args  # same seed, same call
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices).strip()
    # Without the forcing constraint the same request is free text: no tool call parsed.
    free = cl.chat.completions.create(**{**kw, "max_tokens": 8, "extra_body": {}})
    assert free.choices[0].finish_reason == "length" and not free.choices[0].message.tool_calls
    cluster.wait_idle()
