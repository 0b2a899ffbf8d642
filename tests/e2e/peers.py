"""Helpers for the hostile-peer tests (test_cluster_auth.py): the processes a `pdserve
up` started, the sockets they listen on (read from /proc, not from our own code),
and a ZeroMQ peer that reports how its handshake went."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
UNIX_ACCEPTING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's Flags


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
