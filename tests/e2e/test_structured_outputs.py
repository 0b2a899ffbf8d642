"""Structured outputs and tool calls through real processes, with the official `openai`
client: response_format json_schema (non-streaming and streaming), vLLM's
structured_outputs, forced tool calls reassembled from a stream, a bad schema as a 400;
seeded schema-constrained requests 100% valid and token-identical in colocated, 1P+1D
and the single-process engine; and after a kill -9 of the decode worker mid-stream.

The built-in model's weights are random: the schemas force termination (enums,
booleans, bounded strings and arrays) and max_tokens is generous."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from pdserve.common.structured import json_schema
from tests.e2e.cluster import Cluster, metric_value, running_cluster, worker_metrics
from tests.e2e.conftest import Reference
from tests.e2e.test_exact_recovery import KEY, KILL_AFTER, Stream

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "color", "name", "tags"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": TIME}},
]
PARAMS_OF = {"get_weather": WEATHER, "get_time": TIME}
MAX_TOKENS = 150
N_SEEDED = 16


def _client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _json_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}


def _seeded_body(reference: Reference, i: int) -> dict[str, Any]:
    return {"model": reference.model_name, "prompt": f"Record {i}:", "max_tokens": MAX_TOKENS,
            "temperature": 1.0, "seed": 1000 + i, "structured_outputs": {"json": SCHEMA}}


def _reference_text(reference: Reference, body: dict[str, Any]) -> str:
    """The single-process engine's output for `body`, with the same constraint and seed."""
    [ids] = reference.generate(reference.completion_ids(body["prompt"]), max_tokens=MAX_TOKENS, temperature=1.0,
                               seed=body["seed"], structured=json_schema(SCHEMA, "structured_outputs.json"))
    return reference.text(ids)


def _valid(text: str, schema: dict[str, Any] = SCHEMA) -> Any:
    obj = json.loads(text)
    jsonschema.validate(obj, schema)
    return obj


