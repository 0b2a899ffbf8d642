"""Wire format of the KV handoff: typed control messages, msgpack-encoded.

Every message on a KV-transfer socket is one msgpack *header* frame, optionally
followed by exactly one raw tensor frame (only `Chunk` with `inline=True`).
Tensors never travel inside msgpack, and nothing is ever unpickled.

A header is the msgpack array `[WIRE_VERSION, msg_type, field, ...]`. Decoding
checks the total size first, unpacks with hard per-object limits, rejects unknown
versions and types, and type-checks every field, so a malformed or hostile header
raises `WireError` before anything is allocated from its declared sizes
(`validate_chunk` checks those against the layout).

Conversation (sender = prefill side, receiver = decode side):

    sender                              receiver
    Hello(compat_hash, liveness, parallel) ->            (liveness: see shm_pool.LivenessLock;
                                                          parallel: pdserve.common.parallel_layout)
                                <-      HelloAck(compat_hash, ok, shm pool, max frame)
    Claim(transfer, dst blocks) ->                       (once per transfer)
                                <-      Grant(transfer, deadline) | Ack(ok=False)
    Chunk(header [+ raw frame]) ->                       (any order, any number)
                                <-      Ack(transfer, ok, reason)   (all verified / failed)
    Abort(transfer, reason)     ->                       (sender gave up; stops writing)
                                <-      Cancel(transfer, reason)    (receiver gave up)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack

WIRE_VERSION = 1

MAX_HEADER_BYTES = 1 << 20
MAX_ID_LEN = 256
MAX_REASON_LEN = 1024
MAX_BLOCKS_PER_MESSAGE = 65536
MAX_DIMS = 8
# Largest tensor frame a receiver accepts unless configured otherwise.
DEFAULT_MAX_FRAME_BYTES = 64 << 20


class WireError(ValueError):
    """A message that is malformed, oversized, of unknown type or version."""


class MsgType(enum.IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    CLAIM = 3
    GRANT = 4
    CHUNK = 5
    ACK = 6
    ABORT = 7
    CANCEL = 8


@dataclass(frozen=True)
class Hello:
    compat_hash: str
    liveness: str = ""  # a same-host sender's LivenessLock name ("" if none)
    # The sender's pdserve.common.parallel_layout.ParallelLayout fields; () if it says none.
    parallel: tuple[int, ...] = ()


@dataclass(frozen=True)
class ShmDescriptor:
    """Where a receiver's pool lives in shared memory (same host only)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class HelloAck:
    compat_hash: str
    ok: bool
    reason: str
    max_frame_bytes: int
    shm: ShmDescriptor | None


@dataclass(frozen=True)
class Claim:
    """Sender asks to write into `dst_block_ids` for `transfer_id`."""

    transfer_id: str
    request_id: str
    compat_hash: str
    dst_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Grant:
    """Reservation confirmed; no write may start at or after `deadline` (CLOCK_MONOTONIC)."""

    transfer_id: str
    deadline: float


@dataclass(frozen=True)
class Chunk:
    """Layers [layer_start, layer_end) of the listed destination blocks.

    `inline`: a raw frame of `nbytes` follows, in order (layer, K/V, block in
    list order, slot, head, dim). Otherwise the sender already wrote those bytes
    into the receiver's shared-memory pool and the receiver verifies its own
    memory. `checksum` covers the bytes in that same order (see checksum.py).
    """

    transfer_id: str
    request_id: str
    compat_hash: str
    dst_block_ids: tuple[int, ...]
    layer_start: int
    layer_end: int
    nbytes: int
    checksum: int
    inline: bool


@dataclass(frozen=True)
class Ack:
    transfer_id: str
    ok: bool
    reason: str


@dataclass(frozen=True)
class Abort:
    """Sender gave up; it promises not to write this transfer's blocks again."""

    transfer_id: str
    reason: str


@dataclass(frozen=True)
class Cancel:
    """Receiver gave up on a transfer; the sender should stop and answer Abort."""

    transfer_id: str
    reason: str


Message = Hello | HelloAck | Claim | Grant | Chunk | Ack | Abort | Cancel


def _fields(msg: Message) -> tuple[MsgType, list[Any]]:
    if isinstance(msg, Hello):
        return MsgType.HELLO, [msg.compat_hash, msg.liveness, list(msg.parallel)]
    if isinstance(msg, HelloAck):
        shm = None if msg.shm is None else [msg.shm.name, list(msg.shm.shape), msg.shm.dtype]
        return MsgType.HELLO_ACK, [msg.compat_hash, msg.ok, msg.reason, msg.max_frame_bytes, shm]
    if isinstance(msg, Claim):
        return MsgType.CLAIM, [
            msg.transfer_id, msg.request_id, msg.compat_hash, list(msg.dst_block_ids)]
    if isinstance(msg, Grant):
        return MsgType.GRANT, [msg.transfer_id, float(msg.deadline)]
    if isinstance(msg, Chunk):
        return MsgType.CHUNK, [
            msg.transfer_id, msg.request_id, msg.compat_hash, list(msg.dst_block_ids),
            msg.layer_start, msg.layer_end, msg.nbytes, msg.checksum, msg.inline]
    if isinstance(msg, Ack):
        return MsgType.ACK, [msg.transfer_id, msg.ok, msg.reason]
    if isinstance(msg, Abort):
        return MsgType.ABORT, [msg.transfer_id, msg.reason]
    if isinstance(msg, Cancel):
        return MsgType.CANCEL, [msg.transfer_id, msg.reason]
    raise TypeError(f"not a wire message: {type(msg).__name__}")


