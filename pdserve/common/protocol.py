"""Control-plane messages between the gateway and the workers.

Every message that crosses a process boundary on the control plane is one of
the frozen dataclasses below. On the wire a message is one msgpack frame:

    [MAGIC, VERSION, type_tag, {field: value, ...}]

Decoding checks the frame size before unpacking, unpacks with hard length
limits, rejects unknown tags, versions and fields, and checks every field's
type down to the leaves (`pdserve/common/codec.py`: nested dataclasses such as
`RequestPayload`, `SamplingParams`, `TokenDelta` and `Logprob` are checked from
their annotations), so a hostile or confused peer can only ever produce a
`ProtocolError`.
Nothing here is ever pickled. A new request is sent once in full
(`DecodeReserve`, `PrefillRequest`, `RunRequest`); afterwards only deltas
(`TokenBatch`) and small control messages travel.

Topology: the gateway binds one ZeroMQ ROUTER; each worker connects one DEALER
whose identity is its worker id. Gateway-to-worker messages are routed by that
identity, so workers need no listening control socket of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from pdserve.common.codec import WireError, from_wire, to_wire
from pdserve.common.draft_kv import DraftBlocks
from pdserve.common.logprobs import Logprob
from pdserve.common.payload import (
    RequestPayload as RequestPayload,  # re-exported: the messages carry it
)
from pdserve.common.payload import Resume as Resume
from pdserve.common.roles import (
    FLIP_ROLES as FLIP_ROLES,  # re-exported: the roles a live role flip moves between
)
from pdserve.common.roles import ROLES as ROLES
from pdserve.common.roles import Role as Role  # re-exported: RegisterWorker and SwitchRole carry it
from pdserve.common.tracing import valid_traceparent

MAGIC = "pdsv"
VERSION = 1
MAX_MESSAGE_BYTES = 32 << 20
MAX_LIST_LEN = 1 << 20  # tokens in a prompt, blocks in a reservation
MAX_MAP_LEN = 4096
MAX_STR_LEN = 1 << 16
MAX_RECEIVED = 1024  # request ids in one heartbeat (`Heartbeat.received`)



class ProtocolError(ValueError):
    """A frame that is not a well-formed message of this protocol version."""


# --- messages ---------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    TAG: ClassVar[str] = ""


@dataclass(frozen=True)
class KvTierInfo:
    """A KV tier below a worker's pool (kv_transfer/tiers), as the KV-aware router sees it
    (gateway/kv_tiers.py): workers naming the same tier share what is stored in it."""

    kind: str  # host | disk | remote (the order a worker asks them)
    location: str  # a file tier's directory (per host_id), a remote tier's server (no credentials)
    capacity_blocks: int = 0  # blocks it holds at most; 0: unknown (the server's own bound)


@dataclass(frozen=True)
class RegisterWorker(Message):
    """Worker -> gateway, once at start (and again if the gateway forgot it)."""

    TAG: ClassVar[str] = "register"
    worker_id: str
    role: Role  # a plain name is turned into its Role here
    host_id: str  # same host_id => same-host fast paths are possible
    kv_address: str  # decode: KV receiver address ("" for prefill/colocated)
    kv_shm: str  # decode: shared-memory pool descriptor ("" when none)
    compat_hash: str
    total_blocks: int
    block_size: int
    metrics_port: int
    pid: int
    quantization: str = "none"  # weight quantization served: none | int8 | int4 | awq | gptq
    kv_cache_dtype: str = ""  # the KV pool's element dtype
    lm_head_quantization: str = "none"  # the LM head's weights: none | int8
    kv_tiers: list[KvTierInfo] | None = None  # the KV tiers it reads and writes (None: none)

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))


@dataclass(frozen=True)
class RegisterAck(Message):
    """Gateway -> worker. `accepted` False: unknown worker (re-register) or refused."""

    TAG: ClassVar[str] = "register_ack"
    worker_id: str
    accepted: bool
    reason: str = ""


@dataclass(frozen=True)
class Heartbeat(Message):
    """Worker -> gateway, periodically: load for routing plus gauges to re-export.

    `steps` counts the worker's engine steps since it started: a worker that holds
    runnable work (running sequences or queued prefill tokens) and whose count stands
    still is stalled, even though its heartbeat thread is alive.

    `received`: the ids of the requests that reached the worker since heartbeat `seq - 1`
    (its load counts them, or they are gone), so the gateway drops its own estimate of
    them and keeps the one of requests still on the wire. None when the worker cannot
    say (more than `MAX_RECEIVED` arrived; an older worker): the load stands for all."""

    TAG: ClassVar[str] = "heartbeat"
    worker_id: str
    queued_prefill_tokens: int
    free_blocks: int
    total_blocks: int
    running_seqs: int
    waiting_seqs: int
    gauges: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    received: list[str] | None = None
    seq: int = 0  # numbers the worker's heartbeats from 1: a gap means one was lost
    loras: list[str] | None = None  # fingerprints of the LoRA adapters it holds (routing)


@dataclass(frozen=True)
class Deregister(Message):
    """Worker -> gateway: stop routing new requests to me (graceful shutdown).

    `final` False: draining, in-flight requests still finish here; True: gone."""

    TAG: ClassVar[str] = "deregister"
    worker_id: str
    final: bool = True
    reason: str = ""


@dataclass(frozen=True)
class DecodeReserve(Message):
    """Gateway -> decode: reserve KV blocks for a prompt that will arrive by transfer."""

    TAG: ClassVar[str] = "decode_reserve"
    request_id: str
    transfer_id: str
    payload: RequestPayload


@dataclass(frozen=True)
class ReserveResult(Message):
    """Decode -> gateway: destination block ids, or a refusal."""

    TAG: ClassVar[str] = "reserve_result"
    request_id: str
    transfer_id: str
    block_ids: list[int]  # the blocks the KV is written into
    refused: str = ""  # non-empty: why nothing was reserved
    cached_blocks: int = 0  # leading prompt blocks decode already holds: not shipped
    draft: DraftBlocks | None = None  # draft_kv=prefill: where the draft's KV goes

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
    payload: RequestPayload


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
    skip_blocks: int = 0  # the prompt's first blocks decode holds already: ship from this one on
    draft: DraftBlocks | None = None  # ReserveResult.draft, passed on


@dataclass(frozen=True)
class RunRequest(Message):
    """Gateway -> colocated worker: run a whole request (prefill and decode)."""

    TAG: ClassVar[str] = "run"
    request_id: str
    payload: RequestPayload


@dataclass(frozen=True)
class FirstToken(Message):
    """Prefill -> gateway: the first sampled token of each choice (TTFT)."""

    TAG: ClassVar[str] = "first_token"
    request_id: str
    transfer_id: str
    token_ids: list[int]  # one per choice
    finish_reasons: list[str | None]  # one per choice
    logprobs: list[Logprob | None]  # one entry per choice (None when not requested)
    cached_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds
    # params.prompt_logprobs: one entry per prompt token (None at position 0), computed
    # here where the prompt was; None when not requested.
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass(frozen=True)
class StartDecode(Message):
    """Gateway -> decode: the first tokens; admit once the KV transfer is complete."""

    TAG: ClassVar[str] = "start_decode"
    request_id: str
    transfer_id: str
    token_ids: list[int]
    logprobs: list[Logprob | None]  # one entry per choice, as in `FirstToken`


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one choice: an entry of a `TokenBatch` on the wire, and the event
    the gateway's backend yields to its HTTP layer (there `request_id` is left empty).

    `logprobs` is None or one entry per token of `token_ids`; `finish_reason` is set on
    the choice's last delta ("stop" or "length"); `timings` carries worker-measured
    stage durations in seconds (see gateway/backend.py). `prompt_logprobs` rides on
    the first delta of a worker that computed the prompt (params.prompt_logprobs), as
    in `FirstToken`."""

    index: int
    token_ids: list[int]
    logprobs: list[Logprob] | None = None
    finish_reason: str | None = None
    cached_tokens: int = 0
    timings: dict[str, float] | None = None
    request_id: str = ""  # the worker-side request id
    prompt_logprobs: list[Logprob | None] | None = None


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


