"""Small typed ZeroMQ helpers for the control plane.

The gateway binds one ROUTER; every worker connects one DEALER whose identity
is its worker id. Frames are `pdserve.common.protocol` messages only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq

from pdserve.common import protocol
from pdserve.common.protocol import Message, ProtocolError

log = logging.getLogger(__name__)

# A peer that has not finished the ZeroMQ (and CURVE) handshake by then is dropped;
# libzmq's default is 30 s, long enough for a flood of half-open connections to pile up.
HANDSHAKE_IVL_MS = 5000


def limit_incoming(sock: zmq.Socket[Any], max_message_bytes: int) -> None:
    """Every socket that receives from a peer: zmq drops the connection of a peer that
    sends a frame above `max_message_bytes` before buffering it (a decoder's cap comes
    too late: the frame is already in memory), and one that stalls its handshake."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)


def host_id() -> str:
    """Identity of this machine for same-host fast paths (hostname + boot id)."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}|{boot}"


def transport_kind(kv_address: str) -> str:
    """The KV transport a receiver address names: `shm` (shared-memory copies),
    `cuda_ipc` (CUDA IPC copies), `tcp` or `ipc` (ZeroMQ frames); "" for no address."""
    scheme = kv_address.partition("://")[0] if "://" in kv_address else ""
    kind, _, _ = scheme.partition("+")
    return {"cuda": "cuda_ipc"}.get(kind, kind)


def new_worker_id(role: str) -> str:
    return f"{role}-{os.getpid()}-{secrets.token_hex(3)}"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True)
class CurveClient:
    """ZeroMQ CURVE for a worker: its own certificate (secret file, as written by
    `zmq.auth.create_certificates`) and the gateway's public certificate."""

    secret_key_file: str
    server_key_file: str


@dataclass(frozen=True)
class CurveServer:
    """ZeroMQ CURVE for the gateway: its secret certificate and a directory of the
    workers' public certificates; a worker whose key is not there cannot connect."""

    secret_key_file: str
    authorized_keys_dir: str


def apply_curve_client(sock: zmq.Socket[Any], curve: CurveClient) -> None:
    from zmq.auth import load_certificate

    public, secret = load_certificate(curve.secret_key_file)
    server_public, _ = load_certificate(curve.server_key_file)
    if secret is None:
        raise ValueError(f"{curve.secret_key_file} holds no secret key")
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, server_public


def apply_curve_server(sock: zmq.Socket[Any], curve: CurveServer) -> None:
    from zmq.auth import load_certificate

    public, secret = load_certificate(curve.secret_key_file)
    if secret is None:
        raise ValueError(f"{curve.secret_key_file} holds no secret key")
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_server = True


class ZapLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """pyzmq's authenticator reports refusals at debug level; surface them as warnings.
    `extra["plane"]` names the socket in the warning (default: the control plane).
    A refused peer reconnects every 100 ms, so only the 1st, 2nd, 4th, 8th... refusal
    is logged: a flood of them cannot flood the log."""

    def __init__(self, logger: logging.Logger, extra: Mapping[str, object] | None = None) -> None:
        super().__init__(logger, extra or {})
        self.denied = 0

    def debug(self, msg: object, *args: Any, **kwargs: Any) -> None:
        text = str(msg) % args if args else str(msg)
        if not text.startswith("DENIED"):
            self.logger.debug("%s", text)
            return
        self.denied += 1
        if self.denied & (self.denied - 1) == 0:
            plane = (self.extra or {}).get("plane", "control plane")
            self.logger.warning("%s refused a peer (%d so far): %s", plane, self.denied, text)


class WorkerChannel:
    """The worker's end of the control plane: one DEALER to the gateway's ROUTER."""

    def __init__(self, gateway_address: str, worker_id: str, curve: CurveClient | None = None,
                 lossy: bool = False) -> None:
        """`lossy`: for heartbeats -- nothing is queued while the gateway is unreachable
        (a stale backlog would arrive all at once on reconnect); a full queue drops."""
        self.worker_id = worker_id
        self.lossy = lossy
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        if curve is not None:
            apply_curve_client(self._sock, curve)
        self._sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self._sock.setsockopt(zmq.LINGER, 500)
        self._sock.setsockopt(zmq.SNDHWM, 2 if lossy else 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        limit_incoming(self._sock, protocol.MAX_MESSAGE_BYTES)
        if lossy:
            self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self._sock.connect(gateway_address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The DEALER, for polling several channels at once (`pdserve.worker.gateways`)."""
        return self._sock

    def send(self, msg: Message) -> None:
        if not self.lossy:
            self._sock.send(protocol.encode(msg), copy=False)
            return
        with contextlib.suppress(zmq.Again):
            self._sock.send(protocol.encode(msg), flags=zmq.NOBLOCK, copy=False)

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