def encode(msg: Message) -> bytes:
    """Serialize a message header (never a tensor)."""
    msg_type, fields = _fields(msg)
    data: bytes = msgpack.packb([WIRE_VERSION, int(msg_type), *fields], use_bin_type=True)
    if len(data) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    return data


# --- field checkers: each returns the value or raises WireError -------------------------

def _int(v: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise WireError(f"{what}: expected int in [{lo}, {hi}], got {v!r:.80}")
    return v


def _str(v: Any, what: str, max_len: int = MAX_ID_LEN) -> str:
    if type(v) is not str or len(v) > max_len:
        raise WireError(f"{what}: expected str of at most {max_len} chars")
    return v


def _bool(v: Any, what: str) -> bool:
    if type(v) is not bool:
        raise WireError(f"{what}: expected bool")
    return v


def _float(v: Any, what: str) -> float:
    if type(v) not in (float, int) or v != v:
        raise WireError(f"{what}: expected a number")
    return float(v)


def _ids(v: Any, what: str) -> tuple[int, ...]:
    if type(v) is not list or len(v) > MAX_BLOCKS_PER_MESSAGE:
        raise WireError(f"{what}: expected a list of at most {MAX_BLOCKS_PER_MESSAGE} ints")
    return tuple(_int(x, what, 0, (1 << 31) - 1) for x in v)


def _parallel(v: Any) -> tuple[int, ...]:
    if type(v) is not list or len(v) not in (0, 4):
        raise WireError("parallel: expected a list of 0 or 4 ints")
    return tuple(_int(x, "parallel", 1, 1 << 20) for x in v)


def _shm(v: Any) -> ShmDescriptor | None:
    if v is None:
        return None
    if type(v) is not list or len(v) != 3:
        raise WireError("shm: expected [name, shape, dtype]")
    shape = v[1]
    if type(shape) is not list or not 1 <= len(shape) <= MAX_DIMS:
        raise WireError("shm.shape: expected a short list of ints")
    return ShmDescriptor(
        _str(v[0], "shm.name"), tuple(_int(x, "shm.shape", 0, 1 << 40) for x in shape),
        _str(v[2], "shm.dtype", 16))


_ARITY = {
    MsgType.HELLO: 3, MsgType.HELLO_ACK: 5, MsgType.CLAIM: 4, MsgType.GRANT: 2,
    MsgType.CHUNK: 9, MsgType.ACK: 3, MsgType.ABORT: 2, MsgType.CANCEL: 2,
}


def decode(data: bytes | memoryview) -> Message:
    """Parse one header; raises WireError on anything unexpected."""
    if len(data) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(data)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        obj = msgpack.unpackb(
            data, raw=False, use_list=True, strict_map_key=True,
            max_str_len=MAX_REASON_LEN, max_bin_len=0, max_ext_len=0,
            max_array_len=MAX_BLOCKS_PER_MESSAGE, max_map_len=0)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise WireError(f"undecodable header: {type(exc).__name__}") from None
    if type(obj) is not list or len(obj) < 2:
        raise WireError("header: expected [version, type, ...]")
    if obj[0] != WIRE_VERSION or type(obj[0]) is not int:
        raise WireError(f"unsupported wire version {obj[0]!r:.40}")
    try:
        msg_type = MsgType(_int(obj[1], "type"))
    except ValueError:
        raise WireError(f"unknown message type {obj[1]!r:.40}") from None
    f = obj[2:]
    if len(f) != _ARITY[msg_type]:
        raise WireError(f"{msg_type.name}: expected {_ARITY[msg_type]} fields, got {len(f)}")
    if msg_type is MsgType.HELLO:
        return Hello(_str(f[0], "compat_hash"), _str(f[1], "liveness"), _parallel(f[2]))
    if msg_type is MsgType.HELLO_ACK:
        return HelloAck(_str(f[0], "compat_hash"), _bool(f[1], "ok"),
                        _str(f[2], "reason", MAX_REASON_LEN), _int(f[3], "max_frame_bytes"),
                        _shm(f[4]))
    if msg_type is MsgType.CLAIM:
        return Claim(_str(f[0], "transfer_id"), _str(f[1], "request_id"),
                     _str(f[2], "compat_hash"), _ids(f[3], "dst_block_ids"))
    if msg_type is MsgType.GRANT:
        return Grant(_str(f[0], "transfer_id"), _float(f[1], "deadline"))
    if msg_type is MsgType.CHUNK:
        return Chunk(_str(f[0], "transfer_id"), _str(f[1], "request_id"),
                     _str(f[2], "compat_hash"), _ids(f[3], "dst_block_ids"),
                     _int(f[4], "layer_start"), _int(f[5], "layer_end"), _int(f[6], "nbytes"),
                     _int(f[7], "checksum", 0, (1 << 64) - 1), _bool(f[8], "inline"))
    if msg_type is MsgType.ACK:
        return Ack(_str(f[0], "transfer_id"), _bool(f[1], "ok"),
                   _str(f[2], "reason", MAX_REASON_LEN))
    if msg_type is MsgType.ABORT:
        return Abort(_str(f[0], "transfer_id"), _str(f[1], "reason", MAX_REASON_LEN))
    return Cancel(_str(f[0], "transfer_id"), _str(f[1], "reason", MAX_REASON_LEN))
