"""What a KV peer can make the decode receiver hold: descriptors on liveness locks are
capped, released once their holder goes, and the pool's name and shape are told only
to a sender that names a live lock. Real ZeroMQ sockets, real lock files."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from kv_transfer import wire
from kv_transfer.links import ZmqLink
from kv_transfer.liveness_table import DEFAULT_CAPACITY, LivenessTable
from kv_transfer.pool.shm import LivenessLock, create_shm_pool
from kv_transfer.receiver.receiver import ZmqReceiver
from pdserve.common import protocol
from tests.kv_transfer.harness import TINY

HELLOS = 3000
BATCH = 100  # peers connected at once; each sends one Hello and goes


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _ack(sock: zmq.Socket[Any]) -> wire.HelloAck:
    assert sock.poll(10_000), "no HelloAck"
    msg = wire.decode(sock.recv())
    assert isinstance(msg, wire.HelloAck)
    return msg


def test_3000_hellos_naming_a_live_lock_hold_at_most_the_cap_and_release_it() -> None:
    lock = LivenessLock()
    pool = create_shm_pool(TINY, 8)
    receiver = ZmqReceiver(TINY, pool, transport="shm")
    endpoint = receiver.address.partition("+")[2]
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        baseline = _open_fds()
        for start in range(0, HELLOS, BATCH):
            socks = [ctx.socket(zmq.DEALER) for _ in range(BATCH)]
            for s in socks:
                s.setsockopt(zmq.LINGER, 0)
                s.connect(endpoint)
                s.send(wire.encode(wire.Hello(TINY.compat_hash, lock.name)))
            acks = [_ack(s) for s in socks]
            assert all(a.ok and a.shm is not None for a in acks[-1:])  # the newest always gets in
            for s in socks:
                s.close()
            assert receiver.core.liveness_fds() <= DEFAULT_CAPACITY, start
        # Before the fix every Hello left one descriptor open: 3,000 here. The peers'
        # connections close asynchronously (both ends live in this process): wait for them.
        _wait(lambda: _open_fds() - baseline <= DEFAULT_CAPACITY + 16, "connections closed")
        lock.close()  # the "sender" goes: its lock is released
        _wait(lambda: receiver.core.liveness_fds() == 0, "descriptors swept")  # once a second
        _wait(lambda: _open_fds() - baseline <= 16, "no descriptor left")
    finally:
        ctx.destroy(linger=0)
        receiver.close()
        pool.close()
        lock.close()


def test_the_pool_is_named_only_to_a_sender_that_proves_a_live_lock() -> None:
    pool = create_shm_pool(TINY, 8)
    receiver = ZmqReceiver(TINY, pool, transport="shm")
    endpoint = receiver.address.partition("+")[2]
    ctx: zmq.Context[Any] = zmq.Context()
    lock = LivenessLock()
    try:
        asks: list[tuple[str, str, bool]] = [
            ("bogus-hash", lock.name, False),  # wrong compatibility hash: nothing at all
            (TINY.compat_hash, "", False),  # no lock: no pool (its KV travels as frames)
            (TINY.compat_hash, "pdkvlive_1_00", False),  # a lock nobody holds
            (TINY.compat_hash, lock.name, True),
        ]
        for compat, liveness, told in asks:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            s.send(wire.encode(wire.Hello(compat, liveness)))
            ack = _ack(s)
            assert (ack.shm is not None) is told, (compat, liveness, ack)
            if compat != TINY.compat_hash:
                assert not ack.ok and ack.compat_hash == "" and ack.max_frame_bytes == 0
            s.close()
    finally:
        ctx.destroy(linger=0)
        receiver.close()
        pool.close()
        lock.close()


class _Fds:
    """A fake `watch` that opens a real descriptor per call (on /dev/null)."""

    def __init__(self) -> None:
        self.opened: list[int] = []

    def __call__(self, name: str) -> int | None:
        fd = os.open(os.devnull, os.O_RDONLY)
        self.opened.append(fd)
        return fd


def test_table_evicts_the_oldest_unused_entry_and_never_one_in_use() -> None:
    fds = _Fds()
    table = LivenessTable(capacity=2, watch=fds)
    assert table.watch(b"a", "x", set()) and table.watch(b"b", "x", set())
    assert table.watch(b"c", "x", set())  # a is evicted (oldest, unused)
    with pytest.raises(OSError):
        os.fstat(fds.opened[0])  # its descriptor is closed
    assert len(table) == 2
    assert not table.watch(b"d", "x", {b"b", b"c"})  # every entry in use: the newcomer gets none
    with pytest.raises(OSError):
        os.fstat(fds.opened[3])
    assert table.watch(b"b", "x", {b"b", b"c"})  # a peer's new Hello replaces its own entry
    assert len(table) == 2
    table.close()
    assert len(table) == 0


def test_every_receiving_socket_caps_its_message_size() -> None:
    """MAXMSGSIZE on the KV receiver, the sender's link and the worker's control channel."""
    from pdserve.common.transport import WorkerChannel

    pool = create_shm_pool(TINY, 8)
    receiver = ZmqReceiver(TINY, pool, transport="shm")
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        assert receiver._sock.getsockopt(zmq.MAXMSGSIZE) == wire.DEFAULT_MAX_FRAME_BYTES + wire.MAX_HEADER_BYTES
        link = ZmqLink(ctx, receiver.address.partition("+")[2])
        assert link.socket.getsockopt(zmq.MAXMSGSIZE) == wire.MAX_HEADER_BYTES
        link.close()
        channel = WorkerChannel("tcp://127.0.0.1:9", "w-test")
        assert channel.socket.getsockopt(zmq.MAXMSGSIZE) == protocol.MAX_MESSAGE_BYTES
        channel.close()
    finally:
        ctx.destroy(linger=0)
        receiver.close()
        pool.close()
