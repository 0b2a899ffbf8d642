"""Decode-side receiver over ZeroMQ (tcp://, ipc://) and shared memory.

A ROUTER socket bound to loopback (or a private ipc path carrying pid + random
suffix) on a background I/O thread; all bookkeeping is in `ReceiverCore`.

transport: "tcp" / "ipc" -- tensor frames travel inline (into a device pool through
a host staging buffer, staging.py). "shm" (a pool from
`create_shm_pool`) or "cuda" (a pool from `cuda_ipc.create_cuda_pool`), each
optionally "+tcp"/"+ipc" for the control socket (default ipc): the address is
`shm+ipc://...` / `cuda+ipc://...`, and same-host senders write blocks straight
into the pool and send only control headers, which this side verifies over its
own memory.

Without CURVE the tcp socket binds to loopback unless `host` says otherwise (a
warning then says anyone who can reach it can send KV); with `curve` it is a
CURVE server that admits only authorized senders, and `address` carries its
public key (kv_transfer/auth.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
import threading

import numpy as np
import zmq

from kv_transfer import auth, wire
from kv_transfer.faults import FaultConfig
from kv_transfer.links import Waker, tune_socket
from kv_transfer.pool.copy_threads import DEFAULT_COPY_THREADS
from kv_transfer.pool.cuda_ipc import CudaPool
from kv_transfer.pool.shm import ShmPool
from kv_transfer.pool.staging import HiddenHostPool
from kv_transfer.receiver.core import CoreReceiver, ReceiverCore
from pdserve.common.hosts import is_loopback
from pdserve.common.kv_layout import KVLayout
from pdserve.common.parallel_layout import ParallelLayout
from pdserve.common.transport import limit_incoming

TRANSPORTS = ("tcp", "ipc", "shm", "shm+ipc", "shm+tcp", "cuda", "cuda+ipc", "cuda+tcp")
log = logging.getLogger(__name__)
TICK_MS = 20
MAX_MESSAGES_PER_ROUND = 256


class ZmqReceiver(CoreReceiver):
    """Implements `kv_transfer.api.KVReceiver`. Call `close()` (or use `with`)."""

    def __init__(self, layout: KVLayout, pool: np.ndarray | ShmPool | CudaPool | HiddenHostPool, *,
                 transport: str = "ipc",
                 host: str = "127.0.0.1", port: int = 0, faults: FaultConfig | None = None,
                 grace_s: float = 1.0,
                 max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
                 copy_threads: int = DEFAULT_COPY_THREADS,
                 curve: auth.CurveKeys | None = None,
                 parallel: ParallelLayout | None = None) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r} not in {TRANSPORTS}")
        kind, _, inner = transport.partition("+")
        if kind in ("shm", "cuda"):
            inner = inner or "ipc"
            wanted = ShmPool if kind == "shm" else CudaPool
            if not isinstance(pool, wanted):
                raise ValueError(f"the {kind} transport needs a pool from create_{kind}_pool()")
        else:
            kind, inner = "", transport
        array = pool.array if isinstance(pool, (ShmPool, CudaPool)) else pool
        descriptor = pool.descriptor if kind and isinstance(pool, (ShmPool, CudaPool)) else None
        self._waker = Waker()
        self.core = ReceiverCore(
            layout, array, shm=descriptor,
            grace_s=grace_s, max_frame_bytes=max_frame_bytes,
            faults=FaultConfig() if faults is None else faults, wake=self._waker.wake,
            copy_threads=copy_threads, parallel=parallel)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        # Before bind: a socket is a CURVE server from its first connection or never.
        self._auth = auth.serve(self._ctx, self._sock, curve) if curve is not None else None
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # zmq drops a connection that sends a frame above this before buffering it.
        limit_incoming(self._sock, max_frame_bytes + wire.MAX_HEADER_BYTES)
        self._ipc_path = ""
        try:
            self._bind(inner, host, port)
        except BaseException:  # e.g. a --kv-port in use: stop the authenticator and copy threads
            self._release()
            raise
        endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._address = (f"{kind}+" if kind else "") + endpoint
        if curve is not None:
            self._address = auth.advertise(self._address, curve.public)
        log_binding(endpoint, curve is not None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-receiver-io", daemon=True)
        self._thread.start()

    def _bind(self, inner: str, host: str, port: int) -> None:
        if inner == "tcp":
            self._sock.bind(f"tcp://{host}:{port}")  # port 0: ephemeral
            return
        self._ipc_path = os.path.join(
            tempfile.gettempdir(), f"pdkv-{os.getpid()}-{secrets.token_hex(6)}.sock")
        tune_socket(self._sock, "ipc://")
        self._sock.bind(f"ipc://{self._ipc_path}")

    def _release(self) -> None:
        """Everything but the I/O thread, which has stopped (or never started)."""
        self.core.close()
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
        self._waker.close()
        if self._ipc_path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ipc_path)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._waker.wake()
        self._thread.join()
        self._release()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._waker.fileno(), zmq.POLLIN)
        while not self._stop.is_set():
            poller.poll(TICK_MS)
            self._waker.drain()
            for _ in range(MAX_MESSAGES_PER_ROUND):
                try:
                    frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if len(frames) not in (2, 3):
                    self.core.note_malformed()
                    continue
                frame = frames[2].buffer if len(frames) == 3 else None
                try:
                    self.core.handle(frames[0].bytes, frames[1].buffer, frame)
                except Exception:  # a bug must not kill the I/O thread: leases still run
                    log.exception("kv receiver: message handling failed")
            self.core.tick()
            self._send_replies()

    def _send_replies(self) -> None:
        for peer, msg in self.core.take_outbox():
            # Peer gone or congested: it fails the transfer at its own deadline.
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send_multipart([peer, wire.encode(msg)], flags=zmq.NOBLOCK)


def log_binding(endpoint: str, curve: bool) -> None:
    """Say where the receiver listens; warn when it is reachable off-host without CURVE."""
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    exposed = endpoint.startswith("tcp://") and not is_loopback(host)
    if exposed and not curve:
        log.warning("KV receiver bound to %s without CURVE: any host that can reach it can "
                    "send KV (set --curve-key, or keep --kv-host on a private network)", endpoint)
    else:
        log.info("KV receiver bound to %s (CURVE %s)", endpoint, "on" if curve else "off")
