"""Message links between one sender and one receiver address, and the I/O-thread waker.

A link moves multipart messages: `[header]` or `[header, raw frame]`. The sender's
I/O thread owns every link; nothing here is shared between threads except `Waker`.
"""

from __future__ import annotations

import contextlib
import socket
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import zmq

from kv_transfer import auth, wire
from pdserve.common.transport import limit_incoming

Parts = list[Any]  # bytes-like frames: the msgpack header, then optionally one tensor frame
SMALL_FRAME = 64 << 10  # below this, copying into zmq is cheaper than tracking a zero-copy frame
# Unix-socket buffers default to ~200 KiB: a multi-MiB frame then takes dozens of
# write/wake-up rounds between the two zmq I/O threads. The kernel caps this at
# net.core.wmem_max / rmem_max. (TCP buffers are left to the kernel's autotuning.)
IPC_SOCKET_BUFFER_BYTES = 4 << 20


def tune_socket(sock: zmq.Socket, endpoint: str) -> None:
    """Socket options for bulk KV frames, set before bind/connect."""
    if endpoint.startswith("ipc://"):
        sock.setsockopt(zmq.SNDBUF, IPC_SOCKET_BUFFER_BYTES)
        sock.setsockopt(zmq.RCVBUF, IPC_SOCKET_BUFFER_BYTES)


class Waker:
    """Wakes an I/O thread blocked in zmq.Poller from any thread (a socketpair)."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)

    def fileno(self) -> int:
        return self._r.fileno()

    def wake(self) -> None:
        # BlockingIOError: a wake-up is already pending; OSError: closed during shutdown.
        with contextlib.suppress(BlockingIOError, OSError):
            self._w.send(b"\0")

    def drain(self) -> None:
        try:
            while self._r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        self._r.close()
        self._w.close()


class Sent(Protocol):
    """Completion of a send: `done` once the link no longer reads the frame's memory."""

    @property
    def done(self) -> bool: ...


class _Done:
    done = True


DONE: Sent = _Done()


class Link(Protocol):
    socket: zmq.Socket | None  # polled by the I/O thread when not None

    def send(self, parts: Parts) -> Sent | None:
        """Queue a message; None if it would block (retry when writable)."""
        ...

    def recv(self) -> list[memoryview] | None:
        """Next incoming message without blocking, or None."""
        ...

    def close(self) -> None: ...


class ZmqLink:
    """A DEALER connected to a receiver's ROUTER (tcp:// or ipc://)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, curve: auth.CurveKeys | None = None,
                 server_key: bytes | None = None) -> None:
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if curve is not None and server_key is not None:
            auth.apply_client(self.socket, curve, server_key)
        # Queue only on live connections: a dead receiver makes sends would-block
        # instead of growing an unbounded queue; the lease then fails the transfer.
        self.socket.setsockopt(zmq.IMMEDIATE, 1)
        # A receiver only ever answers with small control messages.
        limit_incoming(self.socket, wire.MAX_HEADER_BYTES)
        tune_socket(self.socket, endpoint)
        self.socket.connect(endpoint)

    def send(self, parts: Parts) -> Sent | None:
        big = len(parts) > 1 and memoryview(parts[1]).nbytes >= SMALL_FRAME
        try:
            if not big:
                self.socket.send_multipart(parts, flags=zmq.NOBLOCK)
                return DONE
            # Zero-copy: zmq reads the frame from our buffer until the tracker is done.
            tracker = self.socket.send_multipart(parts, flags=zmq.NOBLOCK, copy=False,
                                                 track=True)
        except zmq.Again:
            return None
        return tracker if tracker is not None else DONE

    def recv(self) -> list[memoryview] | None:
        try:
            frames = self.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return [f.buffer for f in frames]

    def close(self) -> None:
        self.socket.close(linger=0)


class LinkFactory(Protocol):
    def open(self, endpoint: str, wake: Callable[[], None]) -> Link:
        """Open a link; an in-process link calls `wake` when a message arrives."""
        ...

    def close(self) -> None: ...


class ZmqLinkFactory:
    """`curve`: this worker's keys; then links go only to receivers that advertise an
    authorized CURVE key, and without it only to receivers that advertise none."""

    def __init__(self, curve: auth.CurveKeys | None = None) -> None:
        self._ctx = zmq.Context()
        self._curve = curve

    def open(self, endpoint: str, wake: Callable[[], None]) -> Link:
        endpoint, server_key = auth.connect_options(self._curve, endpoint)
        if not endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"unsupported endpoint {endpoint!r}")
        return ZmqLink(self._ctx, endpoint, self._curve, server_key)

    def close(self) -> None:
        self._ctx.term()


class InboxLink:
    """Base for in-process links: replies are pushed into `inbox` by the peer."""

    def __init__(self) -> None:
        self.socket: zmq.Socket | None = None
        self.inbox: deque[list[memoryview]] = deque()

    def recv(self) -> list[memoryview] | None:
        return self.inbox.popleft() if self.inbox else None


class StagingBuffers:
    """Reusable flat uint8 frame buffers (I/O thread only).

    Fresh memory costs a page fault per 4 KiB, more than the copy into it, so
    frame buffers are recycled -- but only once their send is `done`.
    """

    def __init__(self, keep_per_size: int = 8,
                 alloc: Callable[[int], np.ndarray] | None = None) -> None:
        self._alloc = alloc  # e.g. pinned memory for a device pool's staging copies
        self._free: dict[int, list[np.ndarray]] = {}
        self._busy: list[tuple[np.ndarray, Sent]] = []
        self._keep = keep_per_size

    def take(self, nbytes: int) -> np.ndarray:
        self._reap()
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        return np.empty(nbytes, np.uint8) if self._alloc is None else self._alloc(nbytes)

    def give(self, buffer: np.ndarray, sent: Sent) -> None:
        self._busy.append((buffer, sent))

    def _reap(self) -> None:
        busy = []
        for buffer, sent in self._busy:
            if not sent.done:
                busy.append((buffer, sent))
                continue
            free = self._free.setdefault(buffer.nbytes, [])
            if len(free) < self._keep:
                free.append(buffer)
        self._busy = busy
