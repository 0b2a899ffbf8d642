"""Trust on the KV plane: CURVE between sender and receiver, a refused handshake that
reveals nothing, pending claims bounded per peer, owner-only shared memory."""

from __future__ import annotations

import argparse
import os
import stat
import threading
from collections.abc import Iterator
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from kv_transfer import wire
from kv_transfer.api import TransferState
from kv_transfer.auth import CurveKeys, KVCurve, load_keys, split_address
from kv_transfer.faults import FaultConfig
from kv_transfer.links import ZmqLinkFactory
from kv_transfer.pool.shm import create_shm_pool
from kv_transfer.receiver.core import ReceiverCore, ReceiverStats
from kv_transfer.receiver.pending_claims import MAX_PENDING_CLAIMS, MAX_PENDING_CLAIMS_PER_PEER
from kv_transfer.receiver.receiver import ZmqReceiver
from kv_transfer.sender.sender import Sender
from tests.kv_transfer.harness import TINY, random_pool, same_bytes, wait_terminal

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@pytest.fixture
def certs(tmp_path: Path) -> dict[str, Any]:
    """Certificates of two workers in an authorized directory, and one rogue outside it."""
    allowed, rogue_dir = tmp_path / "authorized", tmp_path / "rogue"
    allowed.mkdir()
    rogue_dir.mkdir()
    out: dict[str, Any] = {"dir": str(allowed)}
    for name in ("decode", "prefill"):
        _, secret = zmq.auth.create_certificates(str(allowed), name)
        out[name] = load_keys(KVCurve(secret, str(allowed)))
    _, rogue_secret = zmq.auth.create_certificates(str(rogue_dir), "rogue")
    out["rogue"] = load_keys(KVCurve(rogue_secret, str(rogue_dir)))
    return out


@pytest.fixture
def curve_receiver(certs: dict[str, Any]) -> Iterator[ZmqReceiver]:
    dst = np.zeros(TINY.pool_shape(16), np.float16)
    with ZmqReceiver(TINY, dst, transport="tcp", curve=certs["decode"]) as r:
        yield r


def dealer(ctx: zmq.Context[Any], endpoint: str, curve: CurveKeys | None = None,
           server: bytes | None = None) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None and server is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve.public, curve.secret, server
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
    sock.connect(endpoint)
    return sock, monitor


def handshake_event(monitor: zmq.Socket[Any], timeout_ms: int = 10_000) -> int:
    assert monitor.poll(timeout_ms), "no handshake outcome"
    return int(recv_monitor_message(monitor)["event"])


def transfer(sender: Sender, receiver: ZmqReceiver, tid: str, dst: tuple[int, int] = (3, 4)) -> TransferState:
    receiver.expect(tid, "req", dst, lease_s=20)
    sender.begin(tid, "req", receiver.address, [1, 2], dst, lease_s=20)
    sender.send_all(tid)
    return wait_terminal(sender.poll, tid)


def test_curve_transfer_between_authorized_workers(certs: dict[str, Any],
                                                   curve_receiver: ZmqReceiver) -> None:
    endpoint, key = split_address(curve_receiver.address)
    assert endpoint.startswith("tcp://127.0.0.1:") and key == certs["decode"].public
    src = random_pool(TINY, 8, seed=3)
    with Sender(TINY, src, links=ZmqLinkFactory(certs["prefill"])) as sender:
        assert transfer(sender, curve_receiver, "t") is TransferState.COMPLETE
        assert wait_terminal(curve_receiver.poll, "t") is TransferState.COMPLETE
        assert same_bytes(curve_receiver.core.pool[:, :, [3, 4]], src[:, :, [1, 2]])


