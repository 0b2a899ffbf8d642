"""Control-plane messages between the gateway and the workers.

Every message that crosses a process boundary on the control plane is one of
the frozen dataclasses below. On the wire a message is one msgpack frame:

    [MAGIC, VERSION, type_tag, {field: value, ...}]

Decoding checks the frame size before unpacking, unpacks with hard length
limits, rejects unknown tags, versions and fields, and checks every field's
type, so a hostile or confused peer can only ever produce a `ProtocolError`.
Nothing here is ever pickled. A new request is sent once in full
(`DecodeReserve`, `PrefillRequest`, `RunRequest`); afterwards only deltas
(`TokenBatch`) and small control messages travel.

Topology: the gateway binds one ZeroMQ ROUTER; each worker connects one DEALER
whose identity is its worker id. Gateway-to-worker messages are routed by that
identity, so workers need no listening control socket of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

MAGIC = "pdsv"
VERSION = 1
MAX_MESSAGE_BYTES = 32 << 20
MAX_LIST_LEN = 1 << 20  # tokens in a prompt, blocks in a reservation
MAX_MAP_LEN = 4096
MAX_STR_LEN = 1 << 16

ROLES = ("prefill", "decode", "colocated")


class ProtocolError(ValueError):
    """A frame that is not a well-formed message of this protocol version."""


# --- field checkers ---------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_list(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(x) for x in v)


def _str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _opt_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(x is None or isinstance(x, str) for x in v)


def _int_list_list(v: Any) -> bool:
    return isinstance(v, list) and all(_int_list(x) for x in v)


def _plain(v: Any, depth: int = 0) -> bool:
    """msgpack-native data (no bytes), bounded nesting: logprobs, params, gauges."""
    if depth > 6:
        return False
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    if isinstance(v, list):
        return all(_plain(x, depth + 1) for x in v)
    if isinstance(v, dict):
        return all(isinstance(k, str) and _plain(x, depth + 1) for k, x in v.items())
    return False


_CHECKS: dict[str, Any] = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "float": _is_num,
    "bool": lambda v: isinstance(v, bool),
    "list[int]": _int_list,
    "list[str]": _str_list,
    "list[str | None]": _opt_str_list,
    "list[list[int]]": _int_list_list,
    "dict[str, Any]": lambda v: isinstance(v, dict) and _plain(v),
    "dict[str, float]": lambda v: isinstance(v, dict)
    and all(isinstance(k, str) and _is_num(x) for k, x in v.items()),
    "Any": _plain,
    "list[Any]": lambda v: isinstance(v, list) and _plain(v),
}


# --- messages ---------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    TAG: ClassVar[str] = ""


@dataclass(frozen=True)
class RegisterWorker(Message):
    """Worker -> gateway, once at start (and again if the gateway forgot it)."""

    TAG: ClassVar[str] = "register"
    worker_id: str
    role: str  # prefill | decode | colocated
    host_id: str  # same host_id => same-host fast paths are possible
    kv_address: str  # decode: KV receiver address ("" for prefill/colocated)
    kv_shm: str  # decode: shared-memory pool descriptor ("" when none)
    compat_hash: str
    total_blocks: int
    block_size: int
    metrics_port: int
    pid: int


@dataclass(frozen=True)
class RegisterAck(Message):
    """Gateway -> worker. `accepted` False: unknown worker (re-register) or refused."""

    TAG: ClassVar[str] = "register_ack"
    worker_id: str
    accepted: bool
    reason: str = ""


@dataclass(frozen=True)
class Heartbeat(Message):
    """Worker -> gateway, periodically: load for routing plus gauges to re-export."""

    TAG: ClassVar[str] = "heartbeat"
    worker_id: str
    queued_prefill_tokens: int
    free_blocks: int
    total_blocks: int
    running_seqs: int
    waiting_seqs: int
    gauges: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Deregister(Message):
    """Worker -> gateway: stop routing new requests to me (graceful shutdown).

    `final` False: draining, in-flight requests still finish here; True: gone."""

    TAG: ClassVar[str] = "deregister"
    worker_id: str
    final: bool = True
    reason: str = ""


def split_resumed(token_ids: list[int], output_offset: int) -> tuple[list[int], list[int]]:
    """(prompt, output tokens already produced) of a request message's token ids.

    A recovered request continues where its stream stopped: those outputs are
    prefilled with the prompt but stay *output* to the engine, so sampling seeds
    (seed, choice, index) and presence/frequency penalties continue exactly."""
    if output_offset < 0 or (output_offset and output_offset >= len(token_ids)):
        raise ValueError(f"output_offset {output_offset} outside [0, {len(token_ids)})")
    cut = len(token_ids) - output_offset
    return list(token_ids[:cut]), list(token_ids[cut:])


@dataclass(frozen=True)
class DecodeReserve(Message):
    """Gateway -> decode: reserve KV blocks for a prompt that will arrive by transfer.

    Recovery (see `split_resumed`): the last `output_offset` of `prompt_token_ids`
    are output tokens choice `choice_index` already produced."""

    TAG: ClassVar[str] = "decode_reserve"
    request_id: str
    transfer_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    output_offset: int = 0
    choice_index: int = 0


@dataclass(frozen=True)
class ReserveResult(Message):
    """Decode -> gateway: destination block ids, or a refusal."""

    TAG: ClassVar[str] = "reserve_result"
    request_id: str
    transfer_id: str
    block_ids: list[int]
    refused: str = ""  # non-empty: why nothing was reserved

    @property
    def ok(self) -> bool:
        return not self.refused


@dataclass(frozen=True)
class PrefillRequest(Message):
    """Gateway -> prefill: compute the prompt and sample the first token(s). Sent at
    the same time as the decode reservation, so reserving overlaps computing; the
    KV is pushed only once the matching `TransferTarget` has arrived."""

    TAG: ClassVar[str] = "prefill"
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    output_offset: int = 0  # recovery, as in `DecodeReserve`
    choice_index: int = 0


@dataclass(frozen=True)
class TransferTarget(Message):
    """Gateway -> prefill: blocks reserved at decode worker `target_worker`; push the KV there."""

    TAG: ClassVar[str] = "transfer_target"
    request_id: str
    transfer_id: str
    target_worker: str
    target_host_id: str
    target_kv_address: str
    target_kv_shm: str
    dst_block_ids: list[int]


@dataclass(frozen=True)
class RunRequest(Message):
    """Gateway -> colocated worker: run a whole request (prefill and decode)."""

    TAG: ClassVar[str] = "run"
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    output_offset: int = 0  # recovery, as in `DecodeReserve`
    choice_index: int = 0


@dataclass(frozen=True)
class FirstToken(Message):
    """Prefill -> gateway: the first sampled token of each choice (TTFT)."""

    TAG: ClassVar[str] = "first_token"
    request_id: str
    transfer_id: str
    token_ids: list[int]  # one per choice
    finish_reasons: list[str | None]  # one per choice
    logprobs: list[Any]  # one entry per choice (None when not requested)
    cached_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds


@dataclass(frozen=True)
class StartDecode(Message):
    """Gateway -> decode: the first tokens; admit once the KV transfer is complete."""

    TAG: ClassVar[str] = "start_decode"
    request_id: str
    transfer_id: str
    token_ids: list[int]
    logprobs: list[Any]


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one choice since the last batch (not a message on its own).

    `logprobs` is None or one entry per token: [token_id, logprob, [[id, logprob], ...]]."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: Any = None
    finish_reason: str | None = None
    cached_tokens: int = 0
    timings: dict[str, float] | None = None


@dataclass(frozen=True)
class TokenBatch(Message):
    """Decode/colocated -> gateway: every token produced by one engine step."""

    TAG: ClassVar[str] = "tokens"
    worker_id: str
    deltas: list[TokenDelta]


@dataclass(frozen=True)
class Abort(Message):
    """Gateway -> worker: drop these requests from every queue, transfer and batch."""

    TAG: ClassVar[str] = "abort"
    request_ids: list[str]
    reason: str = ""


@dataclass(frozen=True)
class RequestFailed(Message):
    """Worker -> gateway: a request failed here; `retryable` lets the gateway re-route."""

    TAG: ClassVar[str] = "failed"
    request_id: str
    reason: str
    retryable: bool = True
    transfer_id: str = ""


MESSAGE_TYPES: tuple[type[Message], ...] = (
    RegisterWorker,
    RegisterAck,
    Heartbeat,
    Deregister,
    DecodeReserve,
    ReserveResult,
    PrefillRequest,
    TransferTarget,
    RunRequest,
    FirstToken,
    StartDecode,
    TokenBatch,
    Abort,
    RequestFailed,
)
_BY_TAG: dict[str, type[Message]] = {cls.TAG: cls for cls in MESSAGE_TYPES}
_DELTA_FIELDS = {f.name: str(f.type) for f in fields(TokenDelta)}


# --- encode / decode --------------------------------------------------------


def _delta_to_dict(d: TokenDelta) -> dict[str, Any]:
    return {
        "request_id": d.request_id,
        "index": d.index,
        "token_ids": list(d.token_ids),
        "logprobs": d.logprobs,
        "finish_reason": d.finish_reason,
        "cached_tokens": d.cached_tokens,
        "timings": d.timings,
    }


def encode_fields(msg: Message) -> dict[str, Any]:
    """The message body as plain msgpack-native data."""
    body: dict[str, Any] = {}
    for f in fields(msg):
        v = getattr(msg, f.name)
        if isinstance(msg, TokenBatch) and f.name == "deltas":
            v = [_delta_to_dict(d) for d in v]
        body[f.name] = v
    return body


def encode(msg: Message) -> bytes:
    """One msgpack frame for `msg`."""
    data: bytes = msgpack.packb([MAGIC, VERSION, msg.TAG, encode_fields(msg)], use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{msg.TAG} message of {len(data)} bytes exceeds the cap")
    return data


def _check_fields(name: str, spec: dict[str, str], required: set[str], body: Any) -> None:
    if not isinstance(body, dict):
        raise ProtocolError(f"{name}: body is not a map")
    unknown = set(body) - set(spec)
    if unknown:
        raise ProtocolError(f"{name}: unknown field {sorted(map(str, unknown))[0]!r}")
    missing = required - set(body)
    if missing:
        raise ProtocolError(f"{name}: missing field {sorted(missing)[0]!r}")
    for key, value in body.items():
        type_name = spec[key]
        nullable = type_name.endswith(" | None")
        base = type_name.removesuffix(" | None")
        if value is None and nullable:
            continue
        if not _CHECKS[base](value):
            raise ProtocolError(f"{name}: field {key!r} is not {type_name}")


def _required(cls: type) -> set[str]:
    from dataclasses import MISSING

    return {
        f.name
        for f in fields(cls)
        if f.default is MISSING and f.default_factory is MISSING  # type: ignore[misc]
    }


_SPECS: dict[str, tuple[dict[str, str], set[str]]] = {
    cls.TAG: (
        {f.name: ("list[TokenDelta]" if f.name == "deltas" else str(f.type)) for f in fields(cls)},
        _required(cls),
    )
    for cls in MESSAGE_TYPES
}
_CHECKS["list[TokenDelta]"] = lambda v: isinstance(v, list)
_DELTA_REQUIRED = _required(TokenDelta)


def decode(data: bytes) -> Message:
    """Parse one frame into a typed message or raise ProtocolError (never anything else)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError("frame is not bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds the cap")
    try:
        obj = msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_STR_LEN,
            max_bin_len=0,
            max_array_len=MAX_LIST_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several unrelated types
        raise ProtocolError(f"undecodable frame: {type(e).__name__}") from None
    if not isinstance(obj, list) or len(obj) != 4 or obj[0] != MAGIC:
        raise ProtocolError("not a pdserve control message")
    if obj[1] != VERSION:
        raise ProtocolError(f"unsupported protocol version {obj[1]!r}")
    tag, body = obj[2], obj[3]
    cls = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {str(tag)[:40]!r}")
    spec, required = _SPECS[tag]
    _check_fields(tag, spec, required, body)
    if cls is TokenBatch:
        deltas = []
        for d in body["deltas"]:
            _check_fields("token delta", _DELTA_FIELDS, _DELTA_REQUIRED, d)
            deltas.append(TokenDelta(**d))
        body = {**body, "deltas": deltas}
    if cls is RegisterWorker and body["role"] not in ROLES:
        raise ProtocolError(f"unknown role {body['role'][:20]!r}")
    return cls(**body)
