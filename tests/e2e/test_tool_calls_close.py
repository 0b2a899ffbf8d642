"""Forced tool calls close on the trained built-in model (real gateway and colocated
worker, the official `openai` client): a weather tool whose parameters schema does not
say `additionalProperties: false` is generated strictly (no unnamed keys), so
`tool_choice: "required"` and a named function return a complete call within
`max_tokens` 80 whose arguments validate against the schema; `parallel_tool_calls:
false` yields one call; the `openai` client's streaming helper (`chat.completions.stream`)
reassembles the streamed tool-call deltas into the same calls as the non-streaming
answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.e2e.cluster import Cluster

WEATHER: dict[str, Any] = {  # as app builders write it: no additionalProperties
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TIME: dict[str, Any] = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                        "required": ["zone"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
PROMPTS = ["What is the weather in Paris?", "Is it raining in Oslo today?", "How warm is it in Rome?",
           "Weather for Berlin, in celsius please.", "Tell me the weather in Madrid."]
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from pdserve.builtin.default_model import default_model_dir

    home = tmp_path_factory.mktemp("home")
    env = {"PDSERVE_HOME": str(home), "PDSERVE_BUILTIN_WEIGHTS": "trained"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        default_model_dir()  # assembled once here, before the processes look for it
    c = Cluster(tmp_path_factory.mktemp("tool-calls-close"))
    try:
        c.start_gateway(env=env, wait=False)
        c.add_worker("worker", env=env)
        c.wait_gateway()
        c.wait_roles(colocated=1)
        yield c
    finally:
        c.stop()


def _client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _valid_calls(calls: Any) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for call in calls or []:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, {**SCHEMAS[call.function.name], "additionalProperties": False})
        out.append((call.function.name, args))
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_required_tool_call_closes_within_80_tokens(cluster: Cluster, prompt: str) -> None:
    cl = _client(cluster)
    kw: Any = {"model": "pdserve-tiny-llama", "messages": [{"role": "user", "content": prompt}], "tools": TOOLS,
               "tool_choice": "required", "max_tokens": MAX_TOKENS, "temperature": 0}
    r = cl.chat.completions.create(**kw)
    choice = r.choices[0]
    # The tiny model keeps appending calls to the array until max_tokens; every call in
    # the answer is complete and valid (one cut off by max_tokens is left out).
    assert choice.finish_reason in ("tool_calls", "length"), choice
    assert len(_valid_calls(choice.message.tool_calls)) >= 1, choice
    assert r.usage is not None and r.usage.completion_tokens <= MAX_TOKENS
    # One call allowed: the array closes after it, well within max_tokens.
    r = cl.chat.completions.create(**kw, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    assert len(_valid_calls(r.choices[0].message.tool_calls)) == 1
    assert r.usage is not None and r.usage.completion_tokens < MAX_TOKENS


def test_named_call_and_parallel_false_and_stream_helper(cluster: Cluster) -> None:
    cl = _client(cluster)
    msgs: Any = [{"role": "user", "content": PROMPTS[0]}]
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    r = cl.chat.completions.create(model="pdserve-tiny-llama", messages=msgs, tools=TOOLS, tool_choice=named,
                                   max_tokens=MAX_TOKENS, temperature=0)
    [(name, _)] = _valid_calls(r.choices[0].message.tool_calls)
    assert name == "get_weather" and r.choices[0].finish_reason == "stop"

    # parallel_tool_calls false: one call, also at a temperature that wanders.
    for seed in range(3):
        r = cl.chat.completions.create(model="pdserve-tiny-llama", messages=msgs, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        assert len(_valid_calls(r.choices[0].message.tool_calls)) == 1, r
        assert r.choices[0].finish_reason == "tool_calls", r

    # The client's streaming helper assembles our deltas into the non-streaming calls.
    for choice_arg in ("required", named):
        kw: Any = {"model": "pdserve-tiny-llama", "messages": msgs, "tools": TOOLS, "tool_choice": choice_arg,
                   "parallel_tool_calls": False, "max_tokens": MAX_TOKENS, "temperature": 0}
        want = _valid_calls(cl.chat.completions.create(**kw).choices[0].message.tool_calls)
        arg_deltas, done = [], []
        with cl.chat.completions.stream(**kw) as stream:
            for event in stream:
                if event.type == "tool_calls.function.arguments.delta":
                    arg_deltas.append(event.arguments_delta)
                elif event.type == "tool_calls.function.arguments.done":
                    done.append((event.name, json.loads(event.arguments)))
            final = stream.get_final_completion()
        assert done == want and _valid_calls(final.choices[0].message.tool_calls) == want
        assert len(arg_deltas) > 1  # arguments arrive as they are generated, not at the end
