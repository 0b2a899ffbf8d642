"""Helpers for the hostile-peer tests (test_cluster_auth.py): the processes a `pdserve
up` started, the sockets they listen on (read from /proc, not from our own code),
and a ZeroMQ peer that reports how its handshake went."""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from pdserve.common import protocol as p
from tests.e2e.cluster import wait_for

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
UNIX_ACCEPTING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's Flags
HUGE = 1 << 20


def children(pid: int) -> list[int]:
    """Every live descendant of `pid`."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def environ(pid: int) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    out.add(int(target[8:-1]))
    return out


@dataclass(frozen=True)
class Listening:
    tcp_ports: frozenset[int]
    unix_paths: frozenset[str]


def listening(pids: list[int]) -> Listening:
    """The TCP ports and unix socket paths `pids` accept connections on."""
    inodes = set().union(*(_socket_inodes(p) for p in pids))
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[9]) in inodes:  # LISTEN
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    paths = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        cols = line.split()
        if len(cols) >= 8 and int(cols[3], 16) & UNIX_ACCEPTING and int(cols[6]) in inodes:
            paths.add(cols[7])
    return Listening(frozenset(ports), frozenset(paths))


def rss_peak_bytes(pid: int) -> int:
    """VmHWM: the most resident memory the process ever had."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


class Peer:
    """A plain ZeroMQ DEALER (or a CURVE client with keys nobody authorized) watching
    its own connection events."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, identity: bytes | None = None,
                 curve: tuple[bytes, bytes, bytes] | None = None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        if curve is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = curve
        self.monitor = self.sock.get_monitor_socket()
        self.events: list[int] = []
        self.sock.connect(endpoint)

    def send(self, *parts: bytes) -> None:
        with contextlib.suppress(zmq.Again):  # not connected (refused): nothing to queue into
            self.sock.send_multipart(list(parts), flags=zmq.NOBLOCK)

    def pump_events(self, timeout_ms: int = 0) -> list[int]:
        while self.monitor.poll(timeout_ms):
            self.events.append(recv_monitor_message(self.monitor)["event"])
            timeout_ms = 0
        return self.events

    def received(self) -> list[list[bytes]]:
        out = []
        while self.sock.poll(0):
            out.append(self.sock.recv_multipart())
        return out

    def handshake_failed(self) -> bool:
        return any(e & HANDSHAKE_FAILED for e in self.pump_events())

    def handshake_succeeded(self) -> bool:
        return zmq.EVENT_HANDSHAKE_SUCCEEDED in self.pump_events()


def rogue_curve(server_public_file: str) -> tuple[bytes, bytes, bytes]:
    """A fresh key pair nobody authorized, aimed at the real server's public key."""
    public, secret = zmq.curve_keypair()
    server, _ = zmq.auth.load_certificate(server_public_file)
    return public, secret, server


class FakeWorkers:
    """The fake-worker attack: a decode and a prefill "worker" that register with the
    real compatibility hash and a huge free-block count and heartbeat as an eager,
    empty worker would (the router's first choice) -- once over a plain DEALER, once
    with a CURVE key nobody authorized aimed at the gateway's real public key."""

    def __init__(self, control: str, compat_hash: str, block_size: int, gateway_public_file: str) -> None:
        self._ctx: zmq.Context[Any] = zmq.Context()
        self.peers: list[Peer] = []
        for n, curve in enumerate((None, rogue_curve(gateway_public_file))):
            for role in ("decode", "prefill"):
                wid = f"{role}-evil-{n}"
                peer = Peer(self._ctx, control, wid.encode(), curve)
                peer.send(p.encode(p.RegisterWorker(
                    worker_id=wid, role=p.Role(role), host_id="evil",
                    kv_address="tcp://127.0.0.1:9" if role == "decode" else "", kv_shm="",
                    compat_hash=compat_hash, total_blocks=HUGE, block_size=block_size,
                    metrics_port=1, pid=1)))
                self.peers.append(peer)
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(0.2):
            for peer in self.peers:
                wid = peer.sock.getsockopt(zmq.IDENTITY).decode()
                peer.send(p.encode(p.Heartbeat(wid, 0, HUGE, HUGE, 0, 0)))

    def wait_refused(self, timeout_s: float = 30.0) -> None:
        wait_for(lambda: all(f.handshake_failed() for f in self.peers), lambda: [f.events for f in self.peers],
                 timeout_s)

    def assert_got_nothing(self) -> None:
        for f in self.peers:
            assert not f.handshake_succeeded(), f.events
            assert f.received() == []  # not a RegisterAck, not a token

    def close(self) -> None:
        self._stop.set()
        self._beat.join(5)
        self._ctx.destroy(linger=0)
