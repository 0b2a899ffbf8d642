"""The Responses API through real processes (gateway + prefill + decode worker, the
trained built-in model) with the official `openai` client: a `text.format` JSON schema
enforced by the workers' grammar engine (valid by `jsonschema`), a function call under
`tool_choice: "required"`, a stream whose text equals the non-streaming answer at
temperature 0, and a `previous_response_id` turn whose usage reports the prefix-cache
hit on the stored conversation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.cluster import Cluster

MODEL = "pdserve-tiny-llama"
SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "mood": {"enum": ["happy", "sad"]}, "name": {"type": "string", "maxLength": 8}},
    "required": ["mood", "name"], "additionalProperties": False}
TOOLS: Any = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                              "required": ["city"]}}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from pdserve.builtin.default_model import default_model_dir

    env = {"PDSERVE_HOME": str(tmp_path_factory.mktemp("home")), "PDSERVE_BUILTIN_WEIGHTS": "trained"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        default_model_dir()  # assembled once here, before the processes look for it
    c = Cluster(tmp_path_factory.mktemp("responses-e2e"))
    try:
        c.start_gateway(env=env, wait=False)
        c.add_worker("prefill", env=env)
        c.add_worker("decode", env=env)
        c.wait_gateway()
        c.wait_roles(prefill=1, decode=1)
        yield c
    finally:
        c.stop()


def _client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_json_schema_function_call_and_stream(cluster: Cluster) -> None:
    cl = _client(cluster)
    fmt: Any = {"type": "json_schema", "name": "friend", "schema": SCHEMA, "strict": True}
    r = cl.responses.create(model=MODEL, input="Describe a friend.", text={"format": fmt}, max_output_tokens=60,
                            temperature=0)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), SCHEMA)

    r = cl.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                            parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather", r
    jsonschema.validate(json.loads(call.arguments), {**TOOLS[0]["parameters"], "additionalProperties": False})

    kw: Any = {"model": MODEL, "input": "Tell me about the sea.", "max_output_tokens": 48, "temperature": 0}
    want = cl.responses.create(**kw).output_text
    with cl.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert len(deltas) > 1 and "".join(deltas) == want == final.output_text and want


def test_previous_response_id_reports_cached_tokens(cluster: Cluster) -> None:
    cl = _client(cluster)
    first = cl.responses.create(model=MODEL, input="Tell me a story about a cat and a dog who were friends.",
                                max_output_tokens=24, temperature=0)
    second = cl.responses.create(model=MODEL, input="What happened next?", previous_response_id=first.id,
                                 max_output_tokens=8, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # The second prompt starts with the first conversation: its blocks come from the cache.
    assert second.usage.input_tokens_details.cached_tokens >= 16, second.usage
    cluster.wait_idle()
