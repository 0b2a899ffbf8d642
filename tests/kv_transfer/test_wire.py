"""Wire format: round trips, and hostile input rejected without allocation or crash."""

from __future__ import annotations

import contextlib
import time
import tracemalloc

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kv_transfer import wire
from kv_transfer.api import TransferState
from kv_transfer.faults import FaultConfig
from kv_transfer.receiver.core import ReceiverCore
from kv_transfer.receiver.receiver import ZmqReceiver
from tests.kv_transfer.harness import TINY, make_pair, same_bytes, wait_terminal

ids = st.text(max_size=40)
blocks = st.lists(st.integers(0, (1 << 31) - 1), max_size=50).map(tuple)
u64 = st.integers(0, (1 << 64) - 1)
nat = st.integers(0, 1 << 40)
shm = st.none() | st.builds(wire.ShmDescriptor, ids,
                            st.lists(st.integers(0, 1 << 30), min_size=1, max_size=6).map(tuple),
                            st.sampled_from(["float16", "float32"]))
messages = st.one_of(
    st.builds(wire.Hello, ids),
    st.builds(wire.HelloAck, ids, st.booleans(), ids, nat, shm),
    st.builds(wire.Claim, ids, ids, ids, blocks),
    st.builds(wire.Grant, ids, st.floats(allow_nan=False, allow_infinity=False)),
    st.builds(wire.Chunk, ids, ids, ids, blocks, nat, nat, nat, u64, st.booleans()),
    st.builds(wire.Ack, ids, st.booleans(), ids),
    st.builds(wire.Abort, ids, ids),
    st.builds(wire.Cancel, ids, ids),
)


@settings(deadline=None)  # a loaded CI machine must not turn slowness into failures
@given(messages)
def test_every_message_round_trips(msg: wire.Message) -> None:
    assert wire.decode(wire.encode(msg)) == msg


@settings(deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_wire_error(data: bytes) -> None:
    with contextlib.suppress(wire.WireError):
        wire.decode(data)


@settings(deadline=None)
@given(messages, st.data())
def test_truncated_or_mutated_headers_only_raise_wire_error(msg: wire.Message,
                                                           data: st.DataObject) -> None:
    raw = bytearray(wire.encode(msg))
    cut = data.draw(st.integers(0, len(raw)))
    mutated = bytes(raw[:cut])
    if raw and data.draw(st.booleans()):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
        mutated = bytes(raw)
    try:
        decoded = wire.decode(mutated)
    except wire.WireError:
        return
    assert type(decoded) in wire.Message.__args__  # type: ignore[attr-defined]


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=6), max_leaves=30)


@settings(deadline=None)
@given(st.integers(0, 12), st.lists(json_like, max_size=10))
def test_wrong_field_types_are_rejected(msg_type: int, fields: list) -> None:
    raw = msgpack.packb([wire.WIRE_VERSION, msg_type, *fields])
    try:
        msg = wire.decode(raw)
    except wire.WireError:
        return
    assert wire.decode(wire.encode(msg)) == msg  # whatever passed is a well-formed message


def test_unknown_type_version_and_oversize_are_rejected() -> None:
    good = wire.encode(wire.Hello("abc"))
    with pytest.raises(wire.WireError, match="unknown message type"):
        wire.decode(msgpack.packb([wire.WIRE_VERSION, 99, "abc"]))
    with pytest.raises(wire.WireError, match="version"):
        wire.decode(msgpack.packb([wire.WIRE_VERSION + 1, 1, "abc"]))
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.decode(good + b"\0" * wire.MAX_HEADER_BYTES)
    with pytest.raises(wire.WireError):  # a bool is not an int
        wire.decode(msgpack.packb([wire.WIRE_VERSION, int(wire.MsgType.GRANT), "t", True]))
    with pytest.raises(wire.WireError):  # a 4 GiB string length prefix with no data
        wire.decode(b"\x93\x01\x01\xdb\xff\xff\xff\xff")
    with pytest.raises(wire.WireError):  # a 4-billion-element array prefix
        wire.decode(b"\xdd\xff\xff\xff\xff")