@pytest.mark.parametrize("who", ["plain", "rogue"])
def test_unauthenticated_kv_client_gets_nothing_accepted(certs: dict[str, Any], curve_receiver: ZmqReceiver,
                                                         who: str) -> None:
    endpoint, server = split_address(curve_receiver.address)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sock, monitor = dealer(ctx, endpoint, certs["rogue"] if who == "rogue" else None, server)
        sock.send(wire.encode(wire.Hello(TINY.compat_hash)))
        sock.send(wire.encode(wire.Claim("t0", "req", TINY.compat_hash, (3,))))
        event = handshake_event(monitor)
        assert event & HANDSHAKE_FAILED, f"handshake event {event}"
        assert sock.poll(0) == 0  # no HelloAck, no Ack: not a byte came back
        curve_receiver.expect("t0", "req", [3], lease_s=20)
        assert curve_receiver.poll("t0") is TransferState.RESERVED  # the claim never arrived
        assert curve_receiver.stats() == ReceiverStats(0, 0, 0)
        curve_receiver.cancel("t0")
        curve_receiver.forget("t0")
    finally:
        ctx.destroy(linger=0)  # closes every socket, also after a failed assert
    # and the receiver keeps serving authorized senders
    with Sender(TINY, random_pool(TINY, 8, seed=4), links=ZmqLinkFactory(certs["prefill"])) as sender:
        assert transfer(sender, curve_receiver, "t1") is TransferState.COMPLETE


def test_sender_refuses_plain_receivers_and_unauthorized_keys(certs: dict[str, Any],
                                                             curve_receiver: ZmqReceiver) -> None:
    src = random_pool(TINY, 8, seed=5)
    dst = np.zeros(TINY.pool_shape(16), np.float16)
    with ZmqReceiver(TINY, dst, transport="tcp") as plain, \
            Sender(TINY, src, links=ZmqLinkFactory(certs["prefill"])) as curved, \
            Sender(TINY, src, links=ZmqLinkFactory()) as uncurved, \
            Sender(TINY, src, links=ZmqLinkFactory(certs["rogue"])) as outsider:
        assert transfer(curved, plain, "a") is TransferState.FAILED
        assert "offers no CURVE key" in curved.reason("a")
        assert transfer(uncurved, curve_receiver, "b") is TransferState.FAILED
        assert "requires CURVE" in uncurved.reason("b")
        # the rogue's own authorized directory does not hold the decode worker's key
        assert transfer(outsider, curve_receiver, "c", (5, 6)) is TransferState.FAILED
        assert "not in" in outsider.reason("c")
        assert not dst.any() and not curve_receiver.core.pool.any()


def test_refused_handshake_reveals_nothing() -> None:
    with create_shm_pool(TINY, 16) as shm, ZmqReceiver(TINY, shm, transport="shm+tcp") as receiver:
        endpoint = receiver.address.removeprefix("shm+")
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            sock, monitor = dealer(ctx, endpoint)
            sock.send(wire.encode(wire.Hello("not-the-hash", "")))
            assert sock.poll(10_000)
            raw = sock.recv()
            reply = wire.decode(raw)
            assert isinstance(reply, wire.HelloAck) and not reply.ok
            assert (reply.compat_hash, reply.max_frame_bytes, reply.shm) == ("", 0, None)
            sock.send(wire.encode(wire.Claim("t", "req", "not-the-hash", (3,))))
            assert sock.poll(10_000)
            raw_ack = sock.recv()
            for data in (raw, raw_ack):
                assert TINY.compat_hash.encode() not in data
                assert shm.descriptor.name.encode() not in data
                assert b"tiny-model" not in data
        finally:
            ctx.destroy(linger=0)  # closes every socket, also after a failed assert


def core() -> ReceiverCore:
    return ReceiverCore(TINY, np.zeros(TINY.pool_shape(64), np.float16), shm=None, grace_s=0.3,
                        max_frame_bytes=wire.DEFAULT_MAX_FRAME_BYTES, faults=FaultConfig(),
                        wake=lambda: None)


def claim(c: ReceiverCore, peer: bytes, tid: str, blocks: tuple[int, ...] = (5,)) -> None:
    c.handle(peer, wire.encode(wire.Claim(tid, "req", TINY.compat_hash, blocks)), None)


def replies_to(c: ReceiverCore, peer: bytes) -> list[wire.Message]:
    return [m for p, m in c.take_outbox() if p == peer]