def _reassemble(chunks: list[Any]) -> dict[int, dict[str, str]]:
    """Tool calls rebuilt from streamed deltas the way OpenAI clients do it."""
    calls: dict[int, dict[str, str]] = {}
    for ch in chunks:
        for choice in ch.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
    return calls


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One colocated worker; the seeded test then adds a prefill and a decode worker."""
    with running_cluster(tmp_path_factory.mktemp("structured"), {"worker": 1}) as c:
        yield c


def test_openai_client_structured_outputs_and_forced_tool_calls(colocated: Cluster, reference: Reference) -> None:
    c = colocated
    cl, model = _client(c), reference.model_name
    msgs: Any = [{"role": "user", "content": "Describe a thing."}]
    kw: Any = {"model": model, "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 5}
    r = cl.chat.completions.create(response_format=_json_format(SCHEMA), **kw)
    assert r.choices[0].finish_reason == "stop"
    text = r.choices[0].message.content or ""
    _valid(text)
    chunks = list(cl.chat.completions.create(response_format=_json_format(SCHEMA), stream=True, **kw))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text  # same seed, same tokens, streamed or not

    done = cl.completions.create(model=model, prompt="Answer:", max_tokens=40, temperature=1.0, seed=3,
                                 extra_body={"structured_outputs": {"regex": "(yes|no) [0-9]{3}"}})
    assert done.choices[0].finish_reason == "stop"
    assert done.choices[0].text[:3] in ("yes", "no ") and done.choices[0].text[-3:].isdigit()
    picked = cl.completions.create(model=model, prompt="Pick:", max_tokens=40, temperature=1.0, seed=4,
                                   extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    assert picked.choices[0].text in ("alpha", "beta", "gamma")

    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    r = cl.chat.completions.create(tools=TOOLS, tool_choice=named, **kw)
    [call] = r.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    _valid(call.function.arguments, WEATHER)
    chunks = list(cl.chat.completions.create(tools=TOOLS, tool_choice=named, stream=True, **kw))
    streamed_calls = _reassemble(chunks)
    assert list(streamed_calls) == [0] and streamed_calls[0]["name"] == "get_weather"
    assert streamed_calls[0]["arguments"] == call.function.arguments

    for seed in (1, 2, 3):
        r = cl.chat.completions.create(tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                       **{**kw, "seed": seed})
        assert r.choices[0].finish_reason == "tool_calls"
        [call] = r.choices[0].message.tool_calls or []
        _valid(call.function.arguments, PARAMS_OF[call.function.name])
    chunks = list(cl.chat.completions.create(tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                             stream=True, **kw))
    [streamed_call] = _reassemble(chunks).values()
    _valid(streamed_call["arguments"], PARAMS_OF[streamed_call["name"]])
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"

    with pytest.raises(openai.BadRequestError) as info:
        cl.chat.completions.create(response_format=_json_format({"type": "object", "properties": {"a": {"type": 7}}}),
                                   **kw)
    assert info.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        cl.completions.create(model=model, prompt="x", extra_body={"structured_outputs": {"regex": "a(b"}})
    assert info.value.body["param"] == "structured_outputs.regex"  # type: ignore[index]
    c.wait_idle()


def test_seeded_schema_requests_are_valid_and_identical_colocated_and_disaggregated(
    colocated: Cluster, reference: Reference,
) -> None:
    bodies = [_seeded_body(reference, i) for i in range(N_SEEDED)]
    expected = [_reference_text(reference, b) for b in bodies]
    for e in expected:
        _valid(e)
    c, cl = colocated, _client(colocated)
    for mode in ("colocated", "disaggregated"):
        if mode == "disaggregated":  # with a prefill and a decode worker the gateway disaggregates
            c.add_worker("prefill")
            c.add_worker("decode")
            prefill = next(w for w in c.wait_roles(colocated=1, prefill=1, decode=1) if w["role"] == "prefill")
        for body, want in zip(bodies, expected, strict=True):
            r = cl.completions.create(**{k: v for k, v in body.items() if k != "structured_outputs"},
                                      extra_body={"structured_outputs": body["structured_outputs"]})
            assert r.choices[0].finish_reason == "stop", (mode, body["seed"])
            assert r.choices[0].text == want, (mode, body["seed"])
        c.wait_idle()
    assert metric_value(worker_metrics(prefill), "llm_prefill_requests_total") == N_SEEDED


def test_kill_decode_mid_stream_schema_streams_resume_valid_and_exact(log_dir: Path, reference: Reference) -> None:
    c = Cluster(log_dir)
    try:
        # least-loaded: decode placement by most free KV (kv-aware would spread by running count).
        c.start_gateway("--heartbeat-timeout", "1.5", "--router", "least-loaded",
                        env={"PDSERVE_GATEWAY_SEED_KEY": KEY.hex()})
        c.add_worker("prefill")
        # Four times the KV of the other decode worker (so every request is routed to it),
        # slowed down (0.1 s a step) so the kill lands mid-stream.
        victim = c.add_worker("decode", "--num-blocks", "1024", "--enable-fault-injection",
                              env={"PDSERVE_FAULTS": "step_delay_s=0.1"})
        c.add_worker("decode")
        c.wait_roles(prefill=1, decode=2)
        bodies = [_seeded_body(reference, i) for i in range(4)]
        streams = [Stream(c.url, f"schema-{i}", b) for i, b in enumerate(bodies)]
        for s in streams:
            s.thread.start()
        for s in streams:
            s.wait_chunks(KILL_AFTER)
        victim.signal(signal.SIGKILL)
        assert all(not s.finishes for s in streams)  # every stream was cut mid-way
        for s, body in zip(streams, bodies, strict=True):
            texts, finishes = s.result()
            assert finishes == ["stop"] and texts == [_reference_text(reference, body)], s.rid
            _valid(texts[0])
        gateway_log = c.gateway.log_path.read_text() if c.gateway else ""
        assert all(f"recovering {s.rid} " in gateway_log for s in streams)
        c.wait_roles(prefill=1, decode=1)
        c.wait_idle(timeout=50)
    finally:
        c.stop()