def _core() -> ReceiverCore:
    pool = np.zeros(TINY.pool_shape(16), np.float16)
    return ReceiverCore(TINY, pool, shm=None, grace_s=0.1, max_frame_bytes=1 << 20,
                        faults=FaultConfig(), wake=lambda: None)


def _chunk(**over: object) -> wire.Chunk:
    base = dict(transfer_id="t", request_id="r", compat_hash=TINY.compat_hash,
                dst_block_ids=(3,), layer_start=0, layer_end=1,
                nbytes=TINY.block_bytes_per_layer, checksum=0, inline=True)
    base.update(over)
    return wire.Chunk(**base)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 1 << 40), st.integers(-2, 5), st.integers(-2, 6),
       st.lists(st.integers(0, 40), max_size=8))
def test_declared_sizes_are_checked_before_any_allocation(nbytes: int, l0: int, l1: int,
                                                          dst: list[int]) -> None:
    core = _core()
    core.expect("t", "r", [3, 4], lease_s=10)
    core.handle(b"p", wire.encode(wire.Claim("t", "r", TINY.compat_hash, (3, 4))), None)
    header = msgpack.packb([wire.WIRE_VERSION, int(wire.MsgType.CHUNK), "t", "r",
                            TINY.compat_hash, dst, l0, l1, nbytes, 0, True])
    tracemalloc.start()
    core.handle(b"p", header, memoryview(b"\0" * 64))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20  # nothing near the declared size was allocated
    assert not core.pool.any()
    assert core.stats().rejected + core.stats().malformed >= 1


def test_huge_declared_chunk_rejected_and_counted() -> None:
    core = _core()
    core.expect("t", "r", [3], lease_s=10)
    core.handle(b"p", wire.encode(wire.Claim("t", "r", TINY.compat_hash, (3,))), None)
    tracemalloc.start()
    core.handle(b"p", wire.encode(_chunk(nbytes=10 << 30)), memoryview(b"\0" * 16))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20
    assert core.stats().rejected == 1
    assert core.poll("t") is TransferState.FAILED
    assert "declared" in core.reason("t")


def test_chunks_outside_the_reservation_are_never_written() -> None:
    core = _core()
    core.expect("t", "r", [3], lease_s=10)
    frame = np.ones(TINY.block_bytes_per_layer, np.uint8).data
    core.handle(b"p", wire.encode(_chunk()), frame)  # no grant yet: refused
    assert core.stats().rejected == 1 and not core.pool.any()
    core.handle(b"p", wire.encode(wire.Claim("t", "r", TINY.compat_hash, (3,))), None)
    core.handle(b"q", wire.encode(_chunk()), frame)  # a sender without the grant
    core.handle(b"p", wire.encode(_chunk(dst_block_ids=(5,))), frame)  # unreserved block
    core.handle(b"p", wire.encode(_chunk(transfer_id="zz")), frame)  # unknown transfer
    assert core.stats().rejected == 4
    assert not core.pool.any()


def test_garbage_on_the_socket_does_not_kill_the_receiver() -> None:
    pair = make_pair("tcp")
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    try:
        rogue.connect(pair.receiver.address)
        rogue.send(b"\xc1garbage")
        rogue.send_multipart([b"\x93", b"x", b"y", b"z"])
        rogue.send(msgpack.packb([wire.WIRE_VERSION, 42]))
        rogue.send(wire.encode(_chunk(nbytes=10 << 30)))
        end = time.monotonic() + 5
        receiver = pair.receiver
        assert isinstance(receiver, ZmqReceiver)
        while receiver.stats().malformed < 3 and time.monotonic() < end:
            time.sleep(0.01)
        assert receiver.stats().malformed == 3
        receiver.expect("t", "r", [2], lease_s=10)
        pair.sender.begin("t", "r", receiver.address, [1], [2], lease_s=10)
        pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.COMPLETE
        assert same_bytes(pair.dst[:, :, [2]], pair.src[:, :, [1]])
    finally:
        rogue.close(linger=0)
        ctx.term()
        pair.close()
