"""Small typed ZeroMQ helpers for the control plane.

The gateway binds one ROUTER; every worker connects one DEALER whose identity
is its worker id. Frames are `pdserve.protocol` messages only.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import uuid

import zmq

from pdserve import protocol
from pdserve.protocol import Message, ProtocolError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free right now on `host` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def host_id() -> str:
    """Identity of this machine for same-host fast paths (hostname + boot id)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}|{boot}"


def new_worker_id(role: str) -> str:
    return f"{role}-{os.getpid()}-{secrets.token_hex(3)}"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


class WorkerChannel:
    """The worker's end of the control plane: one DEALER to the gateway's ROUTER."""

    def __init__(self, gateway_address: str, worker_id: str) -> None:
        self.worker_id = worker_id
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self._sock.setsockopt(zmq.LINGER, 500)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(gateway_address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def send(self, msg: Message) -> None:
        self._sock.send(protocol.encode(msg), copy=False)

    def wait(self, timeout_ms: int) -> bool:
        """Block up to `timeout_ms` for an incoming message; True if one is ready."""
        return bool(self._poller.poll(timeout_ms))

    def recv_all(self) -> list[Message]:
        """Every message ready now; malformed frames are logged and dropped."""
        out: list[Message] = []
        while True:
            try:
                frame = self._sock.recv(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return out
            try:
                out.append(protocol.decode(frame))
            except ProtocolError as e:
                log.warning("dropped malformed control frame: %s", e)

    def close(self) -> None:
        self._sock.close(linger=500)