def test_pending_claims_bounded_per_peer() -> None:
    c = core()
    flood = MAX_PENDING_CLAIMS + 100
    for i in range(flood):
        claim(c, b"flooder", f"f{i}")
    refused = [m for m in replies_to(c, b"flooder") if isinstance(m, wire.Ack) and not m.ok]
    assert len(refused) == flood - MAX_PENDING_CLAIMS_PER_PEER
    claim(c, b"worker", "real", (7, 8))  # arrives before its reservation, like a fast prefill
    assert replies_to(c, b"worker") == []  # held, not refused
    c.expect("real", "req", [7, 8], lease_s=20)
    assert replies_to(c, b"worker") == [wire.Grant("real", pytest.approx(c._res["real"].deadline))]
    # a claim that no reservation of this pool could match is never held
    claim(c, b"worker", "huge", tuple(range(1, 65)))
    claim(c, b"worker", "outside", (64,))
    assert [m.transfer_id for m in replies_to(c, b"worker") if isinstance(m, wire.Ack)] == ["huge", "outside"]


def test_full_claim_table_still_admits_a_new_peer() -> None:
    c = core()
    peers = [f"p{i}".encode() for i in range(MAX_PENDING_CLAIMS // MAX_PENDING_CLAIMS_PER_PEER + 2)]
    for p in peers:  # many connections, each at its quota: more than the table holds
        for i in range(MAX_PENDING_CLAIMS_PER_PEER):
            claim(c, p, f"{p.decode()}-{i}")
    c.take_outbox()
    claim(c, b"newcomer", "real", (9,))
    evicted = c.take_outbox()
    assert len(evicted) == 1 and evicted[0][0] != b"newcomer"  # one hog's oldest claim made room
    c.expect("real", "req", [9], lease_s=20)
    assert [m for p, m in c.take_outbox() if p == b"newcomer"][0] == wire.Grant(
        "real", pytest.approx(c._res["real"].deadline))


def test_shm_pool_is_owner_only_whatever_the_umask(monkeypatch: pytest.MonkeyPatch) -> None:
    # A library default or umask that would let other users map the pool changes nothing.
    monkeypatch.setattr(shared_memory.SharedMemory, "_mode", 0o666)
    old = os.umask(0)
    try:
        pool = create_shm_pool(TINY, 4, sweep=False)
    finally:
        os.umask(old)
    with pool:
        mode = stat.S_IMODE(os.stat(f"/dev/shm/{pool.descriptor.name}").st_mode)
        assert mode == 0o600, oct(mode)


def test_worker_flags_and_addresses_fail_clearly(certs: dict[str, Any], tmp_path: Path) -> None:
    from pdserve.cli.workers import kv_curve_option

    secret = str(Path(certs["dir"]) / "decode.key_secret")

    def opts(role: str, key: str | None, allowed: str | None) -> argparse.Namespace:
        return argparse.Namespace(role=role, curve_key=key, curve_authorized_keys=allowed)

    with pytest.raises(SystemExit, match="needs --curve-authorized-keys"):
        kv_curve_option(opts("decode", secret, None))
    with pytest.raises(SystemExit, match="needs --curve-key"):
        kv_curve_option(opts("prefill", None, certs["dir"]))
    with pytest.raises(SystemExit, match="not a directory"):
        kv_curve_option(opts("prefill", secret, str(tmp_path / "missing")))
    assert kv_curve_option(opts("colocated", secret, None)) is None  # no KV plane
    assert kv_curve_option(opts("decode", secret, certs["dir"])) == KVCurve(secret, certs["dir"])
    for bad in ("tcp://127.0.0.1:1?curve=abc", "tcp://127.0.0.1:1?curve=" + "zz" * 32):
        with pytest.raises(ValueError, match="malformed CURVE key"):
            split_address(bad)


def test_receiver_on_a_taken_port_fails_and_releases_its_authenticator(certs: dict[str, Any],
                                                                      curve_receiver: ZmqReceiver) -> None:
    port = int(split_address(curve_receiver.address)[0].rsplit(":", 1)[1])
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(zmq.ZMQError):
        ZmqReceiver(TINY, np.zeros(TINY.pool_shape(4), np.float16), transport="tcp", port=port,
                    curve=certs["decode"])
    assert {t.name for t in threading.enumerate()} <= before  # no authenticator left running
