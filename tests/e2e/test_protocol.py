"""Control-plane messages: round trips, strict rejection, and fuzzed decoding."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common import protocol as p
from pdserve.common.draft_kv import DraftBlocks
from pdserve.common.logprobs import Logprob, TopLogprob
from pdserve.common.sampling_params import SamplingParams

PAYLOAD = p.RequestPayload([1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=frozenset({7})))
RESUMED = p.RequestPayload([1, 2], SamplingParams(n=1, seed=3), p.Resume([8, 9], choice_index=1))
TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACED = p.RequestPayload([1, 2, 3], SamplingParams(max_tokens=4), traceparent=TP)
LP = Logprob(9, -0.5, (TopLogprob(9, -0.5), TopLogprob(4, -1.25)))

SAMPLES: list[p.Message] = [
    p.RegisterWorker("d-1", "decode", "host|boot", "shm+tcp://127.0.0.1:5", "psm_x", "abcd", 511, 16, 9000, 42),
    p.RegisterAck("d-1", False, "unknown worker"),
    p.Heartbeat("d-1", 10, 400, 511, 3, 1, {"llm_kv_cache_usage_ratio": 0.25}, steps=1234),
    p.Deregister("d-1", final=False, reason="draining"),
    p.DecodeReserve("r#1", "x1", PAYLOAD),
    p.ReserveResult("r#1", "x1", [5, 6]),
    p.ReserveResult("r#1", "x1", [], refused="full"),
    p.PrefillRequest("r#1", RESUMED),
    p.TransferTarget("r#1", "x1", "d-1", "h", "tcp://127.0.0.1:1", "", [5]),
    p.RunRequest("r#1", PAYLOAD),
    p.FirstToken("r#1", "x1", [9, 8], [None, "stop"], [LP, None], 16, {"prefill_compute": 0.1}),
    p.StartDecode("r#1", "x1", [9, 8], [LP, None]),
    p.TokenBatch("d-1", [p.TokenDelta(0, [4, 5], [LP, LP], request_id="r#1"),
                         p.TokenDelta(1, [6], None, "length", 3, request_id="r#2")]),
    p.Abort(["r#1", "r#2"], "client gone"),
    p.RequestFailed("r#1", "kv transfer failed", True, "x1"),
    p.ReserveResult("r#1", "x1", [7], cached_blocks=3),
    p.TransferTarget("r#1", "x1", "d-1", "h", "tcp://127.0.0.1:1", "", [7], 3),
    p.ReserveResult("r#1", "x1", [7], draft=DraftBlocks("tcp://127.0.0.1:2", [3, 4])),
    p.TransferTarget("r#1", "x1", "d-1", "h", "tcp://127.0.0.1:1", "", [7], 3,
                     DraftBlocks("tcp://127.0.0.1:2", [3, 4])),
    p.KvEvents("p-1", 7, [(1 << 63) - 1, 0, 12345], [99]),
    p.KvEvents("p-1", 6, [5, 6], snapshot=True),
    p.KvSnapshotRequest("p-1"),
    p.Heartbeat("d-1", 0, 400, 511, 0, 2, steps=5, received=["r#1", "r#2"], seq=7),
    p.Heartbeat("d-1", 0, 400, 511, 0, 0, received=[], seq=1),
    p.PrefillRequest("r#1", TRACED),
    p.DecodeReserve("r#1", "x1", TRACED),
    p.RunRequest("r#1", TRACED),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: p.Message) -> None:
    assert p.decode(p.encode(msg)) == msg


def test_leaves_decode_to_their_types() -> None:
    """Typed to the leaves: params, resume points and logprobs come back as dataclasses."""
    msg = p.decode(p.encode(p.PrefillRequest("r#1", RESUMED)))
    assert isinstance(msg, p.PrefillRequest) and isinstance(msg.payload.params, SamplingParams)
    assert msg.payload.params.stop_token_ids == frozenset() and msg.payload.output_token_ids == [8, 9]
    assert msg.payload.choice_index == 1 and msg.payload.num_tokens == 4
    first = p.decode(p.encode(p.FirstToken("r", "x", [9], [None], [LP])))
    assert isinstance(first, p.FirstToken) and first.logprobs[0] == LP
    assert isinstance(first.logprobs[0], Logprob) and isinstance(first.logprobs[0].top[1], TopLogprob)
    target = p.decode(p.encode(p.TransferTarget("r", "x", "d", "h", "a", "", [7], 0, DraftBlocks("b", [3]))))
    assert isinstance(target, p.TransferTarget) and isinstance(target.draft, DraftBlocks)
    with pytest.raises(p.ProtocolError):  # a draft's block ids are ints, like the target's
        p.decode(msgpack.packb([p.MAGIC, p.VERSION, "reserve_result", {
            "request_id": "r", "transfer_id": "x", "block_ids": [1], "draft": {"kv_address": "b", "block_ids": ["1"]}}]))


def _body(msg: p.Message, **changes: object) -> dict:
    return {**p.encode_fields(msg), **changes}


PAYLOAD_WIRE = p.encode_fields(p.RunRequest("r", PAYLOAD))["payload"]


def _frame(tag: object, body: object, version: object = p.VERSION, magic: object = p.MAGIC) -> bytes:
    return msgpack.packb([magic, version, tag, body], use_bin_type=True)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x00\x01garbage",
        _frame("abort", {"request_ids": ["a"]}, version=2),
        _frame("abort", {"request_ids": ["a"]}, magic="nope"),
        _frame("no_such_type", {}),
        _frame("abort", {"request_ids": ["a"], "extra": 1}),  # unknown field
        _frame("abort", {}),  # missing field
        _frame("abort", {"request_ids": "a"}),  # wrong type
        _frame("abort", {"request_ids": [1]}),
        _frame("reserve_result", {"request_id": "r", "transfer_id": "t", "block_ids": [True]}),
        _frame("kv_events", {"worker_id": "p", "seq": 1, "stored": ["deadbeef"]}),  # keys are ints
        _frame("kv_events", {"worker_id": "p", "seq": 1, "stored": [1], "evicted": [b"x"]}),
        _frame("register", {**p.encode_fields(SAMPLES[0]), "role": "attacker"}),
        _frame("tokens", {"worker_id": "w", "deltas": [{"request_id": "r"}]}),
        # Leaves deep inside a message are checked as strictly as top-level fields.
        _frame("run", {"request_id": "r", "payload": {**PAYLOAD_WIRE, "params": {"max_tokens": "4"}}}),
        _frame("run", {"request_id": "r", "payload": {**PAYLOAD_WIRE, "params": {"evil": 1}}}),
        _frame("run", {"request_id": "r", "payload": {**PAYLOAD_WIRE, "params": {"stop_token_ids": [1.5]}}}),
        _frame("run", {"request_id": "r", "payload": {**PAYLOAD_WIRE, "resume": {"output_token_ids": ["x"]}}}),
        _frame("run", {"request_id": "r", "payload": {"prompt_token_ids": [1]}}),  # params missing
        _frame("first_token", _body(p.FirstToken("r", "x", [9], [None], [LP]),
                                    logprobs=[{"token_id": 9, "logprob": -0.5, "top": [[9, -0.5]]}])),
        _frame("first_token", _body(p.FirstToken("r", "x", [9], [None], [LP]),
                                    logprobs=[{"token_id": 9, "logprob": "high"}])),
        _frame("tokens", {"worker_id": "w", "deltas": [{"index": 0, "token_ids": [1], "logprobs": [7]}]}),
        _frame("heartbeat", _body(SAMPLES[2], gauges={"kv": "full"})),
        _frame("heartbeat", _body(SAMPLES[2], received="r#1")),
        _frame("heartbeat", _body(SAMPLES[2], received=[7])),
        _frame("heartbeat", _body(SAMPLES[2], received=["r"] * (p.MAX_RECEIVED + 1))),
        _frame("heartbeat", _body(SAMPLES[2], seq="1")),
        _frame("abort", {"request_ids": ["a"], "reason": b"bytes are never accepted"}),
        msgpack.packb([p.MAGIC, p.VERSION, "abort", {"request_ids": ["a"] * (p.MAX_LIST_LEN + 1)}]),
    ],
)
def test_malformed_frames_are_rejected(frame: bytes) -> None:
    with pytest.raises(p.ProtocolError):
        p.decode(frame)


def test_an_older_workers_heartbeat_parses_without_a_received_list() -> None:
    body = {k: v for k, v in p.encode_fields(SAMPLES[2]).items() if k not in ("received", "seq")}
    hb = p.decode(_frame("heartbeat", body))
    assert isinstance(hb, p.Heartbeat) and (hb.received, hb.seq, hb.steps) == (None, 0, 1234)
    full = p.decode(_frame("heartbeat", _body(SAMPLES[2], received=["r"] * p.MAX_RECEIVED, seq=3)))
    assert isinstance(full, p.Heartbeat) and len(full.received or []) == p.MAX_RECEIVED


@pytest.mark.parametrize("tag", ["prefill", "decode_reserve", "run"])
def test_an_older_gateways_request_parses_without_a_traceparent(tag: str) -> None:
    """A gateway from before tracing sends payloads without the field: untraced work."""
    msg = next(m for m in SAMPLES if tag == m.TAG and getattr(m, "payload", None) is TRACED)
    body = p.encode_fields(msg)
    del body["payload"]["traceparent"]
    old = p.decode(_frame(tag, body))
    assert old.payload.traceparent is None  # type: ignore[attr-defined]
    assert old.payload.prompt_token_ids == [1, 2, 3]  # type: ignore[attr-defined]
    assert p.decode(p.encode(msg)).payload.traceparent == TP  # type: ignore[attr-defined]


def test_an_untraced_request_is_what_an_older_worker_parses() -> None:
    """Unset optional fields are left off the wire, so a worker from before tracing (whose
    codec refuses unknown fields) still takes an untraced request from a newer gateway."""
    body = p.encode_fields(p.PrefillRequest("r#1", PAYLOAD))
    assert "traceparent" not in body["payload"] and "resume" not in body["payload"]
    assert p.decode(_frame("prefill", body)) == p.PrefillRequest("r#1", PAYLOAD)


@pytest.mark.parametrize("bad", ["", "x", TP.upper(), "01" + TP[2:], TP[:-1], TP + "0",
                                 "00-" + "0" * 32 + TP[35:], TP[:36] + "0" * 16 + TP[52:]])
def test_a_malformed_traceparent_is_a_protocol_error(bad: str) -> None:
    body = p.encode_fields(p.RunRequest("r#1", TRACED))
    body["payload"]["traceparent"] = bad
    with pytest.raises(p.ProtocolError, match="traceparent"):
        p.decode(_frame("run", body))


def test_oversized_frame_rejected_before_unpacking() -> None:
    with pytest.raises(p.ProtocolError, match="exceeds"):
        p.decode(b"\x00" * (p.MAX_MESSAGE_BYTES + 1))


def test_declared_sizes_are_not_trusted() -> None:
    # An array header declaring 2**31 elements with no data must fail fast, allocating nothing.
    frame = b"\x94\xa4pdsv\x01\xa5abort\x81\xabrequest_ids\xdd\x7f\xff\xff\xff"
    with pytest.raises(p.ProtocolError):
        p.decode(frame)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_random_bytes_only_raise_protocol_error(data: bytes) -> None:
    with contextlib.suppress(p.ProtocolError):
        p.decode(data)


_plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=8) | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([c.TAG for c in p.MESSAGE_TYPES]), st.dictionaries(st.text(max_size=14), _plain, max_size=6))
def test_fuzz_structured_bodies_only_raise_protocol_error(tag: str, body: dict) -> None:
    try:
        msg = p.decode(_frame(tag, body))
    except p.ProtocolError:
        return
    assert p.decode(p.encode(msg)) == msg
