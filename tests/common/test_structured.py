"""The structured-output constraint on the wire and as a grammar: typed to its leaves in
every request message (never pickled), checked the same way by gateway and worker."""

from __future__ import annotations

import json

import msgpack
import pytest

from pdserve.common import protocol as p
from pdserve.common.sampling_params import SamplingParams, SamplingParamsError
from pdserve.common.structured import (
    StructuredOutput,
    StructuredOutputError,
    check,
    choice_regex,
    json_schema,
)

CONSTRAINED = SamplingParams(max_tokens=9, seed=1, structured=json_schema({"enum": ["a", "b"]}, "response_format"))


@pytest.mark.parametrize("msg", [
    p.PrefillRequest("r#1", p.RequestPayload([1, 2], CONSTRAINED, p.Resume([5], 0))),
    p.DecodeReserve("r#1", "x", p.RequestPayload([1, 2], CONSTRAINED)),
    p.RunRequest("r#1", p.RequestPayload([1], CONSTRAINED)),
], ids=lambda m: type(m).__name__)
def test_constraint_round_trips_typed(msg: p.Message) -> None:
    back = p.decode(p.encode(msg))
    assert back == msg
    c = back.payload.params.structured  # type: ignore[attr-defined]
    assert isinstance(c, StructuredOutput) and c.kind == "json_schema" and json.loads(c.spec) == {"enum": ["a", "b"]}
    assert SamplingParams.from_dict(CONSTRAINED.to_dict()) == CONSTRAINED


@pytest.mark.parametrize("structured", [
    {"kind": "regex", "spec": 5, "param": "x"},
    {"kind": "regex", "spec": "a", "param": "x", "pickle": "cos\nsystem\n"},
    {"spec": "a"},
    "regex:a",
])
def test_malformed_constraints_are_protocol_errors(structured: object) -> None:
    payload = p.encode_fields(p.RunRequest("r", p.RequestPayload([1], CONSTRAINED)))["payload"]
    payload["params"]["structured"] = structured
    frame = msgpack.packb([p.MAGIC, p.VERSION, "run", {"request_id": "r", "payload": payload}], use_bin_type=True)
    with pytest.raises(p.ProtocolError):
        p.decode(frame)


def test_unknown_kind_fails_validation_naming_the_parameter() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured=StructuredOutput("xml", "", "structured_outputs.xml")).validate()
    assert info.value.param == "structured_outputs.xml"


def test_check_names_the_parameter_and_accepts_good_constraints() -> None:
    for bad in (StructuredOutput("regex", "(", "structured_outputs.regex"),
                StructuredOutput("json_schema", '{"type": "nope"}', "tools[0].function.parameters"),
                StructuredOutput("grammar", "start: missing", "structured_outputs.grammar")):
        with pytest.raises(StructuredOutputError) as info:
            check(bad)
        assert info.value.param == bad.param and bad.param in str(info.value)
    for good in (StructuredOutput("json_object"), StructuredOutput("choice", json.dumps(["a+b", "c|d", "(e)"])),
                 StructuredOutput("regex", "[0-9]+"), StructuredOutput("grammar", 'start: "x"+')):
        assert check(good)


def test_choice_regex_escapes_every_operator() -> None:
    import re

    choices = ["a.b", "c|d", "(e)", "f*g+h?", "[i]{2}", "^j$", "k\\l", "m-n~&#"]
    assert all(re.fullmatch(choice_regex(choices), c) for c in choices)
    assert not re.fullmatch(choice_regex(choices), "axb") and not re.fullmatch(choice_regex(choices), "c")