@dataclass(frozen=True)
class KvEvents(Message):
    """Worker -> every gateway, at most once per tick: prefix-cache block keys
    (pdserve/common/block_hash.py) stored and evicted since the previous batch. `seq` numbers the
    batches; a gateway that sees a gap asks for a snapshot. `snapshot`: `stored` is the
    whole cache as of batch `seq` (to one gateway: on registration, or when asked)."""

    TAG: ClassVar[str] = "kv_events"
    worker_id: str
    seq: int
    stored: list[int]
    evicted: list[int] = field(default_factory=list)
    snapshot: bool = False


@dataclass(frozen=True)
class KvSnapshotRequest(Message):
    """Gateway -> worker: its `KvEvents` had a gap; send a snapshot."""

    TAG: ClassVar[str] = "kv_snapshot_request"
    worker_id: str


@dataclass(frozen=True)
class SwitchRole(Message):
    """Gateway -> worker (admin call or planner): drain, then serve as `role` (prefill or
    decode) under the same worker id, and register again. The gateway stops routing to the
    worker before it sends this, so every request it routed there arrives first."""

    TAG: ClassVar[str] = "switch_role"
    worker_id: str
    role: Role

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role(self.role))


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
    KvEvents,
    KvSnapshotRequest,
    SwitchRole,
)
_BY_TAG: dict[str, type[Message]] = {cls.TAG: cls for cls in MESSAGE_TYPES}


# --- encode / decode --------------------------------------------------------


def encode_fields(msg: Message) -> dict[str, Any]:
    """The message body as plain msgpack-native data."""
    body: dict[str, Any] = to_wire(msg)
    return body


def encode(msg: Message) -> bytes:
    """One msgpack frame for `msg`."""
    data: bytes = msgpack.packb([MAGIC, VERSION, msg.TAG, encode_fields(msg)], use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"{msg.TAG} message of {len(data)} bytes exceeds the cap")
    return data


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
    try:
        msg: Message = from_wire(cls, body, tag)
    except WireError as e:
        raise ProtocolError(str(e)) from None
    except (TypeError, ValueError) as e:  # a field's own constructor refused the value
        raise ProtocolError(f"{tag}: {type(e).__name__}") from None
    if isinstance(msg, Heartbeat) and msg.received is not None and len(msg.received) > MAX_RECEIVED:
        raise ProtocolError(f"heartbeat lists {len(msg.received)} received requests (at most {MAX_RECEIVED})")
    payload = getattr(msg, "payload", None)
    if isinstance(payload, RequestPayload) and payload.traceparent is not None \
            and not valid_traceparent(payload.traceparent):
        raise ProtocolError(f"{tag}: payload.traceparent is not a W3C traceparent")
    if isinstance(msg, SwitchRole) and msg.role not in FLIP_ROLES:
        raise ProtocolError(f"cannot switch to role {msg.role.value!r}")
    return msg
